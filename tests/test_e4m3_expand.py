"""E2M1 x 2^offset -> E4M3 bytes (kernels/moe_details/e4m3_expand.py): the Triton routine (in the
interpreter without a GPU) and its torch reference, bit for bit against ml_dtypes over all 16
codes x every offset of the exact window [-8, 6]."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch
import triton
import triton.language as tl

from k3nvfp4.kernels.moe_details.e4m3_expand import (E4M3_EXPAND_MAX_OFFSET, E4M3_EXPAND_MIN_OFFSET,
                                                     E4M3_NORMAL_MIN_OFFSET, expand_e2m1_to_e4m3,
                                                     expand_e2m1_to_e4m3_reference)

OFFSETS = np.arange(E4M3_EXPAND_MIN_OFFSET, E4M3_EXPAND_MAX_OFFSET + 1)


def _all_cases() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """codes uint8 [16 x 15], offsets int32, and the E4M3 bytes ml_dtypes gives for e2m1 x 2^j."""
    codes, offs = np.meshgrid(np.arange(16, dtype=np.uint8), OFFSETS, indexing="ij")
    codes, offs = codes.reshape(-1), offs.reshape(-1).astype(np.int32)
    v = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64) * np.ldexp(1.0, offs)
    e4m3 = v.astype(ml_dtypes.float8_e4m3fn)
    assert (e4m3.astype(np.float64) == v).all()  # the window: every product is an E4M3 value
    return codes, offs, e4m3.view(np.uint8)


def test_window_is_minus8_to_6():
    assert (E4M3_EXPAND_MIN_OFFSET, E4M3_EXPAND_MAX_OFFSET) == (-8, 6)


def test_reference_bit_exact_against_ml_dtypes():
    codes, offs, want = _all_cases()
    got = expand_e2m1_to_e4m3_reference(torch.from_numpy(codes), torch.from_numpy(offs))
    assert got.dtype == torch.uint8
    assert np.array_equal(got.numpy(), want)
    # a scalar offset broadcasts; -0 keeps its sign bit
    assert expand_e2m1_to_e4m3_reference(torch.tensor([8, 0, 7], dtype=torch.uint8), -3).tolist() == [0x80, 0, 0x34]  # 6 x 2^-3 = 1.5 x 2^-1: field 6


def test_reference_refuses_what_cannot_be_exact():
    with pytest.raises(ValueError, match=r"offset: must lie in \[-8, 6\].*\[-9, -9\]"):
        expand_e2m1_to_e4m3_reference(torch.tensor([1], dtype=torch.uint8), -9)
    with pytest.raises(ValueError, match="offset"):
        expand_e2m1_to_e4m3_reference(torch.tensor([1], dtype=torch.uint8), torch.tensor([7]))
    with pytest.raises(ValueError, match="codes: E2M1 codes are 0..15"):
        expand_e2m1_to_e4m3_reference(torch.tensor([16], dtype=torch.uint8), 0)
    with pytest.raises(TypeError, match="codes"):
        expand_e2m1_to_e4m3_reference(torch.tensor([1], dtype=torch.int32), 0)


@triton.jit
def _expand_kernel(codes_ptr, offset_ptr, out_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    keep = i < n
    c = tl.load(codes_ptr + i, mask=keep, other=0)
    j = tl.load(offset_ptr + i, mask=keep, other=0)
    tl.store(out_ptr + i, expand_e2m1_to_e4m3(c, j).to(tl.uint8), mask=keep)


def test_triton_routine_bit_exact_against_ml_dtypes():
    """In the interpreter on CPU (tests/conftest.py), on the GPU where there is one."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    codes, offs, want = _all_cases()
    out = torch.empty(codes.size, dtype=torch.uint8, device=dev)
    _expand_kernel[(1,)](torch.from_numpy(codes).to(dev), torch.from_numpy(offs).to(dev), out, codes.size,
                         BLOCK=triton.next_power_of_2(codes.size))
    assert np.array_equal(out.cpu().numpy(), want)
    # the bytes are the operand: read as float8_e4m3fn they are the products
    v = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64) * np.ldexp(1.0, offs)
    assert np.array_equal(out.cpu().view(torch.float8_e4m3fn).double().numpy(), v)


