"""Accuracy statistics of the serve A/B: per arm, and paired between two arms.

Inputs are per (question, seed) grades: ``correct`` float [Q, N] in {0, 1} (Q graded
questions, N seeds; each grade is grading.grade's, by grading.GRADING_RULE: the extracted answer
against the gold one whatever the finish_reason, 0 without an answer), the extracted answers
[Q][N] (str or None) and ``truncated`` bool [Q, N]. Seed 0 is the greedy request.

Per arm (NeMo-Skills' definitions, nemo_skills/evaluation/metrics/base.py, which the model
card's harness computes):
- per-seed accuracy acc_s = mean over questions of correct[:, s];
- pass@1[avg-of-N] = mean over the N seeds of acc_s;
- std over seeds = sample std of acc_s (ddof=1); SEM = std / sqrt(N) (NeMo-Skills'
  ``std_err_across_runs``); None for one seed;
- majority@N: per question, the most common answer among its N requests that have one (all
  None: scores 0); a tie between answers scores the mean correctness of the tied answers
  (NeMo-Skills' rule); mean over questions;
- truncated rate: share of the Q x N requests with finish_reason "length";
- empty-answer rate: share of the Q x N requests without an extractable answer (truncated ones
  included: the two rates overlap).

Between arm A (baseline) and arm B, on the same questions and seeds:
- difference = pass@1_B - pass@1_A in percentage points;
- paired standard error over questions: d_q = mean_s correct_B[q, s] - mean_s correct_A[q, s],
  SE = sample std of d_q (ddof=1) / sqrt(Q). Var(mean d) over questions is the seed noise
  plus the spread of the per-question effects, so it is valid for any N (also one greedy seed)
  and never smaller than the seed-only error of a paired design; sigmas = difference / SE;
- the unpaired error of the published style, sqrt(SEM_A^2 + SEM_B^2) (N >= 2), for comparison
  with figures such as "87.63% (SEM 0.29) vs 86.81% (SEM 0.40), -0.82 pp (1.7 sigma)";
- 95% bootstrap interval over questions: questions resampled with replacement (each keeping its
  N seeds: d_q), the mean of d over each resample, percentile interval (scipy.stats.bootstrap,
  method "percentile", a numpy Generator seeded with the recorded seed);
- McNemar counts on seed 0 (the greedy requests): questions A gets right and B misses, and the
  reverse; exact two-sided McNemar p-value = binomial test of B-only among the discordant
  questions against p = 1/2 (scipy.stats.binomtest); 1 when there are none;
- the verdict claims a difference only when the 95% interval excludes 0.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np

CONFIDENCE = 0.95


@dataclass
class ArmAccuracy:
    """pass@1[avg-of-N] and its companions for one arm (fractions, not percent)."""

    questions: int
    seeds: int
    pass_at_1: float
    per_seed: list[float]
    std_over_seeds: float | None
    sem: float | None
    majority: float
    truncated_rate: float
    empty_answer_rate: float

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class McNemar:
    """Discordant and concordant questions of one seed (0: greedy) between arms A and B."""

    seed: int
    a_only: int  # A right, B wrong
    b_only: int  # B right, A wrong
    both: int
    neither: int
    p_value: float  # exact two-sided McNemar (binomial) p-value


@dataclass
class PairedComparison:
    """B against A on the same questions and seeds; differences in percentage points (B - A)."""

    arm_a: str
    arm_b: str
    questions: int
    seeds: int
    pass_at_1_a: float
    pass_at_1_b: float
    diff_pp: float
    se_pp: float | None
    sigmas: float | None
    unpaired_se_pp: float | None
    unpaired_sigmas: float | None
    ci95_pp: tuple[float, float] | None
    bootstrap: dict
    mcnemar: McNemar
    verdict: str

    def to_dict(self) -> dict:
        return asdict(self)


def _grid(x, name: str) -> np.ndarray:
    a = np.asarray(x, dtype=np.float64)
    if a.ndim != 2 or a.shape[0] < 1 or a.shape[1] < 1:
        raise ValueError(f"{name}: expected a [questions, seeds] array, got shape {a.shape}")
    return a


def majority_at_n(answers: Sequence[Sequence[str | None]], gold: Sequence[str]) -> float:
    """majority@N over questions: answers[q] are question q's N extracted answers (None: none),
    gold[q] its gold answer; see the module docstring for ties and unanswered questions."""
    if len(answers) != len(gold) or not answers:
        raise ValueError(f"majority_at_n: {len(answers)} answer lists for {len(gold)} gold answers")
    total = 0.0
    for ans, g in zip(answers, gold):
        counts = Counter(a for a in ans if a is not None)
        if not counts:
            continue
        top = max(counts.values())
        tied = [a for a, c in counts.items() if c == top]
        total += sum(a == g for a in tied) / len(tied)
    return total / len(answers)


def arm_accuracy(correct, answers: Sequence[Sequence[str | None]], gold: Sequence[str], truncated) -> ArmAccuracy:
    """Statistics of one arm from correct [Q, N] (0/1), answers [Q][N], gold [Q], truncated [Q, N]."""
    c = _grid(correct, "correct")
    t = _grid(truncated, "truncated")
    q, n = c.shape
    per_seed = c.mean(axis=0)
    std = float(np.std(per_seed, ddof=1)) if n > 1 else None
    empty = sum(a is None for row in answers for a in row) / (q * n)
    return ArmAccuracy(q, n, float(per_seed.mean()), [float(x) for x in per_seed], std,
                       None if std is None else std / math.sqrt(n), majority_at_n(answers, gold),
                       float(t.mean()), empty)


def mcnemar(correct_a, correct_b, seed: int = 0) -> McNemar:
    """Exact McNemar test on one seed's column of two [Q, N] grade arrays."""
    from scipy.stats import binomtest

    a, b = _grid(correct_a, "correct_a")[:, seed] > 0.5, _grid(correct_b, "correct_b")[:, seed] > 0.5
    a_only, b_only = int(np.sum(a & ~b)), int(np.sum(~a & b))
    p = binomtest(b_only, a_only + b_only, 0.5).pvalue if a_only + b_only else 1.0
    return McNemar(seed, a_only, b_only, int(np.sum(a & b)), int(np.sum(~a & ~b)), float(p))


