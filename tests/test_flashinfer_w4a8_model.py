"""bench/peers/flashinfer_model.flashinfer_w4a8_call (FlashInfer's SM90 MXFP4 x FP8 MoE under the
static model) and bench/w4a8_rows.targets, on hand-made kernel rows (no nvcc build): which measured
kernel each GEMM takes, the FP8 MMA rate and the E4M3 activation bytes against hand-computed
figures, the shards FlashInfer refuses, and issue 38's prefill target needing every peer beaten.
The real rows (flashinfer_sass.flashinfer_w4a8_rows, an nvcc build) are checked by
`bench/sass_report.py --check` (report_check.flashinfer_w4a8_findings)."""

from __future__ import annotations

import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import w4a8_rows  # noqa: E402
from peers.flashinfer_model import admits, flashinfer_call, flashinfer_w4a8_call  # noqa: E402

from k3nvfp4.kernels import perf_model as pm  # noqa: E402


def _row(kernel_type: str, M: int, N: int, K: int, instr_per_weight: float, warps: int = 12,
         min_k: int | None = None, max_k: int | None = None) -> dict:
    return {"kernel_type": kernel_type, "tile": {"M": M, "N": N, "K": K, "schedule": "pingpong", "stages": 4},
            "warp_instr_per_weight": instr_per_weight, "warp_instr_per_weight_without_spills": instr_per_weight,
            "spill_ops_per_iteration": 0, "weights_per_iteration": M * K, "num_warps": warps,
            "registers": 168 if warps == 12 else 88, "shared_bytes": 100_000, "local_bytes": 0,
            "bytes_per_weight": 0.53125, "launches_per_call": 11, "min_k": min_k, "max_k": max_k}


ROWS = [_row("warp_specialized", 64, 16, 128, 0.07), _row("warp_specialized", 64, 64, 128, 0.07),
        _row("single_warpgroup_rolling", 128, 16, 128, 0.095, warps=4, min_k=385),
        _row("single_warpgroup_prefill", 128, 16, 128, 0.001, warps=4, max_k=384)]
# Every token routes to every expert (top_k = experts): the routing is exact, blocks = E x M / N.
ALL_ROUTED = pm.Shard("all", 4, 4, 1024, 512, 4)


def test_single_warpgroup_kernels_only_where_the_binding_admits_them():
    ep16 = pm.K3_SHARDS["ep16"]  # GEMM1 K = 3584, GEMM2 K = 3072: ROLLING, never PREFILL
    assert [admits(r, g, ep16) for g in ("gemm1", "gemm2") for r in ROWS] == [True, True, True, False] * 2
    small_k = pm.Shard("k384", 4, 4, 384, 256, 4)  # GEMM1 K = 384: PREFILL; GEMM2 K = 256: its tiles divide
    assert [admits(r, "gemm1", small_k) for r in ROWS] == [True, True, False, True]
    # With slow pingpong loops (issue-bound) the cheapest admitted loop wins: ROLLING on EP16,
    # where the cheaper PREFILL is not admitted; PREFILL for K = 384.
    rows = [_row("warp_specialized", 64, 16, 128, 2.0), _row("warp_specialized", 64, 64, 128, 2.0)] + ROWS[2:]
    call = flashinfer_w4a8_call(pm.H200, rows, ep16, 4096)
    assert [k.config for k in call.kernels] == ["128x16x128 pingpong single_warpgroup_rolling"] * 2
    assert flashinfer_w4a8_call(pm.H200, rows, small_k, 4096).kernels[0].config == \
        "128x16x128 pingpong single_warpgroup_prefill"


def test_each_gemm_takes_its_fastest_kernel_at_the_fp8_rate_with_e4m3_activations():
    M = 4096
    call = flashinfer_w4a8_call(pm.H200, ROWS[:3], ALL_ROUTED, M)
    g1, g2 = call.kernels
    # 64 tokens a tile: a quarter of the 16-token tile's weight passes for the same MMA work
    assert g1.config == "64x64x128 pingpong" and g2.config == "64x64x128 pingpong"
    # GEMM1 by hand: 2I = 1024 weight rows / 64 = 16 row tiles, 4 experts x 4096 / 64 = 256 token
    # blocks, H / 128 = 8 passes of 64 x 128 weights x 64 tokens, at 0.7 x the dense FP8 peak.
    flops = 2.0 * 16 * 256 * 8 * 64 * 128 * 64
    assert g1.t_mma == pytest.approx(flops / (0.7 * pm.H200.mma_fp8_flops))
    assert pm.H200.mma_fp8_flops == pytest.approx(2 * pm.H200.mma_bf16_flops, rel=1e-3)  # 1979 vs 989 TFLOP/s
    # E4M3 tokens in (1 B each), bf16 gate/up rows out for every pair (4096 x 4 pairs)
    assert g1.other_bytes == M * 1024 * 1 + M * 4 * 1024 * 2
    # GEMM2: the E4M3 intermediate in, bf16 rows out
    assert g2.other_bytes == M * 4 * 512 * 1 + M * 4 * 1024 * 2
    assert call.launches == 11


