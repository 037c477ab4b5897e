"""The MoE skeleton shared by both kernel families (W4A16: moe_details/kernels.py; FP4 tensor-core
modes: moe_fp4_details/kernels.py). A family only says how one K step's operands are prepared
and what GEMM1's epilogue stores; everything around the K loop lives here:

- the grid: program (b, n, s) = (row block of the routing alignment, column tile, K slice);
  blocks past the used rows exit at once (block_program), so the grid is the worst case and
  nothing is read back on the host;
- split-K finished by the last arrival: each K slice stores its fp32 partials and counts itself
  on a counter of its (block, column tile); the slice that arrives last sums all slices in slice
  order (split_k_arrive, split_k_sum);
- GEMM2's top-k sum by the token's last arrival (combine_by_last_arrival): each (slice, pair) row
  is stored in fp32 (or added atomically), the program that brings a token's count to
  (valid slots x slices) sums the token's rows in slot order, scales, casts and writes out.

Counters are int32 buffers zeroed by the routing launch earlier on the stream. Accumulators are
[BN, BM] with swap-AB (weights on the MMA M side) and [BM, BN] otherwise; tile_index gives the
matching row and column index tensors. The host side allocates the skeleton's scratch buffers
with arrival_counters, split_k_partials and top_k_buffer (sized by the worst case: no host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def tile_index(offs_m, offs_n, SWAP_AB: tl.constexpr):
    """Row (token) and column index tensors of an accumulator tile: [BN, BM] with swap-AB
    (tokens on the MMA N side), else [BM, BN]."""
    if SWAP_AB:
        return offs_m[None, :], offs_n[:, None]
    else:
        return offs_m[:, None], offs_n[None, :]


@triton.jit
def block_program(num_padded_ptr, BLOCK_M: tl.constexpr):
    """This program's (row block, column tile, K slice) ids, and whether its row block holds
    routed rows (blocks past num_padded exit at once: the grid is the worst case)."""
    pid_b = tl.program_id(0)
    return pid_b, tl.program_id(1), tl.program_id(2), pid_b * BLOCK_M < tl.load(num_padded_ptr)


@triton.jit
def block_rows(block_expert_ptr, pid_b, BLOCK_M: tl.constexpr):
    """A used row block's expert (int64) and its rows in the sorted order (int64 [BLOCK_M])."""
    expert = tl.load(block_expert_ptr + pid_b).to(tl.int64)
    return expert, (pid_b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)


@triton.jit
def accumulator(BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr):
    """A zero fp32 accumulator of BLOCK_M tokens x BLOCK_N weight rows: [BN, BM] with swap-AB
    (weights on the MMA M side), else [BM, BN]."""
    if SWAP_AB:
        return tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        return tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)


@triton.jit
def k_range(pid_k, K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """K steps [lo, hi) of slice pid_k: cdiv(K, BLOCK_K) steps cut into SPLIT_K near-equal slices."""
    k_steps = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_steps, SPLIT_K)
    lo = pid_k * per_split
    return lo, tl.minimum(lo + per_split, k_steps)


@triton.jit
def arrive(ticket_ptrs, mask):
    """Count this program's arrival on the given counters after its results are stored; returns
    the old values. The barrier puts every thread's stores before the release (the CUDA
    threadfence-reduction pattern); acquire makes the other programs' stores visible to the one
    that arrives last. No program ever waits: the last arrival does the remaining work."""
    tl.debug_barrier()
    return tl.atomic_add(ticket_ptrs, 1, mask=mask, sem="acq_rel", scope="gpu")


@triton.jit
def split_k_arrive(part, acc_g, acc_u, mask, I, tickets_ptr, pid_b, pid_n, pid_k,
                   BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr):
    """GEMM1 split over K: store this slice's fp32 gate and up accumulators (part: pointers of the
    tile in slice 0 of [SPLIT_K, max_padded, 2I]: gate at column n, up at I + n) and arrive on
    the (block, column tile) counter. True for the slice that arrives last."""
    slice_elems = tl.num_programs(0).to(tl.int64) * BLOCK_M * (2 * I)
    tl.store(part + pid_k * slice_elems, acc_g, mask=mask)
    tl.store(part + pid_k * slice_elems + I, acc_u, mask=mask)
    return arrive(tickets_ptr + pid_b * tl.num_programs(1) + pid_n, pid_k >= 0) == SPLIT_K - 1


