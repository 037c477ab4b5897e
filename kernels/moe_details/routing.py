"""Routing alignment: group (token, slot) pairs by expert and pad each expert to block_m.

No host synchronisation and no data-dependent allocation (every buffer is sized by the worst
case), so it can be captured in a CUDA graph. No sgl_kernel. Two implementations with one
contract: align_routing_triton (3 Triton kernels + a memset; what fused_moe_nvfp4 uses) and
align_routing (plain torch, ~35 small ops; token order within an expert; a second reference
for the tests next to the host loop align_routing_reference).

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


def align_routing_triton(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> AlignedRouting:
    """Same as :func:`align_routing` in 3 Triton kernels + 1 memset (the decode path: launches
    dominate there). Within an expert, pairs are in atomic arrival order (see routing_kernels)."""
    from . import routing_kernels as rk

    device = topk_ids.device
    num_pairs = topk_ids.numel()
    E = num_experts
    max_blocks = max_padded_blocks(num_pairs, E, block_m)
    max_padded = max_blocks * block_m
    ids = topk_ids if topk_ids.is_contiguous() else topk_ids.contiguous()

    counts = torch.zeros(E, dtype=torch.int32, device=device)
    rank = torch.empty(max(num_pairs, 1), dtype=torch.int32, device=device)
    sorted_pair_ids = torch.empty(max_padded + 1, dtype=torch.int32, device=device)
    padded_start = torch.empty(E, dtype=torch.int32, device=device)
    block_expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_padded = torch.empty(1, dtype=torch.int32, device=device)

    block = 256
    fill = max_padded + 1
    rk.count_and_rank_kernel[(-(-max(num_pairs, fill) // block),)](
        ids, counts, rank, sorted_pair_ids, num_pairs, E, fill, BLOCK=block
    )
    e_pow2 = 1 << max(E - 1, 1).bit_length()
    rk.block_offsets_kernel[(1,)](
        counts, padded_start, block_expert_ids, num_padded, E, max_blocks,
        BLOCK_M=block_m, E_POW2=e_pow2, BLOCKS_PER_STEP=max(1, min(64, 16384 // e_pow2)),
        num_warps=4,
    )
    if num_pairs:
        rk.scatter_pairs_kernel[(-(-num_pairs // block),)](
            ids, rank, padded_start, sorted_pair_ids, num_pairs, E, BLOCK=block
        )
    return AlignedRouting(sorted_pair_ids, block_expert_ids, num_padded, num_pairs, block_m, max_blocks)


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
