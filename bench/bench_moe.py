#!/usr/bin/env python3
"""GPU benchmark of the fused NVFP4 SiTU MoE (k3nvfp4.kernels.fused_moe_nvfp4).

Shapes (per rank of Kimi-K3, docs/facts.md#kimi-k3-routed-experts):
  tp16: E=896, H=3584, I=192, top-16 (every expert local, I sharded 16 ways)
  ep16: 56 local experts of 896, H=3584, I=3072, top-16 over all 896; ids outside the local
        range become -1 (about 1 local route per token)
Routing: sigmoid scores, top-16 DISTINCT experts chosen on score + a fixed per-expert bias
(skewed load: hot and cold experts), weights renormalised (k3nvfp4.kernels.testing.kimi_routing).

Per point (shape, M):
  time      CUDA events around one call, the L2 flushed before each call (weights come from
            HBM, as in serving where other layers evict them); median of many. Our kernel is
            timed by CUDA-graph replay (how SGLang decodes) when capture works, else eagerly;
            the eager time is reported too.
  bytes     distinct LOCAL experts touched x (w13 + w2 packed nibbles + bf16 block scales + scale_2)
            + activations in and out (bf16) + topk ids/weights.
  flops     2 * (valid routes) * (2I*H + I*H); valid routes = M*top_k on tp16, the local ones on ep16.
  %         of the H200's 4.8 TB/s (spec) and ~790 TFLOP/s bf16 dense; the ceilings measured on
            this GPU (device-to-device copy, 8192^3 bf16 matmul) are recorded too.
  speedup   over bf16 weights (the same dequantized values) with torch grouped GEMM
            (torch._grouped_mm where it works, else a per-expert loop: the JSON says which),
            and over SGLang 0.5.23's NVFP4 marlin MoE (the Hopper path SGLang serves K3 with):
            its CUDA kernels built from the installed sglang's sources into one library
            (bench/peers/marlin, libk3marlin.so, built on the CPU machine and carried), the
            weights repacked exactly as SGLang prepares them, driven as fused_marlin_moe drives
            them (alignment, GEMM1, SiTU as a separate kernel, GEMM2, top-k sum; see
            bench/peers/marlin/moe.py for the two kernels substituted). x_vs_marlin = marlin time /
            our time. OpenAI triton_kernels when importable (else "not available: why").
            FlashInfer's SiTU MoE where it runs (k3nvfp4.sglang_ext.ab.flashinfer_arm: SM90
            cutlass_fused_moe W4A16 on MXFP4 experts, H and I multiples of 128, so ep16 and not
            tp16; SM100 its NVFP4 x NVFP4 path), on random MXFP4 experts of the shape, checked
            against the reference on those experts first (FlashInfer #4597: a wrong
            activation on this path would show as its error); x_vs_flashinfer = FlashInfer time /
            our time. Elsewhere "not available: why".
Weights: one scale_2 for w1 and w3 of an expert (as the K3 cast writes them and marlin needs).
Correctness: before timing, at one M per shape, our kernel and marlin (NaN-poisoned outputs)
and the bf16 baseline are compared with fused_moe_nvfp4_reference (normwise error); an arm that
fails its check is reported, not timed.

Writes <out-dir>/moe-<device>.json, .md (table) and .png. Run from the repo root:
  python bench/bench_moe.py                       # both shapes, all M (GPU; ~3-5 minutes)
  python bench/bench_moe.py --quick --m-list 1,64,1024
  python bench/bench_moe.py --device cpu --shapes tiny-tp,tiny-ep --quick   # interpreter smoke run

On a Blackwell GPU (sm100/sm103) each point also times the FP4 tensor-core modes
(act_quant_nvfp4 / act_quant_mxfp8: fused_moe_nvfp4 on each mode's weights from random MXFP4
weights, checked against fused_moe_fp4_reference first; x_vs_w4a16 = W4A16 time / mode time).
On a Hopper GPU (sm90) each point also times the W4A8 mode (act_quant_e4m3: weights expanded to
E4M3, FP8 activations, FP8 wgmma; docs/w4a8.md) on the same random MXFP4 experts, checked first
against fused_moe_w4a8_reference (the same quantization in plain torch, itself tested against the
float64 oracle tests/w4a8_oracle.py), with x_vs_w4a16 = W4A16 time / e4m3 time and x_vs_marlin =
marlin time / e4m3 time in the same run; at each shape's first point the weights' normal E4M3
table is also checked bit for bit against the full one (tables_agree: the bench's random weights
take the normal table, so this is where the full table's PTX runs on the GPU). At each shape's
last point, where the pick runs 64 tokens with GEMM1 on 8 warps and GEMM2 on 4, the same config
with GEMM2 on 8 warps is timed beside it (gemm2_warps: the GPU's answer to the static model's
claim, docs/w4a8.md "Built (2026-12-07)"). Shapes whose H or I is not a multiple of 64 (the tiny
CPU shapes) record why it did not run.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as _dt
import json
import os
import pathlib
import subprocess
import sys
import time
import traceback

H200_BW_TBPS = 4.8
H200_BF16_TFLOPS = 790.0


# name -> (per-rank shape as k3nvfp4.kernels.tune.TuneShape fields, M of the correctness check).
# Plain dicts: TuneShape's module defines Triton kernels, which must wait until main() has set
# TRITON_INTERPRET for --device cpu.
SHAPES = {
    "tp16": (dict(E=896, H=3584, I=192, top_k=16, global_experts=896), 64),
    "ep16": (dict(E=56, H=3584, I=3072, top_k=16, global_experts=896), 256),
    # CPU smoke shapes (interpreter): H, I multiples of 16, not powers of two.
    "tiny-tp": (dict(E=6, H=48, I=32, top_k=2, global_experts=6), 4),
    "tiny-ep": (dict(E=4, H=48, I=32, top_k=4, global_experts=16), 4),
    # The FP4 tensor-core modes need H, I multiples of 64 (whole MMA K steps).
    "tiny-fp4": (dict(E=6, H=128, I=64, top_k=2, global_experts=6), 4),
}
DEFAULT_M = [1, 4, 16, 64, 256, 1024, 4096, 16384]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default="tp16,ep16", help=f"comma list of {','.join(SHAPES)}")
    p.add_argument("--m-list", default=None, help=f"comma list of M (default {','.join(map(str, DEFAULT_M))}; cpu: 1,5)")
    p.add_argument("--quick", action="store_true", help="fewer timed runs per point")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cpu = interpreter smoke run")
    p.add_argument("--out-dir", default=None, help="default bench/results/ beside this script")
    p.add_argument("--no-baseline", action="store_true", help="skip the bf16 grouped-GEMM baseline")
    p.add_argument("--no-graph", action="store_true", help="time our kernel eagerly only")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--time-budget", type=float, default=None, help="seconds; skip the remaining points when spent")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def measure_ceilings(torch, device) -> dict:
    """Copy bandwidth (read + write bytes) and bf16 matmul rate on this GPU, random data."""
    out = {}
    try:
        n = 1 << 30
        a = torch.empty(n, dtype=torch.uint8, device=device).random_(0, 255)
        b = torch.empty_like(a)
        for _ in range(3):
            b.copy_(a)
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(10):
            b.copy_(a)
        e.record()
        torch.cuda.synchronize()
        out["copy_TBps"] = 2 * n * 10 / (s.elapsed_time(e) * 1e-3) / 1e12
        del a, b
        x = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
        y = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
        for _ in range(3):
            x @ y
        s.record()
        for _ in range(10):
            x @ y
        e.record()
        torch.cuda.synchronize()
        out["bf16_matmul_TFLOPs"] = 2 * 8192**3 * 10 / (s.elapsed_time(e) * 1e-3) / 1e12
    except Exception as ex:  # a ceiling we could not measure is reported, not fatal
        out["error"] = f"{type(ex).__name__}: {ex}"
    return out


# --------------------------------------------------------------------------------------------
# bf16 baseline: what a user has without this project


def dequantized_bf16(torch, weights, chunk: int = 32):
    """NVFP4MoEWeights -> bf16 w13 [E, 2I, H] (gate/up scale_2 applied), w2 [E, H, I]."""
    from k3nvfp4.kernels import formats

    E, H, I = weights.num_experts, weights.hidden_size, weights.intermediate_size
    w13q, w13s, w13s2, w2q, w2s, w2s2 = weights.to_modelopt()
    w13 = torch.empty(E, 2 * I, H, dtype=torch.bfloat16, device=weights.device)
    w2 = torch.empty(E, H, I, dtype=torch.bfloat16, device=weights.device)
    for lo in range(0, E, chunk):
        hi = min(E, lo + chunk)
        d = formats.dequantize_nvfp4(w13q[lo:hi], w13s[lo:hi], 1.0)
        d[:, :I] *= w13s2[lo:hi, 0, None, None]
        d[:, I:] *= w13s2[lo:hi, 1, None, None]
        w13[lo:hi] = d.to(torch.bfloat16)
        w2[lo:hi] = formats.dequantize_nvfp4(w2q[lo:hi], w2s[lo:hi], w2s2[lo:hi]).to(torch.bfloat16)
        del d
    return w13, w2


def _situ_bf16(torch, h):
    """SiTU (K3 defaults) of the bf16 GEMM1 output [n, 2I] (gate then up), in fp32 -> bf16."""
    from k3nvfp4.kernels.situ import situ_and_mul

    return situ_and_mul(h).to(torch.bfloat16)


def bf16_moe_grouped_mm(torch, x, w13, w2, topk_weights, topk_ids, n_valid: int | None = None):
    """Sort (token, slot) pairs by expert, two torch._grouped_mm calls, SiTU in fp32, weighted
    sum. -1 pairs sort last; ``n_valid`` (host int, the number of ids >= 0, known from the
    routing set-up) drops them before the GEMMs, so the baseline neither syncs nor gathers rows
    it does not need (this favours the baseline a little). No host sync inside."""
    M, k = topk_ids.shape
    E, _, H = w13.shape
    flat = topk_ids.reshape(-1).long()
    key = torch.where(flat < 0, torch.full_like(flat, E), flat)
    order = torch.argsort(key, stable=True)
    if n_valid is not None:
        order = order[:n_valid]
    token = order // k
    counts = torch.zeros(E + 1, dtype=torch.int32, device=x.device).scatter_add_(
        0, key, torch.ones_like(key, dtype=torch.int32)
    )
    offs = torch.cumsum(counts[:E], 0, dtype=torch.int32)
    xs = x.index_select(0, token)
    h = torch._grouped_mm(xs, w13.transpose(1, 2), offs=offs)
    a = _situ_bf16(torch, h)
    y = torch._grouped_mm(a, w2.transpose(1, 2), offs=offs)
    w = topk_weights.reshape(-1)[order]
    valid = (key[order] < E)[:, None]  # all True when n_valid is given
    y = torch.where(valid, y.float() * w[:, None], torch.zeros((), device=x.device))
    return torch.zeros(M, H, dtype=torch.float32, device=x.device).index_add_(0, token, y).to(x.dtype)


def graph_or_eager(torch, fn, cpu: bool):
    """(callable, mode): a CUDA graph replay of fn when capture works, else fn itself."""
    if cpu:
        return fn, "eager", None
    try:
        torch.cuda.synchronize()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()  # warm-up on the capture stream
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        graph.replay()
        torch.cuda.synchronize()
        return graph.replay, "cuda_graph", None
    except Exception as e:
        torch.cuda.synchronize()
        return fn, "eager", f"{type(e).__name__}: {str(e)[:200]}"


def time_call(torch, call, out, timer, *, use_graph: bool, what: str) -> tuple[float, int, float, str, str | None]:
    """(time, iters, eager time, mode, graph failure) of ``call`` (writes ``out``): timed eagerly,
    then as a CUDA-graph replay when ``use_graph`` and capture works. The replay must compute what
    the eager call computed (normwise 1e-2: atomic reductions may reorder the sum)."""
    from k3nvfp4.kernels.tune import normwise_error

    t_eager, n = timer.measure(call)
    t, mode, why = t_eager, "eager", None
    if use_graph:
        fn, mode, why = graph_or_eager(torch, call, False)
        if mode == "cuda_graph":
            t, n = timer.measure(fn)
            ref_out = out.clone()
            out.fill_(float("nan"))
            fn()
            if not torch.equal(out, ref_out) and normwise_error(out, ref_out.float()) > 1e-2:
                raise RuntimeError(f"{what}: CUDA-graph replay differs from the eager call")
    return t, n, t_eager, mode, why


def bf16_moe_loop(torch, x, w13, w2, topk_weights, topk_ids):
    """Per-expert loop (host sync per expert): the fallback where _grouped_mm is unavailable."""
    M, k = topk_ids.shape
    out = torch.zeros(M, x.shape[1], dtype=torch.float32, device=x.device)
    ids = topk_ids.long()
    for e in torch.unique(ids[ids >= 0]).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        a = _situ_bf16(torch, x[tok] @ w13[e].t())
        out.index_add_(0, tok, (a @ w2[e].t()).float() * topk_weights[tok, slot][:, None])
    return out.to(x.dtype)


# --------------------------------------------------------------------------------------------
# Other implementations (users' machines)


def probe_triton_kernels() -> str:
    try:
        import triton_kernels  # noqa: F401
        import triton_kernels.matmul_ogs  # noqa: F401
    except Exception as e:
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
        return f"not available: {type(e).__name__}: {first[:200]}"
    # Importable, but its MoE takes MXFP4 weights in its own swizzled layout and its own routing
    # objects; an adapter is not written yet, so no figure is claimed.
    return "not available: importable, but no adapter to its matmul_ogs API in this benchmark yet"


def probe_marlin(cpu: bool):
    """(MarlinLib or None, status): SGLang's NVFP4 marlin MoE through bench/peers/marlin's library."""
    if cpu:
        return None, "not available: the marlin arm runs on a CUDA GPU only (--device cpu)"
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    try:
        from peers.marlin.lib import load

        lib = load()
        why = lib.usable_driver()
        if why:
            return None, f"not available: {why}"
    except Exception as e:
        return None, f"not available: {type(e).__name__}: {e}"
    k = lib.info["key"]
    return lib, (f"libk3marlin {lib.info['build_id']}: sglang {k['sglang_version']} marlin MoE (NVFP4, bf16), "
                 f"nvcc {k['nvcc_version']}, {k['arch']}")


def bench_weights(shape, device, seed: int):
    """problem_weights' experts (uniform codes, mantissa-bearing E4M3 scales) with one scale_2 for
    gate and up: what the K3 cast writes, and the only case marlin computes exactly."""
    from k3nvfp4.kernels.testing import random_nvfp4_moe_weights

    return random_nvfp4_moe_weights(shape.E, shape.H, shape.I, device=device, seed=seed, block_scales="uniform",
                                    distinct_gate_up_scale_2=False)


# --------------------------------------------------------------------------------------------


def peer_check_error(torch, peer, xb, tw, ids, H: int, ref) -> float:
    """Normwise error against ``ref`` of one peer call into a NaN-poisoned bf16 [M, H] output (a
    row the peer never writes shows up as NaN, not as a stale value)."""
    from k3nvfp4.kernels.tune import normwise_error

    out = torch.full((xb.shape[0], H), float("nan"), dtype=torch.bfloat16, device=xb.device)
    peer(xb, tw, ids, out=out)
    torch.cuda.synchronize()
    return normwise_error(out, ref)


MARLIN_TOL = 2e-2  # bf16, normwise, as our kernel's


def marlin_arm(torch, lib, weights, shape, x, tw, ids, ref, info: dict):
    """Prepare SGLang's marlin layout from the same NVFP4 tensors and check marlin's output against
    the reference at the shape's check M (NaN-poisoned output). (MarlinMoE, None) when it passes,
    else (None, why): a failing arm is reported, not timed."""
    from peers.marlin.moe import MarlinMoE
    from peers.marlin.prepare import prepare_marlin_weights

    try:
        t0 = time.monotonic()
        mw = prepare_marlin_weights(weights, lib)
        torch.cuda.synchronize()
        prep_s = time.monotonic() - t0
        marlin = MarlinMoE(lib, mw, global_experts=shape.global_experts)
        err = peer_check_error(torch, marlin, x.to(torch.bfloat16), tw, ids, shape.H, ref)
    except Exception as e:
        info["marlin"] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:600]}"}
        return None, f"not timed: {info['marlin']['error']}"
    info["marlin"] = {"M": x.shape[0], "normwise_error": err, "tol": MARLIN_TOL, "ok": err <= MARLIN_TOL,
                      "prepare_s": round(prep_s, 2), "is_ep": marlin.is_ep,
                      "gate_up_scale_2_equal": mw.gate_up_scale_2_equal}
    if not err <= MARLIN_TOL:
        return None, f"not timed: failed its check (normwise error {err:.3g} > {MARLIN_TOL} vs the reference)"
    return marlin, None


def mxfp4_bench_weights(torch, shape, device, seed: int):
    """Random MXFP4 experts (uniform E2M1 nibbles, E8M0 scales 2^-7 .. 2^-4 per 32) as the
    release's tensors (MXFP4MoETensors), from which each mode and FlashInfer prepare their own."""
    from k3nvfp4.kernels.moe_details.weights import MXFP4MoETensors

    g = torch.Generator(device).manual_seed(seed + 7)
    E, H, I = shape.E, shape.H, shape.I

    def nibbles(*s):
        return torch.randint(0, 256, s, dtype=torch.uint8, device=device, generator=g)

    def e8m0(*s):  # 2^-7 .. 2^-4 per 32-block: O(1) outputs for O(1) inputs at K3's fan-in
        return torch.randint(120, 124, s, dtype=torch.uint8, device=device, generator=g)

    return MXFP4MoETensors(nibbles(E, 2 * I, H // 2), e8m0(E, 2 * I, H // 32), nibbles(E, H, I // 2),
                           e8m0(E, H, I // 32))


def fp4_mode_arms(torch, shape, device, seed: int) -> dict:
    """{act_quant: FP4MMAWeights} for the Blackwell FP4 modes, from random MXFP4 experts (E8M0
    scales per 32, so both modes can run: mxfp8 needs E8M0-representable weight scales)."""
    from k3nvfp4.kernels.modes import MODES

    t = mxfp4_bench_weights(torch, shape, device, seed)
    return {mode: MODES[mode].prepare(t) for mode in ("nvfp4", "mxfp8")}


def e4m3_mode_arm(torch, shape, device, seed: int):
    """(W4A8MoEWeights, None) for the Hopper W4A8 mode from random MXFP4 experts, or (None, the
    reason it cannot run on this shape)."""
    from k3nvfp4.kernels.modes import MODES

    if shape.H % 64 or shape.I % 64:
        return None, f"not available: the e4m3 mode needs H and I multiples of 64 (H = {shape.H}, I = {shape.I})"
    return MODES["e4m3"].prepare(mxfp4_bench_weights(torch, shape, device, seed)), None


def e4m3_tables_agree(torch, weights, x, tw, ids) -> bool | None:
    """Whether the weights' normal E4M3 table and the full one give the same output bit for bit (the
    same config, the top-k sum in slot order): the normal table's two-instruction PTX checked on the
    GPU against the 11-instruction one, which the bench's weights would otherwise never run. None
    where neither GEMM's weights chose the normal table (nothing to compare)."""
    from k3nvfp4.kernels.moe_w4a8 import run_w4a8

    if "normal" not in (weights.w13_table, weights.w2_table):
        return None
    normal = run_w4a8(x, weights, tw, ids, deterministic=True)  # its config: the one the weights' tables pick
    full = dataclasses.replace(weights, w13_table="full", w2_table="full")  # exact for every offset
    return bool(torch.equal(normal.out, run_w4a8(x, full, tw, ids, config=normal.config, deterministic=True).out))


def e4m3_gemm2_warps(torch, weights, x, tw, ids, timer, no_graph: bool, config=None) -> dict | None:
    """GEMM2 on 4 warps against 8 at one 64-token config (``config``; None: the one the call picks):
    {"config": label, "w4_us", "w8_us", "w8_over_w4"}, each timed like the point (time_call), each
    output first checked against the other (normwise 1e-2: the atomic top-k sum may reorder). None
    where the config is not 64 tokens with GEMM1 on 8 warps (nothing to compare)."""
    from k3nvfp4.kernels.moe_w4a8 import run_w4a8
    from k3nvfp4.kernels.tune import normwise_error

    cfg = config or run_w4a8(x, weights, tw, ids).config
    if (cfg.block_m, cfg.num_warps1) != (64, 8):
        return None
    res, outs = {"config": cfg.label()}, {}
    for warps2 in (4, 8):
        c = dataclasses.replace(cfg, num_warps2=warps2)
        out = torch.full_like(x, float("nan"))
        call = lambda c=c, out=out: run_w4a8(x, weights, tw, ids, config=c, out=out)  # noqa: E731
        call()
        outs[warps2] = out.clone()
        t, _, _, _, _ = time_call(torch, call, out, timer, use_graph=not no_graph, what=f"e4m3 GEMM2 w{warps2}")
        res[f"w{warps2}_us"] = t * 1e6
    err = normwise_error(outs[8], outs[4].float())
    if not err <= 1e-2:
        raise RuntimeError(f"e4m3 GEMM2 on 8 warps differs from 4 warps: normwise {err:.3g} > 1e-2")
    res["w8_over_w4"] = res["w8_us"] / res["w4_us"]
    return res


def time_e4m3_mode(torch, fused_moe_nvfp4, weights, x, tw, ids, timer, no_graph: bool,
                   check_tables: bool = False, gemm2_warps: bool = False) -> dict:
    """One e4m3 point: checked against fused_moe_w4a8_reference (normwise <= 1e-2) before timing;
    "tables": the E4M3 table each GEMM's weights chose (W4A8MoEWeights.w13_table, w2_table);
    check_tables: also :func:`e4m3_tables_agree` ("tables_agree"; a disagreement is an error);
    gemm2_warps: also :func:`e4m3_gemm2_warps` ("gemm2_warps", where the pick has 64 tokens)."""
    from k3nvfp4.kernels.moe_w4a8_reference import fused_moe_w4a8_reference
    from k3nvfp4.kernels.tune import normwise_error

    out = torch.full_like(x, float("nan"))
    run = lambda: fused_moe_nvfp4(x, weights, tw, ids, out=out)  # noqa: E731 - the weights choose the mode
    run()
    err = normwise_error(out, fused_moe_w4a8_reference(x, weights, tw, ids).float())
    if not err <= 1e-2:
        return {"error": f"output differs from fused_moe_w4a8_reference: normwise {err:.3g} > 1e-2 (not timed)"}
    agree = e4m3_tables_agree(torch, weights, x, tw, ids) if check_tables else None
    if agree is False:
        return {"error": "the normal and the full E4M3 table give different outputs (same config, slot-order sum; "
                         "not timed)"}
    t, n, t_eager, mode, why = time_call(torch, run, out, timer, use_graph=not no_graph, what="act_quant=e4m3")
    warps = e4m3_gemm2_warps(torch, weights, x, tw, ids, timer, no_graph) if gemm2_warps else None
    return {"time_us": t * 1e6, "mode": mode, "eager_us": t_eager * 1e6, "iters": n, "normwise_vs_reference": err,
            "tables": [weights.w13_table, weights.w2_table], **({"tables_agree": agree} if check_tables else {}),
            **({"gemm2_warps": warps} if warps else {}), **({"graph_failure": why} if why else {})}


FLASHINFER_TOL = 2e-2  # SM90 W4A16: bf16, normwise, as marlin's (FlashInfer also rounds the GEMM1 output to bf16)
# SM100 NVFP4 x NVFP4 (W4A4) against the W4A16 reference: the activations' quantization error
# (~0.1 normwise here); a wrong activation gives errors of order 1.
FLASHINFER_W4A4_TOL = 0.25


def flashinfer_status(torch, shape, device) -> str | None:
    """None when FlashInfer's SiTU MoE can be tried on this shape here, else "not available: why"
    (k3nvfp4.sglang_ext.ab.flashinfer_arm.unavailable_reason: device, arch, shape, build)."""
    from k3nvfp4.kernels.activation import K3_SITU
    from k3nvfp4.sglang_ext.ab.flashinfer_arm import unavailable_reason

    why = unavailable_reason(device, torch.bfloat16, shape.H, shape.I, K3_SITU)
    return None if why is None else f"not available: {why}"


def flashinfer_arm(torch, shape, device, seed: int, x, tw, ids, info: dict):
    """(FlashInferMoE, None) when FlashInfer's SiTU MoE (SM90 W4A16; SM100 NVFP4 x NVFP4) runs this
    shape and its output at the check M (NaN-poisoned) is within tolerance of the reference on the
    same MXFP4 experts; else (None, why). Its error is recorded either way: it is what tells
    whether FlashInfer ran SiTU (FlashInfer #4597), never assumed."""
    from k3nvfp4.kernels import NVFP4MoEWeights, fused_moe_nvfp4_reference
    from k3nvfp4.kernels.activation import K3_SITU
    from k3nvfp4.kernels.moe_fp4_details.weights import cast_mxfp4_moe
    from k3nvfp4.sglang_ext.ab.flashinfer_arm import FlashInferMoE, FlashInferMXFP4, flashinfer_weights

    why = flashinfer_status(torch, shape, device)
    if why:
        info["flashinfer"] = {"ok": False, "status": why}
        return None, why
    try:
        t0 = time.monotonic()
        t = mxfp4_bench_weights(torch, shape, device, seed)
        fw = flashinfer_weights(cast_mxfp4_moe(*t), device)  # FlashInfer takes the NVFP4 (cast) tensors
        w = NVFP4MoEWeights.from_mxfp4(*t)  # the reference's weights, from the same experts
        fi = FlashInferMoE(fw, K3_SITU)
        w4a16 = isinstance(fw, FlashInferMXFP4)
        tol = FLASHINFER_TOL if w4a16 else FLASHINFER_W4A4_TOL
        torch.cuda.synchronize()
        prep_s = time.monotonic() - t0
        xb = x.to(torch.bfloat16)
        ref = fused_moe_nvfp4_reference(xb, w, tw, ids).float()
        err = peer_check_error(torch, fi, xb, tw, ids, shape.H, ref)
    except Exception as e:
        info["flashinfer"] = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:600]}"}
        return None, f"not timed: {info['flashinfer']['error']}"
    import flashinfer

    info["flashinfer"] = {"M": x.shape[0], "normwise_error": err, "tol": tol, "ok": err <= tol,
                          "path": "SM90 W4A16 (MXFP4 weights)" if w4a16 else "SM100 NVFP4 x NVFP4 (W4A4)",
                          "bytes_key": "mxfp4" if w4a16 else "modelopt_nvfp4",
                          "prepare_s": round(prep_s, 2), "version": flashinfer.__version__,
                          "weights": "random MXFP4 experts (mxfp4_bench_weights), the reference on the same experts"}
    if not err <= tol:
        return None, (f"not timed: failed its check (normwise error {err:.3g} > {tol} vs the reference on "
                      "the same MXFP4 experts; a wrong activation, FlashInfer #4597, would look like this)")
    return fi, None


def time_peer(torch, peer, x, tw, ids, shape, M: int, timer, nbytes: int, no_graph: bool, what: str) -> dict:
    """One call of a peer MoE (``peer(x_bf16, topk_weights, topk_ids, out=...)``: marlin,
    FlashInfer) timed like ours (graph replay when capture works; the eager time too)."""
    xb = x.to(torch.bfloat16)
    out = torch.empty(M, shape.H, dtype=torch.bfloat16, device=x.device)
    call = lambda: peer(xb, tw, ids, out=out)  # noqa: E731
    t, n, t_eager, mode, why = time_call(torch, call, out, timer, use_graph=not no_graph, what=what)
    res = {"time_us": t * 1e6, "mode": mode, "eager_us": t_eager * 1e6, "iters": n, "GBps": nbytes / t / 1e9,
           "pct_bw": 100 * nbytes / t / (H200_BW_TBPS * 1e12), "bytes": nbytes}
    if why:
        res["graph_failure"] = why
    return res


def time_fp4_mode(torch, fused_moe_nvfp4, weights, act_quant: str, x, tw, ids, timer, no_graph: bool) -> dict:
    """One FP4-mode point: checked against fused_moe_fp4_reference (normwise <= 1e-2) before timing."""
    from k3nvfp4.kernels.moe_fp4_reference import fused_moe_fp4_reference
    from k3nvfp4.kernels.tune import normwise_error

    out = torch.empty_like(x)
    run = lambda: fused_moe_nvfp4(x, weights, tw, ids, out=out)  # noqa: E731 - the weights choose the mode
    run()
    ref = fused_moe_fp4_reference(x, weights, tw, ids).float()
    err = normwise_error(out, ref)
    if not err <= 1e-2:
        return {"error": f"output differs from fused_moe_fp4_reference: normwise {err:.3g} > 1e-2 (not timed)"}
    t, n, t_eager, mode, why = time_call(torch, run, out, timer, use_graph=not no_graph, what=f"act_quant={act_quant}")
    return {"time_us": t * 1e6, "mode": mode, "eager_us": t_eager * 1e6, "iters": n, "normwise_vs_reference": err,
            **({"graph_failure": why} if why else {})}


def time_marlin(torch, marlin, x, tw, ids, shape, M: int, timer, nbytes: int, no_graph: bool) -> dict:
    """time_peer for marlin, plus the routing alignment alone and which alignment kernel SGLang
    would run here."""
    from peers.marlin.moe import align_path, moe_block_size

    res = time_peer(torch, marlin, x, tw, ids, shape, M, timer, nbytes, no_graph, "marlin")
    block = moe_block_size(M, shape.top_k, shape.E)
    t_align, _ = timer.measure(lambda: marlin.align(ids, block))
    sglang_align, here_align = align_path(M, shape.top_k, shape.global_experts, marlin.is_ep)
    res.update(moe_block_size=block, align_us=t_align * 1e6, align_sglang=sglang_align, align_here=here_align)
    return res

def markdown_table(result: dict) -> str:
    """One row per point: ours, marlin, FlashInfer, bf16 and the ratios."""
    lines = [f"fused NVFP4 SiTU MoE on {result['device']} (torch {result['versions']['torch']}, triton "
             f"{result['versions']['triton']}); marlin: {result['other_implementations']['sglang_marlin_nvfp4']}", "",
             "| shape | M | triton_situ (us) | % of 4.8 TB/s | marlin (us) | marlin % of 4.8 TB/s "
             "| speedup vs marlin (marlin us / ours) | flashinfer (us) | speedup vs flashinfer (flashinfer us / ours) "
             "| bf16 grouped (us) | speedup vs bf16 (bf16 us / ours) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in result["points"]:
        o, m, f, b = p.get("ours") or {}, p.get("sglang_marlin_nvfp4"), p.get("flashinfer"), p.get("bf16")
        mt = f"{m['time_us']:.1f}" if isinstance(m, dict) else "-"
        mp = f"{m['pct_bw']:.1f}" if isinstance(m, dict) else "-"
        lines.append(f"| {p['shape']} | {p['M']} | {o.get('time_us', float('nan')):.1f} | {o.get('pct_bw', float('nan')):.1f} "
                     f"| {mt} | {mp} | {('x%.2f' % p['x_vs_marlin']) if 'x_vs_marlin' in p else '-'} "
                     f"| {('%.1f' % f['time_us']) if isinstance(f, dict) else '-'} "
                     f"| {('x%.2f' % p['x_vs_flashinfer']) if 'x_vs_flashinfer' in p else '-'} "
                     f"| {('%.1f' % b['time_us']) if isinstance(b, dict) else '-'} "
                     f"| {('x%.2f' % p['speedup_vs_bf16']) if 'speedup_vs_bf16' in p else '-'} |")
    for peer, key in (("marlin", "sglang_marlin_nvfp4"), ("flashinfer", "flashinfer")):
        notes = sorted({f"{p['shape']}: {p[key]}" if key == "flashinfer" else p[key]
                        for p in result["points"] if isinstance(p.get(key), str)})
        if notes:
            lines += [""] + [f"{peer}: {n}" for n in notes]
    e4 = [p for p in result["points"] if isinstance(p.get("act_quant_e4m3"), dict)]
    if e4:
        lines += ["", "W4A8 (`K3NVFP4_ACT_QUANT=e4m3`, Hopper) in the same run:", "",
                  "| shape | M | e4m3 (us) | W4A16 us / e4m3 us | marlin us / e4m3 us | normwise vs reference |",
                  "|---|---|---|---|---|---|"]
        for p in e4:
            r = p["act_quant_e4m3"]
            if "error" in r:
                lines.append(f"| {p['shape']} | {p['M']} | error: {r['error'][:80]} | | | |")
                continue
            lines.append(f"| {p['shape']} | {p['M']} | {r['time_us']:.1f} | x{r['x_vs_w4a16']:.2f} | "
                         f"{('x%.2f' % r['x_vs_marlin']) if 'x_vs_marlin' in r else '-'} | "
                         f"{r['normwise_vs_reference']:.2e} |")
    return "\n".join(lines)


def bytes_moved(shape: "TuneShape", M: int, distinct: int, act_bytes: int = 2) -> dict:
    """Bytes one call reads and writes. "nvfp4": what the kernel-native layout reads (nibbles, one
    byte per 16-weight block scale, scale_2: the checkpoint's bytes); "modelopt_nvfp4": the same
    in ModelOpt's tensors, what marlin reads; "mxfp4": nibbles and one E8M0 byte per 32 weights,
    what FlashInfer's W4A16 reads; "bf16": the dequantized baseline."""
    H, I = shape.H, shape.I

    def expert_bytes(scale_bytes: int) -> int:
        w13 = 2 * I * H // 2 + scale_bytes * 2 * I * H // 16 + 2 * 4
        w2 = H * I // 2 + scale_bytes * H * I // 16 + 4
        return w13 + w2

    acts = 2 * M * H * act_bytes + M * shape.top_k * 8
    return {
        "nvfp4": distinct * expert_bytes(1) + acts,
        "modelopt_nvfp4": distinct * expert_bytes(1) + acts,
        "mxfp4": distinct * (2 * I * H // 2 + 2 * I * H // 32 + H * I // 2 + H * I // 32) + acts,
        "bf16": distinct * 3 * I * H * 2 + acts,
    }


def git_commit(repo: pathlib.Path) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10).stdout.strip() or None  # fmt: skip
    except Exception:
        return None


def main(argv=None) -> int:
    args = parse_args(argv)
    cpu = args.device == "cpu"
    if cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is defined
    import torch
    import triton

    from k3nvfp4.kernels import fused_moe_nvfp4, fused_moe_nvfp4_reference
    from k3nvfp4.kernels.moe_details.config import get_moe_config
    from k3nvfp4.kernels.target import capability, current_device_name
    from k3nvfp4.kernels.tune import Timer, TuneShape, normwise_error, problem_routing

    if not cpu and not torch.cuda.is_available():
        print("bench_moe.py: no CUDA device (use --device cpu for an interpreter smoke run)", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    device_name = current_device_name() if not cpu else "cpu"
    shapes = []
    for s in args.shapes.split(","):
        if s not in SHAPES:
            print(f"--shapes: unknown shape {s!r} (known: {', '.join(SHAPES)})", file=sys.stderr)
            return 2
        fields, check_m = SHAPES[s]
        shapes.append((s, TuneShape(**fields), check_m))
    m_list = [int(m) for m in (args.m_list or ("1,5" if cpu else ",".join(map(str, DEFAULT_M)))).split(",")]
    dtype = torch.float32 if cpu else torch.bfloat16
    out_dir = pathlib.Path(args.out_dir) if args.out_dir else pathlib.Path(__file__).resolve().parent / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    repo = pathlib.Path(__file__).resolve().parent.parent

    marlin_lib, marlin_status = probe_marlin(cpu)
    print(f"marlin: {marlin_status}", flush=True)
    result = {
        "device": device_name,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
                     "python": sys.version.split()[0]},  # fmt: skip
        "git_commit": git_commit(repo),
        "config_dir": os.environ.get("K3NVFP4_MOE_CONFIG_DIR") or "kernels/configs (package default)",
        "peaks": {"bandwidth_TBps_spec": H200_BW_TBPS, "bf16_TFLOPs": H200_BF16_TFLOPS},
        "measured_ceilings": measure_ceilings(torch, device) if not cpu else {},
        "method": "CUDA events, L2 flushed (256 MiB memset) before each call, median; ours by CUDA-graph "
        "replay when capture works (time_us), eager too (eager_us)" if not cpu else "interpreter, wall clock",
        "definitions": {
            "bytes": "distinct local experts touched x (w13 + w2 nibbles + 1-byte block scales + scale_2) + activations "
                     "in and out + topk ids/weights",
            "flops": "2 x valid_routes x (2I*H + I*H); valid_routes = pairs with a local expert id (M*top_k on "
                     "tp16; about M on ep16, the other ranks' routes are not this rank's work)",
            "speedup_vs_bf16": "bf16 baseline time / our time (ours: time_us, graph replay when captured)",
            "x_vs_marlin": "SGLang marlin time / our time (both graph replay when captured): the issue's "
                           "triton_situ / marlin ratio, > 1 means triton_situ is faster",
            "x_vs_flashinfer": "FlashInfer cutlass_fused_moe time / our time (SM90 W4A16 on MXFP4 experts, its bytes "
                               "the MXFP4 ones, bytes_mxfp4; SM100 NVFP4 x NVFP4, bytes_modelopt), > 1 means "
                               "triton_situ is faster",
        },
        "other_implementations": {"triton_kernels": probe_triton_kernels(), "sglang_marlin_nvfp4": marlin_status,
                                  "flashinfer": {}},  # per shape: flashinfer_status
        "weights": "random NVFP4 (uniform E2M1 codes, E4M3 block scales with every mantissa, one scale_2 for "
                   "w1/w3 of an expert, as the K3 cast writes)",
        "shapes": {},
        "points": [],
        "errors": [],
    }  # fmt: skip
    quick = args.quick or cpu
    # CPU: 3 warm-up + 2 wall-clock runs; CUDA: runs sized to ~30 ms (quick) or ~120 ms of GPU time.
    timer = Timer(device, warmup=3, iters=2, target_s=0.03 if quick else 0.12, max_iters=40 if quick else 200)
    failed = False

    for i_shape, (name, shape, check_m) in enumerate(shapes):
        # an even share of what is left of --time-budget for each remaining shape
        shape_deadline = None
        if args.time_budget:
            left = args.time_budget - (time.monotonic() - t0)
            shape_deadline = time.monotonic() + left / (len(shapes) - i_shape)
        weights = bench_weights(shape, device, seed=args.seed)
        w13_bf16 = w2_bf16 = None
        baseline_impl = None
        if not args.no_baseline:
            w13_bf16, w2_bf16 = dequantized_bf16(torch, weights)
            baseline_impl = "torch._grouped_mm" if hasattr(torch, "_grouped_mm") else "per-expert loop"
        info = {"name": name, **dataclasses.asdict(shape), "check_m": check_m, "baseline_impl": baseline_impl}
        result["shapes"][name] = info
        print(f"== {name}: E={shape.E}/{shape.global_experts} H={shape.H} I={shape.I} top-{shape.top_k}", flush=True)

        # Correctness, before any timing.
        M = check_m
        x = torch.randn(M, shape.H, device=device, generator=torch.Generator(device).manual_seed(args.seed + 1)).to(dtype)
        tw, ids = problem_routing(M, shape, device, seed=args.seed + 2)
        ref = fused_moe_nvfp4_reference(x, weights, tw, ids).float()
        out = torch.full((M, shape.H), float("nan"), dtype=dtype, device=device)
        fused_moe_nvfp4(x, weights, tw, ids, out=out)
        err = normwise_error(out, ref)
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        info["check"] = {"M": M, "ours_normwise_error": err, "tol": tol, "ok": err <= tol}
        if not err <= tol:
            failed = True
            result["errors"].append(f"{name}: our kernel differs from the reference: {err:.3g} > {tol}")
        if baseline_impl == "torch._grouped_mm":
            try:
                n_valid = int((ids >= 0).sum())
                b = bf16_moe_grouped_mm(torch, x.to(torch.bfloat16), w13_bf16, w2_bf16, tw, ids, n_valid=n_valid)
                berr = normwise_error(b, ref)
                if not berr <= 3e-2:
                    raise RuntimeError(f"normwise error {berr:.3g} vs the reference")
            except Exception as e:
                info["grouped_mm_failure"] = f"{type(e).__name__}: {str(e)[:300]}"
                baseline_impl = info["baseline_impl"] = "per-expert loop"
        if baseline_impl == "per-expert loop":
            berr = normwise_error(bf16_moe_loop(torch, x.to(torch.bfloat16), w13_bf16, w2_bf16, tw, ids), ref)
        if baseline_impl:
            info["check"]["baseline_normwise_error"] = berr
        print(f"   check M={M}: ours err {err:.2e} (tol {tol:g}){'' if err <= tol else '  FAILED'}"
              + (f", bf16 baseline err {berr:.2e} [{baseline_impl}]" if baseline_impl else ""), flush=True)  # fmt: skip
        # The Blackwell FP4 tensor-core modes, timed only where they run natively (bench/README.md).
        fp4_weights = None
        if not cpu and capability(device)[0] == 10:
            fp4_weights = fp4_mode_arms(torch, shape, device, args.seed)
        # The Hopper W4A8 mode, timed where it is meant to run (sm90) beside W4A16 and marlin.
        e4m3_weights, e4m3_skip = None, "not available: the e4m3 mode is timed on Hopper (sm90) only"
        if not cpu and capability(device)[0] == 9:
            e4m3_weights, e4m3_skip = e4m3_mode_arm(torch, shape, device, args.seed)
        info["e4m3"] = e4m3_skip or "ok"
        marlin, marlin_skip = None, result["other_implementations"]["sglang_marlin_nvfp4"]
        if marlin_lib is not None:
            marlin, marlin_skip = marlin_arm(torch, marlin_lib, weights, shape, x, tw, ids, ref, info)
            if marlin is None:
                failed = True
                result["errors"].append(f"{name}: marlin: {marlin_skip}")
            print(f"   marlin: {info['marlin']}", flush=True)
        if cpu:  # no CUDA device: reported without importing FlashInfer
            fi, fi_skip = None, "not available: the FlashInfer arm runs on a CUDA GPU only (--device cpu)"
            info["flashinfer"] = {"ok": False, "status": fi_skip}
        else:
            fi, fi_skip = flashinfer_arm(torch, shape, device, args.seed, x, tw, ids, info)
        result["other_implementations"]["flashinfer"][name] = fi_skip or f"ok (flashinfer {info['flashinfer']['version']})"
        print(f"   flashinfer: {info['flashinfer']}", flush=True)

        for M in m_list:
            if shape_deadline is not None and time.monotonic() > shape_deadline:
                result["errors"].append(f"time budget spent: skipped {name} M={M} and later points")
                break
            point = {"shape": name, "M": M}
            try:
                x = torch.randn(M, shape.H, device=device, generator=torch.Generator(device).manual_seed(M)).to(dtype)
                tw, ids = problem_routing(M, shape, device, seed=args.seed + 100 + M)
                valid = ids[ids >= 0]
                distinct = int(torch.unique(valid).numel())
                routes = int(valid.numel())
                nbytes = bytes_moved(shape, M, distinct, act_bytes=x.element_size())
                flops = 2 * routes * 3 * shape.I * shape.H
                cfg = get_moe_config(shape.E, shape.H, shape.I, shape.top_k, M, device_name=device_name)
                point.update(valid_routes=routes, distinct_experts=distinct, bytes=nbytes["nvfp4"], bytes_modelopt=nbytes["modelopt_nvfp4"],
                             bytes_mxfp4=nbytes["mxfp4"], flops=flops,
                             config=cfg.to_dict())  # fmt: skip
                out = torch.empty(M, shape.H, dtype=dtype, device=device)
                ours = lambda: fused_moe_nvfp4(x, weights, tw, ids, out=out)  # noqa: E731
                t, n, t_eager, mode, why = time_call(torch, ours, out, timer, use_graph=not (args.no_graph or cpu),
                                                     what="triton_situ")  # fmt: skip
                if why:
                    point["graph_failure"] = why
                ours_res = {
                    "time_us": t * 1e6, "mode": mode, "eager_us": t_eager * 1e6, "iters": n,
                    "GBps": nbytes["nvfp4"] / t / 1e9, "pct_bw": 100 * nbytes["nvfp4"] / t / (H200_BW_TBPS * 1e12),
                    "TFLOPs": flops / t / 1e12, "pct_bf16_peak": 100 * flops / t / (H200_BF16_TFLOPS * 1e12),
                }  # fmt: skip
                ceil = result["measured_ceilings"]
                if ceil.get("copy_TBps"):
                    ours_res["pct_measured_copy_bw"] = 100 * nbytes["nvfp4"] / t / (ceil["copy_TBps"] * 1e12)
                if ceil.get("bf16_matmul_TFLOPs"):
                    ours_res["pct_measured_matmul"] = 100 * flops / t / (ceil["bf16_matmul_TFLOPs"] * 1e12)
                point["ours"] = ours_res
                if baseline_impl and routes == 0:
                    point["bf16"] = "not timed: no local routes at this M"
                elif baseline_impl:
                    xb = x.to(torch.bfloat16)
                    if baseline_impl == "torch._grouped_mm":
                        base = lambda: bf16_moe_grouped_mm(torch, xb, w13_bf16, w2_bf16, tw, ids, n_valid=routes)  # noqa: E731
                        bfn, bmode, why = graph_or_eager(torch, base, cpu or args.no_graph)
                        if why:
                            point["bf16_graph_failure"] = why
                    else:
                        bfn, bmode = (lambda: bf16_moe_loop(torch, xb, w13_bf16, w2_bf16, tw, ids)), "eager"
                    tb, nb = timer.measure(bfn, warmup=2)
                    point["bf16"] = {"impl": baseline_impl, "mode": bmode, "time_us": tb * 1e6, "iters": nb,
                                     "GBps": nbytes["bf16"] / tb / 1e9, "TFLOPs": flops / tb / 1e12}  # fmt: skip
                    point["speedup_vs_bf16"] = tb / t
                point["triton_kernels"] = result["other_implementations"]["triton_kernels"]
                if marlin is None:
                    point["sglang_marlin_nvfp4"] = marlin_skip
                else:
                    try:
                        point["sglang_marlin_nvfp4"] = time_marlin(torch, marlin, x, tw, ids, shape, M, timer,
                                                                   nbytes["modelopt_nvfp4"], args.no_graph)
                        point["x_vs_marlin"] = point["sglang_marlin_nvfp4"]["time_us"] / ours_res["time_us"]
                    except Exception as e:  # reported per point; our figures stand
                        failed = True
                        point["sglang_marlin_nvfp4"] = f"error: {type(e).__name__}: {str(e)[:400]}"
                        result["errors"].append(f"{name} M={M}: marlin: {point['sglang_marlin_nvfp4']}")
                if fi is None:
                    point["flashinfer"] = fi_skip
                else:
                    try:
                        point["flashinfer"] = time_peer(torch, fi, x, tw, ids, shape, M, timer,
                                                        nbytes[info["flashinfer"]["bytes_key"]], args.no_graph,
                                                        "flashinfer")
                        point["x_vs_flashinfer"] = point["flashinfer"]["time_us"] / ours_res["time_us"]
                    except Exception as e:  # reported per point; our figures stand
                        point["flashinfer"] = f"error: {type(e).__name__}: {str(e)[:400]}"
                if fp4_weights is not None:
                    for act_quant, fw in fp4_weights.items():
                        try:
                            r = time_fp4_mode(torch, fused_moe_nvfp4, fw, act_quant, x, tw, ids, timer, args.no_graph)
                        except Exception as e:  # reported per point
                            r = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
                        if "error" in r:
                            failed = True
                            result["errors"].append(f"{name} M={M}: act_quant={act_quant}: {r['error']}")
                        else:
                            r["x_vs_w4a16"] = ours_res["time_us"] / r["time_us"]
                        point[f"act_quant_{act_quant}"] = r
                if e4m3_weights is None:
                    point["act_quant_e4m3"] = e4m3_skip
                else:
                    try:
                        # the tables compared once per shape, at its first point
                        r = time_e4m3_mode(torch, fused_moe_nvfp4, e4m3_weights, x, tw, ids, timer, args.no_graph,
                                           check_tables=M == m_list[0], gemm2_warps=M == m_list[-1])
                    except Exception as e:  # reported per point
                        r = {"error": f"{type(e).__name__}: {str(e)[:400]}"}
                    if "error" in r:
                        failed = True
                        result["errors"].append(f"{name} M={M}: act_quant=e4m3: {r['error']}")
                    else:
                        r["x_vs_w4a16"] = ours_res["time_us"] / r["time_us"]
                        if isinstance(point.get("sglang_marlin_nvfp4"), dict):
                            r["x_vs_marlin"] = point["sglang_marlin_nvfp4"]["time_us"] / r["time_us"]
                    point["act_quant_e4m3"] = r
                mres = point["sglang_marlin_nvfp4"]
                print(f"   M={M:>6} ours {t * 1e6:9.1f} us ({mode}, eager {t_eager * 1e6:.1f}) "
                      f"{ours_res['GBps']:7.0f} GB/s {ours_res['pct_bw']:5.1f}% bw {ours_res['TFLOPs']:6.1f} TFLOP/s"
                      + (f" | bf16 {point['bf16']['time_us']:9.1f} us x{point['speedup_vs_bf16']:.2f}"
                         if "speedup_vs_bf16" in point else "")
                      + (f" | marlin {mres['time_us']:9.1f} us x{point['x_vs_marlin']:.2f}"
                         if "x_vs_marlin" in point else "")
                      + (f" | flashinfer {point['flashinfer']['time_us']:9.1f} us x{point['x_vs_flashinfer']:.2f}"
                         if "x_vs_flashinfer" in point else ""), flush=True)  # fmt: skip
            except Exception as e:
                failed = True
                point["error"] = f"{type(e).__name__}: {e}"
                result["errors"].append(f"{name} M={M}: {point['error']}")
                traceback.print_exc()
                if not cpu:
                    torch.cuda.synchronize()
            result["points"].append(point)
        del weights, w13_bf16, w2_bf16, marlin, fp4_weights, fi
        if not cpu:
            torch.cuda.empty_cache()

    result["targets"] = evaluate_targets(result["points"])
    for t in result["targets"]:
        print(f"target {t['target']}: {t['verdict']} ({t['measured']})")
    result["elapsed_s"] = time.monotonic() - t0
    slug = device_name.replace("/", "_")
    json_path = out_dir / f"moe-{slug}.json"
    tmp = json_path.with_name(f".{json_path.name}.tmp")
    tmp.write_text(json.dumps(result, indent=2) + "\n")
    os.replace(tmp, json_path)
    print(f"wrote {json_path}")
    md_path = out_dir / f"moe-{slug}.md"
    md_path.write_text(markdown_table(result) + "\n")
    print(f"wrote {md_path}")
    if not args.no_plot:
        try:
            png = plot(result, out_dir / f"moe-{slug}.png")
            print(f"wrote {png}")
        except Exception as e:
            print(f"plot failed: {type(e).__name__}: {e}", file=sys.stderr)
    for err in result["errors"]:
        print(f"ERROR: {err}", file=sys.stderr)
    return 1 if failed else 0


def evaluate_targets(points: list[dict]) -> list[dict]:
    """The H200 targets of the issue, against the points measured (absent points: not measured)."""

    def pts(shape, lo, hi):
        return [p for p in points if p["shape"] == shape and lo <= p["M"] <= hi and "ours" in p]

    out = []

    def add(target, sel, value, ok):
        if not sel:
            out.append({"target": target, "verdict": "not measured", "measured": "no point"})
        else:
            out.append({"target": target, "verdict": "met" if all(ok(p) for p in sel) else "missed",
                        "measured": ", ".join(f"M={p['M']}: {value(p)}" for p in sel)})  # fmt: skip

    add(">= 70% of 4.8 TB/s at M=64..1024 (tp16)", pts("tp16", 64, 1024),
        lambda p: f"{p['ours']['pct_bw']:.1f}%", lambda p: p["ours"]["pct_bw"] >= 70)
    add("<= 15 us per call at M=1 (tp16)", pts("tp16", 1, 1),  # issue 9's target, as bench_graph.py's
        lambda p: f"{p['ours']['time_us']:.1f} us", lambda p: p["ours"]["time_us"] <= 15)
    add(">= 55% of bf16 peak at M=16384 (ep16)", pts("ep16", 16384, 16384),
        lambda p: f"{p['ours']['pct_bf16_peak']:.1f}%", lambda p: p["ours"]["pct_bf16_peak"] >= 55)
    for shape in ("tp16", "ep16"):
        sel = [p for p in pts(shape, 1, 256) if "speedup_vs_bf16" in p]
        add(f">= 3x over bf16 grouped GEMM at M<=256 ({shape})", sel,
            lambda p: f"x{p['speedup_vs_bf16']:.2f}", lambda p: p["speedup_vs_bf16"] >= 3)
    for shape in ("tp16", "ep16"):
        sel = [p for p in pts(shape, 1, 1024) if p["M"] in MARLIN_TARGET_M and "x_vs_marlin" in p]
        add(f">= 1.3x SGLang marlin at M in {{1,4,16,64,256,1024}} ({shape})", sel,
            lambda p: f"x{p['x_vs_marlin']:.2f}", lambda p: p["x_vs_marlin"] >= 1.3)
    return out


MARLIN_TARGET_M = (1, 4, 16, 64, 256, 1024)


def plot(result: dict, path: pathlib.Path) -> pathlib.Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.2))
    for name in result["shapes"]:
        pts = [p for p in result["points"] if p["shape"] == name and "ours" in p]
        if not pts:
            continue
        ms = [p["M"] for p in pts]
        ax1.plot(ms, [p["ours"]["pct_bw"] for p in pts], "o-", label=f"{name} ours")
        mb = [(p["M"], p["sglang_marlin_nvfp4"]["pct_bw"]) for p in pts if isinstance(p.get("sglang_marlin_nvfp4"), dict)]
        if mb:
            ax1.plot(*zip(*mb), "s--", label=f"{name} marlin")
        sp = [(p["M"], p["speedup_vs_bf16"]) for p in pts if "speedup_vs_bf16" in p]
        if sp:
            ax2.plot(*zip(*sp), "o-", label=f"{name} vs {result['shapes'][name]['baseline_impl']}")
        sm = [(p["M"], p["x_vs_marlin"]) for p in pts if "x_vs_marlin" in p]
        if sm:
            ax3.plot(*zip(*sm), "o-", label=f"{name}")
    ax3.axhline(1.3, color="r", lw=0.8, ls=":", label="target 1.3")
    ax3.axhline(1.0, color="k", lw=0.8)
    ax3.set_ylabel("speedup vs marlin (marlin time / ours)")
    for ax in (ax1, ax2, ax3):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("M (tokens)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    ax1.set_ylabel(f"effective bandwidth, % of {H200_BW_TBPS} TB/s")
    ax2.set_ylabel("speedup over bf16 grouped GEMM")
    ax2.axhline(1.0, color="k", lw=0.8)
    fig.suptitle(f"fused NVFP4 SiTU MoE on {result['device']} (torch {result['versions']['torch']}, "
                 f"triton {result['versions']['triton']})", fontsize=10)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    sys.exit(main())
