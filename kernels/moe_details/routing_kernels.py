"""Routing alignment in Triton: 3 small kernels (plus one memset) instead of ~35 torch ops, for
the decode path where launch count dominates. Same output contract as routing.align_routing,
except that the order of pairs WITHIN an expert follows atomic arrival (not token order). That
order never changes a result: every row of a block is an independent dot product and GEMM2
writes per pair (or adds per token in a fixed split order).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def count_and_rank_kernel(topk_ids_ptr, counts_ptr, rank_ptr, sorted_ids_ptr, num_pairs, num_experts,
                          fill_len, BLOCK: tl.constexpr):
    """Per pair: rank within its expert (atomic counter); also fills sorted_ids with the
    padding sentinel (num_pairs) over fill_len entries."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(sorted_ids_ptr + offs, tl.full((BLOCK,), 0, tl.int32) + num_pairs, mask=offs < fill_len)
    in_range = offs < num_pairs
    e = tl.load(topk_ids_ptr + offs, mask=in_range, other=-1).to(tl.int32)
    valid = in_range & (e >= 0) & (e < num_experts)
    rank = tl.atomic_add(counts_ptr + e, tl.full((BLOCK,), 1, tl.int32), mask=valid)
    tl.store(rank_ptr + offs, rank, mask=valid)


@triton.jit
def block_offsets_kernel(counts_ptr, padded_start_ptr, block_expert_ptr, num_padded_ptr, num_experts,
                         max_blocks, BLOCK_M: tl.constexpr, E_POW2: tl.constexpr, BLOCKS_PER_STEP: tl.constexpr):
    """One program: expert offsets padded to BLOCK_M, and the expert of every block
    (num_experts for blocks past the used rows)."""
    e = tl.arange(0, E_POW2)
    e_ok = e < num_experts
    c = tl.load(counts_ptr + e, mask=e_ok, other=0)
    padded = (c + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    end = tl.cumsum(padded, 0)
    tl.store(padded_start_ptr + e, end - padded, mask=e_ok)
    tl.store(num_padded_ptr, tl.sum(padded, 0))
    for s in range(0, tl.cdiv(max_blocks, BLOCKS_PER_STEP)):
        b = s * BLOCKS_PER_STEP + tl.arange(0, BLOCKS_PER_STEP)
        row = b * BLOCK_M
        before = (end[None, :] <= row[:, None]) & e_ok[None, :]
        tl.store(block_expert_ptr + b, tl.sum(before.to(tl.int32), 1), mask=b < max_blocks)


@triton.jit
def scatter_pairs_kernel(topk_ids_ptr, rank_ptr, padded_start_ptr, sorted_ids_ptr, num_pairs, num_experts,
                         BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < num_pairs
    e = tl.load(topk_ids_ptr + offs, mask=in_range, other=-1).to(tl.int32)
    valid = in_range & (e >= 0) & (e < num_experts)
    rank = tl.load(rank_ptr + offs, mask=valid, other=0)
    start = tl.load(padded_start_ptr + e, mask=valid, other=0)
    tl.store(sorted_ids_ptr + start + rank, offs.to(tl.int32), mask=valid)
