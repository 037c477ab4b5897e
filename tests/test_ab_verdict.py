"""The serve A/B's verdict (k3nvfp4.sglang_ext.ab.verdict) on hand-made greedy streams, and the
client naming a null / NaN logprob."""

from __future__ import annotations

import json

import pytest

from k3nvfp4.sglang_ext.ab.client import TokenLogprob, parse_completion
from k3nvfp4.sglang_ext.ab.errors import MalformedResponse
from k3nvfp4.sglang_ext.ab.verdict import (DEFAULT_BOUND_NATS, FP16_MANTISSA_BITS, decide, rounding_bound,
                                           verdict_line, verdict_markdown)


def tok(token: str, lp: float, **top: float) -> TokenLogprob:
    return TokenLogprob(token, lp, {token: lp, **top})


A = [tok("x", -0.1, y=-2.5), tok("y", -0.3, z=-1.5), tok("z", -0.05, x=-3.0)]


def test_rounding_bound_is_twice_the_largest_step():
    # bf16 logits in [16, 32): spacing 2^(4-7) = 1/8 -> 1/4; fp16 in [4, 8): 2^(2-10) -> 2^-7.
    assert DEFAULT_BOUND_NATS == rounding_bound() == 0.25
    assert rounding_bound(FP16_MANTISSA_BITS, 8.0) == 2 ** -7
    assert rounding_bound(7, 33.0) == 0.5  # 33 lies in [32, 64)
    with pytest.raises(ValueError):
        rounding_bound(7, 0.0)


def test_identical_streams_within_the_bound_agree():
    b = [tok("x", -0.12, y=-2.4), tok("y", -0.29, z=-1.5), tok("z", -0.05, x=-3.1)]
    v = decide([("p", A, b)], bound=0.05)
    assert v.verdict == "agree" and v.identical == 1 and v.compared == 1
    assert v.max_abs_dlogprob == pytest.approx(0.02)
    assert v.per_prompt[0].worst_position == 0


def test_a_logprob_beyond_the_bound_diverges_even_with_equal_tokens():
    b = [tok("x", -0.1, y=-2.5), tok("y", -0.45, z=-1.2), tok("z", -0.05, x=-3.0)]
    v = decide([("p", A, b)], bound=0.1)
    assert v.verdict == "diverge" and v.beyond_bound == ["p"]
    r = v.per_prompt[0]
    assert r.status == "beyond_bound" and r.worst_position == 1 and r.max_abs_dlogprob == pytest.approx(0.15)
    assert decide([("p", A, b)], bound=0.2).verdict == "agree"  # the same data, a looser bound


def test_a_swap_at_a_near_tie_is_tolerated_and_a_confident_swap_is_not():
    near = [tok("x", -0.6, y=-0.75), tok("q", -0.1)]  # A's margin x over y: 0.15
    b = [tok("y", -0.62, x=-0.66), tok("r", -0.2)]  # B picks y; x within 0.06 of A's
    v = decide([("p", near, b)], bound=0.1)  # 0.15 <= 2 * 0.1
    assert v.verdict == "agree" and v.near_tie == 1 and v.per_prompt[0].first_divergence == 0
    assert v.per_prompt[0].margin == pytest.approx(0.15)
    v = decide([("p", near, b)], bound=0.07)  # |dlp(x)| = 0.06 is within, the margin 0.15 > 0.14 is not
    assert v.verdict == "diverge" and v.divergent == ["p"]
    assert v.per_prompt[0].status == "divergent"


def test_tokens_missing_from_the_other_arms_top_k():
    # B does not return A's token at an aligned position: beyond the bound, named by position.
    b = [tok("x", -0.1, y=-2.5), tok("w", -0.2, z=-1.4)]
    v = decide([("p", A[:2], b)], bound=0.1)
    assert v.verdict == "diverge" and v.per_prompt[0].missing_positions == [1]
    # B's token not among A's top logprobs at the divergence: no margin, so not a near tie.
    b = [tok("x", -0.1, y=-2.5), tok("w", -0.3, y=-0.31)]
    r = decide([("p", A[:2], b)], bound=0.1).per_prompt[0]
    assert r.status == "divergent" and r.margin is None and r.first_divergence == 1


def test_a_stream_that_ends_early_is_divergent():
    r = decide([("p", A, A[:2])], bound=0.1).per_prompt[0]
    assert r.status == "divergent" and r.first_divergence == 2


def test_no_logprobs_is_undecided_not_agreement():
    v = decide([("p", A, None), ("q", None, A)])
    assert v.verdict == "undecided" and not v.agree and v.compared == 0 and v.no_logprobs == ["p", "q"]
    v = decide([("p", A, None), ("q", A, A)])
    assert v.verdict == "agree" and v.compared == 1


def test_bound_must_be_positive():
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="positive number of nats"):
            decide([("p", A, A)], bound=bad)


