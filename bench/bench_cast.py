"""Cast throughput vs a plain copy of the same shards on the same disk (one run).

    python -P bench/bench_cast.py --scratch /tmp/k3cast-bench [--gb 4.2] [--workers N] [--keep]

Builds (once) a synthetic Kimi-K3 MXFP4 checkpoint of K3-sized experts (w1/w3 [3072, 3584],
w2 [3584, 3072]) of at least 4 GB, then measures, with the page cache dropped before each
step when permitted:
  copy          shutil.copyfile of every shard (+ fsync, as the cast fsyncs its shards)
  cast          k3nvfp4-cast without --verify
  cast+verify   k3nvfp4-cast --verify
in GB/s of source bytes read per wall-clock second, plus the tensor-level time of casting one
K3 expert (in memory, one thread) with 0% and 0.5% zero-exponent blocks, and writes
bench/results/cast-<host>.json. Targets: cast >= 0.9x copy, cast+verify >= 0.7x copy.
The scratch data is deleted afterwards unless --keep.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

TARGETS = {"cast_vs_copy": 0.9, "cast_verify_vs_copy": 0.7}
K3_EXPERT = dict(hidden_size=3584, intermediate_size=3072)


def drop_page_cache() -> bool:
    """sync + drop the page cache (root only); False if not permitted."""
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


def _bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.glob("*.safetensors"))


def _versions() -> dict:
    import numpy
    import safetensors
    import torch

    v = {"python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
         "safetensors": safetensors.__version__}
    try:
        from importlib.metadata import version

        v["kimi-k3-nvfp4"] = version("kimi-k3-nvfp4")
    except Exception:  # noqa: BLE001 - not installed as a distribution
        v["kimi-k3-nvfp4"] = None
    return v


def _disk(path: Path) -> dict:
    st = shutil.disk_usage(path)
    dev = subprocess.run(["df", "--output=source,fstype", str(path)], capture_output=True, text=True).stdout.split("\n")[1:2]
    return {"path": str(path), "device": dev[0].split() if dev else None, "free_gb": st.free / 1e9}


def expert_cast_ms(zero_exponent_fraction: float, repeats: int = 9, seed: int = 0) -> dict:
    """Median/min wall time (ms) of ``cast_expert`` on one K3 expert held in memory, one torch
    thread; zero-exponent blocks hold +-0 nibbles only (what MXFP4 quantizers write)."""
    import numpy as np
    import torch

    from k3nvfp4.kernels.cast import MXFP4Weight, cast_expert

    rng = np.random.default_rng(seed)

    def mat(rows: int, cols: int, name: str) -> MXFP4Weight:
        nb = cols // 32
        e8m0 = (130 - rng.binomial(8, 0.25, size=(rows, nb))).astype(np.uint8)
        zero = rng.random((rows, nb)) < zero_exponent_fraction
        e8m0[zero] = 0
        packed = np.frombuffer(rng.bytes(rows * cols // 2), np.uint8).reshape(rows, nb, 16).copy()
        packed[zero] = np.array([0x00, 0x08, 0x80, 0x88], np.uint8)[rng.integers(0, 4, size=(int(zero.sum()), 16))]
        return MXFP4Weight(torch.from_numpy(packed.reshape(rows, -1)), torch.from_numpy(e8m0), name)

    h, i = K3_EXPERT["hidden_size"], K3_EXPERT["intermediate_size"]
    w1, w3, w2 = mat(i, h, "w1"), mat(i, h, "w3"), mat(h, i, "w2")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        cast_expert(w1, w3, w2)  # warm-up
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            *_, stats = cast_expert(w1, w3, w2)
            times.append(time.perf_counter() - t)
    finally:
        torch.set_num_threads(threads)
    times.sort()
    return {"zero_exponent_fraction": zero_exponent_fraction, "median_ms": 1e3 * times[len(times) // 2],
            "min_ms": 1e3 * times[0], "stats": stats.to_dict()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scratch", type=Path, required=True, help="scratch dir on the disk to measure")
    ap.add_argument("--gb", type=float, default=4.2, help="synthetic checkpoint size (>= 4)")
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--keep", action="store_true", help="keep the scratch data")
    ap.add_argument("--zero-exponent-fraction", type=float, default=0.0,
                    help="share of all-zero (E8M0 = 0) blocks in the checkpoint (all +-0 nibbles: the cast keeps "
                    "them without re-quantizing)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args(argv)

    from k3nvfp4.checkpoint.convert import CastOptions, run_cast
    from k3nvfp4.checkpoint.layout import INDEX_FILE
    from k3nvfp4.checkpoint.synthetic import write_synthetic_checkpoint

    per_expert = 3 * (3072 * 3584 // 2 + 3072 * 3584 // 32)
    moe_layers = 2
    experts = max(1, int(args.gb * 1e9 * 0.88 / per_expert / moe_layers))
    src = args.scratch / "k3-mxfp4"
    free = shutil.disk_usage(args.scratch.parent if not args.scratch.exists() else args.scratch).free
    need = 3.2 * args.gb * 1e9  # source + copy + cast output
    if free < need:
        print(f"bench_cast: {free / 1e9:.1f} GB free under {args.scratch}, need ~{need / 1e9:.1f} GB", file=sys.stderr)
        return 2
    args.scratch.mkdir(parents=True, exist_ok=True)
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    if not (src / INDEX_FILE).is_file():
        shutil.rmtree(src, ignore_errors=True)
        write_synthetic_checkpoint(src, num_layers=1 + moe_layers, num_experts=experts, num_shards=args.shards,
                                   model_hidden_size=7168, zero_exponent_fraction=args.zero_exponent_fraction, progress=True, **K3_EXPERT)
    gen_s = time.perf_counter() - t0
    src_bytes = _bytes(src)
    shards = sorted(src.glob("*.safetensors"))
    results: dict = {}

    # 1) plain copy of every shard
    copy_dir = args.scratch / "copy"
    shutil.rmtree(copy_dir, ignore_errors=True)
    copy_dir.mkdir()
    dropped = [drop_page_cache()]
    t = time.perf_counter()
    for s in shards:
        shutil.copyfile(s, copy_dir / s.name)
        fd = os.open(copy_dir / s.name, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    results["copy"] = {"seconds": time.perf_counter() - t}
    shutil.rmtree(copy_dir)

    # 2) cast, 3) cast --verify
    for key, verify in (("cast", False), ("cast_verify", True)):
        out = args.scratch / "k3-nvfp4"
        shutil.rmtree(out, ignore_errors=True)
        dropped.append(drop_page_cache())
        t = time.perf_counter()
        rep = run_cast(CastOptions(source=src, output=out, verify=verify, workers=args.workers, progress=True))
        wall = time.perf_counter() - t
        results[key] = {
            "seconds": wall,
            "report_seconds": rep["seconds"],
            "bit_exact": f"{rep['stats']['exact_blocks']} / {rep['stats']['blocks']}",
            "verify_mismatches": rep["verify"]["mismatches"] if rep["verify"] else None,
            "output_bytes": _bytes(out),
        }
        shutil.rmtree(out)
    for r in results.values():
        r["gb_per_s"] = src_bytes / r["seconds"] / 1e9
    ratios = {
        "cast_vs_copy": results["cast"]["gb_per_s"] / results["copy"]["gb_per_s"],
        "cast_verify_vs_copy": results["cast_verify"]["gb_per_s"] / results["copy"]["gb_per_s"],
    }
    per_expert = [expert_cast_ms(f) for f in (0.0, 0.005)]
    load_after = os.getloadavg()
    host = socket.gethostname()
    doc = {
        "benchmark": "bench/bench_cast.py",
        "host": host,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "workers": args.workers,
        "platform": platform.platform(),
        "versions": _versions(),
        "disk": _disk(args.scratch),
        "page_cache_dropped": all(dropped),
        "page_cache_note": "sync + echo 3 > /proc/sys/vm/drop_caches before each step"
        if all(dropped) else "drop_caches not permitted: reads may be served from the page cache",
        "load_average_before": load_before,
        "load_average_after": load_after,
        "load_note": "2-core machine shared with other jobs during the run; see load averages",
        "source": {"bytes": src_bytes, "shards": len(shards), "moe_layers": moe_layers, "experts_per_layer": experts,
                   "expert_shapes": "w1/w3 [3072, 3584], w2 [3584, 3072] (K3)", "generation_seconds": gen_s,
                   "zero_exponent_fraction": args.zero_exponent_fraction, "out_of_range_fraction": 0.0},
        "copy_method": "shutil.copyfile per shard + fsync",
        "per_expert_cast": per_expert,
        "results": results,
        "ratios": ratios,
        "targets": TARGETS,
        "meets_targets": {k: ratios[k] >= v for k, v in TARGETS.items()},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"cast-{host}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    if not args.keep:
        shutil.rmtree(args.scratch, ignore_errors=True)
    for k in ("copy", "cast", "cast_verify"):
        print(f"{k:12s} {results[k]['seconds']:7.2f} s  {results[k]['gb_per_s']:.3f} GB/s")
    print(f"cast/copy {ratios['cast_vs_copy']:.3f} (target {TARGETS['cast_vs_copy']}), "
          f"cast+verify/copy {ratios['cast_verify_vs_copy']:.3f} (target {TARGETS['cast_verify_vs_copy']})")
    for e in per_expert:
        print(f"one K3 expert, {100 * e['zero_exponent_fraction']:.1f}% zero-exponent blocks: {e['median_ms']:.2f} ms (median)")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
