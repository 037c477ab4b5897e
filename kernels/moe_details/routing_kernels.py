"""Routing alignment in Triton, for the decode path where the number of launches dominates.

Two implementations of the contract of routing.align_routing:

- align_small_kernel: ONE program does everything for up to SMALL_MAX_PAIRS pairs (histogram,
  exclusive scan, sort, scatter; no memset, no second launch). Pairs of one expert keep token
  order (a stable sort by (expert, pair)), so the layout is the same as align_routing's.
- count_and_rank_kernel + block_offsets_kernel + scatter_pairs_kernel (plus a memset of the
  counters) for larger batches: the order of pairs WITHIN an expert follows atomic arrival. That
  order never changes a result: every row of a block is an independent dot product and GEMM2
  sums the top-k slots of a token in slot order.

Both also zero an int32 scratch buffer (the GEMMs' arrival counters, see kernels.py): the
routing launch runs before the GEMMs on the stream, so the counters need no memset of their own
and are reset on every call, also under CUDA-graph replay.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Bounds of the one-program path: the sort runs over next_pow2(pairs) keys in one program and the
# histogram over next_pow2(E + 1) bins; K3 decode (64 tokens x top-16 = 1024 pairs, 896 experts)
# is the largest case it is sized for.
SMALL_MAX_PAIRS = 1024
SMALL_MAX_BINS = 1024


def small_routing(num_pairs: int, num_experts: int) -> bool:
    """Whether align_small (one program) serves a call of num_pairs pairs over num_experts."""
    return num_pairs <= SMALL_MAX_PAIRS and num_experts < SMALL_MAX_BINS


@triton.jit
def align_small_kernel(topk_ids_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, shift_ptr,
                       tickets_ptr, num_pairs, num_experts, fill_len, max_blocks, ticket_len,
                       BLOCK_M: tl.constexpr, P: tl.constexpr, E_BINS: tl.constexpr, FILL: tl.constexpr):
    """Whole alignment in one program (grid (1,)); see align_small."""
    align_small(topk_ids_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, shift_ptr, tickets_ptr, num_pairs,
                num_experts, fill_len, max_blocks, ticket_len, BLOCK_M, P, E_BINS, FILL)


@triton.jit
def align_small(topk_ids_ptr, sorted_ids_ptr, block_expert_ptr, num_padded_ptr, shift_ptr,
                tickets_ptr, num_pairs, num_experts, fill_len, max_blocks, ticket_len,
                BLOCK_M: tl.constexpr, P: tl.constexpr, E_BINS: tl.constexpr, FILL: tl.constexpr):
    """The whole alignment by the calling program (a kernel of its own, or program 0 of a launch
    that does other per-token work in its other programs, e.g. the FP4 modes' activation
    quantization). P: pow2 >= num_pairs; E_BINS: pow2 > num_experts (bin num_experts collects
    dropped pairs and the P - num_pairs lanes past the end).

    shift_ptr: int32 [E_BINS] scratch (padded start - unpadded start of every expert)."""
    p = tl.arange(0, P)
    ids = tl.load(topk_ids_ptr + p, mask=p < num_pairs, other=-1)  # int32 or int64: compared before any cast
    e = tl.where((ids >= 0) & (ids < num_experts), ids, num_experts).to(tl.int32)

    # Per-expert counts, padded to BLOCK_M; exclusive scans give each expert's first row.
    bins = tl.arange(0, E_BINS)
    counts = tl.where(bins < num_experts, tl.histogram(e, E_BINS), 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    shift = (tl.cumsum(padded, 0) - padded) - (tl.cumsum(counts, 0) - counts)
    tl.store(shift_ptr + bins, shift)
    tl.store(num_padded_ptr, tl.sum(padded, 0))

    # Fill: padding rows hold num_pairs, unused blocks expert E, counters 0. Overwritten below
    # after the barrier (same addresses, other threads: the barrier orders the two writes).
    for off in range(0, fill_len, FILL):
        f = off + tl.arange(0, FILL)
        tl.store(sorted_ids_ptr + f, tl.full((FILL,), 0, tl.int32) + num_pairs, mask=f < fill_len)
    for off in range(0, max_blocks, FILL):
        f = off + tl.arange(0, FILL)
        tl.store(block_expert_ptr + f, tl.full((FILL,), 0, tl.int32) + num_experts, mask=f < max_blocks)
    for off in range(0, ticket_len, FILL):
        f = off + tl.arange(0, FILL)
        tl.store(tickets_ptr + f, tl.full((FILL,), 0, tl.int32), mask=f < ticket_len)
    tl.debug_barrier()

    # Stable order by (expert, pair): sorted position i of a real pair goes to row i + shift[e];
    # a row at a multiple of BLOCK_M starts a block of that expert.
    key = tl.sort(e * P + p)
    se = key // P
    real = se < num_experts
    dest = tl.arange(0, P) + tl.load(shift_ptr + se, mask=real, other=0)
    tl.store(sorted_ids_ptr + dest, key % P, mask=real)
    tl.store(block_expert_ptr + dest // BLOCK_M, se, mask=real & (dest % BLOCK_M == 0))


@triton.jit
def count_and_rank_kernel(topk_ids_ptr, counts_ptr, rank_ptr, sorted_ids_ptr, tickets_ptr, num_pairs, num_experts,
                          fill_len, ticket_len, BLOCK: tl.constexpr):
    """Per pair: rank within its expert (atomic counter); also fills sorted_ids with the
    padding sentinel (num_pairs) over fill_len entries and zeroes ticket_len counters."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(sorted_ids_ptr + offs, tl.full((BLOCK,), 0, tl.int32) + num_pairs, mask=offs < fill_len)
    tl.store(tickets_ptr + offs, tl.full((BLOCK,), 0, tl.int32), mask=offs < ticket_len)
    in_range = offs < num_pairs
    ids = tl.load(topk_ids_ptr + offs, mask=in_range, other=-1)
    valid = in_range & (ids >= 0) & (ids < num_experts)
    e = tl.where(valid, ids, 0).to(tl.int32)
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
    ids = tl.load(topk_ids_ptr + offs, mask=in_range, other=-1)
    valid = in_range & (ids >= 0) & (ids < num_experts)
    e = tl.where(valid, ids, 0).to(tl.int32)
    rank = tl.load(rank_ptr + offs, mask=valid, other=0)
    start = tl.load(padded_start_ptr + e, mask=valid, other=0)
    tl.store(sorted_ids_ptr + start + rank, offs.to(tl.int32), mask=valid)
