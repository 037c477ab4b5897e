"""Triton jit kernels of the FP4 tensor-core MoE modes (``tl.dot_scaled``).

MODE 0 = "nvfp4" (W4A4): activations E2M1 + E4M3 per 16 + fp32 per row, weights E2M1 + E4M3 per 16
(+ scale_2 on the accumulator): tcgen05 ``kind::mxf4nvf4 block16`` on sm100.
MODE 1 = "mxfp8" (W4A8): activations E4M3 + E8M0 per 32, weights E2M1 + E8M0 per 32 (scale_2
folded in): tcgen05 ``kind::mxf8f6f4 block32`` on sm100.
Elsewhere Triton decomposes ``tl.dot_scaled`` (wgmma on sm90). EMULATE=True replaces it by this
module's own decomposition (dequantize to fp32, fp32 dot): Triton 3.8's interpreter decodes E4M3
scales as E8M0, so the interpreter runs MODE 0 that way (moe_fp4.py decides; never on a GPU).

Quantizers (_quant_nvfp4 / _quant_mxfp8) follow kernels/act_quant.py exactly: same fp32
operations in the same order, IEEE divisions (div_rn), so the bits agree with the torch reference.
Both GEMMs run on the MoE skeleton of the W4A16 family (moe_details/skeleton.py): grid (row
block, column tile, K slice), split-K finished by the last slice to arrive, and GEMM2's top-k sum
by each token's last arrival, writing the output in its dtype (no combine launch). Only the K
step (``tl.dot_scaled`` on quantized tiles) and GEMM1's epilogue (quantization of the
intermediate) are this family's own.

GEMM1 stacks the gate rows n .. n + BLOCK_N and the up rows I + n .. of its column tile into ONE
weight operand of 2 x BLOCK_N rows: with BLOCK_N = 64 that is the 128-row M side tcgen05's
block-scaled MMA wants (swap-AB), and I = 192 / 384 splits into 3 / 6 tiles with no padding row.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..interpreter import interpret_requested
from ..moe_details.activation import gated_act
from ..moe_details.routing_kernels import align_small
from ..moe_details.skeleton import (accumulator, block_program, block_rows, combine_by_last_arrival, k_range,
                                    split_k_arrive, split_k_sum, tile_index, zero_dropped_tokens)

MODE_NVFP4 = 0
MODE_MXFP8 = 1

# Triton 3.8's interpreter converts fp32 -> float8e4nv wrongly (round half up, and a mantissa carry
# is OR-ed into the exponent: 31.8 -> 16 instead of 32), so where the kernels are interpreted the
# conversion is done in integer arithmetic (_f32_to_e4m3); on a GPU cvt.rn.satfinite does it.
_SOFT_E4M3 = tl.constexpr(interpret_requested())


@triton.jit
def _f32_to_e4m3(x):
    """fp32 with |x| <= 448 -> float8e4nv, round to nearest even (subnormals included)."""
    if _SOFT_E4M3:
        bits = x.to(tl.uint32, bitcast=True)
        sign = (bits >> 31) << 7
        a = bits & 0x7FFFFFFF
        # normal range (|x| >= 2^-6): round the fp32 mantissa to 3 bits; a carry moves into the exponent
        r = (a + 0x7FFFF + ((a >> 20) & 1)) >> 20
        normal = r - (120 << 3)
        # subnormal range: multiples of 2^-9, rounded to an integer 0..8 by the 2^23 trick (8 is 2^-6)
        m = tl.abs(x) * 512.0
        sub = ((m + 8388608.0) - 8388608.0).to(tl.uint32)
        mag = tl.where(tl.abs(x) < 0.015625, sub, normal)
        return (mag | sign).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    else:
        return x.to(tl.float8e4nv)


@triton.jit
def _e2m1_codes(y):
    """fp32 -> E2M1 codes (uint8), round to nearest, ties to even, saturating at 6; sign bit kept.
    Ties: 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4 (even codes)."""
    m = tl.abs(y)
    c = ((m > 0.25).to(tl.int32) + (m >= 0.75).to(tl.int32) + (m > 1.25).to(tl.int32)
         + (m >= 1.75).to(tl.int32) + (m > 2.5).to(tl.int32) + (m >= 3.5).to(tl.int32) + (m > 5.0).to(tl.int32))
    sign = (y.to(tl.uint32, bitcast=True) >> 31).to(tl.int32)
    return (c | (sign << 3)).to(tl.uint8)


@triton.jit
def _pack_pairs(codes, R: tl.constexpr, C: tl.constexpr):
    """uint8 codes [R, C] -> packed bytes [R, C/2], low nibble = even element."""
    lo, hi = tl.split(tl.reshape(codes, (R, C // 2, 2)))
    return lo | (hi << 4)


@triton.jit
def _quant_nvfp4(x, rs, R: tl.constexpr, C: tl.constexpr):
    """x fp32 [R, C], rs fp32 [R, 1] (row scales) -> (packed uint8 [R, C/2], E4M3 scales [R, C/16])."""
    xb = tl.reshape(x, (R, C // 16, 16))
    amax = tl.max(tl.abs(xb), axis=2)
    bf = tl.minimum(tl.math.div_rn(amax, rs * 6.0), 448.0)
    bs = _f32_to_e4m3(bf)
    denom = bs.to(tl.float32) * rs
    ok = denom > 0
    y = tl.math.div_rn(xb, tl.where(ok, denom, 1.0)[:, :, None])
    y = tl.where(ok[:, :, None], y, 0.0)  # underflowed block scale: flushed to +0
    codes = _e2m1_codes(tl.reshape(y, (R, C)))
    return _pack_pairs(codes, R, C), bs


@triton.jit
def _quant_mxfp8(x, R: tl.constexpr, C: tl.constexpr):
    """x fp32 [R, C] -> (E4M3 values [R, C], E8M0 bytes uint8 [R, C/32]); act_quant.py's rule."""
    xb = tl.reshape(x, (R, C // 32, 32))
    amax = tl.max(tl.abs(xb), axis=2)
    bits = amax.to(tl.int32, bitcast=True)
    byte = ((bits >> 23) & 0xFF) - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    byte = tl.minimum(tl.maximum(byte, 1), 254)
    scale = (byte << 23).to(tl.float32, bitcast=True)
    y = tl.math.div_rn(xb, scale[:, :, None])
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    return _f32_to_e4m3(tl.reshape(y, (R, C))), byte.to(tl.uint8)


@triton.jit
def _e2m1_to_f32(packed, R: tl.constexpr, C: tl.constexpr):
    """packed uint8 [R, C/2] -> fp32 [R, C] (the 16 E2M1 values, exact)."""
    codes = tl.reshape(tl.join(packed & 0xF, packed >> 4), (R, C)).to(tl.int32)
    mag = codes & 7
    e = mag >> 1
    mf = (mag & 1).to(tl.float32)
    p = (1 << tl.maximum(e - 1, 0)).to(tl.float32)
    v = tl.where(e == 0, 0.5 * mf, p * (1.0 + 0.5 * mf))
    return tl.where((codes & 8) != 0, -v, v)


@triton.jit
def _dequant_emulated(q, s, FMT: tl.constexpr, R: tl.constexpr, K: tl.constexpr, G: tl.constexpr):
    """One dot_scaled operand, K-major ([R, K/2] packed E2M1 or [R, K] E4M3; scales [R, K/G]:
    E4M3 per 16 (G = 16) or E8M0 per 32 (G = 32)) -> fp32 [R, K]."""
    if FMT == "e2m1":
        v = _e2m1_to_f32(q, R, K)
    else:
        v = q.to(tl.float32)
    if G == 16:
        sf = s.to(tl.float32)
    else:
        sf = (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    return tl.reshape(tl.reshape(v, (R, K // G, G)) * sf[:, :, None], (R, K))


@triton.jit
def _scaled_mma(acc, p, ps, P_FMT: tl.constexpr, q, qs, Q_FMT: tl.constexpr,
                P_ROWS: tl.constexpr, Q_ROWS: tl.constexpr, BLOCK_K: tl.constexpr, G: tl.constexpr,
                EMULATE: tl.constexpr):
    """acc [P_ROWS, Q_ROWS] += p x q^T; both operands K-major tiles with their block scales (per G)."""
    if EMULATE:
        pv = _dequant_emulated(p, ps, P_FMT, P_ROWS, BLOCK_K, G)
        qv = _dequant_emulated(q, qs, Q_FMT, Q_ROWS, BLOCK_K, G)
        return tl.dot(pv, tl.trans(qv), acc, input_precision="ieee")
    else:
        return tl.dot_scaled(p, ps, P_FMT, tl.trans(q), qs, Q_FMT, acc)


@triton.jit
def _load_act(a_ptr, as_ptr, rows, k0, K, MODE: tl.constexpr, BLOCK_K: tl.constexpr):
    """Quantized activation tile of the given rows, K columns k0 .. k0 + BLOCK_K (K % BLOCK_K == 0):
    MODE 0 -> (packed [BM, BK/2], E4M3 [BM, BK/16]); MODE 1 -> (E4M3 [BM, BK], E8M0 [BM, BK/32])."""
    if MODE == 0:
        kq = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        ks = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        q = tl.load(a_ptr + rows[:, None] * (K // 2) + kq[None, :])
        s = tl.load(as_ptr + rows[:, None] * (K // 16) + ks[None, :])
    else:
        kq = k0 + tl.arange(0, BLOCK_K)
        ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        q = tl.load(a_ptr + rows[:, None] * K + kq[None, :])
        s = tl.load(as_ptr + rows[:, None] * (K // 32) + ks[None, :])
    return q, s


@triton.jit
def _load_w(w_ptr, ws_ptr, rows, k0, K, MODE: tl.constexpr, BLOCK_K: tl.constexpr):
    """Weight tile of one expert (pointers already at the expert): packed [BN, BK/2] and its scales
    (MODE 0: E4M3 [BN, BK/16]; MODE 1: E8M0 [BN, BK/32]). rows: int64 [BN]."""
    kq = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    q = tl.load(w_ptr + rows[:, None] * (K // 2) + kq[None, :])
    if MODE == 0:
        ks = k0 // 16 + tl.arange(0, BLOCK_K // 16)
        s = tl.load(ws_ptr + rows[:, None] * (K // 16) + ks[None, :])
    else:
        ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        s = tl.load(ws_ptr + rows[:, None] * (K // 32) + ks[None, :])
    return q, s


@triton.jit
def _mma_step(acc, aq, asc, wq, wsc, MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, SWAP_AB: tl.constexpr, EMULATE: tl.constexpr):
    A_FMT: tl.constexpr = "e2m1" if MODE == 0 else "e4m3"
    G: tl.constexpr = 16 if MODE == 0 else 32
    if SWAP_AB:  # weights on the MMA M side, tokens on N: acc [BN, BM]
        return _scaled_mma(acc, wq, wsc, "e2m1", aq, asc, A_FMT, BLOCK_N, BLOCK_M, BLOCK_K, G, EMULATE)
    else:
        return _scaled_mma(acc, aq, asc, A_FMT, wq, wsc, "e2m1", BLOCK_M, BLOCK_N, BLOCK_K, G, EMULATE)


@triton.jit
def _as_mn(acc, SWAP_AB: tl.constexpr):
    if SWAP_AB:
        return tl.trans(acc)
    else:
        return acc


@triton.jit
def _split_gate_up(acc, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
    """GEMM1's stacked accumulator ([2 BN, BM] with swap-AB, else [BM, 2 BN]; gate rows first) ->
    (gate, up), each [BN, BM] / [BM, BN]."""
    if SWAP_AB:
        both = tl.permute(tl.reshape(acc, (2, BLOCK_N, BLOCK_M)), (1, 2, 0))
    else:
        both = tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1))
    return tl.split(both)


@triton.jit
def quant_row(x_ptr, stride_xm, q_ptr, s_ptr, rs_ptr, r, K, static_scale,
              MODE: tl.constexpr, STATIC: tl.constexpr, BLOCK_K: tl.constexpr):
    """Quantize row r of x [R, K] (any float dtype, K % BLOCK_K == 0) once.

    MODE 0 (NVFP4): pass 1 row amax (unless STATIC: row scale = static_scale), pass 2 packed
    [R, K/2] + E4M3 [R, K/16] + fp32 row scale [R]. MODE 1 (MXFP8): E4M3 [R, K] + E8M0 [R, K/32].
    """
    row = x_ptr + r * stride_xm
    offs = tl.arange(0, BLOCK_K)
    if MODE == 0:
        if STATIC:
            rs = static_scale + tl.zeros((1, 1), dtype=tl.float32)
        else:
            amax = tl.zeros((1, 1), dtype=tl.float32)
            for k0 in range(0, K, BLOCK_K):
                x = tl.load(row + k0 + offs[None, :]).to(tl.float32)
                amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1, keep_dims=True))
            rs = tl.math.div_rn(amax, 2688.0)
            rs = tl.where(rs > 0, rs, 1.0)
        tl.store(rs_ptr + r + tl.zeros((1, 1), dtype=tl.int64), rs)
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(row + k0 + offs[None, :]).to(tl.float32)
            q, s = _quant_nvfp4(x, rs, 1, BLOCK_K)
            tl.store(q_ptr + r * (K // 2) + k0 // 2 + tl.arange(0, BLOCK_K // 2)[None, :], q)
            tl.store(s_ptr + r * (K // 16) + k0 // 16 + tl.arange(0, BLOCK_K // 16)[None, :], s)
    else:
        for k0 in range(0, K, BLOCK_K):
            x = tl.load(row + k0 + offs[None, :]).to(tl.float32)
            q, s = _quant_mxfp8(x, 1, BLOCK_K)
            tl.store(q_ptr + r * K + k0 + offs[None, :], q)
            tl.store(s_ptr + r * (K // 32) + k0 // 32 + tl.arange(0, BLOCK_K // 32)[None, :], s)


@triton.jit
def quant_rows_kernel(
    x_ptr, stride_xm, q_ptr, s_ptr, rs_ptr, num_rows_ptr, K, static_scale,
    MODE: tl.constexpr, STATIC: tl.constexpr, HAS_NUM_ROWS: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """quant_row of row program_id(0). HAS_NUM_ROWS: rows >= num_rows_ptr[0] (unused padding
    rows of the intermediate) exit."""
    r = tl.program_id(0).to(tl.int64)
    if HAS_NUM_ROWS:
        if r >= tl.load(num_rows_ptr):
            return
    quant_row(x_ptr, stride_xm, q_ptr, s_ptr, rs_ptr, r, K, static_scale, MODE, STATIC, BLOCK_K)


@triton.jit
def route_quant_kernel(
    topk_ids_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, shift_ptr, tickets_ptr,
    num_pairs, num_experts, fill_len, max_blocks, ticket_len,
    x_ptr, stride_xm, q_ptr, s_ptr, rs_ptr, K, static_scale,
    BLOCK_M: tl.constexpr, P: tl.constexpr, E_BINS: tl.constexpr, FILL: tl.constexpr,
    MODE: tl.constexpr, STATIC: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """The call's first launch, grid (1 + M,): program 0 aligns the routing (routing_kernels.
    align_small, also zeroing the GEMMs' counters), program 1 + t quantizes token t's activation
    row once for all its experts (quant_row). Two kernels' work in one launch."""
    pid = tl.program_id(0)
    if pid == 0:
        align_small(topk_ids_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, shift_ptr, tickets_ptr,
                    num_pairs, num_experts, fill_len, max_blocks, ticket_len, BLOCK_M, P, E_BINS, FILL)
    else:
        quant_row(x_ptr, stride_xm, q_ptr, s_ptr, rs_ptr, (pid - 1).to(tl.int64), K, static_scale,
                  MODE, STATIC, BLOCK_K)


@triton.jit
def fp4_gemm1_kernel(
    a_ptr, as_ptr, ars_ptr,
    w_ptr, ws_ptr, s2_ptr,
    o_ptr, os_ptr, of_ptr, part_ptr, tickets_ptr,
    sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, top_k, H, I,
    beta, linear_beta, inter_scale,
    MODE: tl.constexpr, OUT_F32: tl.constexpr, ACT: tl.constexpr, HAS_LINEAR_BETA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    SWAP_AB: tl.constexpr, EMULATE: tl.constexpr,
):
    """GEMM1 + gated activation + quantization of the intermediate, one (row block, column tile of
    BLOCK_N columns of I, K slice).

    a: the tokens' quantized activations (row scale ars [M] in MODE 0), read through pair ->
    token. One MMA per K step on the stacked gate + up rows (module docstring). In MODE 0 the fp32
    accumulators are multiplied by the token's row scale and the per-half scale_2 (MODE 1 has
    scale_2 folded into the E8M0 scales). SPLIT_K > 1: the skeleton's split-K (fp32 partials
    part [SPLIT_K, max_padded, 2I], counters tickets[block, column tile]). The finishing program:
    SiTU / SiLU in fp32, then
      OUT_F32: fp32 [max_padded, I] to of (quantized afterwards by quant_rows_kernel), or
      MODE 0: NVFP4 with the static row scale inter_scale -> o packed [max_padded, I/2], os E4M3
              [max_padded, I/16];  MODE 1: MXFP8 -> o E4M3 [max_padded, I], os E8M0 [max_padded, I/32].
    Padding rows are stored too (computed from token 0: finite), as in the W4A16 family: GEMM2
    and the row quantizer read whole blocks unmasked, and an unwritten row would feed them
    whatever the allocator left there (NaN / inf bytes: 0/0 and inf x 0 on lanes never stored).
    """
    pid_b, pid_n, pid_k, used = block_program(num_padded_ptr, BLOCK_M)
    if not used:
        return
    expert, offs_m = block_rows(block_expert_ptr, pid_b, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    valid = pair < num_pairs
    token = tl.where(valid, pair // top_k, 0)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    n_ok = offs_n < I
    # Stacked operand rows: gate rows n, then up rows I + n; a tile past I re-reads row I - 1.
    r = tl.arange(0, 2 * BLOCK_N)
    n_row = tl.minimum(pid_n * BLOCK_N + r % BLOCK_N, I - 1).to(tl.int64)
    w_rows = tl.where(r < BLOCK_N, n_row, I + n_row)
    two_i = 2 * I
    w_e = w_ptr + expert * two_i * (H // 2)
    if MODE == 0:
        ws_e = ws_ptr + expert * two_i * (H // 16)
    else:
        ws_e = ws_ptr + expert * two_i * (H // 32)
    acc = accumulator(BLOCK_M, 2 * BLOCK_N, SWAP_AB)
    step_lo, step_hi = k_range(pid_k, H, BLOCK_K, SPLIT_K)
    for step in range(step_lo, step_hi):
        k0 = step * BLOCK_K
        aq, asc = _load_act(a_ptr, as_ptr, token, k0, H, MODE, BLOCK_K)
        wq, wsc = _load_w(w_e, ws_e, w_rows, k0, H, MODE, BLOCK_K)
        acc = _mma_step(acc, aq, asc, wq, wsc, MODE, BLOCK_M, 2 * BLOCK_N, BLOCK_K, SWAP_AB, EMULATE)
    g, u = _split_gate_up(acc, BLOCK_M, BLOCK_N, SWAP_AB)
    if MODE == 0:
        rs, _unused = tile_index(tl.load(ars_ptr + token), offs_n, SWAP_AB)
        g = g * rs * tl.load(s2_ptr + expert * 2)
        u = u * rs * tl.load(s2_ptr + expert * 2 + 1)
    if SPLIT_K > 1:
        m_idx, n_idx = tile_index(offs_m.to(tl.int64), offs_n, SWAP_AB)
        ok_m, ok_n = tile_index(offs_m >= 0, n_ok, SWAP_AB)
        part = part_ptr + m_idx * (2 * I) + n_idx
        if not split_k_arrive(part, g, u, ok_m & ok_n, I, tickets_ptr, pid_b, pid_n, pid_k, BLOCK_M, SPLIT_K):
            return
        g, u = split_k_sum(part, ok_m & ok_n, I, g, u, BLOCK_M, SPLIT_K)
    rows = offs_m.to(tl.int64)[:, None]
    if OUT_F32:
        act = _as_mn(gated_act(g, u, beta, linear_beta, ACT, HAS_LINEAR_BETA), SWAP_AB)
        tl.store(of_ptr + rows * I + offs_n[None, :], act, mask=n_ok[None, :])
    elif BLOCK_N > 64:
        # Activated and quantized in two column halves: fewer registers live at once (128 x 128
        # spilled, MXFP8 first, then both modes once tanh gained its small-|x| polynomial).
        g0, g1 = _column_halves(_as_mn(g, SWAP_AB), BLOCK_M, BLOCK_N)
        u0, u1 = _column_halves(_as_mn(u, SWAP_AB), BLOCK_M, BLOCK_N)
        _store_quantized(gated_act(g0, u0, beta, linear_beta, ACT, HAS_LINEAR_BETA), pid_n * BLOCK_N, o_ptr,
                         os_ptr, rows, I, inter_scale, MODE, BLOCK_M, BLOCK_N // 2)
        _store_quantized(gated_act(g1, u1, beta, linear_beta, ACT, HAS_LINEAR_BETA), pid_n * BLOCK_N + BLOCK_N // 2,
                         o_ptr, os_ptr, rows, I, inter_scale, MODE, BLOCK_M, BLOCK_N // 2)
    else:
        act = _as_mn(gated_act(g, u, beta, linear_beta, ACT, HAS_LINEAR_BETA), SWAP_AB)
        _store_quantized(act, pid_n * BLOCK_N, o_ptr, os_ptr, rows, I, inter_scale, MODE, BLOCK_M, BLOCK_N)


@triton.jit
def _column_halves(x, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """fp32 [BLOCK_M, BLOCK_N] -> its columns 0 .. BLOCK_N/2 and BLOCK_N/2 .. BLOCK_N."""
    return tl.split(tl.permute(tl.reshape(x, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))


@triton.jit
def _store_quantized(x, c0, o_ptr, os_ptr, rows, I, inter_scale, MODE: tl.constexpr, BLOCK_M: tl.constexpr,
                     C: tl.constexpr):
    """Quantize intermediate columns c0 .. c0 + C (x fp32 [BLOCK_M, C]) of the given rows (int64
    [BLOCK_M, 1], padding rows included) and store them: MODE 0 NVFP4 with the static row scale
    inter_scale (o packed [rows, I/2], os E4M3 [rows, I/16]), MODE 1 MXFP8 (o E4M3 [rows, I], os
    E8M0 [rows, I/32]). Columns past I are not stored (I % 64 == 0: every 16- / 32-block lies
    wholly before or past I)."""
    if MODE == 0:
        q, s = _quant_nvfp4(x, inter_scale + tl.zeros((BLOCK_M, 1), dtype=tl.float32), BLOCK_M, C)
        cq = c0 // 2 + tl.arange(0, C // 2)
        c16 = c0 // 16 + tl.arange(0, C // 16)
        tl.store(o_ptr + rows * (I // 2) + cq[None, :], q, mask=(cq < I // 2)[None, :])
        tl.store(os_ptr + rows * (I // 16) + c16[None, :], s, mask=(c16 < I // 16)[None, :])
    else:
        q, s = _quant_mxfp8(x, BLOCK_M, C)
        cols = c0 + tl.arange(0, C)
        c32 = c0 // 32 + tl.arange(0, C // 32)
        tl.store(o_ptr + rows * I + cols[None, :], q, mask=(cols < I)[None, :])
        tl.store(os_ptr + rows * (I // 32) + c32[None, :], s, mask=(c32 < I // 32)[None, :])


@triton.jit
def fp4_gemm2_kernel(
    a_ptr, as_ptr, ars_ptr,
    w_ptr, ws_ptr, s2_ptr,
    topk_w_ptr, topk_ids_ptr, stride_im, stride_ik,
    buf_ptr, out_ptr, stride_om, stride_oh, tickets_ptr,
    sorted_ids_ptr, block_expert_ptr, num_padded_ptr,
    num_pairs, top_k, num_experts, H, I, inter_scale, scale,
    MODE: tl.constexpr, INTER_STATIC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    SWAP_AB: tl.constexpr, EMULATE: tl.constexpr, ATOMIC: tl.constexpr,
):
    """GEMM2 of one (row block, column tile, K slice): the quantized intermediate rows of the block
    (sorted order) x w2[expert]^T; MODE 0 multiplies the fp32 accumulator by the intermediate's
    row scale (inter_scale when INTER_STATIC, else ars [max_padded]) and w2's scale_2; then the
    skeleton's combine_by_last_arrival: x routing weight, the top-k sum (in slot order through buf
    fp32 [SPLIT_K, M*k, H], or ATOMIC: fp32 adds into buf [M, H], zeroed by the caller), x scale,
    cast: out [M, H] in its dtype."""
    pid_b, pid_n, pid_k, used = block_program(num_padded_ptr, BLOCK_M)
    if not used:
        zero_dropped_tokens(out_ptr, stride_om, stride_oh, topk_ids_ptr, stride_im, stride_ik, pid_b, pid_n, pid_k,
                            num_pairs, top_k, num_experts, H, BLOCK_M, BLOCK_N)
        return
    expert, offs_m = block_rows(block_expert_ptr, pid_b, BLOCK_M)
    offs_n = (pid_n * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    w_rows = tl.minimum(offs_n, H - 1)  # a tile past H re-reads row H - 1 (never stored)
    w_e = w_ptr + expert * H * (I // 2)
    if MODE == 0:
        ws_e = ws_ptr + expert * H * (I // 16)
    else:
        ws_e = ws_ptr + expert * H * (I // 32)
    acc = accumulator(BLOCK_M, BLOCK_N, SWAP_AB)
    step_lo, step_hi = k_range(pid_k, I, BLOCK_K, SPLIT_K)
    for step in range(step_lo, step_hi):
        k0 = step * BLOCK_K
        aq, asc = _load_act(a_ptr, as_ptr, offs_m, k0, I, MODE, BLOCK_K)
        wq, wsc = _load_w(w_e, ws_e, w_rows, k0, I, MODE, BLOCK_K)
        acc = _mma_step(acc, aq, asc, wq, wsc, MODE, BLOCK_M, BLOCK_N, BLOCK_K, SWAP_AB, EMULATE)
    if MODE == 0:
        if INTER_STATIC:
            post = inter_scale * tl.load(s2_ptr + expert)
        else:
            rs, _unused = tile_index(tl.load(ars_ptr + offs_m), offs_n, SWAP_AB)
            acc = acc * rs
            post = tl.load(s2_ptr + expert)
    else:
        post = 1.0  # scale_2 is folded into the E8M0 scales
    combine_by_last_arrival(acc, post, offs_m, topk_w_ptr, topk_ids_ptr, stride_im, stride_ik,
                            buf_ptr, out_ptr, stride_om, stride_oh, tickets_ptr, sorted_ids_ptr,
                            pid_b, pid_n, pid_k, num_pairs, top_k, num_experts, H, scale,
                            BLOCK_M, BLOCK_N, SPLIT_K, SWAP_AB, ATOMIC)
