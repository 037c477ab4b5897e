"""`sass_report.py --check`: the change detectors of the static report (issue 27).

They hold the project's performance claims to what was measured. They are not correctness tests,
and they break on any compiler update by design, so they run here and not in `make test`:

- **stale tables**: every shipped W4A16 and e4m3 GEMM compiled today against its row of
  `kernels/cost_table.py` (the heuristic's input), and the table's FP4 sections re-measured in
  full against their committed rows;
- **moved rows**: every prediction of this run (our rows, both FP4 modes' MMA rows, the B200 rows,
  the Hopper W4A8 (e4m3) rows, the peers' rows where built) against the committed report (bench/results/perf-model.json),
  row by row, naming the row and the fields that moved;
- **the dequant's opcode counts** (the H200 decode rows, M = 1 on TP16 / EP16, both checkpoint
  formats): exactly 4 bf16x2 scale products per word of 8 weights, 5 rotations per word plus at
  most one per 2 words for the scales (NVFP4; per 4 for E8M0), no PRMT (byte shuffles), no
  I2F/F2F, no spill: the dequant's design, which a compiler update must not undo (moved here
  from make test: they break on any compiler update by design);
- the loop budgets and KNOWN_MISSES, which sass_report applies to every row (its `ok`);
- **peer builds** (when the report built the peers): libk3marlin.so built from SGLang's sources and
  its self-check (exports, linkage, argument checks, the wrapper's errors), and the shape of
  FlashInfer's measured tiles.

Run after any change to a kernel, a layout, a config, a table or the Triton version
(bench/README.md, "When to run the static report").
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent
COMMITTED = REPO / "bench" / "results" / "perf-model.json"
# The figures of a row that a prediction consists of (the rest are labels or derived text).
ROW_FIELDS = ("config", "launchable", "launches", "time_us", "bytes_per_useful_weight", "warp_instr_per_useful_weight")
KERNEL_FIELDS = ("config", "launchable", "registers", "shared_bytes", "local_bytes", "ctas_per_sm",
                 "instructions_per_iteration", "warp_instr_per_useful_weight", "time_s")


def stale_tile_rows(rows: list[dict]) -> list[str]:
    """Shipped W4A16 GEMMs whose compile today disagrees with their cost_table entry:
    shared memory within 1 KiB, at least the CTAs per SM the model assumed, the loop within 5 %
    (GEMM1 also not 5 % shorter; GEMM2's entry is the worse of its two top-k reductions)."""
    from k3nvfp4.kernels import perf_model as pm
    from k3nvfp4.kernels.moe_details.layout import E5M3_16, E8M0_32
    from k3nvfp4.kernels.costs import Tile, tile_cost
    from k3nvfp4.kernels.moe_details.config import MoEConfig

    formats = {"nvfp4": E5M3_16, "mxfp4": E8M0_32}
    out = []
    for r in rows:
        if "kernels" not in r or r.get("implementation", "").split()[0] != "k3nvfp4":
            continue
        c = r["config"] if isinstance(r["config"], dict) else None
        if c is None:
            continue
        arch = pm.DEVICES[r["device"]].arch
        for k, kind, n in zip(r["kernels"], ("gemm1", "gemm2"), ("1", "2")):
            tile = Tile(kind, c["block_m"], c["swap_ab"], c[f"block_n{n}"], c[f"block_k{n}"], c[f"num_warps{n}"],
                        c[f"num_stages{n}"])
            where = f"{r['device']} {r['checkpoint']} {r['shard']} M={r['M']} {tile.label()} sk{c[f'split_k{n}']}"
            cost = tile_cost(tile, arch, MoEConfig.cost_mode(formats[r["checkpoint"]]))
            if cost is None:
                out.append(f"{where}: not in the table for sm_{arch}")
                continue
            modelled = pm.occupancy(pm.DEVICES[r["device"]], cost.registers, 32 * cost.num_warps, cost.shared_bytes)[0]
            measured, table = k["instructions_per_iteration"], cost.instructions_per_iteration
            if k["shared_bytes"] > cost.shared_bytes + 1024:
                out.append(f"{where}: shared {k['shared_bytes']} B > table {cost.shared_bytes} + 1024")
            if k["ctas_per_sm"] < modelled:
                out.append(f"{where}: {k['ctas_per_sm']} CTAs/SM < the table's {modelled}")
            if measured > 1.05 * table or (kind == "gemm1" and measured < 0.95 * table):
                out.append(f"{where}: loop {measured} instructions vs table {table}")
    return out


def stale_w4a8_rows(rows: list[dict]) -> list[str]:
    """Shipped e4m3 GEMMs (the report's "e4m3" rows) whose compile today disagrees with their
    cost_table entry ("w4a8 e4m3/<block>": the worse of split-K 1 and 2): shared memory within 1 KiB,
    at least the CTAs per SM the model assumed, the loop at most 5 % longer than the table's and at
    most 10 % shorter (the table keeps the worse split-K compile, which can be ~6 % longer than the
    other: 371 against 352 for GEMM1 bm64 bk128 w8)."""
    from k3nvfp4.kernels import perf_model as pm
    from k3nvfp4.kernels.costs import tile_cost
    from k3nvfp4.kernels.moe_w4a8_details.config import COST_ARCH, W4A8Config

    out = []
    for r in rows:
        if "kernels" not in r:
            continue
        cfg = W4A8Config.from_dict({k: v for k, v in r["config"].items() if k != "label"})
        wb = {"nvfp4": 16, "mxfp4": 32}[r["checkpoint"]]
        for k, kind in zip(r["kernels"], ("gemm1", "gemm2")):
            tile = cfg.tile(kind)
            table = r.get("table", "full")
            where = f"H200 e4m3 {r['checkpoint']} {table} {r['shard']} M={r['M']} {tile.label()}"
            cost = tile_cost(tile, COST_ARCH, W4A8Config.cost_mode(wb, table))
            if cost is None:
                out.append(f"{where}: not in the table")
                continue
            modelled = pm.occupancy(pm.H200, cost.registers, 32 * cost.num_warps, cost.shared_bytes)[0]
            if k["shared_bytes"] > cost.shared_bytes + 1024:
                out.append(f"{where}: shared {k['shared_bytes']} B > table {cost.shared_bytes} + 1024")
            if k["ctas_per_sm"] < modelled:
                out.append(f"{where}: {k['ctas_per_sm']} CTAs/SM < the table's {modelled}")
            loop, table = k["instructions_per_iteration"], cost.instructions_per_iteration
            if loop > 1.05 * table or loop < 0.90 * table:
                out.append(f"{where}: loop {k['instructions_per_iteration']} instructions vs table "
                           f"{cost.instructions_per_iteration}")
    return out


OPCODE_SHARDS = ("tp16", "ep16")  # the decode rows whose dequant opcodes are counted


def opcode_findings(rows: list[dict]) -> list[str]:
    """The dequant's exact opcode counts in the hot K loop of the H200 decode rows (M = 1,
    OPCODE_SHARDS, both checkpoints): per thread and iteration ``words`` words of 8 weights; 4
    bf16x2 products (f16x2) per word; 5 SHF.L.W.U32.HI per word plus at most words // 2 (NVFP4's
    1-byte scales) or words // 4 (E8M0 per 32) for the scale words; PRMT 0; no I2F/F2F; no
    local memory in the loop. One line per breach, naming the row and the GEMM."""
    out = []
    picked = [r for r in rows if r.get("implementation", "k3nvfp4") == "k3nvfp4" and r.get("device") == "H200"
              and r.get("M") == 1 and r.get("shard") in OPCODE_SHARDS]
    if rows and not picked:
        return [f"opcode counts: no H200 decode row (M = 1, {'/'.join(OPCODE_SHARDS)}) in the report"]
    for r in picked:
        if "error" in r:
            out.append(f"H200 {r['checkpoint']} {r['shard']} M=1: {r['error']}")
            continue
        for k in r["kernels"]:
            where = f"H200 {r['checkpoint']} {r['shard']} M=1 {k['name']}"
            mix, fam = k.get("opcode_mix", {}), k.get("family_mix", {})
            words = k["weights_per_iteration"] // k["num_warps"] // 32 // 8
            rotations = mix.get("SHF.L.W.U32.HI", 0) - 5 * words
            limit = words // 2 if r["checkpoint"] == "nvfp4" else words // 4
            checks = [(k["mma_per_iteration"] > 0, f"no MMA in the loop"),
                      (k["local_bytes"] == 0 and k["local_memory_ops_in_loop"] == 0, "spills"),
                      (fam.get("convert", 0) == 0, f"{fam.get('convert')} I2F/F2F in the dequant"),
                      (fam.get("f16x2", 0) == 4 * words, f"f16x2 {fam.get('f16x2', 0)} != 4 x {words} words"),
                      (0 <= rotations <= limit, f"scale rotations {rotations} outside 0..{limit} ({words} words)"),
                      (mix.get("PRMT", 0) == 0, f"PRMT {mix.get('PRMT')} (byte shuffles)")]
            out += [f"{where}: {what}" for ok, what in checks if not ok]
    return out


def stale_fp4_table() -> list[str]:
    """The FP4 sections of the cost table re-measured in full (a subprocess without
    TRITON_INTERPRET), row by row."""
    from k3nvfp4.kernels import cost_table
    from k3nvfp4.kernels.moe_fp4_details.config import COST_ARCH, FP4MoEConfig
    from k3nvfp4.kernels.target import triton_release

    version = triton_release()
    table = {f"{mode} {label}": row for (v, arch, mode), rows in cost_table.COSTS.items()
             if v == version and arch == COST_ARCH and mode in map(FP4MoEConfig.cost_mode, ("nvfp4", "mxfp8"))
             for label, row in rows.items()}
    if not table:
        return [f"FP4 cost table: not measured with the installed Triton {version}: "
                f"regenerate it ({cost_table.COMMAND} --family fp4)"]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import json; from k3nvfp4.kernels.offline import costs; "
            "print(json.dumps({f'{k[2]} {label}': list(v) for k, rows in costs.measure_family('fp4', progress=False).items() "
            "for label, v in rows.items()}))")
    proc = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, env=env, timeout=1800)
    if proc.returncode != 0:
        return [f"FP4 cost table: the measurement failed: {proc.stderr[-2000:]}"]
    measured = {k: tuple(v) for k, v in json.loads(proc.stdout.strip().splitlines()[-1]).items()}
    out = [f"FP4 cost table {k}: table {table.get(k)} measured {v}"
           for k, v in sorted(measured.items()) if table.get(k) != v]
    out += [f"FP4 cost table {k}: in the table, no longer measured" for k in sorted(set(table) - set(measured))]
    return out


