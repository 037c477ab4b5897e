"""Launches per fused_moe_nvfp4 call (issue 9: <= 4 at M <= 64 on the K3 TP16 / EP16 shards, no
host synchronisation, no data-dependent allocation), and per fused_moe_fp4 call (issue 18: the
FP4 tensor-core modes in <= 4 at M <= 64 on the B200 TP8 / TP16 shards: 3 for mxfp8 and for nvfp4
with the static intermediate scale, 4 with the dynamic one).

How it is counted (k3nvfp4.kernels.launches): every Triton ``kernel[grid](...)`` is wrapped, and
every torch op except allocations and views counts as a launch (a memset, copy or elementwise op
is a kernel on a GPU), so a forgotten torch.zeros or .contiguous() copy shows up.

Why the K3 shapes are counted without running the kernels: the launch sequence is decided on the
host from the shapes and the config alone (no value is read back: that is what "no host sync"
means, and a read-back would show as a sync op here), so calling fused_moe_nvfp4 at H = 3584
with the real heuristic config and the kernels mocked out gives the real count; the weights are
uninitialised tensors (never touched, so no memory is committed). The second test runs the same
config kinds for real in the interpreter on small shapes and checks that executing does not
change the count, i.e. the mock hides nothing.
"""

from __future__ import annotations

import pytest
import torch
import triton

from k3nvfp4.kernels import MoEConfig, NVFP4MoEWeights, fused_moe_nvfp4, fused_moe_nvfp4_reference, moe_fp4, target
from k3nvfp4.kernels.launches import count_launches
from k3nvfp4.kernels.moe_details.config import get_moe_config
from k3nvfp4.kernels.moe_details.routing_kernels import SMALL_MAX_PAIRS
from k3nvfp4.kernels.moe_fp4 import FP4MMAWeights, FP4MoEConfig, check_fp4_mode_supported, fused_moe_fp4
from k3nvfp4.kernels.moe_fp4_reference import fused_moe_fp4_reference
from k3nvfp4.kernels.testing import kimi_routing, random_mxfp4_tensors, random_nvfp4_moe_weights, random_routing

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DECODE_M = (1, 2, 4, 8, 16, 32, 64)
K3_SHAPES = {  # name: (local experts E, global experts, H, I, top_k)
    "tp16": (896, 896, 3584, 192, 16),
    "ep16": (56, 896, 3584, 3072, 16),
}
ONE_CALL = ["align_small_kernel", "gemm1_gated_kernel", "gemm2_combine_kernel"]


