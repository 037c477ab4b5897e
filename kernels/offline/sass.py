"""Static SASS analysis: disassemble a cubin with the tools Triton bundles and measure its hot loop.

The performance signal of a GPU kernel when no GPU is at hand. An H200 issues about
132 SMs x 4 schedulers x 1.98 GHz = 1.05e12 warp-instructions/s while its HBM streams
4.8e12 B/s = 9.6e12 FP4 weights/s, so a weight-streaming kernel whose K loop spends more than
``HBM_BUDGET`` warp-instructions per weight element cannot run at HBM speed; its issue-bound
ceiling is ``HBM_BUDGET / measured`` of HBM bandwidth.

Works on cubin bytes (from ``triton.compile(...).asm["cubin"]`` or nvcc); nothing here needs a
GPU. The tools are Triton's bundled ``cuobjdump`` / ``nvdisasm`` (``triton/backends/nvidia/bin``).
"""

from __future__ import annotations

import collections
import os
import pathlib
import re
import subprocess
import tempfile
from dataclasses import dataclass, field

from ..perf_model import H200

# The H200's warp-instruction issue rate over the FP4 weights (2 per byte) its HBM spec streams:
# ~0.109 warp-instructions per weight (one device record for everything: perf_model.H200).
HBM_BUDGET = H200.issue_rate / (2 * H200.hbm_bytes_per_s)

# Opcode families of the mix (the base opcode, before the first '.').
_MMA = {"HGMMA", "HMMA", "UTCHMMA", "UTCQMMA", "UTCOMMA", "QGMMA", "IMMA"}
_FAMILIES = {
    "mma": _MMA,
    "global_load": {"LDG"},
    "shared_load": {"LDS", "LDSM"},
    "shared_store": {"STS"},
    "async_copy": {"LDGSTS", "UTMALDG", "UBLKCP", "LDGDEPBAR", "DEPBAR", "SYNCS"},
    "local_memory": {"LDL", "STL"},
    "int_logic": {"LOP3", "SHF", "PRMT", "LEA", "IADD3", "IMAD", "ISETP", "SEL", "SGXT", "BMSK", "IABS",
                  "IMNMX", "VIMNMX", "FLO", "POPC", "BREV", "IMUL", "IDP", "I2IP", "VIADD", "UIADD3",
                  "ULOP3", "USHF", "UIMAD", "ULEA", "UISETP", "USEL", "UPRMT", "UMOV", "USGXT", "ULDC"},
    "f16x2": {"HMUL2", "HFMA2", "HADD2", "HMNMX2"},
    "fp32": {"FMUL", "FADD", "FFMA", "FSETP", "FSEL", "FMNMX", "MUFU", "FCHK"},
    "convert": {"I2F", "F2I", "F2F", "F2FP", "I2FP", "F2IP", "FRND"},
    "move": {"MOV", "S2R", "S2UR", "R2UR", "CS2R", "SHFL", "MOVM", "R2P", "P2R", "PLOP3"},
    "control": {"BRA", "BAR", "WARPSYNC", "NOP", "BSSY", "BSYNC", "EXIT", "WARPGROUP", "YIELD", "CCTL",
                "MEMBAR", "FENCE", "ERRBAR", "CALL", "RET", "ELECT", "ACQBULK", "VOTE", "VOTEU"},
}
_FAMILY_OF = {op: fam for fam, ops in _FAMILIES.items() for op in ops}

_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)\s*([^;]*);")
_FUNC = re.compile(r"Function\s*:?\s*([^\s:]+)")


@dataclass(frozen=True)
class Instr:
    addr: int
    opcode: str  # full, e.g. "LDG.E.128.CONSTANT"
    operands: str
    predicate: str = ""

    @property
    def base(self) -> str:
        return self.opcode.split(".", 1)[0]


@dataclass(frozen=True)
class Loop:
    """A backward branch and the straight range it closes: [start, end] (both addresses inclusive)."""

    start: int
    end: int
    instrs: tuple[Instr, ...]

    @property
    def size(self) -> int:
        return len(self.instrs)


@dataclass
class LoopStats:
    """Static figures of one kernel's hot loop, per warp and per iteration."""

    instructions: int
    mma: int
    opcode_mix: dict[str, int] = field(default_factory=dict)
    family_mix: dict[str, int] = field(default_factory=dict)
    local_memory_ops: int = 0


@dataclass
class ResourceUsage:
    registers: int
    local_bytes: int  # per-thread local memory (register spills, stack)
    shared_bytes: int


