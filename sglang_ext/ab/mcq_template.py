"""The user message of a multiple-choice question: a template with placeholders.

A template is Python ``str.format`` text (NeMo-Skills' prompt configs use the same rules:
literal braces are doubled, ``{{`` and ``}}``) with these placeholders:
- ``{problem}``: the question, a blank line, and the lettered choices, one a line ("A) ...");
- ``{question}``: the question alone;
- ``{options}``: the lettered choices alone;
- ``{A}``, ``{B}``, ...: the text of one choice.
A template needs ``{problem}``, or ``{question}`` with ``{options}`` or with every choice letter.

Built in:
- ``mcq-4choices`` (the default of the GPQA formats): the text of NeMo-Skills'
  ``eval/aai/mcq-4choices`` prompt, the model card's harness (asks for a last line
  "Answer: X");
- ``ab-mc`` (the project's JSONL prompts): the question and choices, then "Think step by step,
  then finish with a final line of the form 'Answer: X' ...".

``--prompt-template FILE`` replaces both: the file's text (trailing newlines dropped) is the
template; the report records the text verbatim with its source.
"""

from __future__ import annotations

import string
from dataclasses import dataclass
from pathlib import Path

from .errors import InputError

LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"

MCQ_4CHOICES = ("Answer the following multiple choice question. The last line of your response should be in the "
                "following format: 'Answer: A/B/C/D' (e.g. 'Answer: A').\n\n{problem}")
AB_MC = ("{problem}\n\nThink step by step, then finish with a final line of the form 'Answer: X' where X is the "
         "letter of the correct choice.")


@dataclass(frozen=True)
class MCQTemplate:
    """A template's text and where it came from ("built-in mcq-4choices", or a file path)."""

    text: str
    source: str

    @property
    def fields(self) -> set[str]:
        return {name for _, name, _, _ in string.Formatter().parse(self.text) if name is not None}

    def render(self, question: str, choices: list[str], *, problem: str | None = None) -> str:
        """The user message for one question; ``problem`` overrides the composed one (NeMo-Skills
        rows carry theirs)."""
        options = "\n".join(f"{LETTERS[i]}) {c}" for i, c in enumerate(choices))
        values = {"question": question, "options": options,
                  "problem": problem if problem is not None else f"{question}\n\n{options}",
                  **{LETTERS[i]: c for i, c in enumerate(choices)}}
        fields = self.fields
        missing = sorted(fields - set(values))
        if not missing and not {"problem", "options"} & fields and not set(LETTERS[: len(choices)]) <= fields:
            missing = sorted(set(LETTERS[: len(choices)]) - fields)
            raise InputError(f"prompt template ({self.source}): a question with {len(choices)} choices would not show "
                             f"choice {missing[0]} (the template has no {{{missing[0]}}}, {{options}} or {{problem}})")
        if missing:
            raise InputError(f"prompt template ({self.source}): placeholder {{{missing[0]}}} has no value for a "
                             f"question with {len(choices)} choices")
        return self.text.format_map(values)


BUILTIN = {"mcq-4choices": MCQTemplate(MCQ_4CHOICES, "built-in mcq-4choices"),
           "ab-mc": MCQTemplate(AB_MC, "built-in ab-mc")}


def load_template(path: str | Path) -> MCQTemplate:
    """Read a template file and check its placeholders; InputError names the file otherwise."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"--prompt-template: file not found: {p}")
    text = p.read_text(encoding="utf-8").rstrip("\n")
    try:
        parsed = list(string.Formatter().parse(text))
    except ValueError as e:  # a single brace: literal braces are written {{ and }}
        raise InputError(f"--prompt-template {p}: not a format template ({e}; write literal braces as {{{{ and }}}})") from None
    fields = {name for _, name, spec, conv in parsed if name is not None}
    known = {"problem", "question", "options", *LETTERS}
    bad = sorted(f for f in fields if f not in known)
    if bad:
        raise InputError(f"--prompt-template {p}: unknown placeholder {{{bad[0]}}} (known: {{problem}}, {{question}}, "
                         "{options}, {A}..{Z})")
    letters = {f for f in fields if f in LETTERS}
    has_choices = "options" in fields or (letters and letters == set(LETTERS[: len(letters)]))
    if "problem" not in fields and not ("question" in fields and has_choices):
        raise InputError(f"--prompt-template {p}: needs {{problem}}, or {{question}} with {{options}} (or {{A}}, {{B}}, "
                         "... for every choice); it has " + (", ".join(f"{{{f}}}" for f in sorted(fields)) or "no placeholder"))
    return MCQTemplate(text, str(p))
