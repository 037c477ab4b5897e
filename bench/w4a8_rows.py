"""The Hopper W4A8 ("e4m3") rows of the static report (bench/sass_report.py): on the H200 (sm_90),
every shard and M the report lists for W4A16, both checkpoints (nvfp4: the cast's NVFP4, weight
block 16; mxfp4: the release, weight block 32), each under both E4M3 tables the preparation may
choose (TABLES: "full", any weights; "normal", weights whose blocks all lie within 11 binades of
their row's largest), the config W4A8Config.heuristic picks, both GEMMs
compiled with the shard's shapes (offline/compile_w4a8.measure_w4a8_gemm: loop, registers, shared
memory, spills, FP8 / bf16 wgmma in the PTX) and put through the mode's call model
(moe_w4a8_details/call_model.w4a8_call). Beside each row: the W4A16 row, the W4A16 peer of its
checkpoint (marlin for nvfp4, FlashInfer for mxfp4) and FlashInfer's W4A8 (MXFP4 x FP8) at the
same shard and M, and per useful MAC (a useful weight times the local
tokens that need it: local pairs x 3 I H per call) the warp-instructions and weight bytes of each.

Everything here is computed from this run's compiles and rows; nothing is hard-coded. The issue's
static targets (issue 38) are evaluated in :func:`targets`.
"""

from __future__ import annotations

from dataclasses import asdict

from k3nvfp4.kernels.moe_details.e4m3_expand import E4M3_TABLES

CHECKPOINT_BLOCK = {"nvfp4": 16, "mxfp4": 32}  # the weights' block of each checkpoint (W4A8MoEWeights.block)
# The E4M3 tables a layer's GEMMs may take (W4A8MoEWeights.w13_table / w2_table, chosen from the
# data at preparation): a row assumes both GEMMs take the same one.
TABLES = E4M3_TABLES
LAST_ARRIVAL_BUFFER = {"gemm1": "part_ptr", "gemm2": "buf_ptr"}
# Issue 38's static done-when (H200): at M >= 4096 on EP16 and TP16, e4m3 <= 0.6x W4A16 and ahead of
# every peer counted; at M <= 64, e4m3 <= 1.05x W4A16.
TARGET_SHARDS = ("ep16", "tp16")
PREFILL_M, PREFILL_RATIO = 4096, 0.6
DECODE_M, DECODE_RATIO = 64, 1.05
# Short names of the report's peer sections, and the W4A16 peer of each checkpoint (the W4A8 peer,
# FlashInfer's MXFP4 x FP8, serves the same model on the same GPU: a peer of both).
PEER_LABEL = {"marlin": "marlin", "flashinfer": "FlashInfer W4A16", "flashinfer_w4a8": "FlashInfer W4A8"}
W4A16_PEER = {"nvfp4": "marlin", "mxfp4": "flashinfer"}


def peers_of(checkpoint: str) -> tuple[str, ...]:
    """The report sections whose rows an e4m3 row of this checkpoint is compared with."""
    return (W4A16_PEER[checkpoint], "flashinfer_w4a8")


def measure_job(job: tuple, ptx_dir: str | None = None) -> dict:
    """One e4m3 GEMM compiled and measured (a worker process's task). job: ("e4m3", kind, config,
    H, I, top_k, weight_block, table). With ptx_dir a last-arrival kernel (GEMM2, GEMM1 split over K) also
    writes its PTX there (its index entry under "ptx")."""
    import pathlib

    from k3nvfp4.common.files import write_text_atomic
    from k3nvfp4.kernels.offline.compile_w4a8 import compile_w4a8_gemm, measure_w4a8_gemm

    _, kind, cfg, H, I, top_k, wb, table = job
    try:
        c = compile_w4a8_gemm(kind, cfg, H, I, top_k, 90, wb, table)
        out = measure_w4a8_gemm(kind, cfg, H, I, top_k, 90, wb, compiled=c, table=table)
        if ptx_dir and (kind == "gemm2" or cfg.split_k1 > 1):
            path = pathlib.Path(ptx_dir) / f"{c.hash}.ptx"
            write_text_atomic(path, c.asm["ptx"])
            out["ptx"] = {"hash": c.hash, "ptx": path.name, "kind": kind, "buffer": LAST_ARRIVAL_BUFFER[kind],
                          "params": [k for k, v in c.src.signature.items() if v != "constexpr"]}
        return out
    except Exception as e:  # reported in the row, not hidden
        return {"error": f"{type(e).__name__}: {str(e)[:300]}"}


