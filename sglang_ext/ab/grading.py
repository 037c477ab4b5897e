"""How one request of the serve A/B is graded: the rule, in one place.

``GRADING_RULE`` is the rule in words; report.json's ``definitions.grading`` and docs/ab.md carry
this text verbatim (tests/test_ab_stats.py checks both), and :func:`grade` is the only code that
decides a grade. It follows NeMo-Skills, the model card's harness: its multiple-choice evaluator
(``nemo_skills/evaluation/evaluator/mcq.py``) sets ``symbolic_correct = predicted_answer ==
expected_answer`` for every generation, and its metrics (``metrics/base.py``) count a missing
answer as incorrect; the ``finish_reason`` it records plays no part in either.
"""

from __future__ import annotations

from dataclasses import dataclass

from .prompts import Prompt, response_answer

GRADING_RULE = (
    "A request is graded on the answer extracted from its response: correct when it equals the gold answer, "
    "wrong when it differs, and 0 when there is none. finish_reason plays no part in the grade, as in NeMo-Skills "
    "(its multiple-choice evaluator compares predicted_answer with expected_answer for every generation, and a missing "
    "answer counts as incorrect): a truncated request (finish_reason \"length\") that gave its answer before the cut "
    "is graded on it, one cut off before any answer scores 0. The truncated rate is reported beside the score. One "
    "difference: NeMo-Skills reads the answer from message.content only, so a reasoning model cut off inside its "
    "thinking (empty content) scores 0 there; this tool reads reasoning_content when content is empty, so such a "
    "request is graded on the last answer line of its thinking (answer_source \"reasoning_content\"; "
    "answer_from_reasoning_rate per arm says how often, and where it is 0 the two rules agree)."
)


@dataclass(frozen=True)
class Grade:
    """One request's grade. correct: None for a prompt without a gold answer."""

    answer: str | None  # the extracted answer, None when the response has none
    answer_source: str | None  # "content", "reasoning_content" or None (no answer)
    correct: bool | None
    truncated: bool  # finish_reason == "length"; reported, never part of `correct`


def grade(prompt: Prompt, content: str | None, reasoning_content: str | None, finish_reason: str | None) -> Grade:
    """Grade one response to ``prompt`` by GRADING_RULE."""
    answer, source = response_answer(content, reasoning_content, prompt.kind, prompt.num_choices)
    correct = None if prompt.answer is None else (answer is not None and answer == prompt.answer)
    return Grade(answer, source, correct, finish_reason == "length")
