"""The A/B serve tool against real SGLang servers (tiny hand-built Llamas on CPU), not fake ones.

Two ``sglang.launch_server`` processes (tests/real_server.py: started with the documented CPU
command, ``python -P -m k3nvfp4.sglang_ext.cpu_server``, the production launch for one node plus
the CPU flags and workarounds) serve arm A and arm B: the same tiny Llama (real_server.write_tiny_llama: it answers every chat
prompt "Answer: X", the letter X set by the prompt's length, then follows a random bigram chain),
B with its lm_head perturbed (noise, and its letters turned by 60 degrees), so their greedy
streams share some tokens and not others, and their letters agree on some questions and not on
others. The report is checked against values computed here from the servers' own answers;
GPQA's CSV and NeMo-Skills' JSONL (made-up fixtures) run through both arms with every statistic
of the report recomputed from completions.jsonl, and none of them degenerate; then three faults
against a real server: a request it rejects, a timeout, and a server killed mid-run. What only a
GPU can show (K3 accuracy, the kernels' speed) is not here: docs/ab.md.
"""

from __future__ import annotations

import csv
import json
import math
import re
import threading
import time
from pathlib import Path

import pytest

from k3nvfp4.sglang_ext.ab import cli
from real_server import SGLangServer, write_tiny_llama

