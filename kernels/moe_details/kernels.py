"""Triton jit kernels of the fused NVFP4 gated MoE (W4A16: FP4 weights dequantized in registers).

Layouts read (canonical ModelOpt, K-major, see weights.py): w13 uint8 [E, 2I, H/2] (gate rows
then up rows), w13 scales uint8 (E4M3 bits) [E, 2I, H/16], w2 uint8 [E, H, I/2], w2 scales
[E, H, I/16]. Per row and K step a weight tile is BLOCK_K/2 contiguous bytes and BLOCK_K/16
contiguous scale bytes (decoded once per 16 elements, then broadcast); activations are one
contiguous [rows, BLOCK_K] tile split into even/odd columns in registers. Row strides come in
as arguments so that Triton's divisibility-16 specialisation applies; with it, triton 3.6 and
3.8 pipeline every load through shared memory (cp.async, num_stages) and use wgmma on sm90
(checked by compiling for sm90 without a GPU).

Nibble planes: byte j of a row holds elements 2j (low) and 2j+1 (high). Instead of
interleaving nibbles in registers, each K step does two dots: (even activation columns) x
(low-nibble plane) and (odd columns) x (high plane). Sums are order-free, so this is the same
GEMM.

Grid of both GEMMs: (max_blocks, column tiles, split_k), max_blocks being the worst case of the
routing alignment; blocks past the used rows exit at once (no host sync on the real count).
"""

from __future__ import annotations

import triton
import triton.language as tl

from .fp4 import dequant_nvfp4_planes, e4m3_to_f32

ACT_SITU = 0
ACT_SILU = 1


