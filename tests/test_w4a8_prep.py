"""W4A8 weight preparation (kernels/moe_w4a8_details/prep.py) against the independent float64 oracle
(tests/w4a8_oracle.py): row exponents, block offsets, out-of-window counts and the E4M3 bytes of
every block bit for bit, from MXFP4 and from power-of-two NVFP4; the refusals."""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import pytest
import torch

import w4a8_oracle as orc
from k3nvfp4.kernels import formats
from k3nvfp4.kernels.moe_w4a8_details.prep import (e4m3_pow2_exponents, prepare_w4a8_from_mxfp4,
                                       prepare_w4a8_from_nvfp4)


def _mxfp4(E: int, N: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random nibbles; E8M0 bytes as the synthetic checkpoints spread them (most within a few
    binades of a per-matrix maximum) plus blocks 15..40 binades lower, byte-0 (2^-127) blocks,
    all-zero blocks and one all-zero row."""
    g = np.random.default_rng(seed)
    packed = g.integers(0, 256, (E, N, K // 2), dtype=np.uint8)
    e8 = (121 - g.binomial(12, 0.25, (E, N, K // 32))).astype(np.int64)
    u = g.random(e8.shape)
    e8 = np.where(u < 0.08, 121 - g.integers(15, 41, e8.shape), e8)
    e8 = np.where((u >= 0.08) & (u < 0.1), 0, e8).astype(np.uint8)
    zero_blocks = g.random(e8.shape) < 0.05
    pb = packed.reshape(E, N, K // 32, 16)
    pb[zero_blocks] = g.choice(np.array([0x00, 0x08, 0x80, 0x88], np.uint8), size=(int(zero_blocks.sum()), 16))
    packed[0, 1] = 0x88  # a row of (signed) zeros
    return torch.from_numpy(packed), torch.from_numpy(e8)


def test_mxfp4_matches_the_oracle_bit_for_bit():
    packed, e8 = _mxfp4(2, 24, 256, seed=3)
    with pytest.warns(UserWarning, match=r"w13: \d+ of 384 E2M1 blocks lie more than 14 binades below"):
        w = prepare_w4a8_from_mxfp4(packed, e8, name="w13")
    assert w.block == 32 and w.offsets.dtype == torch.int8 and w.row_exponent.dtype == torch.int32
    assert int(w.offsets.min()) >= -8 and int(w.offsets.max()) <= 6
    assert w.out_of_window > 20 and 0 < w.rounded <= w.out_of_window
    oracles = [orc.w4a8_from_mxfp4(packed[e].numpy(), e8[e].numpy()) for e in range(2)]
    assert (w.out_of_window, w.rounded) == (sum(m.out_of_window for m in oracles), sum(m.rounded for m in oracles))
    e4m3 = w.expand_e4m3().numpy()
    for e, m in enumerate(oracles):
        assert w.row_exponent[e].numpy().tolist() == m.row_exponent.tolist()
        assert w.offsets[e].numpy().astype(np.int64).tolist() == m.offsets.tolist()
        assert np.array_equal(e4m3[e], m.e4m3)  # every block, bit for bit
        assert m.table == "full"  # blocks 12 .. 14 binades below their row's largest, and re-encoded ones
        assert np.array_equal(w.dequantize()[e].numpy(), m.dequantize())
    assert w.table == "full"
    assert torch.equal(w.row_scale, torch.exp2(w.row_exponent.float()))
    # where the nibbles were not re-encoded the values are the MXFP4 values exactly (the oracle's decoding)
    v = orc.e2m1_values(orc.nibbles(packed.numpy())) * np.repeat(np.ldexp(1.0, e8.numpy().astype(np.int64) - 127), 32, -1)
    kept = np.repeat(w.packed.numpy() == packed.numpy(), 2, -1)
    assert kept.mean() > 0.8 and np.array_equal(w.dequantize().numpy()[kept], v[kept])


def _table_case(below: int, fill: int = 0x77) -> tuple[torch.Tensor, torch.Tensor]:
    """One matrix [4, 128]: every block at E8M0 120 except block (1, 2), ``below`` binades lower,
    holding ``fill`` in every byte."""
    packed = torch.full((4, 64), 0x53, dtype=torch.uint8)
    packed[1, 32:48] = fill
    e8 = torch.full((4, 4), 120, dtype=torch.uint8)
    e8[1, 2] = 120 - below
    return packed, e8


@pytest.mark.parametrize("below, fill, offset, table", [
    (11, 0x77, -5, "normal"),   # its smallest code 0.5 x 2^-5 = 2^-6, still a normal E4M3
    (12, 0x77, -6, "full"),     # 0.5 x 2^-6 is an E4M3 subnormal
    (14, 0x11, -8, "full"),     # the bottom of the window
    (40, 0x00, -5, "normal"),   # a zero block far below: exact at any offset, so it takes -5
    (40, 0x88, -5, "normal"),   # signed zeros too
    (23, 0x11, -5, "normal"),   # out of window: 0.5 x 2^-17 rounds to 0 at offset -8, the block empties
    (16, 0x77, -8, "full"),     # out of window, re-encoded at -8 (6 x 2^-2 -> 1.5): stays nonzero
])
def test_table_is_normal_iff_every_block_with_a_code_is_at_offset_minus5_or_above(below, fill, offset, table):
    """The preparation's per-matrix choice of the kernel's E4M3 table (prep.py), against the
    oracle's independent rule (all eight E2M1 magnitudes x 2^offset normal E4M3 values) and by hand:
    every row's largest block sits at offset 6, so block (1, 2) sits at 6 - below."""
    packed, e8 = _table_case(below, fill)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the re-encoded cases warn (test_mxfp4_matches_the_oracle_bit_for_bit)
        w = prepare_w4a8_from_mxfp4(packed, e8, name="w2")
    m = orc.w4a8_from_mxfp4(packed.numpy(), e8.numpy())
    assert (w.table, m.table) == (table, table)
    assert int(w.offsets[1, 2]) == offset and int(w.offsets[0].min()) == 6
    assert w.offsets.numpy().astype(np.int64).tolist() == m.offsets.tolist()
    assert np.array_equal(w.expand_e4m3().numpy(), m.e4m3)


def test_refuse_names_the_tensor():
    packed, e8 = _mxfp4(1, 8, 128, seed=5)
    with pytest.raises(ValueError, match=r"layers\.3\.w2: \d+ E2M1 blocks lie more than 14 binades below .*out_of_window='round'"):
        prepare_w4a8_from_mxfp4(packed, e8, name="layers.3.w2", out_of_window="refuse")
    e8_ok = torch.full_like(e8, 120)
    w = prepare_w4a8_from_mxfp4(packed, e8_ok, name="w2", out_of_window="refuse")
    assert w.out_of_window == w.rounded == 0 and w.packed is packed
    bad = e8_ok.clone()
    bad[0, 2, 1] = 255
    with pytest.raises(ValueError, match=r"w2 \(E8M0 scales\): 1 E8M0 scale byte\(s\) are 255 \(NaN\)"):
        prepare_w4a8_from_mxfp4(packed, bad, name="w2")
    with pytest.raises(ValueError, match="out_of_window"):
        prepare_w4a8_from_mxfp4(packed, e8_ok, out_of_window="clip")
    with pytest.raises(TypeError, match=r"w2 \(E8M0 scales\): expected a torch.uint8 tensor"):
        prepare_w4a8_from_mxfp4(packed, e8_ok.int(), name="w2")
    with pytest.raises(ValueError, match="do not match 32-element blocks"):
        prepare_w4a8_from_mxfp4(packed, e8_ok[..., :-1], name="w2")


def test_pow2_nvfp4_matches_the_oracle_and_the_mxfp4_path():
    """The cast's NVFP4 (block scale 2^(k_j - m) per 16, scale_2 = 2^m) prepares to the same bytes and
    row factors as the MXFP4 it came from (offsets per 16 instead of per 32)."""
    packed, e8 = _mxfp4(1, 16, 128, seed=7)
    e8 = torch.where(e8 < 105, torch.full_like(e8, 105), e8)  # within the cast's 17-binade window, not all in W4A8's 14
    k = e8.to(torch.int32) - 127
    m_exp = int(k.max()) - 8
    scale = torch.exp2((k - m_exp).float()).repeat_interleave(2, -1).to(torch.float8_e4m3fn)
    s2 = torch.tensor([2.0**m_exp])
    with pytest.warns(UserWarning, match="w1: "):
        nv = prepare_w4a8_from_nvfp4(packed, scale, s2, name="w1")
    assert nv.rounded > 0
    with pytest.warns(UserWarning):
        mx = prepare_w4a8_from_mxfp4(packed, e8, name="w1")
    assert torch.equal(nv.expand_e4m3(), mx.expand_e4m3()) and torch.equal(nv.dequantize(), mx.dequantize())
    rows = (formats.unpack_e2m1(packed) & 7).amax(-1) > 0  # the zero row's factor is irrelevant (and differs)
    assert not rows.all() and torch.equal(nv.row_scale[rows], mx.row_scale[rows])
    assert nv.block == 16 and torch.equal(nv.offsets, mx.offsets.repeat_interleave(2, -1))
    o = orc.w4a8_from_pow2_nvfp4(packed[0].numpy(), scale[0].view(torch.uint8).numpy())
    assert np.array_equal(nv.expand_e4m3()[0].numpy(), o.e4m3)
    assert nv.row_exponent[0].numpy().tolist() == o.row_exponent.tolist()  # relative to scale_2 (in row_scale)
    assert torch.equal(mx.row_exponent[rows], nv.row_exponent[rows] + m_exp)
    # zero block scales: the block is zero whatever its nibbles
    z = scale.clone()
    z[0, 3, 1] = 0.0
    w = prepare_w4a8_from_nvfp4(packed[:, :4, :16], z[:, :4, :2], 1.0, name="w1")
    assert (w.dequantize()[0, 3, 16:32] == 0).all() and (packed[0, 3, 8:16] != 0).any()


def test_non_power_of_two_nvfp4_scales_are_refused():
    packed = torch.randint(0, 256, (4, 16), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    scale = torch.full((4, 2), 0.5).to(torch.float8_e4m3fn)
    scale[2, 1] = 0.75
    with pytest.raises(ValueError, match=r"experts\.7\.w3 \(E4M3 block scales\): 1 E4M3 block scales are not powers of "
                                         r"two \(first at \(2, 1\): 0\.75\).*use W4A16"):
        prepare_w4a8_from_nvfp4(packed, scale, 1.0, name="experts.7.w3")
    for bad in (-0.5, float("nan")):
        s = torch.full((4, 2), 0.5).to(torch.float8_e4m3fn)
        s[0, 0] = bad
        with pytest.raises(ValueError, match="not powers of two"):
            prepare_w4a8_from_nvfp4(packed, s, 1.0)
    k, zero = e4m3_pow2_exponents(torch.tensor([2.0**-9, 2.0**-7, 0.0, 448.0 / 1.75]).to(torch.float8_e4m3fn))
    assert k.tolist() == [-9, -7, 0, 8] and zero.tolist() == [False, False, True, False]
    with pytest.raises(ValueError, match="scale_2"):
        prepare_w4a8_from_nvfp4(packed, torch.full((4, 2), 0.5).to(torch.float8_e4m3fn), 0.0)