def _gemm_key(kind: str, cfg, wb: int, table: str) -> tuple:
    """What a compile of one GEMM depends on (H, I, top_k are runtime ints, all divisible by 16)."""
    if kind == "gemm1":
        return (kind, cfg.block_m, cfg.block_n1, cfg.block_k1, cfg.split_k1, cfg.num_warps1, cfg.num_stages, wb, table)
    return (kind, cfg.block_m, cfg.block_n2, cfg.block_k2, cfg.split_k2, cfg.num_warps2, cfg.num_stages,
            cfg.atomic_reduce, wb, table)


def row_name(checkpoint: str, table: str, shard: str, M: int) -> str:
    """An e4m3 row's name in the --ptx-dir index ("rows" of each last-arrival kernel)."""
    return f"H200 e4m3 {checkpoint} {table} {shard} M={M}"


class W4A8Statics:
    """The e4m3 compiles, cached per GEMM; with ``planning`` only records the jobs (as
    sass_report.Statics does), so that they run in the report's one process pool."""

    def __init__(self, planning: bool = False):
        self.planning = planning
        self.cache: dict = {}
        self.jobs: dict = {}
        self.uses: dict = {}
        self.errors: list[str] = []

    def get(self, kind: str, cfg, shard, wb: int, table: str, row: str) -> dict:
        key = _gemm_key(kind, cfg, wb, table)
        job = ("e4m3", kind, cfg, shard.hidden, shard.intermediate, shard.top_k, wb, table)
        self.jobs.setdefault(key, job)
        if row not in self.uses.setdefault(key, []):
            self.uses[key].append(row)
        if self.planning:
            return {"error": "planned"}
        if key not in self.cache:
            self.store(key, measure_job(job))
        return self.cache[key]

    def store(self, key: tuple, result: dict) -> None:
        self.cache[key] = result
        if "error" in result:
            self.errors.append(f"sm_90 e4m3 {' '.join(map(str, key))}: {result['error']}")


def config_dict(cfg) -> dict:
    return {**asdict(cfg), "label": cfg.label()}


def rows(shard_names, m_list, statics: W4A8Statics, checkpoint: str, table: str = "full") -> list[dict]:
    """The e4m3 rows of one checkpoint on the H200, both GEMMs under one E4M3 table (module docstring)."""
    from k3nvfp4.kernels import perf_model as pm
    from k3nvfp4.kernels.moe_w4a8_details.call_model import w4a8_call
    from k3nvfp4.kernels.moe_w4a8_details.config import W4A8Config

    device, wb = pm.H200, CHECKPOINT_BLOCK[checkpoint]
    out = []
    for sname in shard_names:
        shard = pm.K3_SHARDS[sname]
        for M in m_list:
            row = {"implementation": "k3nvfp4 e4m3", "checkpoint": checkpoint, "table": table, "device": "H200",
                   "arch": device.sm_tag, "shard": sname, "M": M}
            if shard.hidden % 64 or shard.intermediate % 64:
                row["error"] = (f"not runnable: the e4m3 mode needs H and I multiples of 64 "
                                f"(H = {shard.hidden}, I = {shard.intermediate})")
                out.append(row)
                continue
            cfg = W4A8Config.heuristic(shard.local_experts, shard.hidden, shard.intermediate, shard.top_k, M,
                                       num_global_experts=shard.global_experts, weight_block=wb, tables=(table, table),
                                       device_name="H200")
            row["config"] = config_dict(cfg)
            name = row_name(checkpoint, table, sname, M)
            measured = {kind: statics.get(kind, cfg, shard, wb, table, name) for kind in ("gemm1", "gemm2")}
            if any("error" in m for m in measured.values()):
                row["error"] = "; ".join(m["error"] for m in measured.values() if "error" in m)
                out.append(row)
                continue
            pred = w4a8_call(device, shard, M, cfg, {k: m["loop_cost"] for k, m in measured.items()}, wb)
            row.update(pred.to_dict())
            row.update(per_mac(row, shard, M))
            for kind, kern in zip(("gemm1", "gemm2"), row["kernels"]):
                m = measured[kind]
                kern.update({k: m[k] for k in ("instructions_per_iteration", "weights_per_iteration", "num_warps",
                                               "warp_instr_per_weight", "mma_per_iteration", "local_memory_ops_in_loop",
                                               "family_mix", "opcode_mix", "wgmma_forms", "wgmma_e4m3_in_ptx",
                                               "wgmma_bf16_in_ptx", "a_in_registers")})
                kern["ok"] = (kern["launchable"] and kern["local_bytes"] == 0 and kern["wgmma_e4m3_in_ptx"] > 0
                              and kern["wgmma_bf16_in_ptx"] == 0)
            row["ok"] = all(k["ok"] for k in row["kernels"])
            out.append(row)
    return out


