#!/usr/bin/env python3
"""CUDA-graph check and replay timing of one fused_moe_nvfp4 call at decode sizes (issue 9), for
W4A16 and for the FP4 tensor-core modes this GPU and Triton support (issue 18: act_quant="nvfp4"
/ "mxfp8" on random MXFP4 experts, bench_moe.fp4_mode_arms).

Per mode, shape (tp16 / ep16, the K3 shards of bench_moe.py) and M (default 1, 2, 4, 8, 16, 32, 64):
  launches   device launches of one call as served (deterministic=False; also counted with
             deterministic=True) - Triton kernels + launching torch ops, host syncs flagged
             (k3nvfp4.kernels.launches) - with the config the call picks (tuned JSON under
             K3NVFP4_MOE_CONFIG_DIR when present, else the heuristic);
  capture    the call (deterministic=True, static input/output buffers) captured in a
             torch.cuda.CUDAGraph; the replay's output must equal the eager output BIT FOR BIT,
             also after new routing is copied into the static topk tensors (the arrival counters
             are reset by the routing launch inside the graph);
  reference  normwise error against fused_moe_nvfp4_reference (bf16 bound 1e-2), for the FP4
             modes against fused_moe_fp4_reference (same quantization; bound 1e-2);
  time       replay time per call, CUDA events around each replay, median of --replays replays:
             "replay_us" with the L2 flushed before each replay (weights from HBM, as in serving),
             "replay_warm_us" back to back without a flush; "eager_us" the same call eagerly
             (L2 flushed). Target: replay_us <= 15 at M = 1 on tp16.
Only after every check passes is a point timed. Exit status 1 when a check fails.

  python bench/bench_graph.py --out results/graph.json             # GPU (~1 min on an H200)
  python bench/bench_graph.py --cpu-rehearsal --shapes tiny-fp4 --modes nvfp4,mxfp8 --out /tmp/g.json
  python bench/bench_graph.py --cpu-rehearsal --out /tmp/graph.json  # interpreter, tiny shapes,
      no graphs: the same plumbing (static buffers, in-place routing update, "replay" = the
      captured closure called eagerly, bitwise checks, launch counts), wall-clock times
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import pathlib
import statistics
import sys
import time
import traceback

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_moe import SHAPES, fp4_mode_arms, git_commit  # noqa: E402  (plain dicts; no Triton import)

DECODE_M = [1, 2, 4, 8, 16, 32, 64]
LAUNCH_TARGET = 4  # per call at M <= 64
TP16_M1_TARGET_US = 15.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", default=None, help="comma list (default tp16,ep16; rehearsal: tiny-tp,tiny-ep)")
    p.add_argument("--m-list", default=None, help="comma list of M (default 1,2,4,8,16,32,64; rehearsal: 1,8,64)")
    p.add_argument("--replays", type=int, default=200, help="timed replays per point (GPU)")
    p.add_argument("--out", required=True, help="JSON path")
    p.add_argument("--cpu-rehearsal", action="store_true", help="interpreter on CPU, tiny shapes, no CUDA graphs")
    p.add_argument("--modes", default=None,
                   help="comma list of w4a16, nvfp4, mxfp8 (default: w4a16 and the FP4 modes this GPU / Triton runs)")
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def supported_modes(torch, device) -> list[str]:
    """w4a16, and each FP4 mode check_fp4_mode_supported accepts here."""
    from k3nvfp4.kernels.moe_fp4 import ACT_QUANT_MODES, check_fp4_mode_supported

    out = ["w4a16"]
    for mode in ACT_QUANT_MODES:
        try:
            check_fp4_mode_supported(mode, device)
            out.append(mode)
        except RuntimeError as e:
            print(f"mode {mode}: skipped here: {e}", flush=True)
    return out


class Replay:
    """One call with static buffers: capture() records it in a CUDA graph (GPU) or keeps the
    closure (rehearsal); replay() runs it again on whatever the static inputs hold now."""

    def __init__(self, torch, fn, cpu: bool):
        self.torch, self.fn, self.cpu, self.graph = torch, fn, cpu, None

    def capture(self) -> None:
        torch = self.torch
        if self.cpu:
            return
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.fn()  # warm-up (compiles) on the capture stream
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.fn()
        torch.cuda.synchronize()

    def replay(self) -> None:
        if self.graph is None:
            self.fn()
        else:
            self.graph.replay()


def median_us(torch, fn, n: int, cpu: bool, flush=None) -> float:
    """Median over n runs of fn: CUDA events around each run (flush() before it, untimed), or
    wall clock on CPU."""
    times = []
    if cpu:
        for _ in range(n):
            t = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t) * 1e6)
        return statistics.median(times)
    for _ in range(3):
        fn()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
    for s, e in zip(starts, ends):
        if flush is not None:
            flush()
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends))


def run_point(torch, name, shape, M, weights, args, cpu, flush, mode: str = "w4a16") -> dict:
    from k3nvfp4.kernels import fused_moe_nvfp4, fused_moe_nvfp4_reference
    from k3nvfp4.kernels.launches import count_launches
    from k3nvfp4.kernels.moe_details.config import get_moe_config
    from k3nvfp4.kernels.moe_fp4 import FP4MoEConfig, fused_moe_fp4
    from k3nvfp4.kernels.moe_fp4_reference import fused_moe_fp4_reference
    from k3nvfp4.kernels.tune import normwise_error, problem_routing

    device = weights.device
    dtype = torch.float32 if cpu else torch.bfloat16
    g = torch.Generator().manual_seed(args.seed + M)
    x = torch.randn(M, shape.H, generator=g).to(device=device, dtype=dtype)
    tw, ids = problem_routing(M, shape, device, seed=args.seed + M)
    tw2, ids2 = problem_routing(M, shape, device, seed=args.seed + M + 1000)  # the "next step's" routing
    out = torch.full((M, shape.H), float("nan"), dtype=dtype, device=device)
    if mode == "w4a16":
        cfg = get_moe_config(shape.E, shape.H, shape.I, shape.top_k, M)
        point = {"mode": mode, "shape": name, "M": M, "config": cfg.to_dict(),
                 "config_label": f"{cfg.gemm('gemm1').label()} | {cfg.gemm('gemm2').label()}"}  # fmt: skip

        def moe(tw, ids, out=None, deterministic=False):
            return fused_moe_nvfp4(x, weights, tw, ids, out=out, deterministic=deterministic)

        def reference():
            return fused_moe_nvfp4_reference(x, weights, tw, ids)
    else:
        from k3nvfp4.kernels.target import model_device_name

        cfg = FP4MoEConfig.heuristic(shape.E, shape.H, shape.I, shape.top_k, M, act_quant=mode,
                                     device_name=model_device_name(device))
        point = {"mode": mode, "shape": name, "M": M, "config": cfg.__dict__.copy(), "config_label": cfg.label()}

        def moe(tw, ids, out=None, deterministic=False):
            return fused_moe_fp4(x, weights, tw, ids, out=out, deterministic=deterministic)

        def reference():
            return fused_moe_fp4_reference(x, weights, tw, ids)

    def call():
        moe(tw, ids, out=out, deterministic=True)

    with count_launches() as c:  # the call as served (deterministic=False, SGLang's plugin)
        moe(tw, ids, out=out)
    with count_launches() as cd:
        call()
    if not cpu:
        torch.cuda.synchronize()
    point.update(launches=c.total, triton_kernels=c.triton, torch_ops=c.torch_ops, syncs=c.syncs + cd.syncs,
                 launches_deterministic=cd.total)
    eager = out.clone()
    eager2 = moe(tw2, ids2, deterministic=True)
    point["ref_err"] = normwise_error(eager, reference())

    rep = Replay(torch, call, cpu)
    out.fill_(float("nan"))
    rep.capture()
    rep.replay()
    if not cpu:
        torch.cuda.synchronize()
    point["replay_equals_eager"] = bool(torch.equal(out, eager))
    tw.copy_(tw2)
    ids.copy_(ids2)  # new routing into the captured tensors
    rep.replay()
    if not cpu:
        torch.cuda.synchronize()
    point["replay_new_routing_equals_eager"] = bool(torch.equal(out, eager2))
    point["graph"] = "cuda_graph" if rep.graph is not None else "eager closure (cpu rehearsal)"

    checks = {
        "launches": max(c.total, cd.total) <= LAUNCH_TARGET and not point["syncs"],
        "replay_equals_eager": point["replay_equals_eager"],
        "replay_new_routing_equals_eager": point["replay_new_routing_equals_eager"],
        "reference": point["ref_err"] < (2e-5 if dtype == torch.float32 and mode == "w4a16" else 1e-2),
    }
    point["checks"] = checks
    if all(checks.values()):
        n = 1 if cpu else args.replays  # the rehearsal checks the plumbing; its times mean nothing
        point["replay_us"] = median_us(torch, rep.replay, n, cpu, flush)
        point["replay_warm_us"] = median_us(torch, rep.replay, n, cpu)
        point["eager_us"] = median_us(torch, call, n, cpu, flush)
    return point


def main(argv=None) -> int:
    args = parse_args(argv)
    cpu = args.cpu_rehearsal
    if cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before any Triton kernel is defined
    import torch
    import triton

    from k3nvfp4.kernels.target import current_device_name
    from k3nvfp4.kernels.tune import TuneShape, problem_weights

    if not cpu and not torch.cuda.is_available():
        print("bench_graph.py: no CUDA device (use --cpu-rehearsal on a machine without one)", file=sys.stderr)
        return 2
    device = torch.device("cpu" if cpu else "cuda")
    shape_names = (args.shapes or ("tiny-tp,tiny-ep" if cpu else "tp16,ep16")).split(",")
    for s in shape_names:
        if s not in SHAPES:
            print(f"--shapes: unknown shape {s!r} (known: {', '.join(SHAPES)})", file=sys.stderr)
            return 2
    m_list = [int(m) for m in (args.m_list or ("1,8,64" if cpu else ",".join(map(str, DECODE_M)))).split(",")]
    flush_buf = None if cpu else torch.empty(256 << 20, dtype=torch.uint8, device=device)
    flush = None if cpu else (lambda: flush_buf.zero_())

    result = {
        "device": "cpu (interpreter rehearsal)" if cpu else current_device_name(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "versions": {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda},
        "git_commit": git_commit(pathlib.Path(__file__).resolve().parent.parent),
        "config_dir": os.environ.get("K3NVFP4_MOE_CONFIG_DIR") or "kernels/configs (package default)",
        "method": "wall clock, interpreter" if cpu else
                  f"CUDA events around each graph replay, median of {args.replays}; replay_us with a 256 MiB "
                  "L2 flush before each replay, replay_warm_us without",
        "targets": {"launches_per_call_max": LAUNCH_TARGET, "tp16_M1_replay_us_max": TP16_M1_TARGET_US},
        "points": [],
        "skipped": [],
        "errors": [],
    }  # fmt: skip
    modes = args.modes.split(",") if args.modes else supported_modes(torch, device)
    bad = [m for m in modes if m not in ("w4a16", "nvfp4", "mxfp8")]
    if bad:
        print(f"--modes: unknown mode(s) {bad} (known: w4a16, nvfp4, mxfp8)", file=sys.stderr)
        return 2
    result["modes"] = modes
    failed = False
    for name in shape_names:
        shape = TuneShape(**SHAPES[name][0])
        for mode in modes:
            if mode != "w4a16" and (shape.H % 64 or shape.I % 64):
                result["skipped"].append(f"{mode} {name}: the FP4 modes need H and I multiples of 64 "
                                         f"(H = {shape.H}, I = {shape.I})")
                continue
            weights = (problem_weights(shape, device, seed=args.seed) if mode == "w4a16"
                       else fp4_mode_arms(torch, shape, device, args.seed)[mode])
            for M in m_list:
                try:
                    p = run_point(torch, name, shape, M, weights, args, cpu, flush, mode)
                except Exception as e:  # a failing point is reported and fails the run
                    failed = True
                    result["errors"].append({"mode": mode, "shape": name, "M": M, "error": f"{type(e).__name__}: {e}",
                                             "traceback": traceback.format_exc()[-3000:]})  # fmt: skip
                    print(f"{mode} {name} M={M}: ERROR {type(e).__name__}: {e}", flush=True)
                    continue
                failed |= not all(p["checks"].values())
                result["points"].append(p)
                t = f"replay {p['replay_us']:.1f} us (warm {p['replay_warm_us']:.1f}, eager {p['eager_us']:.1f})" \
                    if "replay_us" in p else f"checks {p['checks']}"
                print(f"{mode} {name} M={M}: {p['launches']} launches {p['triton_kernels']} {p['torch_ops']}; "
                      f"replay==eager {p['replay_equals_eager']}/{p['replay_new_routing_equals_eager']}; "
                      f"err {p['ref_err']:.2e}; {t}", flush=True)  # fmt: skip
            del weights
    tp1 = [p for p in result["points"]
           if p["mode"] == "w4a16" and p["shape"] == "tp16" and p["M"] == 1 and "replay_us" in p]
    if tp1:
        result["tp16_M1_replay_us"] = tp1[0]["replay_us"]
        result["tp16_M1_meets_target"] = tp1[0]["replay_us"] <= TP16_M1_TARGET_US
    result["passed"] = not failed
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out} ({'passed' if not failed else 'FAILED'})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
