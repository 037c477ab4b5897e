"""Layer-level A/B: one MoE layer (NVFP4, or the MXFP4 release read directly) through every arm on
the same routed inputs.

The plain-torch reference always runs; triton_situ, marlin and flashinfer run where they can and
are otherwise reported "not available: <reason>". Pairs compared: every available arm against
the reference, and triton_situ against marlin and against flashinfer. Outputs: report.json, summary.md,
error_hist.png, per_expert_error.png in the output directory.
"""

from __future__ import annotations

import platform
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from k3nvfp4.checkpoint.layer import NVFP4MoELayer

from ...common.files import write_text_atomic
from ...common.outputs import OutputPathError, check_output_dir
from . import plots
from .arms import ARM_NAMES, ArmUnavailable, arm_pairs, build_arm, default_arms
from .errors import InputError
from .layer_inputs import load_activations, load_checkpoint_layer, realistic_routed_inputs, synthetic_layer
from .metrics import PairMetrics, compare_outputs
from .report import fmt, markdown_table, write_json

DEFAULT_REPEATS = 5  # timed runs per arm after its warm-up


@dataclass
class LayerABConfig:
    """Options of `k3nvfp4-ab layer` (see cli.py). ckpt+layer, or synthetic sizes."""

    out_dir: Path | None
    ckpt: Path | None = None
    layer: int | None = None
    synthetic: bool = False
    num_experts: int | None = None  # synthetic: 8; checkpoint: load the first N experts (None = all)
    hidden_size: int = 256
    intermediate_size: int = 128
    top_k: int | None = None
    tokens: int = 64
    seed: int = 0
    activations: Path | None = None
    dtype: str = "bfloat16"
    arms: tuple[str, ...] | None = None  # None: arms.default_arms (triton_situ_cast added for MXFP4 layers)
    device: str | None = None
    repeats: int | None = None
    plots: bool = True


@dataclass
class ArmResult:
    name: str
    status: str  # "ok", "not available: <reason>" or "failed: <error>"
    times_ms: list[float] = field(default_factory=list)  # the timed runs, after one untimed warm-up run
    notes: list[str] = field(default_factory=list)
    output_rms: float | None = None
    timing: str = ""  # how the times were taken, and the caveat that goes with them (the table's "timing")

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @property
    def median_ms(self) -> float | None:
        return statistics.median(self.times_ms) if self.times_ms else None


@dataclass
class LayerABReport:
    """Result of one layer A/B; `to_dict()` is report.json, `summary_markdown()` summary.md."""

    setup: dict
    arms: list[ArmResult]
    pairs: list[PairMetrics]
    files: dict = field(default_factory=dict)

    def arm(self, name: str) -> ArmResult:
        return next(a for a in self.arms if a.name == name)

    def pair(self, a: str, b: str) -> PairMetrics | None:
        return next((p for p in self.pairs if p.a == a and p.b == b), None)

    def to_dict(self) -> dict:
        return {"setup": self.setup,
                "arms": [dict(asdict(a), median_ms=a.median_ms) for a in self.arms],
                "pairs": [p.to_dict() for p in self.pairs],
                "definitions": DEFINITIONS, "files": self.files}

    def summary_markdown(self) -> str:
        s = self.setup
        lines = [f"# Layer A/B: {s['weights']}", "",
                 f"tokens {s['tokens']}, top-k {s['top_k']}, E {s['num_experts']}, H {s['hidden_size']}, "
                 f"I {s['intermediate_size']}, {s['dtype']}, activation {s['activation']}, device {s['device']}",
                 f"inputs: {s['inputs']}", "", "## Arms", "",
                 markdown_table(["arm", "status", "median time (ms)", "timing", "output RMS"],
                                [[a.name, a.status, fmt(a.median_ms, ".3f"), a.timing or "–", fmt(a.output_rms, ".4g")]
                                 for a in self.arms])]
        notes = [f"- {a.name}: {n}" for a in self.arms for n in a.notes]
        if notes:
            lines += ["", *notes]
        lines += ["", "## Errors (a vs baseline b)", ""]
        if self.pairs:
            lines.append(markdown_table(
                ["a", "b", "max abs err", "rel err (norm)", "cosine", "> 2 ulp bf16", "bit-equal", "worst experts (rel err)"],
                [[p.a, p.b, fmt(p.max_abs_err, ".3e"), fmt(p.rel_err, ".3e"), fmt(p.cosine, ".8f"),
                  f"{100 * p.beyond_2ulp:.3f}%", f"{100 * p.exact_match:.2f}%",
                  ", ".join(f"{w.expert}: {w.rel_err:.2e}" for w in p.worst_experts[:3])] for p in self.pairs]))
        else:
            lines.append("No pair of available arms to compare.")
        lines.append("")
        return "\n".join(lines)


