"""Memory ordering of the last-arrival sums, checked as dataflow in the compiled PTX of the real
kernels (tests/ptx_ordering.py; docs/kernels.md, "Memory ordering of the last-arrival sums", says
why the rule suffices under the PTX memory model).

Every shipped kernel: the compiles are the static report's (bench/sass_report.py --ptx-dir, run
once per test session and shared with tests/test_launch_configs.py: tests/shared_compiles.py):
every device, shard and M the report lists, both checkpoint formats, every family (W4A16 on
sm90 / sm100, the FP4 modes on sm100, the Hopper W4A8 mode e4m3 on sm90), each distinct compiled
kernel (by Triton's hash) once. At
every arrival atomic, every store to the sum's buffer lies before a bar.sync that precedes it on
every path, the atomic is acq_rel at GPU scope, and every load of the buffer follows it through
a bar.sync.

Source mutants of the skeleton (tests/skeleton_mutants.py), compiled in a subprocess each
(tests/ptx_ordering.py --mutant, started at once and run beside the report), must fail the same
check, and so must PTX with a barrier removed or a store moved. The interpreter's counterpart,
the weak-memory adversary, is tests/test_weak_memory.py.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from ptx_ordering import Program, violations
from skeleton_mutants import MUTANTS

SCRIPT = pathlib.Path(__file__).resolve().parent / "ptx_ordering.py"
# What each source mutant's compiled kernels must be told (None: see test_barrier_mutant_...).
EXPECTED = {"up_after_arrive": "a store to the buffer after the arrival",
            "topk_after_arrive": "a store to the buffer after the arrival",
            "relaxed": "semantics are not acq_rel", "cta_scope": "scope is not gpu", "no_barrier": None}


@pytest.fixture(scope="module")
def mutant_run(tmp_path_factory):
    """One subprocess compiling every mutant (a process each, one after another), started before
    the shared report is waited for, so that both compile at once."""
    root = tmp_path_factory.mktemp("mutants")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    args = [a for m in MUTANTS for a in ("--mutant", m)]
    proc = subprocess.Popen([sys.executable, "-P", str(SCRIPT), "--out", str(root), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    yield root, proc
    if proc.poll() is None:
        proc.kill()


@pytest.fixture(scope="module")
def mutants(mutant_run) -> dict[str, list[dict]]:
    """{mutant: [index entry + "text": the PTX]}."""
    root, proc = mutant_run
    _out, err = proc.communicate(timeout=2400)
    assert proc.returncode == 0, err[-4000:]
    out = {}
    for m in MUTANTS:
        index = json.loads((root / m / "index.json").read_text())
        out[m] = [{**e, "text": (root / m / e["ptx"]).read_text()} for e in index]
    return out


@pytest.fixture(scope="module")
def shipped(mutant_run, static_report) -> list[dict]:
    """The report's last-arrival kernels, each with its PTX ("text")."""
    assert static_report.result is not None, static_report.stderr_tail
    index = static_report.index()
    assert index["errors"] == [], index["errors"]
    return [{**e, "text": (static_report.ptx_dir / e["ptx"]).read_text()} for e in index["kernels"]]


def _expected_rows(result: dict) -> set[str]:
    """Every (report row, GEMM) that sums by last arrival: GEMM2 always, GEMM1 when split over K."""
    rows = set()
    for r in result["rows"]:
        name = f"{r['device']} {r['checkpoint']} {r['shard']} M={r['M']}"
        rows |= {f"{name} gemm2"} | ({f"{name} gemm1"} if r["config"]["split_k1"] > 1 else set())
    for r in result["b200"]["fp4"]:
        split_k1 = int(re.search(r"\bsk(\d+)/\d+", r["config"]).group(1))
        name = f"B200 {r['implementation']} {r['shard']} M={r['M']}"
        rows |= {f"{name} gemm2"} | ({f"{name} gemm1"} if split_k1 > 1 else set())
    for r in result["e4m3"]["rows"]:
        if "config" in r:
            name = f"H200 e4m3 {r['checkpoint']} {r['table']} {r['shard']} M={r['M']}"
            rows |= {f"{name} gemm2"} | ({f"{name} gemm1"} if r["config"]["split_k1"] > 1 else set())
    return rows