def _key(row: dict) -> tuple:
    # "table": the e4m3 rows' E4M3 table (None elsewhere); last, so that [1:5] stays (checkpoint .. M)
    return tuple(row.get(f) for f in ("implementation", "checkpoint", "device", "shard", "M", "kernel", "arch",
                                      "table"))


def _section_rows(result: dict) -> dict[str, list[dict]]:
    return {"rows": result.get("rows", []), "fp4_modes": result.get("fp4_modes", []),
            "b200.fp4": result.get("b200", {}).get("fp4", []), "b200.w4a16": result.get("b200", {}).get("w4a16", []),
            "marlin": result.get("marlin", {}).get("rows", []), "flashinfer": result.get("flashinfer", {}).get("rows", []),
            "flashinfer_w4a8": result.get("flashinfer_w4a8", {}).get("rows", []),
            "e4m3": result.get("e4m3", {}).get("rows", [])}


def _fields(row: dict) -> dict:
    out = {f: row.get(f) for f in ROW_FIELDS if f in row}
    out |= {f: row[f] for f in ("registers", "shared_bytes", "local_bytes", "native", "tcgen05_mma", "wgmma") if f in row}
    for i, k in enumerate(row.get("kernels", [])):
        out |= {f"kernels[{i}].{f}": k.get(f) for f in KERNEL_FIELDS if f in k}
    return out