def useful_macs(shard, M: int) -> float:
    """Multiply-adds a call needs: the local (token, slot) pairs x (GEMM1's 2 I H + GEMM2's H I)."""
    pairs = M * shard.top_k * shard.local_experts / shard.global_experts
    return pairs * 3 * shard.intermediate * shard.hidden


def per_mac(row: dict, shard, M: int) -> dict:
    """Warp-instructions (hot loops) and weight bytes per useful MAC of a predicted call's row."""
    macs = useful_macs(shard, M)
    kernels = row.get("kernels", [])
    return {"warp_instr_per_useful_mac": sum(k.get("warp_instructions", 0.0) for k in kernels) / macs,
            "bytes_per_useful_mac": sum(k.get("weight_bytes", 0.0) for k in kernels) / macs}


def floor_us(shard, M: int, weight_block: int, device=None, assumptions=None) -> dict:
    """The least time any e4m3 call on this skeleton can take at (shard, M) under the model's device
    figures: no tile, padding, instruction or launch cost, only what the call must move and multiply.

    - GEMM1: max(bytes, MMA): the active experts' gate/up weights (W4A8MoEWeights' bytes per
      weight: nibbles, one int8 offset per block, one fp32 row factor), the tokens in and the
      intermediate out in E4M3 with one fp32 scale per 128 (one row per local pair); the useful
      MACs (local pairs x 2 I H) at the FP8 peak x mma_efficiency;
    - GEMM2: max(bytes, MMA): the down weights, the intermediate in, and the top-k sum in fp32 as
      every mode here does it (the cheaper of the skeleton's two: the fp32 buffer zeroed, one fp32
      atomic per (pair, column), read once, the bf16 output written); MACs local pairs x H I;
    - the tokens' quantization (bf16 read, E4M3 + scales written).

    The GEMMs are separate launches, so their floors add. Bytes at device.hbm_copy_bytes_per_s.
    Returns {"us", "gemm1_us", "gemm2_us", "quant_us", "topk_sum_us"}: a target with
    floor > bound x W4A16 cannot be met by a better kernel on this skeleton, only by moving fewer
    bytes (targets)."""
    from k3nvfp4.kernels import perf_model as pm
    from k3nvfp4.kernels.moe_w4a8_details.call_model import ACT_BYTES as act, w4a8_bytes_per_weight

    device = device or pm.H200
    a = assumptions or pm.DEFAULT_ASSUMPTIONS
    H, I = shard.hidden, shard.intermediate
    routing = pm.expected_routing(shard, M, 16)  # its pairs and active experts do not depend on the tile
    pairs, active = routing.local_pairs, routing.active_experts

    def bpw(K: int) -> float:
        return w4a8_bytes_per_weight(weight_block, K)

    bw, fp8 = device.hbm_copy_bytes_per_s, a.mma_efficiency * device.mma_fp8_flops
    topk_sum = M * H * 4 + pairs * H * 4 + M * H * 4 + M * H * 2
    g1 = max((active * 2 * I * H * bpw(H) + min(M, pairs) * H * act + pairs * I * act) / bw, 2 * pairs * 2 * I * H / fp8)
    g2 = max((active * H * I * bpw(I) + pairs * I * act + topk_sum) / bw, 2 * pairs * H * I / fp8)
    quant = M * H * (2 + act) / bw
    return {"us": (g1 + g2 + quant) * 1e6, "gemm1_us": g1 * 1e6, "gemm2_us": g2 * 1e6, "quant_us": quant * 1e6,
            "topk_sum_us": topk_sum / bw * 1e6}


