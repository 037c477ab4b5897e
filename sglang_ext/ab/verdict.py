"""The serve A/B's verdict: do two arms' greedy streams agree up to rounding?

Two correct implementations of the same model (marlin and triton_situ on a GPU node, or
torch_reference and triton_situ on CPU) differ only in the order of their sums and in where
they round to the model dtype. The verdict checks the greedy pass (seed 0) against one bound
``bound`` (nats) on the logprob difference such rounding may cause:

1. Logprobs: at every aligned position (0..first divergence inclusive, where both arms saw the
   same context; see serve_metrics), |lp_A(t) - lp_B(t)| <= bound for arm A's token t. A
   position where B did not return t among its top logprobs counts as beyond the bound (B put t
   below its whole top-k list, which rounding does not do to a token A chose).
2. Tokens: the streams are identical, or they part at a near tie: at the first divergence d,
   A's margin between its own token and B's token, lp_A(t_A) - lp_A(t_B), is at most
   2 * bound. Within that margin a change of each logprob by ``bound`` can swap the two tokens,
   so rounding explains the swap; a larger margin, B's token missing from A's top logprobs, or
   one stream ending where the other goes on (nothing to compare a margin with) does not.
   After d the contexts differ and nothing more is compared.

``agree``: every prompt compared (logprobs on both arms) passes both rules; ``diverge``: one
fails; ``undecided``: no prompt could be compared (no logprobs), which is not agreement.

The default bound (DEFAULT_BOUND_NATS) comes from bf16 rounding of the logits: SGLang's
lm_head runs in the model dtype, bf16 on GPUs, whose numbers in [2^e, 2^(e+1)) are 2^(e-7)
apart. Two arms whose hidden states differ by rounding move a logit by about one such step;
a logprob, z_t - logsumexp(z), moves by at most twice the largest logit change. For logits
below 32 in magnitude (LOGIT_MAGNITUDE) the step is at most 2^(4-7) = 1/8, so the bound is
1/4 nats. :func:`rounding_bound` gives the same figure for other dtypes and magnitudes (an fp16
CPU server with logits below 8: 2 * 2^(2-10) = 2^-7). ``k3nvfp4-ab serve --dlogprob-bound``
overrides it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Sequence

from .client import TokenLogprob
from .report import fmt, markdown_table
from .serve_metrics import first_divergence

BF16_MANTISSA_BITS = 7
FP16_MANTISSA_BITS = 10
LOGIT_MAGNITUDE = 32.0  # logits below this magnitude: the bf16 step is at most 2^(4-7)


def rounding_bound(mantissa_bits: int = BF16_MANTISSA_BITS, logit_magnitude: float = LOGIT_MAGNITUDE) -> float:
    """Bound (nats) on a logprob change caused by one rounding step of every logit below
    ``logit_magnitude`` in a float format with ``mantissa_bits`` stored mantissa bits: twice
    the largest step, 2 * 2^(ceil(log2 M) - 1 - mantissa_bits)."""
    if logit_magnitude <= 0 or mantissa_bits < 0:
        raise ValueError(f"rounding_bound: need logit_magnitude > 0 and mantissa_bits >= 0, got "
                         f"{logit_magnitude}, {mantissa_bits}")
    return 2.0 * 2.0 ** (math.ceil(math.log2(logit_magnitude)) - 1 - mantissa_bits)


DEFAULT_BOUND_NATS = rounding_bound()  # 0.25

RULE = ("agree when, for every prompt with logprobs on both arms, |lp_A(t) - lp_B(t)| <= bound at every aligned "
        "position (A's token t missing from B's top logprobs counts as beyond), and the greedy streams are "
        "identical or first differ where A's margin lp_A(t_A) - lp_A(t_B) <= 2 * bound (a near tie rounding can "
        "swap); undecided when no prompt has logprobs on both arms")

IDENTICAL, NEAR_TIE, DIVERGENT, BEYOND_BOUND, NO_LOGPROBS = (
    "identical", "near_tie", "divergent", "beyond_bound", "no_logprobs")


@dataclass
class PromptVerdict:
    """One prompt's greedy streams judged against the bound.

    status: identical | near_tie (they part where rounding can swap the tokens) | divergent (they
    part elsewhere) | beyond_bound (a logprob differs by more than the bound before or at the
    first divergence; checked first) | no_logprobs (an arm returned none: not compared)."""

    id: str
    status: str
    first_divergence: int | None = None
    margin: float | None = None  # lp_A(t_A) - lp_A(t_B) at the first divergence (None: not in A's top-k)
    max_abs_dlogprob: float | None = None  # over aligned positions where B returned A's token
    worst_position: int | None = None  # where the largest |delta logprob| (or a missing token) is
    missing_positions: list[int] = field(default_factory=list)  # A's token absent from B's top logprobs


@dataclass
class Verdict:
    """The A/B's decision (``verdict``) with the counts it rests on."""

    verdict: str  # agree | diverge | undecided
    bound_nats: float
    rule: str
    prompts: int
    compared: int
    identical: int
    near_tie: int
    divergent: list[str]  # prompt ids
    beyond_bound: list[str]
    no_logprobs: list[str]
    max_abs_dlogprob: float | None
    per_prompt: list[PromptVerdict]

    @property
    def agree(self) -> bool:
        return self.verdict == "agree"

    def to_dict(self) -> dict:
        return asdict(self)


