"""The fragment-order weight layout of the Hopper W4A8 mode, probed (docs/w4a8.md, "A pre-permuted
weight layout"; kernels/offline/compile_w4a8.py: w4a8_fragment_probe_kernel, a GEMM around the
mode's own loads and expansion, moe_w4a8_details/kernels._expanded_weights -> e4m3_expand.fragment_tile).

- In the interpreter: the probe GEMM (the expansion's plain-Triton path: the same join / reshape /
  permute chain as the compiled one) on weights packed HERE from the layout's written definition by an
  independent numpy packer, against a float64 product (E2M1 x 2^j exact, tokens through
  ml_dtypes' E4M3), for blocks of 32 (MXFP4) and 16 (NVFP4).
- The pack = 4 lookup PTX of both block sizes, run by tests/ptx_emulator.py with Triton's operand
  numbering (four copies of each operand), bit for bit against the reference bytes.
- Compiled for sm90 (offline, no GPU): the expanded weights reach the FP8 wgmma from registers with
  no shared-memory trip (only the tokens' 64 x 16 E4M3 tile is a local_alloc), no spills.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import ml_dtypes
import numpy as np
import pytest
import torch

from ptx_emulator import run
from k3nvfp4.kernels.moe_details.e4m3_expand import E4M3_TABLE_PTX, expand_e2m1_to_e4m3_reference
from k3nvfp4.kernels.moe_details.e4m3_expand import FRAGMENT_LOOKUP_PTX_16, FRAGMENT_LOOKUP_PTX_32
from k3nvfp4.kernels.moe_w4a8_details.fragment import from_fragment_order, to_fragment_order
from k3nvfp4.kernels.offline.compile_w4a8 import w4a8_fragment_probe_kernel

E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)


def _pack(codes: np.ndarray, j: np.ndarray, wb: int) -> tuple[np.ndarray, np.ndarray]:
    """codes uint8 [N, K] (E2M1, bit 3 the sign), j int [N, K / wb] -> (words int32 [N/16, K/64, 128],
    offsets int8 [N/16, K/64, 1024 / wb]) as the layout's definition says, element by element."""
    N, K = codes.shape
    words = np.zeros((N // 16, K // 64, 128), dtype=np.uint32)
    offs = np.zeros((N // 16, K // 64, 1024 // wb), dtype=np.int8)
    for r in range(N // 16):
        for q in range(K // 64):
            for g in range(8):
                for t in range(4):
                    for s in range(2):
                        for h in range(2):
                            row = 16 * r + 8 * h + g
                            word = 0
                            for n in range(8):
                                k = 64 * q + 32 * s + (4 * t + n if n < 4 else 16 + 4 * t + n - 4)
                                word |= int(codes[row, k]) << (4 * n)
                            words[r, q, ((g * 4 + t) * 2 + s) * 2 + h] = word
                            b = (g * 2 + s) * 2 + h
                            if wb == 32:
                                offs[r, q, b] = j[row, 2 * q + s]
                            else:
                                offs[r, q, 2 * b] = j[row, 4 * q + 2 * s]
                                offs[r, q, 2 * b + 1] = j[row, 4 * q + 2 * s + 1]
    return words.view(np.int32), offs


@pytest.mark.parametrize("wb", [32, 16])
def test_probe_gemm_in_the_fragment_order_matches_float64(wb):
    rng = np.random.default_rng(wb)
    N, K, M = 32, 128, 16
    codes = rng.integers(0, 16, size=(N, K), dtype=np.uint8)
    j = rng.integers(-8, 7, size=(N, K // wb))  # the exact window of the E4M3 expansion
    words, offs = _pack(codes, j, wb)
    xq = (rng.standard_normal((K, M)) * 4).astype(ml_dtypes.float8_e4m3fn)
    w = np.where(codes & 8, -1.0, 1.0) * E2M1[codes & 7] * np.exp2(np.repeat(j, wb, axis=1))
    want = w @ xq.astype(np.float64)

    out = torch.empty(N, M, dtype=torch.float32)
    x = torch.from_numpy(xq.view(np.uint8).copy()).view(torch.float8_e4m3fn)
    w4a8_fragment_probe_kernel[(1,)](torch.from_numpy(words), torch.from_numpy(offs), x, out, K,
                                     R=N // 16, BLOCK_M=M, WB=wb)
    scale = np.abs(w) @ np.abs(xq.astype(np.float64))
    err = np.abs(out.numpy().astype(np.float64) - want)
    assert (err <= 1e-6 * scale + 1e-30).all(), float((err / (scale + 1e-30)).max())


@pytest.mark.parametrize("wb", [32, 16])
def test_the_preparation_writes_this_layout_and_reads_it_back(wb):
    """W4A8MoEWeights' storage (fragment.to_fragment_order, vectorized torch) equals the packer
    above element by element, with experts as a leading dim, and from_fragment_order inverts it."""
    rng = np.random.default_rng(10 + wb)
    E, N, K = 2, 48, 192
    codes = rng.integers(0, 16, size=(E, N, K), dtype=np.uint8)
    j = rng.integers(-8, 7, size=(E, N, K // wb))
    packed = torch.from_numpy(codes[..., 0::2] | (codes[..., 1::2] << 4))
    offs = torch.from_numpy(j.astype(np.int8))
    words, frag = to_fragment_order(packed, offs, wb)
    for e in range(E):
        want_w, want_o = _pack(codes[e], j[e], wb)
        assert np.array_equal(words[e].numpy(), want_w) and np.array_equal(frag[e].numpy(), want_o)
    back_p, back_o = from_fragment_order(words, frag, wb)
    assert torch.equal(back_p, packed) and torch.equal(back_o, offs)


def _word(codes: list[int]) -> int:
    return sum(c << (4 * n) for n, c in enumerate(codes))


def _bytes(x: int) -> list[int]:
    return [(x >> (8 * i)) & 0xFF for i in range(4)]


def _ref(codes: list[int], j: int) -> list[int]:
    return expand_e2m1_to_e4m3_reference(torch.tensor(codes, dtype=torch.uint8), j).tolist()


@pytest.mark.parametrize("wb", [32, 16])
def test_pack4_lookup_ptx_gives_the_reference_bytes(wb):
    """Operands as Triton passes them with pack = 4: four copies of the word, then of each table;
    the outputs' byte i is element i (K 4t + i, and 16 + 4t + i for the second output). Blocks of
    16 take the second half's bytes from the second block's tables."""
    asm = FRAGMENT_LOOKUP_PTX_32 if wb == 32 else FRAGMENT_LOOKUP_PTX_16
    n_in = 12 if wb == 32 else 20
    offsets = list(range(-8, 7))
    for ja, jb in zip(offsets, offsets[5:] + offsets[:5]):
        ta = run(E4M3_TABLE_PTX, "=r,=r,r", [ja & 0xFFFFFFFF])
        tb = run(E4M3_TABLE_PTX, "=r,=r,r", [jb & 0xFFFFFFFF]) if wb == 16 else ta
        for c in range(16):
            codes = [(c + 3 * n) % 16 for n in range(8)]
            ops = [_word(codes)] * 4 + [ta[0]] * 4 + [ta[1]] * 4 + ([tb[0]] * 4 + [tb[1]] * 4 if wb == 16 else [])
            assert len(ops) == n_in
            lo, hi = run(asm, "=r,=r" + ",r" * n_in, ops)
            want = _ref(codes[:4] + [0] * 4, ja)[:4] + _ref([0] * 4 + codes[4:], jb if wb == 16 else ja)[4:]
            assert _bytes(lo) + _bytes(hi) == want, (wb, ja, jb, codes)


def test_compiled_for_sm90_the_weights_reach_fp8_wgmma_from_registers():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-P", "-m", "k3nvfp4.kernels.offline.compile_w4a8", "--fragment-probe"],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    rows = json.loads(proc.stdout)
    assert [r["weight_block"] for r in rows] == [32, 16]
    for r in rows:
        # the tokens' tile (64 K x 16 tokens) is the only E4M3 operand staged in shared memory
        assert r["e4m3_operands_through_shared"] == ["64x16"], r
        # and no layout conversion of the expanded bytes on the way to the MMA (a K order or a lane
        # assignment that is not the fragment's costs one: STSM + LDS or shuffles every iteration)
        assert r["byte_tile_conversions"] == 0 and r["matrix_shared_ops_in_loop"] == {}, r
        assert r["a_in_registers"] and r["wgmma_forms"] == ["wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3"], r
        assert r["local_bytes"] == 0 and r["loop_mma_per_warp"] >= 1, r
        print(f"fragment probe, blocks of {r['weight_block']}: {r['loop_instructions_per_warp']} instructions per warp "
              f"per iteration, {r['warp_instr_per_weight']} warp-instructions per weight")
