"""The plugin's MoE backends in real SGLang server processes, on CPU: the synthetic Kimi-K3
checkpoint, cast to NVFP4 and as the MXFP4 release, served over HTTP, and a server A/B through
the MoE layer on prompts of more than 512 tokens, decided by the A/B's own verdict.

Every server is started with the documented CPU command, ``python -P -m
k3nvfp4.sglang_ext.cpu_server`` (tests/real_server.py): the production launch for one node plus
the CPU flags and workarounds, the plugin found through its entry point in the spawned scheduler,
the Triton MoE kernels in Triton's interpreter. Its diagnostic hook (K3NVFP4_RECORD_MOE_CALLS)
records every fused_moe_nvfp4 call of the server's processes: that the MoE layers are served by
the project's kernels, with which weight layout, finite, and SGLang's loading timeout as the
plugin set it from K3NVFP4_LOAD_TIMEOUT_S.

Four servers, started together once for the module (one K3 server takes about 38 CPU-s to
start; started together they share the cores):
- ``nvfp4``: the cast on ``triton_situ`` (the ModelOpt NVFP4 layout, E5M3_16 scale words);
- ``reference``: the MXFP4 release on ``torch_reference`` (kernels/moe_torch_backend.py: plain
  torch, its own decode of the release's nibbles and E8M0 exponents, no Triton, no kernel layout);
- ``perturbed``: the release on ``triton_situ`` (its own E8M0_32 layout) with
  ``activation_situ_beta`` 4.0 -> PERTURBED_BETA in a copy of its config.json: the negative control;
- ``e4m3``: the cast on ``triton_situ`` in the Hopper W4A8 mode (``K3NVFP4_ACT_QUANT=e4m3``).
``k3nvfp4-ab serve --fail-on-divergence`` (greedy, logprobs) compares reference vs nvfp4, two
implementations AND two checkpoints (the cast is exact, so the same model): verdict agree, exit 0;
then reference vs perturbed on the short prompt (AB_RUNS): verdict diverge, exit 1. The two
runs share the reference server one after the other with different batching, and its streams
for the prompts both runs ask must come out the same in both. Last, reference vs e4m3 on two
short prompts with the FP8 bound (below): verdict agree, exit 0, logprobs not bit-equal.
The synthetic model has no MLA layer (two layers: dense, then KDA + MoE), so SGLang's MLA decode
kernels are not reached. Prompts past one 16-token KDA sub-chunk came back NaN before the CPU
workaround ``_interpreter_bf16_dot`` (docs/serving.md); the long prompts keep it proven.

The bound (DLOGPROB_BOUND, docs/ab.md "The verdict"). On CPU the servers run fp16. Both backends
compute the same real-valued MoE with fp32 dots; they differ by the order of the fp32 sums and,
through it, by a rounding step of the fp16 intermediate or output now and then. The MoE is the
last layer: the difference reaches no later position, only this position's logits through the
final norm and lm_head, which round to fp16 again. Logits below 8 (this model's range) have an
fp16 step of at most 2^-8; a logprob moves by at most twice the largest logit change
(rounding_bound(10, 8) = 2^-7), and twice that for the two roundings: 2^-6 nats.
Measured (2-core CPU, `pytest -s` prints the figures): reference vs cast `agree`, 2 of 2 streams identical (one prompt of 522 tokens), max |delta logprob| 0.0, exit 0; negative control `diverge`, 1 of 2 streams identical (first divergence at position 1), both prompts beyond the bound, max |delta logprob| 0.148 (9x the bound), exit 1; the reference's streams equal in both runs. In `make test` (two workers, 2 cores, 2026-12-06) the file took 188 s beside the static report's compiles with three servers, 199 s wall / 225 CPU-s with four (372 s before the servers slept while idle: --sleep-on-idle, docs/serving.md): the servers' start 86-94 s of it, the A/B runs 75-78 s; a 512-token prefill alone costs about 35 s of the interpreter's KDA kernels (measured on the torch_reference server alone; triton_situ interprets its MoE on top).

The W4A8 bound (DLOGPROB_BOUND_E4M3 = 2^-5 nats, docs/ab.md). FP8 activations are not a rounding
of the last layer's logits: every token and every SiTU intermediate is rounded to E4M3 (3
mantissa bits: up to 2^-4 relative per element) before a GEMM, which moves the MoE output by 3-5 %
normwise (docs/w4a8.md), and no closed form carries that through the final norm and lm_head of
a given model. The bound is measured and checked from both sides on these servers (2-core CPU,
2026-12-06): reference vs e4m3 gave max |delta logprob| 0.0069-0.0084 nats on three short prompts
(4 tokens, identical streams), so 2^-5 leaves 3.7x; GEMM2's row factor one binade high (w2's
``row_scale`` x 2 in moe_w4a8_details/prep.py) gave 0.064-0.348 nats, and the SiTU-beta control
0.148: both beyond it. On a real model the bound is the GPU A/B's to set (docs/ab.md).

What the cast-vs-release comparison through triton_situ alone (the earlier fourth server) proved
is now covered by the reference arm (a layout bug shared by both triton_situ paths would make the
reference arm diverge from the cast) and, for the release's E8M0 layout in triton_situ, by the
layer- and model-level tests of tests/test_model_class.py (the release's part).
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass

import pytest

from k3nvfp4.sglang_ext.ab import cli
from k3nvfp4.sglang_ext.ab.verdict import FP16_MANTISSA_BITS, rounding_bound
from real_server import SGLangServer

CKPT_SHAPE = dict(num_layers=2, num_experts=8, hidden_size=64, intermediate_size=64, top_k=4)
LOAD_TIMEOUT_S = 1234  # SGLang's default is 480
NEW_TOKENS = 3
# The CPU workarounds of k3nvfp4/sglang_ext/cpu/pythonpath/sitecustomize.py a K3 server needs, each
# of which must take effect (a newer SGLang that moves what one answers fails here, by name).
WORKAROUNDS = {"_cuda_stream", "_sgl_kernel_cpu_ops", "_autotuner_first_config", "_kda_triton_kernels",
               "_kda_conv_update", "_fla_jit_math", "_kda_libdevice", "_interpreter_bf16_dot", "_count_moe_calls"}
# name -> (checkpoint, --moe-runner-backend, extra environment)
SERVERS = {"nvfp4": ("nvfp4", "triton_situ", {}), "reference": ("mxfp4", "torch_reference", {}),
           "perturbed": ("mxfp4_beta", "triton_situ", {}),
           "e4m3": ("nvfp4", "triton_situ", {"K3NVFP4_ACT_QUANT": "e4m3"})}
PERTURBED_BETA = 2.0  # activation_situ_beta of the negative control (the model's is 4.0)
# The verdict's bound (module docstring): two fp16 rounding steps of logits below 8.
DLOGPROB_BOUND = 2 * rounding_bound(FP16_MANTISSA_BITS, 8.0)  # 2^-6 nats
# The W4A8 (e4m3) arm's bound, FP8 activations (module docstring, docs/ab.md): 2^-5 nats.
DLOGPROB_BOUND_E4M3 = 2.0**-5
AB_TOKENS = 4  # the control diverges by position 3 (measured); fewer tokens keep the servers' time down
LONG_WORDS = 520  # a user message of 520 words: a prompt of at least 512 tokens


def _words(n: int, step: int) -> str:
    return " ".join(f"w{(step * i) % 240:03d}" for i in range(n))


AB_PROMPTS = [{"id": "long", "prompt": _words(LONG_WORDS, 7)}, {"id": "short", "prompt": "w100 w017 w042 w007"}]
SHORT2 = {"id": "short2", "prompt": "w001 w002 w003"}  # the W4A8 run's second prompt


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    """The synthetic release (MXFP4), its NVFP4 cast, and the release with a perturbed SiTU beta."""
    from k3nvfp4.checkpoint.cli import main as cast_main
    from k3nvfp4.checkpoint.synthetic import write_synthetic_checkpoint

    root = tmp_path_factory.mktemp("k3")
    mxfp4 = write_synthetic_checkpoint(root / "mxfp4", num_shards=2, seed=7, **CKPT_SHAPE)
    nvfp4 = root / "nvfp4"
    assert cast_main(["--source_ckpt", str(mxfp4), "--output_ckpt", str(nvfp4), "--workers", "1",
                      "--no-progress"]) == 0
    perturbed = root / "mxfp4_beta"
    shutil.copytree(mxfp4, perturbed)
    cfg = json.loads((perturbed / "config.json").read_text())
    assert cfg["text_config"]["activation_situ_beta"] == 4.0
    cfg["text_config"]["activation_situ_beta"] = PERTURBED_BETA
    (perturbed / "config.json").write_text(json.dumps(cfg, indent=2))
    return {"nvfp4": nvfp4, "mxfp4": mxfp4, "mxfp4_beta": perturbed}


@pytest.fixture(scope="module")
def servers(k3, tmp_path_factory):
    """name -> (server, its fused_moe_nvfp4 call records, its applied-workarounds file); all
    started before any is waited for, each with the documented CPU command
    (k3nvfp4.sglang_ext.cpu_server), which writes the tiny K3 tokenizer into the cache folder."""
    d = tmp_path_factory.mktemp("k3servers")
    out, started = {}, []
    for name, (ckpt, backend, extra_env) in SERVERS.items():
        calls, applied = d / f"{name}.moe_calls.jsonl", d / f"{name}.workarounds.txt"
        server = SGLangServer(k3[ckpt], d / f"{name}.log", backend=backend,
                              env={"K3NVFP4_LOAD_TIMEOUT_S": str(LOAD_TIMEOUT_S), "K3NVFP4_CACHE_DIR": str(d / "cache"),
                                   "K3NVFP4_RECORD_MOE_CALLS": str(calls), "K3NVFP4_CPU_WORKAROUNDS_LOG": str(applied),
                                   **extra_env},
                              ready_timeout_s=600)
        assert f"--moe-runner-backend {backend}" in " ".join(server.cmd)
        out[name] = (server, calls, applied)
    try:
        for server, _, _ in out.values():
            started.append(server.start())
        for server in started:
            server.wait_ready()
        yield out
    finally:
        SGLangServer.stop_all(started)


def _records(calls) -> list[dict]:
    return [json.loads(x) for x in calls.read_text().splitlines()] if calls.exists() else []


@pytest.mark.parametrize("name,scale_format", [("nvfp4", "e5m3/16"), ("perturbed", "e8m0/32")])
def test_triton_situ_serves_k3_over_http(servers, name, scale_format):
    """The cast and the release, each in its own layout, through the project's kernels in the
    server's worker process (the perturbed release differs from the release in one config value
    only, which the kernels read as the activation's beta)."""
    server, calls, applied = servers[name]
    log = server.log_tail(10**7)
    assert "k3nvfp4: MoE runner backend triton_situ active: 8 local of 8 experts" in log
    assert f"kernel-native FP4 tiles (bit-placed e2m1, {scale_format} block scales)" in log  # its own layout, named
    before = len(_records(calls))  # the module's servers are shared: only this request's calls
    body = server.chat({"model": "k3", "messages": [{"role": "user", "content": "w001 w002 w003"}],
                        "max_tokens": NEW_TOKENS, "temperature": 0.0, "logprobs": True, "top_logprobs": 3},
                       timeout_s=300)
    lps = [t["logprob"] for t in body["choices"][0]["logprobs"]["content"]]
    assert all(isinstance(x, float) and math.isfinite(x) for x in lps), lps
    missing = WORKAROUNDS - set(applied.read_text().split())
    assert not missing, f"CPU workarounds that no longer take effect with this SGLang: {sorted(missing)}"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == NEW_TOKENS
    records = _records(calls)[before:]
    # One MoE layer (layer 1; layer 0 is dense): one call for the prefill, one per decoded token
    # after the first, all in a worker process.
    assert len(records) == NEW_TOKENS, records
    assert server.proc.pid not in {r["pid"] for r in records} and all(r["out_finite"] for r in records)
    assert records[0]["tokens"] >= 3 and [r["tokens"] for r in records[1:]] == [1] * (NEW_TOKENS - 1)
    for r in records:
        assert r["experts"] == 8 and r["hidden"] == CKPT_SHAPE["hidden_size"]
        assert r["scale_format"] == scale_format  # the release is served in its own E8M0 layout
        assert r["weights"] == "NVFP4MoEWeights"  # W4A16, the default mode
        assert r["load_timeout_s"] == LOAD_TIMEOUT_S


