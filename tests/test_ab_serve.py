"""Server-level A/B: the stdlib client and the metrics against local chat-completions servers.

Every fake server is a real http.server on 127.0.0.1 (ephemeral port) speaking the OpenAI
chat-completions API, non-streaming; the expected metric values are computed by hand below.
"""

from __future__ import annotations

import json
import math
import socket
import time

import pytest

from ab_fake_server import PROMPTS, X, FakeServer, arm_responder, completion
from k3nvfp4.sglang_ext.ab import cli
from k3nvfp4.sglang_ext.ab.client import ChatClient, TokenLogprob
from k3nvfp4.sglang_ext.ab.errors import EndpointDown, EndpointTimeout, MalformedResponse, ServerError
from k3nvfp4.sglang_ext.ab.prompts import extract_answer, load_prompts, normalize_number
from k3nvfp4.sglang_ext.ab.serve_metrics import first_divergence, pass_at_1, token_agreement, topk_kl


def test_serve_end_to_end(tmp_path):
    pfile = tmp_path / "p.jsonl"
    pfile.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    with FakeServer(arm_responder("marlin")) as sa, FakeServer(arm_responder("triton_situ")) as sb:
        out = tmp_path / "out"
        rc = cli.main(["serve", "--arm", f"marlin={sa.url}", "--arm", f"triton_situ={sb.url}/v1", "--prompts",
                       str(pfile), "--seeds", "2", "--concurrency", "4", "--reasoning-effort", "low",
                       "--retries", "0", "--no-progress", "--out", str(out)])
        assert rc == 0
        greedy_payloads = [p for p in sa.payloads if p["temperature"] == 0.0]
        sampled_payloads = [p for p in sa.payloads if p["temperature"] != 0.0]
    assert len(greedy_payloads) == 3 and len(sampled_payloads) == 3
    g0 = greedy_payloads[0]
    assert g0["logprobs"] is True and g0["top_logprobs"] == 5 and g0["max_tokens"] == 65536
    assert g0["stream"] is False and g0["reasoning_effort"] == "low" and g0["model"] == "k3-test" and g0["seed"] == 0
    s0 = sampled_payloads[0]
    assert s0["temperature"] == 0.6 and s0["top_p"] == 0.95 and s0["seed"] == 1 and "logprobs" not in s0

    rep = json.loads((out / "report.json").read_text())
    g = rep["greedy"]
    # mc-1: same answer; mc-2: C vs D; ar-1: marlin truncated with empty content vs "391".
    assert g["final_answer_match_rate"] == pytest.approx(1 / 3)
    # Divergence: mc-1 identical, mc-2 at token 2, ar-1 at token 0.
    assert g["identical_token_streams"] == 1 and sorted(g["first_divergence_positions"]) == [0, 2]
    assert g["median_first_divergence"] == 1
    # Aligned positions 3 + 3 + 1; top-1 agrees at 3 + 2 + 0 of them.
    assert g["aligned_positions"] == 7 and g["top1_agreement"] == pytest.approx(5 / 7)
    # |dlogprob|: mc-1 {0, .05, 0}, mc-2 {0, 0, |-0.4 - (-1.0)|}; ar-1 "Let" missing from B's top-k.
    assert g["mean_abs_dlogprob"] == pytest.approx(0.65 / 6) and g["dlogprob_missing"] == 1
    # KL by hand at the 3 positions that are not identical distributions (all others are 0).
    def kl_rest(p, q):  # two-token dicts with their rest bucket, written out independently
        ps, qs = [math.exp(v) for v in p], [math.exp(v) for v in q]
        return sum(a * math.log(a / b) for a, b in zip(ps, qs)) + (1 - sum(ps)) * math.log((1 - sum(ps)) / (1 - sum(qs)))
    k_mc1 = kl_rest([-0.2, X], [-0.25, X])
    k_mc2 = kl_rest([-0.4, -1.5], [-1.0, -0.5])
    p, q = math.exp(-0.5), math.exp(-0.2)  # "Let" absent in B: q("Let") = B's smallest returned prob
    k_ar1 = p * math.log(p / q) + (1 - p) * math.log((1 - p) / (1 - q))
    assert g["mean_topk_kl"] == pytest.approx((k_mc1 + k_mc2 + k_ar1) / 7, rel=1e-9)

    acc = rep["accuracy"]
    # marlin: seed 0 -> mc-1 ok, mc-2 ok, ar-1 truncated (2/3); seed 1 -> mc-1 ok, mc-2 wrong, 390 wrong (1/3).
    am = acc["marlin"]["all_graded"]
    assert am["per_seed"] == pytest.approx([2 / 3, 1 / 3]) and am["pass@1"] == pytest.approx(0.5)
    assert am["std"] == pytest.approx(math.sqrt(2 * (1 / 6) ** 2))
    assert am["truncated_rate"] == pytest.approx(1 / 6) and am["wrong_rate"] == pytest.approx(2 / 6)
    assert acc["marlin"]["truncation_rate"] == pytest.approx(1 / 6)
    assert acc["marlin"]["mc"]["pass@1"] == pytest.approx(0.75)
    # triton_situ: seed 0 -> 2/3 (D wrong), seed 1 -> 3/3 (boxed B extracted).
    at = acc["triton_situ"]["all_graded"]
    assert at["per_seed"] == pytest.approx([2 / 3, 1.0]) and at["pass@1"] == pytest.approx(5 / 6)
    assert at["truncated_rate"] == 0.0 and acc["triton_situ"]["truncation_rate"] == 0.0

    md = (out / "summary.md").read_text()
    assert "| final-answer match rate | 0.333 |" in md and "| marlin | all_graded | 3 | 50.00 | 23.57 |" in md
    for png in ("accuracy.png", "divergence_hist.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = [json.loads(l) for l in (out / "completions.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and {r["reasoning_content"] for r in rows} == {"thinking about it"}


def test_retries_after_500_then_success():
    calls = []

    def respond(payload):
        calls.append(time.perf_counter())
        if len(calls) <= 2:
            return 500, {"error": "overloaded"}, 0
        return 200, completion("Answer: 7"), 0

    with FakeServer(respond) as s:
        c = ChatClient("a", s.url, retries=2, backoff_s=0.05, timeout_s=5)
        comp = c.chat({"model": "m", "messages": []})
    assert comp.content == "Answer: 7" and len(calls) == 3
    # Exponential backoff: waits of >= 0.05 s then >= 0.1 s.
    assert calls[1] - calls[0] >= 0.05 and calls[2] - calls[1] >= 0.1


def test_5xx_exhausts_retries_clear_message():
    with FakeServer(lambda p: (503, b"busy", 0)) as s:
        with pytest.raises(ServerError, match=r"HTTP 503 after 2 attempt\(s\): busy"):
            ChatClient("marlin", s.url, retries=1, backoff_s=0.01).chat({"messages": []})
        assert len(s.payloads) == 2


@pytest.mark.parametrize("body, pattern", [
    (b"<html>oops</html>", "response is not JSON"),
    ({"object": "chat.completion"}, "no non-empty 'choices' list"),
    ({"choices": [{"index": 0}]}, "choices\\[0\\] has no 'message'"),
])
def test_malformed_responses(body, pattern):
    with FakeServer(lambda p: (200, body, 0)) as s:
        with pytest.raises(MalformedResponse, match=pattern):
            ChatClient("triton_situ", s.url, retries=3, backoff_s=0.01).chat({"messages": []})
        assert len(s.payloads) == 1  # a malformed 200 is not retried


def test_slow_response_times_out():
    # The server answers after 1.5 s, so only the client's 0.2 s timeout can raise here: the
    # error (its type and the timeout it names) is the proof, not a clock on a loaded machine.
    with FakeServer(lambda p: (200, completion("Answer: 1"), 1.5)) as s:
        with pytest.raises(EndpointTimeout, match="no answer within --timeout 0.2 s"):
            ChatClient("a", s.url, retries=0, timeout_s=0.2).chat({"messages": []})


def _free_port():
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return so.getsockname()[1]


def test_endpoint_down_cli_exit_code(tmp_path, capsys):
    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(EndpointDown, match="cannot connect"):
        ChatClient("marlin", url, retries=0).models()
    rc = cli.main(["serve", "--arm", f"marlin={url}", "--arm", f"triton_situ={url}", "--retries", "1",
                   "--backoff", "0.01", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "arm 'marlin'" in err and "cannot connect" in err and "is the server running?" in err
    assert not (tmp_path / "o" / "report.json").exists()


def test_malformed_mid_run_cli_exit_code(tmp_path, capsys):
    with FakeServer(lambda p: (200, completion("Answer: B"), 0)) as sa, FakeServer(lambda p: (200, {"oops": 1}, 0)) as sb:
        rc = cli.main(["serve", "--arm", f"marlin={sa.url}", "--arm", f"triton_situ={sb.url}", "--limit", "2",
                       "--no-progress", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "arm 'triton_situ'" in err and "no non-empty 'choices'" in err
    # A partial report says what is missing: every triton_situ request; marlin's may have run.
    partial = json.loads((tmp_path / "o" / "partial.json").read_text())
    assert "partial report:" in err and str(tmp_path / "o" / "partial.json") in err
    assert partial["complete"] is False and partial["error"]["type"] == "MalformedResponse"
    assert partial["requests"] == 4 and partial["answered"] + len(partial["missing"]) == 4
    assert len([m for m in partial["missing"] if m["arm"] == "triton_situ"]) == 2  # it never answers
    answered = [json.loads(x) for x in (tmp_path / "o" / "completions.partial.jsonl").read_text().splitlines()]
    assert len(answered) == partial["answered"] and all(a["arm"] == "marlin" and a["content"] == "Answer: B" for a in answered)
    assert not (tmp_path / "o" / "report.json").exists()


def test_print_launch(capsys):
    assert cli.main(["serve", "--print-launch", "--model-path", "/m/k3-nvfp4", "--tp", "16"]) == 0
    out = capsys.readouterr().out
    assert "--moe-runner-backend marlin " in out and out.count("--port 30000") == 1
    assert "--moe-runner-backend triton_situ " in out and out.count("--port 30001") == 1
    assert out.count("--model-path /m/k3-nvfp4 ") == 2 and out.count("--tp-size 16") == 2


def test_first_divergence_and_agreement_units():
    assert first_divergence(list("abc"), list("abc")) is None
    assert first_divergence(list("abc"), list("abd")) == 2
    assert first_divergence(list("ab"), list("abc")) == 2
    a = [TokenLogprob("a", -0.1, {"a": -0.1}), TokenLogprob("b", -1.0, {"b": -1.0, "c": -2.0})]
    b = [TokenLogprob("a", -0.3, {"a": -0.3}), TokenLogprob("c", -0.5, {"c": -0.5, "b": -1.5})]
    ag = token_agreement(a, b)
    assert ag.first_divergence == 1 and ag.aligned == 2 and ag.top1_agree == 1
    assert ag.dlogprob_sum == pytest.approx(0.2 + 0.5) and ag.dlogprob_n == 2


def test_topk_kl_hand_values():
    assert topk_kl({"a": math.log(0.5), "b": math.log(0.5)}, {"a": math.log(0.5), "b": math.log(0.5)}) == 0.0
    # Full mass on {a, b} both sides: the plain KL of (0.5, 0.5) vs (0.25, 0.75).
    kl = topk_kl({"a": math.log(0.5), "b": math.log(0.5)}, {"a": math.log(0.25), "b": math.log(0.75)})
    assert kl == pytest.approx(0.5 * math.log(2) + 0.5 * math.log(0.5 / 0.75), rel=1e-12)


def test_pass_at_1_std():
    m, s = pass_at_1([0.9, 0.8, 1.0])
    assert m == pytest.approx(0.9) and s == pytest.approx(0.1)
    assert pass_at_1([0.7]) == (0.7, 0.0)


@pytest.mark.parametrize("content, kind, expected", [
    ("Reasoning... Answer: A\nWait, no. Answer: C", "mc", "C"),
    ("**Answer:** (B)", "mc", "B"),
    ("so \\boxed{D}", "mc", "D"),
    ("Answer: E", "mc", None),  # not one of 4 choices
    ("Answer: 1,234", "arith", "1234"),
    ("the answer is 42.0.", "arith", "42"),
    ("\\boxed{-17}", "arith", "-17"),
    ("", "arith", None),
    (None, "mc", None),
])
def test_extract_answer(content, kind, expected):
    assert extract_answer(content, kind, 4) == expected


def test_default_prompt_set_ships_and_is_consistent():
    ps = load_prompts(None)
    assert len(ps) == 32 and {p.kind for p in ps} == {"mc", "arith"}
    for p in ps:
        if p.kind == "arith":  # recompute each arithmetic answer from its question
            expr = p.text.split("What is ", 1)[1].split("?", 1)[0] if "What is" in p.text else None
            if expr:
                assert normalize_number(str(eval(expr))) == p.answer  # noqa: S307 - our own data file
        else:
            assert p.answer in "ABCD" and p.num_choices == 4


def test_prompt_file_errors(tmp_path):
    from k3nvfp4.sglang_ext.ab.errors import InputError

    with pytest.raises(InputError, match="file not found"):
        load_prompts(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "choices": ["a", "b"], "answer": "C"}\n')
    with pytest.raises(InputError, match="line 1: mc 'answer' must be one of AB"):
        load_prompts(bad)


def _two_fake_arms(respond_a, respond_b=None):
    return FakeServer(respond_a), FakeServer(respond_b or respond_a)


@pytest.mark.parametrize("kind", ["file", "under_file"])
def test_out_unwritable_refused_before_any_request(tmp_path, capsys, kind):
    """An --out that is a file (or lies under one) is refused in one line, exit 2, before the
    /v1/models check or any completion request; the file is left as it was."""
    blocker = tmp_path / "outfile"
    blocker.write_text("keep me\n")
    out = blocker if kind == "file" else blocker / "sub"
    with FakeServer(arm_responder("marlin")) as sa, FakeServer(arm_responder("triton_situ")) as sb:
        rc = cli.main(["serve", "--arm", f"marlin={sa.url}", "--arm", f"triton_situ={sb.url}", "--no-progress",
                       "--out", str(out)])
        assert sa.requests == [] and sb.requests == []
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith(f"k3nvfp4-ab serve: error: --out {out}: ")
    assert ("exists and is not a directory" if kind == "file" else f"{blocker} is a file") in err
    assert blocker.read_text() == "keep me\n"


def test_preflight_failure_writes_partial(tmp_path, capsys):
    """The pre-flight /v1/models check fails on arm B: partial.json says so (stage pre-flight),
    nothing answered, every request missing; no report.json."""
    with FakeServer(arm_responder("marlin")) as sa:
        url_b = f"http://127.0.0.1:{_free_port()}"
        rc = cli.main(["serve", "--arm", f"marlin={sa.url}", "--arm", f"triton_situ={url_b}", "--retries", "0",
                       "--limit", "3", "--seeds", "2", "--no-progress", "--out", str(tmp_path / "o")])
        assert sa.payloads == []
    err = capsys.readouterr().err
    assert rc == 2 and "arm 'triton_situ'" in err and "partial report:" in err
    partial = json.loads((tmp_path / "o" / "partial.json").read_text())
    assert partial["stage"] == "pre-flight" and partial["error"]["type"] == "EndpointDown"
    assert partial["requests"] == 12 and partial["answered"] == 0 and len(partial["missing"]) == 12
    assert {(m["arm"], m["seed"]) for m in partial["missing"]} == {(a, s) for a in ("marlin", "triton_situ") for s in (0, 1)}
    assert (tmp_path / "o" / "completions.partial.jsonl").read_text() == ""
    assert not (tmp_path / "o" / "report.json").exists()


def _fixed(content, finish="stop", reasoning=None):
    return lambda p: (200, completion(content, finish=finish, reasoning=reasoning), 0)


def test_truncated_request_graded_on_its_answer(tmp_path):
    """The grading rule (grading.GRADING_RULE): finish_reason does not enter the grade. Arm A's
    answers are cut by the token budget after a right 'Answer: B' (scores 1, counted truncated);
    arm B's are cut before any answer (score 0)."""
    pfile = tmp_path / "p.jsonl"
    pfile.write_text(json.dumps(PROMPTS[0]) + "\n")  # gold B
    with FakeServer(_fixed("Answer: B and then", finish="length")) as sa, \
            FakeServer(_fixed("", finish="length", reasoning="Let me think")) as sb:
        assert cli.main(["serve", "--arm", f"a={sa.url}", "--arm", f"b={sb.url}", "--prompts", str(pfile),
                         "--seeds", "2", "--no-progress", "--no-plots", "--out", str(tmp_path / "o")]) == 0
    rep = json.loads((tmp_path / "o" / "report.json").read_text())
    a, b = rep["accuracy"]["a"]["all_graded"], rep["accuracy"]["b"]["all_graded"]
    assert a["pass@1"] == 1.0 and a["truncated_rate"] == 1.0 and a["answered_rate"] == 1.0
    assert b["pass@1"] == 0.0 and b["truncated_rate"] == 1.0 and b["answered_rate"] == 0.0
    assert rep["comparison"]["diff_pp"] == -100.0
    rows = [json.loads(x) for x in (tmp_path / "o" / "completions.jsonl").read_text().splitlines()]
    assert {(r["arm"], r["correct"], r["truncated"]) for r in rows} == {("a", True, True), ("b", False, True)}
    summary = (tmp_path / "o" / "summary.md").read_text()
    assert "a: every graded request was truncated" in summary and "graded on the answers given before the cut" in summary
    assert "b: every graded request was truncated" in summary and "none gave an answer before the cut" in summary
    assert "Nothing was graded" not in summary


def test_nothing_graded_says_so(tmp_path):
    """Every request of both arms truncated before an answer: the summary says nothing was graded,
    and no accuracy comparison (no 'no difference resolved') is made."""
    with FakeServer(_fixed("", finish="length", reasoning="Hmm")) as sa, \
            FakeServer(_fixed("", finish="length", reasoning="Well")) as sb:
        assert cli.main(["serve", "--arm", f"a={sa.url}", "--arm", f"b={sb.url}", "--limit", "4",
                         "--no-progress", "--no-plots", "--out", str(tmp_path / "o")]) == 0
    rep = json.loads((tmp_path / "o" / "report.json").read_text())
    assert rep["comparison"] is None
    assert all(rep["accuracy"][x]["all_graded"]["answered_rate"] == 0 for x in "ab")
    summary = (tmp_path / "o" / "summary.md").read_text()
    assert "**Nothing was graded: no request of either arm gave an answer" in summary and "Raise --max-tokens." in summary
    assert "no difference resolved" not in summary  # no accuracy comparison
    # The logprob verdict (verdict.py) is its own section: these fake arms return no logprobs,
    # so it is undecided, never agree.
    assert "**Verdict: undecided**" in summary and "Verdict: agree" not in summary


def test_free_prompts_no_empty_table(tmp_path):
    """Prompts without gold answers: the accuracy section says nothing was graded, no empty table."""
    pfile = tmp_path / "p.jsonl"
    pfile.write_text(json.dumps({"id": "free-1", "prompt": "Say hi"}) + "\n")
    with FakeServer(_fixed("hi")) as sa, FakeServer(_fixed("hello")) as sb:
        assert cli.main(["serve", "--arm", f"a={sa.url}", "--arm", f"b={sb.url}", "--prompts", str(pfile),
                         "--no-progress", "--no-plots", "--out", str(tmp_path / "o")]) == 0
    summary = (tmp_path / "o" / "summary.md").read_text()
    section = summary.split("## Accuracy (pass@1 over seeds)", 1)[1].split("\n## ", 1)[0]
    assert section.lstrip().startswith("Nothing was graded: no prompt has a gold answer")
    assert "| arm |" not in section