def test_probe_gemm_multiplies_the_prepared_weights():
    """The sm90 probe GEMM of kernels/offline/compile_w4a8.py (nibble unpack, per-32 offsets
    broadcast, expansion, E4M3 x E4M3 dot) run in the interpreter on weights kernels/moe_w4a8_details/prep.py
    prepares: equal to the float64 oracle's E4M3 weights x activations within fp32 accumulation
    (|error| <= K x 2^-24 x sum |products|)."""
    import w4a8_oracle as orc

    from k3nvfp4.kernels.offline.compile_w4a8 import w4a8_probe_kernel
    from k3nvfp4.kernels.moe_w4a8_details.prep import prepare_w4a8_from_mxfp4

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = np.random.default_rng(0)
    N, K, M = 32, 128, 16
    packed = torch.from_numpy(g.integers(0, 256, (N, K // 2), dtype=np.uint8))
    e8 = torch.from_numpy(g.integers(110, 125, (N, K // 32)).astype(np.uint8))  # 14 binades: all exact
    w = prepare_w4a8_from_mxfp4(packed, e8)
    xb = g.integers(0, 256, (K, M)).astype(np.uint8)
    xb[(xb & 0x7F) == 0x7F] = 0  # no NaN codes
    out = torch.empty(N, M, dtype=torch.float32, device=dev)
    w4a8_probe_kernel[(N // 16,)](w.packed.to(dev), w.offsets.to(dev), torch.from_numpy(xb).view(torch.float8_e4m3fn).to(dev),
                                  out, K, M, BLOCK_N=16, BLOCK_M=M, BLOCK_K=64)
    m = orc.w4a8_from_mxfp4(packed.numpy(), e8.numpy())
    assert m.rounded == 0
    wv, xv = orc.e4m3_values(m.e4m3), orc.e4m3_values(xb)
    ref = wv @ xv
    bound = K * 2.0**-24 * (np.abs(wv) @ np.abs(xv))
    assert (np.abs(out.cpu().numpy() - ref) <= bound).all()
    assert np.abs(ref).max() > 1e3  # a real product, not zeros


@triton.jit
def _words_kernel(w_ptr, off_ptr, out_ptr, K, WB: tl.constexpr, R: tl.constexpr, BLOCK_K: tl.constexpr,
                  NORMAL: tl.constexpr):
    from k3nvfp4.kernels.moe_w4a8_details.kernels import _expanded_weights

    blocks = tl.arange(0, R // 16)
    rows = tl.arange(0, R)
    for k0 in range(0, K, BLOCK_K):
        w = _expanded_weights(w_ptr, off_ptr, blocks, k0 // 64, K // 64, WB, R // 16, BLOCK_K, NORMAL)
        tl.store(out_ptr + rows[:, None] * K + (k0 + tl.arange(0, BLOCK_K))[None, :], w.to(tl.uint8, bitcast=True))


def _word_form_case(wb: int, offsets: np.ndarray, seed: int = 1):
    """32 rows x 128 K of E2M1 codes (half the rows every code in every block, half random) with
    block offsets drawn from ``offsets`` (each several times): (packed uint8 [32, 64], offsets int8
    [32, 128 / wb], the fragment-order words and offsets)."""
    from k3nvfp4.kernels.moe_w4a8_details.fragment import to_fragment_order

    g = np.random.default_rng(seed)
    R, K = 32, 128
    codes = g.integers(0, 16, (R, K), dtype=np.uint8)
    codes[: R // 2] = (np.arange(K)[None, :] * 7 + np.arange(R // 2)[:, None]) % 16  # every code in every block
    packed = torch.from_numpy(codes[:, 0::2] | (codes[:, 1::2] << 4))
    offs = np.resize(offsets, R * K // wb).reshape(R, K // wb)  # every offset in several blocks
    offs = torch.from_numpy(g.permuted(offs, axis=0).astype(np.int8))
    return (packed, offs, *to_fragment_order(packed, offs, wb))


def _word_form_tile(words, frag_offs, wb: int, block_k: int, normal: bool) -> torch.Tensor:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out = torch.empty(32, 128, dtype=torch.uint8, device=dev)
    _words_kernel[(1,)](words.to(dev), frag_offs.to(dev), out, 128, WB=wb, R=32, BLOCK_K=block_k, NORMAL=normal)
    return out.cpu()


def _reference_tile(packed, offs, wb: int) -> torch.Tensor:
    from k3nvfp4.kernels import formats

    return expand_e2m1_to_e4m3_reference(formats.unpack_e2m1(packed), offs.to(torch.int32).repeat_interleave(wb, dim=1))


@pytest.mark.parametrize("wb", [32, 16])
@pytest.mark.parametrize("block_k, table", [(64, "full"), (128, "full"), (64, "normal")])
def test_word_form_tile_is_the_reference(wb, block_k, table):
    """The W4A8 kernels' expansion routine (moe_w4a8_details/kernels._expanded_weights: the weights
    in wgmma's fragment order, int32 word and int8 offset loads, e4m3_expand.fragment_tile's
    plain-Triton tables and lookup, the same bits as the PTX, which test_e4m3_prmt_ptx.py and
    test_w4a8_fragment_probe.py check) in the interpreter: the tile equal to
    expand_e2m1_to_e4m3_reference in K order over every code in blocks of every offset of the
    table's range (the full table: the window [-8, 6]; the normal one: [-5, 6]) and random rows,
    32 rows x 2 K steps of 64 or one of 128."""
    low = E4M3_EXPAND_MIN_OFFSET if table == "full" else E4M3_NORMAL_MIN_OFFSET
    packed, offs, words, frag_offs = _word_form_case(wb, np.arange(low, E4M3_EXPAND_MAX_OFFSET + 1))
    assert torch.equal(_word_form_tile(words, frag_offs, wb, block_k, table == "normal"),
                       _reference_tile(packed, offs, wb))


@pytest.mark.parametrize("j", [-6, -7, -8])
def test_normal_table_is_wrong_below_its_range(j):
    """Why the preparation chooses the table per matrix: one block at j < -5 expanded by the normal
    table gives other bytes than the reference (and than the full table)."""
    packed, offs, words, frag_offs = _word_form_case(32, np.array([0, j]))
    want = _reference_tile(packed, offs, 32)
    assert torch.equal(_word_form_tile(words, frag_offs, 32, 64, False), want)
    assert not torch.equal(_word_form_tile(words, frag_offs, 32, 64, True), want)
