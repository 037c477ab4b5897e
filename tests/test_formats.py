"""FP4 format codecs (k3nvfp4.kernels.formats) against independent oracles over all codes:
ml_dtypes' float4_e2m1fn / float8_e8m0fnu / float8_e4m3fn and torch's float8 dtypes."""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from k3nvfp4.kernels import formats

ALL_BYTES = np.arange(256, dtype=np.uint8)


def _same(a, b) -> bool:
    """Bitwise-equal float32 arrays (signed zeros distinguished), NaN matching NaN."""
    a = np.asarray(a, dtype=np.float32)
    b = np.asarray(b, dtype=np.float32)
    if a.shape != b.shape or not np.array_equal(np.isnan(a), np.isnan(b)):
        return False
    keep = ~np.isnan(a)
    return np.array_equal(a[keep].view(np.uint32), b[keep].view(np.uint32))


# ---------------------------------------------------------------- E2M1


def test_e2m1_all_16_codes_match_ml_dtypes():
    codes = np.arange(16, dtype=np.uint8)
    ref = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32)
    ours = formats.e2m1_to_float(torch.from_numpy(codes)).numpy()
    assert _same(ours, ref)
    assert _same(formats.e2m1_table().numpy(), ref)
    assert math.copysign(1.0, float(ours[8])) == -1.0  # code 8 is -0


def test_float_to_e2m1_roundtrips_every_code():
    codes = torch.arange(16, dtype=torch.uint8)
    assert torch.equal(formats.float_to_e2m1(formats.e2m1_to_float(codes)), codes)


def test_float_to_e2m1_ties_to_even_hand_cases():
    x = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, -5.0])
    expected = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -0.0, -2.0, -4.0]
    got = formats.e2m1_to_float(formats.float_to_e2m1(x))
    assert _same(got.numpy(), np.array(expected, dtype=np.float32))


def test_float_to_e2m1_matches_ml_dtypes_rne_and_saturation():
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], dtype=np.float32)
    eps = np.float32(1e-3)
    rng = np.random.default_rng(0)
    x = np.concatenate(
        [
            mids, mids - eps, mids + eps, np.array([0.0, 6.0, 6.5, 7.0, 1e6, 5.9999], np.float32),
            rng.uniform(-8, 8, 4000).astype(np.float32),
            rng.uniform(-0.6, 0.6, 1000).astype(np.float32),
        ]
    )
    x = np.concatenate([x, -x])
    ref = x.astype(ml_dtypes.float4_e2m1fn).view(np.uint8)
    ours = formats.float_to_e2m1(torch.from_numpy(x)).numpy()
    assert np.array_equal(ours, ref)


def test_float_to_e2m1_refuses_nan():
    with pytest.raises(ValueError, match="NaN"):
        formats.float_to_e2m1(torch.tensor([1.0, float("nan")]))


def test_pack_unpack_nibble_order_hand_case():
    # elements [0.5, -1, 6, -0] -> codes [1, 10, 7, 8]; LOW nibble holds the EVEN element.
    codes = torch.tensor([[1, 10, 7, 8]], dtype=torch.uint8)
    packed = formats.pack_e2m1(codes)
    assert packed.tolist() == [[0xA1, 0x87]]
    assert torch.equal(formats.unpack_e2m1(packed), codes)
    assert formats.e2m1_to_float(formats.unpack_e2m1(packed)).tolist() == [[0.5, -1.0, 6.0, -0.0]]


def test_pack_unpack_roundtrip_all_bytes():
    b = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    codes = formats.unpack_e2m1(b)
    assert codes.shape == (4, 128) and int(codes.max()) == 15
    assert torch.equal(formats.pack_e2m1(codes), b)
    # the low nibble is the even element, the high nibble the odd one
    assert torch.equal(codes[:, 0::2], b & 0xF) and torch.equal(codes[:, 1::2], b >> 4)