@triton.jit
def _sigmoid(x):
    # exp of a non-positive argument only: no overflow for large |x|.
    e = tl.exp(-tl.abs(x))
    return tl.where(x >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def _tanh(x):
    # tanh(|x|) = (1 - e) / (1 + e), e = exp(-2|x|) <= 1: no overflow for any x.
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _gated_act(g, u, beta, linear_beta, ACT: tl.constexpr, HAS_LINEAR_BETA: tl.constexpr):
    """fp32 gate/up -> fp32 activation (SiTU or SiLU-and-mul)."""
    if ACT == 0:
        gp = beta * _tanh(g / beta) * _sigmoid(g)
        if HAS_LINEAR_BETA:
            u = linear_beta * _tanh(u / linear_beta)
    else:
        gp = g * _sigmoid(g)
    return gp * u


@triton.jit
def _tile_index(offs_m, offs_n, SWAP_AB: tl.constexpr):
    """Row (token) and column index tensors of an accumulator tile: [BN, BM] with swap-AB
    (tokens on the MMA N side), else [BM, BN]."""
    if SWAP_AB:
        return offs_m[None, :], offs_n[:, None]
    else:
        return offs_m[:, None], offs_n[None, :]


@triton.jit
def _load_act_planes(a_ptr, rows, stride_m, stride_k, k0, K, row_ok,
                     BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr):
    """Even and odd activation columns k0 + 2j, k0 + 2j + 1 of the given rows, oriented for the
    dot: [BM, BLOCK_K/2] each, or [BLOCK_K/2, BM] with swap-AB. One contiguous [BM, BLOCK_K]
    load (vectorised when stride_k == 1), split into the two planes in registers."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    mask = row_ok[:, None] & (offs_k < K)[None, :]
    tile = tl.load(a_ptr + rows[:, None] * stride_m + offs_k[None, :] * stride_k, mask=mask, other=0.0)
    even, odd = tl.split(tl.reshape(tile, (tile.shape[0], BLOCK_K // 2, 2)))
    if SWAP_AB:
        return tl.trans(even), tl.trans(odd)
    else:
        return even, odd


@triton.jit
def _load_weight_planes(w_ptr, s_ptr, rows, row_bytes, row_scales, g0, n_ok, BLOCK_K: tl.constexpr):
    """Dequantized nibble planes [BN, BLOCK_K/2] (elements 2j and 2j+1) of weight rows ``rows``,
    starting at scale group g0 (16 elements = 8 bytes per group). The packed bytes are one
    contiguous [BN, BLOCK_K/2] tile per row (16-byte vector loads when row_bytes % 16 == 0);
    the BLOCK_K/16 scale bytes of a row are decoded once and broadcast over their 8 bytes."""
    HALF_K: tl.constexpr = BLOCK_K // 2
    GROUPS: tl.constexpr = BLOCK_K // 16
    j = g0 * 8 + tl.arange(0, HALF_K)
    g = g0 + tl.arange(0, GROUPS)
    packed = tl.load(
        w_ptr + rows[:, None] * row_bytes + j[None, :],
        mask=n_ok[:, None] & (j < row_bytes)[None, :],
        other=0,
    )
    scale_b = tl.load(
        s_ptr + rows[:, None] * row_scales + g[None, :],
        mask=n_ok[:, None] & (g < row_scales)[None, :],
        other=0,
    )
    scale = e4m3_to_f32(scale_b.to(tl.int32))
    n: tl.constexpr = scale.shape[0]
    scale = tl.reshape(tl.broadcast_to(scale[:, :, None], (n, GROUPS, 8)), (n, HALF_K))
    return dequant_nvfp4_planes(packed, scale)


@triton.jit
def _mma(acc, a, w, SWAP_AB: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """acc += a-plane x w-plane; a is [BM, BK/2] (or [BK/2, BM] with swap), w is [BN, BK/2]."""
    a = a.to(DOT_DTYPE)
    w = w.to(DOT_DTYPE)
    if SWAP_AB:
        return tl.dot(w, a, acc, input_precision=PRECISION)
    else:
        return tl.dot(a, tl.trans(w), acc, input_precision=PRECISION)


@triton.jit
def gemm1_gated_kernel(
    x_ptr, stride_xm, stride_xk,
    w_ptr, ws_ptr, s2_ptr, row_bytes, row_scales,
    out_ptr,
    sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, top_k, H, I,
    beta, linear_beta,
    ACT: tl.constexpr, HAS_LINEAR_BETA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    SWAP_AB: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
):
    """GEMM1 + gated activation for one (row block, column tile, K slice).

    Gate rows n and up rows I + n of the block's expert are dequantized and multiplied in the
    same program; per-half scale_2 is applied to the fp32 accumulators before the activation.
    SPLIT_K == 1: out = act(gate, up) in out's dtype, [max_padded, I].
    SPLIT_K > 1: out = fp32 partials [SPLIT_K, max_padded, 2I] (scale_2 applied), finished by
    gated_activation_kernel.
    """
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    num_padded = tl.load(num_padded_ptr)
    if pid_b * BLOCK_M >= num_padded:
        return
    expert = tl.load(block_expert_ptr + pid_b).to(tl.int64)

    offs_m = pid_b * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    row_ok = pair < num_pairs
    token = pair // top_k
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I

    # row_bytes = H / 2 and row_scales = H / 16 come as arguments: Triton specialises ints
    # divisible by 16, which is what enables 16-byte vector loads of the packed rows.
    gate_rows = expert * 2 * I + offs_n
    up_rows = gate_rows + I

    k_steps = tl.cdiv(H, BLOCK_K)
    steps_per_split = tl.cdiv(k_steps, SPLIT_K)
    step_lo = pid_k * steps_per_split
    step_hi = tl.minimum(step_lo + steps_per_split, k_steps)

    if SWAP_AB:
        acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    for step in range(step_lo, step_hi):
        x_even, x_odd = _load_act_planes(x_ptr, token, stride_xm, stride_xk, step * BLOCK_K, H, row_ok,
                                         BLOCK_K, SWAP_AB)
        g0 = step * (BLOCK_K // 16)
        g_even, g_odd = _load_weight_planes(w_ptr, ws_ptr, gate_rows, row_bytes, row_scales, g0, n_ok, BLOCK_K)
        acc_g = _mma(acc_g, x_even, g_even, SWAP_AB, DOT_DTYPE, PRECISION)
        acc_g = _mma(acc_g, x_odd, g_odd, SWAP_AB, DOT_DTYPE, PRECISION)
        u_even, u_odd = _load_weight_planes(w_ptr, ws_ptr, up_rows, row_bytes, row_scales, g0, n_ok, BLOCK_K)
        acc_u = _mma(acc_u, x_even, u_even, SWAP_AB, DOT_DTYPE, PRECISION)
        acc_u = _mma(acc_u, x_odd, u_odd, SWAP_AB, DOT_DTYPE, PRECISION)

    acc_g = acc_g * tl.load(s2_ptr + expert * 2)
    acc_u = acc_u * tl.load(s2_ptr + expert * 2 + 1)

    m_idx, n_idx = _tile_index(offs_m.to(tl.int64), offs_n, SWAP_AB)
    ok_m, ok_n = _tile_index(row_ok, n_ok, SWAP_AB)
    mask = ok_m & ok_n  # padding rows are never written (nor read: GEMM2 masks them too)
    if SPLIT_K == 1:
        y = _gated_act(acc_g, acc_u, beta, linear_beta, ACT, HAS_LINEAR_BETA)
        tl.store(out_ptr + m_idx * I + n_idx, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        part = out_ptr + pid_k * (tl.num_programs(0) * BLOCK_M) * (2 * I) + m_idx * (2 * I) + n_idx
        tl.store(part, acc_g, mask=mask)
        tl.store(part + I, acc_u, mask=mask)


@triton.jit
def gated_activation_kernel(
    part_ptr, out_ptr, sorted_ids_ptr, num_padded_ptr, num_pairs, I, max_padded,
    beta, linear_beta,
    ACT: tl.constexpr, HAS_LINEAR_BETA: tl.constexpr, SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """Split-K epilogue of GEMM1: sum the fp32 partials in a fixed order, apply the activation."""
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    num_padded = tl.load(num_padded_ptr)
    if pid_b * BLOCK_M >= num_padded:
        return
    offs_m = (pid_b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = tl.load(sorted_ids_ptr + offs_m) < num_pairs
    mask = row_ok[:, None] & (offs_n[None, :] < I)
    base = part_ptr + offs_m[:, None] * (2 * I) + offs_n[None, :]
    g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(SPLIT_K):
        g += tl.load(base + s * max_padded * (2 * I), mask=mask, other=0.0)
        u += tl.load(base + s * max_padded * (2 * I) + I, mask=mask, other=0.0)
    y = _gated_act(g, u, beta, linear_beta, ACT, HAS_LINEAR_BETA)
    tl.store(out_ptr + offs_m[:, None] * I + offs_n[None, :], y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def gemm2_combine_kernel(
    a_ptr,
    w_ptr, ws_ptr, s2_ptr, row_bytes, row_scales,
    topk_w_ptr, out_ptr,
    sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, top_k, H, I, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    SWAP_AB: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    USE_ATOMIC: tl.constexpr, ROW_IS_TOKEN: tl.constexpr,
):
    """GEMM2 (intermediate [max_padded, I] x w2^T) x scale_2 x routing weight x scale.

    ROW_IS_TOKEN == False: output rows are pairs, out is fp32 [M*k, H] (summed over k later).
    ROW_IS_TOKEN == True:  output rows are tokens, out is fp32 [M, H], atomics required.
    USE_ATOMIC: fp32 atomic adds (split-K or ROW_IS_TOKEN), else plain stores (deterministic).
    """
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    num_padded = tl.load(num_padded_ptr)
    if pid_b * BLOCK_M >= num_padded:
        return
    expert = tl.load(block_expert_ptr + pid_b).to(tl.int64)

    offs_m = (pid_b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    pair = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    row_ok = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H

    w_rows = expert * H + offs_n

    k_steps = tl.cdiv(I, BLOCK_K)
    steps_per_split = tl.cdiv(k_steps, SPLIT_K)
    step_lo = pid_k * steps_per_split
    step_hi = tl.minimum(step_lo + steps_per_split, k_steps)

    if SWAP_AB:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for step in range(step_lo, step_hi):
        a_even, a_odd = _load_act_planes(a_ptr, offs_m, I, 1, step * BLOCK_K, I, row_ok, BLOCK_K, SWAP_AB)
        w_even, w_odd = _load_weight_planes(w_ptr, ws_ptr, w_rows, row_bytes, row_scales, step * (BLOCK_K // 16),
                                            n_ok, BLOCK_K)
        acc = _mma(acc, a_even, w_even, SWAP_AB, DOT_DTYPE, PRECISION)
        acc = _mma(acc, a_odd, w_odd, SWAP_AB, DOT_DTYPE, PRECISION)

    routing_w = tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0)
    if ROW_IS_TOKEN:
        out_row = pair // top_k
    else:
        out_row = pair
    if SWAP_AB:
        acc = acc * routing_w[None, :]
    else:
        acc = acc * routing_w[:, None]
    acc = acc * (tl.load(s2_ptr + expert) * scale)
    r_idx, n_idx = _tile_index(out_row, offs_n, SWAP_AB)
    ok_r, ok_n = _tile_index(row_ok, n_ok, SWAP_AB)
    mask = ok_r & ok_n
    ptrs = out_ptr + r_idx * H + n_idx
    if USE_ATOMIC:
        tl.atomic_add(ptrs, acc, mask=mask)
    else:
        tl.store(ptrs, acc, mask=mask)


@triton.jit
def combine_topk_kernel(
    buf_ptr, topk_ids_ptr, stride_im, stride_ik, out_ptr, stride_om, stride_oh,
    top_k, H, num_experts, scale,
    BLOCK_H: tl.constexpr,
):
    """out[m] = scale * sum over slots j (in order) of buf[m * top_k + j], skipping slots whose
    expert id is outside [0, E) (their rows were never written); cast to out's dtype.
    Deterministic; replaces a memset + sum + scale + cast."""
    m = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = offs_h < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for j in range(0, top_k):
        e = tl.load(topk_ids_ptr + m * stride_im + j * stride_ik)
        valid = (e >= 0) & (e < num_experts)
        acc += tl.load(buf_ptr + (m * top_k + j) * H + offs_h, mask=h_ok & valid, other=0.0)
    acc = acc * scale
    tl.store(out_ptr + m * stride_om + offs_h * stride_oh, acc.to(out_ptr.dtype.element_ty), mask=h_ok)
