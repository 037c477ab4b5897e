"""``k3nvfp4-tune``: search the fused NVFP4 MoE launch configs for one shape on this GPU.

``--mode`` picks the kernel mode tuned: "none" (W4A16, MoEConfig, described below) or "e4m3" (the
Hopper W4A8 mode, W4A8Config: random MXFP4 experts prepared by the mode, each candidate checked
against fused_moe_w4a8_reference, its own file name; docs/tuning.md). What differs per mode (config
class, spaces, start config, weights, reference, launch check, file name) is
tune_details/modes.py; the search, timing, files and resume below are the same for both.

For each batch size M the tuner builds random NVFP4 expert weights and realistic routing
(sigmoid scores with a skewed per-expert bias, ``top_k`` distinct experts per token; ids of
experts outside this rank's range become -1), then for every candidate :class:`MoEConfig`:

1. runs ``fused_moe_nvfp4(..., config=cfg)`` once into a NaN-poisoned output and compares it
   with ``fused_moe_nvfp4_reference`` (normwise relative error, ``--tol``): a fast wrong
   config never wins; configs that fail to compile or exceed resources are skipped with a note;
2. times it: CUDA events, ``--warmup`` runs, median of ``--iters`` runs, the L2 cache flushed
   before each run (so small batches read their weights from HBM, as in serving).

The search is staged (coordinate descent): block_m / swap_ab first, then the GEMM1 knobs, then
the GEMM2 knobs, each stage starting from the best config so far. Batch sizes are tuned in
coverage order (smallest, largest, then middles), so a run cut short still spans the range.
After each batch size the
results so far are written atomically to ``<final file>.partial.json``; a restart with the same
shape and device skips the finished batch sizes. At the end ONE JSON per shape and device is
written, named by :func:`config_file_name` (keys = batch sizes), to ``--out-dir``, else
``$K3NVFP4_MOE_CONFIG_DIR``, else the per-user ``~/.config/k3nvfp4/moe_configs`` (never into the
installed package) -- exactly what :func:`get_moe_config`
reads at run time.

Without a GPU, ``--device cpu`` runs the same pipeline in the Triton interpreter with
wall-clock timing on the ``tiny`` space (a functional check of the tool, not a tuning: the
interpreter's timings say nothing about a GPU). It re-executes itself with TRITON_INTERPRET=1
when that is not already set, since Triton decides interpretation when kernels are defined.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pathlib
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..common.cli import HelpFormatter
from ..common.files import write_json_atomic
from ..common.progress import is_terminal, progress_bar
from .activation import ACTIVATION_NAMES, ActivationKind, GatedActivation
from .interpreter import kernels_interpreted, rerun_with_interpreter
from .moe_details.config import (
    CONFIG_DIR_ENV,
    MoEConfig,
    config_dir,
    config_file_name,
    user_config_dir,
)
from .target import capability, current_device_name
from .testing import kimi_routing
from .tune_details.modes import SPACE_NAMES as _SPACE_NAMES
from .tune_details.modes import TUNED_MODES

PARTIAL_SUFFIX = ".partial.json"
_PARTIAL_VERSION = 1


# --------------------------------------------------------------------------------------------
# Shapes


@dataclass(frozen=True)
class TuneShape:
    """Per-rank MoE shape: E local experts (of ``global_experts`` routed over), hidden H,
    per-shard intermediate I, ``top_k`` experts per token."""

    E: int
    H: int
    I: int
    top_k: int
    global_experts: int

    def __post_init__(self) -> None:
        for name in ("E", "H", "I", "top_k", "global_experts"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r}: must be a positive integer")
        for name in ("H", "I"):
            if getattr(self, name) % 16:
                raise ValueError(f"{name}={getattr(self, name)}: must be a multiple of 16 (NVFP4 block)")
        if self.global_experts < self.E:
            raise ValueError(f"global_experts={self.global_experts} < E={self.E}")
        if self.top_k > self.global_experts:
            raise ValueError(f"top_k={self.top_k} > number of experts routed over ({self.global_experts})")

    def describe(self) -> str:
        ep = f" of {self.global_experts}" if self.global_experts != self.E else ""
        return f"E={self.E}{ep} H={self.H} I={self.I} top_k={self.top_k}"


def shape_from_model_config(path: str | os.PathLike, tp_size: int = 1, ep_size: int = 1) -> TuneShape:
    """Per-rank routed-expert shape from a Kimi-K3 style config.json.

    Reads ``text_config`` (or the top level): num_experts, moe_intermediate_size,
    routed_expert_hidden_size (else hidden_size), num_experts_per_token (else
    num_experts_per_tok). Sharding follows SGLang: experts are split over ``ep_size`` ranks and
    the intermediate size over ``tp_size // ep_size`` (so TP16/EP16 keeps I whole).
    """
    path = pathlib.Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise SystemExit(f"--model-config {path}: file not found") from None
    except json.JSONDecodeError as e:
        raise SystemExit(f"--model-config {path}: not valid JSON ({e})") from None
    cfg = raw.get("text_config", raw) if isinstance(raw, dict) else None
    if not isinstance(cfg, dict):
        raise SystemExit(f"--model-config {path}: expected a JSON object")

    def key(*names: str) -> int:
        for n in names:
            if n in cfg:
                return int(cfg[n])
        raise SystemExit(f"--model-config {path}: missing key {' / '.join(names)} (looked in text_config)")

    num_experts = key("num_experts", "n_routed_experts")
    inter = key("moe_intermediate_size")
    hidden = key("routed_expert_hidden_size", "hidden_size")
    top_k = key("num_experts_per_token", "num_experts_per_tok")
    if tp_size < 1 or ep_size < 1:
        raise SystemExit(f"--tp-size {tp_size} / --ep-size {ep_size}: must be >= 1")
    if tp_size % ep_size:
        raise SystemExit(f"--tp-size {tp_size} must be a multiple of --ep-size {ep_size} (SGLang: moe_tp = tp / ep)")
    moe_tp = tp_size // ep_size
    if num_experts % ep_size:
        raise SystemExit(f"num_experts={num_experts} is not divisible by --ep-size {ep_size}")
    if inter % moe_tp or (inter // moe_tp) % 16:
        raise SystemExit(
            f"moe_intermediate_size={inter} / moe tp {moe_tp} = {inter / moe_tp}: not a multiple of 16"
        )
    return TuneShape(E=num_experts // ep_size, H=hidden, I=inter // moe_tp, top_k=top_k, global_experts=num_experts)


# --------------------------------------------------------------------------------------------
# Synthetic problem (also used by bench/bench_moe.py)


def problem_weights(shape: TuneShape, device: torch.device | str, seed: int = 0, mode: str = "none"):
    """The tuner's and bench_moe's experts, prepared for ``mode``: for "none" (W4A16) random NVFP4
    weights (NVFP4MoEWeights: uniform codes, mantissa-bearing E4M3 block scales, gate != up
    scale_2, see :func:`testing.random_nvfp4_moe_weights`); for "e4m3" random MXFP4 release
    tensors (:func:`testing.random_mxfp4_tensors`) prepared by the mode (W4A8MoEWeights)."""
    return TUNED_MODES[mode].weights(shape, torch.device(device), seed)


def problem_routing(
    M: int, shape: TuneShape, device: torch.device | str, seed: int = 0, expert_offset: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The tuner's and bench_moe's routing: :func:`testing.kimi_routing` over ``shape.global_experts``
    (topk_weights float32 [M, top_k], topk_ids int32 [M, top_k]), ids local to this rank's experts
    [expert_offset, expert_offset + E), the others -1."""
    local = range(expert_offset, expert_offset + shape.E)
    return kimi_routing(M, shape.top_k, shape.global_experts, local_experts=local, device=device, seed=seed)


