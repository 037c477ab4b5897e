"""The W4A8 expansion compiles for sm90 without a GPU and the GEMM it feeds gets Hopper's FP8 wgmma:
4-bit weights expanded in registers to E4M3 (kernels/moe_details/e4m3_expand.py) as the first
tl.dot operand, FP8 activations from memory (kernels/offline/compile_w4a8.py's probe kernel)."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def test_w4a8_probe_compiles_to_e4m3_wgmma_with_weights_from_registers():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-P", "-m", "k3nvfp4.kernels.offline.compile_w4a8", "--block-k", "128"],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    r = json.loads(proc.stdout)
    assert r["wgmma_forms"] == ["wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3"], r["wgmma_forms"]
    assert r["wgmma_e4m3_in_ptx"] >= 4  # 128 K = 4 wgmma of K 32 per iteration
    assert "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16" not in proc.stdout  # not decomposed to bf16
    assert r["a_in_registers"], r  # the expanded weights are the register operand, the activations by descriptor
    assert r["loop_mma_per_warp"] >= 1 and r["local_bytes"] == 0, r  # FP8 MMA in the hot loop, no spills


def test_the_modes_gemms_compile_to_e4m3_wgmma_without_spills(tmp_path):
    """The e4m3 mode's own GEMM1 (expansion, E4M3 dot, per-group promotion, SiTU, the
    intermediate's quantization, split-K) and GEMM2 (with the top-k combine) for sm90 at the decode
    and prefill tiles of compile_w4a8.W4A8_CONFIGS (K3 TP16 shapes, MXFP4 weight blocks): FP8
    wgmma in the PTX, no bf16 wgmma, an MMA in the hot loop, no spills; and each last-arrival sum
    (GEMM1's split-K at decode, GEMM2's top-k sum, stored and atomic) passes the memory-ordering
    dataflow check of tests/ptx_ordering.py (stores before a bar.sync before the acq_rel GPU-scope
    arrival, loads after it)."""
    from ptx_ordering import violations

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-P", "-m", "k3nvfp4.kernels.offline.compile_w4a8", "--mode",
                           "--weight-block", "32", "--ptx-dir", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    records = json.loads(proc.stdout)
    assert {r["kernel"] for r in records} == {f"{k}_e4m3_{t}_wb32" for k in ("gemm1", "gemm2")
                                              for t in ("bm16_decode", "bm64_prefill")}
    for r in records:
        assert "error" not in r, r
        assert r["wgmma_forms"] and all(f.endswith("k32.f32.e4m3.e4m3") for f in r["wgmma_forms"]), r
        assert r["wgmma_e4m3_in_ptx"] >= 2 and r["wgmma_bf16_in_ptx"] == 0, r  # 64 K = 2 wgmma of K 32
        assert r["loop_mma_per_warp"] >= 1 and r["local_bytes"] == 0, r
    ordered = [r for r in records if "ptx" in r]
    assert {r["kernel"] for r in ordered} == {"gemm1_e4m3_bm16_decode_wb32", "gemm2_e4m3_bm16_decode_wb32",
                                              "gemm2_e4m3_bm64_prefill_wb32"}
    for r in ordered:
        assert violations((tmp_path / r["ptx"]).read_text(), r["params"], r["buffer"]) == [], r["kernel"]
