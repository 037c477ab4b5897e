"""The W4A8 float64 oracle (tests/w4a8_oracle.py) against hand-computed cases: the exact window
of E2M1 x 2^j in E4M3 over every code, the per-row window rule, blocks below it, zero rows, the
activation quantizers, the SiTU bound."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest

import w4a8_oracle as orc

CODES = np.arange(16, dtype=np.uint8)


def test_e2m1_times_2j_is_e4m3_exactly_for_j_in_minus8_to_6():
    """Every code x 2^j is an E4M3 value for j in [-8, 6]; at j = -9 and j = 7 some code is not
    (0.5 x 2^-9 = 2^-10 is below the subnormal step, 6 x 2^7 = 768 > 448)."""
    exact_for_all = [j for j in range(-14, 12) if orc.block_exact(CODES[None], np.array([j]))[0]]
    assert exact_for_all == list(range(-8, 7)) == list(orc.EXACT_OFFSETS)
    v = orc.e2m1_values(CODES)
    for j in orc.EXACT_OFFSETS:
        bits = orc.expand_e2m1(CODES, j)
        assert (orc.e4m3_values(bits) == v * 2.0**j).all()
        assert (np.signbit(orc.e4m3_values(bits)) == (CODES >= 8)).all()  # -0 stays -0
    # the codes that fail just outside: code 1 (0.5) and 3 (1.5) below, 7 (6) and 6 (4) above
    assert not orc.block_exact(np.array([[1]], np.uint8), np.array([-9]))[0]
    assert not orc.block_exact(np.array([[3]], np.uint8), np.array([-9]))[0]
    assert orc.block_exact(np.array([[2, 5, 6, 7]], np.uint8), np.array([-9]))[0]
    assert not orc.block_exact(np.array([[6]], np.uint8), np.array([7]))[0]  # 4 x 128 = 512
    assert orc.block_exact(np.array([[5]], np.uint8), np.array([7]))[0]  # 3 x 128 = 384


def test_expanded_bytes_hand_computed():
    # E4M3 byte = sign | exponent field (bias 7) << 3 | mantissa; subnormals k x 2^-9 have field 0.
    assert orc.expand_e2m1(np.uint8(7), 6) == 0x7C  # 6 x 64 = 384 = 1.5 x 2^8: field 15, mantissa 100
    assert orc.expand_e2m1(np.uint8(15), 6) == 0xFC
    assert orc.expand_e2m1(np.uint8(1), -8) == 0x01  # 2^-9, the smallest subnormal
    assert orc.expand_e2m1(np.uint8(9), -8) == 0x81
    assert orc.expand_e2m1(np.uint8(3), -8) == 0x03  # 1.5 x 2^-8 = 3 x 2^-9
    assert orc.expand_e2m1(np.uint8(5), -6) == 0x14  # 3 x 2^-6 = 1.5 x 2^-5: field 2, mantissa 100
    assert orc.expand_e2m1(np.uint8(2), 0) == 0x38  # 1.0: field 7
    assert orc.expand_e2m1(np.uint8(8), 3) == 0x80  # -0
    with pytest.raises(ValueError, match="not E4M3"):
        orc.expand_e2m1(np.uint8(1), -9)


def _codes(rows: list[list[int]]) -> np.ndarray:
    return np.array(rows, dtype=np.uint8)


def test_row_window_rule_and_the_blocks_below_it():
    """One row of 4 blocks of 4 (block size 4 for readability): k = [3, -11, -12, -12].
    r = k_max - 6 = -3; offsets 6, -8 (14 binades below: exact), -9, -9 (15 below: outside)."""
    block = 4
    codes = _codes([[7, 15, 1, 2,   1, 3, 9, 2,   1, 3, 2, 0,   2, 5, 6, 7]])
    k = np.array([[3, -11, -12, -12]])
    m = orc.w4a8_matrix(codes, k, block)
    assert m.row_exponent.tolist() == [-3]
    assert m.offsets.tolist() == [[6, -8, -8, -8]]
    assert m.out_of_window == 2
    assert m.rounded == 1  # the last block (codes 1, 1.5, 3, 4, 6 halved: 1, 1.5, 2, 3) is exact
    got = m.dequantize()[0]
    # block 2 re-encoded at -8: 0.5 -> 0.25 (tie, to even: 0), 1.5 -> 0.75 (tie, to even: 1), 1 -> 0.5
    want = np.concatenate([
        np.array([6, -6, 0.5, 1]) * 2.0**3,
        np.array([0.5, 1.5, -0.5, 1]) * 2.0**-11,
        np.array([0, 1.0, 0.5, 0]) * 2.0**-11,   # 2^(r - 8) = 2^-11
        np.array([1, 3, 4, 6]) * 2.0**-12,
    ])
    assert (got == want).all()
    with pytest.raises(ValueError, match="1 blocks lie more than 14 binades below"):
        orc.w4a8_matrix(codes, k, block, out_of_window="refuse")
    # without the lossy block, "refuse" passes and the other outside block is exact
    ok = orc.w4a8_matrix(codes[:, [0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15]], k[:, [0, 1, 3]], block, "refuse")
    assert ok.out_of_window == 1 and ok.rounded == 0


def test_window_is_per_row_and_zero_blocks_do_not_set_it():
    """Row 0's largest nonzero block is k = 10 (a zero block at k = 40 does not count); row 1 has
    no nonzero code (r = -126, nothing outside); row 2 lies 200 binades lower, exact in its own window."""
    block = 2
    codes = _codes([[0, 8, 7, 1], [0, 0, 8, 8], [7, 1, 2, 2]])
    k = np.array([[40, 10], [5, -3], [-190, -204]])
    m = orc.w4a8_matrix(codes, k, block)
    assert m.row_exponent.tolist() == [4, -126, -126]
    # row 2: k_max - 6 = -196 is raised to -126 (fp32 normal); -190 - (-126) = -64 < -8: rounded away
    assert m.offsets[0].tolist() == [6, 6]
    assert m.offsets[1].tolist() == [6, 6]  # clip(131, ...), (123): any offset is exact for zeros
    assert m.out_of_window == 2 and m.rounded == 2
    assert (m.dequantize()[2] == 0).all()
    assert (m.dequantize()[0] == np.array([0, -0.0, 6 * 2.0**10, 0.5 * 2.0**10])).all()


def test_mxfp4_and_pow2_nvfp4_entry_points():
    rng = np.random.default_rng(0)
    packed = rng.integers(0, 256, (4, 32), dtype=np.uint8)  # K = 64
    e8m0 = np.array([[127, 120], [100, 115], [0, 130], [127, 127]], dtype=np.uint8)
    m = orc.w4a8_from_mxfp4(packed, e8m0)
    v = orc.e2m1_values(orc.nibbles(packed)) * np.repeat(np.ldexp(1.0, e8m0.astype(np.int64) - 127), 32, axis=1)
    assert m.row_exponent.tolist() == [-6, -18, -3, -6]  # k_max - 6 per row
    # row 2's first block re-encodes to zeros (below): a block of zeros takes offset -5
    assert m.offsets.tolist() == [[6, -1], [-8, 6], [-5, 6], [6, 6]]
    assert m.table == "full"  # row 1's re-encoded block sits at -8
    assert (m.dequantize()[[0, 3]] == v[[0, 3]]).all()
    assert (m.dequantize()[1:3, 32:] == v[1:3, 32:]).all()
    # row 1's first block (15 below) re-encoded at 2^(r - 8) = 2^-26; row 2's 2^-127 block rounds to 0
    want1 = (v[1, :32] * 2.0**26).astype(ml_dtypes.float4_e2m1fn).astype(np.float64) * 2.0**-26
    assert (m.dequantize()[1, :32] == want1).all() and (m.dequantize()[2, :32] == 0).all()
    assert m.out_of_window == 2
    with pytest.raises(ValueError, match="NaN"):
        orc.w4a8_from_mxfp4(packed, np.full((4, 2), 255, np.uint8))
    # the same values as power-of-two NVFP4 (scale_2 = 1): two 16-blocks per 32-block
    s16 = np.repeat(e8m0[[0, 3]].astype(np.int64) - 127, 2, axis=1)
    bits = np.ldexp(1.0, s16).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    n = orc.w4a8_from_pow2_nvfp4(packed[[0, 3]], bits)
    assert (n.dequantize() == v[[0, 3]]).all() and n.block == 16
    bad = bits.copy()
    bad[1, 2] = np.float32(1.5).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    with pytest.raises(ValueError, match="not a positive power of two"):
        orc.w4a8_from_pow2_nvfp4(packed[[0, 3]], bad)


def test_activation_groups_hand_computed():
    x = np.array([[1.0, 2.0, 3.3, -900.0, 0.7]], dtype=np.float32)  # K = 5, group 4: groups of 4 and 1
    q = orc.quantize_e4m3_groups(x, 4, "pow2")
    # group 0: amax 900 > 448 x 2 -> s = 4: 0.25, 0.5, 0.825 -> 0.8125 (step 1/16), -225 -> -224 (step 16)
    assert q.scales.tolist() == [[4.0, 2.0**-9]]  # group 1: 0.7 <= 448 x 2^-9 = 0.875, > 448 x 2^-10
    assert q.dequantize().tolist() == [[1.0, 2.0, 3.25, -896.0, 0.6875]]  # 0.7 x 2^9 = 358.4 -> 352 (step 32)
    f = orc.quantize_e4m3_groups(x, 4, "fp32")
    s = np.float32(900.0) / np.float32(448.0)
    assert f.scales[0, 0] == s
    assert f.dequantize()[0, 3] == -448.0 * float(s)  # the amax maps onto 448 exactly
    z = orc.quantize_e4m3_groups(np.zeros((2, 8), np.float32), 8)
    assert (z.bits == 0).all() and (z.scales == 1.0).all()


def test_pow2_scale_and_mxfp8():
    amax = np.array([448.0, 448.0 * (1 + 2.0**-40), 449.0, 1.0, 0.0, 448.0 * 2.0**-130])
    assert orc.pow2_scale(amax).tolist() == [1.0, 2.0, 2.0, 2.0**-8, 1.0, 2.0**-130]
    x = np.zeros((2, 64), np.float32)
    x[0, :32] = np.linspace(-449, 449, 32, dtype=np.float32)  # scale 2
    x[0, 32] = 1e-39  # below 448 x 2^-127: the scale is clamped at 2^-126 (E8M0 byte 1)
    y = orc.quantize_mxfp8(x)
    assert y[0, 0] == -448.0 and y[0, 31] == 448.0  # 449 / 2 = 224.5 -> 224 (step 16 in [128, 256))
    assert y[0, 32] == np.float64(np.float32(1e-39) / 2.0**-126).astype(ml_dtypes.float8_e4m3fn).astype(np.float64) * 2.0**-126
    assert (y[1] == 0).all()


def test_situ_bound_and_values():
    b = orc.situ_bound(4.0, 25.0)
    assert b == 100.0
    g = np.linspace(-60, 60, 1001)
    u = np.linspace(-400, 400, 1024)
    a = orc.situ(g[:, None], u[None, :])
    assert np.abs(a).max() <= b and np.abs(a).max() > 0.999 * b
    assert orc.situ(0.0, 7.0) == 0.0 and orc.situ(3.0, 0.0) == 0.0
    want = 4 * math.tanh(1.0) / (1 + math.exp(-4.0)) * 25 * math.tanh(1.0)
    assert orc.situ(4.0, 25.0) == pytest.approx(want, rel=1e-15)
    # the static per-tensor scale bound / 448 never saturates a group; fp32 group scales stay below it
    q = orc.quantize_e4m3_groups(a.astype(np.float32), 128, "fp32")
    nonzero = np.abs(a).reshape(1001, 8, 128).max(axis=2) > 0
    assert (q.scales[nonzero] <= np.float32(b / 448.0)).all() and (q.scales[~nonzero] == 1).all()


def test_expert_zero_rows_and_exact_case():
    """Zero tokens give exactly zero; tokens whose groups are E4M3 values with amax 448 are not
    changed by the activation quantizer, so GEMM1 equals the float64 product."""
    rng = np.random.default_rng(1)
    H, I = 64, 32
    w13 = orc.w4a8_from_mxfp4(rng.integers(0, 256, (2 * I, H // 2), dtype=np.uint8),
                              rng.integers(118, 124, (2 * I, H // 32), dtype=np.uint8))
    w2 = orc.w4a8_from_mxfp4(rng.integers(0, 256, (H, I // 2), dtype=np.uint8),
                             rng.integers(118, 124, (H, I // 32), dtype=np.uint8))
    x = rng.integers(-127, 128, (3, H)).astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    x = np.where(np.isnan(x), 0, x).astype(np.float32)
    x[:, ::32] = 448.0
    x[1] = 0.0
    q = orc.quantize_e4m3_groups(x, 32)
    assert (q.dequantize() == x).all()
    y = orc.expert_w4a8(x, w13, w2, group=32)
    assert (y[1] == 0).all() and np.abs(y[[0, 2]]).max(axis=1).min() > 0 and np.isfinite(y).all()
    h = x.astype(np.float64) @ w13.dequantize().T
    a = orc.situ(h[:, :I], h[:, I:]).astype(np.float32)
    assert np.allclose(y, orc.quantize_e4m3_groups(a, 32).dequantize() @ w2.dequantize().T, rtol=0, atol=0)
