"""Memory ordering of the last-arrival sums, checked in the compiled PTX of the real kernels.

Every shipped config that sums by last arrival (GEMM1 split-K slices, GEMM2 top-k rows; W4A16 on
sm90 and sm100 at the K3 shards TP16 / EP16 / TP32, the FP4 modes on sm100 at TP8 / TP16, M in
1 .. 4096) is compiled offline and its PTX must show, at every arrival atomic: the partials'
global stores, bar.sync, atom.global.gpu.acq_rel, bar.sync, then the last arrival's loads
(tests/ptx_ordering.py; docs/kernels.md, "Memory ordering of the last-arrival sums", says why
that suffices under the PTX memory model). Kernel variants with a relaxed or CTA-scoped atomic,
and PTX with either barrier removed or a store moved past it, must fail the same check.

Three subprocesses (no TRITON_INTERPRET: the kernels cannot be compiled under the interpreter),
run at once: about 140 s on 2 cores from an empty Triton cache.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from ptx_ordering import arrival_atomics, violations

SCRIPT = pathlib.Path(__file__).resolve().parent / "ptx_ordering.py"
MUTANTS = {"relaxed": "semantics are not acq_rel", "cta_scope": "scope is not gpu"}


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict[str, list[tuple[str, str]]]:
    """{"shipped" | mutant name: [(label, ptx)]}; the mutants compile the first two configs
    (W4A16 TP16 decode: GEMM1 split-K 2 and GEMM2's top-k sum)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = tmp_path_factory.mktemp("ptx")
    runs = {"shipped": []} | {m: ["--mutant", m, "--limit", "2"] for m in MUTANTS}
    procs = {name: subprocess.Popen([sys.executable, "-P", str(SCRIPT), "--out", str(root / name), *extra],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for name, extra in runs.items()}
    out = {}
    for name, proc in procs.items():
        _stdout, stderr = proc.communicate(timeout=1200)
        assert proc.returncode == 0, f"{name}: {stderr[-4000:]}"
        index = json.loads((root / name / "index.json").read_text())
        out[name] = [(r["label"], (root / name / r["ptx"]).read_text()) for r in index]
    return out


def test_every_shipped_last_arrival_config_releases_and_acquires(compiled):
    shipped = compiled["shipped"]
    labels = [label for label, _ in shipped]
    # Both sums, both families, both architectures are among what was checked.
    assert any("w4a16 sm90" in l and " sk2 " in l for l in labels) and any("w4a16 sm100" in l for l in labels)
    assert any(l.startswith("nvfp4 sm100") and "gemm1" in l for l in labels)
    assert any(l.startswith("mxfp8 sm100") and "gemm2" in l for l in labels)
    assert any(" atomic" in l for l in labels)  # GEMM2's fp32-atomic top-k sum also arrives
    failures = {label: v for label, ptx in shipped if (v := violations(ptx))}
    assert failures == {}
    for label, ptx in shipped:
        assert len(arrival_atomics(ptx)) == 1, label  # one arrival per program: the counter


@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_kernel_without_the_ordering_fails(compiled, mutant):
    runs = compiled[mutant]
    assert len(runs) == 2
    for label, ptx in runs:
        v = violations(ptx)
        assert v and all(MUTANTS[mutant] in x for x in v), (label, v)


def _drop_barriers(ptx: str, after: bool) -> str:
    """The real PTX with every bar.sync removed between the arrival atomic and the last global
    store before it (after=False) or the first global load after it (after=True)."""
    lines = ptx.splitlines()
    i = next(n for n, l in enumerate(lines) if re.search(r"\batom\.global\.\S*\.add\.u32", l))
    if after:
        end = next(n for n in range(i, len(lines)) if "ld.global" in lines[n])
        span = range(i, end)
    else:
        start = max(n for n in range(i) if "st.global" in lines[n])
        span = range(start, i)
    return "\n".join(l for n, l in enumerate(lines) if not (n in span and "bar.sync" in l))


def _store_after_barrier(ptx: str) -> str:
    """The real PTX with one global store moved between the barrier and the atomic."""
    lines = ptx.splitlines()
    i = next(n for n, l in enumerate(lines) if re.search(r"\batom\.global\.\S*\.add\.u32", l))
    s = max(n for n in range(i) if "st.global" in lines[n])
    store = lines.pop(s)
    lines.insert(i - 1, store)
    return "\n".join(lines)


BEFORE = ("a global store between the barrier and the atomic", "lies between the atomic and its barrier",
          "no bar.sync before")
AFTER = ("a global load before the barrier", "a label between the atomic and the barrier after it",
         "no bar.sync after")


@pytest.mark.parametrize("mutation,expected", [
    (lambda p: _drop_barriers(p, after=False), BEFORE),
    (lambda p: _drop_barriers(p, after=True), AFTER),
    (_store_after_barrier, ("a global store between the barrier and the atomic",)),
    (lambda p: p.replace(".acq_rel.add.u32", ".release.add.u32"), ("semantics are not acq_rel",)),
])
def test_ptx_without_a_barrier_fails(compiled, mutation, expected):
    """The barriers' part of the check. A kernel variant without skeleton.arrive's debug_barrier
    still compiles to a bar.sync before the atomic today (Triton's membar pass guards the shared
    scratch that broadcasts the atomic's result), so the barrier mutations are made on the PTX."""
    for label, ptx in compiled["shipped"][:2]:
        assert violations(ptx) == []
        v = violations(mutation(ptx))
        assert any(e in x for x in v for e in expected), (label, v)
