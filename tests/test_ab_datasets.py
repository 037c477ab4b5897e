"""GPQA as users hold it (sglang_ext/ab/datasets.py, mcq_template.py): GPQA's CSV and NeMo-Skills'
prepared JSONL on the made-up fixtures of tests/fixtures/gpqa, the prompt template and its
errors, answer extraction on hand-written responses, and a serve run with a planted accuracy
drop (fake servers) reported as worse with its interval."""

from __future__ import annotations

import csv
import json
import math
import re
from pathlib import Path

import pytest

from ab_fake_server import FakeServer, completion
from k3nvfp4.sglang_ext.ab import cli
from k3nvfp4.sglang_ext.ab.datasets import choice_order, detect_format, load_prompt_set
from k3nvfp4.sglang_ext.ab.errors import InputError
from k3nvfp4.sglang_ext.ab.mcq_template import MCQ_4CHOICES, load_template
from k3nvfp4.sglang_ext.ab.prompts import extract_answer, load_prompts, response_answer

FIX = Path(__file__).resolve().parent / "fixtures" / "gpqa"
CSV_FILE, NEMO_FILE = FIX / "gpqa_sample.csv", FIX / "nemo_skills_gpqa_sample.jsonl"
MCQ_HEAD = ("Answer the following multiple choice question. The last line of your response should be in the following "
            "format: 'Answer: A/B/C/D' (e.g. 'Answer: A').\n\n")


def _shown_choices(text: str) -> dict[str, str]:
    """Letter -> choice text of a rendered prompt's 'X) ...' lines."""
    return dict(re.findall(r"^([A-D])\) (.*)$", text, re.M))


def test_gpqa_csv_reader():
    with open(CSV_FILE, newline="", encoding="utf-8") as f:  # the fixture read independently
        rows = list(csv.DictReader(f))
    ps = load_prompt_set(CSV_FILE, choice_seed=0)
    assert ps.format == "gpqa-csv" and [p.id for p in ps.prompts] == [r["Record ID"] for r in rows]
    for p, r in zip(ps.prompts, rows):
        shown = _shown_choices(p.text)
        assert p.kind == "mc" and p.num_choices == 4 and p.text.startswith(MCQ_HEAD)
        assert p.text[len(MCQ_HEAD):].startswith(r["Question"].strip() + "\n\nA) ")
        # The gold letter shows the correct answer; all four answers are shown once.
        assert shown[p.answer] == r["Correct Answer"].strip()
        assert sorted(shown.values()) == sorted(r[c].strip() for c in ("Correct Answer", "Incorrect Answer 1",
                                                                        "Incorrect Answer 2", "Incorrect Answer 3"))
        # The recorded order says which column each letter shows (0 = correct, k = incorrect k).
        cols = ["Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3"]
        assert [shown[L] for L in "ABCD"] == [r[cols[i]].strip() for i in p.choice_order]
    # The two-line question keeps its line break; the answer " 6 " is stripped.
    assert "two-line question:\nhow many sides" in ps.prompts[1].text and _shown_choices(ps.prompts[1].text)[ps.prompts[1].answer] == "6"
    # The order is numpy's default_rng([seed, row]) permutation, independent of the other rows and of --limit.
    assert [p.choice_order for p in ps.prompts] == [choice_order(0, i) for i in range(4)]
    assert [p.text for p in load_prompt_set(CSV_FILE, limit=2).prompts] == [p.text for p in ps.prompts[:2]]
    other = load_prompt_set(CSV_FILE, choice_seed=1).prompts
    assert [p.choice_order for p in other] != [p.choice_order for p in ps.prompts]
    assert ps.describe()["choice_seed"] == 0 and ps.describe()["prompt_template"]["text"] == MCQ_4CHOICES


def test_nemo_skills_reader():
    rows = [json.loads(x) for x in NEMO_FILE.read_text().splitlines()]
    ps = load_prompt_set(NEMO_FILE)
    assert ps.format == "nemo-skills-jsonl" and ps.describe().get("choice_seed") is None
    assert [p.id for p in ps.prompts] == ["line-0001", "line-0002", "line-0003", "line-0004"]
    for p, r in zip(ps.prompts, rows):
        # NeMo-Skills' own order and gold letter; the mcq-4choices text around its "problem".
        assert p.answer == r["expected_answer"] and p.num_choices == 4 and p.text == MCQ_HEAD + r["problem"]
        assert _shown_choices(p.text)[p.answer] == r[r["expected_answer"]]