def moved_rows(result: dict, committed: dict) -> list[str]:
    """Rows of ``result`` whose predictions differ from ``committed``'s, named with the fields
    that moved; rows only on one side too (a section the run did not compute is skipped)."""
    out = []
    new, old = _section_rows(result), _section_rows(committed)
    for section, rows in new.items():
        if not rows:
            continue
        before = {_key(r): r for r in old.get(section, [])}
        for r in rows:
            b = before.pop(_key(r), None)
            name = f"{section} " + " ".join(str(x) for x in _key(r) if x is not None)
            if b is None:
                out.append(f"{name}: not in the committed report")
                continue
            fa, fb = _fields(r), _fields(b)
            diff = [f"{f} {fb.get(f)!r} -> {fa.get(f)!r}" for f in sorted(set(fa) | set(fb)) if fa.get(f) != fb.get(f)]
            if diff:
                out.append(f"{name}: " + "; ".join(diff))
        covered = {_key(r)[1:5] for r in rows}
        out += [f"{section} " + " ".join(str(x) for x in k if x is not None) + ": in the committed report, not produced"
                for k in before if k[1:5] in covered]
    return out


def marlin_library_findings() -> list[str]:
    """Build (or reuse) libk3marlin.so and run its self-check (bench/peers/marlin/selfcheck.py)."""
    sys.path.insert(0, str(REPO / "bench"))
    from peers.marlin import build, selfcheck

    try:
        res = build.build(log=lambda *_: None)
        rep = selfcheck.run_checks(str(res.path))
    except Exception as e:
        return [f"libk3marlin: {type(e).__name__}: {e}"]
    out = [f"libk3marlin: {f}" for f in rep["failures"]]
    if len(rep["bad_calls"]) != len(selfcheck.BAD_CALLS):
        out.append(f"libk3marlin: {len(rep['bad_calls'])} of {len(selfcheck.BAD_CALLS)} bad calls probed")
    return out