def judge_prompt(pid: str, a: Sequence[TokenLogprob] | None, b: Sequence[TokenLogprob] | None,
                 bound: float) -> PromptVerdict:
    """Judge one prompt's greedy streams (A = the baseline arm) against ``bound`` nats."""
    if a is None or b is None:
        return PromptVerdict(pid, NO_LOGPROBS)
    d = first_divergence([t.token for t in a], [t.token for t in b])
    aligned = min(len(a), len(b)) if d is None else min(d + 1, len(a), len(b))
    worst, worst_pos, missing = None, None, []
    for i in range(aligned):
        ta, tb = a[i], b[i]
        lq = tb.logprob if tb.token == ta.token else tb.top.get(ta.token)
        if lq is None:
            missing.append(i)
            continue
        diff = abs(ta.logprob - lq)
        if worst is None or diff > worst:
            worst, worst_pos = diff, i
    if missing:
        worst_pos = missing[0] if worst is None or worst <= bound else worst_pos
    margin = None
    if d is not None and d < min(len(a), len(b)):
        lp_b_token = a[d].top.get(b[d].token)
        margin = None if lp_b_token is None else a[d].logprob - lp_b_token
    if missing or (worst is not None and worst > bound):
        status = BEYOND_BOUND
    elif d is None:
        status = IDENTICAL
    elif margin is not None and margin <= 2 * bound:
        status = NEAR_TIE
    else:
        status = DIVERGENT
    return PromptVerdict(pid, status, d, margin, worst, worst_pos, missing)


def decide(streams: Sequence[tuple[str, Sequence[TokenLogprob] | None, Sequence[TokenLogprob] | None]],
           bound: float = DEFAULT_BOUND_NATS) -> Verdict:
    """The verdict over ``streams``: (prompt id, arm A's greedy tokens, arm B's), token lists as
    the client parses them (None: the arm returned no logprobs). ``bound`` in nats, > 0."""
    if not (bound > 0 and math.isfinite(bound)):
        raise ValueError(f"the logprob bound must be a positive number of nats, got {bound}")
    rows = [judge_prompt(pid, a, b, bound) for pid, a, b in streams]
    by = {s: [r.id for r in rows if r.status == s] for s in (IDENTICAL, NEAR_TIE, DIVERGENT, BEYOND_BOUND, NO_LOGPROBS)}
    compared = len(rows) - len(by[NO_LOGPROBS])
    worst = [r.max_abs_dlogprob for r in rows if r.max_abs_dlogprob is not None]
    if compared == 0:
        verdict = "undecided"
    elif by[DIVERGENT] or by[BEYOND_BOUND]:
        verdict = "diverge"
    else:
        verdict = "agree"
    return Verdict(verdict, bound, RULE, len(rows), compared, len(by[IDENTICAL]), len(by[NEAR_TIE]), by[DIVERGENT],
                   by[BEYOND_BOUND], by[NO_LOGPROBS], max(worst) if worst else None, rows)


def _beyond_and_parted(d: dict) -> int:
    """Prompts beyond the bound whose streams also part. The statuses are exclusive and the bound
    is checked first, so without this count "0 divergent" reads as if no stream had parted."""
    return sum(1 for r in d["per_prompt"] if r["status"] == BEYOND_BOUND and r["first_divergence"] is not None)


def verdict_line(v: Verdict | dict) -> str:
    """One line: the verdict, the bound and what it rests on (printed by the CLI)."""
    d = v.to_dict() if isinstance(v, Verdict) else v
    parted = _beyond_and_parted(d)
    parts = [f"{d['identical']} identical", f"{d['near_tie']} parted at a near tie",
             f"{len(d['divergent'])} divergent", f"{len(d['beyond_bound'])} beyond the bound"
             + (f" ({parted} of which also parted)" if parted else "")]
    if d["no_logprobs"]:
        parts.append(f"{len(d['no_logprobs'])} without logprobs")
    return (f"verdict: {d['verdict']} (bound {d['bound_nats']:.4g} nats; {d['compared']} of {d['prompts']} prompts "
            f"compared: {', '.join(parts)}; max |delta logprob| {fmt(d['max_abs_dlogprob'], '.3g')})")


def verdict_markdown(v: Verdict | dict) -> str:
    """The summary.md section of the verdict."""
    d = v.to_dict() if isinstance(v, Verdict) else v
    lines = ["## Agreement verdict (greedy pass)", "", f"**Verdict: {d['verdict']}** "
             f"(bound {d['bound_nats']:.4g} nats)", "", f"Rule: {d['rule']}.", ""]
    flagged = [r for r in d["per_prompt"] if r["status"] in (DIVERGENT, BEYOND_BOUND, NEAR_TIE)]
    lines.append(markdown_table(["metric", "value"], [
        ["prompts compared", f"{d['compared']}/{d['prompts']}"],
        ["identical streams", d["identical"]],
        ["parted at a near tie", d["near_tie"]],
        ["divergent (parted, not at a near tie; logprobs within the bound)", len(d["divergent"])],
        ["logprob beyond the bound (checked first)", len(d["beyond_bound"])],
        ["of those beyond the bound: streams also parted", _beyond_and_parted(d)],
        ["max abs delta logprob (aligned positions)", fmt(d["max_abs_dlogprob"], ".3g")],
    ]))
    if flagged:
        lines += ["", markdown_table(["prompt", "status", "first divergence", "margin (nats)", "max abs delta logprob",
                                      "at position", "A's token missing from B's top-k at"],
                                     [[r["id"], r["status"], r["first_divergence"], fmt(r["margin"], ".3g"),
                                       fmt(r["max_abs_dlogprob"], ".3g"), r["worst_position"],
                                       ", ".join(map(str, r["missing_positions"])) or "–"] for r in flagged[:20]])]
        if len(flagged) > 20:
            lines.append(f"({len(flagged) - 20} more in report.json `verdict.per_prompt`)")
    return "\n".join(lines) + "\n"