def test_every_shipped_last_arrival_kernel_releases_and_acquires(shipped, static_report):
    result = static_report.result
    families = {f: sum(e["family"] == f for e in shipped) for f in ("w4a16", "nvfp4", "mxfp8", "e4m3")}
    print(f"\n{len(shipped)} distinct last-arrival kernels checked ({families}); the report lists "
          f"{result['last_arrival_kernels']}")
    assert len(shipped) == result["last_arrival_kernels"]
    assert len({e["hash"] for e in shipped}) == len(shipped)
    # Each row of the report that sums by last arrival is served by a checked kernel, and no other.
    assert {row for e in shipped for row in e["rows"]} == _expected_rows(result)
    # Both sums, both families, both architectures, both top-k reductions are among them.
    labels = [e["label"] for e in shipped]
    assert any(lb.startswith("w4a16 sm90 gemm1") for lb in labels) and any(lb.startswith("w4a16 sm100") for lb in labels)
    assert all(families.values()) and any(" atomic" in lb for lb in labels)
    assert any(lb.startswith(("nvfp4 sm100 gemm1", "mxfp8 sm100 gemm1")) for lb in labels)
    assert any(lb.startswith("e4m3 sm90 gemm1") for lb in labels) and any(
        lb.startswith("e4m3 sm90 gemm2") and " atomic" in lb for lb in labels)
    failures = {e["label"]: v for e in shipped if (v := violations(e["text"], e["params"], e["buffer"]))}
    assert failures == {}


@pytest.mark.parametrize("mutant", sorted(m for m, e in EXPECTED.items() if e))
def test_source_mutant_fails_the_dataflow_check(mutants, mutant):
    runs = mutants[mutant]
    assert runs and {e["label"].split()[0] for e in runs} == {"w4a16", "nvfp4"}  # both families
    for e in runs:
        v = violations(e["text"], e["params"], e["buffer"])
        assert v and all(EXPECTED[mutant] in x for x in v), (e["label"], v)


def _instructions(ptx: str) -> list[str]:
    return [ins.text for ins in Program(ptx).insns]


def test_barrier_mutant_compiles_to_the_shipped_instructions_or_fails(mutants, shipped):
    """Without skeleton.arrive's tl.debug_barrier() the kernels compile today to the very same
    instructions: Triton's membar pass puts a bar.sync before the atomic anyway (the atomic's
    result is broadcast through shared memory that the epilogue's layout conversion used last),
    so no check of compiled code can fail it. Should a Triton stop doing so, the mutant's PTX
    differs and the dataflow check must then fail it. The weak-memory interpreter test, which
    honours only the source's barriers, fails it (tests/test_weak_memory.py)."""
    by_label = {}
    for e in shipped:
        by_label.setdefault(e["label"], e)
    for e in mutants["no_barrier"]:
        # Today: the compiler's bar.sync stands where the source's stood, so the check passes
        # (an equivalent mutant for compiled code). Should it fail, it must be for the barrier.
        v = violations(e["text"], e["params"], e["buffer"])
        assert all("without bar.sync" in x for x in v), (e["label"], v)
        print(e["label"], "instruction-identical to a shipped kernel:",
              any(_instructions(s["text"]) == _instructions(e["text"]) for s in shipped))


def _arrival_line(lines: list[str]) -> int:
    return next(n for n, ln in enumerate(lines) if re.search(r"\batom\.global\.\S*\.add\.u32", ln))


def _drop_barriers(ptx: str, after: bool) -> str:
    """The PTX with every bar.sync removed between the arrival atomic and the last store before
    it (after=False) or the first ld.global.cg (the buffer's loads) after it (after=True)."""
    lines = ptx.splitlines()
    i = _arrival_line(lines)
    if after:
        span = range(i, next(n for n in range(i, len(lines)) if "ld.global.cg" in lines[n]))
    else:
        span = range(max(n for n in range(i) if "st.global" in lines[n]), i)
    return "\n".join(ln for n, ln in enumerate(lines) if not (n in span and "bar.sync" in ln))


_BUFFER_WRITES = ("st.global", "red.global", "atom.global")  # a stored sum's rows, an atomic sum's adds


def _store_after_arrival(ptx: str, params: list[str], buffer: str) -> str:
    """The PTX with the last write to the sum's buffer before the arrival (a store, or an fp32
    atomic add of the atomic top-k sum) moved right after it."""
    prog = Program(ptx)
    last = [i for i in prog.insns
            if i.op.startswith(_BUFFER_WRITES) and params.index(buffer) in (prog.params_of(i) or ())][-1]
    addr = re.escape(last.addr) + r"\b"
    lines = ptx.splitlines()
    i = _arrival_line(lines)
    s = max(n for n in range(i)
            if any(w in lines[n] for w in _BUFFER_WRITES) and re.search(r"\[\s*" + addr, lines[n]))
    store = lines.pop(s)
    lines.insert(i, store)  # i - 1 + 1: after the atomic, whose index moved up by one
    return "\n".join(lines)


def _skip_barrier_on_a_path(ptx: str) -> str:
    """A branch around the barrier before the arrival: one path reaches it without bar.sync."""
    lines = ptx.splitlines()
    i = _arrival_line(lines)
    b = max(n for n in range(i) if "bar.sync" in lines[n])
    return "\n".join(lines[:b] + ["\t@%p1 bra \t$L__skip_barrier;", lines[b], "$L__skip_barrier:"] + lines[b + 1:])


