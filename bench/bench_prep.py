#!/usr/bin/env python3
"""Load-time preparation of one K3 MoE layer: source GB/s and peak temporary memory, per path.

The kernels read their own layout (kernels/moe_details/layout.py), prepared once per layer at
load. This times that preparation on one real-sized layer of random tensors:

- ``nvfp4``: NVFP4MoEWeights.from_modelopt (the cast checkpoint in SGLang);
- ``mxfp4``: NVFP4MoEWeights.from_mxfp4 (the MXFP4 release served as released);
- ``fp4_nvfp4``: FP4MMAWeights.from_modelopt(act_quant="nvfp4") (the W4A4 mode's weights);
- ``fp4_mxfp8``: FP4MMAWeights.from_modelopt(act_quant="mxfp8") on the cast of MXFP4 tensors (the W4A8
  mode: E8M0 scales recovered from the NVFP4 ones);
- ``to_modelopt``: NVFP4MoEWeights.to_modelopt (the inverse, for tests and the A/B tools);
- on a GPU, where SGLang is installed, SGLang's marlin preparation of the same layer.

Shapes: K3's TP16 shard (896 experts, I = 192, H = 3584) and EP16 shard (56 experts, I = 3072).
Each (shape, path) runs in a fresh subprocess: inputs are filled in place (no temporaries), then
peak temporary memory = peak RSS (getrusage; on CUDA torch.cuda.max_memory_allocated) less the
inputs and the outputs. The projected load time of one rank is 92 layers at the measured rate
(K3 has 92 MoE layers; a TP16 / EP16 rank holds one such shard of each).

  python -P bench/bench_prep.py                                  # CPU, both shapes, every path
  python -P bench/bench_prep.py --shapes tp16 --paths nvfp4 --device cuda
  python -P bench/bench_prep.py --out bench/results/prep-cpu.json

Targets (issue 28): >= 1 GB/s of source on the project's 2-core CPU machine; on CUDA >= 50% of the
device's copy bandwidth; peak temporary memory <= 1x the layer's packed size.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import resource
import subprocess
import sys
import time

MOE_LAYERS = 92  # K3's MoE layers (layer 0 is dense)
SHAPES = {"tp16": (896, 192, 3584), "ep16": (56, 3072, 3584), "tiny": (4, 64, 128)}  # (local experts, I, H); tiny: rehearsal
PATHS = ("nvfp4", "mxfp4", "fp4_nvfp4", "fp4_mxfp8", "to_modelopt", "marlin")
CPU_TARGET_GBPS = 1.0


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _nbytes(obj) -> int:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.untyped_storage().nbytes()
    if isinstance(obj, (list, tuple)):
        return sum(_nbytes(x) for x in obj)
    if hasattr(obj, "__dict__"):
        return sum(_nbytes(v) for v in vars(obj).values() if not isinstance(v, (int, float, str)))
    return 0


def _inputs(path: str, E: int, I: int, H: int, device):
    """Random layer tensors, filled in place (no temporaries). Returns (args, source bytes)."""
    import torch

    def u8(*shape, lo=0, hi=256):
        return torch.empty(shape, dtype=torch.uint8, device=device).random_(lo, hi)

    if path == "mxfp4":
        t = (u8(E, 2 * I, H // 2), u8(E, 2 * I, H // 32, lo=118, hi=126), u8(E, H, I // 2), u8(E, H, I // 32, lo=118, hi=126))
        return t, sum(x.numel() for x in t)
    if path == "fp4_mxfp8":  # exact MXFP4 blocks in NVFP4 form: both 16-halves 2^j, scale_2 2^m
        e13 = u8(E, 2 * I, H // 32, lo=0, hi=9)  # one j in 0..8 per 32-block
        e2 = u8(E, H, I // 32, lo=0, hi=9)

        def pow2_e4m3(j):  # E4M3 bits of 2^(j - 6) (normal numbers 2^-6 .. 2^2), both 16-halves alike
            return ((j + 1) << 3).repeat_interleave(2, dim=-1)
        t = (u8(E, 2 * I, H // 2), pow2_e4m3(e13).view(torch.float8_e4m3fn), torch.ones(E, 2, device=device),
             u8(E, H, I // 2), pow2_e4m3(e2).view(torch.float8_e4m3fn), torch.ones(E, device=device))
        del e13, e2
        return t, sum(x.numel() * x.element_size() for x in t)
    t = (u8(E, 2 * I, H // 2), u8(E, 2 * I, H // 16, lo=1, hi=0x7E).view(torch.float8_e4m3fn),
         torch.ones(E, 2, device=device), u8(E, H, I // 2), u8(E, H, I // 16, lo=1, hi=0x7E).view(torch.float8_e4m3fn),
         torch.ones(E, device=device))
    return t, sum(x.numel() * x.element_size() for x in t)


def run_one(shape: str, path: str, device: str) -> dict:
    """In this process: time one preparation; memory from this process's peak."""
    import torch

    from k3nvfp4.kernels import NVFP4MoEWeights
    from k3nvfp4.kernels.moe_fp4 import FP4MMAWeights

    E, I, H = SHAPES[shape]
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if path == "marlin":
        return _marlin(shape, E, I, H, dev)
    # The first call in a process loads (or compiles) the host loops: once per process, not per
    # layer; timed apart and left out of the rate.
    t0 = time.perf_counter()
    warm = _inputs("nvfp4" if path == "to_modelopt" else path, 1, I, H, dev)[0]
    w = (NVFP4MoEWeights.from_modelopt(*warm).to_modelopt() if path == "to_modelopt" else
         {"nvfp4": NVFP4MoEWeights.from_modelopt, "mxfp4": NVFP4MoEWeights.from_mxfp4,
          "fp4_nvfp4": lambda *a: FP4MMAWeights.from_modelopt(*a, act_quant="nvfp4"),
          "fp4_mxfp8": lambda *a: FP4MMAWeights.from_modelopt(*a, act_quant="mxfp8")}[path](*warm))
    first_call_s = time.perf_counter() - t0
    del warm, w
    if path == "to_modelopt":
        args, src = _inputs("nvfp4", E, I, H, dev)
        prepared = NVFP4MoEWeights.from_modelopt(*args)
        del args
        fn, args, src = (lambda w: w.to_modelopt()), (prepared,), _nbytes(prepared)
    else:
        args, src = _inputs(path, E, I, H, dev)
        fn = {"nvfp4": NVFP4MoEWeights.from_modelopt, "mxfp4": NVFP4MoEWeights.from_mxfp4,
              "fp4_nvfp4": lambda *a: FP4MMAWeights.from_modelopt(*a, act_quant="nvfp4"),
              "fp4_mxfp8": lambda *a: FP4MMAWeights.from_modelopt(*a, act_quant="mxfp8")}[path]
    in_bytes = _nbytes(args)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_bytes()
    t0 = time.perf_counter()
    out = fn(*args)
    if cuda:
        torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    out_bytes = _nbytes(out) - _shared_bytes(out, args)
    # Peak above the inputs, less the outputs. On the host the peak is the process's (getrusage):
    # an earlier one above today's RSS would only raise this figure, so it is an upper bound.
    if cuda:
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base
    temp = max(0, peak - out_bytes)
    # FP4MMAWeights(act_quant="nvfp4") keeps the ModelOpt tensors as they are: nothing to time as a rate.
    no_copy = out_bytes < 0.01 * src
    return {"shape": shape, "path": path, "device": device, "experts": E, "I": I, "H": H,
            "source_bytes": src, "input_bytes": in_bytes, "output_bytes": out_bytes, "seconds": round(dt, 4),
            "source_gb_per_s": None if no_copy else round(src / dt / 1e9, 3), "peak_temporary_bytes": temp,
            "note": "keeps the checkpoint tensors (no copy)" if no_copy else None,
            "peak_temporary_x_layer": round(temp / src, 3),
            "projected_rank_s": round(MOE_LAYERS * dt, 1), "first_call_s": round(first_call_s, 3),
            "threads": torch.get_num_threads(), "host_backend": _host_backend()}


