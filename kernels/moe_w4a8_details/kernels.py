"""Triton jit kernels of the Hopper W4A8 mode ("e4m3"): 4-bit weights expanded exactly to E4M3 in
registers (moe_details/e4m3_expand.fragment_tile: its table + PRMT PTX on a GPU, each lookup output
one wgmma A-fragment register because the weights are stored in the fragment's order; its
plain-Triton twin in the interpreter), FP8 activations, ``tl.dot`` on E4M3 x E4M3
(FP8 wgmma ``.e4m3.e4m3`` on sm90), fp32 accumulators. docs/w4a8.md gives the numerics:

- activations and the SiTU intermediate: E4M3 with one fp32 scale s = amax / 448 per token per 128
  columns (a row's last group 64 wide when K % 128 == 64); s = 1 where amax / 448 is 0; elements
  e4m3_rne(min(max(x / s, -448), 448)), IEEE divisions (div_rn): the bits of
  kernels/act_quant.quantize_e4m3_groups and of the float64 oracle (tests/w4a8_oracle.py);
- the fp32 promotion once per activation group: each K step's dot starts a fresh fp32
  accumulator that is added to the running one times the tokens' scale of its group
  (acc += dot(w, a^T) x s[token, k / 128]): the group scale is the only factor that changes
  along K, and Hopper's FP8 accumulation keeps fewer bits than fp32 (DeepSeek-V3's promotion);
- the weights on the MMA M side (swap-AB, always): the per-row factor 2^r x scale_2 multiplies
  accumulator rows once, before split-K's partials and the top-k sum.

Both GEMMs run on the MoE skeleton of the W4A16 family (moe_details/skeleton.py): grid (row
block, column tile, K slice), split-K finished by the last slice to arrive, GEMM2's top-k sum by
each token's last arrival. Only the K step (expansion + E4M3 dot + promotion), the activation
quantizer and GEMM1's epilogue (the intermediate quantized per 128 output columns, so GEMM1's
column tile is a multiple of 128) are this mode's own.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..moe_details.activation import gated_act
from ..interpreter import interpret_requested
from ..moe_details.e4m3_expand import fragment_tile
from ..moe_details.routing_kernels import align_small
from ..moe_details.skeleton import (accumulator, block_program, block_rows, combine_by_last_arrival, k_range,
                                    split_k_arrive, split_k_sum, zero_dropped_tokens)
from ..moe_fp4_details.kernels import _f32_to_e4m3, _split_gate_up

GROUP = 128  # activation / intermediate scale group (columns)
# On a GPU the weights expand by e4m3_expand's inline PTX (per-block byte table + PRMT); Triton's
# interpreter has no inline asm and takes its plain-Triton twin (the same bits).
_USE_ASM = tl.constexpr(not interpret_requested())


@triton.jit
def _quant_groups(x, R: tl.constexpr, NG: tl.constexpr):
    """x fp32 [R, NG x 128] -> (E4M3 [R, NG x 128], fp32 scales [R, NG]), one scale per row per
    128 columns (module docstring; zero columns past K do not change a group's amax)."""
    xb = tl.reshape(x, (R, NG, 128))
    amax = tl.max(tl.abs(xb), axis=2)
    s = tl.math.div_rn(amax, 448.0)
    s = tl.where(s > 0, s, 1.0)
    y = tl.math.div_rn(xb, s[:, :, None])
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)  # fp32 division can land one ulp above 448
    return _f32_to_e4m3(tl.reshape(y, (R, NG * 128))), s


