"""The serve A/B's statistics (sglang_ext/ab/stats.py, speed.py) against values worked by hand
in the comments, and against scipy where scipy computes the same quantity another way."""

from __future__ import annotations

import math

import numpy as np
import pytest
import scipy.stats

from k3nvfp4.sglang_ext.ab.speed import arm_speed
from k3nvfp4.sglang_ext.ab.stats import arm_accuracy, bootstrap_ci, compare, majority_at_n, mcnemar, verdict

# Arm A, 4 questions x 3 seeds (gold "A" everywhere). Rows are questions, columns seeds.
A_ANSWERS = [["A", "A", "A"],   # q1: right 3/3
             ["A", "B", "A"],   # q2: right 2/3
             ["B", "C", "A"],   # q3: right 1/3, a three-way tie
             [None, None, "B"]]  # q4: seeds 0 and 1 truncated without an answer, seed 2 wrong
A = [[float(x == "A") for x in row] for row in A_ANSWERS]
A_TRUNC = [[False] * 3, [False] * 3, [False] * 3, [True, True, False]]
# Arm B on the same questions and seeds.
B = [[1, 1, 1],
     [0, 0, 1],
     [0, 0, 0],
     [0, 0, 0]]


def test_arm_accuracy_by_hand():
    st = arm_accuracy(A, A_ANSWERS, ["A"] * 4, A_TRUNC)
    # Per-seed accuracy over the 4 questions: seed 0 {q1, q2} 2/4, seed 1 {q1} 1/4, seed 2 {q1, q2, q3} 3/4.
    assert st.per_seed == [0.5, 0.25, 0.75] and st.pass_at_1 == pytest.approx(0.5)
    # Sample std of (0.5, 0.25, 0.75): deviations (0, -1/4, 1/4), sum of squares 1/8, / (3 - 1) = 1/16 -> 1/4.
    assert st.std_over_seeds == pytest.approx(0.25) and st.sem == pytest.approx(0.25 / math.sqrt(3))
    assert st.sem == pytest.approx(float(scipy.stats.sem(st.per_seed)))  # scipy's SEM of the per-seed accuracies
    # majority@3: q1 A (1), q2 A 2:1 (1), q3 tie B/C/A -> 1/3, q4 only B answered (0): (1 + 1 + 1/3) / 4.
    assert st.majority == pytest.approx(7 / 12)
    # 2 of 12 requests truncated, the same 2 without an answer.
    assert st.truncated_rate == pytest.approx(2 / 12) and st.empty_answer_rate == pytest.approx(2 / 12)
    assert (st.questions, st.seeds) == (4, 3)


def test_one_seed_has_no_sem():
    st = arm_accuracy([[1.0], [0.0]], [["A"], ["B"]], ["A", "A"], [[False], [False]])
    assert st.pass_at_1 == 0.5 and st.std_over_seeds is None and st.sem is None and st.majority == 0.5


def test_majority_ties_and_unanswered():
    # q1: B twice beats A once -> wrong (0); q2: A/B tie -> 1/2; q3: nothing answered -> 0; q4: C once -> right.
    answers = [["A", "B", "B"], ["A", "B", None], [None, None, None], [None, "C", None]]
    assert majority_at_n(answers, ["A", "A", "A", "C"]) == pytest.approx((0 + 0.5 + 0 + 1) / 4)


