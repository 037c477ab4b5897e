"""The last-arrival sums of both kernel families against a weak-memory adversary in Triton's
interpreter (tests/weak_memory.py): global stores become visible to other programs late, as a
GPU may make them. Today's kernels give the same bits as a plain interpreter run; the source
mutants of the skeleton (tests/skeleton_mutants.py: a store moved past the arrival, the barrier
removed, the atomic relaxed or CTA-scoped) give the same bits as today's kernels in a plain
interpreter run, and wrong outputs under the adversary, and the test names the sum that broke.

The calls: W4A16 (fused_moe_nvfp4) and the FP4 nvfp4 mode (fused_moe_fp4), each with GEMM1
split over K (2 slices) and GEMM2's top-k sum (2 K slices x top-k 2 rows), W4A16's atomic
top-k sum, and W4A16 without split-K in GEMM1 (the top-k sum alone), and the Hopper W4A8 mode
(e4m3, fused_moe_w4a8) with both GEMMs split over K; small shapes (the interpreter runs one program after another).
"""

from __future__ import annotations

import pytest
import torch

import skeleton_mutants
from weak_memory import MODES, first_difference, launch_log, weak_memory

pytestmark = [pytest.mark.skipif(torch.cuda.is_available(), reason="the adversary drives Triton's interpreter"),
              pytest.mark.filterwarnings("ignore:All-NaN slice:RuntimeWarning")]  # a mutant's poisoned reads

E, K, M, H, I = 4, 2, 3, 64, 64


def _w4a16_call(atomic: bool, split_k1: int = 2):
    from k3nvfp4.kernels.moe import fused_moe_nvfp4
    from k3nvfp4.kernels.moe_details.config import MoEConfig
    from k3nvfp4.kernels.testing import random_nvfp4_moe_weights, random_routing

    w = random_nvfp4_moe_weights(E, H, I, seed=1)
    tw, ids = random_routing(M, K, E, seed=1)
    x = torch.randn(M, H, generator=torch.Generator().manual_seed(1))
    cfg = (MoEConfig(block_m=16, block_n1=32, block_k1=32, split_k1=2, block_n2=64, block_k2=32, atomic_reduce=True)
           if atomic else
           MoEConfig(block_m=16, block_n1=32, block_k1=32, split_k1=split_k1, block_n2=64, block_k2=32, split_k2=2))
    return lambda: fused_moe_nvfp4(x, w, tw, ids, config=cfg)


def _fp4_call():
    from k3nvfp4.kernels.moe_fp4 import FP4MMAWeights, FP4MoEConfig, fused_moe_fp4
    from k3nvfp4.kernels.testing import random_mxfp4_tensors, random_routing

    H4 = I4 = 128  # the FP4 MMAs take K steps of 64: two per GEMM, one per slice
    w = FP4MMAWeights.from_mxfp4(*random_mxfp4_tensors(E, H4, I4, seed=2), act_quant="nvfp4")
    tw, ids = random_routing(M, K, E, seed=2)
    x = torch.randn(M, H4, generator=torch.Generator().manual_seed(2))
    cfg = FP4MoEConfig(block_m=16, swap_ab=True, block_n1=64, block_n2=128, block_k1=64, block_k2=64, split_k1=2,
                       split_k2=2)
    return lambda: fused_moe_fp4(x, w, tw, ids, config=cfg)


def _e4m3_call():
    from k3nvfp4.kernels.moe_w4a8 import W4A8Config, W4A8MoEWeights, fused_moe_w4a8
    from k3nvfp4.kernels.testing import random_mxfp4_tensors, random_routing

    H8 = I8 = 128  # K steps of 64: two per GEMM, one per slice
    w = W4A8MoEWeights.from_mxfp4(*random_mxfp4_tensors(E, H8, I8, seed=5))
    tw, ids = random_routing(M, K, E, seed=5)
    x = torch.randn(M, H8, generator=torch.Generator().manual_seed(5))
    cfg = W4A8Config(block_m=16, block_n1=128, block_n2=64, block_k1=64, block_k2=64, split_k1=2, split_k2=2)
    return lambda: fused_moe_w4a8(x, w, tw, ids, config=cfg)


