"""``--moe-runner-backend triton_situ`` in a real SGLang server process, on CPU: the synthetic
Kimi-K3 checkpoint, cast to NVFP4 and as the MXFP4 release, served over HTTP.

``python -m sglang.launch_server`` (tests/real_server.py, the production command builder's
arguments plus CPU flags) loads the checkpoint with the k3nvfp4 plugin, found through its entry
point in the spawned scheduler; the MoE kernels run in Triton's interpreter. A test hook in
tests/fixtures/sglang_cpu/sitecustomize.py records every fused_moe_nvfp4 call of the server's
processes: that the MoE layers are served by the project's kernels, with which weight layout,
and SGLang's loading timeout as the plugin set it from K3NVFP4_LOAD_TIMEOUT_S. A request
prefills and decodes a few greedy tokens; the cast and the release, served through their two
weight layouts (E4M3 scales per 16 re-encoded, E8M0 per 32 as released), must agree on them.
The synthetic model has no MLA layer (two layers: dense, then KDA + MoE), so SGLang's MLA decode
kernels are not reached.
"""

from __future__ import annotations

import json

import pytest

from real_server import K3_CPU_FLAGS, SGLangServer, write_k3_text_processor

CKPT_SHAPE = dict(num_layers=2, num_experts=8, hidden_size=64, intermediate_size=64, top_k=4)
LOAD_TIMEOUT_S = 1234  # SGLang's default is 480
NEW_TOKENS = 3
# The CPU workarounds of tests/fixtures/sglang_cpu/sitecustomize.py a K3 server needs, each of
# which must take effect (a newer SGLang that moves what one answers fails here, by name).
WORKAROUNDS = {"_cuda_stream", "_sgl_kernel_cpu_ops", "_autotuner_first_config", "_kda_triton_kernels",
               "_kda_conv_update", "_fla_jit_math", "_kda_libdevice", "_count_moe_calls"}
STREAMS: dict[str, list[dict]] = {}  # checkpoint -> greedy logprobs, for the last test


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    """The synthetic release (MXFP4), its NVFP4 cast, and the text processor directory."""
    from k3nvfp4.checkpoint.cli import main as cast_main
    from k3nvfp4.checkpoint.synthetic import write_synthetic_checkpoint

    root = tmp_path_factory.mktemp("k3")
    mxfp4 = write_synthetic_checkpoint(root / "mxfp4", num_shards=2, seed=7, **CKPT_SHAPE)
    nvfp4 = root / "nvfp4"
    assert cast_main(["--source_ckpt", str(mxfp4), "--output_ckpt", str(nvfp4), "--workers", "1",
                      "--no-progress"]) == 0
    return {"nvfp4": nvfp4, "mxfp4": mxfp4, "tokenizer": write_k3_text_processor(root / "tokenizer")}


@pytest.mark.parametrize("checkpoint,scale_format", [("nvfp4", "e5m3/16"), ("mxfp4", "e8m0/32")])
def test_triton_situ_serves_k3_over_http(k3, tmp_path, checkpoint, scale_format):
    calls, applied = tmp_path / "moe_calls.jsonl", tmp_path / "workarounds.txt"
    server = SGLangServer(k3[checkpoint], tmp_path / "server.log", extra=K3_CPU_FLAGS + ("--tokenizer-path", str(k3["tokenizer"])),
                          env={"TRITON_INTERPRET": "1", "K3NVFP4_LOAD_TIMEOUT_S": str(LOAD_TIMEOUT_S),
                               "K3NVFP4_TEST_MOE_CALLS": str(calls), "K3NVFP4_TEST_WORKAROUNDS": str(applied)},
                          ready_timeout_s=240)
    assert "--moe-runner-backend triton_situ" in " ".join(server.cmd)
    with server:
        log = server.log_tail(10**7)
        assert "k3nvfp4: MoE runner backend triton_situ active: 8 local of 8 experts" in log
        body = server.chat({"model": "k3", "messages": [{"role": "user", "content": "w001 w002 w003"}],
                            "max_tokens": NEW_TOKENS, "temperature": 0.0, "logprobs": True, "top_logprobs": 3},
                           timeout_s=300)
        server_pid = server.proc.pid
    missing = WORKAROUNDS - set(applied.read_text().split())
    assert not missing, f"CPU workarounds that no longer take effect with this SGLang: {sorted(missing)}"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "length" and body["usage"]["completion_tokens"] == NEW_TOKENS
    STREAMS[checkpoint] = choice["logprobs"]["content"]
    records = [json.loads(x) for x in calls.read_text().splitlines()]
    # One MoE layer (layer 1; layer 0 is dense): one call for the prefill, one per decoded token
    # after the first, all in a worker process.
    assert len(records) == NEW_TOKENS, records
    assert server_pid not in {r["pid"] for r in records} and all(r["out_finite"] for r in records)
    assert records[0]["tokens"] >= 3 and [r["tokens"] for r in records[1:]] == [1] * (NEW_TOKENS - 1)
    for r in records:
        assert r["experts"] == 8 and r["hidden"] == CKPT_SHAPE["hidden_size"]
        assert r["scale_format"] == scale_format  # the release is served in its own E8M0 layout
        assert r["load_timeout_s"] == LOAD_TIMEOUT_S


def test_cast_and_release_decode_the_same_tokens():
    """The same experts through the two layouts: the same greedy tokens, logprobs within fp16
    rounding of the rest of the model."""
    if set(STREAMS) != {"nvfp4", "mxfp4"}:
        pytest.fail(f"needs both servers' streams (the parametrized test above failed?): got {sorted(STREAMS)}")
    a, b = STREAMS["nvfp4"], STREAMS["mxfp4"]
    assert [t["token"] for t in a] == [t["token"] for t in b]
    for ta, tb in zip(a, b):
        assert abs(ta["logprob"] - tb["logprob"]) < 1e-2, (ta, tb)