def test_auto_detection_and_formats(tmp_path):
    assert detect_format(CSV_FILE) == "gpqa-csv" and detect_format(NEMO_FILE) == "nemo-skills-jsonl"
    own = tmp_path / "own.jsonl"
    own.write_text(json.dumps({"id": "q", "question": "Q?", "choices": ["x", "y"], "answer": "B"}) + "\n")
    assert detect_format(own) == "ab-jsonl" and load_prompt_set(own).prompts == load_prompts(own)
    assert load_prompt_set(None).format == "ab-jsonl" and len(load_prompt_set(None).prompts) == 32
    # An explicit format wins: the NeMo-Skills file read as the project's JSONL fails on its first line.
    with pytest.raises(InputError, match="line 1"):
        load_prompt_set(NEMO_FILE, "ab-jsonl")


def test_template_from_a_file(tmp_path):
    t = tmp_path / "t.txt"
    t.write_text("Q: {question}\nChoices:\n{options}\nLiteral {{braces}} and \\boxed{{X}}. End with 'Answer: X'.\n")
    ps = load_prompt_set(NEMO_FILE, template_path=t)
    first = json.loads(NEMO_FILE.read_text().splitlines()[0])
    question, options = first["problem"].split("\n\n")
    assert ps.prompts[0].text == (f"Q: {question}\nChoices:\n{options}\nLiteral {{braces}} and \\boxed{{X}}. "
                                  "End with 'Answer: X'.")
    assert ps.describe()["prompt_template"] == {"source": str(t), "text": t.read_text().rstrip("\n")}
    # Per-letter placeholders, on the CSV.
    t.write_text("{question}\n1. {A}\n2. {B}\n3. {C}\n4. {D}")
    p = load_prompt_set(CSV_FILE, template_path=t).prompts[0]
    assert p.text.splitlines()[0] == "Which gas do green plants take in for photosynthesis?"
    assert p.text.splitlines()["ABCD".index(p.answer) + 1].endswith("Carbon dioxide")


@pytest.mark.parametrize("text, message", [
    ("Answer the question.", "needs {problem}, or {question} with {options}"),
    ("{question} only", "needs {problem}, or {question} with {options}"),
    ("{problem} and {subject}", "unknown placeholder {subject}"),
    ("{problem} with a lone { brace", "not a format template"),
])
def test_template_errors_name_the_file(tmp_path, text, message):
    t = tmp_path / "bad-template.txt"
    t.write_text(text)
    with pytest.raises(InputError, match=re.escape(message)) as e:
        load_template(t)
    assert str(t) in str(e.value)


def test_template_that_would_hide_a_choice(tmp_path):
    t = tmp_path / "t.txt"
    t.write_text("{question}\n{A}\n{B}")  # 2 of 4 choices
    with pytest.raises(InputError, match="would not show choice C"):
        load_prompt_set(CSV_FILE, template_path=t)


