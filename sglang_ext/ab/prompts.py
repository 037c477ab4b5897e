"""Prompt sets (the project's JSONL) and final-answer extraction.

One JSON object per line:
  {"id": "mc-001", "kind": "mc", "question": "...", "choices": ["...", "..."], "answer": "B"}
  {"id": "ar-001", "kind": "arith", "question": "What is 17*23?", "answer": "391"}
  {"id": "free-1", "prompt": "any text"}            (no gold answer: greedy agreement only)
"kind" defaults to "mc" when "choices" is given, "arith" when only "answer" is, else "free".
"choices" are lettered A, B, C, ... in order; "answer" is the gold letter (mc) or number (arith).
A multiple-choice prompt's text is its template's rendering (mcq_template: built-in "ab-mc",
or --prompt-template). GPQA's CSV and NeMo-Skills' JSONL are read by datasets.py.

Answer extraction (documented in the report):
- the response's text is choices[0].message.content; when that is empty (None or whitespace:
  a reasoning model that never closed its thinking), reasoning_content instead;
- mc: the LAST "Answer: X" (the word case-insensitive, markdown ** or _ around it or the
  letter allowed, "(X)" too, X any case, a letter among the question's choices), or
  "answer is X" with X an upper-case letter (so "the answer is a bit" is not "A"); else the
  last \\boxed{X} with X one such letter; else none;
- arith: the last "Answer: N" / "answer is N" (commas and $ stripped, 42.0 == 42), else the last
  \\boxed{N}; else none.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from .errors import InputError
from .mcq_template import BUILTIN, LETTERS, MCQTemplate

_ARITH_INSTRUCTION = "Think step by step, then finish with a final line of the form 'Answer: N' where N is the number."


@dataclass(frozen=True)
class Prompt:
    id: str
    kind: str  # "mc" | "arith" | "free"
    text: str  # the user message sent to the server
    answer: str | None  # gold answer (letter or normalised number), None for free prompts
    num_choices: int = 0
    # GPQA CSV: the shown order of the choices as indices into (Correct, Incorrect 1, 2, 3).
    choice_order: tuple[int, ...] | None = None


def _build(obj: dict, where: str, template: MCQTemplate) -> Prompt:
    if not isinstance(obj, dict):
        raise InputError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    choices = obj.get("choices")
    answer = obj.get("answer")
    kind = obj.get("kind") or ("mc" if choices else "arith" if answer is not None else "free")
    pid = str(obj.get("id", where))
    if kind == "mc":
        if not isinstance(choices, list) or len(choices) < 2 or len(choices) > len(LETTERS):
            raise InputError(f"{where}: mc prompt needs a 'choices' list of 2..26 entries")
        if not isinstance(answer, str) or answer.strip().upper() not in LETTERS[: len(choices)]:
            raise InputError(f"{where}: mc 'answer' must be one of {LETTERS[:len(choices)]}, got {answer!r}")
        if not isinstance(obj.get("question"), str):
            raise InputError(f"{where}: mc prompt needs a 'question' string")
        text = template.render(obj["question"], [str(c) for c in choices])
        return Prompt(pid, "mc", text, answer.strip().upper(), len(choices))
    if kind == "arith":
        if answer is None or "question" not in obj:
            raise InputError(f"{where}: arith prompt needs 'question' and 'answer'")
        return Prompt(pid, "arith", f"{obj['question']}\n\n{_ARITH_INSTRUCTION}", normalize_number(str(answer)))
    text = obj.get("prompt") or obj.get("question")
    if not isinstance(text, str):
        raise InputError(f"{where}: free prompt needs a 'prompt' string")
    return Prompt(pid, "free", text, None)


def load_prompts(path: str | Path | None = None, *, limit: int | None = None,
                 template: MCQTemplate | None = None) -> list[Prompt]:
    """Read a prompt JSONL file (None = the built-in default set shipped with the package);
    multiple-choice texts from ``template`` (default: built-in "ab-mc")."""
    template = template or BUILTIN["ab-mc"]
    if path is None:
        text = resources.files(__package__).joinpath("data/default_prompts.jsonl").read_text()
        name = "built-in default_prompts.jsonl"
    else:
        p = Path(path)
        if not p.is_file():
            raise InputError(f"--prompts: file not found: {p}")
        text, name = p.read_text(), str(p)
    prompts = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except ValueError as e:
            raise InputError(f"{name} line {n}: not valid JSON ({e})") from None
        prompts.append(_build(obj, f"{name} line {n}", template))
    if not prompts:
        raise InputError(f"{name}: no prompts")
    ids = [p.id for p in prompts]
    if len(set(ids)) != len(ids):
        raise InputError(f"{name}: duplicate prompt ids")
    return prompts[:limit] if limit else prompts


def normalize_number(s: str) -> str:
    """'1,234' -> '1234', '42.0' -> '42', '-3.50' -> '-3.5', '$7' -> '7'."""
    s = s.strip().strip("$").replace(",", "").rstrip(".")
    try:
        v = float(s)
    except ValueError:
        return s
    return str(int(v)) if v == int(v) and abs(v) < 1e15 else repr(v)


# "Answer: X" (any case after the colon) or "answer is X" (upper case only).
_ANSWER_LETTER = re.compile(r"(?i:answer)[*_]*\s*(?:[:：][\s*_]*\(?([A-Za-z])|(?i:is)[\s*_:：]*\(?([A-Z]))\)?(?![A-Za-z0-9])")
_ANSWER_NUMBER = re.compile(r"answer\s*(?:is)?\s*[:：]?\s*\**\s*\$?(-?[\d,]*\.?\d+)", re.IGNORECASE)
_BOXED = re.compile(r"\\boxed\{\s*(?:\\text\{)?\s*([^{}]*?)\s*\}?\s*\}")


def extract_answer(content: str | None, kind: str, num_choices: int = 0) -> str | None:
    """Final answer of a completion: last 'Answer: X', else last \\boxed{X}; None when absent."""
    if not content:
        return None
    if kind == "mc":
        valid = LETTERS[: num_choices or len(LETTERS)]
        hits = [(m.group(1) or m.group(2)).upper() for m in _ANSWER_LETTER.finditer(content)]
        hits = [h for h in hits if h in valid]
        if not hits:
            hits = [b.strip("() ").upper() for b in _BOXED.findall(content)]
            hits = [h for h in hits if len(h) == 1 and h in valid]
        return hits[-1] if hits else None
    if kind == "arith":
        hits = _ANSWER_NUMBER.findall(content)
        if not hits:
            hits = [b for b in _BOXED.findall(content) if re.fullmatch(r"\$?-?[\d,]*\.?\d+", b.strip())]
        return normalize_number(hits[-1]) if hits else None
    return None


def response_text(content: str | None, reasoning_content: str | None) -> tuple[str | None, str | None]:
    """(text to grade, where it came from): content, or reasoning_content when content is empty."""
    if content and content.strip():
        return content, "content"
    if reasoning_content and reasoning_content.strip():
        return reasoning_content, "reasoning_content"
    return None, None


def response_answer(content: str | None, reasoning_content: str | None, kind: str,
                    num_choices: int = 0) -> tuple[str | None, str | None]:
    """(extracted answer, "content" | "reasoning_content") of a response, (None, None) when it
    has none; see the module docstring."""
    text, source = response_text(content, reasoning_content)
    ans = extract_answer(text, kind, num_choices)
    return (ans, source) if ans is not None else (None, None)


def final_answer_key(content: str | None, prompt: Prompt, reasoning_content: str | None = None) -> str:
    """What 'the final answers agree' compares: the extracted answer when there is one,
    else the whitespace-normalised graded text (free prompts, or no answer line)."""
    ans, _ = response_answer(content, reasoning_content, prompt.kind, prompt.num_choices)
    if ans is not None:
        return f"answer:{ans}"
    return "text:" + " ".join((response_text(content, reasoning_content)[0] or "").split())