def test_line_and_markdown_name_the_verdict_and_the_flagged_prompts():
    b = [tok("x", -0.1, y=-2.5), tok("z", -1.4, y=-2.0), tok("z", -0.05)]
    v = decide([("p", A, A), ("q", A, b)], bound=0.1)
    assert v.verdict == "diverge"
    line = verdict_line(v)
    assert line.startswith("verdict: diverge (bound 0.1 nats; 2 of 2 prompts compared: 1 identical")
    # q parts at position 1 but counts as beyond the bound (checked first): the line and the table
    # say that its streams parted too, not just "0 divergent" (seen on the tiny Llamas, issue 40).
    assert "0 divergent, 1 beyond the bound (1 of which also parted);" in line
    md = verdict_markdown(json.loads(json.dumps(v.to_dict())))  # as report.json holds it
    assert "**Verdict: diverge**" in md and "| q | beyond_bound | 1 | 1.2 | 1.7 | 1 |" in md and "| p |" not in md
    assert "| of those beyond the bound: streams also parted | 1 |" in md
    # beyond the bound with identical streams: nothing parted, no clause.
    same = [tok("x", -0.1, y=-2.5), tok("y", -0.9, z=-1.5), tok("z", -0.05, x=-3.0)]
    line = verdict_line(decide([("p", A, same)], bound=0.1))
    assert "0 divergent, 1 beyond the bound;" in line


@pytest.mark.parametrize("raw,what", [("null", "null"), ("NaN", "NaN"), ('"nan"', "NaN")])
def test_client_names_a_null_or_nan_logprob(raw, what):
    body = json.loads('{"choices": [{"message": {"content": "x"}, "finish_reason": "length", "logprobs": {"content": '
                      '[{"token": "a", "logprob": -0.5, "top_logprobs": []}, {"token": "<s>", "logprob": %s, '
                      '"top_logprobs": []}]}}]}' % raw)
    with pytest.raises(MalformedResponse) as e:
        parse_completion(body, where="arm 'b' (http://h)")
    assert str(e.value) == f"arm 'b' (http://h): the logprob of token 1 ('<s>') is {what} (the server computed NaN)"
    body["choices"][0]["logprobs"]["content"][1] = {"token": "b", "logprob": -1.0,
                                                    "top_logprobs": [{"token": "b", "logprob": None}]}
    with pytest.raises(MalformedResponse, match=r"top_logprobs\[0\] \('b'\) of token 1 is null \(the server computed NaN\)"):
        parse_completion(body, where="arm 'b' (http://h)")


def test_serve_writes_the_verdict_and_fail_on_divergence_sets_the_exit_status(tmp_path, capsys):
    """Against local fake servers (tests/ab_fake_server.py): the same answers on both arms agree
    (exit 0 with --fail-on-divergence); the two arms of the end-to-end test diverge (exit 1), and
    report.json, summary.md and the printed line carry the verdict."""
    from ab_fake_server import PROMPTS, FakeServer, arm_responder
    from k3nvfp4.sglang_ext.ab import cli

    pfile = tmp_path / "p.jsonl"
    pfile.write_text("\n".join(json.dumps(p) for p in PROMPTS) + "\n")
    with FakeServer(arm_responder("marlin")) as sa, FakeServer(arm_responder("marlin")) as sa2, \
            FakeServer(arm_responder("triton_situ")) as sb:
        common = ["--prompts", str(pfile), "--retries", "0", "--no-progress", "--no-plots", "--fail-on-divergence"]
        rc_same = cli.main(["serve", "--arm", f"a={sa.url}", "--arm", f"b={sa2.url}", *common, "--out", str(tmp_path / "same")])
        out_same = capsys.readouterr().out
        rc_diff = cli.main(["serve", "--arm", f"a={sa.url}", "--arm", f"b={sb.url}", *common, "--out", str(tmp_path / "diff")])
        captured = capsys.readouterr()
    assert rc_same == 0 and "verdict: agree (bound 0.25 nats; 3 of 3 prompts compared: 3 identical" in out_same
    assert rc_diff == 1 and "--fail-on-divergence: the verdict is 'diverge'" in captured.err
    rep = json.loads((tmp_path / "diff" / "report.json").read_text())
    v = rep["verdict"]
    assert v["verdict"] == "diverge" and v["bound_nats"] == DEFAULT_BOUND_NATS and v["identical"] == 1
    assert sorted(v["divergent"] + v["beyond_bound"]) == sorted(p["id"] for p in PROMPTS if p["id"] != "mc-1")
    assert "**Verdict: diverge**" in (tmp_path / "diff" / "summary.md").read_text()
    assert captured.out.rstrip().splitlines()[-1].startswith("verdict: diverge")


def test_dlogprob_bound_must_be_positive_on_the_command_line(tmp_path, capsys):
    from k3nvfp4.sglang_ext.ab import cli

    rc = cli.main(["serve", "--arm", "a=http://127.0.0.1:9", "--arm", "b=http://127.0.0.1:9", "--dlogprob-bound", "0",
                   "--out", str(tmp_path / "o")])
    assert rc == 2 and "--dlogprob-bound must be a positive number of nats, got 0.0" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