def normwise_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (inf when out has NaN/inf)."""
    o, r = out.double(), ref.double()
    if not torch.isfinite(o).all():
        return math.inf
    den = r.norm().item()
    return (o - r).norm().item() / (den if den > 0 else 1.0)


# --------------------------------------------------------------------------------------------
# Search space


# The search spaces, start configs, weights and references of each mode: tune_details/modes.py.
SPACE_NAMES = _SPACE_NAMES


def _block_m_choices(base: MoEConfig) -> list[dict]:
    """block_m one step either side of the heuristic's, each with its swap_ab options."""
    ladder = [16, 32, 64, 128]
    i = ladder.index(base.block_m) if base.block_m in ladder else 0
    out = []
    for bm in ladder[max(0, i - 1) : i + 2]:
        for swap in ([True, False] if bm <= 64 else [False]):
            out.append({"block_m": bm, "swap_ab": swap})
    return out


def _expand_stage(stage: dict[str, list], best):
    """The configs of one stage around ``best`` (a MoEConfig or W4A8Config): the product of the
    stage's fields, de-duplicated; combinations the config class refuses are dropped."""
    choices: list[dict] = [{}]
    for field, values in stage.items():
        if values == ["~"]:  # block_m ladder (with swap_ab)
            options = _block_m_choices(best)
        else:  # a dict value sets several fields together (e4m3: block_m with GEMM1's num_warps1)
            options = [v if isinstance(v, dict) else {field: v} for v in values]
        choices = [{**c, **o} for c in choices for o in options]
    out: dict[MoEConfig, None] = {}  # ordered, de-duplicated
    for c in choices:
        try:
            cfg = dataclasses.replace(best, **c)
        except (TypeError, ValueError):
            continue
        out[cfg] = None
    return list(out)