DEFINITIONS = {
    "rel_err": "||a - b||_F / ||b||_F over the whole [M, H] output (b = baseline arm)",
    "cosine": "<a, b> / (||a|| ||b||) of the flattened outputs",
    "beyond_2ulp": "share of elements with |a - b| > 2 * ulp_bf16(|b|); ulp_bf16(x) = 2^(floor(log2 x) - 7), "
                   "2^-133 below bf16's smallest normal",
    "per_expert": "errors over the output rows of the tokens routed to each expert (tokens count under each of "
                  "their top-k experts)",
    "timings": "median wall time of the arm's timed runs (times_ms, --repeats of them: default 5), each after the "
               "compared run, which is the untimed warm-up (first-call compilation and allocation); on CUDA between "
               "torch.cuda.synchronize calls. On CPU: a plain-torch arm is timed the same way, on this CPU (no "
               "indication of GPU speed); an arm in the Triton interpreter is not timed (its wall time measures the "
               "interpreter, not the kernel). Each arm's 'timing' says which applies.",
}


def _load(cfg: LayerABConfig) -> NVFP4MoELayer:
    if cfg.synthetic == (cfg.ckpt is not None):
        raise InputError("give exactly one of --ckpt DIR (with --layer) or --synthetic")
    if cfg.synthetic:
        return synthetic_layer(cfg.num_experts or 8, cfg.hidden_size, cfg.intermediate_size,
                               top_k=cfg.top_k or 4, seed=cfg.seed)
    ex = load_checkpoint_layer(cfg.ckpt, cfg.layer, cfg.num_experts)
    if cfg.top_k:
        ex = replace(ex, top_k=cfg.top_k)
    E = ex.weights.num_experts
    if ex.top_k > E:
        raise InputError(f"top-k {ex.top_k} > loaded experts {E}; load more experts or pass --top-k")
    return ex


def _interpreted(name: str, device: torch.device) -> bool:
    """The Triton arms (triton_situ, triton_situ_cast, triton_situ:<mode>) run in Triton's
    interpreter off CUDA (arms.py); the reference is plain torch, marlin and flashinfer CUDA only."""
    return device.type != "cuda" and name.startswith("triton_situ")


def _timing_note(name: str, device: torch.device, repeats: int) -> str:
    """The table's "timing" cell of an arm that ran: how it was timed and what the time means."""
    if _interpreted(name, device):
        return "not timed: Triton interpreter on CPU (its time is the interpreter's, not the kernel's)"
    if repeats == 0:
        return "not timed (--repeats 0)"
    runs = f"{repeats} run{'s' if repeats != 1 else ''} after a warm-up"
    return f"{runs}, CUDA" if device.type == "cuda" else f"{runs}, on CPU: says nothing of GPU speed"


def _time(run, x, tw, ids, device: torch.device, repeats: int) -> tuple[torch.Tensor, list[float]]:
    """(the output of a first, untimed run: the compared one and the warm-up; ``repeats`` wall
    times in ms of the runs after it, synchronised on CUDA)."""
    cuda = device.type == "cuda"
    out = run(x, tw, ids)
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        run(x, tw, ids)
        if cuda:
            torch.cuda.synchronize(device)
        times.append(1e3 * (time.perf_counter() - t0))
    return out, times


