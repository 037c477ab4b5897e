"""The B200 rows of the static report (bench/sass_report.py): the FP4 tensor-core modes (W4A4 nvfp4
with the static intermediate scale, W4A8 mxfp8) and W4A16 on sm_100, K3 TP8 (I = 384) and TP16
(I = 192), next to FlashInfer's published K3 NVFP4 SiTU MoE times on B200 at TP8 and next to the
FP4 modes as they were before issue 18.

Each FP4 row: the config FP4MoEConfig.heuristic picks for B200, both GEMMs compiled for sm_100
and measured (offline.compile.measure_fp4_gemm: loop, registers, shared memory, spills), put through
perf_model.fp4_call: launchable, CTAs per SM, waves, bytes per useful weight, bytes in flight per
SM against what HBM needs, launches, predicted time per call.

"Before" is the same model on the FP4 modes of commit 1caa373 (the last before issue 18): GEMM1
with gate and up in two separate 128-row MMAs (block_n1 = 128: at I = 192 a quarter of the rows
padding), no split-K, and two launches more: the activation quantization, and a combine kernel
that read the fp32 [M k, H] rows back. Their loop costs were measured once at that commit with
the same method (sm_100, Triton 3.8, bundled ptxas), and are the constants below.
"""

from __future__ import annotations

from dataclasses import replace

B200_M = (1, 8, 64, 128, 1024, 4096)
B200_SHARDS = ("tp8", "tp16")
MODES = ("nvfp4", "mxfp8")
# FlashInfer PR 5183 (K3 NVFP4 SiTU MoE, B200, TP8 = I 384), us per call at M tokens, as published.
FLASHINFER_B200_TP8_US = {1: 31.9, 8: 91.9, 64: 372.0, 128: 386.0}

# Loop costs at commit 1caa373 (instructions per warp-iteration, registers, shared bytes, spill
# bytes), measured with offline.compile.compile_fp4_gemm + k3nvfp4.kernels.offline.sass on that commit's
# kernels: key (kind, mode, I, decode). Decode = block_m 16 swap-AB, else block_m 128.
BEFORE_COMMIT = "1caa373"
BEFORE_COSTS = {
    ("gemm1", "nvfp4", 384, True): (304, 196, 35840, 0), ("gemm2", "nvfp4", 384, True): (184, 90, 19456, 0),
    ("gemm1", "nvfp4", 192, True): (304, 196, 35840, 0), ("gemm2", "nvfp4", 192, True): (138, 56, 9728, 0),
    ("gemm1", "mxfp8", 384, True): (275, 119, 70144, 0), ("gemm2", "mxfp8", 384, True): (169, 64, 37376, 0),
    ("gemm1", "mxfp8", 192, True): (275, 119, 70144, 0), ("gemm2", "mxfp8", 192, True): (122, 48, 18688, 0),
    ("gemm1", "nvfp4", 384, False): (246, 206, 50176, 0), ("gemm2", "nvfp4", 384, False): (163, 128, 33792, 0),
    ("gemm1", "nvfp4", 192, False): (246, 206, 50176, 0), ("gemm2", "nvfp4", 192, False): (152, 128, 16896, 0),
    ("gemm1", "mxfp8", 384, False): (296, 179, 98816, 0), ("gemm2", "mxfp8", 384, False): (191, 121, 66048, 0),
    ("gemm1", "mxfp8", 192, False): (296, 179, 98816, 0), ("gemm2", "mxfp8", 192, False): (125, 121, 33024, 0),
}


