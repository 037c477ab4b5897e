"""MXFP4 -> NVFP4 closed-form cast (torch path): bit-exactness, scales, statistics,
the out-of-range fallback (vs a brute-force oracle and vs ModelOpt's fallback computed
by hand), and errors."""

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from k3nvfp4.kernels import formats
from k3nvfp4.kernels.cast import CastStats, MXFP4Weight, cast_expert, cast_mxfp4_to_nvfp4
from k3nvfp4.kernels.cast_details.requant import requantize_blocks_e4m3

E4M3_CODES = np.arange(1, 127, dtype=np.uint8)  # positive finite E4M3 codes
E4M3_VALUES = E4M3_CODES.view(ml_dtypes.float8_e4m3fn).astype(np.float64)


def _weight(rows, cols, e8m0, name="w", seed=0):
    """MXFP4Weight with random nibbles (all 16 codes, -0 included) and given E8M0 bytes."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g)
    scale = torch.as_tensor(e8m0, dtype=torch.uint8).reshape(rows, cols // 32).clone()
    return MXFP4Weight(packed, scale, name)


# Dequantized values in float64, by hand: exact for every code (FP32 would overflow for
# E8M0 bytes 253/254 with large nibbles, 4 * 2^127 > FP32 max).
def _codes64(packed):
    return formats.e2m1_to_float(formats.unpack_e2m1(packed)).double()


def _values64(packed, scale):
    rows, cols = packed.shape[0], 2 * packed.shape[1]
    k = torch.exp2(scale.double() - 127).repeat_interleave(32, dim=-1)
    return _codes64(packed) * k.reshape(rows, cols)


def _nv_values64(w):
    s = torch.from_numpy(w.scale.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float64))
    return _codes64(w.packed) * s.repeat_interleave(16, dim=-1) * float(w.scale_2)


def _e4m3_bits_of_exp2(d):
    """E4M3 byte of 2^d from ml_dtypes (the oracle of the closed-form scales)."""
    return np.exp2(np.asarray(d, dtype=np.float32)).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)


# ---------------------------------------------------------------- closed form, hand cases


def test_expert_hand_case_shared_scale_2_and_exact_scales():
    # w1 max byte 130 (k=3), w3 max byte 125 (k=-2): they share m = 3 - 8 = -5.
    # w2 max byte 120 (k=-7): its own m = -15.
    # (rows 2.. hold byte 120, in range for both; I = 32 rows so w2's in-dim is 32-aligned)
    e1 = np.full((32, 2), 120, np.uint8)
    e3 = e1.copy()
    e1[:2] = [[130, 127], [126, 120]]
    e3[:2] = [[125, 124], [113, 112]]
    w1 = _weight(32, 64, e1, "l1.e0.w1", seed=1)
    w3 = _weight(32, 64, e3, "l1.e0.w3", seed=2)
    w2 = _weight(64, 32, np.full((64, 1), 120, np.uint8), "l1.e0.w2", seed=3)  # [H=64, I=32]
    w1n, w3n, w2n, stats = cast_expert(w1, w3, w2)

    assert w1n.scale_2.dtype == torch.float32 and w1n.scale_2.dim() == 0
    assert float(w1n.scale_2) == 2.0**-5 and float(w3n.scale_2) == 2.0**-5
    assert float(w2n.scale_2) == 2.0**-15
    # block scale 2^(k_j - m), each twice: k=3 -> 2^8=256; k=0 -> 32; k=-1 -> 16; k=-7 -> 0.25
    assert w1n.scale.dtype == torch.float8_e4m3fn and w1n.scale.shape == (32, 4)
    assert w1n.scale[:2].float().tolist() == [[256, 256, 32, 32], [16, 16, 0.25, 0.25]]
    # w3: k=-2 -> 8, k=-3 -> 4, k=-14 -> 2^-9 (smallest subnormal, still exact), k=-15 -> 2^-10: out of range
    assert w3n.scale.float()[0].tolist() == [8, 8, 4, 4]
    assert w3n.scale.float()[1, :2].tolist() == [2.0**-9, 2.0**-9]
    assert w2n.scale.float().unique().tolist() == [256.0]
    # nibbles untouched: the very same tensor where every block is exact
    assert w1n.packed is w1.packed and w2n.packed is w2.packed
    # bytes of the exact blocks unchanged in w3 (its last block was re-quantized)
    assert torch.equal(w3n.packed[:, :16], w3.packed[:, :16]) and torch.equal(w3n.packed[0], w3.packed[0])
    assert stats.blocks == 64 + 64 + 64
    assert stats.out_of_range_blocks == 1 and stats.zero_exponent_blocks == 0
    for src, dst in ((w1, w1n), (w2, w2n)):
        assert torch.equal(_nv_values64(dst), _values64(src.packed, src.scale))
    src3, dst3 = _values64(w3.packed, w3.scale), _nv_values64(w3n)
    assert torch.equal(src3[:, :32], dst3[:, :32]) and torch.equal(src3[0], dst3[0])


def test_exact_window_boundary_17_vs_18():
    # max byte 140; 123 = 140 - 17 is exact (scale 2^-9), 122 = 140 - 18 is not representable.
    w = _weight(1, 96, [[140, 123, 122]], "w2", seed=4)
    (n,), stats = cast_mxfp4_to_nvfp4([w])
    assert n.scale.view(torch.uint8)[0, :4].tolist() == [0x78, 0x78, 0x01, 0x01]  # 2^8, 2^-9
    assert stats.out_of_range_blocks == 1
    src, dst = _values64(w.packed, w.scale), _nv_values64(n)
    assert torch.equal(src[0, :64], dst[0, :64])


def test_all_exponent_bytes_give_exact_power_of_two_scales():
    # every in-window byte below each group max, against ml_dtypes' E4M3 encoding of 2^d
    for top in (17, 100, 127, 200, 254):
        lo = max(top - 17, 0)
        bytes_ = np.arange(lo, top + 1, dtype=np.uint8)
        w = _weight(1, 32 * len(bytes_), bytes_[None, :], "w", seed=top)
        (n,), stats = cast_mxfp4_to_nvfp4([w])
        expected = np.repeat(_e4m3_bits_of_exp2(bytes_.astype(np.int32) - top + 8), 2)
        assert np.array_equal(n.scale.view(torch.uint8)[0].numpy(), expected)
        assert float(n.scale_2) == 2.0 ** (top - 127 - 8)
        assert stats.exact_blocks == stats.blocks == len(bytes_) and stats.max_abs_err == 0.0
        assert torch.equal(_nv_values64(n), _values64(w.packed, w.scale))


def test_zero_exponent_blocks_in_a_group():
    # e8m0 == 0 (2^-127) never sets k_max; far outside the window -> re-quantized.
    w = _weight(2, 64, [[0, 130], [0, 129]], "w1", seed=5)
    w.packed[0, :16] = 0x88  # block (0, 0): all -0 nibbles -> reproduced exactly (signs kept)
    w.packed[1, :16] = 0x21  # block (1, 0): 0.5, 1.0 ... * 2^-127 -> lossy
    (n,), stats = cast_mxfp4_to_nvfp4([w])
    assert float(n.scale_2) == 2.0 ** (3 - 8)
    assert stats.zero_exponent_blocks == 2 and stats.out_of_range_blocks == 2
    assert stats.exact_blocks == 3
    assert n.packed[0, :16].tolist() == [0x88] * 16
    assert 0 < stats.max_abs_err <= 2.0**-127
    dst, src = _nv_values64(n), _values64(w.packed, w.scale)
    assert torch.equal(dst[:, 32:], src[:, 32:]) and torch.equal(dst[0], src[0])
    assert (torch.signbit(dst[0, :32])).all()  # -0 stays -0


def test_all_zero_exponent_group_stays_exact():
    # documented choice: k_max = -127, m = -135, scale_2 = 2^-135 (FP32 subnormal), all exact
    w1 = _weight(2, 64, np.zeros((2, 2), np.uint8), "w1", seed=6)
    w3 = _weight(2, 64, np.zeros((2, 2), np.uint8), "w3", seed=7)
    (n1, n3), stats = cast_mxfp4_to_nvfp4([w1, w3])
    assert float(n1.scale_2) == 2.0**-135 and float(n1.scale_2) > 0
    assert n1.scale.float().unique().tolist() == [256.0]
    assert stats == CastStats(blocks=8, exact_blocks=8, zero_exponent_blocks=8, out_of_range_blocks=0)
    for src, dst in ((w1, n1), (w3, n3)):
        assert dst.packed is src.packed
        assert torch.equal(_nv_values64(dst), _values64(src.packed, src.scale))


def test_stats_merge_add_and_to_dict():
    a = CastStats(10, 9, 1, 1, 0.5)
    b = CastStats(5, 5, 0, 0, 0.25)
    assert a + b == a.merge(b) == CastStats(15, 14, 1, 1, 0.5)
    assert (a + b).to_dict() == {
        "blocks": 15, "exact_blocks": 14, "zero_exponent_blocks": 1,
        "out_of_range_blocks": 1, "max_abs_err": 0.5,
    }
    assert sum([a, b], CastStats()) == CastStats(15, 14, 1, 1, 0.5)
    assert not a.all_exact and b.all_exact


# ---------------------------------------------------------------- out-of-range fallback


def _oracle_best_sq_err(x: np.ndarray, scale_2: float) -> np.ndarray:
    """Brute force over all positive finite E4M3 codes with ml_dtypes' E2M1 rounding
    (RNE, saturating): the minimum squared error per 16-block. x: float64 [N, 16]."""
    s = E4M3_VALUES * scale_2  # [C]
    q = (x[:, None, :] / s[None, :, None]).astype(np.float32).astype(ml_dtypes.float4_e2m1fn)
    deq = q.astype(np.float64) * s[None, :, None]
    return ((deq - x[:, None, :]) ** 2).sum(-1).min(1)


def _modelopt_fallback_sq_err(x32: np.ndarray, e8m0: np.ndarray, nib_max: np.ndarray, m: int) -> np.ndarray:
    """NVIDIA ModelOpt's MXFP4->NVFP4 cast for out-of-range blocks, recomputed by hand from
    modelopt/torch/quantization/{utils/numeric_utils.py, qtensor/nvfp4_tensor.py}:
    per-block amax = max |nibble| of the 32-block * 2^k_j (data-derived), global_amax =
    6 * 448 * 2^m, scale = e4m3(clamp(amax/6 * 448 / (global_amax/6), 2^-9, 448)) (amax 0 -> 1.0
    before scaling), values / (scale * scale_2) rounded by its searchsorted E2M1 rule.
    x32: float64 [N, 32]; returns the squared error per 16-block [N, 2]."""
    f32 = np.float32
    amax = (nib_max * np.exp2(e8m0.astype(np.float64) - 127)).astype(f32)
    global_amax = f32(6.0 * 448.0 * 2.0**m)
    per_block = amax / f32(6.0)
    per_block[per_block == 0] = f32(1.0)
    per_block = np.clip(per_block * f32(448.0) / (global_amax / f32(6.0)), f32(2.0**-9), f32(448.0))
    scale = per_block.astype(ml_dtypes.float8_e4m3fn).astype(f32)  # [N]
    wsf2 = global_amax / f32(6.0 * 448.0)
    scaled = (x32.astype(f32) / (scale * wsf2)[:, None]).astype(f32)
    bounds = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5], dtype=f32)
    mag = np.abs(scaled)
    order = np.searchsorted(bounds, mag, side="left") + np.isin(mag, bounds[[1, 3, 5]])
    values = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6], dtype=np.float64)[order] * np.sign(scaled)
    deq = values * (scale.astype(np.float64) * float(wsf2))[:, None]
    return ((deq - x32) ** 2).reshape(-1, 2, 16).sum(-1)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_out_of_range_blocks_beat_modelopt_and_match_brute_force(seed):
    rng = np.random.default_rng(seed)
    rows, cols = 16, 256
    e8m0 = rng.integers(95, 150, size=(rows, cols // 32)).astype(np.uint8)
    e8m0[0, 0] = 150  # k_max; window floor 133
    e8m0[1, :3] = [0, 132, 116]  # zero exponent, just out (delta -10), far out
    w = _weight(rows, cols, e8m0, "l5.e7.w3", seed=seed)
    w.packed[2, :] = 0x77  # some out-of-range blocks holding the largest nibble everywhere
    (n,), stats = cast_mxfp4_to_nvfp4([w])
    m = 150 - 127 - 8
    assert float(n.scale_2) == 2.0**m

    oor = e8m0 < 133
    assert stats.out_of_range_blocks == int(oor.sum()) > 10
    assert stats.zero_exponent_blocks == 1
    src = _values64(w.packed, w.scale).numpy().reshape(rows, -1, 32)
    dst = _nv_values64(n).numpy().reshape(rows, -1, 32)
    # in-range blocks bit-exact
    assert np.array_equal(dst[~oor], src[~oor])
    # out-of-range blocks: our squared error is the brute-force minimum over E4M3 codes ...
    ours = ((dst[oor] - src[oor]) ** 2).reshape(-1, 2, 16).sum(-1)
    best = _oracle_best_sq_err(src[oor].reshape(-1, 16), 2.0**m).reshape(-1, 2)
    assert np.array_equal(ours, best)
    # ... and never worse than ModelOpt's fallback, block by block
    codes = formats.unpack_e2m1(w.packed).numpy().reshape(rows, -1, 32)
    nib_max = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6])[codes & 7].max(-1)
    theirs = _modelopt_fallback_sq_err(src[oor], e8m0[oor], nib_max[oor], m)
    assert (ours <= theirs).all()
    # statistics: exact count and max_abs_err match a direct comparison
    exact = (dst == src).all(-1)
    assert stats.exact_blocks == int(exact.sum())
    assert stats.max_abs_err == float(np.abs(dst - src).max()) > 0


def test_requant_search_matches_brute_force_on_generic_blocks():
    # the fallback search is generic: arbitrary float blocks under an arbitrary scale_2
    rng = np.random.default_rng(3)
    x = rng.normal(size=(300, 16)) * np.exp2(rng.integers(-6, 6, size=(300, 1)))
    x[0] = 0.0
    x[1] = -0.0
    scale_2 = 0.37
    res = requantize_blocks_e4m3(torch.from_numpy(x), scale_2)
    deq = formats.e2m1_to_float(res.codes).double().numpy() * (
        formats.e4m3_to_float(res.scale).double().numpy() * scale_2
    )[:, None]
    ours = ((deq - x) ** 2).sum(-1)
    assert np.array_equal(ours, _oracle_best_sq_err(x, scale_2))
    assert res.exact[:2].all() and not res.exact[2:].any()
    assert res.codes[1].tolist() == [8] * 16  # -0 kept
    assert np.array_equal(res.max_abs_err.numpy(), np.abs(deq - x).max(-1))


# ---------------------------------------------------------------- properties


@st.composite
def _group(draw, in_range: bool):
    n_mats = draw(st.integers(1, 2))
    rows = draw(st.integers(1, 6))
    nblocks = draw(st.integers(1, 5))
    top = draw(st.integers(0, 254))
    lo = max(top - 17, 0) if in_range else 0
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    mats = []
    for i in range(n_mats):
        e8m0 = rng.integers(lo, top + 1, size=(rows, nblocks)).astype(np.uint8)
        if rng.random() < 0.3:
            e8m0[rng.random(e8m0.shape) < 0.3] = 0
        mats.append(_weight(rows, 32 * nblocks, e8m0, f"m{i}", seed=seed + i))
    if draw(st.booleans()):
        mats[0].scale.view(-1)[0] = top  # make the group max explicit
    return mats


@given(_group(in_range=True))
def test_property_in_range_is_bit_exact(mats):
    top = max(int(m.scale.max()) for m in mats)
    outs, stats = cast_mxfp4_to_nvfp4(mats, backend="torch")
    assert stats.out_of_range_blocks == 0 or top > 17  # zero bytes may fall outside
    for src, dst in zip(mats, outs):
        e8m0 = src.scale.numpy()
        inside = e8m0 >= top - 17
        s = _values64(src.packed, src.scale).numpy().reshape(*e8m0.shape, 32)
        d = _nv_values64(dst).numpy().reshape(*e8m0.shape, 32)
        assert np.array_equal(s[inside], d[inside])
        assert np.array_equal(np.signbit(s[inside]), np.signbit(d[inside]))
        packed_src = src.packed.numpy().reshape(*e8m0.shape, 16)
        assert np.array_equal(dst.packed.numpy().reshape(*e8m0.shape, 16)[inside], packed_src[inside])
        if inside.all():
            assert dst.packed is src.packed
        assert float(dst.scale_2) == 2.0 ** (top - 135)


@given(_group(in_range=False))
def test_property_stats_match_direct_count(mats):
    top = max(int(m.scale.max()) for m in mats)
    outs, stats = cast_mxfp4_to_nvfp4(mats)
    blocks = exact = zero = oor = 0
    err = 0.0
    for src, dst in zip(mats, outs):
        e8m0 = src.scale.numpy()
        s = _values64(src.packed, src.scale).numpy().reshape(*e8m0.shape, 32)
        d = _nv_values64(dst).numpy().reshape(*e8m0.shape, 32)
        blocks += e8m0.size
        exact += int((s == d).all(-1).sum())
        zero += int((e8m0 == 0).sum())
        oor += int((e8m0 < top - 17).sum())
        err = max(err, float(np.abs(s - d).max()))
    assert stats == CastStats(blocks, exact, zero, oor, err)


# ---------------------------------------------------------------- errors


def test_nan_exponent_names_the_tensor():
    w = _weight(2, 64, [[127, 255], [255, 3]], "layers.7.experts.3.w2.weight_scale")
    with pytest.raises(ValueError, match=r"layers\.7\.experts\.3\.w2\.weight_scale: 2 E8M0 .*255"):
        cast_mxfp4_to_nvfp4([w])


def test_bad_inputs_name_the_tensor():
    good = _weight(2, 64, np.full((2, 2), 127, np.uint8), "good")
    p, s = good.packed, good.scale
    cases = [
        (MXFP4Weight(p.to(torch.int8), s, "t_dtype"), TypeError, r"t_dtype: packed must be uint8"),
        (MXFP4Weight(p, s.view(torch.float8_e8m0fnu), "t_sdtype"), TypeError, r"t_sdtype: scale must be uint8"),
        (MXFP4Weight(p, s[:, :1], "t_shape"), ValueError, r"t_shape: scale shape \(2, 1\) does not match"),
        (MXFP4Weight(p[:1], s, "t_rows"), ValueError, r"t_rows: scale shape"),
        (MXFP4Weight(p[:, :8], s[:, :1], "t_in"), ValueError, r"t_in: in-dim 16 .* not a multiple of 32"),
        (MXFP4Weight(p.reshape(-1), s, "t_1d"), ValueError, r"t_1d: packed must be 2-D"),
    ]
    for w, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            cast_mxfp4_to_nvfp4([w])
    with pytest.raises(ValueError, match="no weights"):
        cast_mxfp4_to_nvfp4([])
    with pytest.raises(ValueError, match="backend"):
        cast_mxfp4_to_nvfp4([good], backend="cuda")


def test_expert_shape_mismatches():
    w1 = _weight(4, 64, np.full((4, 2), 127, np.uint8), "e.w1")
    w3 = _weight(4, 96, np.full((4, 3), 127, np.uint8), "e.w3")
    w2 = _weight(64, 32, np.full((64, 1), 127, np.uint8), "e.w2")
    with pytest.raises(ValueError, match=r"e\.w3: shape .* differs from e\.w1"):
        cast_expert(w1, w3, w2)
    w1 = _weight(32, 64, np.full((32, 2), 127, np.uint8), "e.w1")
    w3 = _weight(32, 64, np.full((32, 2), 127, np.uint8), "e.w3")
    bad_w2 = _weight(32, 64, np.full((32, 2), 127, np.uint8), "e.w2")
    with pytest.raises(ValueError, match=r"e\.w2: packed shape \(32, 32\) does not fit e\.w1"):
        cast_expert(w1, w3, bad_w2)
    good_w2 = _weight(64, 32, np.full((64, 1), 127, np.uint8), "e.w2")
    *_, stats = cast_expert(w1, w3, good_w2)
    assert stats.blocks == 2 * 64 + 64 and stats.all_exact


def test_expert_k3_shaped_is_exact_and_copies_no_nibbles():
    # K3 expert proportions at 1/16 of the rows: w1/w3 [192, 3584], w2 [3584, 192]
    rng = np.random.default_rng(11)
    w1 = _weight(192, 3584, rng.integers(110, 125, (192, 112)), "w1", seed=1)
    w3 = _weight(192, 3584, rng.integers(112, 128, (192, 112)), "w3", seed=2)
    w2 = _weight(3584, 192, rng.integers(105, 120, (3584, 6)), "w2", seed=3)
    w1n, w3n, w2n, stats = cast_expert(w1, w3, w2)
    assert stats.blocks == 192 * 112 * 2 + 3584 * 6 == stats.exact_blocks
    assert float(w1n.scale_2) == float(w3n.scale_2) == 2.0 ** (127 - 135)
    assert float(w2n.scale_2) == 2.0 ** (119 - 135)
    for src, dst in ((w1, w1n), (w3, w3n), (w2, w2n)):
        assert dst.packed is src.packed
        assert dst.scale.shape == (src.scale.shape[0], 2 * src.scale.shape[1])
        assert torch.equal(_nv_values64(dst), _values64(src.packed, src.scale))
    assert stats.max_abs_err == 0.0 and stats.out_of_range_blocks == 0


def test_outputs_save_and_load_with_safetensors():
    # the writer saves w1/w3 of one expert into one file: no two outputs may share memory
    from safetensors.torch import load, save

    w1 = _weight(32, 64, np.full((32, 2), 120, np.uint8), "w1", seed=8)
    w3 = _weight(32, 64, np.full((32, 2), 121, np.uint8), "w3", seed=9)
    w2 = _weight(64, 32, np.full((64, 1), 119, np.uint8), "w2", seed=10)
    outs = cast_expert(w1, w3, w2)[:3]
    tensors = {}
    for name, o in zip(("w1", "w3", "w2"), outs):
        tensors.update({f"{name}.weight": o.packed, f"{name}.weight_scale": o.scale, f"{name}.weight_scale_2": o.scale_2})
    back = load(save(tensors))
    assert back["w1.weight_scale"].dtype == torch.float8_e4m3fn and back["w1.weight_scale_2"].shape == ()
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k


# ---------------------------------------------------------------- zero-block fast path


def _cast_slow_reference(weights):
    """The cast as it was before the all-+-0 fast path: EVERY out-of-range block goes
    through the E4M3 search (copy of the packed bytes, requantize, write back)."""
    e8m0_max = max(int(w.scale.max()) for w in weights)
    m = e8m0_max - 127 - 8
    thr = e8m0_max - 17
    outs, stats = [], CastStats()
    for w in weights:
        d = w.scale.int() - e8m0_max + 8
        scale = np.where(d.numpy() >= -9, _e4m3_bits_of_exp2(np.maximum(d.numpy(), -9)), 0).astype(np.uint8)
        scale = torch.from_numpy(np.repeat(scale, 2, axis=1))
        packed = w.packed.clone()
        idx = torch.nonzero(w.scale.int().reshape(-1) < thr).squeeze(1)
        st = CastStats(blocks=w.scale.numel(), exact_blocks=w.scale.numel() - idx.numel(),
                       zero_exponent_blocks=int((w.scale == 0).sum()), out_of_range_blocks=idx.numel())
        if idx.numel():
            blocks = packed.view(-1, 16)
            vals = _codes64(blocks[idx]) * torch.exp2(w.scale.reshape(-1)[idx].double() - 127).unsqueeze(1)
            res = requantize_blocks_e4m3(vals.reshape(-1, 16), 2.0**m)
            blocks[idx] = formats.pack_e2m1(res.codes.reshape(-1, 32))
            scale.view(-1, 2)[idx] = res.scale.view(-1, 2)
            st.exact_blocks += int(res.exact.view(-1, 2).all(1).sum())
            st.max_abs_err = float(res.max_abs_err.max())
        outs.append((packed, scale, 2.0**m))
        stats = stats + st
    return outs, stats


def _with_zero_blocks(rng, rows, cols, top, zero_frac, nonzero_frac, oor_frac=0.0):
    """Random weight whose e8m0 == 0 blocks hold only +-0 nibbles (what quantizers write),
    except a share ``nonzero_frac`` of them that keep random nibbles; ``oor_frac`` of the
    blocks get an ordinary out-of-range byte (top - 18 .. top - 40)."""
    nb = cols // 32
    e8m0 = rng.integers(max(top - 17, 1), top + 1, size=(rows, nb)).astype(np.uint8)
    u = rng.random((rows, nb))
    e8m0[u < oor_frac] = np.clip(top - rng.integers(18, 41, size=int((u < oor_frac).sum())), 1, 254)
    zero = (u >= oor_frac) & (u < oor_frac + zero_frac)
    zero.reshape(-1)[0] = False
    e8m0[zero] = 0
    e8m0.reshape(-1)[0] = top
    packed = rng.integers(0, 256, size=(rows, nb, 16)).astype(np.uint8)
    all_zero = zero & (rng.random((rows, nb)) >= nonzero_frac)
    packed[all_zero] = np.array([0x00, 0x08, 0x80, 0x88], np.uint8)[rng.integers(0, 4, size=(int(all_zero.sum()), 16))]
    # some blocks with one +-0 16-half and one nonzero half (the half goes through the search)
    half = zero & ~all_zero & (rng.random((rows, nb)) < 0.5)
    packed[half, :8] = 0x88
    return MXFP4Weight(torch.from_numpy(packed.reshape(rows, -1)), torch.from_numpy(e8m0), "w"), int(all_zero.sum())


@pytest.mark.parametrize(
    "seed,zero_frac,nonzero_frac,oor_frac",
    [
        (0, 0.05, 0.0, 0.0),  # only all-zero blocks out of range: no copy, no search
        (1, 0.05, 0.3, 0.0),  # zero-exponent blocks, some with nonzero nibbles
        (2, 0.1, 0.2, 0.05),  # plus ordinary out-of-range blocks
        (3, 0.0, 0.0, 0.1),  # no zero-exponent blocks at all
        (4, 1.0, 0.0, 0.0),  # every block but the first (byte 130) e8m0 == 0 and all +-0
    ],
)
def test_zero_block_fast_path_matches_slow_path(seed, zero_frac, nonzero_frac, oor_frac):
    rng = np.random.default_rng(seed)
    w1, z1 = _with_zero_blocks(rng, 24, 256, 130, zero_frac, nonzero_frac, oor_frac)
    w3, z3 = _with_zero_blocks(rng, 24, 256, 130, zero_frac, nonzero_frac, oor_frac)
    ref, ref_stats = _cast_slow_reference([w1, w3])
    got, stats = cast_mxfp4_to_nvfp4([w1, w3])
    assert stats == ref_stats
    for (p, s, s2), n, w in zip(ref, got, (w1, w3)):
        assert torch.equal(n.packed, p), "nibbles differ from the slow path"
        assert torch.equal(n.scale.view(torch.uint8), s), "scales differ from the slow path"
        assert float(n.scale_2) == s2
    if nonzero_frac == 0.0 and oor_frac == 0.0:
        assert z1 + z3 > 0 and stats.out_of_range_blocks == stats.zero_exponent_blocks == z1 + z3
        assert got[0].packed is w1.packed and got[1].packed is w3.packed  # no copy of the nibbles
        assert stats.all_exact and stats.max_abs_err == 0.0
        # the documented scale of an all-+-0 out-of-range block: E4M3 code 1 (2^-9), both halves
        oor = (w1.scale < 130 - 17).repeat_interleave(2, dim=1)
        assert (got[0].scale.view(torch.uint8)[oor] == 0x01).all()
        assert torch.equal(_nv_values64(got[0]), _values64(w1.packed, w1.scale))  # -0 kept
    else:
        assert stats.out_of_range_blocks > stats.zero_exponent_blocks - (z1 + z3) >= 0


@given(
    rows=st.integers(1, 6),
    nblocks=st.integers(1, 6),
    top=st.integers(1, 254),
    zero_frac=st.sampled_from([0.0, 0.3, 0.8]),
    nonzero_frac=st.sampled_from([0.0, 0.5]),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_zero_block_fast_path_matches_slow_path(rows, nblocks, top, zero_frac, nonzero_frac, seed):
    rng = np.random.default_rng(seed)
    w, _ = _with_zero_blocks(rng, rows, 32 * nblocks, top, zero_frac, nonzero_frac, 0.1)
    ((p, s, s2),), ref_stats = _cast_slow_reference([w])
    (n,), stats = cast_mxfp4_to_nvfp4([w])
    assert stats == ref_stats
    assert torch.equal(n.packed, p) and torch.equal(n.scale.view(torch.uint8), s) and float(n.scale_2) == s2
