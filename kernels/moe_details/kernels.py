"""Triton jit kernels of the fused NVFP4 gated MoE (W4A16: FP4 weights dequantized in registers).

Weights are read in the kernel-native layout (layout.py, prepared once by NVFP4MoEWeights): per
expert matrix [rows/16, K/64, 512] bytes of bit-placed nibbles and [rows/16, K/64, 16 or 8] block
scale words (one byte per scale: E5M3_16 for NVFP4, E8M0_32 for the MXFP4 release, SCALE_FMT).
A weight tile is dequantized by fp4.dequant_e2m1_words (11 integer instructions per 8 weights +
one bf16x2 multiply per two, after 1.5 or 0.75 per 8 for the scale words) straight into the MMA
A-operand registers; the products carry
2^-ACC_SHIFT, undone together with scale_2 on the fp32 accumulator. Activations are one contiguous
[rows, BLOCK_K] tile (K in natural order: no even/odd split). With swap-AB (weights on the MMA M
side) Hopper's wgmma takes the weights from registers and the activations from shared memory.

Row strides and tile counts come in as arguments so that Triton's divisibility-16 specialisation
applies; triton 3.6 and 3.8 then pipeline every load through shared memory (cp.async,
num_stages) and use wgmma on sm90 (checked by compiling for sm90 without a GPU, and measured by
bench/sass_report.py).

Grid of both GEMMs: (max_blocks, column tiles, split_k), max_blocks being the worst case of the
routing alignment; blocks past the used rows exit at once (no host sync on the real count).
Split-K (both GEMMs) and the top-k combine (GEMM2) are finished in the same launch by the last
program to arrive on an arrival counter: the shared skeleton (skeleton.py); see moe.py.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp4 import decode_scale_words, dequant_e2m1_words, tile_e2m1_bf16
from .activation import gated_act
from .layout import ACC_SCALE
from .skeleton import (accumulator, block_program, block_rows, combine_by_last_arrival, k_range, split_k_arrive,
                       split_k_sum, tile_index, zero_dropped_tokens)

_ACC_SCALE = tl.constexpr(ACC_SCALE)

@triton.jit
def _load_act_tile(a_ptr, rows, stride_m, stride_k, k0, K, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    """Activation columns k0 .. k0 + BLOCK_K of the given rows (in bounds: callers clamp padding
    rows, whose results are never stored): [BM, BLOCK_K], zero past K unless EVEN_K."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    ptrs = a_ptr + rows[:, None] * stride_m + offs_k[None, :] * stride_k
    if EVEN_K:
        return tl.load(ptrs)
    else:
        return tl.load(ptrs, mask=(offs_k < K)[None, :], other=0.0)


