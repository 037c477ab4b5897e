#!/usr/bin/env python3
"""Static SASS report of the fused NVFP4 MoE GEMMs, side by side with SGLang's marlin MoE.

No GPU needed. For the Kimi-K3 TP16 and EP16 shards and every M of the list, take the launch
config that ``get_moe_config`` returns on an H200 (tuned file for "NVIDIA_H200" if one is
committed, else the heuristic), compile GEMM1 and GEMM2 offline for the target (Triton ->
cubin with its bundled ptxas), disassemble with Triton's cuobjdump, find the hot K loop (the
backward branch around the MMAs) and report, per warp and iteration:

  instructions, weight elements consumed by the whole CTA, warps,
  warp-instructions per weight element = instructions x warps / weights,
  issue-bound ceiling = 0.109 / that, as % of the H200's HBM bandwidth (>100%: not issue bound),
  registers, local-memory (spill) bytes, MMA count and the opcode mix.

The budget at HBM speed is ~0.109 (k3nvfp4.kernels.sass.HBM_BUDGET); the targets are <= 0.10
for M <= 1024 and <= 0.12 above, with zero spill. SGLang's marlin MoE (NVFP4, moe_block 8 and
64), compiled by nvcc from the CUDA sources sglang ships, is measured in the same run
(bench/peers/marlin_sass.py). Compiles are cached in-process; a full run takes a few minutes on
2 cores.

  python -P bench/sass_report.py                         # sm90, both shapes, all M, marlin
  python -P bench/sass_report.py --arch 90,100 --write-readme
  python -P bench/sass_report.py --shapes tp16 --m-list 1 --no-peers --out /tmp/s.json

Writes bench/results/sass-sm<arch>.json (one file per arch) and prints a Markdown table;
--write-readme replaces the table between the markers in bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import pathlib
import subprocess
import sys
import traceback

from k3nvfp4.common.files import write_json_atomic, write_text_atomic

REPO = pathlib.Path(__file__).resolve().parent.parent
SHAPES = {  # name: (local experts, H, I, top_k), FACTS.md
    "tp16": (896, 3584, 192, 16),
    "ep16": (56, 3584, 3072, 16),
}
DEFAULT_M = (1, 4, 16, 64, 256, 1024, 4096, 16384)
DEVICE_NAME = "NVIDIA_H200"  # tuned-config lookup as on the H200
README_BEGIN = "<!-- sass-report:begin -->"
README_END = "<!-- sass-report:end -->"


def target_for(M: int) -> float:
    """The issue's budget: <= 0.10 warp-instructions per weight at M <= 1024, <= 0.12 above."""
    return 0.10 if M <= 1024 else 0.12


def measure_kernel(key, cfg, H: int, I: int, top_k: int, arch: int) -> dict:
    """Compile one GEMM (key = cfg.gemm(kind), a GemmLaunch) and measure its hot loop."""
    from k3nvfp4.kernels import sass
    from k3nvfp4.kernels.moe_details.compile_check import compile_gemm

    c = compile_gemm(key.kind, cfg, H, I, top_k, arch)
    cubin = c.asm["cubin"]
    funcs = sass.disassemble(cubin)
    usage = sass.resource_usage(cubin)
    name = next(n for n in funcs if "gemm" in n)
    loop = sass.hot_loop(funcs[name])
    st = sass.loop_stats(loop)
    per_w = sass.warp_instr_per_weight(st.instructions, key.num_warps, key.weights_per_iteration)
    ru = usage[name]
    return {
        "instructions_per_iteration": st.instructions,
        "weights_per_iteration": key.weights_per_iteration,
        "num_warps": key.num_warps,
        "warp_instr_per_weight": round(per_w, 4),
        "hbm_ceiling_pct": round(100 * sass.hbm_ceiling(per_w), 1),
        "registers": ru.registers,
        "local_bytes": ru.local_bytes,
        "shared_bytes": c.metadata.shared,
        "mma_per_iteration": st.mma,
        "local_memory_ops_in_loop": st.local_memory_ops,
        "family_mix": st.family_mix,
        "opcode_mix": dict(list(st.opcode_mix.items())[:15]),
    }