@triton.jit
def quant_row(x_ptr, stride_xm, q_ptr, s_ptr, r, K):
    """Quantize row r of x [R, K] (any float dtype, K % 64 == 0) once: E4M3 q [R, K] and fp32
    scales s [R, cdiv(K, 128)]."""
    offs = tl.arange(0, 128)
    ng = tl.cdiv(K, 128)
    for k0 in range(0, K, 128):
        ok = (k0 + offs) < K
        x = tl.load(x_ptr + r * stride_xm + k0 + offs[None, :], mask=ok[None, :], other=0.0).to(tl.float32)
        q, s = _quant_groups(x, 1, 1)
        tl.store(q_ptr + r * K + k0 + offs[None, :], q, mask=ok[None, :])
        tl.store(s_ptr + r * ng + k0 // 128 + tl.arange(0, 1)[None, :], s)


@triton.jit
def quant_rows_kernel(x_ptr, stride_xm, q_ptr, s_ptr, K):
    """quant_row of row program_id(0)."""
    quant_row(x_ptr, stride_xm, q_ptr, s_ptr, tl.program_id(0).to(tl.int64), K)


@triton.jit
def route_quant_kernel(
    topk_ids_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, shift_ptr, tickets_ptr,
    num_pairs, num_experts, fill_len, max_blocks, ticket_len,
    x_ptr, stride_xm, q_ptr, s_ptr, K,
    BLOCK_M: tl.constexpr, P: tl.constexpr, E_BINS: tl.constexpr, FILL: tl.constexpr,
):
    """The call's first launch, grid (1 + M,): program 0 aligns the routing (routing_kernels.
    align_small, also zeroing the GEMMs' counters), program 1 + t quantizes token t once for all
    its experts (quant_row)."""
    pid = tl.program_id(0)
    if pid == 0:
        align_small(topk_ids_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, shift_ptr, tickets_ptr,
                    num_pairs, num_experts, fill_len, max_blocks, ticket_len, BLOCK_M, P, E_BINS, FILL)
    else:
        quant_row(x_ptr, stride_xm, q_ptr, s_ptr, (pid - 1).to(tl.int64), K)


@triton.jit
def _expanded_weights(w_e, off_e, blocks, step, KQ, WB: tl.constexpr, R: tl.constexpr, BLOCK_K: tl.constexpr,
                      NORMAL: tl.constexpr):
    """E4M3 weight tile [16 R, BLOCK_K] of one expert (pointers at the expert; the weights in
    wgmma's A-fragment order, moe_w4a8_details/fragment.py: words int32 [N/16, K/64, 128], offsets
    int8 [N/16, K/64, 1024/WB]): the 16-row blocks ``blocks`` int [R], the BLOCK_K / 64 K steps of
    64 from ``step`` (KQ = K / 64 per row block). Tile row 16 i + 8 h + g is row 16 blocks[i] +
    8 h + g. Expanded exactly by e4m3_expand.fragment_tile: on a GPU its table + PRMT PTX, each
    lookup output one A-fragment register (no shared-memory trip to the MMA); in the interpreter its
    plain-Triton twin, the same bits. NORMAL: the matrix's offsets are all >= -5 (its prepared
    table, W4A8MoEWeights.w13_table / w2_table): the two-instruction block table."""
    Q: tl.constexpr = BLOCK_K // 64
    j = tl.arange(0, 128 * Q)  # (q, word): word ((g * 4 + t) * 2 + s) * 2 + h
    ql = j // 128
    ob = ((j // 16) % 8 * 2 + (j // 2) % 2) * 2 + j % 2  # the word's (row, 32-K) block in its step
    steps = blocks[:, None].to(tl.int64) * KQ + step + ql[None, :]  # [R, 128 Q]
    words = tl.load(w_e + steps * 128 + (j % 128)[None, :])
    if WB == 16:
        off_a = tl.load(off_e + steps * 64 + 2 * ob[None, :]).to(tl.int32)
        off_b = tl.load(off_e + steps * 64 + 2 * ob[None, :] + 1).to(tl.int32)
    else:
        off_a = tl.load(off_e + steps * 32 + ob[None, :]).to(tl.int32)
        off_b = off_a
    return fragment_tile(words, off_a, off_b, R, Q, WB, _USE_ASM, NORMAL)


@triton.jit
def _k_step(acc, w, a_ptr, as_ptr, rows, k0, K, BLOCK_K: tl.constexpr):
    """acc [R, BM] += (w [R, BLOCK_K] E4M3 x a[rows, k0 ..]^T E4M3) x s[rows, k0 / 128]: a fresh fp32
    dot promoted into the running accumulator with its group's token scales."""
    a = tl.load(a_ptr + rows[:, None] * K + (k0 + tl.arange(0, BLOCK_K))[None, :])
    s = tl.load(as_ptr + rows * tl.cdiv(K, 128) + k0 // 128)
    return acc + tl.dot(w, tl.trans(a)) * s[None, :]


@triton.jit
def w4a8_gemm1_kernel(
    aq_ptr, as_ptr, w_ptr, off_ptr, rs_ptr,
    o_ptr, os_ptr, part_ptr, tickets_ptr,
    sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, top_k, H, I, beta, linear_beta,
    ACT: tl.constexpr, HAS_LINEAR_BETA: tl.constexpr, WB: tl.constexpr, NORMAL: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
):
    """GEMM1 + gated activation + the intermediate's quantization, one (row block, column tile of
    BLOCK_N columns of I, K slice).

    aq E4M3 [M, H], as fp32 [M, cdiv(H, 128)]: the tokens, read through pair -> token; w int32
    [E, 2I/16, H/64, 128] and off int8 [E, 2I/16, H/64, 1024/WB] (the fragment order of
    moe_w4a8_details/fragment.py; NORMAL: every offset >= -5, the normal table), rs fp32 [E, 2I].
    ONE MMA operand of 2 x BLOCK_N weight rows per K step (gate rows n .., then up rows I + n ..;
    a tile past I re-reads I's last 16-row block), tokens on N. The row factors multiply the
    accumulator before split-K's partials (fp32 [SPLIT_K, max_padded, 2I], counters
    tickets[block, column tile]). The finishing program:
    SiTU / SiLU in fp32, columns past I zeroed, then E4M3 per token per 128 columns -> o E4M3
    [max_padded, I], os fp32 [max_padded, cdiv(I, 128)]. Padding rows are stored too (computed
    from token 0: finite), so GEMM2 can read whole blocks unmasked.
    """
    pid_b, pid_n, pid_k, used = block_program(num_padded_ptr, BLOCK_M)
    if not used:
        return
    expert, offs_m = block_rows(block_expert_ptr, pid_b, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    token = tl.where(pair < num_pairs, pair // top_k, 0)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_ok = offs_n < I
    r = tl.arange(0, 2 * BLOCK_N)
    n_row = tl.minimum(pid_n * BLOCK_N + r % BLOCK_N, I - 1).to(tl.int64)
    w_rows = tl.where(r < BLOCK_N, n_row, I + n_row)
    two_i = 2 * I
    w_e = w_ptr + expert * two_i * (H // 8)  # int32 words, 8 nibbles each
    off_e = off_ptr + expert * two_i * (H // WB)
    # the operand's 16-row blocks: gate blocks, then up blocks (a tile past I re-reads the last one)
    RB: tl.constexpr = BLOCK_N // 16
    b = tl.arange(0, 2 * RB)
    nb = tl.minimum(pid_n * RB + b % RB, I // 16 - 1)
    blocks = tl.where(b < RB, nb, I // 16 + nb)
    acc = accumulator(BLOCK_M, 2 * BLOCK_N, True)
    step_lo, step_hi = k_range(pid_k, H, BLOCK_K, SPLIT_K)
    for step in range(step_lo, step_hi):
        k0 = step * BLOCK_K
        w = _expanded_weights(w_e, off_e, blocks, step * (BLOCK_K // 64), H // 64, WB, 2 * RB, BLOCK_K, NORMAL)
        acc = _k_step(acc, w, aq_ptr, as_ptr, token, k0, H, BLOCK_K)
    acc = acc * tl.load(rs_ptr + expert * two_i + w_rows)[:, None]
    g, u = _split_gate_up(acc, BLOCK_M, BLOCK_N, True)  # each [BN, BM]
    if SPLIT_K > 1:
        mask = (offs_m >= 0)[None, :] & n_ok[:, None]
        part = part_ptr + offs_m[None, :] * (2 * I) + offs_n[:, None]
        if not split_k_arrive(part, g, u, mask, I, tickets_ptr, pid_b, pid_n, pid_k, BLOCK_M, SPLIT_K):
            return
        g, u = split_k_sum(part, mask, I, g, u, BLOCK_M, SPLIT_K)
    act = tl.trans(gated_act(g, u, beta, linear_beta, ACT, HAS_LINEAR_BETA))  # [BM, BN]
    act = tl.where(n_ok[None, :], act, 0.0)  # columns past I: out of every group's amax
    NG: tl.constexpr = BLOCK_N // 128
    q, s = _quant_groups(act, BLOCK_M, NG)
    rows = offs_m[:, None]
    tl.store(o_ptr + rows * I + offs_n[None, :], q, mask=n_ok[None, :])
    gi = pid_n * NG + tl.arange(0, NG)
    tl.store(os_ptr + rows * tl.cdiv(I, 128) + gi[None, :], s, mask=(gi * 128 < I)[None, :])


@triton.jit
def w4a8_gemm2_kernel(
    aq_ptr, as_ptr, w_ptr, off_ptr, rs_ptr,
    topk_w_ptr, topk_ids_ptr, stride_im, stride_ik,
    buf_ptr, out_ptr, stride_om, stride_oh, tickets_ptr,
    sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, top_k, num_experts, H, I, scale,
    WB: tl.constexpr, NORMAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr, ATOMIC: tl.constexpr,
):
    """GEMM2 of one (row block, column tile, K slice): the E4M3 intermediate rows of the block
    (sorted order; aq [max_padded, I], as fp32 [max_padded, cdiv(I, 128)]) x the expanded w2[expert]
    (int32 [E, H/16, I/64, 128], off int8 [E, H/16, I/64, 1024/WB]: the fragment order; NORMAL: every
    offset >= -5, the normal table), times
    w2's row factors rs fp32 [E, H]; then the skeleton's combine_by_last_arrival: x routing
    weight, the top-k sum (slot order through buf fp32 [SPLIT_K, M k, H], or ATOMIC: fp32 adds
    into buf [M, H] zeroed by the caller), x scale, cast: out [M, H]."""
    pid_b, pid_n, pid_k, used = block_program(num_padded_ptr, BLOCK_M)
    if not used:
        zero_dropped_tokens(out_ptr, stride_om, stride_oh, topk_ids_ptr, stride_im, stride_ik, pid_b, pid_n, pid_k,
                            num_pairs, top_k, num_experts, H, BLOCK_M, BLOCK_N)
        return
    expert, offs_m = block_rows(block_expert_ptr, pid_b, BLOCK_M)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    w_rows = tl.minimum(offs_n, H - 1)  # a tile past H re-reads row H - 1 (never stored)
    w_e = w_ptr + expert * H * (I // 8)  # int32 words, 8 nibbles each
    off_e = off_ptr + expert * H * (I // WB)
    RB: tl.constexpr = BLOCK_N // 16
    blocks = tl.minimum(pid_n * RB + tl.arange(0, RB), H // 16 - 1)  # a tile past H re-reads the last block
    acc = accumulator(BLOCK_M, BLOCK_N, True)
    step_lo, step_hi = k_range(pid_k, I, BLOCK_K, SPLIT_K)
    for step in range(step_lo, step_hi):
        k0 = step * BLOCK_K
        w = _expanded_weights(w_e, off_e, blocks, step * (BLOCK_K // 64), I // 64, WB, RB, BLOCK_K, NORMAL)
        acc = _k_step(acc, w, aq_ptr, as_ptr, offs_m, k0, I, BLOCK_K)
    acc = acc * tl.load(rs_ptr + expert * H + w_rows)[:, None]
    combine_by_last_arrival(acc, 1.0, offs_m, topk_w_ptr, topk_ids_ptr, stride_im, stride_ik,
                            buf_ptr, out_ptr, stride_om, stride_oh, tickets_ptr, sorted_ids_ptr,
                            pid_b, pid_n, pid_k, num_pairs, top_k, num_experts, H, scale,
                            BLOCK_M, BLOCK_N, SPLIT_K, True, ATOMIC)
