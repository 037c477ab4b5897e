"""The plugin's MoE backends in real SGLang server processes, on CPU: the synthetic Kimi-K3
checkpoint, cast to NVFP4 and as the MXFP4 release, served over HTTP, and a server A/B through
the MoE layer.

``python -m sglang.launch_server`` (tests/real_server.py, the production command builder's
arguments plus CPU flags) loads the checkpoint with the k3nvfp4 plugin, found through its entry
point in the spawned scheduler; the Triton MoE kernels run in Triton's interpreter. A test hook in
tests/fixtures/sglang_cpu/sitecustomize.py records every fused_moe_nvfp4 call of the server's
processes: that the MoE layers are served by the project's kernels, with which weight layout,
and SGLang's loading timeout as the plugin set it from K3NVFP4_LOAD_TIMEOUT_S.

Three servers, started together once for the module (one K3 server takes about 80 s of 2-core
time to start; started together they share the cores):
- ``nvfp4``: the cast on ``triton_situ`` (the ModelOpt NVFP4 layout, E5M3_16 scale words);
- ``reference``: the MXFP4 release on ``torch_reference`` (kernels/moe_torch_backend.py: plain
  torch, its own decode of the release's nibbles and E8M0 exponents, no Triton, no kernel layout);
- ``perturbed``: the release on ``triton_situ`` (its own E8M0_32 layout) with
  ``activation_situ_beta`` 4.0 -> PERTURBED_BETA in a copy of its config.json: the negative control.
``k3nvfp4-ab serve`` (greedy, logprobs) compares reference vs nvfp4, two implementations AND two
checkpoints (the cast is exact, so the same model): they must agree within the bound below; and
reference vs perturbed: reported divergent, with the first divergent position.
The synthetic model has no MLA layer (two layers: dense, then KDA + MoE), so SGLang's MLA decode
kernels are not reached.

The bound (DLOGPROB_BOUND). On CPU the servers run fp16 (K3_CPU_FLAGS). Both backends compute
the same real-valued MoE with fp32 dots; they differ by the order of the fp32 sums (relative
1e-6) and, through it, by a rounding step of the fp16 intermediate or output now and then (the
interpreter also truncates where a GPU rounds). So the layer outputs differ by about one fp16
ulp, 2^-11 relative. The MoE is the last layer: the difference reaches no later position, only
this position's logits through the final norm and lm_head, which round to fp16 again. The
logprob of a token moves by at most twice the largest logit change, and a logit of magnitude
up to 8 (this model's range; top logprobs near -log 256) has an fp16 ulp of 2^-8 = 0.0039: a
few such ulps, DLOGPROB_BOUND = 0.02 nats, and no greedy token may change (the top-2 logprob
gaps of these prompts are far larger). Measured (2-core CPU, `pytest -s` prints the figures):
reference (release) vs triton_situ (cast) max |delta logprob| 0.0 (the served fp16 logprobs are
equal), 3 of 3 streams identical; the negative control (release, beta 2.0, triton_situ) 1 of 3
identical, first divergences at positions 3 and 1, max |delta logprob| 0.16 over 5 tokens (8x the
bound). The file takes 166 s alone on 2 cores (four servers took 490 s).

What the cast-vs-release comparison through triton_situ alone (the earlier fourth server) proved
is now covered by the reference arm (a layout bug shared by both triton_situ paths would make the
reference arm diverge from the cast) and, for the release's E8M0 layout in triton_situ, by the
layer- and model-level tests of tests/test_mxfp4_serving.py.
"""

from __future__ import annotations

import json
import shutil
import threading

import pytest

from k3nvfp4.sglang_ext.ab import cli
from real_server import K3_CPU_FLAGS, K3_SHARED_HOST_FLAGS, SGLangServer, write_k3_text_processor

CKPT_SHAPE = dict(num_layers=2, num_experts=8, hidden_size=64, intermediate_size=64, top_k=4)
LOAD_TIMEOUT_S = 1234  # SGLang's default is 480
NEW_TOKENS = 3
# The CPU workarounds of tests/fixtures/sglang_cpu/sitecustomize.py a K3 server needs, each of
# which must take effect (a newer SGLang that moves what one answers fails here, by name).
WORKAROUNDS = {"_cuda_stream", "_sgl_kernel_cpu_ops", "_autotuner_first_config", "_kda_triton_kernels",
               "_kda_conv_update", "_fla_jit_math", "_kda_libdevice", "_count_moe_calls"}
# name -> (checkpoint, --moe-runner-backend)
SERVERS = {"nvfp4": ("nvfp4", "triton_situ"), "reference": ("mxfp4", "torch_reference"),
           "perturbed": ("mxfp4_beta", "triton_situ")}
PERTURBED_BETA = 2.0  # activation_situ_beta of the negative control (the model's is 4.0)
DLOGPROB_BOUND = 0.02  # nats, max |delta logprob| over aligned positions (module docstring)
AB_TOKENS = 5  # the control diverges by position 3 (measured); fewer tokens keep the servers' time down
AB_PROMPTS = [{"id": "p1", "prompt": "w001 w002 w003"}, {"id": "p2", "prompt": "w100 w017 w042 w007"},
              {"id": "p3", "prompt": "w200"}]


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    """The synthetic release (MXFP4), its NVFP4 cast, the release with a perturbed SiTU beta,
    and the text processor directory."""
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
    return {"nvfp4": nvfp4, "mxfp4": mxfp4, "mxfp4_beta": perturbed,
            "tokenizer": write_k3_text_processor(root / "tokenizer")}