def our_rows(arch: int, shapes: list[str], m_list: list[int]) -> tuple[list[dict], list[str]]:
    from k3nvfp4.kernels.moe_details.config import get_moe_config

    cache: dict = {}
    rows, errors = [], []
    for shape in shapes:
        E, H, I, k = SHAPES[shape]
        for M in m_list:
            cfg = get_moe_config(E, H, I, k, M, device_name=DEVICE_NAME if arch == 90 else f"sm_{arch}", arch=arch)
            for kind in ("gemm1", "gemm2"):
                key = cfg.gemm(kind)
                ck = (key, H, I)
                if ck not in cache:
                    try:
                        cache[ck] = measure_kernel(key, cfg, H, I, k, arch)
                    except Exception as e:  # reported, not hidden: the row says why
                        cache[ck] = {"error": f"{type(e).__name__}: {e}"}
                        errors.append(f"{shape} M={M} {kind} {key.label()}: {e}")
                m = cache[ck]
                K = H if kind == "gemm1" else I
                steps = -(-K // key.block_k)
                row = {"kernel": f"k3nvfp4 {kind}", "shape": shape, "M": M, "config": key.label(),
                       "arch": f"sm_{arch}", "target": target_for(M),
                       # share of the K loop's weight elements past K (masked tail), 0 when block_k | K
                       "k_tail_waste": round(1 - K / (steps * key.block_k), 4), **m}
                if "error" not in m and arch == 90:  # the budget is the H200's
                    effective = m["warp_instr_per_weight"] / (1 - row["k_tail_waste"])
                    row["meets_target"] = effective <= row["target"] and m["local_bytes"] == 0
                rows.append(row)
    return rows, errors


def peer_rows(arch: int) -> tuple[list[dict], list[str]]:
    if arch != 90:
        return [], []
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from peers.marlin_sass import marlin_rows

        return marlin_rows(arch=arch, build_dir=str(REPO / "build" / "peers" / "marlin")), []
    except Exception as e:
        return [], [f"marlin: not available: {type(e).__name__}: {e}"]


def fp4_mode_rows(arch: int) -> list[dict]:
    """The FP4 tensor-core modes' GEMMs (act_quant nvfp4 / mxfp8) on Blackwell: tcgen05 MMA kind,
    block scaling, no decomposition (no wgmma / mma.sync), registers and spill bytes."""
    from k3nvfp4.kernels.moe_fp4_details.compile_fp4 import compile_all

    rows = compile_all(arch)
    for r in rows:
        if "error" not in r:
            want = "kind::mxf4nvf4" if "nvfp4" in r["kernel"] else "kind::mxf8f6f4"
            r["native"] = r["tcgen05_mma"] > 0 and r["kinds"] == [want] and r["wgmma"] == 0 and r["mma_sync"] == 0
    return rows


def _versions() -> dict:
    import torch
    import triton

    out = {"triton": triton.__version__, "torch": torch.__version__, "python": sys.version.split()[0]}
    try:
        nv = subprocess.run(["nvcc", "--version"], capture_output=True, text=True, timeout=60).stdout
        out["nvcc"] = nv.strip().splitlines()[-1] if nv else None
    except OSError:
        out["nvcc"] = None
    try:
        from importlib.metadata import version

        out["sglang"] = version("sglang")
    except Exception:
        out["sglang"] = None
    return out


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=30).stdout.strip() or None
    except OSError:
        return None