def test_paired_comparison_by_hand():
    sem_a = arm_accuracy(A, A_ANSWERS, ["A"] * 4, A_TRUNC).sem
    # B per seed (1/4, 1/4, 1/2): deviations (-1/12, -1/12, 1/6), ss 1/24, / 2 -> std 1/sqrt(48); / sqrt(3) -> 1/12.
    sem_b = 1 / 12
    c = compare("a", "b", A, B, sem_a, sem_b, resamples=10000, seed=7)
    # d_q = mean_s B - mean_s A = (0, 1/3 - 2/3, 0 - 1/3, 0) = (0, -1/3, -1/3, 0); mean -1/6.
    assert c.diff_pp == pytest.approx(-100 / 6)
    # std(d, ddof=1): deviations +-1/6, ss 4/36, / 3 = 1/27; SE = sqrt(1/27) / sqrt(4) = 0.0962250...
    assert c.se_pp == pytest.approx(100 * math.sqrt(1 / 27) / 2)
    assert c.sigmas == pytest.approx(-math.sqrt(3))  # (-1/6) / (sqrt(1/27)/2) = -sqrt(27)/3
    # Unpaired: sqrt(SEM_A^2 + SEM_B^2) = sqrt(1/48 + 1/144) = sqrt(4/144) = 1/6.
    assert c.unpaired_se_pp == pytest.approx(100 / 6) and c.unpaired_sigmas == pytest.approx(-1.0)
    # Bootstrap over 4 questions: a resample mean is -k/12 with k ~ Binomial(4, 1/2) draws of a -1/3 question;
    # P(k = 0) = P(k = 4) = 1/16 > 2.5%, so the percentile interval is [-1/3, 0] exactly.
    assert c.ci95_pp == pytest.approx((-100 / 3, 0.0))
    assert c.bootstrap["seed"] == 7 and c.bootstrap["resamples"] == 10000
    # Seed 0 (greedy): A right on q1, q2; B right on q1 -> only-A 1, only-B 0, both 1, neither 2; p = 1.
    m = c.mcnemar
    assert (m.a_only, m.b_only, m.both, m.neither, m.p_value) == (1, 0, 1, 2, 1.0)
    assert c.verdict == "no difference resolved between b and a: -16.67 pp, 95% CI [-33.33, +0.00]"


def test_planted_drop_is_worse_with_its_interval():
    # 10 questions, one greedy seed: A gets all right, B misses the first 5.
    a = [[1.0]] * 10
    b = [[0.0]] * 5 + [[1.0]] * 5
    c = compare("marlin", "triton_situ", a, b, None, None, resamples=10000, seed=0)
    # d = five -1 and five 0: mean -1/2; std(ddof=1) = sqrt(10 * 1/4 / 9); SE = that / sqrt(10) = 1/6.
    assert c.diff_pp == pytest.approx(-50.0) and c.se_pp == pytest.approx(100 / 6) and c.sigmas == pytest.approx(-3.0)
    # Resample mean -k/10, k ~ Binomial(10, 1/2): P(k <= 1) = 11/1024 = 1.1% < 2.5% < P(k <= 2) = 56/1024 = 5.5%,
    # so the upper end is -2/10 and, by symmetry, the lower end -8/10.
    assert c.ci95_pp == pytest.approx((-80.0, -20.0))
    # McNemar: 5 questions only A gets right, none only B: p = 2 * (1/2)^5.
    assert (c.mcnemar.a_only, c.mcnemar.b_only) == (5, 0) and c.mcnemar.p_value == pytest.approx(2 / 32)
    assert c.unpaired_se_pp is None and c.unpaired_sigmas is None  # one seed: no SEM
    assert c.verdict == "triton_situ is worse than marlin: -50.00 pp, 95% CI [-80.00, -20.00] (3.0 sigma)"


def test_identical_arms():
    a = [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]
    c = compare("x", "y", a, a, 0.1, 0.1, resamples=500, seed=1)
    assert c.diff_pp == 0.0 and c.se_pp == 0.0 and c.sigmas is None and c.ci95_pp == (0.0, 0.0)
    assert c.verdict == "no difference resolved between y and x: +0.00 pp, 95% CI [+0.00, +0.00]"


@pytest.mark.parametrize("a_only, b_only, p", [
    (5, 0, 2 / 32),                       # 2 * (1/2)^5
    (3, 1, 2 * (1 + 4) / 16),             # 2 * P(X <= 1), X ~ Bin(4, 1/2)
    (2, 7, 2 * (1 + 9 + 36) / 512),       # 2 * P(X <= 2), X ~ Bin(9, 1/2)
    (4, 4, 1.0),                          # symmetric: capped at 1
    (0, 0, 1.0),                          # no discordant question
])
def test_mcnemar_exact_p(a_only, b_only, p):
    a = [[1.0]] * a_only + [[0.0]] * b_only + [[1.0], [0.0]]  # plus one concordant right and one wrong
    b = [[0.0]] * a_only + [[1.0]] * b_only + [[1.0], [0.0]]
    m = mcnemar(a, b)
    assert (m.a_only, m.b_only, m.both, m.neither) == (a_only, b_only, 1, 1) and m.p_value == pytest.approx(p)