def flashinfer_findings(statics: list[dict]) -> list[str]:
    """FlashInfer's measured tiles (flashinfer_sass.flashinfer_rows) have the shape the model
    assumes: the tiles of TILES (pingpong) and COOPERATIVE_TILES, (M / 64) x (K / 16) MMAs an
    iteration, 11 launches a call, a loop of at most 0.2 + N / 1024 warp-instructions per weight
    besides its spill loads and stores (N / 1024: the E8M0 scale's FFMA, one per accumulator per 32
    K, 4 warps x (K / 32) x (rows x N / 128) per rows x K weights). A tile that spills is not a
    finding: FlashInfer ships it (with nvcc 13.0 most tiles of 64 tokens and more spill, 8-384 B per
    thread, and the 128x256, 256x128 and 256x256 ones 2400-7688 B), the model charges the spill
    instructions' issue slots but not their traffic, which favours the peer, and the prediction's
    notes name it; spill instructions without local memory are a finding. Nor is a tile whose
    shared memory exceeds an SM's (64x128x512, 128x256x256 and 256x128x256 with nvcc 13.0): it is
    in FlashInfer's list, cannot launch on an H100 / H200, and the model never picks it, so its
    loop is not held to the bound."""
    sys.path.insert(0, str(REPO / "bench"))
    from k3nvfp4.kernels import perf_model as pm
    from peers import flashinfer_sass as fs

    out = []
    tiles = list(fs.TILES + fs.COOPERATIVE_TILES)
    if [(r["tile"]["M"], r["tile"]["N"], r["tile"]["K"]) for r in statics] != tiles:
        out.append(f"flashinfer: tiles {[r['tile'] for r in statics]} != TILES + COOPERATIVE_TILES {tiles}")
    for r in statics:
        t = r["tile"]
        name = f"flashinfer {t['M']}x{t['N']}x{t['K']}"
        kind = "cooperative" if (t["M"], t["N"], t["K"]) in fs.COOPERATIVE_TILES else "warp_specialized"
        fits = r["shared_bytes"] is not None and r["shared_bytes"] <= pm.H200.shared_per_block
        checks = [(r["kernel"] == fs.KERNEL and t["schedule"] == fs.schedule_of(kind), "kernel / schedule"),
                  (r["registers"] > 0 and r["local_bytes"] >= 0, "registers"),
                  (r["mma_per_iteration"] == (t["M"] // 64) * (t["K"] // 16) > 0, "MMAs per iteration"),
                  (r["weights_per_iteration"] == t["M"] * t["K"], "weights per iteration"),
                  (not fits or 0.05 < r["warp_instr_per_weight_without_spills"] < 0.2 + t["N"] / 1024,
                   "warp-instructions per weight"),
                  (r["spill_ops_per_iteration"] == 0 or r["local_bytes"] > 0, "spills without local memory"),
                  (r["consumer_warp_instr_per_weight"] < r["warp_instr_per_weight"], "consumer share"),
                  (r["setmaxnreg"] == {"consumer": 232, "producer": 40}, "setmaxnreg"),
                  (r["launches_per_call"] == 11 and len(r["launch_sources"]) == 11, "launches per call"),
                  (r["bytes_per_weight"] == 0.53125, "bytes per weight")]
        if r["shared_dynamic_bytes"] is not None:
            checks.append((0 < r["shared_dynamic_bytes"]
                           and r["shared_bytes"] == r["shared_static_bytes"] + r["shared_dynamic_bytes"], "shared memory"))
        else:
            checks.append((r["shared_bytes"] is None and bool(r["shared_bytes_note"]), "shared memory note"))
        out += [f"{name}: {what}" for ok, what in checks if not ok]
    return out


def flashinfer_w4a8_findings(statics: list[dict]) -> list[str]:
    """FlashInfer's measured W4A8 kernels (flashinfer_sass.flashinfer_w4a8_rows) have the shape
    flashinfer_model.flashinfer_w4a8_call assumes: the kernels of W4A8_VARIANTS, FP8 QGMMA with
    the weights from registers, (M / 64) x (K / 32) MMAs per warp an iteration, at most 0.3
    warp-instructions per weight besides spill loads and stores, known shared memory that fits an
    SM (every kernel of this peer does, with nvcc 13.0), 11 launches a call, 0.53125 B per weight. A
    spill is not a finding (flashinfer_findings: the model leaves its traffic uncharged, in the
    peer's favour; the 256x256 tile spills 2680 B)."""
    sys.path.insert(0, str(REPO / "bench"))
    from k3nvfp4.kernels import perf_model as pm
    from peers import flashinfer_sass as fs

    out = []
    have = [(r["kernel_type"], (r["tile"]["M"], r["tile"]["N"], r["tile"]["K"])) for r in statics]
    if have != list(fs.W4A8_VARIANTS):
        out.append(f"flashinfer w4a8: kernels {have} != W4A8_VARIANTS {list(fs.W4A8_VARIANTS)}")
    for r in statics:
        t = r["tile"]
        name = f"flashinfer w4a8 {t['M']}x{t['N']}x{t['K']} {r['kernel_type']}"
        single = fs.is_single_warpgroup(r["kernel_type"])
        checks = [(t["mma_atom"] == f"MMA_64x{t['N']}x32_F32E4M3E4M3_RS", "FP8 MMA atom, A from registers"),
                  (r["registers"] > 0 and r["local_bytes"] >= 0, "registers"),
                  (r["mma_per_iteration"] == (t["M"] // 64) * (t["K"] // 32) > 0, "MMAs per iteration"),
                  (r["weights_per_iteration"] == t["M"] * t["K"], "weights per iteration"),
                  (0.03 < r["warp_instr_per_weight_without_spills"] < 0.3, "warp-instructions per weight"),
                  (r["spill_ops_per_iteration"] == 0 or r["local_bytes"] > 0, "spills without local memory"),
                  (r["num_warps"] == (fs.SINGLE_WARPGROUP_WARPS if single else fs.CTA_WARPS), "CTA warps"),
                  (r["shared_bytes"] is not None and 0 < r["shared_bytes"] <= pm.H200.shared_per_block,
                   "shared memory"),
                  (r["launches_per_call"] == 11, "launches per call"),
                  (r["bytes_per_weight"] == 0.53125, "bytes per weight")]
        out += [f"{name}: {what}" for ok, what in checks if not ok]
    return out


def run_checks(result: dict, committed_path: pathlib.Path = COMMITTED) -> list[str]:
    """Every finding of --check, one line each (empty: nothing moved, nothing stale)."""
    findings = [f"stale W4A16 tile table: {x}" for x in stale_tile_rows(result.get("rows", []))]
    findings += [f"dequant opcodes: {x}" for x in opcode_findings(result.get("rows", []))]
    findings += [f"stale e4m3 tile table: {x}" for x in stale_w4a8_rows(result.get("e4m3", {}).get("rows", []))]
    if result.get("marlin", {}).get("available"):
        findings += marlin_library_findings()
    if result.get("flashinfer", {}).get("available"):
        findings += flashinfer_findings(result["flashinfer"]["statics"])
    if result.get("flashinfer_w4a8", {}).get("available"):
        findings += flashinfer_w4a8_findings(result["flashinfer_w4a8"]["statics"])
    if result.get("fp4_modes"):
        findings += stale_fp4_table()
    if not committed_path.is_file():
        return findings + [f"no committed report at {committed_path}"]
    committed = json.loads(committed_path.read_text())
    if committed.get("versions", {}).get("triton") != result.get("versions", {}).get("triton"):
        findings.append(f"the committed report is of Triton {committed.get('versions', {}).get('triton')}, "
                        f"this run {result.get('versions', {}).get('triton')}: rows below may move for that alone")
    findings += [f"moved: {x}" for x in moved_rows(result, committed)]
    return findings