def test_pack_e2m1_errors():
    with pytest.raises(ValueError, match="even"):
        formats.pack_e2m1(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(TypeError, match="codes"):
        formats.pack_e2m1(torch.zeros(4, dtype=torch.int32))
    with pytest.raises(TypeError, match="packed"):
        formats.unpack_e2m1(torch.zeros(4, dtype=torch.int8))


# ---------------------------------------------------------------- E8M0


def test_e8m0_all_256_bytes_match_torch_and_ml_dtypes():
    ours = formats.e8m0_to_float(torch.from_numpy(ALL_BYTES)).numpy()
    ref_ml = ALL_BYTES.view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    ref_torch = torch.from_numpy(ALL_BYTES).view(torch.float8_e8m0fnu).float().numpy()
    assert _same(ours, ref_ml)
    assert _same(ours, ref_torch)
    assert ours[0] == np.float32(2.0**-127) and np.isnan(ours[255])


def test_e8m0_to_exponent_values_and_nan_error():
    k = formats.e8m0_to_exponent(torch.from_numpy(ALL_BYTES[:255].copy()))
    assert k.dtype == torch.int32 and k.tolist() == list(range(-127, 128))
    bad = torch.tensor([[127, 255, 255]], dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"layers\.3\.w1\.weight_scale: 2 E8M0 .*255"):
        formats.e8m0_to_exponent(bad, name="layers.3.w1.weight_scale")
    with pytest.raises(TypeError, match="my_scale"):
        formats.e8m0_to_exponent(torch.zeros(2, dtype=torch.int16), name="my_scale")


# ---------------------------------------------------------------- E4M3


def test_e4m3_all_256_bytes_match_torch_and_ml_dtypes():
    ref_ml = ALL_BYTES.view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    ref_torch = torch.from_numpy(ALL_BYTES).view(torch.float8_e4m3fn).float().numpy()
    assert _same(ref_ml, ref_torch)
    from_bits = formats.e4m3_to_float(torch.from_numpy(ALL_BYTES)).numpy()
    from_fp8 = formats.e4m3_to_float(torch.from_numpy(ALL_BYTES).view(torch.float8_e4m3fn)).numpy()
    assert _same(from_bits, ref_ml)
    assert _same(from_fp8, ref_ml)


def test_exp2_to_e4m3_exact_window():
    k = torch.arange(-9, 9)
    got = formats.exp2_to_e4m3(k)
    assert got.dtype == torch.float8_e4m3fn
    ref = np.exp2(np.arange(-9, 9, dtype=np.float32)).astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert np.array_equal(got.view(torch.uint8).numpy(), ref)
    assert got.float().tolist() == [2.0**i for i in range(-9, 9)]
    for bad in (-10, 9):
        with pytest.raises(ValueError, match="blk_scale"):
            formats.exp2_to_e4m3(torch.tensor([0, bad]), name="blk_scale")


def test_e4m3_to_float_rejects_other_dtypes():
    with pytest.raises(TypeError, match="scale"):
        formats.e4m3_to_float(torch.zeros(2, dtype=torch.float16))


# ---------------------------------------------------------------- dequantize


def test_dequantize_mxfp4_hand_case():
    codes = torch.arange(32, dtype=torch.uint8).remainder(16).reshape(1, 32)
    packed = formats.pack_e2m1(codes)
    scale = torch.tensor([[128]], dtype=torch.uint8)  # 2^1
    got = formats.dequantize_mxfp4(packed, scale)
    mags = [0, 0.5, 1, 1.5, 2, 3, 4, 6]
    vals = [2.0 * v for v in mags] + [-2.0 * v for v in mags]
    assert got.shape == (1, 32) and got[0].tolist() == vals + vals
    assert math.copysign(1.0, float(got[0, 8])) == -1.0
    # e8m0 = 0 is 2^-127 (not zero): code 2 (1.0) -> 2^-127 exactly
    tiny = formats.dequantize_mxfp4(packed, torch.tensor([[0]], dtype=torch.uint8))
    assert float(tiny[0, 2]) == 2.0**-127 and float(tiny[0, 1]) == 2.0**-128


def test_dequantize_nvfp4_hand_case():
    codes = torch.tensor([[2] * 16 + [15] * 16], dtype=torch.uint8)  # 1.0 ..., -6.0 ...
    packed = formats.pack_e2m1(codes)
    scale = torch.tensor([[0.5, 1.5]]).to(torch.float8_e4m3fn)
    got = formats.dequantize_nvfp4(packed, scale, torch.tensor(4.0))
    assert got[0].tolist() == [2.0] * 16 + [-36.0] * 16
    # a per-expert scale_2 [E] broadcasts over [E, out, in]
    got3 = formats.dequantize_nvfp4(
        packed.expand(2, 1, 16), scale.expand(2, 1, 2), torch.tensor([1.0, 0.25])
    )
    assert got3[0, 0, 0].item() == 0.5 and got3[1, 0, 31].item() == -2.25


def test_dequantize_errors():
    packed = torch.zeros(2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="scale"):
        formats.dequantize_mxfp4(packed, torch.zeros(2, 2, dtype=torch.uint8))  # needs [2, 1]
    with pytest.raises(ValueError, match="scale"):
        formats.dequantize_nvfp4(packed, torch.zeros(2, 3, dtype=torch.float8_e4m3fn), 1.0)
    with pytest.raises(TypeError, match="scale"):
        formats.dequantize_mxfp4(packed, torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(TypeError, match="packed"):
        formats.dequantize_mxfp4(packed.to(torch.int16), torch.zeros(2, 1, dtype=torch.uint8))
    nan = formats.dequantize_mxfp4(packed, torch.full((2, 1), 255, dtype=torch.uint8))
    assert torch.isnan(nan).all()
