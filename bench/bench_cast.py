"""Cast throughput vs a plain copy of the same shards on the same disk (one run).

    python -P bench/bench_cast.py --scratch /tmp/k3cast-bench [--gb 4.2] [--workers N] [--keep]
    python -P bench/bench_cast.py --scratch /tmp/k3cast-bench --ranks N [--gb 1.5]

Builds (once) a synthetic Kimi-K3 MXFP4 checkpoint of K3-sized experts (w1/w3 [3072, 3584],
w2 [3584, 3072]) of at least 4 GB, then measures, with the page cache dropped before each
step when permitted:
  copy          shutil.copyfile of every shard (+ fsync, as the cast fsyncs its shards)
  cast          k3nvfp4-cast without --verify
  cast+verify   k3nvfp4-cast --verify
in GB/s of source bytes read per wall-clock second, plus the tensor-level time of casting one
K3 expert (in memory, one thread) with 0% and 0.5% zero-exponent blocks, and writes
bench/results/cast-<host>.json. Targets: cast >= 0.9x copy, cast+verify >= 0.7x copy.

With ``--ranks N`` it measures the cast across ranks instead, each step the k3nvfp4-cast command
in a fresh process (page cache dropped before each): the copy; one rank with --workers 1; one
rank with --workers N; N local ranks (``torchrun --standalone --nproc-per-node N``) with
--workers 1 each. It reports the N ranks against the one rank with one worker (N processes
against 1, the ratio asked for) and against the one rank with N workers (the same number of
processes: what the ranks' coordination costs), checks that every output file has the same
sha256, and writes bench/results/cast-ranks-<host>.json. Times are the cast's own (the report's
``seconds.cast``: from every rank joined to every shard committed) and the command's wall time
(interpreter and torch start-up included).
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


def _run_header(benchmark: str, host: str, scratch: Path, dropped: list[bool], load_before, load_after) -> dict:
    """The fields every result JSON of this script starts with: what ran where, when, on which
    disk, whether the page cache was dropped before each step, and the machine's load."""
    return {
        "benchmark": benchmark,
        "host": host,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "versions": _versions(),
        "disk": _disk(scratch),
        "page_cache_dropped": all(dropped),
        "page_cache_note": "sync + echo 3 > /proc/sys/vm/drop_caches before each step"
        if all(dropped) else "drop_caches not permitted: reads may be served from the page cache",
        "load_average_before": load_before,
        "load_average_after": load_after,
    }


def time_copy(shards: list[Path], copy_dir: Path) -> float:
    """Seconds to copy every shard into copy_dir and fsync it (the storage path's own speed, the
    cast's yardstick); copy_dir is removed afterwards."""
    shutil.rmtree(copy_dir, ignore_errors=True)
    copy_dir.mkdir()
    t = time.perf_counter()
    for s in shards:
        shutil.copyfile(s, copy_dir / s.name)
        fd = os.open(copy_dir / s.name, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
    seconds = time.perf_counter() - t
    shutil.rmtree(copy_dir)
    return seconds


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


LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS")


def _output_hashes(d: Path) -> dict[str, str]:
    """sha256 of every output file except cast_report.json (which holds times and ranks)."""
    import hashlib

    out = {}
    for p in sorted(d.rglob("*")):
        if p.is_file() and p.name != "cast_report.json":
            h = hashlib.sha256()
            with open(p, "rb") as f:
                while chunk := f.read(1 << 24):
                    h.update(chunk)
            out[str(p.relative_to(d))] = h.hexdigest()
    return out


def cast_command(src: Path, out: Path, ranks: int, workers: int) -> dict:
    """Run k3nvfp4-cast as ``ranks`` local processes (torchrun --standalone when > 1) with
    ``workers`` each; returns its wall time and the report's figures."""
    cli = ["-m", "k3nvfp4.checkpoint", "--source-ckpt", str(src), "--output-ckpt", str(out),
           "--workers", str(workers), "--no-progress"]
    cmd = [sys.executable, "-P", *(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
                                   if ranks > 1 else []), *cli]
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_ENV}
    env["K3NVFP4_PROGRESS_INTERVAL"] = "0"
    t = time.perf_counter()
    run = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t
    if run.returncode != 0:
        raise SystemExit(f"bench_cast: {' '.join(cmd)} failed ({run.returncode}):\n{run.stderr[-4000:]}")
    rep = json.loads((out / "cast_report.json").read_text())
    return {
        "command": " ".join(["python -P", *cmd[2:]]).replace(str(src), "SRC").replace(str(out), "OUT"),
        "ranks": ranks, "workers_per_rank": workers, "wall_seconds": wall, "cast_seconds": rep["seconds"]["cast"],
        "report_seconds": rep["seconds"], "bit_exact": f"{rep['stats']['exact_blocks']} / {rep['stats']['blocks']}",
        "per_rank": [{k: v for k, v in row.items() if k != "shards"} | {"shards": len(row["shards"])}
                     for row in rep["ranks"]["per_rank"]],
    }