@dataclass(frozen=True)
class ABRun:
    """One ``k3nvfp4-ab serve`` run against the reference server: its prompts, how many requests
    are in flight at once, and the verdict's bound (nats)."""

    prompts: list
    concurrency: int
    bound: float


# The A/B runs share the reference server, one after the other, with different batching:
# against nvfp4 every request of both arms is in flight at once (the reference server prefills
# both prompts in one batch), against the others one request at a time (each prompt alone). The
# reference's streams must come out the same in every run: its outputs do not depend on its
# batches, so the verdicts compare each triton_situ server with the same reference.
# The negative control runs the short prompt only: a SiTU beta of 2.0 moves its logprobs far
# beyond the bound within AB_TOKENS (measured: 9x), and each 512-token prefill costs ~75 s of
# the interpreter's KDA kernels on 2 cores, twice more (reference and control) for a run on the
# long prompt. The 512-token agreement is the reference-vs-cast run's to prove.
# The W4A8 run (short prompts, as the control's) shows the FP8 arm within its bound and not
# bit-equal to the reference (W4A16 is: max |delta logprob| 0.0).
_SHORT = [p for p in AB_PROMPTS if p["id"] == "short"]
AB_RUNS = {"nvfp4": ABRun(AB_PROMPTS, 2 * len(AB_PROMPTS), DLOGPROB_BOUND),
           "perturbed": ABRun(_SHORT, 1, DLOGPROB_BOUND),
           "e4m3": ABRun([*_SHORT, SHORT2], 1, DLOGPROB_BOUND_E4M3)}