def compare(result: dict) -> None:
    """Put beside each e4m3 row the W4A16 row of the same checkpoint, shard and M and each peer of
    its checkpoint (:func:`peers_of`) from this run: times, per-MAC figures, ratios (e4m3 / other,
    < 1: e4m3 faster)."""
    from k3nvfp4.kernels import perf_model as pm

    ours = {(r["checkpoint"], r["shard"], r["M"]): r for r in result["rows"] if r.get("device") == "H200"}
    peers = {(sec, r["shard"], r["M"]): r for sec in PEER_LABEL for r in result.get(sec, {}).get("rows", [])}
    for r in result["e4m3"]["rows"]:
        if "error" in r:
            continue
        shard = pm.K3_SHARDS[r["shard"]]
        others = {"w4a16": ours.get((r["checkpoint"], r["shard"], r["M"]))}
        others |= {sec: peers.get((sec, r["shard"], r["M"])) for sec in peers_of(r["checkpoint"])}
        for name, o in others.items():
            if o is None or "error" in o or "time_us" not in o:
                r[f"{name}_time_us"] = None
                continue
            r[f"{name}_time_us"] = o["time_us"]
            r[f"{name}_ratio"] = round(r["time_us"] / o["time_us"], 4)
            r[f"{name}_per_mac"] = {k: round(v, 6) for k, v in per_mac(o, shard, r["M"]).items()}


def targets(result: dict) -> list[dict]:
    """Issue 38's static done-when figures from this run's rows (TARGET_SHARDS, both checkpoints,
    each E4M3 table):
    at M >= PREFILL_M e4m3 / W4A16 <= PREFILL_RATIO and e4m3 / peer < 1 for every peer with a time
    there (:func:`peers_of`); at M <= DECODE_M e4m3 / W4A16 <= DECODE_RATIO. "worst_peer" is the
    peer with the largest e4m3 / peer ratio (None where no peer runs the shard).
    "floor_over_w4a16": :func:`floor_us` / the W4A16 time, and "reachable": whether that floor is
    within the bound at all (None without a W4A16 time)."""
    out = []
    for r in result["e4m3"]["rows"]:
        if r["shard"] not in TARGET_SHARDS or "error" in r or r.get("w4a16_ratio") is None:
            continue
        if r["M"] >= PREFILL_M:
            bound, what = PREFILL_RATIO, "prefill"
        elif r["M"] <= DECODE_M:
            bound, what = DECODE_RATIO, "decode"
        else:
            continue
        ratios = {p: r[f"{p}_ratio"] for p in peers_of(r["checkpoint"]) if r.get(f"{p}_ratio") is not None}
        worst = max(ratios, key=ratios.get) if ratios else None
        t = {"checkpoint": r["checkpoint"], "table": r.get("table", "full"), "shard": r["shard"], "M": r["M"],
             "which": what,
             "e4m3_over_w4a16": r["w4a16_ratio"], "bound": bound, "met": r["w4a16_ratio"] <= bound,
             "e4m3_over_peers": ratios, "worst_peer": worst, "floor_over_w4a16": None, "reachable": None}
        if what == "prefill":
            t["met"] = t["met"] and all(x < 1.0 for x in ratios.values())
        if r.get("w4a16_time_us"):
            from k3nvfp4.kernels import perf_model as pm

            f = floor_us(pm.K3_SHARDS[r["shard"]], r["M"], CHECKPOINT_BLOCK[r["checkpoint"]])["us"]
            t["floor_over_w4a16"] = round(f / r["w4a16_time_us"], 4)
            t["reachable"] = t["floor_over_w4a16"] <= bound
        out.append(t)
    return out


