"""Prompt files as users hold them: the project's JSONL, GPQA's own CSV, NeMo-Skills' GPQA JSONL.

Formats (``--prompts-format``; ``auto`` picks one per file: ``.csv`` is gpqa-csv; a JSONL whose
first object has "expected_answer" is nemo-skills-jsonl; any other JSONL is ab-jsonl):

- ``ab-jsonl``: the project's format (prompts.py).
- ``gpqa-csv``: GPQA's CSV as published (gpqa_diamond.csv: 198 rows). Read: "Question",
  "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3" (each
  stripped of surrounding whitespace), "Record ID" as the prompt id where the column exists
  (else row-NNNN, 1-based); every other column is ignored. The four choices are shown in an
  order drawn per question: ``numpy.random.default_rng([choice_seed, row]).permutation(4)``
  over (Correct, Incorrect 1, 2, 3), row the 0-based data row. It depends on nothing else, so
  every arm and seed of a question sees the same order, and ``--limit`` keeps it; the report
  records the seed and each question's order.
- ``nemo-skills-jsonl``: the rows NeMo-Skills' ``nemo_skills/dataset/gpqa/prepare.py`` writes
  (``ns prepare_data gpqa``; NVIDIA/NeMo-Skills at 0b012df, 2025-11): "problem" (the question,
  a blank line and the choices "A) ...", NeMo-Skills' own permutation, drawn with its
  --random_seed), "expected_answer" (the letter), "A".."D" (the choice texts) and "options" (the
  lettered choices); "explanation", "subset_for_metrics" and "difficulty" are ignored. Ids are
  line-NNNN (1-based line number).

Both GPQA formats render their question with the 4-choice template (mcq_template: built-in
``mcq-4choices`` unless ``--prompt-template``). No dataset ships with the package.
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import InputError
from .mcq_template import BUILTIN, LETTERS, MCQTemplate, load_template
from .prompts import Prompt, load_prompts

FORMATS = ("auto", "ab-jsonl", "gpqa-csv", "nemo-skills-jsonl")
GPQA_COLUMNS = ("Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3")
CHOICE_ORDER_RULE = "numpy.random.default_rng([choice_seed, row]).permutation(4) over (Correct, Incorrect 1, 2, 3)"


@dataclass
class PromptSet:
    """The prompts of a run and what the report says about where they came from."""

    prompts: list[Prompt]
    format: str  # one of FORMATS but "auto"
    source: str  # the file, or "built-in default_prompts.jsonl"
    template: MCQTemplate
    choice_seed: int | None = None  # gpqa-csv only

    def describe(self) -> dict:
        """The report's "dataset" section."""
        d = {"format": self.format, "source": self.source, "questions": len(self.prompts),
             "prompt_template": {"source": self.template.source, "text": self.template.text}}
        if self.format == "gpqa-csv":
            d.update(choice_seed=self.choice_seed, choice_order_rule=CHOICE_ORDER_RULE)
        return d


def detect_format(path: Path) -> str:
    """The format ``auto`` reads ``path`` as (see the module docstring)."""
    if path.suffix.lower() == ".csv":
        return "gpqa-csv"
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                try:
                    obj = json.loads(line)
                except ValueError:
                    return "ab-jsonl"  # its reader names the line
                # "expected_answer" is NeMo-Skills' name (the project's JSONL says "answer"); its
                # reader then names what is missing rather than reading the rows as ungraded prompts.
                return "nemo-skills-jsonl" if isinstance(obj, dict) and "expected_answer" in obj else "ab-jsonl"
    return "ab-jsonl"


def choice_order(choice_seed: int, row: int) -> tuple[int, ...]:
    """Shown order of question ``row``'s choices, as indices into (Correct, Incorrect 1, 2, 3)."""
    return tuple(int(i) for i in np.random.default_rng([choice_seed, row]).permutation(4))


