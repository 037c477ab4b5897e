"""SGLang's marlin MoE (NVFP4, H200) under the project's static performance model.

What SGLang 0.5.23 runs for one ``fused_marlin_moe`` call (fused_marlin_moe.py), mapped onto
``k3nvfp4.kernels.perf_model.predict_kernel``:

- alignment: ``moe_align_single_token`` at M = 1 without an expert map (1 kernel), else
  ``moe_align_block_size`` (2 kernels); a ``torch.zeros`` of the lock workspace (1);
- GEMM1 (gate/up), the activation (1 kernel), GEMM2 (down, x routing weight, zeroing inactive
  rows), the top-k sum ``moe_sum_reduce`` (1 kernel): 7 launches (6 at M = 1 on TP).

Each GEMM is ``Marlin<...>`` (marlin_template.h): a persistent grid of SMs x blocks-per-SM
(``determine_exec_config``, replayed on the compiled registers: marlin_sass.select). The work,
k_tiles x n_tiles x parallel tiles (parallel = the expert blocks of moe_block_size tokens), is cut
into equal runs of ``iters`` = ceil(work / grid) K tiles per CTA. A column slice spread over
several CTAs is reduced serially in global memory (barrier_acquire / barrier_release on a lock,
fp32 partials): its ``slice_count - 1`` steps are dependent round trips, two each (wait on the
lock, read-modify-write the partial). The hot loop's figures come from the SASS of the same
instantiations (marlin_sass); bytes are the NVFP4 nibbles and E4M3 scales (0.5625 per weight).

What is not modelled: the activation and top-k-sum kernels are charged their bytes at the copy
bandwidth plus latency; moe_block sizes 16-48 (thread_m_blocks 1-3) reuse the measured
moe_block-64 instantiation of the same tile (their loops differ by the MMAs per K step).
"""

from __future__ import annotations

import math
from typing import Any

from k3nvfp4.kernels import perf_model as pm

from .marlin_sass import CallSite, Flags, Statics, Tile, candidates, moe_block_size, select

MARLIN_BYTES_PER_WEIGHT = 0.5 + 1 / 16  # E2M1 nibble + E4M3 scale per 16 weights

# Published whole-call timings of marlin on an H200, Kimi-K3 TP16 shard (SGLang 0.5.14, SiLU in
# place of SiTU, balanced routing; ai-dynamo aiconfigurator data; docs/facts.md#published-peer-timings):
# M -> (low, high) us.
PUBLISHED_TP16_US = {1: (75, 75), 4: (106, 106), 16: (233, 233), 64: (640, 675), 256: (640, 675), 1024: (1194, 1194)}


def _registers_for(statics: Statics, tile: Tile, flags: Flags) -> tuple[int, Tile]:
    """Registers of an instantiation, and the compiled tile they come from: the tile itself, else
    the compiled one with the same N/K/threads and flags (nearest thread_m_blocks)."""
    regs = statics.registers
    if (tile, flags) in regs:
        return regs[(tile, flags)], tile
    same = [t for (t, f) in regs if f == flags and (t.thread_n_blocks, t.thread_k_blocks, t.threads, t.m_block_size_8)
            == (tile.thread_n_blocks, tile.thread_k_blocks, tile.threads, tile.m_block_size_8)]
    if not same:
        raise RuntimeError(f"no compiled marlin instantiation close to {tile.label} {flags.label}")
    near = min(same, key=lambda t: abs(t.thread_m_blocks - tile.thread_m_blocks))
    return regs[(near, flags)], near


class _Registers(dict):
    """select() asks for registers of every candidate; answer with the nearest compiled one."""

    def __init__(self, statics: Statics):
        super().__init__()
        self.statics = statics

    def __missing__(self, key):
        return _registers_for(self.statics, *key)[0]