def last_arrival_entries(statics: W4A8Statics) -> tuple[list[dict], list[str]]:
    """The e4m3 last-arrival kernels for sass_report's --ptx-dir index (family "e4m3"), and the
    errors of those that wrote no PTX."""
    entries, errors = {}, []
    for key, job in statics.jobs.items():
        kind, cfg = job[1], job[2]
        if not (kind == "gemm2" or cfg.split_k1 > 1):
            continue
        result = statics.cache.get(key, {})
        label = (f"e4m3 sm90 {cfg.tile(kind).label()} sk{cfg.split_k1 if kind == 'gemm1' else cfg.split_k2} wb{job[6]}"
                 f" {job[7]}")
        if "ptx" not in result:
            errors.append(f"{label}: no PTX ({result.get('error', 'not compiled')})")
            continue
        e = entries.setdefault(result["ptx"]["hash"], {**result["ptx"], "family": "e4m3", "rows": [], "label": label})
        e["rows"] += [f"{r} {kind}" for r in statics.uses.get(key, [])]
    return list(entries.values()), errors


def _f(x, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def _pair(full, normal, fmt: str) -> str:
    """"full / normal" of one figure (the normal table's "-" where its row has none)."""
    return f"{_f(full, fmt)} / {_f(normal, fmt)}"


def markdown(result: dict) -> list[str]:
    rows = result["e4m3"]["rows"]
    normal = {(r["checkpoint"], r["shard"], r["M"]): r for r in rows if r.get("table") == "normal" and "error" not in r}
    lines = ["Hopper W4A8 (`K3NVFP4_ACT_QUANT=e4m3`, docs/w4a8.md) on the H200, FP8 wgmma at the dense FP8 rate "
             "(`perf_model.H200.mma_fp8_flops`), W4A8Config.heuristic's pick, `bench/w4a8_rows.py`. Per GEMM: "
             "config (bn GEMM1/GEMM2, bk, sk, warps), CTAs/SM, warp-instructions per useful weight pass (bound). Per "
             "call: warp-instructions and weight bytes per useful MAC (x1000) of e4m3 / W4A16 / the W4A16 peer "
             "(marlin for nvfp4, FlashInfer for mxfp4), predicted times of e4m3, W4A16, the W4A16 peer and "
             "FlashInfer's W4A8 (MXFP4 x FP8, `peers/flashinfer_model.flashinfer_w4a8_call`: each GEMM at the "
             "fastest measured kernel its binding admits), and e4m3 / each. The config and per-GEMM figures are "
             "the full E4M3 table's (any weights); \"full / normal\" cells add the normal table's row (both GEMMs' "
             "weights within 11 binades of their rows' largest blocks: `W4A8MoEWeights.w13_table`, its own "
             "heuristic pick and compiles).", "",
             "| ckpt | shard | M | config | GEMM1 CTAs/SM, instr/useful w | GEMM2 CTAs/SM, instr/useful w | "
             "instr/MAC x1000 e4m3 / W4A16 / peer | B/MAC x1000 e4m3 / W4A16 | e4m3 us full / normal | W4A16 us | "
             "peer us | FI W4A8 us | e4m3/W4A16 full / normal | e4m3/peer full / normal | e4m3/FI W4A8 full / normal "
             "| ok |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.get("table", "full") != "full":
            continue
        if "error" in r:
            lines.append(f"| {r['checkpoint']} | {r['shard']} | {r['M']} | {r['error'][:90]} |" + " |" * 12)
            continue
        n = normal.get((r["checkpoint"], r["shard"], r["M"]), {})
        peer = W4A16_PEER[r["checkpoint"]]
        g = [f"{k['ctas_per_sm']}, {k['warp_instr_per_useful_weight']:.3f} ({k['bound']})" for k in r["kernels"]]
        w, p = r.get("w4a16_per_mac") or {}, r.get(f"{peer}_per_mac") or {}
        cfg = " ".join(x for x in r["config"]["label"].split() if x not in ("swap", "s3"))
        ok = r["ok"] and n.get("ok", False)
        lines.append(
            f"| {r['checkpoint']} | {r['shard']} | {r['M']} | {cfg} | {g[0]} | {g[1]} | "
            f"{r['warp_instr_per_useful_mac'] * 1e3:.3f} / {_f(w.get('warp_instr_per_useful_mac', 0) * 1e3 if w else None, '.3f')}"
            f" / {_f(p.get('warp_instr_per_useful_mac', 0) * 1e3 if p else None, '.3f')} | "
            f"{r['bytes_per_useful_mac'] * 1e3:.3f} / {_f(w.get('bytes_per_useful_mac', 0) * 1e3 if w else None, '.3f')} | "
            f"{_pair(r['time_us'], n.get('time_us'), '.1f')} | {_f(r.get('w4a16_time_us'))} | "
            f"{_f(r.get(f'{peer}_time_us'))} | {_f(r.get('flashinfer_w4a8_time_us'))} | "
            f"{_pair(r.get('w4a16_ratio'), n.get('w4a16_ratio'), '.2f')} | "
            f"{_pair(r.get(f'{peer}_ratio'), n.get(f'{peer}_ratio'), '.2f')} | "
            f"{_pair(r.get('flashinfer_w4a8_ratio'), n.get('flashinfer_w4a8_ratio'), '.2f')} | "
            f"{'yes' if ok else 'NO'} |")
    t = result["e4m3"].get("targets") or []
    if t:
        by_point: dict = {}
        for x in t:
            by_point.setdefault((x["checkpoint"], x["shard"], x["M"]), {})[x.get("table", "full")] = x
        met = {tb: sum(x["met"] for x in t if x.get("table", "full") == tb) for tb in TABLES}
        lines += ["", f"Issue 38's static targets (H200, {'/'.join(TARGET_SHARDS).upper()}): at M >= {PREFILL_M} "
                  f"e4m3 / W4A16 <= {PREFILL_RATIO} and ahead of every peer that runs the shard; at M <= "
                  f"{DECODE_M} e4m3 / W4A16 <= {DECODE_RATIO}. Met at {met['full']} of {len(by_point)} points with "
                  f"the full E4M3 table (any weights), at {met['normal']} with the normal one (every block within 11 "
                  "binades of its row's largest):",
                  "", "| ckpt | shard | M | e4m3 / W4A16 full / normal | bound | floor / W4A16 | "
                  "e4m3 / each peer full / normal | met full / normal |",
                  "|---|---|---|---|---|---|---|---|"]
        for (ckpt, shard, M), by_table in by_point.items():
            x, xn = by_table.get("full") or by_table["normal"], by_table.get("normal", {})
            each = ", ".join(f"{_pair(v, xn.get('e4m3_over_peers', {}).get(k), '.2f')} ({PEER_LABEL[k]})"
                             for k, v in x["e4m3_over_peers"].items()) or "- (none runs it)"
            fl = x.get("floor_over_w4a16")
            fl = "-" if fl is None else f"{fl:.2f}" + ("" if x["reachable"] else " (out of reach)")
            yes = {tb: ("yes" if by_table[tb]["met"] else "no") if tb in by_table else "-" for tb in TABLES}
            ratio = _pair(by_table.get("full", {}).get("e4m3_over_w4a16"), xn.get("e4m3_over_w4a16"), ".2f")
            lines.append(f"| {ckpt} | {shard} | {M} | {ratio} | {x['bound']} | {fl} | {each} | "
                         f"{yes['full']} / {yes['normal']} |")
        lines += ["", "floor: `w4a8_rows.floor_us`, the least time any e4m3 call on this skeleton can take under the "
                  "model's device figures (the weights, activations and fp32 top-k sum at the copy bandwidth, the "
                  "useful MACs at the FP8 rate, nothing else); \"out of reach\": the floor alone exceeds the bound "
                  "(docs/w4a8.md, \"What the targets can reach\")."]
    return lines