def _uninitialised_weights(E: int, H: int, I: int) -> NVFP4MoEWeights:
    """K3-sized weights in the kernel layout, never written (the kernels are mocked)."""
    kt1, kt2 = -(-H // 64), -(-I // 64)
    return NVFP4MoEWeights(
        w13=torch.empty(E, 2 * I // 16, kt1, 512, dtype=torch.uint8, device=DEV),
        w13_scale=torch.empty(E, 2 * I // 16, kt1, 16, dtype=torch.int32, device=DEV),
        w13_scale_2=torch.empty(E, 2, device=DEV),
        w2=torch.empty(E, H // 16, kt2, 512, dtype=torch.uint8, device=DEV),
        w2_scale=torch.empty(E, H // 16, kt2, 16, dtype=torch.int32, device=DEV),
        w2_scale_2=torch.empty(E, device=DEV),
        hidden_size=H,
        intermediate_size=I,
    )


@pytest.mark.parametrize("shape", sorted(K3_SHAPES))
def test_k3_decode_is_three_launches_with_the_heuristic_config(shape):
    E, E_global, H, I, k = K3_SHAPES[shape]
    w = _uninitialised_weights(E, H, I)
    for M in DECODE_M:
        tw, ids = kimi_routing(M, k, E_global, local_experts=range(E), device=DEV)
        x = torch.empty(M, H, dtype=torch.bfloat16, device=DEV)
        cfg = get_moe_config(E, H, I, k, M)  # what the call picks: no tuned file for "cpu", the heuristic
        assert not cfg.atomic_reduce, (shape, M, cfg)  # the memset-free reduction at decode sizes
        for deterministic in (False, True):
            with count_launches(execute=False) as c:
                fused_moe_nvfp4(x, w, tw, ids, deterministic=deterministic)
            assert c.triton == ONE_CALL, (shape, M, cfg, c.summary())
            assert c.torch_ops == [] and c.syncs == [], (shape, M, c.summary())
            assert c.total == 3 <= 4


# Small shapes with the config kinds the heuristic uses at decode (split-K on both GEMMs at
# M = 1, plain at larger M), the atomic reduction (one memset more) and, past 1024 pairs, the
# 3-kernel routing (one memset of its counters).
SMALL = [
    # (config, E, k, M, expected launches: names, torch ops)
    (MoEConfig(block_n1=32, block_k1=32, split_k1=2, block_n2=64, block_k2=32, split_k2=2), 8, 4, 1, ONE_CALL, []),
    (MoEConfig(block_n1=32, block_k1=64, block_n2=64, block_k2=32), 8, 4, 64, ONE_CALL, []),
    (MoEConfig(block_n1=32, block_k1=64, block_n2=64, block_k2=32, atomic_reduce=True), 8, 4, 3, ONE_CALL,
     ["zeros.default"]),
    (MoEConfig(block_m=32, block_n1=32, block_k1=64, block_n2=64, block_k2=32), 4, 2, SMALL_MAX_PAIRS // 2 + 1,
     ["count_and_rank_kernel", "block_offsets_kernel", "scatter_pairs_kernel", "gemm1_gated_kernel",
      "gemm2_combine_kernel"], ["zeros.default"]),
]


@pytest.mark.parametrize("cfg,E,k,M,names,ops", SMALL)
def test_executed_calls_launch_what_the_mocked_calls_count(cfg, E, k, M, names, ops):
    H, I = 64, 32
    w = random_nvfp4_moe_weights(E, H, I, seed=M, device=DEV)
    tw, ids = random_routing(M, k, E, seed=M, device=DEV)
    x = torch.randn(M, H, generator=torch.Generator().manual_seed(M)).to(DEV)
    counts = {}
    for execute in (False, True):
        with count_launches(execute=execute) as c:
            y = fused_moe_nvfp4(x, w, tw, ids, config=cfg)
        counts[execute] = c.summary()
    assert counts[True] == counts[False]
    assert counts[True]["triton"] == names and counts[True]["torch_ops"] == ops and counts[True]["syncs"] == []
    assert torch.allclose(y, fused_moe_nvfp4_reference(x, w, tw, ids), rtol=1e-4, atol=1e-4)


# The FP4 modes. Before issue 18: activation quantization, routing, GEMM1, [row quantization],
# GEMM2, combine = 5-6 launches. Now the routing launch quantizes the tokens and GEMM2 combines.
FP4_SHAPES = {"tp8": (896, 3584, 384, 16), "tp16": (896, 3584, 192, 16), "ep16": (56, 3584, 3072, 16)}
FP4_CALL = ["route_quant_kernel", "fp4_gemm1_kernel", "fp4_gemm2_kernel"]
FP4_DYNAMIC = ["route_quant_kernel", "fp4_gemm1_kernel", "quant_rows_kernel", "fp4_gemm2_kernel"]


def _fp4_refusal(act_quant: str) -> str | None:
    """Why this Triton / device cannot run an FP4 mode at all (e.g. "nvfp4" on Hopper with Triton
    3.6, or the interpreter before 3.8), None where it can. The refusal itself is tested in
    test_moe_fp4_gpu.py / test_moe_fp4.py."""
    try:
        check_fp4_mode_supported(act_quant, torch.device(DEV))
        return None
    except RuntimeError as e:
        return f"act_quant={act_quant!r} not runnable here: {e}"


def _require_fp4_mode(act_quant: str) -> None:
    why = _fp4_refusal(act_quant)
    if why:
        pytest.skip(why)


def _interpreter_runs_fp4() -> bool:
    return target.triton_version() >= moe_fp4._INTERPRETER_MIN_TRITON


def _uninitialised_fp4_weights(E: int, H: int, I: int, act_quant: str) -> FP4MMAWeights:
    e4m3 = torch.float8_e4m3fn
    return FP4MMAWeights(act_quant=act_quant,
        w13=torch.empty(E, 2 * I, H // 2, dtype=torch.uint8, device=DEV),
        w13_scale=torch.empty(E, 2 * I, H // 16, dtype=e4m3, device=DEV), w13_scale_2=torch.empty(E, 2, device=DEV),
        w2=torch.empty(E, H, I // 2, dtype=torch.uint8, device=DEV),
        w2_scale=torch.empty(E, H, I // 16, dtype=e4m3, device=DEV), w2_scale_2=torch.empty(E, device=DEV),
        w13_e8m0=torch.empty(E, 2 * I, H // 32, dtype=torch.uint8, device=DEV),
        w2_e8m0=torch.empty(E, H, I // 32, dtype=torch.uint8, device=DEV), hidden_size=H, intermediate_size=I,
    )


@pytest.mark.parametrize("shape", sorted(FP4_SHAPES))
def test_fp4_modes_decode_in_three_launches_with_the_heuristic_config(shape):
    runnable = [m for m in moe_fp4.ACT_QUANT_MODES if _fp4_refusal(m) is None]
    if not runnable:
        pytest.skip("; ".join(_fp4_refusal(m) for m in moe_fp4.ACT_QUANT_MODES))
    E, H, I, k = FP4_SHAPES[shape]
    ws = {m: _uninitialised_fp4_weights(E, H, I, m) for m in ("nvfp4", "mxfp8")}
    splits = set()
    for M in DECODE_M:
        tw, ids = kimi_routing(M, k, 896, local_experts=range(E), device=DEV)
        x = torch.empty(M, H, dtype=torch.bfloat16, device=DEV)
        for act_quant, kw, names in (("mxfp8", {}, FP4_CALL), ("nvfp4", {}, FP4_CALL),
                                     ("nvfp4", dict(input_scale=0.01), FP4_CALL),
                                     ("nvfp4", dict(intermediate_scale="dynamic"), FP4_DYNAMIC)):
            if act_quant not in runnable:
                continue
            with count_launches(execute=False) as c:
                fused_moe_fp4(x, ws[act_quant], tw, ids, **kw)
            assert c.triton == names, (shape, M, act_quant, kw, c.summary())
            assert c.torch_ops == [] and c.syncs == [], (shape, M, c.summary())
            assert c.total <= 4
        splits.add(FP4MoEConfig.heuristic(E, H, I, k, M).split_k1)
    if shape != "ep16":  # at M = 1 the model splits GEMM1 over K (48 programs alone fill a third of 148 SMs)
        assert max(splits) > 1, splits


FP4_SMALL = [
    # (config, act_quant, intermediate_scale, E, k, M, expected Triton launches)
    (FP4MoEConfig(block_n1=32, block_k1=64, split_k1=2, block_n2=64, block_k2=64, split_k2=2), "mxfp8", "auto",
     8, 4, 1, FP4_CALL),
    (FP4MoEConfig(block_n1=32, block_k1=64, block_n2=64, block_k2=64, split_k2=2), "nvfp4", "auto", 8, 4, 16, FP4_CALL),
    (FP4MoEConfig(block_n1=32, block_k1=64, split_k1=2, block_n2=64, block_k2=64), "nvfp4", "dynamic", 8, 4, 5,
     FP4_DYNAMIC),
    (FP4MoEConfig(block_m=32, block_n1=32, block_k1=64, block_n2=64, block_k2=64), "mxfp8", "auto", 4, 2,
     SMALL_MAX_PAIRS // 2 + 1,
     ["count_and_rank_kernel", "block_offsets_kernel", "scatter_pairs_kernel", "quant_rows_kernel",
      "fp4_gemm1_kernel", "fp4_gemm2_kernel"]),
]


@pytest.mark.parametrize("cfg,act_quant,inter,E,k,M,names", FP4_SMALL)
def test_executed_fp4_calls_launch_what_the_mocked_calls_count(cfg, act_quant, inter, E, k, M, names):
    _require_fp4_mode(act_quant)
    H, I = 128, 128
    w = FP4MMAWeights.from_mxfp4(*random_mxfp4_tensors(E, H, I, seed=M), act_quant=act_quant).to(DEV)
    tw, ids = random_routing(M, k, E, seed=M, device=DEV)
    x = torch.randn(M, H, generator=torch.Generator().manual_seed(M)).to(DEV)
    kw = dict(intermediate_scale=inter)
    counts = {}
    for execute in (False, True):
        with count_launches(execute=execute) as c:
            y = fused_moe_fp4(x, w, tw, ids, config=cfg, **kw)
        counts[execute] = c.summary()
    assert counts[True] == counts[False]
    ops = ["zeros.default"] if len(names) > 4 else []  # the 3-kernel routing's counters
    assert counts[True]["triton"] == names and counts[True]["torch_ops"] == ops and counts[True]["syncs"] == []
    # Tight bounds live in test_moe_fp4.py; over 513 tokens an fp32 sum in another order can move
    # an intermediate value across an E4M3 rounding boundary (2^-4 relative, in one element).
    ref = fused_moe_fp4_reference(x, w, tw, ids, **kw)
    assert float((y - ref).abs().max()) <= 1e-3 * float(ref.abs().max())


def test_counter_sees_torch_launches_and_syncs():
    """The counter can fail: memsets, copies, arithmetic and read-backs are all seen; allocation
    and views are not launches."""
    x = torch.ones(4, 4)
    with count_launches() as c:
        y = torch.empty(4, 4)
        v = x[:, 1:].t()
        z = torch.zeros(3)
        y.copy_(x)
        w = (x * 2).contiguous()
        s = float(w.sum())
        x.t().contiguous()
    assert c.triton == [] and v.shape == (3, 4) and z.numel() == 3 and s == 32.0
    ops = c.torch_ops  # zeros (or empty + zero_), copy_, mul, sum, the read-back, the transpose copy
    assert len(ops) == 6 and c.total == 6, ops
    assert ops[0].startswith(("zeros", "zero_", "fill_")) and ops[1:4] == ["copy_.default", "mul.Tensor", "sum.default"]
    assert c.syncs == ["_local_scalar_dense.default"] == ops[4:5]


def test_graph_bench_rehearses_on_cpu(tmp_path):
    """bench/bench_graph.py --cpu-rehearsal: the GPU script's plumbing (launch counts, static
    buffers, replay after new routing, bitwise checks, JSON) in the interpreter."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).resolve().parent.parent / "bench" / "bench_graph.py"
    out = tmp_path / "graph.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(script), "--cpu-rehearsal", "--shapes", "tiny-tp", "--m-list", "1,64",
                           "--out", str(out)], capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["passed"] and res["errors"] == []
    assert [(p["mode"], p["M"]) for p in res["points"]] == [("w4a16", 1), ("w4a16", 64)]
    for p in res["points"]:
        assert p["launches"] == p["launches_deterministic"] == 3 and p["syncs"] == []
        assert p["replay_equals_eager"] and p["replay_new_routing_equals_eager"]
        assert p["ref_err"] < 2e-5 and p["replay_us"] > 0
    # the FP4 modes run in Triton >= 3.8's interpreter, but not at H = 48: said, not hidden
    modes = ("mxfp8", "nvfp4") if _interpreter_runs_fp4() else ()
    assert sorted(res["skipped"]) == [f"{m} tiny-tp: the FP4 modes need H and I multiples of 64 (H = 48, I = 32)"
                                      for m in modes]


def test_graph_bench_rehearses_the_fp4_modes_on_cpu(tmp_path):
    """bench_graph.py for act_quant nvfp4 / mxfp8: 3 launches, replays bitwise equal, the
    same-quantization reference."""
    import json
    import os
    import pathlib
    import subprocess
    import sys

    if not _interpreter_runs_fp4():
        pytest.skip(f"the FP4 modes need Triton >= 3.8 in the interpreter (tl.dot_scaled), installed {triton.__version__}")
    script = pathlib.Path(__file__).resolve().parent.parent / "bench" / "bench_graph.py"
    out = tmp_path / "graph.json"
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, str(script), "--cpu-rehearsal", "--shapes", "tiny-fp4", "--modes",
                           "nvfp4,mxfp8", "--m-list", "1,8", "--out", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["passed"] and res["errors"] == [] and res["skipped"] == []
    assert [(p["mode"], p["M"]) for p in res["points"]] == [("nvfp4", 1), ("nvfp4", 8), ("mxfp8", 1), ("mxfp8", 8)]
    for p in res["points"]:
        assert p["triton_kernels"] == FP4_CALL and p["torch_ops"] == [] and p["syncs"] == []
        assert p["replay_equals_eager"] and p["replay_new_routing_equals_eager"]
        assert p["ref_err"] < 1e-3 and p["replay_us"] > 0


def test_bench_moe_mode_arms_time_on_cpu():
    """bench/bench_moe.py's per-mode timers (time_fp4_mode for both FP4 modes, time_e4m3_mode with
    its table comparison) run end to end in the interpreter on tiny-fp4, as they do on a GPU: each
    checks its output against its mode's reference before timing and returns a time, and the e4m3
    arm reports the tables its weights took and that the normal table equals the full one bit for
    bit (bench_moe.e4m3_tables_agree, run by gpu_check's bench on the GPU; weights that already take
    the full table have nothing to compare: None), and times GEMM2 on 4 against 8 warps at a 64-token
    config (bench_moe.e4m3_gemm2_warps; None at another tile)."""
    import dataclasses
    import pathlib
    import sys
    import types

    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent / "bench"))
    import bench_moe
    from k3nvfp4.kernels.tune import Timer

    shape = types.SimpleNamespace(E=6, H=128, I=64)
    device = torch.device(DEV)
    timer = Timer(device, warmup=0, iters=1)
    x = torch.randn(3, shape.H, generator=torch.Generator().manual_seed(3)).to(DEV, torch.bfloat16)
    tw, ids = (t.to(DEV) for t in random_routing(3, 2, shape.E, seed=3))
    if _interpreter_runs_fp4() or DEV == "cuda":
        for mode, w in bench_moe.fp4_mode_arms(torch, shape, device, 0).items():
            r = bench_moe.time_fp4_mode(torch, fused_moe_nvfp4, w, mode, x, tw, ids, timer, no_graph=True)
            assert "error" not in r and r["time_us"] > 0 and r["normwise_vs_reference"] <= 1e-2, (mode, r)
    w, why = bench_moe.e4m3_mode_arm(torch, shape, device, 0)
    assert why is None
    r = bench_moe.time_e4m3_mode(torch, fused_moe_nvfp4, w, x, tw, ids, timer, no_graph=True, check_tables=True)
    assert "error" not in r and r["time_us"] > 0 and r["normwise_vs_reference"] <= 1e-2, r
    assert r["tables"] == ["normal", "normal"] and r["tables_agree"] is True
    full = dataclasses.replace(w, w13_table="full", w2_table="full")
    assert bench_moe.e4m3_tables_agree(torch, full, x, tw, ids) is None
    # GEMM2 on 4 against 8 warps at a 64-token config (the bench's last point on a GPU); the call's
    # own pick here is 16 tokens: nothing to compare
    from k3nvfp4.kernels.moe_w4a8 import W4A8Config

    assert "gemm2_warps" not in r and bench_moe.e4m3_gemm2_warps(torch, w, x, tw, ids, timer, True) is None
    cfg = W4A8Config(block_m=64, block_k1=64, block_k2=64, num_warps1=8, num_warps2=4, atomic_reduce=True)
    ab = bench_moe.e4m3_gemm2_warps(torch, w, x, tw, ids, timer, True, config=cfg)
    assert ab["config"] == cfg.label() and ab["w4_us"] > 0 and ab["w8_us"] > 0
    assert ab["w8_over_w4"] == ab["w8_us"] / ab["w4_us"]
