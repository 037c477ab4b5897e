"""The release/acquire pattern of the skeleton's last-arrival sums, read from compiled PTX.

Both last-arrival sums (GEMM1's split-K slices: skeleton.split_k_arrive / split_k_sum; GEMM2's
top-k rows: skeleton.combine_by_last_arrival) rely on this sequence in every program:

  1. the program's partial results are stored to global memory by all its threads;
  2. ``bar.sync``: every thread's stores are ordered before what follows in the CTA;
  3. the counter atomic, ``atom.global.gpu.acq_rel.add`` (semantics acq_rel, scope gpu): it
     releases the CTA's stores to the other programs, and acquires the stores that the earlier
     arrivals released;
  4. ``bar.sync`` again, before any global load: the threads that did not perform the atomic
     are ordered after the acquiring thread;
  5. only then the last arrival's loads of the partials.

docs/kernels.md ("Memory ordering of the last-arrival sums") says why that is enough under the
PTX memory model. ``violations`` checks steps 2-4 on the PTX text: Triton emits each arrival as
straight-line code, so "no label between" means every path to the atomic passes the barrier.

Run as a script (no TRITON_INTERPRET: the kernels are compiled offline for sm90 / sm100 with
Triton's bundled ptxas) it writes the PTX of the shipped configs that sum by last arrival:

    python -P tests/ptx_ordering.py --out DIR [--mutant relaxed|no_barrier|cta_scope]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

_ATOM = re.compile(r"\batom\.global(?P<mods>(?:\.[a-z0-9_]+)*)\.add\.[us]32\b")
_LABEL = re.compile(r"^\s*(?P<name>\$?[A-Za-z_][\w$]*):\s*$")
_BRA = re.compile(r"\bbra(?:\.uni)?\s+(?P<target>\$?[\w$]+)")
_BAR = re.compile(r"\bbar\.sync\b|\bbarrier\.sync\b")
_GLOBAL_ST = re.compile(r"\b(st|red|atom)\.global\b")
_GLOBAL_LD = re.compile(r"\bld\.global\b")


def _code_lines(ptx: str) -> list[str]:
    # Drop comments and debug directives: they are not instructions.
    out = []
    for line in ptx.splitlines():
        line = line.split("//", 1)[0].rstrip()
        if line.strip() and not line.strip().startswith(".loc"):
            out.append(line)
    return out


def arrival_atomics(ptx: str) -> list[int]:
    """Line indices (in _code_lines) of the integer counter atomics (the arrivals)."""
    return [i for i, l in enumerate(_code_lines(ptx)) if _ATOM.search(l)]


def violations(ptx: str) -> list[str]:
    """What breaks the pattern at each arrival atomic; [] when every arrival follows it. An empty
    kernel (no arrival at all) is a violation too: the caller asked about a last-arrival sum."""
    lines = _code_lines(ptx)
    # Only branch targets split straight-line code ($L__tmp labels mark debug locations).
    targets = {m.group("target") for l in lines for m in _BRA.finditer(l)}

    def is_target(line: str) -> bool:
        m = _LABEL.match(line)
        return bool(m) and m.group("name") in targets

    sites = arrival_atomics(ptx)
    if not sites:
        return ["no arrival atomic (atom.global.*.add.u32) in the kernel"]
    found = []
    for i in sites:
        where = f"line {i}: {lines[i].strip()}"
        mods = _ATOM.search(lines[i]).group("mods").split(".")
        if "acq_rel" not in mods:
            found.append(f"{where}: semantics are not acq_rel")
        if not ({"gpu", "sys"} & set(mods)):
            found.append(f"{where}: scope is not gpu (or sys)")
        # Backwards to the barrier that must precede it: straight-line, no global store between.
        j = i - 1
        while j >= 0 and not _BAR.search(lines[j]):
            if is_target(lines[j]):
                found.append(f"{where}: a label (branch target) lies between the atomic and its barrier")
                break
            if _GLOBAL_ST.search(lines[j]):
                found.append(f"{where}: a global store between the barrier and the atomic: {lines[j].strip()}")
                break
            j -= 1
        else:
            if j < 0:
                found.append(f"{where}: no bar.sync before the atomic")
        if j >= 0 and not any(_GLOBAL_ST.search(l) for l in lines[:j]):
            found.append(f"{where}: no global store before the barrier (what does it release?)")
        # Forwards: a barrier before any global load, straight-line.
        k = i + 1
        while k < len(lines) and not _BAR.search(lines[k]):
            if _GLOBAL_LD.search(lines[k]):
                found.append(f"{where}: a global load before the barrier that follows the atomic: {lines[k].strip()}")
                break
            if is_target(lines[k]):
                found.append(f"{where}: a label between the atomic and the barrier after it")
                break
            k += 1
        else:
            if k >= len(lines):
                found.append(f"{where}: no bar.sync after the atomic")
        if not any(_GLOBAL_LD.search(l) for l in lines[k:]):
            found.append(f"{where}: nothing loaded after the arrival (the last arrival reads the partials)")
    return found


# --- the script: compile the shipped last-arrival configs -----------------------------------

SHARDS = ("tp16", "ep16", "tp32")
M_LIST = (1, 8, 64, 1024, 4096)


def _mutate(name: str) -> None:
    """Replace the skeleton's arrive with a variant that lacks part of the ordering (test only:
    the kernels resolve skeleton.arrive by its module global when they are compiled)."""
    import triton
    import triton.language as tl

    from k3nvfp4.kernels.moe_details import skeleton

    if name == "relaxed":
        @triton.jit
        def arrive(ticket_ptrs, mask):
            tl.debug_barrier()
            return tl.atomic_add(ticket_ptrs, 1, mask=mask, sem="relaxed", scope="gpu")
    elif name == "no_barrier":
        @triton.jit
        def arrive(ticket_ptrs, mask):
            return tl.atomic_add(ticket_ptrs, 1, mask=mask, sem="acq_rel", scope="gpu")
    elif name == "cta_scope":
        @triton.jit
        def arrive(ticket_ptrs, mask):
            tl.debug_barrier()
            return tl.atomic_add(ticket_ptrs, 1, mask=mask, sem="acq_rel", scope="cta")
    else:
        raise SystemExit(f"--mutant: unknown {name!r}")
    skeleton.arrive = arrive


def _configs(limit: int | None):
    """(label, thunk) of every distinct last-arrival GEMM the heuristics ship at the K3 shards."""
    from k3nvfp4.kernels import perf_model as pm
    from k3nvfp4.kernels.offline import compile as cc
    from k3nvfp4.kernels.moe_details.config import MoEConfig
    from k3nvfp4.kernels.moe_fp4_details.config import FP4MoEConfig

    seen, out = set(), []
    for arch in (90, 100):
        for shard in SHARDS:
            s = pm.K3_SHARDS[shard]
            for M in M_LIST:
                cfg = MoEConfig.heuristic(s.local_experts, s.hidden, s.intermediate, s.top_k, M, arch=arch,
                                           num_global_experts=s.global_experts)
                for kind in ("gemm1", "gemm2"):
                    g = cfg.gemm(kind)
                    if kind == "gemm1" and g.split_k == 1:
                        continue  # no arrival: GEMM1 without split-K stores its output directly
                    # ATOMIC is a constexpr of its own: the label alone would merge the two sums.
                    tag = f"{g.label()}{' atomic' if g.atomic_reduce else ''}"
                    key = ("w4a16", arch, kind, tag, s.hidden, s.intermediate, s.top_k)
                    if key not in seen:
                        seen.add(key)
                        out.append((f"w4a16 sm{arch} {shard} M={M} {kind} {tag}",
                                    lambda kind=kind, cfg=cfg, s=s, arch=arch: cc.compile_gemm(
                                        kind, cfg, s.hidden, s.intermediate, s.top_k, arch=arch)))
    for shard in ("tp8", "tp16"):
        s = pm.K3_SHARDS[shard]
        for mode in ("nvfp4", "mxfp8"):
            for M in M_LIST:
                cfg = FP4MoEConfig.heuristic(s.local_experts, s.hidden, s.intermediate, s.top_k, M, act_quant=mode,
                                             num_global_experts=s.global_experts)
                for kind in ("gemm1", "gemm2"):
                    if kind == "gemm1" and cfg.split_k1 == 1:
                        continue
                    sk = cfg.split_k1 if kind == "gemm1" else cfg.split_k2
                    bn = cfg.block_n1 if kind == "gemm1" else cfg.block_n2
                    bk = cfg.block_k1 if kind == "gemm1" else cfg.block_k2
                    key = (mode, kind, cfg.block_m, cfg.swap_ab, bn, bk, sk, cfg.num_warps, cfg.num_stages,
                           cfg.atomic_reduce if kind == "gemm2" else None, s.hidden, s.intermediate)
                    if key not in seen:
                        seen.add(key)
                        out.append((f"{mode} sm100 {shard} M={M} {kind} bm{cfg.block_m} bn{bn} bk{bk} sk{sk} "
                                    f"w{cfg.num_warps}{' atomic' if kind == 'gemm2' and cfg.atomic_reduce else ''}",
                                    lambda kind=kind, cfg=cfg, s=s, mode=mode: cc.compile_fp4_gemm(
                                        kind, mode, cfg, s.hidden, s.intermediate, s.top_k, arch=100)))
    return out[:limit] if limit else out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=pathlib.Path, required=True, help="folder for <n>.ptx and index.json")
    ap.add_argument("--mutant", help="compile with an arrive that lacks part of the ordering")
    ap.add_argument("--limit", type=int, help="only the first N configs")
    args = ap.parse_args(argv)
    if args.mutant:
        _mutate(args.mutant)
    args.out.mkdir(parents=True, exist_ok=True)
    index = []
    for n, (label, compile_fn) in enumerate(_configs(args.limit)):
        path = args.out / f"{n}.ptx"
        path.write_text(compile_fn().asm["ptx"])
        index.append({"label": label, "ptx": path.name})
    (args.out / "index.json").write_text(json.dumps(index, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