@pytest.fixture(scope="module")
def ab_runs(servers, tmp_path_factory):
    """``k3nvfp4-ab serve --fail-on-divergence`` against the reference, first with nvfp4, then with
    the negative control, then with the W4A8 server (its own bound). name -> (exit status,
    report.json, summary.md, completions by (arm, prompt id))."""
    d = tmp_path_factory.mktemp("k3ab")
    ref = servers["reference"][0]
    out = {}
    for other, run in AB_RUNS.items():
        prompts = d / f"{other}.prompts.jsonl"
        prompts.write_text("".join(json.dumps(p) + "\n" for p in run.prompts))
        rc = cli.main(["serve", "--arm", f"reference={ref.url}", "--arm", f"{other}={servers[other][0].url}",
                       "--prompts", str(prompts), "--seeds", "1", "--max-tokens", str(AB_TOKENS),
                       "--top-logprobs", "5", "--timeout", "1800", "--no-progress", "--no-plots",
                       "--concurrency", str(run.concurrency), "--dlogprob-bound", str(run.bound),
                       "--fail-on-divergence", "--out", str(d / other)])
        rows = [json.loads(x) for x in (d / other / "completions.jsonl").read_text().splitlines()]
        out[other] = (rc, json.loads((d / other / "report.json").read_text()),
                      (d / other / "summary.md").read_text(), {(r["arm"], r["prompt_id"]): r for r in rows})
    return out