def _before(pm, shard, M: int, mode: str, cfg_now) -> dict:
    """The FP4 mode of commit 1caa373 under today's model (module docstring)."""
    from k3nvfp4.kernels.moe_fp4_details.call_model import fp4_call
    from k3nvfp4.kernels.perf_model import LoopCost

    old = replace(cfg_now, block_n1=128, split_k1=1, split_k2=1)
    costs = {}
    for kind in ("gemm1", "gemm2"):
        instr, regs, shared, local = BEFORE_COSTS[(kind, mode, shard.intermediate, cfg_now.swap_ab)]
        costs[kind] = LoopCost(instr, old.num_warps, regs, shared, local)
    pred = fp4_call(pm.B200, shard, M, old, costs, mode)
    a = pm.DEFAULT_ASSUMPTIONS
    # + the combine kernel (fp32 [M k, H] read, [M, H] bf16 written); + the quantization's own
    # launch where the routing is one launch now (fused there; above 1024 pairs it still is apart).
    extra_launches = 2 if pred.fixed_launches == 1 else 1
    combine_bytes = M * shard.top_k * shard.hidden * 4 + M * shard.hidden * 2
    extra = extra_launches * a.launch_s + a.hbm_latency_s + combine_bytes / pm.B200.hbm_copy_bytes_per_s
    g1 = pred.kernels[0]
    return {"launches": pred.launches + extra_launches, "time_us": round((pred.time_s + extra) * 1e6, 2),
            "gemm1_programs": g1.programs_active, "gemm1_ctas_per_sm": g1.ctas_per_sm, "gemm1_waves": round(g1.waves, 3),
            "config": old.label()}


def _kernel_cells(k) -> dict:
    return {"config": k.config, "launchable": k.launchable, "why_not": k.why_not, "registers": k.registers,
            "shared_bytes": k.shared_bytes, "local_bytes": k.local_bytes, "ctas_per_sm": k.ctas_per_sm,
            "occupancy_limit": k.occupancy_limit, "programs_active": round(k.programs_active, 1),
            "waves": round(k.waves, 3), "bytes_in_flight_per_sm": round(k.bytes_in_flight_per_sm),
            "bytes_in_flight_needed_per_sm": round(k.bytes_in_flight_needed_per_sm),
            "warp_instr_per_useful_weight": round(k.warp_instr_per_useful_weight, 4), "bound": k.bound,
            "time_us": round(k.time_s * 1e6, 2)}


def fp4_rows(errors: list[str]) -> list[dict]:
    """Rows of both FP4 modes on B200, TP8 / TP16, B200_M (measured loops, heuristic configs)."""
    from k3nvfp4.kernels import perf_model as pm
    from k3nvfp4.kernels.moe_fp4_details.call_model import fp4_call
    from k3nvfp4.kernels.offline.compile import measure_fp4_gemm
    from k3nvfp4.kernels.moe_fp4_details.config import FP4MoEConfig

    cache: dict = {}
    rows = []
    for mode in MODES:
        for sname in B200_SHARDS:
            shard = pm.K3_SHARDS[sname]
            for M in B200_M:
                cfg = FP4MoEConfig.heuristic(shard.local_experts, shard.hidden, shard.intermediate, shard.top_k, M,
                                             act_quant=mode, num_global_experts=shard.global_experts,
                                             device_name="B200")
                row = {"implementation": f"k3nvfp4 {mode}", "device": "B200", "arch": "sm_100", "shard": sname, "M": M,
                       "config": cfg.label()}
                costs = {}
                for kind in ("gemm1", "gemm2"):
                    key = f"{FP4MoEConfig.cost_mode(mode)} {cfg.tile(kind).label()}"
                    if key not in cache:
                        try:
                            cache[key] = measure_fp4_gemm(kind, mode, cfg, shard.hidden, shard.intermediate,
                                                          shard.top_k, arch=100)
                        except Exception as e:  # reported in the row and the errors, not hidden
                            cache[key] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
                            errors.append(f"sm_100 {key}: {e}")
                    if "error" in cache[key]:
                        row["error"] = cache[key]["error"]
                    else:
                        costs[kind] = cache[key]["loop_cost"]
                if "error" in row:
                    rows.append(row)
                    continue
                pred = fp4_call(pm.B200, shard, M, cfg, costs, mode)
                pub = FLASHINFER_B200_TP8_US.get(M) if sname == "tp8" else None
                row.update({
                    "launchable": pred.launchable, "launches": pred.launches, "time_us": round(pred.time_s * 1e6, 2),
                    "bytes_per_useful_weight": round(pred.bytes_per_useful_weight, 4),
                    "warp_instr_per_useful_weight": round(pred.warp_instr_per_useful_weight, 4),
                    "kernels": [_kernel_cells(k) for k in pred.kernels],
                    "flashinfer_published_us": pub,
                    "ratio_over_flashinfer": round(pred.time_s * 1e6 / pub, 3) if pub else None,
                    "before": _before(pm, shard, M, mode, cfg),
                })
                row["ok"] = (pred.launchable and all(k.local_bytes == 0 for k in pred.kernels)
                             and (M > 64 or pred.launches <= 4) and (pub is None or row["ratio_over_flashinfer"] <= 1.0))
                rows.append(row)
    return rows