def base_config(space: str, shape: TuneShape, M: int, mode: str = "none"):
    """Starting point of the search: the run-time heuristic of ``mode`` ("none": W4A16's
    MoEConfig, "e4m3": W4A8Config; tiny: small blocks for tiny shapes)."""
    return TUNED_MODES[mode].base(space, shape, M)


def stages(space: str, mode: str = "none") -> list[dict[str, list]]:
    """The stages of a search space for ``mode`` (tune_details/modes.py)."""
    return TUNED_MODES[mode].spaces[space]


# --------------------------------------------------------------------------------------------
# Timing


class Timer:
    """Median time of a callable: CUDA events with an L2 flush before each run, or wall clock.

    ``iters`` timed runs after ``warmup`` untimed ones. On CUDA, ``target_s`` instead sizes the
    run count from a 3-run probe to about that much GPU time, clamped to [10, max_iters]
    (bench/bench_moe.py); on CPU ``iters`` always applies. The tuner and the benchmark share it.
    """

    def __init__(self, device: torch.device, warmup: int, iters: int, flush_mb: int = 256,
                 target_s: float | None = None, max_iters: int = 200):  # fmt: skip
        self.device, self.warmup, self.iters = device, warmup, iters
        self.target_s, self.max_iters = target_s, max_iters
        self.cuda = device.type == "cuda"
        self._flush = torch.empty(flush_mb << 20, dtype=torch.uint8, device=device) if self.cuda else None

    def __call__(self, fn: Callable[[], object]) -> float:
        """Median seconds per call."""
        return self.measure(fn)[0]

    def measure(self, fn: Callable[[], object], warmup: int | None = None) -> tuple[float, int]:
        """(median seconds per call, timed runs)."""
        for _ in range(self.warmup if warmup is None else warmup):
            fn()
        iters = self.iters
        if self.cuda and self.target_s is not None:
            probe = statistics.median(self._run(fn, 3))
            iters = int(min(self.max_iters, max(10, self.target_s / max(probe, 1e-6))))
        return statistics.median(self._run(fn, iters)), iters

    def _run(self, fn: Callable[[], object], n: int) -> list[float]:
        if not self.cuda:
            times = []
            for _ in range(n):
                t0 = time.perf_counter()
                fn()
                times.append(time.perf_counter() - t0)
            return times
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for s, e in zip(starts, ends):
            # the memset also keeps the GPU busy while the launches queue up behind it
            self._flush.zero_()
            s.record()
            fn()
            e.record()
        torch.cuda.synchronize(self.device)
        return [s.elapsed_time(e) * 1e-3 for s, e in zip(starts, ends)]


