"""The kernel-native FP4 layout (kernels/moe_details/layout.py): exact round trips, preparation
from ModelOpt NVFP4 and from MXFP4 tensors, and equality with the closed-form cast."""

from __future__ import annotations

import warnings

import pytest
import torch

from k3nvfp4.kernels import NVFP4MoEWeights, formats, fused_moe_nvfp4
from k3nvfp4.kernels.cast import MXFP4Weight, cast_expert
from k3nvfp4.kernels.moe_details import layout
from k3nvfp4.kernels.testing import random_nvfp4_moe_weights, random_routing

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _nibbles(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("shape", [(16, 32), (48, 40), (3, 32, 88), (2, 2, 64, 1792)])
def test_nibble_tiles_round_trip_bit_for_bit(shape):
    packed = _nibbles(*shape)
    tiles = layout.pack_e2m1_tiles(packed)
    rows, k = shape[-2], 2 * shape[-1]
    assert tiles.shape == (*shape[:-2], rows // 16, -(-k // 64), 512)
    assert torch.equal(layout.unpack_e2m1_tiles(tiles, k), packed)


def test_layout_bits_decode_each_code_in_its_mma_register():
    """Hand check of the bit placement: a tile with one nonzero code at (row, k) puts exactly the
    bits of that code into the word of lane 4 (row % 8) + (k % 8) // 2, K step (k % 64) // 16,
    where rotl(word, r) & 0x81C081C0 (or the split form) yields the bf16 of code x 2^-126."""
    for row, kk, code in [(0, 0, 7), (9, 3, 0xA), (15, 63, 1), (4, 22, 0xF), (12, 45, 8)]:
        codes = torch.zeros(16, 64, dtype=torch.uint8)
        codes[row, kk] = code
        tiles = layout.pack_e2m1_tiles(formats.pack_e2m1(codes))
        words = tiles.reshape(128, 4).long()
        words = words[:, 0] | words[:, 1] << 8 | words[:, 2] << 16 | words[:, 3] << 24
        lane, step = 4 * (row % 8) + (kk % 8) // 2, (kk % 64) // 16
        nonzero = torch.nonzero(words).flatten().tolist()
        assert nonzero == ([lane * 4 + step] if code not in (0,) else [])
        w = int(words[lane * 4 + step])
        h, j, p = row // 8, (kk % 16) // 8, kk % 2
        rs, rm = layout.WORD_ROTATIONS[2 * j + h]
        rot = lambda x, r: ((x << r) | (x >> (32 - r))) & 0xFFFFFFFF if r else x  # noqa: E731
        reg = (rot(w, rs) & layout.SIGN_MASK) | (rot(w, rm) & layout.MAG_MASK)
        half = (reg >> (16 * p)) & 0xFFFF
        bf16 = torch.tensor([half << 16], dtype=torch.int64).to(torch.int32).view(torch.float32)
        expected = formats.e2m1_to_float(torch.tensor([code], dtype=torch.uint8)) * 2.0**-126
        assert torch.equal(bf16, expected) and torch.signbit(bf16) == torch.signbit(expected)
        assert (reg >> (16 * (1 - p))) & 0xFFFF == 0  # the other half is another element: zero here


def test_e5m3_bytes_hand_cases():
    """u = ((e + 22) << 3) | m of 2^e (1 + m/8); the kernel reads bf16 bits (u << 4) | 0x7000,
    i.e. the scale x 2^119. 1.0: u 176, bits 0x7B00 = 2^119; 448 = 2^8 x 1.75: u 246; the
    smallest subnormal 2^-9: u 104; 3 x 2^-9 (subnormal 0x03) = 2^-8 x 1.5: u 116."""
    for code, u in ((0x38, 176), (0x7E, 246), (0x01, 104), (0x03, 116)):
        scale = torch.full((16, 4), code, dtype=torch.uint8)
        _, words, exc = layout.pack_nvfp4_scales(torch.zeros(16, 32, dtype=torch.uint8), scale)
        assert len(exc) == 0
        w = int(words[0, 0, 0]) & 0xFFFFFFFF
        assert (w >> 4) & 0xFF == u and (w >> 20) & 0xFF == u  # steps 0 (in place), rows g and g + 8
        assert ((w & layout.E5M3_16.mask) | layout.E5M3_16.fill) & 0xFFFF == (u << 4) | 0x7000
        value = torch.tensor([code], dtype=torch.uint8).view(torch.float8_e4m3fn).float()
        assert torch.equal(layout.decode_scale_words(words, 64, layout.E5M3_16), value.expand(16, 4))


def test_nvfp4_scales_round_trip_every_e4m3_code_signs_and_zeros():
    """Every finite E4M3 code (negative and zero scales included) with random nibbles: the
    kernel's values (decoded scale words x the nibbles it keeps) equal e2m1 x scale exactly,
    signed zeros included, and unpacking gives the original bytes back; only blocks whose
    scale is negative, or zero with non-zero magnitudes, are kept aside."""
    finite = torch.tensor([b for b in range(256) if (b & 0x7F) != 0x7F], dtype=torch.uint8)
    scale = finite[torch.randperm(32 * 8, generator=torch.Generator().manual_seed(1)) % finite.numel()].reshape(32, 8)
    packed = _nibbles(32, 64, seed=3)
    packed[0, :8] = torch.tensor([0x00, 0x08, 0x80, 0x88] * 2, dtype=torch.uint8)  # a sign-only block
    scale[0, 0] = 0x00
    scale[1, 0] = 0x80  # -0
    original = packed.clone()
    nib, words, exc = layout.pack_nvfp4_scales(packed, scale.view(torch.float8_e4m3fn), "s")
    assert words.dtype == torch.int32 and words.shape == (2, 2, 16)
    kernel = formats.e2m1_to_float(formats.unpack_e2m1(nib)) * layout.decode_scale_words(words, 128, layout.E5M3_16).repeat_interleave(16, -1)
    want = formats.e2m1_to_float(formats.unpack_e2m1(packed)) * scale.view(torch.float8_e4m3fn).float().repeat_interleave(16, -1)
    assert torch.equal(kernel, want) and torch.equal(kernel.signbit(), want.signbit())
    special = (scale >= 0x80) | ((scale == 0) & ((packed.reshape(32, 8, 8) & 0x77).amax(-1) != 0))
    assert sorted(exc.index.tolist()) == torch.nonzero(special.flatten()).flatten().tolist() and 0 not in exc.index.tolist()
    back, s_back = layout.unpack_nvfp4_scales(nib, words, exc, 128)
    assert torch.equal(back, packed) and torch.equal(s_back.view(torch.uint8), scale)
    assert torch.equal(packed, original)  # the input is not modified


def test_scale_words_place_pairs_for_one_lop3():
    """Hand check of a scale word: lane g's word i holds the scales of rows g and g + 8 at K
    step 2i in place and at step 2i + 1 rotated right by 8 bits (E5M3_16); E8M0_32's word
    holds 32-block 0 in place and 1 rotated."""
    codes = torch.zeros(16, 4, dtype=torch.int64)
    codes[3, 2], codes[11, 2], codes[3, 3], codes[11, 3] = 0x11, 0x22, 0x33, 0x44
    w = layout._tile_scale_bytes(codes, layout.FP4TileLayout(16, 64), layout.E5M3_16)
    word = int(w[0, 0, 2 * 3 + 1]) & 0xFFFFFFFF
    rot = ((word << 8) | (word >> 24)) & 0xFFFFFFFF
    assert (word & 0x0FF00FF0) == (0x11 << 4) | (0x22 << 20) and (rot & 0x0FF00FF0) == (0x33 << 4) | (0x44 << 20)
    assert sum(int(x) != 0 for x in w.flatten()) == 1
    e = torch.zeros(16, 2, dtype=torch.int64)
    e[5, 0], e[13, 0], e[5, 1], e[13, 1] = 0x81, 0x7E, 0x01, 0xFE
    word = int(layout._tile_scale_bytes(e, layout.FP4TileLayout(16, 64), layout.E8M0_32)[0, 0, 5]) & 0xFFFFFFFF
    rot = ((word << 8) | (word >> 24)) & 0xFFFFFFFF
    assert (word & 0x7F807F80) == (0x81 << 7) | (0x7E << 23) and (rot & 0x7F807F80) == (0x01 << 7) | (0xFE << 23)


def test_layout_errors_name_the_tensor():
    with pytest.raises(ValueError, match="rows=24 must be a multiple of 16"):
        layout.pack_e2m1_tiles(_nibbles(24, 32))
    nan = torch.full((16, 4), 0x7F, dtype=torch.uint8)
    with pytest.raises(ValueError, match="NaN"):
        layout.pack_nvfp4_scales(torch.zeros(16, 32, dtype=torch.uint8), nan)
    w = random_nvfp4_moe_weights(2, 32, 16).to_modelopt()
    bad = w.w2_scale.clone().view(torch.uint8)
    bad[0, 0, 0] = 0xFF
    with pytest.raises(ValueError, match="w2_scale: .*NaN"):
        NVFP4MoEWeights.from_modelopt(w.w13, w.w13_scale, w.w13_scale_2, w.w2, bad.view(torch.float8_e4m3fn), w.w2_scale_2)


@pytest.mark.parametrize("H,I", [(32, 16), (48, 80), (192, 64)])
def test_from_modelopt_to_modelopt_round_trip(H, I):
    ref = random_nvfp4_moe_weights(3, H, I, seed=H, block_scales="uniform")
    canon = ref.to_modelopt()
    again = NVFP4MoEWeights.from_modelopt(*canon)
    assert again.hidden_size == H and again.intermediate_size == I
    for a, b in zip(canon, again.to_modelopt()):
        assert a.dtype == b.dtype and torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                                                  b.view(torch.uint8) if b.dtype != torch.float32 else b)  # fmt: skip
    # memory: the checkpoint's bytes, K padded to 64: nibbles once, one byte per 16-block scale
    E = 3
    assert again.w13.numel() == E * 2 * I * (-(-H // 64) * 64) // 2
    assert again.w13_scale.numel() * 4 == E * 2 * I * (-(-H // 64) * 64) // 16
    assert again.w2.nbytes + again.w2_scale.nbytes == E * H * (-(-I // 64) * 64) * 0.5625
    assert len(again.w13_exceptions) == 0 and len(again.w2_exceptions) == 0


def _mxfp4_expert(H: int, I: int, e8m0_lo: int, e8m0_hi: int, seed: int):
    g = torch.Generator().manual_seed(seed)

    def w(rows, cols, name):
        return MXFP4Weight(torch.randint(0, 256, (rows, cols // 2), dtype=torch.uint8, generator=g),
                           torch.randint(e8m0_lo, e8m0_hi + 1, (rows, cols // 32), dtype=torch.uint8, generator=g), name)  # fmt: skip

    return w(I, H, "w1"), w(I, H, "w3"), w(H, I, "w2")


def _from_cast(experts):
    casts = [cast_expert(*e, backend="torch") for e in experts]
    w13 = torch.stack([torch.cat([c[0].packed, c[1].packed]) for c in casts])
    s13 = torch.stack([torch.cat([c[0].scale, c[1].scale]) for c in casts])
    s13_2 = torch.stack([torch.stack([c[0].scale_2, c[1].scale_2]) for c in casts])
    w2 = torch.stack([c[2].packed for c in casts])
    s2 = torch.stack([c[2].scale for c in casts])
    s2_2 = torch.stack([c[2].scale_2 for c in casts])
    return NVFP4MoEWeights.from_modelopt(w13, s13, s13_2, w2, s2, s2_2), [c[3] for c in casts]


def _from_mxfp4(experts):
    return NVFP4MoEWeights.from_mxfp4(
        torch.stack([torch.cat([e[0].packed, e[1].packed]) for e in experts]),
        torch.stack([torch.cat([e[0].scale, e[1].scale]) for e in experts]),
        torch.stack([e[2].packed for e in experts]),
        torch.stack([e[2].scale for e in experts]),
    )


def _values(w: NVFP4MoEWeights):
    """float64 dequantized w13 [E, 2I, H] and w2 [E, H, I] of the kernel layout (with scale_2)."""
    v13, v2 = (v.double() for v in w.dequantize())
    I = w.intermediate_size
    v13[:, :I] *= w.w13_scale_2[:, 0, None, None].double()
    v13[:, I:] *= w.w13_scale_2[:, 1, None, None].double()
    v2 = v2 * w.w2_scale_2[:, None, None].double()
    return v13, v2


def _mx_values(packed, e8m0):
    k = torch.exp2(e8m0.double() - 127).repeat_interleave(32, dim=-1)
    return formats.e2m1_to_float(formats.unpack_e2m1(packed)).double() * k


def test_from_mxfp4_equals_the_cast_and_the_mxfp4_values():
    """In range (k_max - k <= 17) the kernel layout from MXFP4 tensors has the cast's NVFP4
    values bit for bit; beyond that (30 binades here) it still holds the MXFP4 values exactly,
    where the cast had to re-quantize."""
    H, I = 96, 64
    narrow = [_mxfp4_expert(H, I, 120, 134, seed=s) for s in range(3)]
    wide = [_mxfp4_expert(H, I, 100, 130, seed=10 + s) for s in range(2)]
    for experts, in_range in ((narrow, True), (wide, False)):
        mx = _from_mxfp4(experts)
        cast, stats = _from_cast(experts)
        assert all(st.all_exact for st in stats) == in_range
        m13, m2 = _values(mx)
        c13, c2 = _values(cast)
        t13 = torch.stack([torch.cat([_mx_values(e[0].packed, e[0].scale), _mx_values(e[1].packed, e[1].scale)]) for e in experts])
        t2 = torch.stack([_mx_values(e[2].packed, e[2].scale) for e in experts])
        assert torch.equal(m13, t13) and torch.equal(m2, t2)  # MXFP4 values, every block
        if in_range:
            assert torch.equal(m13, c13) and torch.equal(m2, c2)
            assert torch.equal(mx.w13, cast.w13) and mx.scale_format == layout.E8M0_32
            assert mx.w13_scale.nbytes * 2 == cast.w13_scale.nbytes  # one byte per 32, not two per 16
            for a, b in zip(mx.to_modelopt(), cast.to_modelopt()):  # the cast's tensors, bit for bit
                assert torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                                   b.view(torch.uint8) if b.dtype != torch.float32 else b)
            assert torch.equal(mx.w13_scale_2, cast.w13_scale_2) and torch.equal(mx.w2_scale_2, cast.w2_scale_2)
        else:
            assert not torch.equal(m13, c13)


def test_from_mxfp4_all_zero_blocks():
    """All-zero blocks stored with E8M0 0 (what MXFP4 quantizers write): the cast re-quantizes
    their scale, from_mxfp4 keeps 2^-127; nibbles and every other block scale are bit-identical
    and every value (signed zeros included) is equal."""
    H, I = 96, 64
    experts = [_mxfp4_expert(H, I, 120, 134, seed=20 + s) for s in range(2)]
    for w in experts[0][0], experts[1][2]:
        w.scale[3, 1] = 0
        w.packed[3, 16:32] = torch.tensor([0x00, 0x08, 0x80, 0x88] * 4, dtype=torch.uint8)
    with warnings.catch_warnings():  # all-zero blocks are not "deep" blocks
        warnings.simplefilter("error")
        mx = _from_mxfp4(experts)
    cast, _ = _from_cast(experts)
    assert torch.equal(mx.w13, cast.w13) and torch.equal(mx.w2, cast.w2)
    m13, m2 = _values(mx)
    c13, c2 = _values(cast)
    assert torch.equal(m13, c13) and torch.equal(m2, c2)
    assert torch.equal(m13.signbit(), c13.signbit()) and torch.equal(m2.signbit(), c2.signbit())
    s_mx = layout.decode_scale_words(mx.w13_scale, H, layout.E8M0_32).repeat_interleave(2, -1)
    s_cast = layout.decode_scale_words(cast.w13_scale, H, layout.E5M3_16)
    differ = (s_mx != s_cast).nonzero().tolist()
    assert all(e == 0 and r == 3 and b in (2, 3) for e, r, b in differ)  # only the zero block's two 16-blocks


def test_from_mxfp4_runs_the_kernels_like_the_cast():
    """fused_moe_nvfp4 on weights prepared from MXFP4 and from the cast's NVFP4: equal outputs."""
    H, I = 64, 32
    experts = [_mxfp4_expert(H, I, 122, 130, seed=s) for s in range(4)]
    mx, cast = _from_mxfp4(experts).to(DEV), _from_cast(experts)[0].to(DEV)
    tw, ids = random_routing(5, 4, 2, device=DEV, seed=1)
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(2)).to(DEV) * 2.0**-6
    assert torch.equal(fused_moe_nvfp4(x, mx, tw, ids), fused_moe_nvfp4(x, cast, tw, ids))


def test_from_mxfp4_refuses_nan_exponents():
    experts = [_mxfp4_expert(64, 32, 120, 130, seed=0)]
    experts[0][2].scale[1, 0] = 255
    with pytest.raises(ValueError, match="w2_e8m0: holds 255"):
        _from_mxfp4(experts)


def test_from_mxfp4_wide_exponent_spread_and_the_deep_block_warning():
    """Exponents 0..31 next to a largest block of 150 in one matrix: packing takes every finite
    exponent and the layout holds every MXFP4 value exactly (plain-torch read-back); the 24
    blocks more than 126 binades below the largest (bf16-subnormal products in the kernel)
    are counted in a warning that names the tensor."""
    H, I = 64, 32
    experts = [_mxfp4_expert(H, I, 120, 130, seed=5)]
    w1_scale = experts[0][0].scale  # [I, H/32] = [32, 2]
    w1_scale[:, 0] = torch.arange(0, 32, dtype=torch.uint8)
    w1_scale[0, 1] = 150  # k_max of w13: blocks 0..23 lie more than 126 binades below
    with pytest.warns(UserWarning, match=r"w13_e8m0: 24 non-zero MXFP4 blocks lie more than 126 binades"):
        mx = _from_mxfp4(experts)
    m13, _ = _values(mx)
    assert torch.equal(m13[0, :I], _mx_values(experts[0][0].packed, experts[0][0].scale))
    with warnings.catch_warnings():  # a 126-binade spread: no warning
        warnings.simplefilter("error")
        _from_mxfp4([_mxfp4_expert(H, I, 0, 126, seed=6)])


# --- the fast layout (issue 28) against its first implementation, bit for bit ----------------
# tests/layout_reference.py is the int64-gather implementation the fast one replaced. Shape
# classes: K3's TP16 w13 rows (2I = 384) and H = 3584 (56 K tiles), EP16's w2 (I = 3072 as K),
# TP32's w2 (K = I = 96: a padded K tile), K = 80 / 48 (padding inside a tile), several leading
# dims; the host (numpy) path on all of them, the CUDA kernels (in Triton's interpreter here) on
# the small ones.

import layout_reference as ref  # noqa: E402
from k3nvfp4.kernels.moe_details import layout_kernels  # noqa: E402

HOST_SHAPES = [(2, 384, 1792), (1, 64, 1536), (3, 96, 48), (2, 2, 32, 40), (16, 24), (5, 16, 32)]
KERNEL_SHAPES = [(2, 32, 48), (16, 40), (1, 48, 32)]


def _scales(shape, k_block: int, seed: int, special: bool) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(1, 0x7F, (*shape[:-1], 2 * shape[-1] // k_block), dtype=torch.uint8, generator=g)
    if special:  # zero and negative scales: the BlockExceptions path
        flat = s.view(-1)
        flat[::7] = 0
        flat[3::11] |= 0x80
        flat[5::13] = 0x80
    return s


@pytest.mark.parametrize("shape", HOST_SHAPES)
def test_fast_nibble_layout_equals_the_reference(shape):
    packed = _nibbles(*shape, seed=sum(shape))
    tiles = layout.pack_e2m1_tiles(packed)
    assert torch.equal(tiles, ref.pack_e2m1_tiles(packed))
    assert torch.equal(layout.unpack_e2m1_tiles(tiles, 2 * shape[-1]), packed)


@pytest.mark.parametrize("shape", HOST_SHAPES)
@pytest.mark.parametrize("special", [False, True])
def test_fast_nvfp4_scale_words_equal_the_reference(shape, special):
    packed = _nibbles(*shape, seed=1)
    scale = _scales(shape, 16, seed=len(shape), special=special)
    n_new, w_new, x_new = layout.pack_nvfp4_scales(packed, scale)
    n_ref, w_ref, x_ref = ref.pack_nvfp4_scales(packed, scale)
    assert torch.equal(w_new, w_ref) and torch.equal(n_new, n_ref)
    assert torch.equal(x_new.index, x_ref.index) and torch.equal(x_new.scale, x_ref.scale)
    assert torch.equal(x_new.nibbles, x_ref.nibbles) and (len(x_new) > 0) == special
    back, s = layout.unpack_nvfp4_scales(n_new, w_new, x_new, 2 * shape[-1])
    assert torch.equal(back, packed) and torch.equal(s.view(torch.uint8), scale)


@pytest.mark.parametrize("shape", [s for s in HOST_SHAPES if (2 * s[-1]) % 32 == 0])
def test_fast_e8m0_scale_words_equal_the_reference(shape):
    g = torch.Generator().manual_seed(3)
    e8m0 = torch.randint(100, 140, (*shape[:-1], 2 * shape[-1] // 32), dtype=torch.uint8, generator=g)
    m = torch.randint(5, 15, shape[:-2], generator=g) if len(shape) > 2 else 9
    words = layout.pack_e8m0_scale_tiles(e8m0, m)
    assert torch.equal(words, ref.pack_e8m0_scale_tiles(e8m0, m))
    k = 2 * shape[-1]
    assert torch.equal(layout.decode_scale_words(words, k, layout.E8M0_32), ref.decode_scale_words(words, k, ref.E8M0_32))


@pytest.mark.parametrize("shape", KERNEL_SHAPES)
def test_cuda_layout_kernels_equal_the_reference(shape):
    """layout_kernels.py (what CUDA tensors take), run here in Triton's interpreter."""
    packed = _nibbles(*shape, seed=11)
    rows, half_k = shape[-2], shape[-1]
    lay = layout.FP4TileLayout(rows, 2 * half_k)
    units = packed.reshape(-1, 16, half_k)
    tiles = torch.empty(units.shape[0], lay.k_tiles, 512, dtype=torch.uint8)
    layout_kernels.pack_nibbles(units, tiles, layout.word_bit_tables())
    assert torch.equal(tiles.reshape(*shape[:-2], *lay.packed_shape), ref.pack_e2m1_tiles(packed))
    back = torch.empty_like(units)
    layout_kernels.unpack_nibbles(tiles, back, layout.word_bit_tables())
    assert torch.equal(back, units)
    scale = _scales(shape, 16, seed=5, special=False)
    units = scale.reshape(-1, 16, scale.shape[-1])
    words = layout_kernels.tile_scale_bytes(units, lay.k_tiles, 2, 4, layout._e5m3_lut("cpu")[None], units.shape[0])
    expected = ref.pack_nvfp4_scales(packed, scale)[1]
    assert torch.equal(words.reshape(expected.shape), expected)
    u = layout_kernels.untile_scale_bytes(words, scale.shape[-1], 2, 4)
    assert torch.equal(u.reshape(scale.shape), layout._e5m3_lut("cpu")[scale.long()])
    if (2 * half_k) % 32 == 0:
        field = torch.randint(1, 255, (*shape[:-1], 2 * half_k // 32), dtype=torch.uint8,
                              generator=torch.Generator().manual_seed(6))
        w8 = layout_kernels.tile_scale_bytes(field.reshape(-1, 16, field.shape[-1]), lay.k_tiles, 1, 7)
        expected = ref._tile_scale_bytes(field.long(), lay, ref.E8M0_32)
        assert torch.equal(w8.reshape(expected.shape), expected)
        # one table per matrix (E8M0's per-expert offset): byte + 3 for matrix 0, + 5 for matrix 1, ...
        lead = field.reshape(-1, rows, field.shape[-1]).shape[0]
        off = torch.arange(lead) * 2 + 3
        luts = ((torch.arange(256)[None] + off[:, None]) & 0xFF).to(torch.uint8)
        shifted = ((field.reshape(lead, rows, -1).long() + off[:, None, None]) & 0xFF)
        w8s = layout_kernels.tile_scale_bytes(field.reshape(-1, 16, field.shape[-1]), lay.k_tiles, 1, 7, luts, rows // 16)
        expected = ref._tile_scale_bytes(shifted.reshape(field.shape), lay, ref.E8M0_32)
        assert torch.equal(w8s.reshape(expected.shape), expected)
        assert torch.equal(layout_kernels.untile_scale_bytes(w8, field.shape[-1], 1, 7).reshape(field.shape), field)


def test_fast_layout_does_not_modify_its_inputs():
    packed = _nibbles(2, 32, 48, seed=9)
    scale = _scales((2, 32, 48), 16, seed=9, special=True)
    p0, s0 = packed.clone(), scale.clone()
    layout.pack_e2m1_tiles(packed[:, :, :40])  # a non-contiguous view, too
    layout.pack_nvfp4_scales(packed, scale)
    assert torch.equal(packed, p0) and torch.equal(scale, s0)


@pytest.mark.parametrize("shape", [(2, 64, 96), (3, 96, 48), (16, 40)])
def test_numpy_host_path_equals_the_reference(shape):
    """layout_host's numpy path (what runs where numba cannot be imported)."""
    from k3nvfp4.kernels.moe_details import layout_host

    packed = _nibbles(*shape, seed=21)
    rows, half_k = shape[-2], shape[-1]
    lay = layout.FP4TileLayout(rows, 2 * half_k)
    units = packed.reshape(-1, 16, half_k).numpy()
    tiles = layout_host.pack_nibbles(units, lay.k_tiles, layout._host_tables(), use_numba=False)
    assert torch.equal(torch.from_numpy(tiles).reshape(*shape[:-2], *lay.packed_shape), ref.pack_e2m1_tiles(packed))
    assert (layout_host.unpack_nibbles(tiles, half_k, layout._host_tables(), use_numba=False) == units).all()
    scale = _scales(shape, 16, seed=22, special=False)
    su = scale.reshape(-1, 16, scale.shape[-1]).numpy()
    words = layout_host.tile_scale_bytes(su, lay.k_tiles, 2, 4, layout._e5m3_lut("cpu").numpy()[None], su.shape[0],
                                         use_numba=False)
    expected = ref.pack_nvfp4_scales(packed, scale)[1]
    assert torch.equal(torch.from_numpy(words).reshape(expected.shape), expected)
    u = layout_host.untile_scale_bytes(words, scale.shape[-1], 2, 4, use_numba=False)
    assert (u == layout._e5m3_lut("cpu").numpy()[su]).all()


@pytest.mark.parametrize("per_matrix", [False, True])
def test_e8m0_fields_outside_bf16_are_counted_like_the_reference(per_matrix):
    """Fields e8m0 - m + 119 outside [0, 254] are refused with their count, as the reference
    counts them (one scalar m for a matrix, or one m per matrix of a stack)."""
    g = torch.Generator().manual_seed(8)
    shape = (3, 16, 4) if per_matrix else (16, 4)
    e8m0 = torch.randint(100, 200, shape, dtype=torch.uint8, generator=g)
    m = torch.tensor([-60, 0, 40]) if per_matrix else -60
    with pytest.raises(ValueError) as expected:
        ref.pack_e8m0_scale_tiles(e8m0, m)
    count = str(expected.value).split(": ")[1].split()[0]
    with pytest.raises(ValueError, match=rf"e8m0: {count} block exponents fall outside bf16"):
        layout.pack_e8m0_scale_tiles(e8m0, m)
