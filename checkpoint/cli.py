"""``k3nvfp4-cast``: the offline MXFP4 -> NVFP4 checkpoint cast (command line)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path
from typing import Sequence

from ..common.cli import HelpFormatter
from .layout import REPORT_FILE, STATE_DIR

# Import-light: torch (through .convert) loads inside main(), where a Ctrl-C is handled.


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="k3nvfp4-cast", formatter_class=HelpFormatter,
        description="Cast a Kimi-K3 MXFP4 (compressed-tensors) checkpoint into a ModelOpt NVFP4 one, "
        "bit-exactly, streaming shard by shard. Runs on CPU. Re-running a finished cast of the same source "
        "with the same options does nothing (with --verify: verifies it again); an interrupted one resumes.",
    )
    # Hyphenated flags like every other tool here; the underscore forms are the model card's command.
    ap.add_argument("--source-ckpt", "--source_ckpt", dest="source_ckpt", required=True, type=Path,
                    help="MXFP4 checkpoint directory (read only)")
    ap.add_argument("--output-ckpt", "--output_ckpt", dest="output_ckpt", required=True, type=Path,
                    help="NVFP4 output directory (not inside the source)")
    ap.add_argument("--verify", action="store_true",
                    help="re-read the output and prove every block equal; fail on any mismatch (default: off)")
    ap.add_argument("--workers", type=int, default=min(4, os.cpu_count() or 1),
                    help=f"worker processes (one shard each at a time; default: min(4, CPUs) = {min(4, os.cpu_count() or 1)} here)")
    ap.add_argument("--strict", action="store_true", help="fail on any block that is not bit-exact (default: off, lossy blocks are reported)")
    ap.add_argument("--w4a4", action="store_true", help="add input_scale = 1.0 per expert matrix (W4A4 config form; default: off, W4A16)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing output directory this tool wrote (default: off: resume or refuse)")
    ap.add_argument("--trim-a-log", "--trim_a_log", dest="trim_a_log", action="store_true",
                    help="write KDA A_log at num_heads instead of zero-padded head_dim (padding must be zero; default: off)")
    ap.add_argument("--no-progress", "--no_progress", dest="progress", action="store_false", help="no progress bars: a status line (done, rate, ETA) every $K3NVFP4_PROGRESS_INTERVAL seconds "
                    "(default 30) instead, as when stderr is not a terminal (default: bars on a terminal)")
    ranks = ap.add_argument_group(
        "a cast across nodes",
        "Under torchrun or an srun task every rank finds its place in the environment; for any other\n"
        "launcher give --rank, --world-size and --dist-init. Every rank gets the same command; the\n"
        "output must be on storage every rank shares. See docs/cast.md.")
    ranks.add_argument("--rank", type=int, default=None,
                       help="this process's rank (default: torchrun's RANK or srun's SLURM_PROCID; without either, one process)")
    ranks.add_argument("--world-size", dest="world_size", type=int, default=None,
                       help="number of ranks (default: WORLD_SIZE or SLURM_STEP_NUM_TASKS; without either, 1)")
    ranks.add_argument("--dist-init", dest="dist_init", metavar="HOST:PORT", default=None,
                       help="where rank 0 listens, the same on every rank (default: MASTER_ADDR:MASTER_PORT; under srun "
                       "without MASTER_ADDR the step's first node, port MASTER_PORT or 29500 + SLURM_JOB_ID mod 1000)")
    ranks.add_argument("--rank-timeout", dest="rank_timeout", type=float, default=60.0, metavar="SECONDS",
                       help="how long a rank waits for an answer from another before it calls it vanished; a rank that fails "
                       "or vanishes stops every rank within about this + 1 s (default: 60)")
    ranks.add_argument("--join-timeout", dest="join_timeout", type=float, default=600.0, metavar="SECONDS",
                       help="how long the ranks wait at start for every rank to join (default: 600)")
    return ap


def _raise_terminated(signum, frame) -> None:
    from .ranks import Terminated

    if isinstance(sys.exc_info()[1], KeyboardInterrupt):
        return  # already stopping (torchrun follows its SIGINT with a SIGTERM): keep the first reason
    raise Terminated()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workers < 1:
        print(f"k3nvfp4-cast: error: --workers {args.workers}: must be >= 1", file=sys.stderr)
        return 2
    for flag, value in (("--rank-timeout", args.rank_timeout), ("--join-timeout", args.join_timeout)):
        if not value > 0:
            print(f"k3nvfp4-cast: error: {flag} {value:g}: must be > 0 seconds", file=sys.stderr)
            return 2
    from ..common.outputs import OutputPathError, check_output_dir

    try:  # before any work (the cast's own rules on what it may resume or replace come later)
        check_output_dir(args.output_ckpt, "--output-ckpt")
    except OutputPathError as exc:
        print(f"k3nvfp4-cast: error: {exc}", file=sys.stderr)
        return 2
    from .ranks import LaunchError, Terminated, rank_spec

    try:
        spec = rank_spec(args.rank, args.world_size, args.dist_init)
    except LaunchError as exc:
        print(f"k3nvfp4-cast: error: {exc}", file=sys.stderr)
        return 2
    who = f"rank {spec.rank} of {spec.world_size}: " if spec.distributed else ""
    again = "launch" if spec.distributed else "command"
    if spec.distributed:
        # gloo's C++ log lines would repeat each one-line error with a stack trace (TORCH_CPP_LOG_LEVEL=INFO shows them).
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "FATAL")
        # torchrun stops the other ranks of a node with SIGTERM when one fails, SLURM on scancel or at the time
        # limit: the same clean-up as Ctrl-C.
        saved_term = signal.signal(signal.SIGTERM, _raise_terminated)
    report: dict | None = None
    coord = None
    try:
        from .convert import CastOptions, run_cast
        from .coordinator import GlooCoordinator, RankMismatch
        from .safetensors_io import CheckpointError

        opts = CastOptions(
            source=args.source_ckpt, output=args.output_ckpt, verify=args.verify, workers=args.workers,
            strict=args.strict, w4a4=args.w4a4, overwrite=args.overwrite, trim_a_log=args.trim_a_log,
            progress=args.progress,
        )
        try:
            if spec.distributed:
                coord = GlooCoordinator(spec, rank_timeout_s=args.rank_timeout, join_timeout_s=args.join_timeout)
                coord.start()
                coord.log(f"joined ({spec.launcher}, rendezvous {spec.address}; hosts {', '.join(coord.hosts)})")
            report = run_cast(opts, coord)
        except RankMismatch as exc:
            print(f"k3nvfp4-cast: error: {who}{exc}", file=sys.stderr)
            return 2
        except CheckpointError as exc:
            print(f"k3nvfp4-cast: error: {who}{exc}", file=sys.stderr)
            hint = _what_remains(args.output_ckpt, str(exc), again) if spec.rank == 0 else None
            if hint:
                print(f"k3nvfp4-cast: {who}{hint}", file=sys.stderr)
            return 1
        finally:
            if coord is not None:
                coord.close()
        _print_result(args, report)
        return 0
    except KeyboardInterrupt as exc:
        if report is not None:  # run_cast returned: every file is in place, only the summary was cut short
            print(f"k3nvfp4-cast: {who}interrupted after the cast had finished; {args.output_ckpt} is complete "
                  f"(summary: {args.output_ckpt / REPORT_FILE})", file=sys.stderr)
            return 0
        if isinstance(exc, Terminated):
            print(f"k3nvfp4-cast: {who}terminated (SIGTERM); run the same {again} again to resume", file=sys.stderr)
            return 143
        print(f"k3nvfp4-cast: {who}interrupted; run the same {again} again to resume", file=sys.stderr)
        return 130
    finally:
        if spec.distributed:
            signal.signal(signal.SIGTERM, saved_term)


def _print_result(args: argparse.Namespace, report: dict) -> None:
    from .convert import format_summary

    if "rank" in report:  # a rank other than 0: its own part; rank 0 prints the summary
        r = report["rank"]
        done = "verified again" if report.get("verified_now") else "nothing to do"
        what = (f"already a finished cast, {done}" if report.get("already_done") else
                f"cast {r['cast_now']} of its {len(r['shards'])} shard(s) ({r['resumed']} done by an earlier run) in "
                f"{r.get('cast_seconds', 0):.2f} s" + (f", verified in {r['verify_seconds']:.2f} s" if "verify_seconds" in r else ""))
        by = "report" if report.get("already_done") and not report.get("verified_now") else "rank 0 wrote"
        print(f"rank {r['rank']} of {report['world_size']}: {what}; {by} {args.output_ckpt / REPORT_FILE}")
        return
    if report.get("already_done"):
        print(f"{args.output_ckpt}: already a finished cast of this source with these options; nothing to do"
              + (" (verified again)" if args.verify else " (--verify checks it again; --overwrite redoes it)"))
    print(format_summary(report))
    print(f"report: {args.output_ckpt / REPORT_FILE}")


def _what_remains(out: Path, message: str, again: str = "command") -> str | None:
    """After a failed cast: what it left in ``out`` (finished shards, the resume state) and how to
    go on; None where it left nothing, or the error already says what to do with ``out``."""
    state = out / STATE_DIR
    if "--overwrite" in message or not state.is_dir() or (out / REPORT_FILE).exists():
        return None
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    kept = f"{len(shards)} finished shard(s) and" if shards else "no finished shard, only"
    return (f"{out} keeps {kept} this cast's resume state ({STATE_DIR}/). The same {again} resumes from them "
            "while the source stays as it is; once the source is fixed or replaced its fingerprint differs, so "
            f"run with --overwrite (or remove {out}) to start over.")


if __name__ == "__main__":
    raise SystemExit(main())