# --------------------------------------------------------------------------------------------
# Results files (written with files.write_json_atomic)


def _shape_key(shape: TuneShape, device_name: str, space: str, dtype: str, activation: str, mode: str = "none") -> dict:
    return {**dataclasses.asdict(shape), "device_name": device_name, "space": space, "dtype": dtype,
            "activation": activation, "mode": mode}  # fmt: skip


def load_partial(path: pathlib.Path, key: dict) -> dict[str, dict]:
    """Finished batch sizes of an interrupted run with the same shape/device/space, else {}."""
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        print(f"note: ignoring unreadable partial results {path}: {e}", file=sys.stderr)
        return {}
    if raw.get("version") != _PARTIAL_VERSION or raw.get("key") != key:
        print(f"note: {path} is for another shape/device/space; starting afresh", file=sys.stderr)
        return {}
    return {m: r for m, r in raw.get("results", {}).items() if r.get("complete")}


# --------------------------------------------------------------------------------------------
# The tuner


@dataclass
class Candidate:
    config: MoEConfig
    time_s: float | None = None
    error: float | None = None
    note: str | None = None


def tune_batch_size(
    M: int,
    shape: TuneShape,
    weights,
    space: str,
    timer: Timer,
    *,
    device: torch.device,
    dtype: torch.dtype,
    activation: str,
    tol: float,
    seed: int,
    expert_offset: int,
    max_configs: int | None,
    deadline: float | None,
    progress: bool,
    launch_check: Callable[[MoEConfig], str | None] | None = None,
    mode: str = "none",
) -> tuple[Candidate | None, list[Candidate], bool]:
    """Staged search for one batch size. Returns (best, all tried, complete).

    mode: the kernel mode tuned ("none": W4A16, MoEConfig; "e4m3": the Hopper W4A8 mode,
    W4A8Config), whose prepared ``weights`` choose the kernels of each call.
    launch_check(cfg) -> reason or None: configs it rejects (cannot launch on the device, or
    spill registers; see :func:`offline_launch_check`) are recorded with the reason and never
    run or timed."""
    from tqdm import tqdm

    from .moe import fused_moe_nvfp4

    tuned = TUNED_MODES[mode]
    x = torch.randn(M, shape.H, generator=torch.Generator(device=device).manual_seed(seed + M), device=device)
    x = x.to(dtype)
    topk_weights, topk_ids = problem_routing(M, shape, device, seed=seed + 7 * M, expert_offset=expert_offset)
    kw = dict(activation=GatedActivation.parse(activation))
    ref = tuned.reference(x, weights, topk_weights, topk_ids, kw["activation"]).float()
    out = torch.empty(M, shape.H, dtype=dtype, device=device)

    best: Candidate | None = None
    tried: list[Candidate] = []
    seen: set[MoEConfig] = set()
    complete = True
    current = base_config(space, shape, M, mode)
    # The configs of one batch size: a nested bar on a terminal only (in a log, nested bars leave
    # cursor-movement codes; the outer status line names the batch size instead).
    bar = tqdm(desc=f"M={M}", unit="cfg", leave=False, disable=not (progress and is_terminal(sys.stderr)),
               file=sys.stderr)
    for stage in stages(space, mode):
        for cfg in _expand_stage(stage, current):
            if cfg in seen:
                continue
            if (max_configs is not None and len(seen) >= max_configs) or (
                deadline is not None and time.monotonic() > deadline
            ):
                complete = False
                break
            seen.add(cfg)
            cand = Candidate(cfg)
            tried.append(cand)
            bar.update(1)
            reason = tuned.invalid(cfg, shape) or (launch_check(cfg) if launch_check is not None else None)
            if reason:
                cand.note = f"skipped: {reason}"
                continue
            run = lambda: fused_moe_nvfp4(x, weights, topk_weights, topk_ids, out=out, config=cfg, **kw)  # noqa: E731
            try:
                out.fill_(float("nan"))  # every element must be written
                run()
                cand.error = normwise_error(out, ref)
                if not cand.error <= tol:
                    cand.note = f"wrong result: normwise error {cand.error:.3g} > tol {tol:g}"
                    continue
                cand.time_s = timer(run)
            except Exception as e:  # compile errors, out of resources, unsupported combinations
                msg = str(e).strip().splitlines()
                cand.note = f"skipped: {type(e).__name__}: {msg[0][:200] if msg else ''}"
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # surface asynchronous faults here, not later
                continue
            if best is None or cand.time_s < best.time_s:
                best = cand
                bar.set_postfix_str(f"best {best.time_s * 1e6:.1f}us")
        if best is not None:
            current = best.config
        if not complete:
            break
    bar.close()
    return best, tried, complete


