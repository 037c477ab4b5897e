"""``k3nvfp4-cast``: the offline MXFP4 -> NVFP4 checkpoint cast (command line)."""

from __future__ import annotations

import argparse
import os
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
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.workers < 1:
        print(f"k3nvfp4-cast: error: --workers {args.workers}: must be >= 1", file=sys.stderr)
        return 2
    report: dict | None = None
    try:
        from .convert import CastOptions, run_cast
        from .safetensors_io import CheckpointError

        opts = CastOptions(
            source=args.source_ckpt, output=args.output_ckpt, verify=args.verify, workers=args.workers,
            strict=args.strict, w4a4=args.w4a4, overwrite=args.overwrite, trim_a_log=args.trim_a_log,
            progress=args.progress,
        )
        try:
            report = run_cast(opts)
        except CheckpointError as exc:
            print(f"k3nvfp4-cast: error: {exc}", file=sys.stderr)
            hint = _what_remains(args.output_ckpt, str(exc))
            if hint:
                print(f"k3nvfp4-cast: {hint}", file=sys.stderr)
            return 1
        _print_result(args, report)
        return 0
    except KeyboardInterrupt:
        if report is not None:  # run_cast returned: every file is in place, only the summary was cut short
            print(f"k3nvfp4-cast: interrupted after the cast had finished; {args.output_ckpt} is complete "
                  f"(summary: {args.output_ckpt / REPORT_FILE})", file=sys.stderr)
            return 0
        print("k3nvfp4-cast: interrupted; run the same command again to resume", file=sys.stderr)
        return 130


def _print_result(args: argparse.Namespace, report: dict) -> None:
    from .convert import format_summary

    if report.get("already_done"):
        print(f"{args.output_ckpt}: already a finished cast of this source with these options; nothing to do"
              + (" (verified again)" if args.verify else " (--verify checks it again; --overwrite redoes it)"))
    print(format_summary(report))
    print(f"report: {args.output_ckpt / REPORT_FILE}")


def _what_remains(out: Path, message: str) -> str | None:
    """After a failed cast: what it left in ``out`` (finished shards, the resume state) and how to
    go on; None where it left nothing, or the error already says what to do with ``out``."""
    state = out / STATE_DIR
    if "--overwrite" in message or not state.is_dir() or (out / REPORT_FILE).exists():
        return None
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    kept = f"{len(shards)} finished shard(s) and" if shards else "no finished shard, only"
    return (f"{out} keeps {kept} this cast's resume state ({STATE_DIR}/). The same command resumes from them "
            "while the source stays as it is; once the source is fixed or replaced its fingerprint differs, so "
            f"run with --overwrite (or remove {out}) to start over.")


if __name__ == "__main__":
    raise SystemExit(main())