def _gemm(device: pm.Device, statics: Statics, shard: pm.Shard, M: int, gemm: str, bs: int,
          routing: pm.RoutingEstimate, a: pm.Assumptions) -> pm.KernelPrediction:
    ep = shard.local_experts != shard.global_experts
    H, I, k = shard.hidden, shard.intermediate, shard.top_k
    first = gemm == "gemm1"
    prob_m, prob_n, prob_k, top_k = (M, 2 * I, H, k) if first else (M * k, H, I, 1)
    flags = Flags(is_ep=ep, has_bias=False, expert_ids_are_sorted=not ep, zero_inactive_output=not first,
                  has_inactive_prefix_count=not ep)
    site = CallSite(shard.name, gemm, f"moe_block {bs}", bs, prob_m, prob_n, prob_k, top_k, flags)
    if not candidates(statics.src, site):
        raise RuntimeError(f"no NVFP4 marlin tile divides N={prob_n}, K={prob_k} (SGLang cannot run this shard)")
    tile, blocks_per_sm, _ = select(statics.src, site, _Registers(statics))
    regs, measured_tile = _registers_for(statics, tile, flags)
    m = statics.measure(measured_tile, flags)
    usage = statics.funcs[(measured_tile, flags)]["usage"]
    size = next(s for t, s in candidates(statics.src, site) if t == tile)
    stages = statics.src.pipe_stages
    thread_n, thread_k = 16 * tile.thread_n_blocks, 16 * tile.thread_k_blocks
    k_tiles, n_tiles = prob_k // thread_k, prob_n // thread_n
    parallel = routing.blocks
    work = k_tiles * n_tiles * parallel
    grid = device.sms * blocks_per_sm
    iters = math.ceil(work / grid)
    active = math.ceil(work / iters)
    slice_count = math.ceil(k_tiles / iters) + (1 if k_tiles % iters and iters < k_tiles else 0)
    trips = 2 * (slice_count - 1)
    cost = pm.LoopCost(m["stats"].instructions / stages, tile.threads // 32, regs, size, usage.local_bytes)
    useful = routing.active_experts * prob_n * prob_k
    tokens = routing.local_pairs
    other = (M * H * 2 + tokens * 2 * I * 2) if first else (tokens * I * 2 + tokens * H * 2)
    stores = tokens * 2 * I * 2 if first else tokens * H * 2
    pred = pm.predict_kernel(
        device, name=f"marlin {gemm}", config=f"{tile.label} x{blocks_per_sm}/SM", cost=cost,
        programs_launched=grid, programs_active=active, iterations_per_program=iters, iterations_total=work,
        weights_per_iteration=thread_n * thread_k, useful_weights=useful, useful_passes=parallel * prob_n * prob_k,
        weight_bytes=useful * MARLIN_BYTES_PER_WEIGHT, other_bytes=other, store_bytes=stores,
        stage_bytes=thread_n * thread_k * MARLIN_BYTES_PER_WEIGHT, stages=stages,
        mma_flops=2.0 * work * thread_n * thread_k * max(16 * tile.thread_m_blocks, 8), dependent_round_trips=trips,
        assumptions=a,
    )
    if measured_tile != tile:
        pred.notes.append(f"loop of {measured_tile.label} (nearest compiled) for {tile.label}")
    pred.notes.append(f"grid {grid}, {iters} K tiles per CTA, serial reduction over {slice_count} CTAs per slice")
    return pred


def marlin_call(device: pm.Device, statics: Statics, shard: pm.Shard, M: int,
                a: pm.Assumptions = pm.DEFAULT_ASSUMPTIONS) -> pm.CallPrediction:
    """One fused_marlin_moe call (NVFP4 weights, bf16 activations) under the model. Raises
    RuntimeError when SGLang's marlin cannot run the shard."""
    # SGLang's block size loop divides by the LOCAL experts (w1.shape[0]): EP-blind, as it runs.
    bs = moe_block_size(M, shard.top_k, shard.local_experts)
    routing = pm.expected_routing(shard, M, bs)
    kernels = [_gemm(device, statics, shard, M, g, bs, routing, a) for g in ("gemm1", "gemm2")]
    ep = shard.local_experts != shard.global_experts
    align = 1 if (M == 1 and not ep) else 2
    pairs = routing.local_pairs
    elementwise_bytes = (pairs * 2 * shard.intermediate * 2 + pairs * shard.intermediate * 2  # activation
                         + M * shard.top_k * shard.hidden * 2 + M * shard.hidden * 2)  # top-k sum
    launches = align + 1 + 2  # alignment, workspace zeros, activation, top-k sum
    fixed = (launches * a.launch_s + (align + 3) * a.hbm_latency_s
             + elementwise_bytes / device.hbm_copy_bytes_per_s)
    return pm.CallPrediction("marlin", device.name, shard.name, M, kernels, routing, fixed, launches,
                             notes=[f"moe_block_size {bs}"])


def validation(statics: Statics, a: pm.Assumptions = pm.DEFAULT_ASSUMPTIONS) -> list[dict[str, Any]]:
    """The model's marlin TP16 times next to the published H200 timings: error per point."""
    out = []
    for M, (lo, hi) in PUBLISHED_TP16_US.items():
        pred = marlin_call(pm.H200, statics, pm.K3_SHARDS["tp16"], M, a)
        us = pred.time_s * 1e6
        published = (lo + hi) / 2
        out.append({"M": M, "published_us": [lo, hi], "model_us": round(us, 1),
                    "ratio_model_over_published": round(us / published, 3),
                    "within_1_5x": 1 / 1.5 <= us / published <= 1.5,
                    "bound": {k.name: k.bound for k in pred.kernels}})
    return out