@pytest.mark.parametrize("mutation,expected", [
    (lambda e: _drop_barriers(e["text"], after=False), "reaches the arrival on a path without bar.sync"),
    (lambda e: _drop_barriers(e["text"], after=True), "reached from the arrival on a path without bar.sync"),
    (lambda e: _store_after_arrival(e["text"], e["params"], e["buffer"]), "a store to the buffer after the arrival"),
    (lambda e: _skip_barrier_on_a_path(e["text"]), "reaches the arrival on a path without bar.sync"),
    (lambda e: e["text"].replace(".acq_rel.add.u32", ".release.add.u32"), "semantics are not acq_rel"),
], ids=["barrier-before", "barrier-after", "store-after", "branch-around-barrier", "release-only"])
def test_ptx_mutation_fails_the_dataflow_check(shipped, mutation, expected):
    """The barriers' part of the check on real PTX (a source mutant cannot remove the barrier
    after the atomic: Triton emits it), for the first kernel of each family group (W4A16, the
    others), GEMM and sum (split-K's, the top-k sum stored by slot, the atomic top-k sum)."""
    picks = {}
    for e in shipped:
        picks.setdefault((e["family"] == "w4a16", e["kind"], " atomic" in e["label"]), e)
    assert len(picks) == 6, sorted(picks)
    for e in picks.values():
        assert violations(e["text"], e["params"], e["buffer"]) == []
        v = violations(mutation(e), e["params"], e["buffer"])
        assert any(expected in x for x in v), (e["label"], v)


# --- the analysis itself, on hand-written PTX ---------------------------------------------------

_TOY = """
.visible .entry toy(
	.param .u64 toy_param_0,
	.param .u64 toy_param_1,
	.param .u64 toy_param_2
)
{
	ld.param.u64 	%rd1, [toy_param_0];
	ld.param.u64 	%rd2, [toy_param_1];
	ld.param.u64 	%rd9, [toy_param_2];
	cvta.to.global.u64 	%rd3, %rd1;
	mov.u32 	%r1, %tid.x;
	mul.wide.u32 	%rd4, %r1, 4;
	add.s64 	%rd5, %rd3, %rd4;
	st.global.f32 	[%rd5], %f1;
	ld.global.u32 	%r9, [%rd9];
	mad.wide.u32 	%rd10, %r9, 4, %rd3;
	st.global.f32 	[%rd10+4], %f2;
	setp.eq.s32 	%p1, %r1, 0;
	bar.sync 	0;
	@%p1 atom.global.gpu.acq_rel.add.u32 	%r2, [%rd2], 1;
	bar.sync 	0;
	setp.ne.s32 	%p2, %r2, 1;
	@%p2 bra 	$L__BB0_2;
	ld.global.cg.f32 	%f3, [%rd5];
$L__BB0_2:
	ret;
}
"""
TOY_PARAMS = ["part_ptr", "tickets_ptr", "ids_ptr"]


def test_analysis_follows_addresses_through_arithmetic_and_paths():
    assert violations(_TOY, TOY_PARAMS, "part_ptr") == []
    prog = Program(_TOY)
    # the store at [%rd10+4]: its offset is loaded data (ids_ptr), its base part_ptr: part_ptr's
    st = [i for i in prog.insns if i.op.startswith("st.global")]
    assert [prog.params_of(i) for i in st] == [frozenset({0}), frozenset({0})]
    # a load of the buffer reached without the barrier after the atomic
    no_bar_after = _TOY.replace("\tbar.sync \t0;\n\tsetp.ne", "\tsetp.ne")
    assert any("without bar.sync" in v for v in violations(no_bar_after, TOY_PARAMS, "part_ptr"))
    # a store on one path only skips the barrier
    branchy = _TOY.replace("\tbar.sync \t0;\n\t@%p1 atom", "\t@%p1 bra $L__BB0_1;\n\tbar.sync \t0;\n$L__BB0_1:\n\t@%p1 atom")
    assert any("reaches the arrival on a path without bar.sync" in v for v in violations(branchy, TOY_PARAMS, "part_ptr"))
    # another buffer's store after the arrival is not the sum's business
    other = _TOY.replace("\tld.global.cg.f32 \t%f3, [%rd5];", "\tld.global.cg.f32 \t%f3, [%rd5];\n\tst.global.u32 [%rd9], %r2;")
    assert violations(other, TOY_PARAMS, "part_ptr") == []
    # an address the analysis cannot follow (read back from shared memory) counts as the buffer's
    lost = other.replace("\tst.global.u32 [%rd9], %r2;", "\tld.shared.u64 %rd20, [%r1];\n\tst.global.u32 [%rd20], %r2;")
    assert any("cannot follow" in v and "after the arrival" in v for v in violations(lost, TOY_PARAMS, "part_ptr"))
    # no store to the buffer at all: nothing released, a violation, not a pass
    renamed = ["x", "tickets_ptr", "part_ptr"]  # the stores now go to x, part_ptr is only loaded
    assert any("no global store to part_ptr" in v for v in violations(_TOY, renamed, "part_ptr"))