def bootstrap_ci(values, *, resamples: int, seed: int, level: float = CONFIDENCE) -> tuple[float, float] | None:
    """Percentile bootstrap interval of the mean of ``values`` [Q] (resampled with replacement,
    numpy Generator seeded with ``seed``); None for fewer than 2 values."""
    from scipy.stats import bootstrap

    v = np.asarray(values, dtype=np.float64)
    if v.size < 2:
        return None
    res = bootstrap((v,), np.mean, n_resamples=resamples, confidence_level=level, method="percentile",
                    vectorized=True, rng=np.random.default_rng(seed))
    return float(res.confidence_interval.low), float(res.confidence_interval.high)


def _sigmas(diff: float, se: float | None) -> float | None:
    if se is None or (se == 0 and diff == 0):
        return None
    return math.copysign(math.inf, diff) if se == 0 else diff / se


def verdict(arm_a: str, arm_b: str, diff_pp: float, ci_pp: tuple[float, float] | None, sigmas: float | None) -> str:
    """One line that claims a difference only when the 95% interval excludes 0."""
    if ci_pp is None:
        return f"no difference resolved: {diff_pp:+.2f} pp ({arm_b} - {arm_a}), no interval from one question"
    lo, hi = ci_pp
    ci = f"95% CI [{lo:+.2f}, {hi:+.2f}]"
    if lo > 0 or hi < 0:
        word = "better" if lo > 0 else "worse"
        sig = "" if sigmas is None else f" ({abs(sigmas):.1f} sigma)"
        return f"{arm_b} is {word} than {arm_a}: {diff_pp:+.2f} pp, {ci}{sig}"
    return f"no difference resolved between {arm_b} and {arm_a}: {diff_pp:+.2f} pp, {ci}"


def compare(arm_a: str, arm_b: str, correct_a, correct_b, sem_a: float | None, sem_b: float | None, *,
            resamples: int = 10000, seed: int = 0) -> PairedComparison:
    """Paired comparison of B against A from their [Q, N] grades on the same questions and seeds."""
    a, b = _grid(correct_a, "correct_a"), _grid(correct_b, "correct_b")
    if a.shape != b.shape:
        raise ValueError(f"compare: {arm_a} has grades {a.shape}, {arm_b} has {b.shape}")
    q, n = a.shape
    d = b.mean(axis=1) - a.mean(axis=1)  # per-question difference, mean over seeds
    diff = 100 * float(d.mean())
    se = 100 * float(np.std(d, ddof=1)) / math.sqrt(q) if q > 1 else None
    sig = _sigmas(diff, se)
    unpaired = 100 * math.hypot(sem_a, sem_b) if sem_a is not None and sem_b is not None else None
    ci = bootstrap_ci(d, resamples=resamples, seed=seed)
    ci_pp = None if ci is None else (100 * ci[0], 100 * ci[1])
    return PairedComparison(
        arm_a, arm_b, q, n, float(a.mean()), float(b.mean()), diff, se, sig, unpaired, _sigmas(diff, unpaired), ci_pp,
        {"resamples": resamples, "seed": seed, "method": "percentile", "confidence_level": CONFIDENCE,
         "unit": "question (its N seeds kept together)"},
        mcnemar(a, b, 0), verdict(arm_a, arm_b, diff, ci_pp, sig))