MAX_TOKENS = 12
TOP = 5
PROMPTS = [
    {"id": "free-1", "prompt": "w001 w002 w003"},
    {"id": "free-2", "prompt": "w100 w017"},
    {"id": "ar-1", "kind": "arith", "question": "w042 w043 w044", "answer": "7"},
    {"id": "mc-1", "question": "w200", "choices": ["w001", "w002"], "answer": "A"},
]


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Arms A and B, started together (each waits ~20-40 s for its model on 2 cores)."""
    d = tmp_path_factory.mktemp("llamas")
    a = SGLangServer(write_tiny_llama(d / "a", seed=0), d / "a.log")
    b = SGLangServer(write_tiny_llama(d / "b", seed=0, perturb_lm_head=0.1, turn_letters=60.0), d / "b.log")
    started = []
    try:
        for s in (a, b):
            started.append(s.start())
        for s in started:
            s.wait_ready()
        yield a, b
    finally:
        SGLangServer.stop_all(started)


@pytest.fixture
def prompt_file(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def _serve(a, b, out, prompt_file, *extra) -> int:
    return cli.main(["serve", "--arm", f"a={a.url}", "--arm", f"b={b.url}", "--prompts", str(prompt_file),
                     "--no-progress", "--out", str(out), *extra])


def _greedy(server, text: str) -> list[dict]:
    """Arm's greedy token stream for one user message, asked directly (the A/B's seed-0 request)."""
    body = server.chat({"model": "m", "messages": [{"role": "user", "content": text}], "max_tokens": MAX_TOKENS,
                        "temperature": 0.0, "seed": 0, "logprobs": True, "top_logprobs": TOP})
    return body["choices"][0]["logprobs"]["content"]


def test_serve_report_matches_the_servers_answers(servers, prompt_file, tmp_path):
    from k3nvfp4.sglang_ext.ab.prompts import load_prompts

    a, b = servers
    out = tmp_path / "ab"
    assert _serve(a, b, out, prompt_file, "--seeds", "2", "--top-logprobs", str(TOP), "--max-tokens",
                  str(MAX_TOKENS)) == 0
    rep = json.loads((out / "report.json").read_text())
    texts = {p.id: p.text for p in load_prompts(str(prompt_file))}

    # Independently: each arm's greedy stream, first divergence, aligned positions, top-1 agreement.
    identical, aligned, top1_same, per_prompt = 0, 0, 0, {r["id"]: r for r in rep["per_prompt"]}
    for pid, text in texts.items():
        ta, tb = _greedy(a, text), _greedy(b, text)
        assert ta and tb and all(len(t["top_logprobs"]) == TOP for t in ta + tb)
        sa, sb = [t["token"] for t in ta], [t["token"] for t in tb]
        d = next((i for i, (x, y) in enumerate(zip(sa, sb)) if x != y), None)
        if d is None and len(sa) != len(sb):
            d = min(len(sa), len(sb))
        row = per_prompt[pid]
        assert (row["first_divergence"], row["tokens_a"], row["tokens_b"]) == (d, len(sa), len(sb)), pid
        identical += d is None
        n = min(len(sa), len(sb)) if d is None else min(d + 1, len(sa), len(sb))
        aligned += n
        for i in range(n):
            best = [max(t["top_logprobs"], key=lambda x: x["logprob"])["token"] for t in (ta[i], tb[i])]
            top1_same += best[0] == best[1]
    g = rep["greedy"]
    assert g["prompts"] == len(PROMPTS) and g["identical_token_streams"] == identical
    assert g["aligned_positions"] == aligned and math.isclose(g["top1_agreement"], top1_same / aligned)
    assert g["prompts_without_logprobs"] == {"a": 0, "b": 0}
    # The arms are neither equal nor unrelated: some greedy tokens agree, some prompt diverges.
    assert aligned > len(PROMPTS) and identical < len(PROMPTS)

    # Every request answered and recorded: 4 prompts x 2 seeds per arm, greedy content as served.
    comps = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    assert len(comps) == 2 * 2 * len(PROMPTS) and {c["arm"] for c in comps} == {"a", "b"}
    assert rep["accuracy"]["a"]["requests"] == rep["accuracy"]["b"]["requests"] == 2 * len(PROMPTS)
    for c in comps:
        assert c["finish_reason"] in ("stop", "length") and c["completion_tokens"] <= MAX_TOKENS
    for name in ("divergence_hist.png", "accuracy.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (out / "partial.json").exists()


GPQA_FIXTURES = Path(__file__).resolve().parent / "fixtures" / "gpqa"
GPQA_MAX_TOKENS, GPQA_SEEDS = 8, 2


def _pct(xs: list[float], q: float) -> float:
    """Percentile by linear interpolation between order statistics at (n - 1) q, written out."""
    xs = sorted(xs)
    pos = (len(xs) - 1) * q / 100
    lo = math.floor(pos)
    return xs[lo] + (pos - lo) * (xs[min(lo + 1, len(xs) - 1)] - xs[lo])


def _sample_std(xs: list[float]) -> float:
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def _check_gpqa_report(out, gold: dict[str, str]) -> dict:
    """Every statistic of report.json recomputed here from completions.jsonl and the gold letters."""
    import numpy as np
    from scipy.stats import bootstrap

    rep = json.loads((out / "report.json").read_text())
    rows = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    qs, seeds = list(gold), range(GPQA_SEEDS)
    by = {(r["arm"], r["seed"], r["prompt_id"]): r for r in rows}
    assert len(rows) == 2 * len(qs) * GPQA_SEEDS and set(by) == {(a, s, q) for a in "ab" for s in seeds for q in qs}
    for r in rows:
        assert r["finish_reason"] in ("stop", "length") and 0 < r["completion_tokens"] <= GPQA_MAX_TOKENS
        # The tiny Llama opens every completion with an answer line, and never a think-end tag: the
        # production launch's reasoning parser (kimi_k3) returns it all as reasoning_content, where
        # the answer is read when content is empty. The graded answer is its letter.
        assert not r["content"] and r["answer_source"] == "reasoning_content"
        assert re.match(r"\s*Answer: [A-D] ", r["reasoning_content"]), r["reasoning_content"]
        assert r["answer"] == re.findall(r"Answer: ([A-D])(?![A-Za-z0-9])", r["reasoning_content"])[-1]
    # Confident letters: the sampled seed answers as the greedy one (SGLang on CPU does not use the
    # request's seed, so this is what makes a rerun's report the same).
    assert all(by[(a, s, q)]["answer"] == by[(a, 0, q)]["answer"] for a in "ab" for s in seeds for q in qs)
    grades = {a: [[float(by[(a, s, q)]["answer"] == gold[q]) for s in seeds] for q in qs] for a in "ab"}
    for a in "ab":
        st = rep["accuracy"][a]["all_graded"]
        per_seed = [sum(grades[a][i][s] for i in range(len(qs))) / len(qs) for s in seeds]
        assert st["prompts"] == len(qs) and st["per_seed"] == per_seed
        assert math.isclose(st["pass@1"], sum(per_seed) / GPQA_SEEDS)
        assert math.isclose(st["sem"], _sample_std(per_seed) / math.sqrt(GPQA_SEEDS), abs_tol=1e-15)
        mine = [by[(a, s, q)] for q in qs for s in seeds]
        assert math.isclose(st["truncated_rate"], sum(r["finish_reason"] == "length" for r in mine) / len(mine))
        assert math.isclose(st["empty_answer_rate"], sum(r["answer"] is None for r in mine) / len(mine))
        majority = 0.0
        for q in qs:
            counts: dict[str, int] = {}
            for s in seeds:
                if by[(a, s, q)]["answer"] is not None:
                    counts[by[(a, s, q)]["answer"]] = counts.get(by[(a, s, q)]["answer"], 0) + 1
            top = [x for x, c in counts.items() if c == max(counts.values())]
            majority += sum(x == gold[q] for x in top) / len(top) if top else 0.0
        assert math.isclose(st["majority"], majority / len(qs))
        # Speed, from the same requests' latencies, usage counts and start / end times.
        sp = rep["speed"][a]
        lat = [r["latency_s"] for r in mine]
        for k in (50, 90, 99):
            assert math.isclose(sp["latency_s"][f"p{k}"], _pct(lat, k), rel_tol=1e-12)
        rates = [r["completion_tokens"] / r["latency_s"] for r in mine]
        for k in (10, 50, 90):
            assert math.isclose(sp["tokens_per_s_per_request"][f"p{k}"], _pct(rates, k), rel_tol=1e-12)
        total = sum(r["completion_tokens"] for r in mine)
        span = max(r["end_s"] for r in mine) - min(r["start_s"] for r in mine)
        assert sp["total_completion_tokens"] == total and math.isclose(sp["aggregate_tokens_per_s"], total / span)
        assert all(math.isclose(r["end_s"] - r["start_s"], r["latency_s"], rel_tol=1e-9) for r in mine)
    # The paired comparison of b against a.
    c = rep["comparison"]
    d = [sum(grades["b"][i]) / GPQA_SEEDS - sum(grades["a"][i]) / GPQA_SEEDS for i in range(len(qs))]
    diff = 100 * sum(d) / len(d)
    se = 100 * _sample_std(d) / math.sqrt(len(d))
    assert math.isclose(c["diff_pp"], diff, abs_tol=1e-12) and math.isclose(c["se_pp"], se, abs_tol=1e-12)
    if se == 0 and diff == 0:
        assert c["sigmas"] is None
    else:
        assert math.isclose(c["sigmas"], diff / se)
    b = c["bootstrap"]
    ci = bootstrap((np.array(d),), np.mean, n_resamples=b["resamples"], method="percentile", vectorized=True,
                   rng=np.random.default_rng(b["seed"])).confidence_interval
    assert all(math.isclose(x, 100 * y, abs_tol=1e-12) for x, y in zip(c["ci95_pp"], (ci.low, ci.high)))
    assert c["ci95_pp"][0] <= diff <= c["ci95_pp"][1]
    a_only = sum(grades["a"][i][0] > grades["b"][i][0] for i in range(len(qs)))
    b_only = sum(grades["b"][i][0] > grades["a"][i][0] for i in range(len(qs)))
    n = a_only + b_only
    p = min(1.0, 2 * sum(math.comb(n, i) for i in range(min(a_only, b_only) + 1)) / 2 ** n) if n else 1.0
    assert (c["mcnemar"]["a_only"], c["mcnemar"]["b_only"]) == (a_only, b_only)
    assert math.isclose(c["mcnemar"]["p_value"], p)
    resolved = c["ci95_pp"][0] > 0 or c["ci95_pp"][1] < 0
    assert c["verdict"].startswith("no difference resolved") != resolved and c["verdict"] in (out / "summary.md").read_text()
    # Not degenerate: an arm right on some answers and wrong on others, every answer extracted, the
    # arms' greedy letters apart on some question and their grades on one at least (McNemar), and
    # an interval of non-zero width.
    assert any(0 < rep["accuracy"][a]["all_graded"]["pass@1"] < 1 for a in "ab")
    assert all(rep["accuracy"][a]["all_graded"]["empty_answer_rate"] == 0 for a in "ab")
    assert any(by[("a", 0, q)]["answer"] != by[("b", 0, q)]["answer"] for q in qs) and a_only + b_only > 0
    assert c["ci95_pp"][0] < c["ci95_pp"][1]
    return rep


@pytest.mark.parametrize("name", ["gpqa_sample.csv", "nemo_skills_gpqa_sample.jsonl"])
def test_gpqa_formats_through_both_arms(servers, tmp_path, name):
    """GPQA's CSV and NeMo-Skills' JSONL (made-up fixtures) through both real servers, 2 seeds,
    8 new tokens: the report's statistics recomputed from completions.jsonl. Every completion
    answers (the tiny Llama's "Answer: X", X from the prompt's length), arm B's letters turned by
    60 degrees from A's: measured, greedy A 2/4 right and B 1/4 on the CSV (McNemar 2 / 1),
    A 1/4 and B 0/4 on the JSONL (1 / 0). A planted drop on 20 questions: test_ab_datasets.py."""
    a, b = servers
    path = GPQA_FIXTURES / name
    out = tmp_path / "ab"
    assert _serve(a, b, out, path, "--seeds", str(GPQA_SEEDS), "--max-tokens", str(GPQA_MAX_TOKENS),
                  "--choice-seed", "3", "--no-plots") == 0
    if name.endswith(".csv"):
        with open(path, newline="") as f:
            recs = list(csv.DictReader(f))
        gold = {}
        rep = json.loads((out / "report.json").read_text())
        for r, row in zip(recs, rep["per_prompt"]):  # the gold letter is where the recorded order put the correct answer
            assert row["id"] == r["Record ID"] and sorted(row["choice_order"]) == [0, 1, 2, 3]
            gold[row["id"]] = "ABCD"[row["choice_order"].index(0)]
            assert row["gold"] == gold[row["id"]]
        assert rep["dataset"]["format"] == "gpqa-csv" and rep["dataset"]["choice_seed"] == 3
    else:
        gold = {f"line-{i:04d}": json.loads(x)["expected_answer"] for i, x in enumerate(path.read_text().splitlines(), 1)}
    rep = _check_gpqa_report(out, gold)
    assert rep["dataset"]["prompt_template"]["source"] == "built-in mcq-4choices"
    assert rep["greedy"]["prompts"] == len(gold) and rep["config"]["prompt_set"] == str(path)


def _partial(out) -> dict:
    p = json.loads((out / "partial.json").read_text())
    assert p["complete"] is False and p["answered"] + len(p["missing"]) == p["requests"]
    assert not (out / "report.json").exists()
    return p


def test_rejected_request_is_named_with_a_partial_report(servers, prompt_file, tmp_path, capsys):
    a, b = servers
    out = tmp_path / "ab"
    # 600 new tokens do not fit the 512-token context: SGLang answers HTTP 400, never retried.
    assert _serve(a, b, out, prompt_file, "--max-tokens", "600", "--retries", "3") == 2
    err = capsys.readouterr().err
    assert "HTTP 400" in err and "partial report:" in err
    p = _partial(out)
    assert p["error"]["type"] == "ServerError" and p["missing"]


def test_timeout_is_named_with_a_partial_report(servers, prompt_file, tmp_path, capsys):
    a, b = servers
    out = tmp_path / "ab"
    # 1 s: /v1/models (the reachability check) answers well within it even on a loaded CI machine;
    # 400 new tokens take several seconds on CPU.
    assert _serve(a, b, out, prompt_file, "--max-tokens", "400", "--timeout", "1", "--retries", "1",
                  "--backoff", "0.05", "--concurrency", "1") == 2
    err = capsys.readouterr().err
    assert "no answer within --timeout 1 s (2 attempt(s))" in err and "partial report:" in err
    assert _partial(out)["error"]["type"] == "EndpointTimeout"


def test_server_killed_mid_run_gives_a_partial_report(servers, prompt_file, tmp_path, capsys):
    """Last in the module: it kills arm B's server."""
    a, b = servers
    out = tmp_path / "ab"
    rc = {}
    posts = lambda: b.log_tail(10**7).count("POST /v1/chat/completions")  # noqa: E731
    before = posts()
    # Sequential requests long enough (50 tokens) that the run is still going a poll (50 ms) after
    # B's first answer, when B is killed.
    run = threading.Thread(target=lambda: rc.update(v=_serve(a, b, out, prompt_file, "--seeds", "4", "--max-tokens",
                                                               "50", "--concurrency", "1", "--retries", "1",
                                                               "--backoff", "0.2")))
    run.start()
    deadline = time.monotonic() + 60
    while posts() < before + 1 and time.monotonic() < deadline:  # B has answered one of this run's requests
        time.sleep(0.05)
    b.kill()
    run.join(timeout=120)
    assert not run.is_alive() and rc["v"] == 2
    err = capsys.readouterr().err
    assert "arm 'b'" in err and ("cannot connect" in err or "connection failed" in err) and "partial report:" in err
    p = _partial(out)
    assert p["error"]["type"] == "EndpointDown" and 0 < p["answered"] < p["requests"]
    assert any(m["arm"] == "b" for m in p["missing"])