def test_reader_errors(tmp_path, capsys):
    bad = tmp_path / "bad.csv"
    bad.write_text("Question,Correct Answer,Incorrect Answer 1\nq,a,b\n")
    with pytest.raises(InputError, match=r"bad.csv: not a GPQA CSV: no column 'Incorrect Answer 2', 'Incorrect Answer 3'"):
        load_prompt_set(bad)
    empty = tmp_path / "empty.csv"
    empty.write_text("Question,Correct Answer,Incorrect Answer 1,Incorrect Answer 2,Incorrect Answer 3\nq,a,b,,d\n")
    with pytest.raises(InputError, match="empty.csv data row 1: empty 'Incorrect Answer 2'"):
        load_prompt_set(empty)
    nemo = tmp_path / "n.jsonl"
    nemo.write_text(json.dumps({"problem": "p", "expected_answer": "E", "A": "1", "B": "2", "C": "3", "D": "4"}) + "\n")
    with pytest.raises(InputError, match=r"n.jsonl line 1: 'expected_answer' 'E' is not one of ABCD"):
        load_prompt_set(nemo)
    # An older NeMo-Skills layout ("question" and an "options" list) is named, not read as ungraded prompts.
    old = tmp_path / "old.jsonl"
    old.write_text(json.dumps({"question": "q", "options": ["1", "2", "3", "4"], "expected_answer": "A"}) + "\n")
    with pytest.raises(InputError, match=r"old.jsonl line 1: not a NeMo-Skills prepared GPQA row .*prepare it again"):
        load_prompt_set(old)
    # On the command line: one line naming the file, exit 2, no report.
    rc = cli.main(["serve", "--arm", "a=http://127.0.0.1:9", "--arm", "b=http://127.0.0.1:9", "--prompts", str(bad),
                   "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and str(bad) in err and not (tmp_path / "o").exists()


@pytest.mark.parametrize("content, reasoning, expected", [
    ("Reasoning... Answer: A\nWait, no. Answer: C", None, ("C", "content")),  # the last one counts
    ("**Answer:** (B)", None, ("B", "content")),
    ("Final answer: d", None, ("D", "content")),  # lower case after the colon
    ("The answer is B.", None, ("B", "content")),
    ("the answer is a bit unclear", None, (None, None)),  # "is a" is not the letter A
    ("The answer is a bit unclear... Answer: C", None, ("C", "content")),
    ("Answer: E", None, (None, None)),  # not one of the 4 choices
    ("so \\boxed{D}", None, ("D", "content")),
    ("Answer: B", "thinking... Answer: C", ("B", "content")),  # content first
    ("", "long thinking, never closed... Answer: C", ("C", "reasoning_content")),  # a reasoning model's answer
    (None, "Answer: A", ("A", "reasoning_content")),
    ("  \n", None, (None, None)),
    ("I am not sure.", "Answer: A", (None, None)),  # content given: reasoning is not searched
])
def test_answer_extraction(content, reasoning, expected):
    assert response_answer(content, reasoning, "mc", 4) == expected


def test_answer_extraction_arith_unchanged():
    assert extract_answer("the answer is 1,234.", "arith") == "1234" and extract_answer("\\boxed{-17}", "arith") == "-17"


def _planted_csv(path: Path, n: int) -> dict[str, int]:
    """n made-up questions; returns question -> index."""
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["Question", "Correct Answer", "Incorrect Answer 1", "Incorrect Answer 2", "Incorrect Answer 3"])
        for i in range(n):
            w.writerow([f"Made-up question number {i}?", f"right-{i}", f"wrong-{i}-1", f"wrong-{i}-2", f"wrong-{i}-3"])
    return {f"Made-up question number {i}?": i for i in range(n)}


def test_planted_accuracy_drop_is_reported_worse(tmp_path):
    """Arm a always answers right (in reasoning_content, as a reasoning model cut off before its
    answer); arm b answers 8 of 20 questions wrong on every seed: -40 pp, resolved."""
    n, planted = 20, set(range(8))
    index = _planted_csv(tmp_path / "gpqa.csv", n)

    def responder(wrong: set[int], in_reasoning: bool):
        def respond(payload):
            text = payload["messages"][0]["content"]
            i = next(v for k, v in index.items() if k in text)
            want = f"wrong-{i}-1" if i in wrong else f"right-{i}"
            letter = next(L for L, c in _shown_choices(text).items() if c == want)
            body = completion(None, reasoning=f"thinking... Answer: {letter}") if in_reasoning else \
                completion(f"Answer: {letter}", reasoning=None)
            return 200, body, 0
        return respond

    out = tmp_path / "out"
    with FakeServer(responder(set(), True)) as sa, FakeServer(responder(planted, False)) as sb:
        rc = cli.main(["serve", "--arm", f"a={sa.url}", "--arm", f"b={sb.url}", "--prompts", str(tmp_path / "gpqa.csv"),
                       "--seeds", "2", "--choice-seed", "5", "--retries", "0", "--no-progress", "--out", str(out)])
    assert rc == 0
    rep = json.loads((out / "report.json").read_text())
    acc_a, acc_b = rep["accuracy"]["a"]["all_graded"], rep["accuracy"]["b"]["all_graded"]
    assert acc_a["pass@1"] == 1.0 and acc_b["pass@1"] == pytest.approx(12 / 20) and acc_b["sem"] == 0.0
    assert rep["accuracy"]["a"]["answer_from_reasoning_rate"] == 1.0 and rep["accuracy"]["b"]["answer_from_reasoning_rate"] == 0
    c = rep["comparison"]
    # d_q = -1 on 8 questions, 0 on 12: mean -0.4; SE = sqrt(20 * 0.4 * 0.6 / 19) / sqrt(20) = sqrt(0.24 / 19).
    assert c["diff_pp"] == pytest.approx(-40.0) and c["se_pp"] == pytest.approx(100 * math.sqrt(0.24 / 19))
    lo, hi = c["ci95_pp"]
    assert lo < -40.0 < hi < 0.0 and c["bootstrap"]["seed"] == 0
    # Greedy: 8 questions only a gets right; p = 2 * (1/2)^8.
    assert (c["mcnemar"]["a_only"], c["mcnemar"]["b_only"], c["mcnemar"]["both"]) == (8, 0, 12)
    assert c["mcnemar"]["p_value"] == pytest.approx(2 / 256)
    assert c["verdict"].startswith(f"b is worse than a: -40.00 pp, 95% CI [{lo:+.2f}, {hi:+.2f}] (")
    assert c["verdict"] in (out / "summary.md").read_text()
    assert rep["dataset"]["format"] == "gpqa-csv" and rep["dataset"]["choice_seed"] == 5
    assert rep["dataset"]["prompt_template"]["text"] == MCQ_4CHOICES
    # Both arms saw the same choice order on every seed: the order is in the prompt, the same text each time.
    texts = {}
    for s in (sa, sb):
        for pl in s.payloads:
            texts.setdefault(pl["messages"][0]["content"], 0)
            texts[pl["messages"][0]["content"]] += 1
    assert len(texts) == n and set(texts.values()) == {4}  # 2 arms x 2 seeds
    assert (out / "accuracy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