CALLS = {"w4a16": lambda: _w4a16_call(False), "w4a16 atomic": lambda: _w4a16_call(True), "nvfp4": _fp4_call,
         "e4m3": _e4m3_call,
         # GEMM1 not split: the top-k sum is the first (and only) last-arrival sum of the call
         "w4a16 top-k only": lambda: _w4a16_call(False, split_k1=1)}


def _run(call, mode: str | None):
    with launch_log() as log:
        if mode is None:
            call()
        else:
            with weak_memory(mode, seed=3):
                call()
    return log


@pytest.fixture(scope="module")
def plain() -> dict:
    """Each call's launches in a plain interpreter run, today's kernels."""
    calls = {name: make() for name, make in CALLS.items()}
    return {name: (call, _run(call, None)) for name, call in calls.items()}


@pytest.mark.parametrize("family", sorted(CALLS))
@pytest.mark.parametrize("mode", MODES)
def test_todays_kernels_give_the_plain_bits_under_the_adversary(plain, family, mode):
    call, expected = plain[family]
    with launch_log() as log:
        with weak_memory(mode, seed=3) as adv:
            call()
    assert first_difference(expected, log) is None
    assert adv.stats["buffered"] > 0  # the adversary saw the writes (not a silent no-op)


# (mutant, call, the modes that must break it, the sum named). The moved stores break under
# both models; the arrival's own defects only where unreleased writes stay buffered.
CASES = [
    ("up_after_arrive", "w4a16", MODES, "GEMM1's split-K sum"),
    ("up_after_arrive", "nvfp4", MODES, "GEMM1's split-K sum"),
    ("topk_after_arrive", "w4a16", MODES, "GEMM2's top-k sum"),
    ("topk_after_arrive", "w4a16 atomic", MODES, "GEMM2's top-k sum"),
    ("topk_after_arrive", "nvfp4", MODES, "GEMM2's top-k sum"),
    ("up_after_arrive", "e4m3", MODES, "GEMM1's split-K sum"),
    ("topk_after_arrive", "e4m3", MODES, "GEMM2's top-k sum"),
    ("no_barrier", "e4m3", ("unreleased",), "GEMM1's split-K sum"),
    ("no_barrier", "w4a16", ("unreleased",), "GEMM1's split-K sum"),
    ("no_barrier", "nvfp4", ("unreleased",), "GEMM1's split-K sum"),
    ("relaxed", "w4a16", ("unreleased",), "GEMM1's split-K sum"),
    ("relaxed", "nvfp4", ("unreleased",), "GEMM1's split-K sum"),
    ("cta_scope", "w4a16", ("unreleased",), "GEMM1's split-K sum"),
    ("cta_scope", "nvfp4", ("unreleased",), "GEMM1's split-K sum"),
    ("no_barrier", "w4a16 top-k only", ("unreleased",), "GEMM2's top-k sum"),
    ("relaxed", "w4a16 top-k only", ("unreleased",), "GEMM2's top-k sum"),
    ("cta_scope", "w4a16 top-k only", ("unreleased",), "GEMM2's top-k sum"),
]


@pytest.mark.parametrize("mutant,family,modes,sum_name", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_mutant_breaks_its_sum_under_the_adversary(plain, mutant, family, modes, sum_name):
    call, expected = plain[family]
    with skeleton_mutants.installed(mutant):
        if mutant == "up_after_arrive":  # the plain interpreter cannot see the race
            assert first_difference(expected, _run(call, None)) is None
        for mode in modes:
            diff = first_difference(expected, _run(call, mode))
            assert diff is not None, f"{mutant} under {mode}: the same bits as today's kernels"
            assert sum_name in diff, diff
            print(f"{mutant} {family} {mode}: {diff}")


def test_arrival_without_its_release_passes_the_weaker_model(plain):
    """The "after_release" model only delays writes issued after a release, so a relaxed atomic
    (no release at all) passes it: the "unreleased" model is the one that proves the release."""
    call, expected = plain["w4a16"]
    with skeleton_mutants.installed("relaxed"):
        assert first_difference(expected, _run(call, "after_release")) is None
