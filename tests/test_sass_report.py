"""The static SASS report: its parser and loop finder on hand-written SASS, and the shipped decode
configs of GEMM1 and GEMM2 compiled for sm90 within the HBM-speed instruction budget, spill-free.

The compile runs in a subprocess without TRITON_INTERPRET (kernels defined for the interpreter
cannot be compiled); deterministic for the Triton that `make test` installs.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from k3nvfp4.kernels.offline import sass

REPO = pathlib.Path(__file__).resolve().parent.parent

_SASS = """
	code for sm_90a
		Function : toy_kernel
        /*0000*/                   MOV R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
        /*0030*/                   LOP3.LUT R8, R4, 0x81c081c0, RZ, 0xc0, !PT ;
        /*0040*/                   SHF.L.W.U32.HI R9, R4, 0x3, R4 ;
        /*0050*/                   HMUL2.BF16_V2 R8, R8, R10.H0_H0 ;
        /*0060*/                   HGMMA.64x16x16.F32.BF16 R24, R8, gdesc[UR8], R24 ;
        /*0070*/               @P0 BRA 0x20 ;
        /*0080*/                   BRA 0x90 ;
        /*0090*/                   ISETP.NE.AND P1, PT, R0, RZ, PT ;
        /*00a0*/              @!P1 BRA 0x90 ;
        /*00b0*/                   EXIT ;
"""


def test_parser_and_hot_loop_on_hand_written_sass():
    funcs = sass.parse_sass(_SASS)
    assert list(funcs) == ["toy_kernel"]
    ins = funcs["toy_kernel"]
    assert len(ins) == 12 and ins[5].opcode == "HMUL2.BF16_V2" and ins[7].predicate == "@P0"
    lps = sass.loops(ins)
    assert [(lp.start, lp.end) for lp in lps] == [(0x90, 0xA0), (0x20, 0x70)]  # innermost first
    hot = sass.hot_loop(ins)  # the loop with the MMA, not the smaller spin loop
    assert (hot.start, hot.end, hot.size) == (0x20, 0x70, 6)
    st = sass.loop_stats(hot)
    assert st.mma == 1 and st.family_mix == {"global_load": 1, "int_logic": 2, "f16x2": 1, "mma": 1, "control": 1}
    # 6 instructions x 4 warps over a 64 x 64 tile
    assert sass.warp_instr_per_weight(6, 4, 64 * 64) == pytest.approx(24 / 4096)
    assert sass.hbm_ceiling(sass.HBM_BUDGET / 2) == pytest.approx(2.0)
    assert 0.108 < sass.HBM_BUDGET < 0.11  # 132 SMs x 4 x 1.98 GHz vs 9.6e12 FP4 weights/s


def test_no_mma_loop_is_an_error():
    ins = sass.parse_sass(_SASS.replace("HGMMA.64x16x16.F32.BF16 R24, R8, gdesc[UR8], R24", "NOP"))["toy_kernel"]
    with pytest.raises(ValueError, match="MMA"):
        sass.hot_loop(ins)


def test_shipped_decode_configs_dequantize_at_the_minimum_on_sm90(tmp_path):
    """bench/sass_report.py on the TP16 and EP16 decode configs (M = 1) of both GEMMs: the hot K
    loop's dequant is exactly 5 rotations and 4 bf16x2 scale products per word of 8 weights, plus
    at most one rotation per 2 words for the 1-byte scales (NVFP4; per 4 words for the MXFP4
    release's E8M0 per 32), no byte shuffles, no I2F/F2F, no spills: the dequant's design, which a
    compiler update must not undo. (Every shard and M, and sm100, are covered by
    tests/test_launch_configs.py; the loop budget is bench/sass_report.py --check's.)"""
    out = tmp_path / "model.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-P", str(REPO / "bench" / "sass_report.py"), "--devices", "H200", "--shards", "tp16,ep16",
         "--m-list", "1", "--no-peers", "--out", str(out)],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    if proc.returncode != 0 and ("ptxas" in proc.stderr and ("not found" in proc.stderr or "No such file" in proc.stderr)):
        pytest.skip(f"Triton's offline compile (bundled ptxas) is unavailable: {proc.stderr[-300:]}")
    assert out.is_file(), proc.stderr[-4000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert {r["shard"] for r in rows} == {"tp16", "ep16"} and all(r["M"] == 1 for r in rows)
    assert {r["checkpoint"] for r in rows} == {"nvfp4", "mxfp4"}
    for r in rows:
        assert "error" not in r, r
        assert [k["name"] for k in r["kernels"]] == ["k3nvfp4 gemm1", "k3nvfp4 gemm2"]
        for k in r["kernels"]:
            assert k["mma_per_iteration"] > 0, k
            assert k["local_bytes"] == 0 and k["local_memory_ops_in_loop"] == 0, k
            assert k["family_mix"].get("convert", 0) == 0, k  # no I2F/F2F in the dequant
            words = k["weights_per_iteration"] // k["num_warps"] // 32 // 8  # per thread: 8 weights a word
            assert k["family_mix"]["f16x2"] == 4 * words, k  # one bf16x2 scale product per two weights
            # the scale words' rotations: at most one per second pair, i.e. per 2 words (NVFP4) or
            # per 4 (E8M0 per 32); the mma.sync tiles' per-word decode shares them further.
            scale_rotations = k["opcode_mix"].get("SHF.L.W.U32.HI", 0) - 5 * words
            assert 0 <= scale_rotations <= (words // 2 if r["checkpoint"] == "nvfp4" else words // 4), k
            assert k["opcode_mix"].get("PRMT", 0) == 0, k  # no byte shuffles
    assert result["errors"] == [], result["errors"]