@triton.jit
def _row_tiles(first, end, BLOCK_N: tl.constexpr):
    """Row-tile indices first .. first + BLOCK_N/16, clamped below end: tiles past a matrix's
    rows re-read its last tile (in bounds; those output columns are never stored)."""
    return tl.minimum(first + tl.arange(0, BLOCK_N // 16), end - 1)


def per_word_scales(num_warps: int) -> bool:
    """The kernels' PER_WORD constexpr for a GEMM launched with num_warps: below a warpgroup the
    MMA is mma.sync, whose register path Triton keeps only when each word decodes its own scales
    (_load_scale_pairs)."""
    return num_warps < 4


@triton.jit
def _rotl8(x):
    return (x << 8) | (x >> 24)


@triton.jit
def _load_scale_pairs(s_ptr, tile, s0, R: tl.constexpr, G: tl.constexpr, S: tl.constexpr, SCALE_FMT: tl.constexpr,
                      USE_ASM: tl.constexpr, PER_WORD: tl.constexpr):
    """The bf16x2 scale pairs (rows g, g + 8) of each word of K steps s0 .. s0 + S of the given
    tiles, uint32 [R, G, 32 S] in the words' order (lane 4g + t, step s), from the layout's
    scale words (layout.py): one LOP3 per pair, after a byte rotation for every second pair.
    PER_WORD: decode after broadcasting the scale words to every word (what Triton keeps in
    registers for the mma.sync tiles), else decode both pairs of a word and join them (wgmma)."""
    if SCALE_FMT == 0:  # NVFP4: 2 words per lane g and tile; word i holds steps 2i, 2i + 1
        NW: tl.constexpr = S // 2
        widx = tl.arange(0, 8)[:, None] * 2 + s0 // 2 + tl.arange(0, NW)[None, :]
        sw = tl.load(s_ptr.to(tl.pointer_type(tl.int32)) + tile[:, :, :, None] * 16 + widx[None, None, :, :])
        sw = sw.to(tl.uint32, bitcast=True)
        if PER_WORD:
            sw = tl.reshape(tl.broadcast_to(tl.reshape(sw, (R, G, 8, 1, NW, 1)), (R, G, 8, 4, NW, 2)), (R, G, 32 * S))
            rotated = (tl.arange(0, 32 * S) % 2 == 1)[None, None, :]  # odd steps: the rotated pair
            pairs = decode_scale_words(tl.where(rotated, _rotl8(sw), sw), SCALE_FMT, USE_ASM)
        else:
            sw = tl.broadcast_to(tl.reshape(sw, (R, G, 8, 1, NW)), (R, G, 8, 4, NW))
            p = tl.join(decode_scale_words(sw, SCALE_FMT, USE_ASM), decode_scale_words(_rotl8(sw), SCALE_FMT, USE_ASM))
            pairs = tl.reshape(p, (R, G, 32 * S))
    else:  # MXFP4: 1 word per lane g and tile; 32-block 0 (steps 0, 1) in place, 1 (steps 2, 3) rotated
        sw = tl.load(s_ptr.to(tl.pointer_type(tl.int32)) + tile * 8 + tl.arange(0, 8)[None, None, :])
        sw = sw.to(tl.uint32, bitcast=True)
        if PER_WORD:
            sw = tl.reshape(tl.broadcast_to(tl.reshape(sw, (R, G, 8, 1)), (R, G, 8, 4 * S)), (R, G, 32 * S))
            rotated = (((s0 + tl.arange(0, 32 * S) % S) // 2) == 1)[None, None, :]
            pairs = decode_scale_words(tl.where(rotated, _rotl8(sw), sw), SCALE_FMT, USE_ASM)
        else:
            sw = tl.broadcast_to(tl.reshape(sw, (R, G, 8, 1)), (R, G, 8, 4))
            p0 = decode_scale_words(sw, SCALE_FMT, USE_ASM)
            p1 = decode_scale_words(_rotl8(sw), SCALE_FMT, USE_ASM)
            if S == 4:
                p = tl.broadcast_to(tl.join(p0, p1)[:, :, :, :, :, None], (R, G, 8, 4, 2, 2))
            else:
                p = tl.broadcast_to(tl.where(s0 == 0, p0, p1)[:, :, :, :, None], (R, G, 8, 4, S))
            pairs = tl.reshape(p, (R, G, 32 * S))
    return pairs


@triton.jit
def _load_weight_tile(w_ptr, s_ptr, rt, k_tiles, k0,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, USE_ASM: tl.constexpr,
                      SCALE_FMT: tl.constexpr, PER_WORD: tl.constexpr):
    """Dequantized weights bf16 [BLOCK_N, BLOCK_K] (x 2^-ACC_SHIFT) of a kernel-layout matrix
    (layout.py: [row tiles, k_tiles, 512] bytes, [row tiles, k_tiles, 16 or 8] scale words in
    format SCALE_FMT): row tiles rt (int [BLOCK_N/16], see _row_tiles), K elements k0 .. k0 + BLOCK_K. Each lane loads
    16 contiguous bytes per K tile (4 bf16x2 MMA registers per K step). No masks: K tiles past
    the matrix are clamped to its last (EVEN_K False), their activations are zero."""
    R: tl.constexpr = BLOCK_N // 16
    if BLOCK_K >= 64:
        G: tl.constexpr = BLOCK_K // 64
        S: tl.constexpr = 4
        s0 = 0
    else:  # half a K tile: K steps (k0 % 64) / 16 .. + BLOCK_K / 16 of each lane's 4
        G: tl.constexpr = 1
        S: tl.constexpr = BLOCK_K // 16
        s0 = (k0 % 64) // 16
    kt = k0 // 64 + tl.arange(0, G)
    if not EVEN_K:
        kt = tl.minimum(kt, k_tiles - 1)
    tile = (rt[:, None] * k_tiles + kt[None, :])[:, :, None]
    if S == 4:  # whole tiles: 128 contiguous words (each lane's 4 words are 16 bytes)
        word = tl.arange(0, 128)
    else:
        word = tl.reshape(tl.arange(0, 32)[:, None] * 4 + s0 + tl.arange(0, S)[None, :], (32 * S,))
    words = tl.load(w_ptr.to(tl.pointer_type(tl.int32)) + tile * 128 + word[None, None, :])
    pairs = _load_scale_pairs(s_ptr, tile, s0, R, G, S, SCALE_FMT, USE_ASM, PER_WORD)
    e0, e1, e2, e3, e4, e5, e6, e7 = dequant_e2m1_words(words, pairs, USE_ASM)
    return tile_e2m1_bf16(e0, e1, e2, e3, e4, e5, e6, e7, R, G, S)


@triton.jit
def _mma(acc, a, w, SWAP_AB: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """acc += a x w^T; a is activations [BM, BK], w weights [BN, BK]; acc [BN, BM] with swap-AB
    (weights on the MMA M side, from registers), else [BM, BN]."""
    a = a.to(DOT_DTYPE)
    w = w.to(DOT_DTYPE)
    if SWAP_AB:
        return tl.dot(w, tl.trans(a), acc, input_precision=PRECISION)
    else:
        return tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)


@triton.jit
def gemm1_gated_kernel(
    x_ptr, stride_xm, stride_xk,
    w_ptr, ws_ptr, s2_ptr, k_tiles,
    out_ptr, part_ptr, tickets_ptr,
    sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, top_k, H, I,
    beta, linear_beta,
    ACT: tl.constexpr, HAS_LINEAR_BETA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    SWAP_AB: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, USE_ASM: tl.constexpr,
    EVEN_K: tl.constexpr, SCALE_FMT: tl.constexpr, PER_WORD: tl.constexpr,
):
    """GEMM1 + gated activation for one (row block, column tile, K slice).

    Gate rows n and up rows I + n of the block's expert are dequantized and multiplied in the
    same program; per-half scale_2 is applied to the fp32 accumulators before the activation.
    out = act(gate, up) in out's dtype, [max_padded, I].
    SPLIT_K > 1: the skeleton's split-K (fp32 partials part [SPLIT_K, max_padded, 2I], counters
    tickets[block, column tile]); the last slice applies the activation.
    """
    pid_b, pid_n, pid_k, used = block_program(num_padded_ptr, BLOCK_M)
    if not used:
        return
    expert, offs_m = block_rows(block_expert_ptr, pid_b, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    token = tl.minimum(pair // top_k, num_pairs // top_k - 1)  # padding rows: any valid row
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I

    # Row tiles (16 rows) of this expert's gate rows n and up rows I + n in w13 [E * 2I/16, ...].
    rt_expert = expert * (2 * I // 16)
    rt_gate = _row_tiles(rt_expert + pid_n * (BLOCK_N // 16), rt_expert + I // 16, BLOCK_N)
    rt_up = _row_tiles(rt_expert + I // 16 + pid_n * (BLOCK_N // 16), rt_expert + 2 * I // 16, BLOCK_N)

    acc_g = accumulator(BLOCK_M, BLOCK_N, SWAP_AB)
    acc_u = accumulator(BLOCK_M, BLOCK_N, SWAP_AB)

    step_lo, step_hi = k_range(pid_k, H, BLOCK_K, SPLIT_K)
    for step in range(step_lo, step_hi):
        k0 = step * BLOCK_K
        x = _load_act_tile(x_ptr, token, stride_xm, stride_xk, k0, H, BLOCK_K, EVEN_K)
        wg = _load_weight_tile(w_ptr, ws_ptr, rt_gate, k_tiles, k0, BLOCK_N, BLOCK_K, EVEN_K, USE_ASM, SCALE_FMT, PER_WORD)
        acc_g = _mma(acc_g, x, wg, SWAP_AB, DOT_DTYPE, PRECISION)
        wu = _load_weight_tile(w_ptr, ws_ptr, rt_up, k_tiles, k0, BLOCK_N, BLOCK_K, EVEN_K, USE_ASM, SCALE_FMT, PER_WORD)
        acc_u = _mma(acc_u, x, wu, SWAP_AB, DOT_DTYPE, PRECISION)

    acc_g = acc_g * (tl.load(s2_ptr + expert * 2) * _ACC_SCALE)
    acc_u = acc_u * (tl.load(s2_ptr + expert * 2 + 1) * _ACC_SCALE)

    m_idx, n_idx = tile_index(offs_m.to(tl.int64), offs_n, SWAP_AB)
    ok_m, ok_n = tile_index(offs_m >= 0, n_ok, SWAP_AB)
    # Padding rows are written too (from a clamped real token: finite): GEMM2 reads whole
    # blocks unmasked and drops those rows only at its store.
    mask = ok_m & ok_n
    if SPLIT_K > 1:
        part = part_ptr + m_idx * (2 * I) + n_idx
        if not split_k_arrive(part, acc_g, acc_u, mask, I, tickets_ptr, pid_b, pid_n, pid_k, BLOCK_M, SPLIT_K):
            return
        acc_g, acc_u = split_k_sum(part, mask, I, acc_g, acc_u, BLOCK_M, SPLIT_K)
    y = gated_act(acc_g, acc_u, beta, linear_beta, ACT, HAS_LINEAR_BETA)
    tl.store(out_ptr + m_idx * I + n_idx, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gemm2_combine_kernel(
    a_ptr,
    w_ptr, ws_ptr, s2_ptr, k_tiles,
    topk_w_ptr, topk_ids_ptr, stride_im, stride_ik,
    buf_ptr, out_ptr, stride_om, stride_oh, tickets_ptr,
    sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, top_k, num_experts, H, I, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    SWAP_AB: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, USE_ASM: tl.constexpr,
    EVEN_K: tl.constexpr, ATOMIC: tl.constexpr, SCALE_FMT: tl.constexpr, PER_WORD: tl.constexpr,
):
    """GEMM2 (intermediate [max_padded, I] x w2^T) x scale_2 x routing weight, the top-k sum,
    x scale, cast: out [M, H] in its dtype, in this one launch (the skeleton's
    combine_by_last_arrival; buf: fp32 [SPLIT_K, M*k, H], or [M, H] zeroed when ATOMIC)."""
    pid_b, pid_n, pid_k, used = block_program(num_padded_ptr, BLOCK_M)
    if not used:
        zero_dropped_tokens(out_ptr, stride_om, stride_oh, topk_ids_ptr, stride_im, stride_ik, pid_b, pid_n, pid_k,
                            num_pairs, top_k, num_experts, H, BLOCK_M, BLOCK_N)
        return
    expert, offs_m = block_rows(block_expert_ptr, pid_b, BLOCK_M)
    rt = _row_tiles(expert * (H // 16) + pid_n * (BLOCK_N // 16), (expert + 1) * (H // 16), BLOCK_N)

    acc = accumulator(BLOCK_M, BLOCK_N, SWAP_AB)
    step_lo, step_hi = k_range(pid_k, I, BLOCK_K, SPLIT_K)
    for step in range(step_lo, step_hi):
        k0 = step * BLOCK_K
        a = _load_act_tile(a_ptr, offs_m, I, 1, k0, I, BLOCK_K, EVEN_K)  # padding rows: never stored
        w = _load_weight_tile(w_ptr, ws_ptr, rt, k_tiles, k0, BLOCK_N, BLOCK_K, EVEN_K, USE_ASM, SCALE_FMT, PER_WORD)
        acc = _mma(acc, a, w, SWAP_AB, DOT_DTYPE, PRECISION)

    # Everything of the epilogue is loaded after the K loop: nothing stays live through it.
    combine_by_last_arrival(acc, tl.load(s2_ptr + expert) * _ACC_SCALE, offs_m, topk_w_ptr, topk_ids_ptr,
                            stride_im, stride_ik, buf_ptr, out_ptr, stride_om, stride_oh, tickets_ptr, sorted_ids_ptr,
                            pid_b, pid_n, pid_k, num_pairs, top_k, num_experts, H, scale,
                            BLOCK_M, BLOCK_N, SPLIT_K, SWAP_AB, ATOMIC)