@triton.jit
def split_k_sum(part, mask, I, acc_g, acc_u, BLOCK_M: tl.constexpr, SPLIT_K: tl.constexpr):
    """The last slice's sums of all slices' gate and up partials, in slice order (its own
    included, from memory: bitwise the same whichever slice finishes). acc_g / acc_u give shape."""
    slice_elems = tl.num_programs(0).to(tl.int64) * BLOCK_M * (2 * I)
    g = tl.zeros(acc_g.shape, dtype=tl.float32)
    u = tl.zeros(acc_u.shape, dtype=tl.float32)
    for s in range(SPLIT_K):
        g += tl.load(part + s * slice_elems, mask=mask, other=0.0, cache_modifier=".cg")
        u += tl.load(part + s * slice_elems + I, mask=mask, other=0.0, cache_modifier=".cg")
    return g, u


@triton.jit
def _valid_slots(ids_ptr, stride_im, stride_ik, token, ok, top_k, num_experts):
    """Number of slots of each token whose expert id is in [0, E) (int32, same shape as token)."""
    cnt = tl.zeros(token.shape, dtype=tl.int32)
    for j in range(0, top_k):
        e = tl.load(ids_ptr + token * stride_im + j * stride_ik, mask=ok, other=-1)
        cnt += ((e >= 0) & (e < num_experts)).to(tl.int32)
    return cnt