def offline_launch_check(shape: "TuneShape", arch: int, device_model=None, mode: str = "none") -> Callable:
    """A launch_check for tune_batch_size: compiles both GEMMs of a config offline for sm<arch>
    (no launch) and rejects it when either cannot launch on the device (shared memory or
    registers over its per-block limits, k3nvfp4.kernels.perf_model.occupancy) or uses local
    memory (register spills), which no shipped config may do. device_model: a perf_model.Device
    (None: the H200 below arch 100, the B200 from 100). mode: the configs' kernel mode
    (tune_details/modes.py: "none" MoEConfig, "e4m3" W4A8Config). Cached per GEMM launch."""
    from . import perf_model

    tuned = TUNED_MODES[mode]

    if device_model is None:
        device_model = perf_model.B200 if arch >= 100 else perf_model.H200
    verdicts: dict = {}

    def check(cfg) -> str | None:
        for kind in ("gemm1", "gemm2"):
            key = tuned.gemm_key(kind, cfg)
            if key not in verdicts:
                try:
                    cost = tuned.measure(kind, cfg, shape, arch)
                except Exception:  # compile errors are reported by the timed run itself
                    return None
                ctas, why = perf_model.occupancy(device_model, cost.registers, 32 * cost.num_warps, cost.shared_bytes)
                if not ctas:
                    verdicts[key] = f"{kind} cannot launch on {device_model.name}: {why}"
                elif cost.local_bytes:
                    verdicts[key] = f"{kind} spills {cost.local_bytes} bytes of local memory per thread (sm_{arch})"
                else:
                    verdicts[key] = None
            if verdicts[key]:
                return verdicts[key]
        return None

    return check


def device_model_of(device: torch.device):
    """perf_model.Device of a CUDA device: the H200/B200 record with this GPU's SM count and
    shared-memory and register limits (as CUDA reports them)."""
    import dataclasses

    from . import perf_model

    props = torch.cuda.get_device_properties(device)
    base = perf_model.B200 if props.major >= 10 else perf_model.H200
    return dataclasses.replace(
        base, name=props.name, arch=10 * props.major + props.minor, sms=props.multi_processor_count,
        shared_per_block=getattr(props, "shared_memory_per_block_optin", base.shared_per_block),
        shared_per_sm=getattr(props, "shared_memory_per_multiprocessor", base.shared_per_sm),
        registers_per_sm=getattr(props, "regs_per_multiprocessor", base.registers_per_sm),
    )


def _parse_batch_sizes(text: str) -> list[int]:
    try:
        values = sorted({int(v) for v in text.replace(" ", "").split(",") if v})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batch-sizes {text!r}: expected a comma list of integers") from None
    if not values or values[0] < 1:
        raise argparse.ArgumentTypeError(f"--batch-sizes {text!r}: need positive integers")
    return values


def coverage_order(batch_sizes: Sequence[int]) -> list[int]:
    """Smallest, largest, then the middles of the gaps (breadth first): a run cut short by
    --time-budget still spans the range, so the nearest-batch-size lookup stays sensible."""
    values = sorted(batch_sizes)
    if len(values) <= 2:
        return values
    order = [values[0], values[-1]]
    gaps = [(0, len(values) - 1)]
    while gaps:
        nxt = []
        for lo, hi in gaps:
            if hi - lo < 2:
                continue
            mid = (lo + hi) // 2
            order.append(values[mid])
            nxt += [(lo, mid), (mid, hi)]
        gaps = nxt
    return order