def ranks_main(args, src: Path, src_bytes: int, shards: list[Path], gen_s: float, load_before) -> int:
    """--ranks N: the copy, 1 rank x 1 worker, 1 rank x N workers, N ranks x 1 worker (see the docstring)."""
    n = args.ranks
    dropped = [drop_page_cache()]
    results = {"copy": {"seconds": time_copy(shards, args.scratch / "copy")}}
    hashes = {}
    for key, ranks, workers in (("one_rank", 1, 1), (f"one_rank_{n}_workers", 1, n), (f"{n}_ranks", n, 1)):
        out = args.scratch / f"k3-nvfp4-{key}"
        shutil.rmtree(out, ignore_errors=True)
        dropped.append(drop_page_cache())
        results[key] = cast_command(src, out, ranks, workers)
        hashes[key] = _output_hashes(out)
        shutil.rmtree(out)
    for r in results.values():
        secs = r.get("cast_seconds", r.get("seconds"))
        r["gb_per_s"] = src_bytes / secs / 1e9
    one, many, same = results["one_rank"], results[f"{n}_ranks"], results[f"one_rank_{n}_workers"]
    ratios = {
        f"{n}_ranks_vs_one_rank": one["cast_seconds"] / many["cast_seconds"],
        f"{n}_ranks_vs_one_rank_{n}_workers": same["cast_seconds"] / many["cast_seconds"],
        f"{n}_ranks_vs_one_rank_wall": one["wall_seconds"] / many["wall_seconds"],
        "one_rank_vs_copy": results["copy"]["seconds"] / one["cast_seconds"],
        f"{n}_ranks_vs_copy": results["copy"]["seconds"] / many["cast_seconds"],
    }
    identical = all(h == hashes["one_rank"] for h in hashes.values())
    host = socket.gethostname()
    doc = {
        **_run_header("bench/bench_cast.py --ranks", host, args.scratch, dropped, load_before, os.getloadavg()),
        "ranks": n,
        "load_note": "one machine, its ranks share its cores and its disk; see load averages for other jobs",
        "source": {"bytes": src_bytes, "shards": len(shards), "generation_seconds": gen_s,
                   "expert_shapes": "w1/w3 [3072, 3584], w2 [3584, 3072] (K3)"},
        "seconds_note": "cast_seconds: the report's seconds.cast (every rank joined -> every shard committed); "
                        "wall_seconds: the whole command, interpreter and torch start-up included",
        "results": results,
        "ratios": ratios,
        "outputs_identical": identical,
        "output_files_compared": len(hashes["one_rank"]),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"cast-ranks-{host}.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    if not args.keep:
        shutil.rmtree(args.scratch, ignore_errors=True)
    print(f"{'copy':26s} {results['copy']['seconds']:7.2f} s  {results['copy']['gb_per_s']:.3f} GB/s")
    for key in results:
        if key != "copy":
            r = results[key]
            print(f"{key:26s} {r['cast_seconds']:7.2f} s  {r['gb_per_s']:.3f} GB/s  (command {r['wall_seconds']:.2f} s)")
    for k, v in ratios.items():
        print(f"{k}: {v:.3f}")
    print(f"outputs identical (sha256 of {len(hashes['one_rank'])} files, report aside): {identical}")
    print(f"wrote {path}")
    return 0 if identical else 1


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
    ap.add_argument("--ranks", type=int, default=None,
                    help="measure N local ranks (torchrun) against one rank on the same data instead (see above)")
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = ap.parse_args(argv)
    if args.ranks is not None and args.ranks < 2:
        ap.error(f"--ranks {args.ranks}: must be >= 2")

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
    if args.ranks is not None:
        return ranks_main(args, src, src_bytes, shards, gen_s, load_before)
    # 1) plain copy of every shard
    dropped = [drop_page_cache()]
    results: dict = {"copy": {"seconds": time_copy(shards, args.scratch / "copy")}}

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
        **_run_header("bench/bench_cast.py", host, args.scratch, dropped, load_before, load_after),
        "workers": args.workers,
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