def _host_backend() -> str:
    from k3nvfp4.kernels.moe_details import layout_host

    return layout_host.backend()


def _shared_bytes(out, args) -> int:
    """Output storage that is the input's (FP4MMAWeights keeps the ModelOpt nibbles as they are)."""
    import torch

    ins = {t.untyped_storage().data_ptr() for t in args if isinstance(t, torch.Tensor)}
    seen, total = set(), 0
    for v in (vars(out).values() if hasattr(out, "__dict__") else out):
        if isinstance(v, torch.Tensor) and v.untyped_storage().data_ptr() in ins and v.untyped_storage().data_ptr() not in seen:
            seen.add(v.untyped_storage().data_ptr())
            total += v.untyped_storage().nbytes()
    return total


def _marlin(shape: str, E: int, I: int, H: int, dev) -> dict:
    """SGLang's marlin preparation of the same layer (prepare_moe_nvfp4_layer_for_marlin on a
    module holding the six ModelOpt tensors); needs SGLang and a CUDA device."""
    import types

    import torch

    try:
        from sglang.srt.layers.quantization.marlin_utils_fp4 import prepare_moe_nvfp4_layer_for_marlin
    except Exception as e:  # noqa: BLE001 - reported in the row
        return {"shape": shape, "path": "marlin", "skipped": f"SGLang's marlin preparation is not importable ({e})"}
    if dev.type != "cuda":
        return {"shape": shape, "path": "marlin", "skipped": "marlin's preparation runs on CUDA only"}
    args, src = _inputs("nvfp4", E, I, H, dev)
    layer = torch.nn.Module()
    names = ("w13_weight", "w13_weight_scale", "w13_weight_scale_2", "w2_weight", "w2_weight_scale", "w2_weight_scale_2")
    for name, t in zip(names, args):
        layer.register_parameter(name, torch.nn.Parameter(t, requires_grad=False))
    del args
    layer.quant_config = types.SimpleNamespace(group_size=16)
    layer.moe_runner_config = types.SimpleNamespace(is_gated=True)
    layer.intermediate_size_per_partition = I
    layer.params_dtype = torch.bfloat16
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    prepare_moe_nvfp4_layer_for_marlin(layer)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    return {"shape": shape, "path": "marlin", "device": "cuda", "experts": E, "I": I, "H": H, "source_bytes": src,
            "seconds": round(dt, 4), "source_gb_per_s": round(src / dt / 1e9, 3), "peak_temporary_bytes": None,
            "peak_temporary_x_layer": None, "projected_rank_s": round(MOE_LAYERS * dt, 1)}


