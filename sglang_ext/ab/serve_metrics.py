"""Agreement metrics between two arms' completions of the same prompt (greedy pass), and
pass@1 statistics (accuracy pass). Pure Python, no tensors.

Definitions (also written into every report):
- first divergence d: the first token position where the two generated token sequences differ;
  if one is a prefix of the other, d = the shorter length; None when identical.
- aligned positions: 0..d inclusive (0..n-1 when identical). Up to and including d both arms
  saw the same context, so their next-token distributions are comparable; after d they are not.
- top-1 agreement: share of aligned positions where both arms' most likely returned token
  (argmax of top_logprobs, falling back to the generated token) is the same.
- |delta logprob|: at an aligned position, |lp_A(t) - lp_B(t)| for A's generated token t, with
  lp_B(t) looked up in B's top_logprobs; positions where t is not among B's top-k are skipped
  (counted as `dlogprob_missing`). Reported as its mean and its maximum over those positions.
- top-k KL(A||B): KL between coarse-grained distributions over S = A's returned top-k tokens plus
  one "rest" bucket: p_rest = 1 - sum_S p_A, q_rest = 1 - sum_S q_B. Tokens of S absent from B's
  top-k get q = B's smallest returned probability (an upper bound of their true value).
  With exact q this is a lower bound of the full-vocabulary KL (data-processing inequality).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from .client import TokenLogprob

_Q_FLOOR = 1e-12  # keeps log(q) finite when B's top-k already covers all mass


@dataclass
class TokenAgreement:
    """Token-level agreement of one prompt between arm A (baseline) and arm B."""

    n_tokens_a: int
    n_tokens_b: int
    first_divergence: int | None
    aligned: int
    top1_agree: int
    dlogprob_sum: float
    dlogprob_n: int
    dlogprob_missing: int
    kl_sum: float
    kl_n: int
    dlogprob_max: float = 0.0


def _top1(t: TokenLogprob) -> str:
    return max(t.top.items(), key=lambda kv: kv[1])[0] if t.top else t.token


def first_divergence(a: list[str], b: list[str]) -> int | None:
    """First index where the token sequences differ; len(shorter) if one is a prefix; None if equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def topk_kl(p_top: dict[str, float], q_top: dict[str, float]) -> float:
    """Approximate KL(P||Q) in nats from two top-k logprob dicts (see module docstring)."""
    if not p_top:
        return 0.0
    q_min = min(q_top.values()) if q_top else math.log(_Q_FLOOR)
    kl, p_s, q_s = 0.0, 0.0, 0.0
    for tok, lp in p_top.items():
        lq = q_top.get(tok, q_min)
        p = math.exp(lp)
        kl += p * (lp - lq)
        p_s += p
        q_s += math.exp(lq)
    p_rest = max(0.0, 1.0 - p_s)
    q_rest = max(_Q_FLOOR, 1.0 - q_s)
    if p_rest > 0.0:
        kl += p_rest * math.log(p_rest / q_rest)
    return max(kl, 0.0)


def token_agreement(a: list[TokenLogprob], b: list[TokenLogprob]) -> TokenAgreement:
    """Compare two greedy token streams with logprobs (A = baseline arm)."""
    d = first_divergence([t.token for t in a], [t.token for t in b])
    n_aligned = min(len(a), len(b)) if d is None else min(d + 1, len(a), len(b))
    agree = 0
    dsum, dn, dmiss, dmax = 0.0, 0, 0, 0.0
    ksum, kn = 0.0, 0
    for i in range(n_aligned):
        ta, tb = a[i], b[i]
        agree += _top1(ta) == _top1(tb)
        lq = tb.logprob if tb.token == ta.token else tb.top.get(ta.token)
        if lq is None:
            dmiss += 1
        else:
            dsum += abs(ta.logprob - lq)
            dmax = max(dmax, abs(ta.logprob - lq))
            dn += 1
        if ta.top:
            ksum += topk_kl(ta.top, tb.top)
            kn += 1
    return TokenAgreement(len(a), len(b), d, n_aligned, agree, dsum, dn, dmiss, ksum, kn, dmax)


def summarize_agreements(items: list[TokenAgreement]) -> dict:
    """Pool per-prompt agreements: rates are over all aligned positions of all prompts."""
    aligned = sum(x.aligned for x in items)
    dn = sum(x.dlogprob_n for x in items)
    kn = sum(x.kl_n for x in items)
    divs = [x.first_divergence for x in items if x.first_divergence is not None]
    return {
        "prompts": len(items),
        "identical_token_streams": sum(x.first_divergence is None for x in items),
        "first_divergence_positions": divs,
        "median_first_divergence": statistics.median(divs) if divs else None,
        "aligned_positions": aligned,
        "top1_agreement": (sum(x.top1_agree for x in items) / aligned) if aligned else None,
        "mean_abs_dlogprob": (sum(x.dlogprob_sum for x in items) / dn) if dn else None,
        "max_abs_dlogprob": max(x.dlogprob_max for x in items) if dn else None,
        "dlogprob_missing": sum(x.dlogprob_missing for x in items),
        "mean_topk_kl": (sum(x.kl_sum for x in items) / kn) if kn else None,
    }


def pass_at_1(per_seed_accuracy: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof=1; 0 for one seed) of per-seed accuracies."""
    if not per_seed_accuracy:
        return float("nan"), float("nan")
    mean = statistics.fmean(per_seed_accuracy)
    std = statistics.stdev(per_seed_accuracy) if len(per_seed_accuracy) > 1 else 0.0
    return mean, std