def markdown(result: dict) -> str:
    arch = result["arch"]
    lines = [
        f"Static SASS of the hot K loop, {arch}, {result['versions']['triton']} Triton, "
        f"{result['date']} (`python -P bench/sass_report.py --arch {arch[3:]}`). Budget at H200 HBM speed: "
        f"{result['hbm_budget']:.3f} warp-instructions per weight; target <= 0.10 (M <= 1024), <= 0.12 above.",
        "",
        "| kernel | shape | M | config | SASS/warp/iter | weights/iter | warps | warp-instr/weight | ceiling (% HBM) | regs | spill B | meets target |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['kernel']} | {r['shape']} | {r['M']} | {r['config']} | error: {r['error'][:80]} |||||||")
            continue
        lines.append(
            f"| {r['kernel']} | {r['shape']} | {r['M']} | {r['config']} | {r['instructions_per_iteration']} | "
            f"{r['weights_per_iteration']} | {r['num_warps']} | {r['warp_instr_per_weight']:.3f} | "
            f"{r['hbm_ceiling_pct']:.0f} | {r['registers']} | {r['local_bytes']} | "
            f"{'n/a' if 'meets_target' not in r else 'yes' if r['meets_target'] else 'NO'} |")
    for r in result["peers"]:
        tp = r.get("template_params", {})
        cfg = f"threads {tp.get('threads')}, n/k blocks {tp.get('thread_n_blocks')}/{tp.get('thread_k_blocks')}, stages {tp.get('stages')}"
        lines.append(
            f"| {r['kernel']} | {str(r.get('shard', '-')).lower()} | {r.get('regime', '-')} | {cfg} | "
            f"{r['instructions_per_iteration']} | {r['weights_per_iteration']} | {r['num_warps']} | "
            f"{r['warp_instr_per_weight']:.3f} | {r['hbm_ceiling_pct']:.0f} | {r['registers']} | "
            f"{r['local_bytes']} | (peer) |")
    if result["peers"]:
        lines += ["", "marlin (SGLang " + str(result["peers"][0].get("sglang_version")) + ", nvcc "
                  + str(result["peers"][0].get("nvcc_version")) + ", sm_90a): one pass of its SASS K loop is the "
                  "runtime stage-group loop with the 4-stage pipe loop unrolled inside = 4 K tiles of 64 x 128 N "
                  "weights of one expert = 32768 weights per 4-warp block (checked against the loop's HMMA count; "
                  "bench/peers/marlin_sass.py)."]
    if result.get("fp4_modes"):
        lines += ["", f"FP4 tensor-core modes (`fused_moe_nvfp4(act_quant=...)`), {arch}, K3 TP16 shapes "
                  "(`k3nvfp4.kernels.moe_fp4_details.compile_fp4`):", "",
                  "| kernel | tcgen05.mma | kind | block scale | wgmma / mma.sync | regs | spill B | native |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in result["fp4_modes"]:
            if "error" in r:
                lines.append(f"| {r['kernel']} | error: {r['error'][:80]} |||||||")
                continue
            lines.append(f"| {r['kernel']} | {r['tcgen05_mma']} | {', '.join(r['kinds'])} | {', '.join(r['block_scale'])} | "
                         f"{r['wgmma']} / {r['mma_sync']} | {r['registers']} | {r['local_bytes']} | "
                         f"{'yes' if r['native'] else 'NO'} |")
    for e in result["errors"]:
        lines.append(f"\n- {e}")
    return "\n".join(lines) + "\n"


def write_readme(md: str, path: pathlib.Path) -> None:
    text = path.read_text()
    if README_BEGIN not in text or README_END not in text:
        raise SystemExit(f"{path}: markers {README_BEGIN} / {README_END} not found")
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    write_text_atomic(path, head + README_BEGIN + "\n" + md + README_END + tail)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--arch", default="90", help="comma list of compute capabilities x10 (90 = H100/H200, 100 = B200)")
    p.add_argument("--shapes", default="tp16,ep16", help=f"comma list of {','.join(SHAPES)}")
    p.add_argument("--m-list", default=",".join(map(str, DEFAULT_M)), help="batch sizes (tokens per rank)")
    p.add_argument("--no-peers", action="store_true", help="skip SGLang's marlin (nvcc build)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/sass-sm<arch>.json)")
    p.add_argument("--write-readme", action="store_true", help="replace the table in bench/README.md (first arch)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("sass_report: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)", file=sys.stderr)
        return 2
    shapes = args.shapes.split(",")
    for s in shapes:
        if s not in SHAPES:
            print(f"--shapes: unknown shape {s!r} (known: {', '.join(SHAPES)})", file=sys.stderr)
            return 2
    try:
        m_list = [int(m) for m in args.m_list.split(",")]
    except ValueError:
        print(f"--m-list: expected comma-separated integers, got {args.m_list!r}", file=sys.stderr)
        return 2
    from k3nvfp4.kernels import sass

    failed = False
    for i, arch in enumerate(int(a) for a in args.arch.split(",")):
        rows, errors = our_rows(arch, shapes, m_list)
        peers, peer_errors = ([], []) if args.no_peers else peer_rows(arch)
        result = {
            "device": "offline compile (no GPU)",
            "arch": f"sm_{arch}",
            "date": _dt.date.today().isoformat(),
            "git_commit": _git_commit(),
            "versions": _versions(),
            "hbm_budget": round(sass.HBM_BUDGET, 4),
            "config_lookup": f"get_moe_config(..., device_name={DEVICE_NAME!r})",
            "rows": rows,
            "peers": peers,
            "errors": errors + peer_errors,
        }
        if arch >= 100:
            result["fp4_modes"] = fp4_mode_rows(arch)
            failed |= not all(r.get("native") for r in result["fp4_modes"])
        out = pathlib.Path(args.out) if args.out else REPO / "bench" / "results" / f"sass-sm{arch}.json"
        write_json_atomic(out, result, indent=1)
        md = markdown(result)
        print(md)
        print(f"wrote {out}")
        if args.write_readme and i == 0:
            write_readme(md, REPO / "bench" / "README.md")
            print("updated bench/README.md")
        failed |= bool(errors) or any(not r.get("meets_target", False) for r in rows if arch == 90)
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception:
        traceback.print_exc()
        sys.exit(1)
