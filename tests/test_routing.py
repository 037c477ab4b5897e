"""Routing alignment (sort pairs by expert, pad to block_m) against a host-side loop."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from k3nvfp4.kernels.moe_details.routing import (
    align_routing,
    align_routing_reference,
    align_routing_triton,
    max_padded_blocks,
)
from k3nvfp4.kernels.moe_details.routing_kernels import SMALL_MAX_PAIRS

IMPLS = [align_routing, align_routing_triton]

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _blocks(r, E, canonical=False):
    """Used blocks of an AlignedRouting as [(expert, pair ids)], read back on the host."""
    n = int(r.num_padded[0])
    assert n % r.block_m == 0
    ids = r.sorted_pair_ids.cpu().tolist()
    experts = r.block_expert_ids.cpu().tolist()
    if canonical:  # order within an expert is not part of the contract of the Triton version
        rows = []
        for b in range(n // r.block_m):
            rows.append((experts[b], ids[b * r.block_m : (b + 1) * r.block_m]))
        by_expert = {}
        for e, chunk in rows:
            by_expert.setdefault(e, []).extend(chunk)
        ids = []
        for e in sorted(by_expert):
            ids.extend(sorted(by_expert[e]))
    out = [(experts[b], ids[b * r.block_m : (b + 1) * r.block_m]) for b in range(n // r.block_m)]
    # unused blocks are marked with expert E, and padding holds num_pairs
    assert all(e == E for e in experts[n // r.block_m :])
    assert all(i == r.num_pairs for i in ids[n : r.max_padded])
    return out


@pytest.mark.parametrize("impl", IMPLS)
def test_hand_case(impl):
    # token 0 -> experts (2, 0), token 1 -> (2, -1), token 2 -> (2, 2): pairs 0..5
    ids = torch.tensor([[2, 0], [2, -1], [2, 2]], dtype=torch.int32, device=DEV)
    r = impl(ids, num_experts=4, block_m=2)
    assert _blocks(r, 4, canonical=True) == [(0, [1, 6]), (2, [0, 2]), (2, [4, 5])]
    assert int(r.num_padded[0]) == 6
    assert r.max_blocks == max_padded_blocks(6, 4, 2) == 5  # (6 pairs + 4 experts * 1) / 2
    assert r.sorted_pair_ids.shape == (r.max_padded + 1,)


@pytest.mark.parametrize("impl", IMPLS)
@given(
    E=st.integers(1, 40),
    k=st.integers(1, 8),
    M=st.integers(0, 70),
    block_m=st.sampled_from([16, 32, 64]),
    drop=st.floats(0, 0.7),
    seed=st.integers(0, 1000),
)
def test_matches_host_loop(impl, E, k, M, block_m, drop, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, E, (M, k), generator=g)
    ids = torch.where(torch.rand(M, k, generator=g) < drop, torch.full_like(ids, -1), ids).to(DEV)
    r = impl(ids, E, block_m)
    assert _blocks(r, E, canonical=True) == align_routing_reference(ids.cpu(), E, block_m)
    assert r.max_blocks >= int(r.num_padded[0]) // block_m


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_worst_case_fits(impl, dtype):
    # every pair on its own expert: the worst padding
    E, block_m = 16, 16
    ids = torch.arange(E, dtype=dtype, device=DEV).reshape(4, 4)
    r = impl(ids, E, block_m)
    assert int(r.num_padded[0]) == E * block_m == r.max_padded
    assert r.block_expert_ids.tolist() == list(range(E))


@pytest.mark.parametrize("M,k,E", [(70, 8, 40), (300, 4, 40), (1, 16, 896), (64, 16, 896)])
def test_triton_paths_and_counter_zeroing(M, k, E):
    """Both Triton paths (one program up to SMALL_MAX_PAIRS pairs, 3 kernels above) against the
    host loop; the one-program path keeps token order within an expert (== align_routing exactly);
    both zero the arrival counters they are given."""
    g = torch.Generator().manual_seed(M)
    ids = torch.randint(0, E, (M, k), generator=g)
    ids = torch.where(torch.rand(M, k, generator=g) < 0.3, torch.full_like(ids, -1), ids).to(DEV)
    tickets = torch.full((1000,), 7, dtype=torch.int32, device=DEV)
    r = align_routing_triton(ids, E, 16, tickets)
    assert _blocks(r, E, canonical=True) == align_routing_reference(ids.cpu(), E, 16)
    assert torch.equal(tickets, torch.zeros_like(tickets))
    if M * k <= SMALL_MAX_PAIRS:
        t = align_routing(ids, E, 16)
        assert _blocks(r, E) == _blocks(t, E)  # same rows, same order
        assert torch.equal(r.sorted_pair_ids[: r.max_padded], t.sorted_pair_ids[: t.max_padded])


def test_ids_beyond_int32_are_dropped_not_wrapped():
    """int64 ids are compared before any narrowing: 2^32 + 1 is not expert 1."""
    ids = torch.tensor([[2**32 + 1, 1], [-(2**32) + 1, 0]], dtype=torch.int64, device=DEV)
    for impl in IMPLS:
        r = impl(ids, 4, 16)
        assert _blocks(r, 4, canonical=True) == align_routing_reference(ids.cpu(), 4, 16) == [
            (0, [3] + [4] * 15), (1, [1] + [4] * 15)]