def test_reference_and_triton_situ_agree_on_512_token_prompts(servers, ab_runs):
    """The release on the plain-torch backend and the cast on triton_situ, prompts of 512 tokens
    and more: the A/B's verdict is agree (identical greedy streams, logprobs within the bound),
    and --fail-on-divergence exits 0."""
    rc, rep, summary, _ = ab_runs["nvfp4"]
    g, v = rep["greedy"], rep["verdict"]
    print(json.dumps({k: g[k] for k in ("identical_token_streams", "aligned_positions", "max_abs_dlogprob")}),
          json.dumps({k: v[k] for k in ("verdict", "bound_nats", "identical", "near_tie", "max_abs_dlogprob")}))
    assert rc == 0 and v["verdict"] == "agree" and v["bound_nats"] == DLOGPROB_BOUND
    assert "**Verdict: agree**" in summary
    assert g["prompts_without_logprobs"] == {"reference": 0, "nvfp4": 0}
    assert v["compared"] == v["identical"] == len(AB_PROMPTS) and g["first_divergence_positions"] == []
    assert g["aligned_positions"] == len(AB_PROMPTS) * AB_TOKENS and g["top1_agreement"] == 1.0
    assert g["dlogprob_missing"] == 0 and g["max_abs_dlogprob"] <= DLOGPROB_BOUND, g
    # The reference arm really ran the plain-torch backend: its load log says so, and no MoE call
    # of its processes went through the Triton kernels.
    ref, calls, _ = servers["reference"]
    assert "k3nvfp4: MoE runner backend torch_reference active: 8 local of 8 experts" in ref.log_tail(10**7)
    assert "MoE runner backend triton_situ active" not in ref.log_tail(10**7)
    assert _records(calls) == []
    # The nvfp4 server ran the long prompts through the project's kernels, finite, in one prefill
    # call of at least 512 tokens each (a request's prefill may be batched with the others').
    nv = _records(servers["nvfp4"][1])
    assert nv and all(r["out_finite"] for r in nv) and max(r["tokens"] for r in nv) >= 512