def tool(name: str) -> pathlib.Path:
    """Path of one of Triton's bundled CUDA binaries (cuobjdump, nvdisasm, ptxas)."""
    import triton

    p = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name
    if not p.is_file():
        raise FileNotFoundError(f"{name}: not bundled with this Triton ({p} missing)")
    return p


def _run_on_cubin(args: list[str], cubin: bytes) -> str:
    with tempfile.TemporaryDirectory(prefix="k3nvfp4-sass-") as d:
        path = os.path.join(d, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        proc = subprocess.run([*args, path], capture_output=True, text=True, timeout=300)
    if proc.returncode != 0:
        raise RuntimeError(f"{pathlib.Path(args[0]).name} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return proc.stdout


def disassemble(cubin: bytes) -> dict[str, list[Instr]]:
    """{function name: instructions in address order} of every function in a cubin."""
    text = _run_on_cubin([str(tool("cuobjdump")), "-sass"], cubin)
    return parse_sass(text)


def parse_sass(text: str) -> dict[str, list[Instr]]:
    """Parse ``cuobjdump -sass`` output into {function: [Instr]}."""
    funcs: dict[str, list[Instr]] = {}
    current: list[Instr] | None = None
    for line in text.splitlines():
        m = _FUNC.search(line)
        if m:
            current = funcs.setdefault(m.group(1), [])
            continue
        m = _LINE.search(line)
        if m and current is not None:
            current.append(Instr(int(m.group(1), 16), m.group(3), m.group(4).strip(), (m.group(2) or "").strip()))
    return funcs


def resource_usage(cubin: bytes) -> dict[str, ResourceUsage]:
    """{function: registers, local (spill/stack) bytes, static shared bytes} from cuobjdump -res-usage."""
    text = _run_on_cubin([str(tool("cuobjdump")), "-res-usage"], cubin)
    out: dict[str, ResourceUsage] = {}
    name = None
    for line in text.splitlines():
        m = _FUNC.search(line)
        if m:
            name = m.group(1)
            continue
        if name and "REG:" in line:
            vals = dict(re.findall(r"(\w+):(\d+)", line))
            out[name] = ResourceUsage(
                registers=int(vals.get("REG", 0)),
                local_bytes=int(vals.get("LOCAL", 0)) + int(vals.get("STACK", 0)),
                shared_bytes=int(vals.get("SHARED", 0)),
            )
            name = None
    return out


def _branch_target(ins: Instr) -> int | None:
    m = re.search(r"`?\(\.L_x_\d+\)|0x([0-9a-f]+)", ins.operands)
    if m and m.group(1):
        return int(m.group(1), 16)
    return None


def loops(instrs: list[Instr]) -> list[Loop]:
    """Every backward branch (BRA to a lower or equal address) as a Loop, innermost first."""
    by_addr = {ins.addr: i for i, ins in enumerate(instrs)}
    found = []
    for j, ins in enumerate(instrs):
        if ins.base != "BRA":
            continue
        target = _branch_target(ins)
        if target is None or target > ins.addr or target not in by_addr:
            continue
        i = by_addr[target]
        found.append(Loop(target, ins.addr, tuple(instrs[i : j + 1])))
    return sorted(found, key=lambda lp: lp.size)


def hot_loop(instrs: list[Instr]) -> Loop:
    """The K loop: the smallest loop holding the most MMA instructions."""
    cands = loops(instrs)
    if not cands:
        raise ValueError("no loop (backward branch) in this function")
    best = max(cands, key=lambda lp: (sum(i.base in _MMA for i in lp.instrs), -lp.size))
    if not any(i.base in _MMA for i in best.instrs):
        raise ValueError("no loop of this function holds an MMA instruction")
    return best


def loop_stats(loop: Loop) -> LoopStats:
    """Instruction count, MMA count and opcode mix of one loop iteration (per warp)."""
    ops = collections.Counter(i.opcode for i in loop.instrs)
    fams = collections.Counter(_FAMILY_OF.get(i.base, "other") for i in loop.instrs)
    return LoopStats(
        instructions=loop.size,
        mma=sum(i.base in _MMA for i in loop.instrs),
        opcode_mix=dict(ops.most_common()),
        family_mix=dict(fams.most_common()),
        local_memory_ops=fams.get("local_memory", 0),
    )


def warp_instr_per_weight(instructions_per_warp: float, num_warps: int, weights_per_iteration: int) -> float:
    """All warps' instructions of one iteration divided by the weight elements it consumes."""
    return instructions_per_warp * num_warps / weights_per_iteration


def hbm_ceiling(per_weight: float) -> float:
    """Issue-bound ceiling as a fraction of H200 HBM bandwidth (above 1: the issue bound does not bind)."""
    return HBM_BUDGET / per_weight
