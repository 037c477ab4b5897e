"""The release / acquire pattern of the skeleton's last-arrival sums, checked as dataflow in the
compiled PTX of the real kernels.

Both last-arrival sums (GEMM1's split-K slices: skeleton.split_k_arrive / split_k_sum, through the
partials buffer ``part_ptr``; GEMM2's top-k rows: skeleton.combine_by_last_arrival, through the
top-k buffer ``buf_ptr``) rely on this in every program (docs/kernels.md, "Memory ordering of the
last-arrival sums", says why it suffices under the PTX memory model):

  1. every global store (or atomic add) whose address derives from the buffer parameter lies
     before a ``bar.sync`` that precedes the arrival on EVERY path: no path from the store to the
     arrival avoids a barrier, and no store to the buffer is reachable from the arrival;
  2. the arrival is ``atom.global.<gpu|sys>.acq_rel.add`` on the counters parameter
     (``tickets_ptr``);
  3. every load of the buffer is reachable from the arrival only through a ``bar.sync`` (the
     barrier that follows the acquire), and no load of the buffer lies before the arrival.

``violations`` checks exactly that. ``Program`` parses the kernel body into instructions and a
control-flow graph (labels, ``bra`` with and without a guard predicate, ``ret``), and follows
every register back to the kernel parameters: ``ld.param`` (and a ``mov`` of a parameter symbol)
starts a chain, and every arithmetic or move instruction (add, mad, mul.wide, shl, cvt, cvta,
mov, selp ...) passes the parameters of all its source registers to its destinations, until
nothing changes (flow-insensitive: a register counts as deriving from every parameter any of its
definitions derives from, so a check over-approximates, never misses a chain). A loaded value
is data, not an address: ``ld`` / ``atom`` destinations derive from nothing. The parameters are
named from Triton's signature of the compile (``params``: the non-constexpr arguments in order).

Where the PTX makes following impossible: an address computed from a value loaded from memory
alone (a pointer stored to shared or global memory and read back) derives from no parameter.
Such an access is counted as the buffer's (conservatively: a store of unknown address after the
arrival, or a load of unknown address before it, is a violation); the shipped kernels have none,
so no access escapes the check. Generic ``st`` / ``ld`` (no state space) count as global, and
TMA bulk copies (``cp.async.bulk``) as stores or loads by direction.

The compile script (no TRITON_INTERPRET: Triton's bundled ptxas, offline for sm90 / sm100)
writes the PTX of the kernels compiled with a SOURCE mutant of the skeleton
(tests/skeleton_mutants.py); the shipped kernels' PTX comes from bench/sass_report.py --ptx-dir:

    python -P tests/ptx_ordering.py --out DIR --mutant up_after_arrive
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys
from dataclasses import dataclass

_COMMENT = re.compile(r"//.*$")
_LABEL = re.compile(r"^\s*(?P<name>\$?[A-Za-z_][\w$]*):")
_GUARD = re.compile(r"^\s*@!?%\w+\s+")
_BRA = re.compile(r"^bra(?:\.uni)?\s+(?P<target>\$?[\w$]+)\s*;")
_REG = re.compile(r"%[A-Za-z_][\w]*")
_ADDR = re.compile(r"\[\s*(?P<base>%[\w]+|[A-Za-z_][\w$]*)\s*(?:\+\s*-?\w+\s*)?\]")
_PARAM = re.compile(r"\[\s*\w+_param_(?P<n>\d+)\s*\]")
_PARAM_SYM = re.compile(r"\b\w+_param_(?P<n>\d+)\b")
_BAR = re.compile(r"^(?:bar|barrier)\.(?:cta\.)?sync\b")
_COUNTER = re.compile(r"^atom\.global(?P<mods>(?:\.[a-z0-9_]+)*)\.add\.[us]32\b")
# Global memory accesses. A generic st / ld (no state space) may reach global memory: counted.
_STORE = re.compile(r"^(?:st(?!\.(?:shared|local|param))(?:\.\S*)?|red\.\S*global\S*|atom\.\S*global\S*|"
                    r"cp\.async\.bulk\S*\.global\.shared\S*|cp\.reduce\.async\.bulk\S*\.global\.shared\S*)\s")
_LOAD = re.compile(r"^(?:ld(?!\.(?:shared|local|param|const))(?:\.\S*)?|cp\.async\.(?:ca|cg)\.shared\.global\S*|"
                   r"cp\.async\.bulk\S*\.shared\S*\.global\S*)\s")


@dataclass
class Insn:
    """One PTX instruction: its text without the guard predicate, the registers it writes and
    reads, and the register or symbol its memory operand is addressed by."""

    line: int  # index in Program.insns
    text: str
    op: str
    dests: tuple[str, ...]
    srcs: tuple[str, ...]
    addr: str | None


class Program:
    """The kernel body as a list of instructions, its control-flow graph, and for every register
    the kernel parameters its value may derive from (flow-insensitive, so an over-approximation:
    a register that derives from a parameter on any path counts as deriving from it)."""

    def __init__(self, ptx: str):
        self.insns: list[Insn] = []
        labels: dict[str, int] = {}
        body = ptx.split(".entry", 1)[-1]
        body = body[body.index("{"):] if "{" in body else body
        for raw in body.splitlines():
            line = _COMMENT.sub("", raw).strip()
            m = _LABEL.match(line)
            if m:
                labels[m.group("name")] = len(self.insns)
                line = line[m.end():]
            for stmt in line.split(";"):
                stmt = stmt.strip()
                if stmt.startswith("{"):  # an inline-asm block's braces, not a vector operand's
                    stmt = stmt[1:].strip()
                if stmt.endswith("}") and stmt.count("}") > stmt.count("{"):
                    stmt = stmt[:-1].strip()
                if stmt and not stmt.startswith((".loc", ".reg", ".shared", ".local", ".file", ".pragma")):
                    self.insns.append(_parse(len(self.insns), stmt))
        self.succ: list[list[int]] = []
        for i, ins in enumerate(self.insns):
            m = _BRA.match(ins.text)
            nxt = [i + 1] if i + 1 < len(self.insns) else []
            if m:
                tgt = labels.get(m.group("target"))
                if tgt is None:
                    raise ValueError(f"branch to an unknown label: {ins.text}")
                self.succ.append([tgt] + (nxt if ins.op == "guarded-bra" else []))
            elif ins.op in ("ret", "exit", "trap"):
                self.succ.append([])
            else:
                self.succ.append(nxt)
        self.taint = self._taint()

    def _taint(self) -> dict[str, frozenset[int]]:
        taint: dict[str, set[int]] = {}
        changed = True
        while changed:
            changed = False
            for ins in self.insns:
                if not ins.dests:
                    continue
                m = _PARAM.search(ins.text)
                if ins.op.startswith("ld.param") and m:
                    src = {int(m.group("n"))}
                elif ins.op.startswith("mov") and _PARAM_SYM.search(ins.text):
                    src = {int(_PARAM_SYM.search(ins.text).group("n"))}  # the parameter's address
                elif ins.op.startswith(("ld", "atom", "cp.")):
                    src = set()  # a loaded value is data, not an address derived from a parameter
                else:
                    src = set().union(*(taint.get(r, set()) for r in ins.srcs)) if ins.srcs else set()
                for d in ins.dests:
                    cur = taint.setdefault(d, set())
                    if not src <= cur:
                        cur |= src
                        changed = True
        return {k: frozenset(v) for k, v in taint.items()}

    def params_of(self, ins: Insn) -> frozenset[int] | None:
        """The parameters the memory operand's address derives from; None when it derives from
        none (an address the analysis cannot follow back: it is treated as any buffer's)."""
        if ins.addr is None:
            return None
        got = self.taint.get(ins.addr, frozenset())
        return got or None

    def reachable(self, start: int, stop_at_barrier: bool) -> set[int]:
        """Instructions reachable from ``start`` (exclusive) along the CFG; with stop_at_barrier,
        paths end at the first bar.sync (the barrier itself is not included)."""
        seen: set[int] = set()
        todo = list(self.succ[start])
        while todo:
            j = todo.pop()
            if j in seen:
                continue
            if stop_at_barrier and _BAR.match(self.insns[j].text):
                continue
            seen.add(j)
            todo.extend(self.succ[j])
        return seen


def _parse(n: int, line: str) -> Insn:
    guard = _GUARD.match(line)
    text = line[guard.end():] if guard else line
    text = text.rstrip(";").strip() + ";"
    op = text.split(None, 1)[0].rstrip(";")
    if op.startswith("bra") and guard:
        op = "guarded-bra"
    # The global operand: the first [...] but in a copy global -> shared (cp.async ... .shared.global
    # ...), whose destination comes first.
    spaces = re.findall(r"\.(shared|global)", op)
    brackets = [m.group("base") for m in _ADDR.finditer(text)]
    pick = 1 if op.startswith("cp.") and spaces[:2] == ["shared", "global"] and len(brackets) > 1 else 0
    addr = brackets[pick] if brackets and brackets[pick].startswith("%") else None
    operands = text[len(text.split(None, 1)[0]):]
    first, _, rest = operands.partition(",")
    if _STORE.match(text) and not op.startswith("atom") or op.startswith(("bar", "bra", "guarded-bra", "ret", "exit",
                                                                             "cp.async.commit", "cp.async.wait",
                                                                             "wgmma.fence", "wgmma.commit",
                                                                             "wgmma.wait", "fence", "membar")):
        dests, srcs = (), tuple(_REG.findall(operands))
    else:
        dests = tuple(_REG.findall(first))
        srcs = tuple(_REG.findall(rest))
    return Insn(n, text, op, dests, srcs, addr)


def violations(ptx: str, params: list[str], buffer: str, counters: str = "tickets_ptr") -> list[str]:
    """What breaks the release / acquire pattern of a last-arrival sum in one kernel's PTX; []
    when nothing does. ``params``: the kernel's PTX parameter names in order (Triton's signature
    without its constexprs); ``buffer``: the parameter of the buffer the sum goes through (GEMM1:
    part_ptr, the split-K partials; GEMM2: buf_ptr, the top-k rows); ``counters``: the arrival
    counters' parameter. See the module docstring for the rule."""
    prog = Program(ptx)
    try:
        buf, tick = params.index(buffer), params.index(counters)
    except ValueError as e:
        return [f"parameter list {params}: {e}"]
    found: list[str] = []
    arrivals = [ins for ins in prog.insns if _COUNTER.match(ins.text) and (prog.params_of(ins) or set()) & {tick}]
    if not arrivals:
        return [f"no arrival atomic (atom.global.*.add.u32 on {counters}) in the kernel"]
    others = [ins for ins in prog.insns if _COUNTER.match(ins.text) and ins not in arrivals]
    found += [f"line {ins.line}: a counter atomic on something else than {counters}: {ins.text}" for ins in others]

    def touches(ins: Insn) -> bool:
        p = prog.params_of(ins)
        return p is None or buf in p  # an address the analysis cannot follow counts as the buffer's

    stores = [ins for ins in prog.insns if _STORE.match(ins.text) and ins not in arrivals and touches(ins)]
    loads = [ins for ins in prog.insns if _LOAD.match(ins.text) and touches(ins)]
    if not any(prog.params_of(s) for s in stores):
        found.append(f"no global store to {buffer} found (what does the arrival release?)")
    if not any(prog.params_of(ld) for ld in loads):
        found.append(f"no global load of {buffer} found (what does the last arrival sum?)")
    for a in arrivals:
        where = f"line {a.line}: {a.text}"
        mods = _COUNTER.match(a.text).group("mods").split(".")
        if "acq_rel" not in mods:
            found.append(f"{where}: semantics are not acq_rel")
        if not ({"gpu", "sys"} & set(mods)):
            found.append(f"{where}: scope is not gpu (or sys)")
        after = prog.reachable(a.line, stop_at_barrier=False)
        after_unsynced = prog.reachable(a.line, stop_at_barrier=True)
        for s in stores:
            what = "a store to the buffer" if prog.params_of(s) else "a store whose address the analysis cannot follow"
            if s.line in after:
                found.append(f"{where}: {what} after the arrival: line {s.line}: {s.text}")
            elif a.line in prog.reachable(s.line, stop_at_barrier=True):
                found.append(f"{where}: {what} reaches the arrival on a path without bar.sync: line {s.line}: {s.text}")
        for ld in loads:
            what = "a load of the buffer" if prog.params_of(ld) else "a load whose address the analysis cannot follow"
            if ".nc" in ld.op:  # texture path: outside the memory model (PTX ISA section 8.1)
                found.append(f"{where}: {what} through the non-coherent path (.nc): line {ld.line}: {ld.text}")
            if ld.line in after_unsynced:
                found.append(f"{where}: {what} reached from the arrival on a path without bar.sync: "
                             f"line {ld.line}: {ld.text}")
            elif ld.line not in after:
                found.append(f"{where}: {what} before the arrival (not ordered after the acquire): "
                             f"line {ld.line}: {ld.text}")
    return found


# --- the script: compile kernels with a skeleton mutant ---------------------------------------

BUFFERS = {"gemm1": "part_ptr", "gemm2": "buf_ptr"}


def kernel_params(compiled) -> list[str]:
    """The PTX parameter names of a Triton compile, in order: its signature without constexprs."""
    return [k for k, v in compiled.src.signature.items() if v != "constexpr"]


def mutant_kernels(mutant: str) -> list[tuple[str, str, object]]:
    """(label, kind, thunk) of the kernels a mutant is compiled for: the decode configs (M = 1,
    the heuristic's, with split-K in GEMM1) of both families, W4A16 on sm90 at TP16 and the
    nvfp4 mode on sm100 at TP16; of each family the GEMMs whose sum the mutant breaks, and for a
    mutant of the arrival itself W4A16's GEMM1 (split-K) and FP4's GEMM2 (top-k)."""
    from skeleton_mutants import MUTANTS

    from k3nvfp4.kernels import perf_model as pm
    from k3nvfp4.kernels.moe_details.config import MoEConfig
    from k3nvfp4.kernels.moe_fp4_details.config import FP4MoEConfig
    from k3nvfp4.kernels.offline import compile as cc

    s = pm.K3_SHARDS["tp16"]
    w = MoEConfig.heuristic(s.local_experts, s.hidden, s.intermediate, s.top_k, 1, arch=90,
                            num_global_experts=s.global_experts)
    f = FP4MoEConfig.heuristic(s.local_experts, s.hidden, s.intermediate, s.top_k, 1, act_quant="nvfp4",
                               num_global_experts=s.global_experts, device_name="B200")
    assert w.gemm("gemm1").split_k > 1 and f.split_k1 > 1, "the decode configs no longer split GEMM1 over K"
    sums = MUTANTS[mutant].sums
    pick = {("w4a16", "gemm1"), ("fp4", "gemm2")} if len(sums) == 2 else \
        {(fam, "gemm1" if sums == ("split_k",) else "gemm2") for fam in ("w4a16", "fp4")}
    out = []
    for kind in ("gemm1", "gemm2"):
        if ("w4a16", kind) in pick:
            out.append((f"w4a16 sm90 tp16 M=1 {kind} {w.gemm(kind).label()}", kind,
                        lambda kind=kind: cc.compile_gemm(kind, w, s.hidden, s.intermediate, s.top_k, arch=90)))
        if ("fp4", kind) in pick:
            out.append((f"nvfp4 sm100 tp16 M=1 {kind} {f.label()}", kind,
                        lambda kind=kind: cc.compile_fp4_gemm(kind, "nvfp4", f, s.hidden, s.intermediate, s.top_k,
                                                              arch=100)))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=pathlib.Path, required=True, help="folder for <n>.ptx and index.json")
    ap.add_argument("--mutant", required=True, action="append",
                    help="a mutant of tests/skeleton_mutants.py (repeat: each is compiled in a process of its own, "
                         "into OUT/<mutant>)")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    import skeleton_mutants

    bad = [m for m in args.mutant if m not in skeleton_mutants.MUTANTS]
    if bad:
        print(f"--mutant: unknown {bad} (known: {', '.join(skeleton_mutants.MUTANTS)})", file=sys.stderr)
        return 2
    if len(args.mutant) > 1:
        # Triton keys a kernel's cache on its callees' source when it first compiles it: one
        # process per mutant, one after another.
        import subprocess

        for m in args.mutant:
            rc = subprocess.run([sys.executable, "-P", __file__, "--out", str(args.out / m), "--mutant", m]).returncode
            if rc:
                return rc
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    index = []
    with skeleton_mutants.installed(args.mutant[0], args.out):
        for n, (label, kind, compile_fn) in enumerate(mutant_kernels(args.mutant[0])):
            compiled = compile_fn()
            (args.out / f"{n}.ptx").write_text(compiled.asm["ptx"])
            index.append({"label": label, "kind": kind, "buffer": BUFFERS[kind], "params": kernel_params(compiled),
                          "ptx": f"{n}.ptx"})
    (args.out / "index.json").write_text(json.dumps(index, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