def _versions() -> dict:
    import numpy
    import torch

    v = {"python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__}
    try:
        import triton

        v["triton"] = triton.__version__
    except ImportError:
        pass
    return v


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default="tp16,ep16", help=f"comma list of {', '.join(SHAPES)} (default: both)")
    p.add_argument("--paths", default=",".join(PATHS), help=f"comma list of {', '.join(PATHS)} (default: all)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")
    p.add_argument("--out", default=None, help="JSON path (default: print only)")
    p.add_argument("--one", nargs=2, metavar=("SHAPE", "PATH"), help=argparse.SUPPRESS)  # the subprocess
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(*args.one, args.device)))
        return 0
    shapes, paths = args.shapes.split(","), args.paths.split(",")
    bad = [s for s in shapes if s not in SHAPES] + [x for x in paths if x not in PATHS]
    if bad:
        print(f"bench_prep: unknown shape(s)/path(s) {bad} (shapes {list(SHAPES)}, paths {list(PATHS)})", file=sys.stderr)
        return 2
    rows = []
    for shape in shapes:
        for path in paths:
            proc = subprocess.run([sys.executable, "-P", __file__, "--device", args.device, "--one", shape, path],
                                  capture_output=True, text=True)
            if proc.returncode:
                row = {"shape": shape, "path": path, "error": proc.stderr.strip().splitlines()[-1:]}
            else:
                row = json.loads(proc.stdout.strip().splitlines()[-1])
            rows.append(row)
            if row.get("note"):
                print(f"{shape:5s} {path:12s} {row['source_bytes'] / 1e9:6.3f} GB  {row['seconds']:7.3f} s  {row['note']}")
            elif "source_gb_per_s" in row:
                print(f"{shape:5s} {path:12s} {row['source_bytes'] / 1e9:6.3f} GB  {row['seconds']:7.3f} s  "
                      f"{row['source_gb_per_s']:6.2f} GB/s  peak temp {row['peak_temporary_x_layer']:.2f}x  "
                      f"rank of {MOE_LAYERS} layers {row['projected_rank_s']:.0f} s", flush=True)
            else:
                print(f"{shape:5s} {path:12s} {row.get('skipped') or row.get('error')}", flush=True)
    result = {"benchmark": "bench/bench_prep.py", "date": _dt.date.today().isoformat(), "device": args.device,
              "host": {"cpus": os.cpu_count(), "machine": platform.machine()}, "versions": _versions(),
              "targets": {"cpu_gb_per_s": CPU_TARGET_GBPS, "peak_temporary_x_layer": 1.0}, "rows": rows}
    if args.out:
        from k3nvfp4.common.files import write_json_atomic

        write_json_atomic(args.out, result, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