def test_reference_outputs_do_not_depend_on_its_batches(ab_runs):
    """The reference's greedy streams (text and token count) are the same in every A/B run that
    asks the same prompt, whose requests reached it in different batches (ABRun.concurrency)."""
    a = ab_runs["nvfp4"][3]
    for other in ("perturbed", "e4m3"):
        b = ab_runs[other][3]
        for p in _SHORT:
            ra, rb = a[("reference", p["id"])], b[("reference", p["id"])]
            assert ra["content"] == rb["content"] and ra["completion_tokens"] == rb["completion_tokens"] == AB_TOKENS, (other, p["id"])
    ta = {r["id"]: r for r in ab_runs["nvfp4"][1]["verdict"]["per_prompt"]}
    assert set(ta) == {p["id"] for p in AB_PROMPTS}


def test_negative_control_is_reported_divergent(ab_runs):
    """A SiTU beta of PERTURBED_BETA instead of 4.0 in the served config: the verdict is diverge,
    naming the prompts, and --fail-on-divergence exits 1."""
    rc, rep, summary, _ = ab_runs["perturbed"]
    g, v = rep["greedy"], rep["verdict"]
    print(json.dumps({k: g[k] for k in ("identical_token_streams", "first_divergence_positions", "max_abs_dlogprob")}),
          json.dumps({k: v[k] for k in ("verdict", "divergent", "beyond_bound", "max_abs_dlogprob")}))
    assert rc == 1 and v["verdict"] == "diverge" and "**Verdict: diverge**" in summary
    flagged = set(v["divergent"]) | set(v["beyond_bound"])
    assert flagged == {p["id"] for p in AB_RUNS["perturbed"].prompts}
    assert g["max_abs_dlogprob"] > DLOGPROB_BOUND
    for r in v["per_prompt"]:
        if r["status"] == "divergent":
            assert 0 <= r["first_divergence"] < AB_TOKENS and (r["margin"] is None or r["margin"] > 2 * DLOGPROB_BOUND)


def test_reference_and_w4a8_agree_within_the_fp8_bound(servers, ab_runs):
    """The cast served in the Hopper W4A8 mode (K3NVFP4_ACT_QUANT=e4m3: weights expanded exactly
    to E4M3, E4M3 activations and intermediate) against the reference: verdict agree within
    DLOGPROB_BOUND_E4M3 (--fail-on-divergence exits 0), the streams identical, and its logprobs
    not bit-equal to the reference's (what the FP8 activations change; W4A16's are). Every MoE
    call of that server took the W4A8 weights, finite."""
    rc, rep, summary, _ = ab_runs["e4m3"]
    g, v = rep["greedy"], rep["verdict"]
    print(json.dumps({k: g[k] for k in ("identical_token_streams", "max_abs_dlogprob")}),
          json.dumps({k: v[k] for k in ("verdict", "bound_nats", "identical", "max_abs_dlogprob")}))
    assert rc == 0 and v["verdict"] == "agree" and v["bound_nats"] == DLOGPROB_BOUND_E4M3, v
    assert "**Verdict: agree**" in summary
    assert v["compared"] == v["identical"] == len(AB_RUNS["e4m3"].prompts) and g["first_divergence_positions"] == []
    assert g["dlogprob_missing"] == 0 and 0.0 < g["max_abs_dlogprob"] <= DLOGPROB_BOUND_E4M3, g
    server, calls, _ = servers["e4m3"]
    log = server.log_tail(10**7)
    assert "layout W4A8MoEWeights" in log and "activation quantization e4m3 (K3NVFP4_ACT_QUANT" in log
    records = _records(calls)
    assert records and all(r["weights"] == "W4A8MoEWeights" and r["out_finite"] for r in records), records