def test_bootstrap_against_the_normal_approximation():
    # Another way to the same interval: for 400 questions the bootstrap distribution of the mean is close to
    # normal, mean +- 1.96 sd/sqrt(n) with the plug-in sd (ddof=0), which is what a bootstrap resample sees.
    d = np.random.default_rng(3).choice([-1.0, 0.0, 0.0, 1.0], size=400)
    lo, hi = bootstrap_ci(d, resamples=20000, seed=0)
    half = 1.959964 * d.std() / math.sqrt(d.size)
    assert lo == pytest.approx(d.mean() - half, abs=0.006) and hi == pytest.approx(d.mean() + half, abs=0.006)
    assert bootstrap_ci([0.5], resamples=10, seed=0) is None  # one question: no interval


def test_verdicts_never_claim_more_than_the_interval():
    assert verdict("a", "b", 1.2, (0.3, 2.1), 2.6) == "b is better than a: +1.20 pp, 95% CI [+0.30, +2.10] (2.6 sigma)"
    assert verdict("a", "b", -3.0, (-4.4, -1.5), -4.1) == "b is worse than a: -3.00 pp, 95% CI [-4.40, -1.50] (4.1 sigma)"
    assert verdict("a", "b", -0.8, (-2.1, 0.5), -1.2).startswith("no difference resolved between b and a: -0.80 pp")
    assert verdict("a", "b", 0.5, None, None).startswith("no difference resolved: +0.50 pp")


def test_speed_by_hand():
    sp = arm_speed([1.0, 2.0, 3.0, 4.0, 5.0], [10, 30, None, 20, 100], [0.0, 0.0, 1.0, 2.0, 3.0], [1.0, 2.0, 4.0, 6.0, 8.0])
    # Linear interpolation at (n-1) q: p50 index 2 -> 3; p90 index 3.6 -> 4.6; p99 index 3.96 -> 4.96.
    assert sp.latency_s == pytest.approx({"p50": 3.0, "p90": 4.6, "p99": 4.96, "mean": 3.0})
    # Rates of the 4 requests with usage: 10/1, 30/2, 20/4, 100/5 -> sorted (5, 10, 15, 20):
    # p10 index 0.3 -> 6.5, p50 index 1.5 -> 12.5, p90 index 2.7 -> 18.5; mean 12.5.
    assert sp.tokens_per_s_per_request == pytest.approx({"p10": 6.5, "p50": 12.5, "p90": 18.5, "mean": 12.5})
    # 160 tokens over the span 0 .. 8 s.
    assert (sp.total_completion_tokens, sp.wall_span_s, sp.aggregate_tokens_per_s) == (160, 8.0, 20.0)
    assert sp.requests == 5 and sp.requests_without_usage == 1
    none = arm_speed([1.0], [None], [0.0], [1.0])
    assert none.tokens_per_s_per_request is None and none.aggregate_tokens_per_s is None


def test_grading_rule_is_one_text_in_code_report_and_docs():
    """grading.GRADING_RULE is what report.json's definitions carry and, word for word (line
    breaks aside), what docs/ab.md states."""
    from pathlib import Path

    from k3nvfp4.sglang_ext.ab.grading import GRADING_RULE
    from k3nvfp4.sglang_ext.ab.serve import DEFINITIONS

    assert DEFINITIONS["grading"] == GRADING_RULE
    doc = (Path(__file__).resolve().parents[1] / "docs" / "ab.md").read_text()
    words = " ".join(doc.replace("\n    > ", " ").split())
    assert " ".join(GRADING_RULE.split()) in words


@pytest.mark.parametrize("content, reasoning, finish, gold, expected", [
    ("Answer: B", None, "length", "B", (True, True, "B", "content")),  # truncated after the answer: graded on it
    ("Answer: C", None, "stop", "B", (False, False, "C", "content")),
    ("", "Answer: B ... and more", "length", "B", (True, True, "B", "reasoning_content")),  # content empty
    ("", "still thinking", "length", "B", (False, True, None, None)),  # cut before any answer: 0
    ("Answer: B", None, "stop", None, (None, False, "B", "content")),  # no gold answer: not graded
])
def test_grade_by_the_rule(content, reasoning, finish, gold, expected):
    from k3nvfp4.sglang_ext.ab.grading import grade
    from k3nvfp4.sglang_ext.ab.prompts import Prompt

    g = grade(Prompt("q", "mc", "text", gold, 4), content, reasoning, finish)
    assert (g.correct, g.truncated, g.answer, g.answer_source) == expected