@triton.jit
def zero_dropped_tokens(out_ptr, stride_om, stride_oh, ids_ptr, stride_im, stride_ik, pid_b, pid_n, pid_k,
                        num_pairs, top_k, num_experts, H, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (b, n, 0), b < cdiv(M, BLOCK_M): zero the output columns of tile n of tokens
    b * BLOCK_M .. + BLOCK_M whose ids all lie outside [0, E) (no expert of this rank serves them,
    so no program arrives for them). Every such GEMM2 program runs it, whether its row block is
    used or not (max_blocks >= cdiv(M, BLOCK_M) always)."""
    num_tokens = num_pairs // top_k
    if pid_k == 0:
        if pid_b * BLOCK_M < num_tokens:
            t = (pid_b * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
            t_ok = t < num_tokens
            dropped = t_ok & (_valid_slots(ids_ptr, stride_im, stride_ik, t, t_ok, top_k, num_experts) == 0)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty)
            tl.store(out_ptr + t[:, None] * stride_om + offs_n[None, :] * stride_oh, zero,
                     mask=dropped[:, None] & (offs_n < H)[None, :])


@triton.jit
def combine_by_last_arrival(
    acc, post_scale, offs_m, topk_w_ptr, topk_ids_ptr, stride_im, stride_ik,
    buf_ptr, out_ptr, stride_om, stride_oh, tickets_ptr, sorted_ids_ptr,
    pid_b, pid_n, pid_k, num_pairs, top_k, num_experts, H, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, SWAP_AB: tl.constexpr,
    ATOMIC: tl.constexpr,
):
    """GEMM2's epilogue: acc (fp32 accumulator of rows offs_m, column tile pid_n, K slice pid_k)
    x routing weight x post_scale (the family's scalar scales), then the top-k sum:

    ATOMIC False: each (K slice, pair) row goes to buf fp32 [SPLIT_K, M*k, H] (plain stores).
    ATOMIC True:  fp32 atomic adds into buf [M, H] (zeroed by the caller; order not fixed).
    Then the program arrives on tickets[token, column tile] (int32 [M, H tiles]) for each of its
    rows; the one that brings a token's count to (valid slots x SPLIT_K) writes that token's output
    columns: the sum over slots (slot order, then slice order: deterministic unless ATOMIC) x scale,
    cast to out's dtype. Also zeroes the output of tokens no local expert serves."""
    pair = tl.load(sorted_ids_ptr + offs_m).to(tl.int64)
    row_ok = pair < num_pairs
    routing_w = tl.load(topk_w_ptr + pair, mask=row_ok, other=0.0)
    token = tl.where(row_ok, pair // top_k, 0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    if SWAP_AB:
        acc = acc * routing_w[None, :]
    else:
        acc = acc * routing_w[:, None]
    acc = acc * post_scale
    t_idx, n_idx = tile_index(token, offs_n, SWAP_AB)
    ok_r, ok_n = tile_index(row_ok, n_ok, SWAP_AB)
    if ATOMIC:
        tl.atomic_add(buf_ptr + t_idx * H + n_idx, acc, mask=ok_r & ok_n)
    else:
        p_idx, _ = tile_index(pid_k * num_pairs + pair, offs_n, SWAP_AB)
        tl.store(buf_ptr + p_idx * H + n_idx, acc, mask=ok_r & ok_n)

    zero_dropped_tokens(out_ptr, stride_om, stride_oh, topk_ids_ptr, stride_im, stride_ik, pid_b, pid_n, pid_k,
                        num_pairs, top_k, num_experts, H, BLOCK_M, BLOCK_N)

    slots = _valid_slots(topk_ids_ptr, stride_im, stride_ik, token, row_ok, top_k, num_experts)
    old = arrive(tickets_ptr + token * tl.num_programs(1) + pid_n, row_ok)
    last = row_ok & (old == slots * SPLIT_K - 1)
    # The finisher works in column chunks: a whole 128-token x 256-column fp32 tile would spill.
    # Chunk widths per block shape are the static SASS report's best for the K loop (ptxas
    # allocates registers for the whole kernel, so the epilogue's shape moves the loop's count).
    C: tl.constexpr = BLOCK_N if BLOCK_M <= 16 else (128 if SWAP_AB else 64)
    CHUNK: tl.constexpr = BLOCK_N if BLOCK_N < C else C
    if tl.max(last.to(tl.int32), 0) > 0:
        for c in range(0, BLOCK_N // CHUNK):
            cols = pid_n * BLOCK_N + c * CHUNK + tl.arange(0, CHUNK)
            tc_idx, c_idx = tile_index(token, cols, SWAP_AB)
            ok_last, ok_c = tile_index(last, cols < H, SWAP_AB)
            ok_t = ok_last & ok_c
            if ATOMIC:
                y = tl.load(buf_ptr + tc_idx * H + c_idx, mask=ok_t, other=0.0, cache_modifier=".cg")
            else:
                y = tl.zeros(ok_t.shape, dtype=tl.float32)
                for q in range(0, top_k * SPLIT_K):  # slot j = q // SPLIT_K, K slice q % SPLIT_K
                    j = q // SPLIT_K
                    e = tl.load(topk_ids_ptr + token * stride_im + j * stride_ik, mask=last, other=-1)
                    ok_e, _unused = tile_index((e >= 0) & (e < num_experts), cols, SWAP_AB)
                    y += tl.load(buf_ptr + ((q % SPLIT_K) * num_pairs + tc_idx * top_k + j) * H + c_idx,
                                 mask=ok_e & ok_t, other=0.0, cache_modifier=".cg")
            y = y * scale
            tl.store(out_ptr + tc_idx * stride_om + c_idx * stride_oh, y.to(out_ptr.dtype.element_ty), mask=ok_t)


# ---------------------------------------------------------------------------------------------- host side


def arrival_counters(max_blocks: int, tiles1: int, split_k1: int, M: int, tiles2: int,
                     device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One int32 buffer for the routing launch to zero, and its two views: GEMM1's counters per
    (block, column tile) when it is split over K (offset rounded to 128 bytes), then GEMM2's per
    (token, column tile). Returns (all, gemm1's, gemm2's)."""
    n_t1 = -(-max_blocks * tiles1 // 32) * 32 if split_k1 > 1 else 0
    tickets = torch.empty(n_t1 + M * tiles2, dtype=torch.int32, device=device)
    return tickets, (tickets[:n_t1] if n_t1 else tickets), tickets[n_t1:]


def split_k_partials(split_k1: int, max_padded: int, I: int, unused: torch.Tensor) -> torch.Tensor:
    """GEMM1's fp32 partials [split_k1, max_padded, 2I] (gate, up) when it is split over K, else
    ``unused`` (any tensor: the kernel does not read it)."""
    if split_k1 == 1:
        return unused
    return torch.empty(split_k1, max_padded, 2 * I, dtype=torch.float32, device=unused.device)


def top_k_buffer(atomic: bool, split_k2: int, M: int, num_pairs: int, H: int, device) -> torch.Tensor:
    """GEMM2's fp32 rows for the top-k sum: [M, H] zeroed for atomic adds (one memset), else
    [split_k2, M k, H] (rows of dropped pairs are never written and never read)."""
    if atomic:
        return torch.zeros(M, H, dtype=torch.float32, device=device)
    return torch.empty(split_k2, num_pairs, H, dtype=torch.float32, device=device)