def run_layer_ab(cfg: LayerABConfig) -> LayerABReport:
    """Run the layer A/B and (when cfg.out_dir is set) write its report files. Raises ABError
    on input problems (missing checkpoint/layer, bad activation file, unknown arm, an out_dir
    that cannot be written: checked before any work)."""
    if cfg.out_dir is not None:
        try:
            check_output_dir(cfg.out_dir, "--out")
        except OutputPathError as e:
            raise InputError(str(e)) from None
    for a in cfg.arms or ():
        if a not in ARM_NAMES:
            raise InputError(f"--arms: unknown arm {a!r}; choose from {', '.join(ARM_NAMES)}")
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[cfg.dtype]
    if cfg.activations is not None and not Path(cfg.activations).is_file():  # fail before loading weights
        raise InputError(f"--activations: file not found: {cfg.activations}")
    ex = _load(cfg)
    w = ex.weights
    chosen = cfg.arms if cfg.arms is not None else default_arms(ex)
    arms = ("reference",) + tuple(a for a in chosen if a != "reference")  # the reference always runs
    if cfg.activations is not None:
        inp = load_activations(cfg.activations, w.hidden_size, w.num_experts, dtype)
    else:
        inp = realistic_routed_inputs(cfg.tokens, w.hidden_size, w.num_experts, ex.top_k, seed=cfg.seed, dtype=dtype)
    x, tw, ids = inp.hidden_states.to(device), inp.topk_weights.to(device), inp.topk_ids.to(device)
    repeats = cfg.repeats if cfg.repeats is not None else DEFAULT_REPEATS
    if repeats < 0:
        raise InputError(f"--repeats must be >= 0, got {repeats}")

    results: list[ArmResult] = []
    outputs: dict[str, torch.Tensor] = {}
    for name in arms:
        try:
            run, notes = build_arm(name, ex, device, dtype)
        except ArmUnavailable as e:
            results.append(ArmResult(name, f"not available: {e}"))
            continue
        except ImportError as e:  # the arm's code is missing from this install (e.g. a wheel without it)
            results.append(ArmResult(name, f"not available: {type(e).__name__}: {e}"))
            continue
        try:
            out, times = _time(run, x, tw, ids, device, 0 if _interpreted(name, device) else repeats)
        except Exception as e:  # noqa: BLE001 - a crashing arm is reported, the others still run
            if name == "reference":
                raise
            results.append(ArmResult(name, f"failed: {type(e).__name__}: {str(e)[:300]}", notes=notes))
            continue
        outputs[name] = out
        results.append(ArmResult(name, "ok", times, notes, float(out.double().pow(2).mean().sqrt()),
                                 _timing_note(name, device, repeats)))

    pairs = [compare_outputs(outputs[a], outputs[b], ids, w.num_experts, name_a=a, name_b=b)
             for a, b in arm_pairs() if a in outputs and b in outputs]
    setup = {"weights": ex.source, "inputs": inp.source, "tokens": int(x.shape[0]), "top_k": int(ids.shape[1]),
             "source_format": ex.source_format, "num_experts": w.num_experts, "hidden_size": w.hidden_size, "intermediate_size": w.intermediate_size,
             "dtype": cfg.dtype, "activation": ex.hidden_act, "situ_beta": ex.situ_beta,
             "situ_linear_beta": ex.situ_linear_beta, "routed_scaling_factor": ex.routed_scaling_factor,
             "device": str(device) + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
             "seed": cfg.seed, "torch": torch.__version__, "python": platform.python_version(),
             "triton_interpret": device.type != "cuda",
             "timing": {"warmup_runs": 1, "timed_runs": repeats, "interpreted_arms_timed": False}}
    try:
        import triton

        setup["triton"] = triton.__version__
    except ImportError:
        pass
    rep = LayerABReport(setup, results, pairs)
    if cfg.out_dir is not None:
        _write(rep, Path(cfg.out_dir), outputs, cfg.plots)
    return rep


def _write(rep: LayerABReport, out: Path, outputs: dict[str, torch.Tensor], with_plots: bool) -> None:
    """report.json and summary.md first, then the plots (optional: plots.draw_all), then
    report.json again with the plot files it got."""
    out.mkdir(parents=True, exist_ok=True)
    rep.files = {"report": "report.json", "summary": "summary.md"}
    write_text_atomic(out / "summary.md", rep.summary_markdown())
    write_json(out / "report.json", rep.to_dict())
    if not (with_plots and rep.pairs):
        return

    def hist(path: Path) -> Path:
        series = {f"{p.a} vs {p.b}": (outputs[p.a].double() - outputs[p.b].double()).abs().flatten().cpu().numpy()
                  for p in rep.pairs}
        return plots.error_histogram(path, series, "|a - b| per output element")

    def per_expert(path: Path) -> Path:
        return plots.per_expert_error(
            path, {f"{p.a} vs {p.b}": ([e.expert for e in p.per_expert], [max(e.rel_err, 1e-12) for e in p.per_expert])
                   for p in rep.pairs}, "per-expert normwise relative error (floored at 1e-12)")

    drawn, skipped = plots.draw_all(out, {"error_hist": ("error_hist.png", hist),
                                          "per_expert_error": ("per_expert_error.png", per_expert)})
    rep.files.update(drawn)
    if skipped:
        rep.files["plots_skipped"] = skipped
    write_json(out / "report.json", rep.to_dict())