def w4a16_rows(our_rows_fn, statics) -> list[dict]:
    """W4A16 (fused_moe_nvfp4, NVFP4 checkpoint) on sm_100 at the same points, with FlashInfer's
    published TP8 times beside (information: the issue-bound W4A16 loop is not the B200 fast path)."""
    rows = our_rows_fn("B200", B200_SHARDS, B200_M, statics)
    for r in rows:
        pub = FLASHINFER_B200_TP8_US.get(r["M"]) if r["shard"] == "tp8" else None
        r["flashinfer_published_us"] = pub
        r["ratio_over_flashinfer"] = round(r["time_us"] / pub, 3) if pub and "time_us" in r else None
    return rows


def markdown(fp4: list[dict], w4a16: list[dict]) -> list[str]:
    """The B200 table of the report."""
    lines = [
        "B200 (sm_100), K3 TP8 (I = 384) and TP16 (I = 192): the FP4 tensor-core modes (nvfp4 = W4A4 with the static "
        "intermediate scale, mxfp8 = W4A8) with FP4MoEConfig.heuristic's split-K, before (commit "
        f"{BEFORE_COMMIT}) -> now, and W4A16; FlashInfer PR 5183's published B200 TP8 times beside "
        "(`bench/fp4_modes_model.py`). Per GEMM: programs, CTAs/SM, waves; in flight: KiB per SM "
        "(HBM needs bandwidth x latency / SMs).",
        "",
        "| path | shard | M | config | launches | GEMM1 programs / CTAs/SM / waves | GEMM2 programs / CTAs/SM / waves "
        "| B/useful w | in flight KiB/SM (needed) | predicted us | FlashInfer us | ratio | ok |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in fp4:
        if "error" in r:
            lines.append(f"| {r['implementation']} | {r['shard']} | {r['M']} | error: {r['error'][:80]} |" + " |" * 9)
            continue
        g1, g2 = r["kernels"]
        b = r["before"]
        fl = min(g["bytes_in_flight_per_sm"] for g in (g1, g2)) / 1024
        lines.append(
            f"| {r['implementation'].split()[-1]} | {r['shard']} | {r['M']} | {r['config']} | {b['launches']} -> {r['launches']} "
            f"| {b['gemm1_programs']:.0f} / {b['gemm1_ctas_per_sm']} / {b['gemm1_waves']:.2f} -> {g1['programs_active']:.0f} / "
            f"{g1['ctas_per_sm']} / {g1['waves']:.2f} | {g2['programs_active']:.0f} / {g2['ctas_per_sm']} / {g2['waves']:.2f} "
            f"| {r['bytes_per_useful_weight']:.3f} | {fl:.0f} ({g1['bytes_in_flight_needed_per_sm'] / 1024:.0f}) "
            f"| {b['time_us']:.1f} -> {r['time_us']:.1f} | {r['flashinfer_published_us'] or '-'} "
            f"| {r['ratio_over_flashinfer'] if r['ratio_over_flashinfer'] is not None else '-'} | {'yes' if r['ok'] else 'NO'} |")
    for r in w4a16:
        if "error" in r:
            continue
        g1, g2 = r["kernels"]
        fl = min(g["bytes_in_flight_per_sm"] for g in (g1, g2)) / 1024
        lines.append(
            f"| W4A16 | {r['shard']} | {r['M']} | {g1['config']}; {g2['config']} | {r['launches']} "
            f"| {g1['programs_active']:.0f} / {g1['ctas_per_sm']} / {g1['waves']:.2f} "
            f"| {g2['programs_active']:.0f} / {g2['ctas_per_sm']} / {g2['waves']:.2f} | {r['bytes_per_useful_weight']:.3f} "
            f"| {fl:.0f} ({g1['bytes_in_flight_needed_per_sm'] / 1024:.0f}) | {r['time_us']:.1f} "
            f"| {r['flashinfer_published_us'] or '-'} "
            f"| {r['ratio_over_flashinfer'] if r['ratio_over_flashinfer'] is not None else '-'} | - |")
    return lines