def test_the_w4a16_call_takes_the_same_tactic_rule_at_the_bf16_rate_with_bf16_activations():
    M = 4096
    g1, g2 = flashinfer_call(pm.H200, ROWS[:2], ALL_ROUTED, M).kernels
    assert g1.config == g2.config == "64x64x128 pingpong"
    flops = 2.0 * 16 * 256 * 8 * 64 * 128 * 64  # as in the W4A8 test above
    assert g1.t_mma == pytest.approx(flops / (0.7 * pm.H200.mma_bf16_flops))
    assert g1.other_bytes == M * 1024 * 2 + M * 4 * 1024 * 2
    assert flashinfer_call(pm.H200, ROWS[:2], ALL_ROUTED, 1).kernels[0].config == "64x16x128 pingpong"


def test_shards_flashinfer_cannot_run_are_refused_with_the_reason():
    with pytest.raises(RuntimeError, match=r"I % 128 == 0.*I = 192"):
        flashinfer_w4a8_call(pm.H200, ROWS, pm.K3_SHARDS["tp16"], 4096)
    with pytest.raises(RuntimeError, match="no measured kernel is admitted for gemm1"):
        flashinfer_w4a8_call(pm.H200, [ROWS[3]], pm.K3_SHARDS["ep16"], 4096)


def _result(peer_ratios: dict, M: int = 4096, w4a16_ratio: float = 0.5) -> dict:
    row = {"checkpoint": "mxfp4", "shard": "ep16", "M": M, "w4a16_ratio": w4a16_ratio}
    row |= {f"{p}_ratio": v for p, v in peer_ratios.items()}
    return {"e4m3": {"rows": [row]}}


def test_a_prefill_target_needs_every_peer_beaten():
    (t,) = w4a8_rows.targets(_result({"flashinfer": 0.3, "flashinfer_w4a8": 0.95}))
    assert t["met"] and t["worst_peer"] == "flashinfer_w4a8"
    (t,) = w4a8_rows.targets(_result({"flashinfer": 0.3, "flashinfer_w4a8": 1.02}))
    assert not t["met"] and t["worst_peer"] == "flashinfer_w4a8"
    (t,) = w4a8_rows.targets(_result({"flashinfer": 0.3, "flashinfer_w4a8": 0.95}, w4a16_ratio=0.61))
    assert not t["met"]
    # decode: only the W4A16 bound counts
    (t,) = w4a8_rows.targets(_result({"flashinfer_w4a8": 1.5}, M=64, w4a16_ratio=1.04))
    assert t["met"] and t["which"] == "decode"


def test_report_check_names_a_measured_kernel_the_model_would_misread():
    """report_check.flashinfer_w4a8_findings: rows shaped like flashinfer_w4a8_rows' pass (a spill
    too: its traffic uncharged, in the peer's favour, and a loop long only by its spill loads and
    stores); no registers, a bf16 MMA atom, a wrong MMA count, a loop long without spills or spill
    instructions without local memory are named."""
    import report_check as rc
    from peers import flashinfer_sass as fs

    rows = []
    for kernel_type, (m, n, k) in fs.W4A8_VARIANTS:
        single = fs.is_single_warpgroup(kernel_type)
        r = _row(kernel_type, m, n, k, 0.07, warps=fs.SINGLE_WARPGROUP_WARPS if single else fs.CTA_WARPS)
        r["tile"]["mma_atom"] = f"MMA_64x{n}x32_F32E4M3E4M3_RS"
        r["mma_per_iteration"] = (m // 64) * (k // 32)
        rows.append(r)
    assert rc.flashinfer_w4a8_findings(rows) == []
    rows[0]["local_bytes"] = 16  # a spill is not a finding: the model leaves it uncharged (the peer's favour)
    rows[0]["spill_ops_per_iteration"], rows[0]["warp_instr_per_weight"] = 900, 0.37  # 256x256's: 0.138 without
    assert rc.flashinfer_w4a8_findings(rows) == []
    rows[3]["warp_instr_per_weight"] = rows[3]["warp_instr_per_weight_without_spills"] = 0.37
    rows[5]["spill_ops_per_iteration"] = 4  # local loads and stores, but cuobjdump saw no local memory
    rows[1]["registers"] = 0
    rows[2]["tile"]["mma_atom"] = "MMA_64x64x16_F32BF16BF16_RS"
    rows[4]["mma_per_iteration"] += 1  # one MMA more than its tile's (M / 64) x (K / 32)
    found = rc.flashinfer_w4a8_findings(rows)
    assert [f.split(": ")[1] for f in found] == ["registers", "FP8 MMA atom, A from registers",
                                                 "warp-instructions per weight", "MMAs per iteration",
                                                 "spills without local memory"], found
