#!/usr/bin/env python3
"""The static performance report: every shipped launch config compiled offline, checked for
launchability, and put through the static performance model (k3nvfp4.kernels.perf_model) next to
SGLang's marlin MoE and FlashInfer's SM90 W4A16 MoE. No GPU needed.

For each device (H200: sm_90, K3 TP8/TP16/TP32/EP8/EP16/EP32; B200: sm_100, TP8/TP16, the model
card's deployment) and each M, take the config ``get_moe_config`` returns there (tuned file for the
device if committed, else the heuristic, with the shard's global expert count), compile GEMM1 and
GEMM2 for the architecture (Triton -> cubin, bundled ptxas), read registers, spills and shared
memory, count the hot K loop (Triton's cuobjdump), and predict the call: launchable, CTAs per SM,
grid and waves (EP-aware), bytes and warp-instructions per useful weight, bytes in flight, launches,
time per call. Marlin (built by nvcc from SGLang's shipped sources, its grid from SGLang's host
heuristic replayed) and FlashInfer (W4A16 and W4A8, tiles built from its JIT sources) go through the same
model on the H200; the marlin model is checked against published H200 timings.

  python -P bench/sass_report.py                             # everything (~5 min, + peer builds once)
  python -P bench/sass_report.py --write-readme              # also the table in bench/README.md
  python -P bench/sass_report.py --devices H200 --shards tp16 --m-list 1 --no-peers --out /tmp/r.json
  python -P bench/sass_report.py --baseline 25a9584 --out bench/results/perf-model-before.json

On B200 also the FP4 tensor-core modes (bench/fp4_modes_model.py): before / after issue 18 and
next to FlashInfer's published K3 TP8 times.

Writes bench/results/perf-model.json and prints Markdown. Exit 1 when a config of ours cannot
launch, spills, or misses the loop budget (perf_model.loop_budget) outside the known exceptions
listed in KNOWN_MISSES, or an FP4 mode's row misses its target (launchable, no spill, <= 4
launches at M <= 64, at most FlashInfer's published time). With --check also when a tile table
is stale or a row moved against the committed report (report_check.py; bench/README.md says when
to run it):

  python -P bench/sass_report.py --check --out /tmp/perf-model.json    # compare, keep the committed one

With --ptx-dir DIR it also writes the PTX of every distinct compiled kernel that sums by last
arrival (W4A16 GEMM2, and GEMM1 where split over K, of every row; the same of the FP4 modes'
shipped configs at B200_M), one file per compiled kernel (named by Triton's hash), and
DIR/index.json naming the report rows each serves: tests/test_memory_ordering.py checks their
release / acquire dataflow (tests/ptx_ordering.py) on the compiles this report made.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import os
import pathlib
import subprocess
import sys
import traceback
from dataclasses import asdict, dataclass

from k3nvfp4.common.files import write_json_atomic, write_text_atomic

REPO = pathlib.Path(__file__).resolve().parent.parent
DEFAULT_M = (1, 4, 16, 64, 256, 1024, 4096, 16384)
DEVICE_SHARDS = {"H200": ("tp8", "tp16", "tp32", "ep8", "ep16", "ep32"), "B200": ("tp8", "tp16")}
DEVICE_NAMES = {"H200": "NVIDIA_H200", "B200": "NVIDIA_B200"}  # tuned-config lookup
README_BEGIN = "<!-- sass-report:begin -->"
README_END = "<!-- sass-report:end -->"


@dataclass(frozen=True)
class KnownMiss:
    """Shipped configs whose loop misses the budget, and why. Asserted, not hidden:
    tests/test_launch_configs.py holds each to its bound."""

    device: str
    shards: tuple[str, ...]
    kind: str  # "gemm1" | "gemm2"
    m_min: int
    m_max: int
    bound: float  # warp-instructions per useful weight pass
    why: str

    def covers(self, device: str, shard: str, kind: str, M: int) -> bool:
        return device == self.device and shard in self.shards and kind == self.kind and self.m_min <= M <= self.m_max


_ALL_M = (1, 1 << 30)
_BM32_WHY = ("at 513-1024 tokens an expert's ~10-18 tokens fit one 32-token block; the 16-token tiles that meet 0.09 "
             "per pass stream every expert twice (0.145-0.148 per useful weight, predicted 3-5% slower). The 32-token "
             "tiles' activation loads (GEMM1) and 16-word bk64 iterations (GEMM2, K = I = 384 or 192; the 32-word "
             "bn512 tile spills at 32 tokens) cost 0.0005-0.005 more per pass")
_SM100_WHY = ("sm_100 W4A16: tcgen05 takes A from shared memory only, so the dequantized weights make a round trip "
              "through it (4+ warps) or run on 2-warp mma.sync tiles; the Blackwell loop budget and its fix are "
              "issue 18's")
KNOWN_MISSES = (
    KnownMiss("H200", ("tp32",), "gemm2", *_ALL_M, 0.12,
              "K = I = 96 is 1.5 of the layout's 64-wide K tiles: the best tile processes 128 K for 96 (a 32-wide "
              "half-tile costs more per weight)"),
    KnownMiss("H200", ("tp32",), "gemm1", *_ALL_M, 0.12,
              "I = 96 is 1.5 of the 64-row tiles that launch without spills at M >= 1024: the prefill tile computes "
              "128 rows for 96; below, the 32-row 2-warp tile (mma.sync, weights through shared memory)"),
    KnownMiss("H200", ("tp8", "tp16", "ep8", "ep16", "ep32"), "gemm1", 513, 1024, 0.092, _BM32_WHY),
    KnownMiss("H200", ("tp8", "tp16", "ep8", "ep16", "ep32"), "gemm2", 513, 1024, 0.095, _BM32_WHY),
    KnownMiss("B200", ("tp8", "tp16"), "gemm1", 1, 1024, 0.13, _SM100_WHY),
    KnownMiss("B200", ("tp8", "tp16"), "gemm2", 1, 1024, 0.11, _SM100_WHY),
    KnownMiss("B200", ("tp8", "tp16"), "gemm1", 1025, _ALL_M[1], 0.16, _SM100_WHY),
    KnownMiss("B200", ("tp8", "tp16"), "gemm2", 1025, _ALL_M[1], 0.175, _SM100_WHY),
)


def known_miss_bound(device: str, shard: str, kind: str, M: int) -> float | None:
    """The bound a known miss holds this GEMM to, None where the loop budget applies."""
    return next((k.bound for k in KNOWN_MISSES if k.covers(device, shard, kind, M)), None)


def _versions() -> dict:
    import torch
    import triton

    out = {"triton": triton.__version__, "torch": torch.__version__, "python": sys.version.split()[0]}
    try:
        nv = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=60).stdout
        out["nvcc"] = nv.strip().splitlines()[-1] if nv else None
    except OSError:
        out["nvcc"] = None
    for pkg in ("sglang", "flashinfer-python"):
        try:
            from importlib.metadata import version

            out[pkg] = version(pkg)
        except Exception:
            out[pkg] = None
    return out


def _git(*args: str) -> str | None:
    try:
        proc = subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, timeout=60)
        return proc.stdout if proc.returncode == 0 else None
    except OSError:
        return None


def baseline_heuristic(rev: str):
    """The W4A16 heuristic of the config module at a git revision (for before/after tables):
    MoEConfig.heuristic, or heuristic_moe_config before it was a classmethod."""
    text = _git("show", f"{rev}:kernels/moe_details/config.py")
    if text is None:
        raise SystemExit(f"--baseline: cannot read kernels/moe_details/config.py at {rev!r}")
    name = "k3nvfp4.kernels.moe_details._baseline_config"
    spec = importlib.util.spec_from_loader(name, loader=None)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "k3nvfp4.kernels.moe_details"
    mod.__file__ = str(REPO / "kernels" / "moe_details" / f"_baseline_{rev}.py")
    sys.modules[name] = mod
    exec(compile(text, f"{rev}:kernels/moe_details/config.py", "exec"), mod.__dict__)
    return getattr(mod, "heuristic_moe_config", None) or mod.MoEConfig.heuristic


def _measure_job(job: tuple, ptx_dir: str | None = None) -> dict:
    """One offline compile and measurement (a worker process's task; Statics.prefetch). With
    ptx_dir, a GEMM that sums by last arrival also has its PTX written there (_write_ptx; the
    second compile_gemm is a hit in Triton's cache)."""
    from k3nvfp4.kernels.offline.compile import compile_gemm, measure_gemm

    kind, cfg, H, I, top_k, arch, kernel_id = job
    try:
        out = measure_gemm(kind, cfg, H, I, top_k, arch, scale_fmt=kernel_id)
        if ptx_dir and (kind == "gemm2" or cfg.gemm(kind).split_k > 1):
            out["ptx"] = _write_ptx(compile_gemm(kind, cfg, H, I, top_k, arch, scale_fmt=kernel_id), kind, ptx_dir)
        return out
    except Exception as e:  # reported in the row, not hidden
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


LAST_ARRIVAL_BUFFER = {"gemm1": "part_ptr", "gemm2": "buf_ptr"}  # the buffer each last-arrival sum goes through


def _any_job(job: tuple, ptx_dir: str | None = None) -> dict:
    """A W4A16 job (_measure_job) or an e4m3 one (w4a8_rows.measure_job: its tuple starts "e4m3")."""
    if job[0] == "e4m3":
        sys.path.insert(0, str(REPO / "bench"))
        import w4a8_rows

        return w4a8_rows.measure_job(job, ptx_dir)
    return _measure_job(job, ptx_dir)


def _write_ptx(compiled, kind: str, ptx_dir: str) -> dict:
    """Write a compiled kernel's PTX as <ptx_dir>/<hash>.ptx; returns its index entry: hash,
    file, the PTX parameter names (Triton's signature without constexprs) and the buffer
    parameter its last-arrival sum goes through."""
    path = pathlib.Path(ptx_dir) / f"{compiled.hash}.ptx"
    write_text_atomic(path, compiled.asm["ptx"])
    return {"hash": compiled.hash, "ptx": path.name, "kind": kind, "buffer": LAST_ARRIVAL_BUFFER[kind],
            "params": [k for k, v in compiled.src.signature.items() if v != "constexpr"]}


def _fp4_ptx_job(job: tuple, ptx_dir: str) -> dict:
    """Compile one shipped FP4-mode GEMM (its own split-K, unlike the measured rows' split 2)
    and write its PTX (a worker process's task; fp4_last_arrival_ptx)."""
    from k3nvfp4.kernels.offline.compile import compile_fp4_gemm

    kind, mode, cfg, H, I, top_k = job
    try:
        return _write_ptx(compile_fp4_gemm(kind, mode, cfg, H, I, top_k, arch=100), kind, ptx_dir)
    except Exception as e:  # reported in the index and the errors, not hidden
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def _pool_map(fn, items: list, workers: int | None) -> list:
    """fn over items in ``workers`` spawned processes (default one per CPU), in order."""
    workers = min(workers or os.cpu_count() or 1, len(items))
    if workers <= 1:
        return [fn(x) for x in items]
    import concurrent.futures as cf
    import multiprocessing as mp

    # spawn, not fork: the parent has torch's and Triton's threads running.
    with cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as pool:
        return list(pool.map(fn, items))


def fp4_last_arrival_jobs() -> dict:
    """{job: [row names]}: the FP4 modes' shipped GEMMs that sum by last arrival (GEMM2; GEMM1
    where split over K) at the report's FP4 rows (fp4_modes_model: MODES x B200_SHARDS x B200_M,
    FP4MoEConfig.heuristic for the B200), each job (kind, mode, config, H, I, top_k)."""
    sys.path.insert(0, str(REPO / "bench"))
    import fp4_modes_model as b200

    from k3nvfp4.kernels import perf_model as pm
    from k3nvfp4.kernels.moe_fp4_details.config import FP4MoEConfig

    jobs: dict = {}
    for mode in b200.MODES:
        for sname in b200.B200_SHARDS:
            s = pm.K3_SHARDS[sname]
            for M in b200.B200_M:
                cfg = FP4MoEConfig.heuristic(s.local_experts, s.hidden, s.intermediate, s.top_k, M, act_quant=mode,
                                             num_global_experts=s.global_experts, device_name="B200")
                for kind in ("gemm1", "gemm2"):
                    if kind == "gemm2" or cfg.split_k1 > 1:
                        jobs.setdefault((kind, mode, cfg, s.hidden, s.intermediate, s.top_k), []).append(
                            f"B200 k3nvfp4 {mode} {sname} M={M} {kind}")
    return jobs


def last_arrival_index(statics: "Statics", fp4_jobs: dict, fp4_results: list[dict], w4a8=None) -> dict:
    """The index of --ptx-dir: one entry per distinct compiled kernel (by Triton's hash) with
    the rows it serves; errors of compiles that wrote no PTX."""
    entries: dict = {}
    errors = []
    w4a16 = [(statics.cache.get(key, {}), statics.uses.get(key, []), job, key[2])
             for key, job in statics.jobs_seen.items()]
    for result, rows, job, fmt in w4a16:
        kind, cfg = job[0], job[1]
        if not (kind == "gemm2" or cfg.gemm(kind).split_k > 1):
            continue
        if "ptx" not in result:
            errors.append(f"sm_{job[5]} {kind} {cfg.gemm(kind).label()}: no PTX ({result.get('error', 'not compiled')})")
            continue
        e = entries.setdefault(result["ptx"]["hash"], {**result["ptx"], "family": "w4a16", "rows": [],
                                                       "label": f"w4a16 sm{job[5]} {kind} {cfg.gemm(kind).label()}"
                                                                + (" atomic" if cfg.gemm(kind).atomic_reduce else "")
                                                                + f" {fmt}"})
        e["rows"] += [f"{r} {kind}" for r in rows]
    for (job, rows), result in zip(fp4_jobs.items(), fp4_results):
        if "error" in result:
            errors.append(f"sm_100 {job[1]} {job[0]} {job[2].label()}: {result['error']}")
            continue
        e = entries.setdefault(result["hash"], {**result, "family": job[1], "rows": [],
                                                "label": f"{job[1]} sm100 {job[0]} {job[2].label()}"})
        e["rows"] += rows
    if w4a8 is not None:
        import w4a8_rows

        e4m3, e4m3_errors = w4a8_rows.last_arrival_entries(w4a8)
        errors += e4m3_errors
        for e in e4m3:
            entries.setdefault(e["hash"], e)
    return {"kernels": sorted(entries.values(), key=lambda e: e["label"]), "errors": errors}


class Statics:
    """Offline compiles of our GEMMs, cached per (GEMM launch, arch). With ``planning`` it only
    records which compiles a pass over the rows needs (the rows it returns are discarded), so that
    :meth:`prefetch` can run them in parallel before the real pass."""

    def __init__(self, planning: bool = False, ptx_dir: str | None = None):
        self.cache: dict = {}
        self.errors: list[str] = []
        self.planning = planning
        self.ptx_dir = ptx_dir  # where _measure_job writes the last-arrival GEMMs' PTX
        self.jobs: dict = {}  # key -> job tuple, in first-seen order
        self.jobs_seen: dict = {}  # key -> job tuple of every get (also when not planning)
        self.uses: dict = {}  # key -> the rows ("device checkpoint shard M=") that use it

    @staticmethod
    def _key(kind: str, cfg, shard, fmt) -> tuple:
        return (cfg.gemm(kind), (shard.hidden % cfg.block_k1 == 0, shard.intermediate % cfg.block_k2 == 0), fmt.name)

    def get(self, kind: str, cfg, shard, arch: int, fmt, row: str | None = None) -> dict:
        key = (*self._key(kind, cfg, shard, fmt), arch)
        job = (kind, cfg, shard.hidden, shard.intermediate, shard.top_k, arch, fmt.kernel_id)
        self.jobs_seen.setdefault(key, job)
        if row is not None and row not in self.uses.setdefault(key, []):
            self.uses[key].append(row)
        if self.planning:
            self.jobs.setdefault(key, job)
            return {"error": "planned"}
        if key not in self.cache:
            self._store(key, job, _measure_job(job, self.ptx_dir))
        return self.cache[key]

    def _store(self, key: tuple, job: tuple, result: dict) -> None:
        self.cache[key] = result
        if "error" in result:
            kind, cfg, arch = job[0], job[1], job[5]
            self.errors.append(f"sm_{arch} {kind} {cfg.gemm(kind).label()}: {result['error']}")

    def prefetch(self, jobs: dict, workers: int | None = None, w4a8=None, w4a8_jobs: dict | None = None) -> None:
        """Compile and measure ``jobs`` (key -> job, as a planning Statics collected them) in
        ``workers`` processes (default: one per CPU), and in the same pool the e4m3 mode's
        ``w4a8_jobs`` into ``w4a8`` (a w4a8_rows.W4A8Statics). Each compile is single-threaded:
        Triton's passes, ptxas, cuobjdump and nvdisasm one after the other, so on two cores two at
        a time halve the report's time."""
        import functools

        todo = {k: j for k, j in jobs.items() if k not in self.cache}
        todo8 = {k: j for k, j in (w4a8_jobs or {}).items() if w4a8 is not None and k not in w4a8.cache}
        # the slower e4m3 compiles first, so that the pool's last tasks are short ones
        results = _pool_map(functools.partial(_any_job, ptx_dir=self.ptx_dir),
                            list(todo8.values()) + list(todo.values()), workers)
        for (k, j), result in zip(todo.items(), results[len(todo8):]):
            self._store(k, j, result)
        for k, result in zip(todo8, results[:len(todo8)]):
            w4a8.store(k, result)


CHECKPOINTS = ("nvfp4", "mxfp4")  # the cast checkpoint (E5M3_16 layout), the MXFP4 release (E8M0_32)


def _scale_format(checkpoint: str):
    from k3nvfp4.kernels.moe_details.layout import E5M3_16, E8M0_32

    return {"nvfp4": E5M3_16, "mxfp4": E8M0_32}[checkpoint]


def our_rows(device_name: str, shard_names, m_list, statics: Statics, heuristic=None, checkpoint: str = "nvfp4"
             ) -> list[dict]:
    from k3nvfp4.kernels import perf_model as pm
    from k3nvfp4.kernels.moe_details.call_model import our_call
    from k3nvfp4.kernels.moe_details.config import get_moe_config

    device = pm.DEVICES[device_name]
    fmt = _scale_format(checkpoint)
    rows = []
    for sname in shard_names:
        shard = pm.K3_SHARDS[sname]
        for M in m_list:
            args = (shard.local_experts, shard.hidden, shard.intermediate, shard.top_k, M)
            if heuristic is None:
                cfg = get_moe_config(*args, device_name=DEVICE_NAMES[device_name], arch=device.arch,
                                     num_global_experts=shard.global_experts, scale_format=fmt)
            else:
                cfg = heuristic(*args, arch=device.arch)
            measured = {kind: statics.get(kind, cfg, shard, device.arch, fmt, f"{device_name} {checkpoint} {sname} M={M}")
                        for kind in ("gemm1", "gemm2")}
            row = {"implementation": "k3nvfp4", "checkpoint": checkpoint, "device": device_name, "arch": device.sm_tag,
                   "shard": sname, "M": M, "config": cfg.to_dict()}
            if any("error" in m for m in measured.values()):
                row["error"] = "; ".join(m["error"] for m in measured.values() if "error" in m)
                rows.append(row)
                continue
            pred = our_call(device, shard, M, cfg, {k: m["loop_cost"] for k, m in measured.items()}, fmt=fmt)
            row.update(pred.to_dict())
            budget = pm.loop_budget(M)
            for k, kern in zip(("gemm1", "gemm2"), row["kernels"]):
                m = measured[k]
                kern.update({key: m[key] for key in ("instructions_per_iteration", "weights_per_iteration", "num_warps",
                                                     "warp_instr_per_weight", "mma_per_iteration",
                                                     "local_memory_ops_in_loop", "family_mix", "opcode_mix")})
                bound = known_miss_bound(device_name, sname, k, M) or budget
                kern["budget"] = budget
                kern["meets_budget"] = kern["warp_instr_per_useful_weight"] <= budget
                kern["ok"] = (kern["launchable"] and kern["local_bytes"] == 0
                              and kern["warp_instr_per_useful_weight"] <= bound)
            row["ok"] = all(k["ok"] for k in row["kernels"])
            rows.append(row)
    return rows


def _peer_rows(implementation: str, call, statics, m_list) -> list[dict]:
    """call(device, statics, shard, M) -> CallPrediction for every H200 shard and M; a shard the
    peer cannot run gets a row with the reason."""
    from k3nvfp4.kernels import perf_model as pm

    rows = []
    for sname in DEVICE_SHARDS["H200"]:
        for M in m_list:
            try:
                rows.append(call(pm.H200, statics, pm.K3_SHARDS[sname], M).to_dict())
            except RuntimeError as e:
                rows.append({"implementation": implementation, "device": "H200", "shard": sname, "M": M,
                             "error": f"not runnable: {e}"})
    return rows


def marlin_section(m_list) -> dict:
    """Marlin under the model (H200), and the model's error against published timings."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from peers.marlin_model import marlin_call, validation
        from peers.marlin_sass import marlin_statics

        statics = marlin_statics(90, str(REPO / "build" / "peers" / "marlin"))
    except Exception as e:
        return {"available": False, "reason": f"{type(e).__name__}: {e}", "rows": [], "validation": []}
    rows = _peer_rows("marlin", marlin_call, statics, m_list)
    return {"available": True, "sglang": statics.src.version, "nvcc": statics.nvcc[1], "rows": rows,
            "validation": validation(statics)}


def flashinfer_section(m_list) -> dict:
    """FlashInfer's SM90 CUTLASS W4A16 MoE (MXFP4 x bf16) under the model (H200, I % 128 == 0)."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from peers.flashinfer_model import flashinfer_call
        from peers.flashinfer_sass import flashinfer_rows

        statics = flashinfer_rows(90, str(REPO / "build" / "peers" / "flashinfer"))
    except Exception as e:
        return {"available": False, "reason": f"{type(e).__name__}: {e}", "rows": []}
    rows = _peer_rows("flashinfer", flashinfer_call, statics, m_list)
    return {"available": True, "statics": [{k: v for k, v in r.items() if k not in ("opcode_mix",)} for r in statics],
            "rows": rows}


def flashinfer_w4a8_section(m_list) -> dict:
    """FlashInfer's SM90 CUTLASS W4A8 MoE (MXFP4 x FP8, use_wfp4afp8_humming) under the model
    (H200, I % 128 == 0): each GEMM at the fastest measured kernel the binding admits."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from peers.flashinfer_model import flashinfer_w4a8_call
        from peers.flashinfer_sass import flashinfer_w4a8_rows

        statics = flashinfer_w4a8_rows(str(REPO / "build" / "peers" / "flashinfer"))
    except Exception as e:
        return {"available": False, "reason": f"{type(e).__name__}: {e}", "rows": []}
    rows = _peer_rows("flashinfer w4a8", flashinfer_w4a8_call, statics, m_list)
    return {"available": True, "statics": [{k: v for k, v in r.items() if k not in ("opcode_mix", "nvcc_command")}
                                           for r in statics], "rows": rows}


def fp4_mode_rows(arch: int) -> list[dict]:
    """The FP4 tensor-core modes' GEMMs (act_quant nvfp4 / mxfp8) on Blackwell: tcgen05 MMA kind,
    block scaling, no decomposition (no wgmma / mma.sync), registers and spill bytes."""
    from k3nvfp4.kernels.offline.compile import compile_all_fp4

    rows = compile_all_fp4(arch)
    for r in rows:
        if "error" not in r:
            want = "kind::mxf4nvf4" if "nvfp4" in r["kernel"] else "kind::mxf8f6f4"
            r["native"] = r["tcgen05_mma"] > 0 and r["kinds"] == [want] and r["wgmma"] == 0 and r["mma_sync"] == 0
    return rows


def _kern(r: dict, i: int) -> dict:
    return r["kernels"][i] if "kernels" in r and len(r["kernels"]) > i else {}


def markdown(result: dict) -> str:
    from k3nvfp4.kernels import perf_model as pm

    a = result["assumptions"]
    lines = [
        f"Static performance model, {result['date']}, Triton {result['versions']['triton']}, "
        f"`python -P bench/sass_report.py`. Per GEMM: config, CTAs per SM (limit), waves, warp-instructions per "
        f"useful weight (budget {pm.loop_budget(1):.2f} to M = 1024, {pm.loop_budget(4096):.2f} above), "
        f"bound. Per call: launches, bytes per useful weight, predicted time. Assumptions: HBM latency "
        f"{a['hbm_latency_s'] * 1e9:.0f} ns, L2 round trip {a['l2_round_trip_s'] * 1e9:.0f} ns, "
        f"{a['launch_s'] * 1e6:.1f} us per launch, stores and reductions "
        + ("held to the weights' bytes in flight like loads" if a.get("stores_in_flight", True)
           else "at the copy bandwidth only")
        + " (`k3nvfp4.kernels.perf_model.Assumptions`; the issue-38 targets under the other reading: "
        "`bench/inflight_sensitivity.py`).",
        "",
        "Checkpoint nvfp4: the cast's NVFP4 (our E5M3_16 layout; marlin NVFP4 next to it); mxfp4: the MXFP4 "
        "release served directly (our E8M0_32 layout; FlashInfer's MXFP4 next to it).",
        "",
        "| device | ckpt | shard | M | GEMM1 | CTAs/SM | waves | instr/useful w | GEMM2 | CTAs/SM | waves | instr/useful w "
        "| launches | B/useful w | predicted us | marlin us | FlashInfer us | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    peers = {}
    for sec in ("marlin", "flashinfer"):
        for r in result[sec]["rows"]:
            peers[(sec, r["device"], r["shard"], r["M"])] = r
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['device']} | {r['checkpoint']} | {r['shard']} | {r['M']} | error: {r['error'][:100]} |"
                         + " |" * 13)
            continue
        g1, g2 = _kern(r, 0), _kern(r, 1)
        cells = [r["device"], r["checkpoint"], r["shard"], str(r["M"])]
        for g in (g1, g2):
            short = " ".join(w for w in g["config"].split() if w not in ("s3", "sk1"))
            cells += [short, f"{g['ctas_per_sm']} ({g['occupancy_limit']})",
                      f"{g['waves']:.2f}", f"{g['warp_instr_per_useful_weight']:.3f} ({g['bound']})"]
        nv = r["checkpoint"] == "nvfp4"
        mp = peers.get(("marlin", r["device"], r["shard"], r["M"])) if nv else None
        fp = peers.get(("flashinfer", r["device"], r["shard"], r["M"])) if not nv else None
        cells += [str(r["launches"]), f"{r['bytes_per_useful_weight']:.3f}", f"{r['time_us']:.1f}",
                  "-" if not mp else ("n/a" if "error" in mp else f"{mp['time_us']:.1f}"),
                  "-" if not fp else ("n/a" if "error" in fp else f"{fp['time_us']:.1f}"),
                  "yes" if r["ok"] else "NO"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *floor_markdown(result["floor"])]
    v = result["marlin"].get("validation") or []
    if v:
        lines += ["", "Marlin under the model against published H200 timings (K3 TP16, SGLang 0.5.14, SiLU; "
                  "ai-dynamo aiconfigurator):", "", "| M | published us | model us | model / published |",
                  "|---|---|---|---|"]
        for p in v:
            pub = p["published_us"]
            lines.append(f"| {p['M']} | {pub[0] if pub[0] == pub[1] else f'{pub[0]}-{pub[1]}'} | {p['model_us']:.1f} "
                         f"| {p['ratio_model_over_published']:.2f} |")
        ok = all(p["within_1_5x"] for p in v)
        lines += ["", "The model predicts marlin within a factor of 1.5 at "
                  + ("every published point." if ok else
                     f"{sum(p['within_1_5x'] for p in v)} of {len(v)} published points: its absolute times are "
                     "NOT performance claims (see bench/README.md, 'What the model misses').")]
    if result.get("b200"):
        import fp4_modes_model as b200

        lines += ["", *b200.markdown(result["b200"]["fp4"], result["b200"]["w4a16"])]
    if result.get("fp4_modes"):
        lines += ["", "FP4 tensor-core modes (`fused_moe_nvfp4` on FP4MMAWeights), sm_100, K3 TP16 shapes: the MMA "
                  "each GEMM compiles to (`k3nvfp4.kernels.offline.compile`):", "",
                  "| kernel | tcgen05.mma | kind | block scale | wgmma / mma.sync | regs | spill B | native |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in result["fp4_modes"]:
            if "error" in r:
                lines.append(f"| {r['kernel']} | error: {r['error'][:80]} |||||||")
                continue
            lines.append(f"| {r['kernel']} | {r['tcgen05_mma']} | {', '.join(r['kinds'])} | {', '.join(r['block_scale'])} | "
                         f"{r['wgmma']} / {r['mma_sync']} | {r['registers']} | {r['local_bytes']} | "
                         f"{'yes' if r['native'] else 'NO'} |")
    if result.get("e4m3"):
        import w4a8_rows

        lines += ["", *w4a8_rows.markdown(result)]
    for sec in ("marlin", "flashinfer", "flashinfer_w4a8"):
        if not result.get(sec, {"available": True})["available"]:
            # the reason's head and its last line (a compiler's verdict comes after its warnings)
            first, *rest = result[sec]["reason"].strip().splitlines() or [""]
            lines.append(f"\n- {sec}: not available: {first[:300]}" + (f" ... {rest[-1][:200]}" if rest else ""))
    for e in result["errors"]:
        lines.append(f"\n- {e}")
    return "\n".join(lines) + "\n"


def floor_rows(result: dict) -> list[dict]:
    """Bytes and time per weight at memory speed, per implementation and checkpoint format, on
    the H200: max(bytes / HBM bandwidth, warp-instructions / issue rate) per useful weight, with
    the hot loops' instructions per useful weight of the weight GEMMs (median and worst over the
    shards at M <= 1024: what decode and mid batches stream)."""
    from statistics import median

    from k3nvfp4.kernels import perf_model as pm

    dev = pm.H200
    peers = {}  # implementation: (checkpoint, bytes per weight of its weight stream, from its model)
    if result["marlin"]["rows"]:
        from peers.marlin_model import MARLIN_BYTES_PER_WEIGHT  # importable once marlin_section ran

        peers["marlin"] = ("nvfp4", MARLIN_BYTES_PER_WEIGHT)
    if result["flashinfer"]["rows"]:
        peers["flashinfer"] = ("mxfp4", result["flashinfer"]["statics"][0]["bytes_per_weight"])

    def loops(rows, pick):
        return [k["warp_instr_per_useful_weight"] for r in rows if "error" not in r and r.get("device", "H200") == "H200"
                and r["M"] <= 1024 for k in r["kernels"] if pick(k)]

    out = []

    def add(impl, ckpt, bpw, ipw, note=""):
        if not ipw:
            return
        med, worst = median(ipw), max(ipw)
        t = lambda i: max(bpw / dev.hbm_bytes_per_s, i / dev.issue_rate) * 1e12  # noqa: E731
        out.append({"implementation": impl, "checkpoint": ckpt, "bytes_per_weight": bpw,
                    "warp_instr_per_useful_weight_median": round(med, 4), "warp_instr_per_useful_weight_worst": round(worst, 4),
                    "ps_per_weight_median": round(t(med), 4), "ps_per_weight_worst": round(t(worst), 4), "note": note})

    for ckpt in CHECKPOINTS:
        rows = [r for r in result["rows"] if r.get("checkpoint") == ckpt]
        add("k3nvfp4", ckpt, _scale_format(ckpt).bytes_per_weight, loops(rows, lambda k: True))
    for sec, (ckpt, bpw) in peers.items():
        ipw = loops(result[sec]["rows"], lambda k: k.get("useful_weights", 0) > 0)
        add(sec, ckpt, bpw, ipw)
        if sec == "marlin":  # the MXFP4 release through marlin: E8M0 per 32, the NVFP4 instantiation's loop
            add(sec, "mxfp4", _scale_format("mxfp4").bytes_per_weight, ipw, "loop of marlin's NVFP4 instantiation")
    return out


def floor_markdown(rows: list[dict]) -> list[str]:
    from k3nvfp4.kernels import perf_model as pm

    lines = [f"Time per weight at memory speed on the H200 (max(bytes / {pm.H200.hbm_bytes_per_s / 1e12:.1f} TB/s, "
             f"warp-instructions / {pm.H200.issue_rate / 1e12:.2f}e12 per s); loops of the weight GEMMs at "
             "M <= 1024, median and worst over the shards):", "",
             "| implementation | checkpoint | B / weight | instr / useful w (median, worst) | ps / weight (median, worst) | note |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['implementation']} | {r['checkpoint']} | {r['bytes_per_weight']:.5g} | "
                     f"{r['warp_instr_per_useful_weight_median']:.3f}, {r['warp_instr_per_useful_weight_worst']:.3f} | "
                     f"{r['ps_per_weight_median']:.3f}, {r['ps_per_weight_worst']:.3f} | {r['note']} |")
    return lines


def write_readme(md: str, path: pathlib.Path) -> None:
    text = path.read_text()
    if README_BEGIN not in text or README_END not in text:
        raise SystemExit(f"{path}: markers {README_BEGIN} / {README_END} not found")
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    write_text_atomic(path, head + README_BEGIN + "\n" + md + README_END + tail)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--devices", default="H200,B200", help="comma list of H200, B200")
    p.add_argument("--shards", "--shapes", default=None,
                   help="comma list of tp8,tp16,tp32,ep8,ep16,ep32 (default: H200 all six, B200 tp8,tp16)")
    p.add_argument("--m-list", default=",".join(map(str, DEFAULT_M)), help="batch sizes (tokens per rank)")
    p.add_argument("--no-peers", action="store_true", help="skip marlin and FlashInfer (nvcc builds)")
    p.add_argument("--baseline", default=None, metavar="REV",
                   help="use the heuristic of git revision REV instead of get_moe_config (before/after)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/perf-model.json)")
    p.add_argument("--workers", type=int, default=None,
                   help="compile processes (default: one per CPU; each compile is single-threaded)")
    p.add_argument("--write-readme", action="store_true", help="replace the table in bench/README.md")
    p.add_argument("--check", action="store_true",
                   help="also the change detectors (report_check.py): stale tile tables, and every row against "
                        "the committed report; exit 1 naming what moved")
    p.add_argument("--ptx-dir", default=None,
                   help="also write the PTX of every distinct compiled last-arrival kernel there, with index.json "
                        "(tests/test_memory_ordering.py)")
    p.add_argument("--committed", default=str(REPO / "bench" / "results" / "perf-model.json"),
                   help="with --check: the report to compare with (default: the committed one)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("sass_report: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)", file=sys.stderr)
        return 2
    from k3nvfp4.kernels import perf_model as pm

    devices = args.devices.split(",")
    for d in devices:
        if d not in DEVICE_SHARDS:
            print(f"--devices: unknown device {d!r} (known: {', '.join(DEVICE_SHARDS)})", file=sys.stderr)
            return 2
    if args.shards:
        shards = args.shards.split(",")
        bad = [s for s in shards if s not in pm.K3_SHARDS]
        if bad:
            print(f"--shards: unknown shard(s) {bad} (known: {', '.join(pm.K3_SHARDS)})", file=sys.stderr)
            return 2
    try:
        m_list = [int(m) for m in args.m_list.split(",")]
    except ValueError:
        print(f"--m-list: expected comma-separated integers, got {args.m_list!r}", file=sys.stderr)
        return 2
    heuristic = baseline_heuristic(args.baseline) if args.baseline else None
    statics = Statics(ptx_dir=args.ptx_dir)
    if args.ptx_dir:
        pathlib.Path(args.ptx_dir).mkdir(parents=True, exist_ok=True)
    passes = [(d, args.shards.split(",") if args.shards else DEVICE_SHARDS[d], ckpt)
              for d in devices for ckpt in (CHECKPOINTS if not args.baseline else ("nvfp4",))]
    plan = Statics(planning=True)  # which compiles the rows need, then all of them in parallel
    for d, shards, ckpt in passes:
        our_rows(d, shards, m_list, plan, heuristic, ckpt)
    w4a8 = None  # the Hopper W4A8 (e4m3) rows: H200, every shard and M of the W4A16 rows, both checkpoints x tables
    if "H200" in devices and not args.baseline:
        sys.path.insert(0, str(REPO / "bench"))
        import w4a8_rows

        w4a8_shards = args.shards.split(",") if args.shards else DEVICE_SHARDS["H200"]
        w4a8_plan, w4a8 = w4a8_rows.W4A8Statics(planning=True), w4a8_rows.W4A8Statics()
        for ckpt in CHECKPOINTS:
            for table in w4a8_rows.TABLES:
                w4a8_rows.rows(w4a8_shards, m_list, w4a8_plan, ckpt, table)
    statics.prefetch(plan.jobs, args.workers, w4a8, w4a8_plan.jobs if w4a8 is not None else None)
    fp4_ptx = None
    if args.ptx_dir and "B200" in devices and not args.baseline:
        import functools

        fp4_jobs = fp4_last_arrival_jobs()
        fp4_ptx = (fp4_jobs, _pool_map(functools.partial(_fp4_ptx_job, ptx_dir=args.ptx_dir), list(fp4_jobs),
                                       args.workers))
    rows = []
    for d, shards, ckpt in passes:
        rows += our_rows(d, shards, m_list, statics, heuristic, ckpt)
    skip = {"available": False, "reason": "--no-peers", "rows": [], "validation": []}
    result = {
        "device": "offline compile and static model (no GPU)",
        "date": _dt.date.today().isoformat(),
        "git_commit": (_git("rev-parse", "HEAD") or "").strip() or None,
        "baseline": args.baseline,
        "versions": _versions(),
        "devices": {d: dict(pm.DEVICES[d].__dict__) for d in devices},
        "assumptions": dict(pm.DEFAULT_ASSUMPTIONS.__dict__),
        "known_misses": [asdict(k) for k in KNOWN_MISSES],
        "rows": rows,
        "marlin": skip if args.no_peers or "H200" not in devices else marlin_section(m_list),
        "flashinfer": skip if args.no_peers or "H200" not in devices else flashinfer_section(m_list),
        "flashinfer_w4a8": skip if args.no_peers or "H200" not in devices else flashinfer_w4a8_section(m_list),
        "errors": statics.errors,
    }
    result["floor"] = floor_rows(result)
    if w4a8 is not None:
        result["e4m3"] = {"rows": [r for ckpt in CHECKPOINTS for table in w4a8_rows.TABLES
                                   for r in w4a8_rows.rows(w4a8_shards, m_list, w4a8, ckpt, table)]}
        w4a8_rows.compare(result)
        result["e4m3"]["targets"] = w4a8_rows.targets(result)
        statics.errors += w4a8.errors
    if "B200" in devices and not args.baseline:
        result["fp4_modes"] = fp4_mode_rows(100)
        sys.path.insert(0, str(REPO / "bench"))
        import fp4_modes_model as b200

        result["b200"] = {"fp4": b200.fp4_rows(statics.errors), "w4a16": b200.w4a16_rows(our_rows, statics),
                          "flashinfer_published_tp8_us": b200.FLASHINFER_B200_TP8_US,
                          "before_commit": b200.BEFORE_COMMIT}
    if args.ptx_dir:
        index = last_arrival_index(statics, *(fp4_ptx or ({}, [])), w4a8=w4a8)
        statics.errors += index["errors"]
        write_json_atomic(pathlib.Path(args.ptx_dir) / "index.json", index, indent=1)
        result["last_arrival_kernels"] = len(index["kernels"])
    out = pathlib.Path(args.out) if args.out else REPO / "bench" / "results" / "perf-model.json"
    write_json_atomic(out, result, indent=1)
    md = markdown(result)
    print(md)
    print(f"wrote {out}")
    if args.write_readme:
        write_readme(md, REPO / "bench" / "README.md")
        print("updated bench/README.md")
    fp4_ok = (all(r.get("native") for r in result.get("fp4_modes", []))
              and all(r.get("ok") for r in result.get("b200", {}).get("fp4", [])))
    e4m3_ok = all(r.get("ok") or r.get("error", "").startswith("not runnable")
                  for r in result.get("e4m3", {}).get("rows", []))
    failed = bool(statics.errors or not fp4_ok or not e4m3_ok or not all(r.get("ok") for r in rows))
    if args.check:
        sys.path.insert(0, str(REPO / "bench"))
        import report_check

        findings = report_check.run_checks(result, pathlib.Path(args.committed))
        print(f"\n--check against {args.committed}: " + ("nothing moved, no stale table" if not findings else
                                                           f"{len(findings)} finding(s)"))
        for f in findings:
            print(f"  {f}")
        failed = failed or bool(findings)
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception:
        traceback.print_exc()
        sys.exit(1)