def read_gpqa_csv(path: Path, template: MCQTemplate, choice_seed: int) -> list[Prompt]:
    """GPQA's CSV -> 4-choice prompts with the choices permuted by ``choice_seed``."""
    with open(path, encoding="utf-8-sig", newline="") as f:  # utf-8-sig: a BOM is not part of "Question"
        reader = csv.DictReader(f)
        missing = [c for c in GPQA_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise InputError(f"{path}: not a GPQA CSV: no column {', '.join(repr(c) for c in missing)} "
                             f"(columns: {', '.join(reader.fieldnames or []) or 'none'})")
        prompts = []
        for row, rec in enumerate(reader):
            vals = [(rec.get(c) or "").strip() for c in GPQA_COLUMNS]
            empty = [c for c, v in zip(GPQA_COLUMNS, vals) if not v]
            if empty:
                raise InputError(f"{path} data row {row + 1}: empty {empty[0]!r}")
            order = choice_order(choice_seed, row)
            options = [vals[1 + i] for i in order]  # vals[1] is the correct answer, vals[2..4] the incorrect
            pid = (rec.get("Record ID") or "").strip() or f"row-{row + 1:04d}"
            prompts.append(Prompt(pid, "mc", template.render(vals[0], options), LETTERS[order.index(0)], 4, order))
    return prompts


def read_nemo_skills_jsonl(path: Path, template: MCQTemplate) -> list[Prompt]:
    """NeMo-Skills' prepared GPQA JSONL -> prompts (its own choice order and gold letter)."""
    prompts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path} line {n}"
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise InputError(f"{where}: not valid JSON ({e})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("problem"), str) or "expected_answer" not in obj:
                raise InputError(f"{where}: not a NeMo-Skills prepared GPQA row (needs 'problem' and 'expected_answer'; "
                                 "an older prepare.py wrote 'question' and an 'options' list: prepare it again)")
            k = 0
            while k < len(LETTERS) and isinstance(obj.get(LETTERS[k]), str):
                k += 1
            if k < 2:
                raise InputError(f"{where}: no choice texts 'A', 'B', ... (NeMo-Skills writes one field per letter)")
            gold = str(obj["expected_answer"]).strip().upper()
            if gold not in LETTERS[:k]:
                raise InputError(f"{where}: 'expected_answer' {obj['expected_answer']!r} is not one of {LETTERS[:k]}")
            choices = [obj[LETTERS[i]] for i in range(k)]
            problem = obj["problem"]
            options = obj.get("options") if isinstance(obj.get("options"), str) else None
            # "problem" is f"{question}\n\n{options}"; the question alone for a {question} template.
            question = problem[: -len(options) - 2] if options and problem.endswith("\n\n" + options) else None
            if question is None and "question" in template.fields:
                raise InputError(f"{where}: 'problem' does not end with its 'options', so the template's {{question}} "
                                 "has no value; use {problem}")
            prompts.append(Prompt(f"line-{n:04d}", "mc", template.render(question or problem, choices, problem=problem),
                                  gold, k))
    if not prompts:
        raise InputError(f"{path}: no prompts")
    return prompts


def load_prompt_set(path: str | Path | None, fmt: str = "auto", *, choice_seed: int = 0,
                    template_path: str | Path | None = None, limit: int | None = None) -> PromptSet:
    """Read ``path`` in format ``fmt`` (None: the built-in set), first ``limit`` prompts."""
    if fmt not in FORMATS:
        raise InputError(f"--prompts-format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    override = load_template(template_path) if template_path else None
    if path is None:
        if fmt not in ("auto", "ab-jsonl"):
            raise InputError(f"--prompts-format {fmt} needs --prompts FILE")
        tpl = override or BUILTIN["ab-mc"]
        return PromptSet(load_prompts(None, limit=limit, template=tpl), "ab-jsonl", "built-in default_prompts.jsonl", tpl)
    p = Path(path)
    if not p.is_file():
        raise InputError(f"--prompts: file not found: {p}")
    if fmt == "auto":
        fmt = detect_format(p)
    if fmt == "ab-jsonl":
        tpl = override or BUILTIN["ab-mc"]
        return PromptSet(load_prompts(p, limit=limit, template=tpl), fmt, str(p), tpl)
    tpl = override or BUILTIN["mcq-4choices"]
    prompts = read_gpqa_csv(p, tpl, choice_seed) if fmt == "gpqa-csv" else read_nemo_skills_jsonl(p, tpl)
    if not prompts:
        raise InputError(f"{p}: no prompts")
    ids = [x.id for x in prompts]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise InputError(f"{p}: duplicate prompt id {dup!r}")
    return PromptSet(prompts[:limit] if limit else prompts, fmt, str(p), tpl, choice_seed if fmt == "gpqa-csv" else None)