@pytest.fixture(scope="module")
def servers(k3, tmp_path_factory):
    """name -> (server, its fused_moe_nvfp4 call records, its applied-workarounds file); all
    started before any is waited for."""
    d = tmp_path_factory.mktemp("k3servers")
    out, started = {}, []
    for name, (ckpt, backend) in SERVERS.items():
        calls, applied = d / f"{name}.moe_calls.jsonl", d / f"{name}.workarounds.txt"
        server = SGLangServer(k3[ckpt], d / f"{name}.log", backend=backend,
                              extra=K3_CPU_FLAGS + K3_SHARED_HOST_FLAGS + ("--tokenizer-path", str(k3["tokenizer"])),
                              env={"TRITON_INTERPRET": "1", "K3NVFP4_LOAD_TIMEOUT_S": str(LOAD_TIMEOUT_S),
                                   "K3NVFP4_TEST_MOE_CALLS": str(calls), "K3NVFP4_TEST_WORKAROUNDS": str(applied)},
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
        for server in started:
            server.stop()


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
    before = len(_records(calls))  # the module's servers are shared: only this request's calls
    body = server.chat({"model": "k3", "messages": [{"role": "user", "content": "w001 w002 w003"}],
                        "max_tokens": NEW_TOKENS, "temperature": 0.0, "logprobs": True, "top_logprobs": 3},
                       timeout_s=300)
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
        assert r["load_timeout_s"] == LOAD_TIMEOUT_S


@pytest.fixture(scope="module")
def ab_reports(servers, tmp_path_factory):
    """``k3nvfp4-ab serve`` twice, at the same time (the reference server answers both): the
    reference against triton_situ, and against the negative control. name -> report.json."""
    d = tmp_path_factory.mktemp("k3ab")
    prompts = d / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in AB_PROMPTS))
    ref = servers["reference"][0]
    rcs: dict[str, int] = {}

    def run(other: str) -> None:
        rcs[other] = cli.main(["serve", "--arm", f"reference={ref.url}", "--arm", f"{other}={servers[other][0].url}",
                               "--prompts", str(prompts), "--seeds", "1", "--max-tokens", str(AB_TOKENS),
                               "--top-logprobs", "5", "--timeout", "900", "--no-progress", "--out", str(d / other)])

    threads = [threading.Thread(target=run, args=(other,)) for other in ("nvfp4", "perturbed")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert rcs == {"nvfp4": 0, "perturbed": 0}, rcs
    return {other: json.loads((d / other / "report.json").read_text()) for other in ("nvfp4", "perturbed")}


def test_reference_and_triton_situ_agree_within_fp16_rounding(servers, ab_reports):
    """The release on the plain-torch backend and the cast on triton_situ: the same greedy tokens
    and logprobs within DLOGPROB_BOUND (two implementations and two layouts of the same experts)."""
    rep = ab_reports["nvfp4"]
    g = rep["greedy"]
    print(json.dumps({k: g[k] for k in ("identical_token_streams", "aligned_positions", "top1_agreement",
                                        "mean_abs_dlogprob", "max_abs_dlogprob", "dlogprob_missing")}))
    assert g["prompts"] == len(AB_PROMPTS) and g["prompts_without_logprobs"] == {"reference": 0, "nvfp4": 0}
    assert g["identical_token_streams"] == len(AB_PROMPTS) and g["first_divergence_positions"] == []
    assert g["aligned_positions"] == len(AB_PROMPTS) * AB_TOKENS and g["top1_agreement"] == 1.0
    assert g["dlogprob_missing"] == 0 and g["max_abs_dlogprob"] <= DLOGPROB_BOUND, g
    # The reference arm really ran the plain-torch backend: its load log says so, and no MoE call
    # of its processes went through the Triton kernels.
    ref, calls, _ = servers["reference"]
    assert "k3nvfp4: MoE runner backend torch_reference active: 8 local of 8 experts" in ref.log_tail(10**7)
    assert "MoE runner backend triton_situ active" not in ref.log_tail(10**7)
    assert _records(calls) == []
    assert _records(servers["nvfp4"][1])  # the other arm did


def test_negative_control_is_reported_divergent(ab_reports):
    """A SiTU beta of PERTURBED_BETA instead of 4.0 in the served config: the same A/B reports the
    arms divergent (a changed greedy token, at the position it names) and beyond the bound."""
    g = ab_reports["perturbed"]["greedy"]
    print(json.dumps({k: g[k] for k in ("identical_token_streams", "first_divergence_positions", "top1_agreement",
                                        "mean_abs_dlogprob", "max_abs_dlogprob")}))
    rows = ab_reports["perturbed"]["per_prompt"]
    diverged = [r for r in rows if r["first_divergence"] is not None]
    assert diverged and g["identical_token_streams"] < len(AB_PROMPTS)
    for r in diverged:
        assert 0 <= r["first_divergence"] < AB_TOKENS and r["tokens_a"] == r["tokens_b"] == AB_TOKENS
    assert sorted(g["first_divergence_positions"]) == sorted(r["first_divergence"] for r in diverged)
    assert g["max_abs_dlogprob"] > DLOGPROB_BOUND
