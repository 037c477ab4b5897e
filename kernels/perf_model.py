"""The generic static device model: launchability, occupancy, waves, bytes, instructions and a
predicted time of a weight-streaming kernel, without a GPU. Each kernel family's call model
(moe_details/call_model.py for W4A16, moe_fp4_details/call_model.py for the FP4 tensor-core
modes) maps its launches onto :func:`predict_kernel`; this module imports nothing of the project
(tests/test_imports.py), so the families' heuristics can read it without a loop.

A weight-streaming kernel needs per weight at least max(bytes / HBM bandwidth, warp-instructions /
issue rate); at decode it also pays for a grid too small to keep enough bytes in flight, for waves,
for dependent round trips in its epilogue and for launches. This module puts those terms in one
place, for this project's kernels and for its peers (SGLang's marlin MoE, FlashInfer's SM90 W4A16
MoE: ``bench/peers/`` maps them onto :func:`predict_kernel`).

Inputs are static: a kernel's hot-loop instruction count, registers and shared memory (from an
offline compile, ``k3nvfp4.kernels.offline.sass``), the launch config, the shard and M. Routing is assumed
uniform: each local expert receives Binomial(M, top_k / E_global) tokens, so under expert
parallelism only ~E_local / E_global of the (token, slot) pairs are local.

Definitions:
- useful weight: a weight element of an expert matrix that at least one local token needs, counted
  once per call. Rows past a matrix (tile padding), K past its end, and a second block of the same
  expert re-reading its weights are processed, not useful.
- bytes per useful weight: bytes the kernel streams from HBM for weights, per useful weight (the
  layout's nibbles and block scales, K padding included).
- useful weight pass: a useful weight processed for one block of tokens (a GEMM processes each
  weight once per token block of its expert; padding rows and K tails are not useful).
- warp-instructions per useful weight: hot-loop instructions of all programs over useful weight
  passes (the loop's efficiency; at M = 1 passes and useful weights coincide).

Every assumption is a field of :class:`Assumptions`; devices are :class:`Device` records with their
sources.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

__all__ = [
    "Assumptions", "B200", "CallPrediction", "DEFAULT_ASSUMPTIONS", "DEVICES", "Device", "H200", "K3_SHARDS",
    "KernelPrediction", "LoopCost", "RoutingEstimate", "Shard", "expected_routing", "loop_budget", "occupancy",
    "predict_kernel",
]


# ---------------------------------------------------------------------------------------------- devices


@dataclass(frozen=True)
class Device:
    """What the model needs of a GPU. Limits are per thread block / per SM as CUDA reports them."""

    name: str
    arch: int  # compute capability x 10
    sms: int
    clock_hz: float  # boost clock the issue rate is computed at
    hbm_bytes_per_s: float  # spec
    hbm_copy_bytes_per_s: float  # a device-to-device copy measures about this (the achievable stream)
    mma_bf16_flops: float  # dense bf16 tensor-core peak
    mma_fp8_flops: float = 0.0  # dense FP8 (E4M3 x E4M3) tensor-core peak; 0: no FP8 MMA
    shared_per_block: int = 232448  # 227 KiB opt-in
    shared_per_sm: int = 233472  # 228 KiB
    registers_per_sm: int = 65536
    max_registers_per_thread: int = 255
    max_threads_per_sm: int = 2048
    max_ctas_per_sm: int = 32
    schedulers_per_sm: int = 4  # one warp-instruction per scheduler per clock

    @property
    def issue_rate(self) -> float:
        """Warp-instructions per second, the whole GPU."""
        return self.sms * self.schedulers_per_sm * self.clock_hz

    @property
    def sm_tag(self) -> str:
        return f"sm_{self.arch}"


# H200 SXM: 132 SMs, 1.98 GHz boost, 4.8 TB/s HBM3e, 989 TFLOP/s dense bf16 and 1979 TFLOP/s dense FP8
# (NVIDIA H200 datasheet, the same tensor cores as the H100 SXM's; docs/facts.md#hardware);
# ~4.3 TB/s measured device copy (docs/facts.md#hardware, the project's H200); 227 KiB shared per block, 228 KiB per
# SM, 64K registers and 2048 threads per SM (CUDA programming guide, compute capability 9.0).
H200 = Device("H200", 90, 132, 1.98e9, 4.8e12, 4.3e12, 989e12, 1979e12)
# B200: 148 SMs, ~1.9 GHz, 8 TB/s HBM3e, 2.25 PFLOP/s dense bf16, 4.5 PFLOP/s dense FP8 (NVIDIA DGX B200 datasheet,
# per GPU);
# copy bandwidth not measured by this project: 0.9 x spec, the H200's measured ratio; limits of
# compute capability 10.0 (CUDA programming guide: same shared memory and register file as 9.0).
B200 = Device("B200", 100, 148, 1.9e9, 8.0e12, 7.2e12, 2.25e15, 4.5e15)
DEVICES = {"H200": H200, "B200": B200}


@dataclass(frozen=True)
class Assumptions:
    """Every modelling assumption, in one place (times in seconds).

    - hbm_latency_s: loaded HBM latency. Little's law: a kernel streams at most
      (bytes in flight) / latency, so at decode a small grid cannot reach the copy bandwidth.
      Not measured by this project (H100-class microbenchmarks report 500-800 ns under load).
    - l2_round_trip_s: one dependent L2 round trip (an acq_rel atomic, then .cg loads of what
      other programs stored); the epilogues' arrival counters and marlin's serial K reduction
      pay it per step.
    - launch_s: one kernel of a CUDA-graph replay, launch and the dependent kernel's start.
    - fill: the first HBM latency of a kernel is exposed once (later programs overlap theirs with
      co-resident programs' streaming); so is the epilogue's chain of dependent round trips.
    - weights_once: each active expert's weights come from HBM once per call; a second block of
      the same expert, and rows re-read to fill a tile, hit L2 (issue cost counted, bytes not).
    - activations: x, the intermediate, split-K partials and the top-k buffer are counted as HBM
      traffic once each way (an upper bound: some of it stays in the 50-126 MB L2).
    - mma_efficiency: fraction of the dense tensor-core peak an MMA-bound loop reaches.
    - stores_in_flight: whether a kernel's stores and fp32 reductions (its ``store_bytes``: the
      intermediate, split-K partials, the top-k sum's rows or atomics, the output) count against
      the in-flight limit like its loads (True, every figure of the report: the conservative
      reading) or only against the copy bandwidth (False: the SM posts them without waiting on
      them). Not measured by this project; it decides GEMM2 at TP prefill, where the top-k sum is
      most of the bytes (bench/inflight_sensitivity.py puts the targets under both).
    """

    hbm_latency_s: float = 700e-9
    l2_round_trip_s: float = 600e-9
    launch_s: float = 2.0e-6
    mma_efficiency: float = 0.7
    # The routing kernel of a call (one program up to 1024 pairs; histogram, scan, sort, scatter).
    routing_small_s: float = 3.0e-6
    routing_large_s: float = 8.0e-6  # 3 kernels + a memset above 1024 pairs (launches added apart)
    stores_in_flight: bool = True


DEFAULT_ASSUMPTIONS = Assumptions()


def loop_budget(M: int) -> float:
    """Target warp-instructions per useful weight pass of a GEMM's hot loop at M tokens: 0.09 up
    to M = 1024 (the 1-byte-scale layout streams 0.5625 B per NVFP4 weight; at 0.09 the H200
    issues a weight in 0.086 ps against HBM's 0.117, room for what the loop does not show), 0.11
    above (prefill is MMA-bound; the loop only has to stay out of the way). Shipped configs that
    miss it are listed with their reason in bench/sass_report.py's KNOWN_MISSES."""
    return 0.09 if M <= 1024 else 0.11


# ---------------------------------------------------------------------------------------------- shards


@dataclass(frozen=True)
class Shard:
    """One rank's routed experts: E_local of E_global experts, hidden H, intermediate I per rank."""

    name: str
    local_experts: int
    global_experts: int
    hidden: int
    intermediate: int
    top_k: int

    @property
    def route_probability(self) -> float:
        """Probability that a token routes to a given expert (top_k distinct of E_global)."""
        return min(1.0, self.top_k / self.global_experts)


def _k3(name: str, tp: int = 1, ep: int = 1) -> Shard:
    # Kimi-K3 routed experts (docs/facts.md#kimi-k3-routed-experts): 896 experts, H = 3584, I = 3072, top-16.
    return Shard(name, 896 // ep, 896, 3584, 3072 // tp, 16)


K3_SHARDS: dict[str, Shard] = {s.name: s for s in (
    _k3("tp8", tp=8), _k3("tp16", tp=16), _k3("tp32", tp=32), _k3("ep8", ep=8), _k3("ep16", ep=16), _k3("ep32", ep=32),
)}


@dataclass(frozen=True)
class RoutingEstimate:
    """Expected routing of M tokens on one shard (uniform routing)."""

    tokens: int
    local_pairs: float  # (token, slot) pairs routed to local experts
    active_experts: float  # local experts with at least one pair
    blocks: float  # sum over local experts of ceil(pairs / block_m)
    block_m: int


def _binomial_ceil_moments(n: int, p: float, block_m: int) -> tuple[float, float]:
    """(P(X > 0), E[ceil(X / block_m)]) for X ~ Binomial(n, p), summed in log space near the mean."""
    if p >= 1.0:
        return (1.0 if n > 0 else 0.0), float(-(-n // block_m))
    if p <= 0.0 or n == 0:
        return 0.0, 0.0
    mean, sd = n * p, math.sqrt(n * p * (1 - p))
    hi = min(n, int(mean + 12 * sd + 16))
    log_ratio = math.log(p / (1 - p))
    lp = n * math.log1p(-p)  # log P(X = 0)
    p0 = math.exp(lp)
    e_blocks = 0.0
    for x in range(1, hi + 1):
        lp += math.log((n - x + 1) / x) + log_ratio
        e_blocks += math.exp(lp) * (-(-x // block_m))
    return 1.0 - p0, e_blocks


def expected_routing(shard: Shard, M: int, block_m: int) -> RoutingEstimate:
    """Expected local pairs, active local experts and block_m-row blocks of M tokens."""
    p_active, e_blocks = _binomial_ceil_moments(M, shard.route_probability, block_m)
    return RoutingEstimate(M, M * shard.top_k * shard.local_experts / shard.global_experts,
                           shard.local_experts * p_active, shard.local_experts * e_blocks, block_m)


# ---------------------------------------------------------------------------------------------- kernels


@dataclass(frozen=True)
class LoopCost:
    """Static figures of one compiled kernel (offline compile + SASS; see k3nvfp4.kernels.offline.sass)."""

    instructions_per_iteration: int  # hot K loop, per warp
    num_warps: int
    registers: int  # per thread
    shared_bytes: int  # per block, static + dynamic
    local_bytes: int = 0  # per thread: spills


def occupancy(device: Device, registers: int, threads: int, shared_bytes: int) -> tuple[int, str]:
    """(CTAs per SM, what limits it); 0 when a block cannot launch at all (the reason says why).
    Registers are allocated per warp in units of 256 (8 per thread)."""
    if shared_bytes > device.shared_per_block:
        return 0, f"shared memory {shared_bytes} B > {device.shared_per_block} B per block"
    if registers > device.max_registers_per_thread:
        return 0, f"{registers} registers > {device.max_registers_per_thread} per thread"
    if threads > 1024:
        return 0, f"{threads} threads > 1024 per block"
    regs_per_warp = -(-max(registers, 1) * 32 // 256) * 256
    limits = {
        "registers": device.registers_per_sm // (regs_per_warp * (-(-threads // 32))),
        "threads": device.max_threads_per_sm // threads,
        "blocks": device.max_ctas_per_sm,
        # The driver reserves 1 KiB of shared memory per block.
        "shared memory": device.shared_per_sm // (shared_bytes + 1024) if shared_bytes else device.max_ctas_per_sm,
    }
    which = min(limits, key=lambda k: limits[k])
    return limits[which], which


@dataclass
class KernelPrediction:
    """One kernel of a call under the model. Times in seconds; ``time_s`` includes its launch."""

    name: str
    config: str
    launchable: bool
    why_not: str | None
    registers: int
    shared_bytes: int
    local_bytes: int
    ctas_per_sm: int
    occupancy_limit: str
    programs_launched: int
    programs_active: float
    waves: float  # active programs / (SMs x CTAs per SM)
    tail: float  # idle share of the last wave (0: full)
    useful_weights: float
    useful_passes: float
    processed_weights: float
    weight_bytes: float
    other_bytes: float
    bytes_per_useful_weight: float
    warp_instructions: float
    warp_instr_per_useful_weight: float
    bytes_in_flight_per_sm: float
    bytes_in_flight_needed_per_sm: float  # bandwidth x latency / SMs
    dependent_round_trips: int
    t_bytes: float
    t_issue: float
    t_mma: float
    t_exposed_latency: float
    launches: int
    time_s: float
    bound: str
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def predict_kernel(
    device: Device,
    *,
    name: str,
    config: str,
    cost: LoopCost,
    programs_launched: int,
    programs_active: float,
    iterations_per_program: float,
    iterations_total: float,
    weights_per_iteration: int,
    useful_weights: float,
    useful_passes: float,
    weight_bytes: float,
    other_bytes: float,
    stage_bytes: float,
    stages: int,
    mma_flops: float,
    dependent_round_trips: int = 0,
    launches: int = 1,
    assumptions: Assumptions = DEFAULT_ASSUMPTIONS,
    mma_peak_flops: float | None = None,
    store_bytes: float = 0.0,
) -> KernelPrediction:
    """Time of one weight-streaming kernel = launches x launch_s + exposed latency (first HBM
    latency + dependent L2 round trips of the epilogue) + max(bytes, issue, MMA) where

    - bytes: weight_bytes + other_bytes at min(copy bandwidth, bytes in flight / latency), and the
      busiest SM's share at its own bytes in flight / latency (wave quantization);
    - issue: the busiest SM's warp-instructions at ``schedulers_per_sm`` per clock, and no warp
      faster than one instruction per clock;
    - MMA: mma_flops at mma_efficiency x the dense peak of the MMA the kernel runs
      (mma_peak_flops; None: the device's bf16 peak, Device.mma_bf16_flops).

    programs_active: expected programs that do work (the rest exit at once); one program runs at
    most iterations_per_program hot-loop iterations of weights_per_iteration weights (all
    programs together iterations_total), and keeps (stages - 1) x stage_bytes of weights in
    flight. useful_weights: distinct useful weights (bytes); useful_passes: useful weights times
    the token blocks that process them (instructions). store_bytes: the part of other_bytes the
    kernel writes (stores, reductions); with ``assumptions.stores_in_flight`` False the in-flight
    limit applies to the rest only, and all bytes to the copy bandwidth."""
    a = assumptions
    threads = 32 * cost.num_warps
    ctas, limit = occupancy(device, cost.registers, threads, cost.shared_bytes)
    why = None if ctas else limit
    notes = []
    if cost.local_bytes:
        notes.append(f"spills {cost.local_bytes} B per thread")
    slots = device.sms * max(ctas, 1)
    active = max(programs_active, 0.0)
    waves = active / slots
    tail = (math.ceil(waves) - waves) / math.ceil(waves) if waves > 0 else 0.0
    per_sm_programs = math.ceil(active / device.sms) if active else 0
    resident_per_sm = min(per_sm_programs, max(ctas, 1))

    warp_instr_program = iterations_per_program * cost.instructions_per_iteration * cost.num_warps
    warp_instr = iterations_total * cost.instructions_per_iteration * cost.num_warps
    t_issue = max(per_sm_programs * warp_instr_program / device.schedulers_per_sm,
                  math.ceil(per_sm_programs / max(ctas, 1)) * iterations_per_program * cost.instructions_per_iteration,
                  ) / device.clock_hz

    in_flight_cta = max(stages - 1, 1) * stage_bytes
    resident = min(active, slots)
    bandwidth = min(device.hbm_copy_bytes_per_s, resident * in_flight_cta / a.hbm_latency_s) if resident else 0.0
    total_bytes = weight_bytes + other_bytes
    if not 0.0 <= store_bytes <= other_bytes:
        raise ValueError(f"{name}: store_bytes {store_bytes:.4g} must lie in [0, other_bytes = {other_bytes:.4g}]")
    t_bytes = total_bytes / bandwidth if bandwidth else 0.0
    if bandwidth and not a.stores_in_flight:  # only the loads wait on the latency
        t_bytes = max((total_bytes - store_bytes) / bandwidth, total_bytes / device.hbm_copy_bytes_per_s)
    if per_sm_programs and active:
        sm_bytes = per_sm_programs * (weight_bytes / active)
        t_bytes = max(t_bytes, sm_bytes * a.hbm_latency_s / (resident_per_sm * in_flight_cta))
    t_mma = mma_flops / (a.mma_efficiency * (mma_peak_flops or device.mma_bf16_flops))
    terms = {"bytes": t_bytes, "issue": t_issue, "mma": t_mma}
    bound = max(terms, key=lambda k: terms[k])
    exposed = (a.hbm_latency_s + dependent_round_trips * a.l2_round_trip_s) if active else 0.0
    time_s = launches * a.launch_s + exposed + terms[bound]
    if exposed > terms[bound]:
        bound = "latency"
    return KernelPrediction(
        name=name, config=config, launchable=bool(ctas), why_not=why, registers=cost.registers,
        shared_bytes=cost.shared_bytes, local_bytes=cost.local_bytes, ctas_per_sm=ctas, occupancy_limit=limit,
        programs_launched=programs_launched, programs_active=active, waves=waves, tail=tail,
        useful_weights=useful_weights, useful_passes=useful_passes,
        processed_weights=iterations_total * weights_per_iteration,
        weight_bytes=weight_bytes, other_bytes=other_bytes,
        bytes_per_useful_weight=weight_bytes / useful_weights if useful_weights else 0.0,
        warp_instructions=warp_instr,
        warp_instr_per_useful_weight=warp_instr / useful_passes if useful_passes else 0.0,
        bytes_in_flight_per_sm=resident_per_sm * in_flight_cta,
        bytes_in_flight_needed_per_sm=device.hbm_copy_bytes_per_s * a.hbm_latency_s / device.sms,
        dependent_round_trips=dependent_round_trips, t_bytes=t_bytes, t_issue=t_issue, t_mma=t_mma,
        t_exposed_latency=exposed, launches=launches, time_s=time_s, bound=bound, notes=notes,
    )


@dataclass
class CallPrediction:
    """A whole MoE call: its kernels in order, and the totals."""

    implementation: str
    device: str
    shard: str
    M: int
    kernels: list[KernelPrediction]
    routing: RoutingEstimate | None
    fixed_s: float = 0.0  # kernels modelled by a fixed time (routing, activation, sum)
    fixed_launches: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def launches(self) -> int:
        return self.fixed_launches + sum(k.launches for k in self.kernels)

    @property
    def time_s(self) -> float:
        return self.fixed_s + sum(k.time_s for k in self.kernels)

    @property
    def launchable(self) -> bool:
        return all(k.launchable for k in self.kernels)

    @property
    def useful_weights(self) -> float:
        return sum(k.useful_weights for k in self.kernels)

    @property
    def bytes_per_useful_weight(self) -> float:
        u = self.useful_weights
        return sum(k.weight_bytes for k in self.kernels) / u if u else 0.0

    @property
    def warp_instr_per_useful_weight(self) -> float:
        u = sum(k.useful_passes for k in self.kernels)
        return sum(k.warp_instructions for k in self.kernels) / u if u else 0.0

    def to_dict(self) -> dict:
        return {
            "implementation": self.implementation, "device": self.device, "shard": self.shard, "M": self.M,
            "launchable": self.launchable, "launches": self.launches, "time_us": round(self.time_s * 1e6, 2),
            "bytes_per_useful_weight": round(self.bytes_per_useful_weight, 4),
            "warp_instr_per_useful_weight": round(self.warp_instr_per_useful_weight, 4),
            "useful_weights": self.useful_weights,
            "routing": None if self.routing is None else dict(self.routing.__dict__),
            "kernels": [k.to_dict() for k in self.kernels], "notes": self.notes,
        }
