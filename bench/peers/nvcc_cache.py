"""nvcc builds of peer kernels to cubins, in parallel and cached: one place for finding nvcc and for
the cache rule both peers (marlin_sass, flashinfer_sass) use.

A translation unit ``name`` is written to ``out/name.cu`` and compiled to ``out/name.cubin``; the
build's key (the caller's inputs: versions, source hashes, flags, plus the unit's own hash) goes
to ``out/name.key.json``. A cubin whose recorded key equals the current one is reused.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable


def find_nvcc() -> tuple[str, str]:
    """(path, version) of nvcc, looked up as SGLang's and FlashInfer's JITs do: CUDA_HOME /
    CUDA_PATH, then PATH, then /usr/local/cuda. RuntimeError when absent."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    in_home = os.path.join(home, "bin", "nvcc") if home else ""
    fallback = "/usr/local/cuda/bin/nvcc"
    nvcc = (in_home if os.path.isfile(in_home) else None) or shutil.which("nvcc") or (
        fallback if os.path.isfile(fallback) else None)
    if nvcc is None:
        raise RuntimeError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, timeout=60).stdout
    m = re.search(r"release [\d.]+, V([\d.]+)", out)
    if not m:
        raise RuntimeError(f"cannot parse `{nvcc} --version`: {out.strip()[-200:]}")
    return nvcc, m.group(1)


def require_cuobjdump() -> None:
    """RuntimeError unless Triton bundles cuobjdump (the disassembler every peer measurement uses)."""
    from k3nvfp4.kernels.offline import sass

    try:
        sass.tool("cuobjdump")
    except FileNotFoundError as e:
        raise RuntimeError(str(e)) from e


@dataclass
class Build:
    cubin: bytes
    seconds: float  # compile wall time of this run; 0 when the cached cubin was reused
    cached: bool
    path: pathlib.Path
    command: list[str]
    recorded_seconds: float | None = None  # compile wall time recorded when the cubin was built


# A CUTLASS MoE translation unit takes nvcc (cicc + ptxas) several GB; on a 2-core, 24 GiB machine
# three at once were killed by the OOM killer (exit 137). Builds run at most this many at a time.
NVCC_JOBS_ENV = "K3NVFP4_NVCC_JOBS"
GIB_PER_BUILD = 8


def nvcc_jobs() -> int:
    """Builds at a time: $K3NVFP4_NVCC_JOBS, else min(CPUs, available memory / 8 GiB), at least 1."""
    raw = os.environ.get(NVCC_JOBS_ENV, "").strip()
    if raw:
        try:
            jobs = int(raw)
        except ValueError:
            jobs = 0
        if jobs < 1:
            raise RuntimeError(f"${NVCC_JOBS_ENV}={raw!r}: expected a whole number of builds >= 1")
        return jobs
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        avail = GIB_PER_BUILD << 30
    return max(1, min(os.cpu_count() or 1, avail // (GIB_PER_BUILD << 30)))


def build_all(tus: dict[str, str], out: pathlib.Path, key: dict[str, Any],
              command: Callable[[pathlib.Path, pathlib.Path], list[str]],
              raise_on_error: bool = True, timeout_s: int = 1800) -> dict[str, Build | str]:
    """Compile each translation unit {name: source text} to a cubin, :func:`nvcc_jobs` nvcc
    processes at a time, reusing cached cubins. key: what the cubins depend on besides their text;
    command(cu, cubin): the nvcc command line. A failed build raises RuntimeError, or with
    raise_on_error=False maps to its error text. Each build's output goes to out/<name>.log."""
    todo, cached, cmds = [], set(), {}
    for name, text in tus.items():
        cu, cubin, keyf = out / f"{name}.cu", out / f"{name}.cubin", out / f"{name}.key.json"
        cmds[name] = command(cu, cubin)
        full_key = {**key, "source_sha256": hashlib.sha256(text.encode()).hexdigest()}
        try:
            fresh = cubin.is_file() and json.loads(keyf.read_text()).get("key") == full_key
        except (OSError, ValueError):
            fresh = False
        if fresh:
            cached.add(name)
            continue
        out.mkdir(parents=True, exist_ok=True)
        cu.write_text(text)
        keyf.unlink(missing_ok=True)
        cubin.unlink(missing_ok=True)
        todo.append((name, full_key, cmds[name]))
    errors: dict[str, str] = {}
    seconds: dict[str, float] = {}
    running: list = []
    jobs = nvcc_jobs() if todo else 1
    try:
        while todo or running:
            while todo and len(running) < jobs:
                name, full_key, cmd = todo.pop(0)
                log = open(out / f"{name}.log", "w")
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
                log.close()
                running.append((name, full_key, cmd, proc, time.monotonic()))
            name, full_key, cmd, proc, t0 = running.pop(0)
            try:
                proc.wait(timeout=max(timeout_s - (time.monotonic() - t0), 1))
                text = (out / f"{name}.log").read_text(errors="replace")
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                text = f"timed out after {timeout_s} s"
            seconds[name] = time.monotonic() - t0
            if proc.returncode != 0 or not (out / f"{name}.cubin").is_file():
                hint = (" (killed: out of memory? fewer builds at a time: "
                        f"{NVCC_JOBS_ENV}=1)") if proc.returncode in (-9, 137) else ""
                errors[name] = f"nvcc failed ({proc.returncode}){hint} on {out / name}.cu: {text[-3000:]}"
                if raise_on_error:
                    raise RuntimeError(errors[name])
                continue
            (out / f"{name}.key.json").write_text(json.dumps(
                {"key": full_key, "command": cmd, "compile_seconds": round(seconds[name], 1)}, indent=1))
    finally:
        for _, _, _, proc, _ in running:  # an error left others building: stop them
            proc.kill()
            proc.wait()
    builds: dict[str, Build | str] = {}
    for name in tus:
        if name in errors:
            builds[name] = errors[name]
            continue
        cubin, keyf = out / f"{name}.cubin", out / f"{name}.key.json"
        try:
            recorded = json.loads(keyf.read_text()).get("compile_seconds")
        except (OSError, ValueError):
            recorded = None
        builds[name] = Build(cubin.read_bytes(), seconds.get(name, 0.0), name in cached, cubin, cmds[name], recorded)
    return builds


def print_rows(rows_fn: Callable[[], list[dict[str, Any]]]) -> int:
    """A peer module's command line: its rows as JSON, or "not available: <reason>" and exit 2."""
    try:
        rows = rows_fn()
    except RuntimeError as e:
        print(f"not available: {e}", file=sys.stderr)
        return 2
    print(json.dumps(rows, indent=2))
    return 0