DEFAULT_BATCH_SIZES = "1,2,4,8,16,32,64,128,256,512,1024,2048,4096,8192,16384"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="k3nvfp4-tune", formatter_class=HelpFormatter,
        description="Tune the fused NVFP4 MoE launch configs for one shape on the current GPU and write "
        "the JSON that the kernel reads at run time.",
    )
    g = p.add_argument_group("shape (either explicit, or from a model config)")
    g.add_argument("--E", type=int, help="local experts on this rank")
    g.add_argument("--H", type=int, help="hidden size (K of GEMM1, N of GEMM2)")
    g.add_argument("--I", type=int, help="per-shard intermediate size (N of GEMM1 per half)")
    g.add_argument("--top-k", type=int, help="experts per token")
    g.add_argument("--global-experts", type=int, help="experts routed over (default E; EP: all experts)")
    g.add_argument("--model-config", help="HF config.json of Kimi-K3 (text_config keys)")
    g.add_argument("--tp-size", type=int, default=1, help="with --model-config: tensor-parallel size")
    g.add_argument("--ep-size", type=int, default=None,
                   help="with --model-config: expert-parallel size (experts / ep per rank, I / (tp / ep); "
                        "alone it implies --tp-size = --ep-size, as in SGLang's TP16/EP16)")  # fmt: skip
    p.add_argument("--batch-sizes", type=_parse_batch_sizes, default=None,
                   help=f"comma list (default {DEFAULT_BATCH_SIZES}; cpu: 1,3)")  # fmt: skip
    p.add_argument("--mode", choices=tuple(TUNED_MODES), default="none",
                   help="kernel mode to tune: none (W4A16, the default mode) or e4m3 (the Hopper W4A8 mode: FP8 "
                        "activations, needs an sm89+ GPU or --device cpu, H and I multiples of 64; its file is read "
                        "by calls on MXFP4-release weights, docs/w4a8.md)")  # fmt: skip
    p.add_argument("--space", choices=SPACE_NAMES, default=None,
                   help="search space: tiny (2 configs), small (<= 10 per batch size), default (staged, <= 67), "
                        "wide (staged, <= 95); "
                        "default: 'default' on cuda, 'tiny' on cpu")  # fmt: skip
    p.add_argument("--max-configs", type=int, default=None, help="cap on configs tried per batch size")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds; stop searching when spent and write what is done (resumable)")  # fmt: skip
    p.add_argument("--out-dir", help=f"output directory (default ${CONFIG_DIR_ENV}, else {user_config_dir()}; "
                                     "get_moe_config reads both, then the configs shipped in the package)")
    p.add_argument("--report", help="also write every candidate's time/error/note to this JSON file")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default) or cpu: Triton interpreter + wall clock, a functional check only")  # fmt: skip
    p.add_argument("--interpret", action="store_true", help="same as --device cpu")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                   help="activation dtype (default bf16 on cuda, fp32 on cpu)")  # fmt: skip
    p.add_argument("--activation", choices=ACTIVATION_NAMES, default=ActivationKind.SITU.value, help="gated activation of the tuned calls")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs per config (cuda 5, cpu 1)")
    p.add_argument("--iters", type=int, default=None, help="timed runs per config, median taken (cuda 50, cpu 2)")
    p.add_argument("--tol", type=float, default=None,
                   help="max normwise error vs the mode's reference (default: e4m3 1e-2; else 2e-2 bf16/fp16, 1e-4 fp32)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="random seed of the weights and routing")
    p.add_argument("--no-resume", action="store_true", help="ignore (and overwrite) partial results")
    p.add_argument("--no-progress", action="store_true", help="no bars: a status line every $K3NVFP4_PROGRESS_INTERVAL s (default 30) instead, as without a terminal")
    return p


def _resolve_shape(args, p: argparse.ArgumentParser) -> TuneShape:
    explicit = [args.E, args.H, args.I, args.top_k]
    if args.model_config:
        if any(v is not None for v in explicit):
            p.error("give either --model-config or --E/--H/--I/--top-k, not both")
        ep = args.ep_size if args.ep_size is not None else 1
        tp = args.tp_size if args.ep_size is None or args.tp_size != 1 else ep
        return shape_from_model_config(args.model_config, tp_size=tp, ep_size=ep)
    if any(v is None for v in explicit):
        p.error("need --E, --H, --I and --top-k (or --model-config)")
    try:
        return TuneShape(args.E, args.H, args.I, args.top_k, args.global_experts or args.E)
    except ValueError as e:
        p.error(str(e))
        raise  # unreachable


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    from ..common.outputs import OutputPathError, check_output_dir, check_output_file

    try:  # before any tuning (and before the interpreter re-run): minutes of work must not end in a failed write
        if args.out_dir:
            check_output_dir(args.out_dir, "--out-dir")
        if args.report:
            check_output_file(args.report, "--report")
    except OutputPathError as e:
        print(f"k3nvfp4-tune: error: {e}", file=sys.stderr)
        return 2
    if args.interpret:
        args.device = "cpu"
    cpu = args.device == "cpu"
    if cpu and not kernels_interpreted():
        if argv is not None:  # called as a function: never replace the caller's process
            raise RuntimeError("k3nvfp4-tune --device cpu needs TRITON_INTERPRET=1 set before triton is imported")
        rerun_with_interpreter("k3nvfp4.kernels.tune", even_with_cuda=True)
    if not cpu and not torch.cuda.is_available():
        print("k3nvfp4-tune: no CUDA device; use --device cpu for the interpreter's functional run", file=sys.stderr)
        return 2

    shape = _resolve_shape(args, p)
    tuned_mode = TUNED_MODES[args.mode]
    if why := tuned_mode.shape_error(shape):
        p.error(why)
    if not cpu and (why := tuned_mode.device_error(torch.device("cuda"))):
        print(f"k3nvfp4-tune: {why}", file=sys.stderr)
        return 2
    device = torch.device("cpu" if cpu else "cuda")
    space = args.space or ("tiny" if cpu else "default")
    dtype_name = args.dtype or ("fp32" if cpu else "bf16")
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    tol = args.tol if args.tol is not None else (
        tuned_mode.default_tol or (1e-4 if dtype == torch.float32 else 2e-2))
    warmup = args.warmup if args.warmup is not None else (1 if cpu else 5)
    iters = args.iters if args.iters is not None else (2 if cpu else 50)
    if warmup < 0 or iters < 1:
        p.error("--warmup must be >= 0 and --iters >= 1")
    batch_sizes = args.batch_sizes or _parse_batch_sizes("1,3" if cpu else DEFAULT_BATCH_SIZES)
    device_name = current_device_name() if not cpu else "cpu"
    out_dir = pathlib.Path(args.out_dir) if args.out_dir else config_dir()
    final_path = out_dir / config_file_name(shape.E, shape.H, shape.I, device_name, tuned_mode.file_dtype)
    partial_path = final_path.with_name(final_path.name + PARTIAL_SUFFIX)
    key = _shape_key(shape, device_name, space, dtype_name, args.activation, args.mode)

    t_start = time.monotonic()
    deadline = t_start + args.time_budget if args.time_budget else None
    done = {} if args.no_resume else load_partial(partial_path, key)
    todo = [m for m in coverage_order(batch_sizes) if str(m) not in done]
    print(
        f"k3nvfp4-tune: {shape.describe()}, mode {args.mode}, on {device_name} ({'interpreter, wall clock' if cpu else 'CUDA events'}), "
        f"space={space}, dtype={dtype_name}; batch sizes {batch_sizes}"
        + (f"; resuming: {len(batch_sizes) - len(todo)} already done in {partial_path.name}" if len(todo) < len(batch_sizes) else ""),
        file=sys.stderr,
    )  # fmt: skip

    results: dict[str, dict] = dict(done)
    if todo:
        weights = problem_weights(shape, device, seed=args.seed, mode=args.mode)
        timer = Timer(device, warmup, iters)
        launch_check = None
        if device.type == "cuda":
            major, minor = capability(device)
            launch_check = offline_launch_check(shape, 10 * major + minor, device_model_of(device), args.mode)
        # A bar on a terminal; in a log (or with --no-progress) a status line every interval.
        outer = progress_bar(len(todo), "tuning", bars=not args.no_progress, unit="batch sizes")
        try:
            for M in todo:
                if deadline is not None and time.monotonic() > deadline:
                    print(f"note: --time-budget spent; batch sizes left for a resume: {[m for m in todo if str(m) not in results]}", file=sys.stderr)  # fmt: skip
                    break
                outer.set_postfix_str(f"M={M}")
                best, tried, complete = tune_batch_size(
                    M, shape, weights, space, timer, device=device, dtype=dtype, activation=args.activation,
                    tol=tol, seed=args.seed, expert_offset=0, max_configs=args.max_configs, deadline=deadline,
                    progress=not args.no_progress, launch_check=launch_check, mode=args.mode,
                )  # fmt: skip
                for c in tried:
                    if c.note:
                        print(f"note: M={M} {c.config}: {c.note}", file=sys.stderr)
                entry = {
                    "complete": complete and best is not None,
                    "config": best.config.to_dict() if best else None,
                    "time_us": best.time_s * 1e6 if best else None,
                    "error": best.error if best else None,
                    "tried": [
                        {"config": c.config.to_dict(), "time_us": None if c.time_s is None else c.time_s * 1e6,
                         "error": c.error, "note": c.note}
                        for c in tried
                    ],
                }  # fmt: skip
                if best is None:
                    print(f"warning: M={M}: no config passed the check; nothing recorded", file=sys.stderr)
                results[str(M)] = entry
                write_json_atomic(partial_path, {"version": _PARTIAL_VERSION, "key": key, "results": results})
                outer.update(1)
        except KeyboardInterrupt:
            outer.close()
            kept = [m for m in todo if str(m) in results]
            print(f"k3nvfp4-tune: interrupted; {len(results)} batch size(s) done so far are kept in {partial_path}"
                  f"{f' ({len(kept)} of them in this run)' if kept else ''}; the same command resumes",
                  file=sys.stderr)  # fmt: skip
            return 130
        finally:
            outer.close()

    tuned = {m: r for m, r in results.items() if r.get("config")}
    if not tuned:
        print("k3nvfp4-tune: no batch size tuned; no config file written", file=sys.stderr)
        return 1
    # Merge with an existing file of the same shape/device: entries of other batch sizes stay.
    merged: dict[str, dict] = {}
    if final_path.is_file():
        try:
            merged = {k: v for k, v in json.loads(final_path.read_text()).items()}
        except (OSError, json.JSONDecodeError) as e:
            print(f"note: replacing unreadable {final_path}: {e}", file=sys.stderr)
    merged.update({m: r["config"] for m, r in tuned.items()})
    write_json_atomic(final_path, {k: merged[k] for k in sorted(merged, key=int)})
    if args.report:
        write_json_atomic(pathlib.Path(args.report), {"key": key, "results": results,
                                                      "elapsed_s": time.monotonic() - t_start})  # fmt: skip
    finished = all(str(m) in results and results[str(m)]["complete"] for m in batch_sizes)
    if finished:
        partial_path.unlink(missing_ok=True)
    print(f"{'M':>7} {'time_us':>10}  config", file=sys.stdout)
    for m in sorted(tuned, key=int):
        r = tuned[m]
        flag = "" if r["complete"] else "  (search cut short)"
        print(f"{m:>7} {r['time_us']:>10.1f}  {r['config']}{flag}", file=sys.stdout)
    print(f"wrote {final_path}" + ("" if finished else f" (partial; resume with the same command: {partial_path.name})"))
    return 0 if finished else 3


if __name__ == "__main__":
    sys.exit(main())
