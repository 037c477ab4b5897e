"""Routing alignment: group (token, slot) pairs by expert and pad each expert to block_m.

No host synchronisation and no data-dependent allocation (every buffer is sized by the worst
case), so it can be captured in a CUDA graph. No sgl_kernel. Two implementations with one
contract: align_routing_triton (what fused_moe_nvfp4 uses: one Triton launch up to 1024 pairs,
else 3 kernels + a memset) and align_routing (plain torch, ~35 small ops; token order within
an expert; a second reference for the tests next to the host loop align_routing_reference).

Pairs are numbered p = token * top_k + slot. Ids outside [0, E) (-1 = expert on another rank)
are dropped: they never reach a kernel, so they contribute nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AlignedRouting:
    """Expert-sorted, block-padded pair list.

    sorted_pair_ids: int32 [max_padded + 1]; entries of padding (and the tail) hold num_pairs.
                     The extra last slot receives the dropped (-1) pairs and is never read.
    block_expert_ids: int32 [max_blocks]; expert of each block_m-row block, E for unused blocks.
    num_padded: int32 [1]; rows actually used (sum over experts of counts rounded up to block_m).
    max_blocks: host int, grid size of the kernels (worst case over routings).
    """

    sorted_pair_ids: torch.Tensor
    block_expert_ids: torch.Tensor
    num_padded: torch.Tensor
    num_pairs: int
    block_m: int
    max_blocks: int

    @property
    def max_padded(self) -> int:
        return self.max_blocks * self.block_m


def max_padded_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Worst-case number of block_m blocks: every non-empty expert wastes < block_m rows and at
    most min(E, pairs) experts are non-empty."""
    worst = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return max(-(-worst // block_m), 1)


def align_routing(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedRouting:
    """topk_ids: int32/int64 [M, k] (-1 or any id outside [0, E) = dropped) -> AlignedRouting."""
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    E = num_experts
    max_blocks = max_padded_blocks(num_pairs, E, block_m)
    max_padded = max_blocks * block_m

    ids = topk_ids.reshape(-1).to(torch.int64)
    valid = (ids >= 0) & (ids < E)
    key = torch.where(valid, ids, torch.full_like(ids, E))  # dropped pairs sort last, "expert" E

    counts = torch.zeros(E + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    counts = counts[:E]
    padded = (counts + (block_m - 1)) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)  # inclusive
    padded_start = padded_end - padded
    count_start = torch.cumsum(counts, 0) - counts

    # Stable sort keeps pairs of one expert in token order (deterministic layout).
    sorted_key, order = torch.sort(key, stable=True)
    pos = torch.arange(num_pairs, device=device, dtype=torch.int64)
    safe_key = sorted_key.clamp(max=E - 1)
    dest = padded_start[safe_key] + (pos - count_start[safe_key])
    dest = torch.where(sorted_key < E, dest, torch.full_like(dest, max_padded))

    sorted_pair_ids = torch.full((max_padded + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids.scatter_(0, dest, order.to(torch.int32))

    block_start = torch.arange(max_blocks, device=device, dtype=torch.int64) * block_m
    # Expert e owns rows [padded_start[e], padded_end[e]); empty experts own nothing.
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert_ids = block_expert.clamp(max=E).to(torch.int32)
    num_padded = padded_end[-1:].to(torch.int32)
    return AlignedRouting(sorted_pair_ids, block_expert_ids, num_padded, num_pairs, block_m, max_blocks)


def align_routing_triton(
    topk_ids: torch.Tensor, num_experts: int, block_m: int, tickets: torch.Tensor | None = None
) -> AlignedRouting:
    """Same as :func:`align_routing` in Triton, with no host synchronisation.

    Up to routing_kernels.SMALL_MAX_PAIRS pairs (and E < SMALL_MAX_BINS): ONE launch, no memset;
    pairs of one expert in token order (the layout equals align_routing's). Larger: 3 kernels + a
    memset of the per-expert counters; order within an expert follows atomic arrival.
    tickets: optional int32 buffer zeroed by the same launch(es) (the GEMMs' arrival counters).
    """
    from . import routing_kernels as rk

    small = small_routing_launch(topk_ids, num_experts, block_m, tickets)
    if small is not None:
        routing, args, consts = small
        rk.align_small_kernel[(1,)](*args, **consts, num_warps=SMALL_NUM_WARPS)
        return routing
    r, ids, tickets = _routing_buffers(topk_ids, num_experts, block_m, tickets)
    device, E, num_pairs, fill = ids.device, num_experts, r.num_pairs, r.max_padded + 1

    counts = torch.zeros(E, dtype=torch.int32, device=device)
    rank = torch.empty(max(num_pairs, 1), dtype=torch.int32, device=device)
    padded_start = torch.empty(E, dtype=torch.int32, device=device)
    block = 256
    rk.count_and_rank_kernel[(-(-max(num_pairs, fill, tickets.numel()) // block),)](
        ids, counts, rank, r.sorted_pair_ids, tickets, num_pairs, E, fill, tickets.numel(), BLOCK=block
    )
    e_pow2 = _next_pow2(max(E, 2))
    rk.block_offsets_kernel[(1,)](
        counts, padded_start, r.block_expert_ids, r.num_padded, E, r.max_blocks,
        BLOCK_M=block_m, E_POW2=e_pow2, BLOCKS_PER_STEP=max(1, min(64, 16384 // e_pow2)),
        num_warps=4,
    )
    rk.scatter_pairs_kernel[(-(-num_pairs // block),)](
        ids, rank, padded_start, r.sorted_pair_ids, num_pairs, E, BLOCK=block
    )
    return r


SMALL_NUM_WARPS = 8  # warps of the one-program alignment (its sort and histogram)


def _routing_buffers(topk_ids: torch.Tensor, num_experts: int, block_m: int, tickets: torch.Tensor | None):
    """(AlignedRouting with uninitialised buffers, contiguous ids, checked tickets)."""
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    max_blocks = max_padded_blocks(num_pairs, num_experts, block_m)
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()
    if tickets is None:
        tickets = torch.empty(0, dtype=torch.int32, device=device)
    elif tickets.dtype != torch.int32 or not tickets.is_contiguous() or tickets.device != device:
        raise ValueError(f"tickets: expected a contiguous int32 tensor on {device}, got {tickets.dtype} on {tickets.device}")
    routing = AlignedRouting(
        torch.empty(max_blocks * block_m + 1, dtype=torch.int32, device=device),
        torch.empty(max_blocks, dtype=torch.int32, device=device),
        torch.empty(1, dtype=torch.int32, device=device),
        num_pairs, block_m, max_blocks,
    )
    return routing, ids, tickets


def small_routing_launch(topk_ids: torch.Tensor, num_experts: int, block_m: int,
                         tickets: torch.Tensor | None = None) -> tuple[AlignedRouting, tuple, dict] | None:
    """The one-program alignment's buffers and launch arguments, or None where the call is too
    large for it (> routing_kernels.SMALL_MAX_PAIRS pairs, or E >= SMALL_MAX_BINS). Returns
    (routing, positional args, constexpr kwargs) of routing_kernels.align_small, for
    align_small_kernel or a kernel that runs align_small in its program 0 (one launch less)."""
    from . import routing_kernels as rk

    num_pairs = topk_ids.numel()
    if not rk.small_routing(num_pairs, num_experts):
        return None
    routing, ids, tickets = _routing_buffers(topk_ids, num_experts, block_m, tickets)
    bins = max(16, _next_pow2(num_experts + 1))
    shift = torch.empty(bins, dtype=torch.int32, device=ids.device)
    args = (ids, routing.sorted_pair_ids, routing.block_expert_ids, routing.num_padded, shift, tickets,
            num_pairs, num_experts, routing.max_padded + 1, routing.max_blocks, tickets.numel())
    consts = dict(BLOCK_M=block_m, P=max(16, _next_pow2(num_pairs)), E_BINS=bins, FILL=1024)
    return routing, args, consts


def _next_pow2(n: int) -> int:
    return 1 << max(int(n) - 1, 0).bit_length()


def align_routing_reference(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> list[tuple[int, list[int]]]:
    """Independent host-side version for tests: [(expert, pair ids of one block incl. padding)]."""
    ids = topk_ids.reshape(-1).tolist()
    n = len(ids)
    blocks = []
    for e in range(num_experts):
        pairs = [p for p, i in enumerate(ids) if i == e]
        for s in range(0, len(pairs), block_m):
            chunk = pairs[s : s + block_m]
            blocks.append((e, chunk + [n] * (block_m - len(chunk))))
    return blocks
