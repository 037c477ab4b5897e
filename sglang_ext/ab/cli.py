"""`k3nvfp4-ab`: accuracy A/B of the triton_situ MoE backend against marlin.

  k3nvfp4-ab layer --synthetic --out DIR          # one MoE layer, tensor-level metrics
  k3nvfp4-ab layer --ckpt NVFP4_DIR --layer 5 --out DIR
  k3nvfp4-ab layer --ckpt MXFP4_DIR --layer 5 --out DIR  (the release read directly, vs its cast)
  k3nvfp4-ab serve --print-launch                 # the two sglang servers it expects
  k3nvfp4-ab serve --arm marlin=http://h:30000 --arm triton_situ=http://h:30001 --out DIR
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ...common.cli import HelpFormatter
from ...common.outputs import OutputPathError, check_output_dir
from .errors import ABError, InputError


def _arm(s: str) -> tuple[str, str]:
    name, sep, url = s.partition("=")
    if not sep or not name or not url:
        raise argparse.ArgumentTypeError(f"expected NAME=URL, got {s!r}")
    return name, url


def _add_layer(sub) -> None:
    p = sub.add_parser("layer", formatter_class=HelpFormatter, help="layer-level A/B of one MoE layer (reference, triton_situ, marlin, flashinfer)",
                       description="Run one NVFP4 MoE layer through every arm on the same routed inputs and "
                                   "compare outputs. Arms that cannot run are reported 'not available: <reason>'.")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--ckpt", type=Path, help="checkpoint directory: NVFP4 (ModelOpt, the cast) or the MXFP4 release")
    src.add_argument("--synthetic", action="store_true", help="random NVFP4 weights with K3 shard structure")
    p.add_argument("--layer", type=int, help="MoE layer index (with --ckpt)")
    p.add_argument("--experts", type=int, default=None,
                   help="--synthetic: local experts (default 8; K3 TP16 shard: 896); --ckpt: load the first N (default all)")
    p.add_argument("--hidden", type=int, default=256, help="--synthetic: hidden size H (K3: 3584)")
    p.add_argument("--intermediate", type=int, default=128, help="--synthetic: intermediate size I (K3 TP16: 192)")
    p.add_argument("--top-k", type=int, default=None, help="experts per token (default: checkpoint's, synthetic 4)")
    p.add_argument("--tokens", type=int, default=64, help="number of tokens M")
    p.add_argument("--seed", type=int, default=0, help="random seed of the synthetic inputs and routing")
    p.add_argument("--activations", type=Path, help=".pt/.safetensors with hidden_states, topk_ids, topk_weights")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16",
                   help="activation dtype; float32 is an exactness check of triton_situ vs the reference "
                        "(fp32 dots; marlin runs 16-bit activations only)")
    p.add_argument("--arms", default=None,
                   help="comma list of arms to try (default reference,triton_situ,marlin,flashinfer; with an MXFP4 --ckpt "
                        "also triton_situ_cast: the same kernels on the cast of those experts)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed runs per arm, after one untimed warm-up run (the compared one); default 5. Arms in "
                        "the Triton interpreter (CPU) are not timed")
    p.add_argument("--out", type=Path, required=True, help="output directory (report.json, summary.md, PNGs)")
    p.add_argument("--no-plots", action="store_true",
                   help="write report.json and summary.md only (without matplotlib the plots are skipped anyway)")


def _add_serve(sub) -> None:
    from .datasets import FORMATS
    from .serve import ServeConfig

    d = ServeConfig(arms=[], out_dir=Path("."))
    p = sub.add_parser("serve", formatter_class=HelpFormatter, help="server-level A/B of two OpenAI-compatible endpoints",
                       description="Send the same prompts to two SGLang servers (one per MoE backend) and compare "
                                   "greedy outputs token by token and pass@1 over seeds. Without --arm (or with "
                                   "--print-launch) it prints the two launch commands it expects.")
    p.add_argument("--arm", type=_arm, action="append", default=None, metavar="NAME=URL",
                   help="an endpoint, twice; the first is the baseline (e.g. marlin=http://host:30000)")
    p.add_argument("--print-launch", action="store_true", help="print the expected sglang launch commands and exit")
    p.add_argument("--model-path", default="/path/to/kimi-k3-nvfp4", help="checkpoint shown in --print-launch")
    p.add_argument("--tp", type=int, default=16, help="tensor-parallel size in --print-launch (default 16: K3 does "
                                                       "not fit 8 GPUs)")
    p.add_argument("--ep", type=int, default=None, help="expert-parallel size in --print-launch (default: none)")
    p.add_argument("--nnodes", type=int, default=2, help="nodes the ranks span, in --print-launch (default 2)")
    p.add_argument("--extra-args", default="", help="flags appended to both launch commands (default: none)")
    p.add_argument("--model", default=None, help="model name sent in requests (default: each server's first /v1/models id)")
    p.add_argument("--prompts", default=None,
                   help="prompt file: the project's JSONL, GPQA's CSV (e.g. gpqa_diamond.csv) or NeMo-Skills' prepared "
                        "GPQA JSONL (default: built-in arithmetic + multiple-choice set)")
    p.add_argument("--prompts-format", choices=FORMATS, default=d.prompts_format,
                   help="how to read --prompts; auto: .csv is gpqa-csv, a JSONL with 'expected_answer' is "
                        "nemo-skills-jsonl, other JSONL is ab-jsonl")
    p.add_argument("--choice-seed", type=int, default=d.choice_seed,
                   help="gpqa-csv: seed of each question's choice order (the same for every arm and seed)")
    p.add_argument("--prompt-template", default=None, metavar="FILE",
                   help="multiple-choice prompt template (str.format text with {problem}, or {question} and "
                        "{options}); default: NeMo-Skills' mcq-4choices text for the GPQA formats, the built-in ab-mc "
                        "text for JSONL prompts")
    p.add_argument("--limit", type=int, default=None, help="use only the first N prompts")
    p.add_argument("--concurrency", type=int, default=d.concurrency, help="requests in flight over both arms together, started in prompt order (so both servers see the same batches)")
    p.add_argument("--retries", type=int, default=d.retries, help="extra attempts on connection errors, timeouts, 5xx")
    p.add_argument("--backoff", type=float, default=d.backoff_s, help="first retry wait in s, doubled each retry")
    p.add_argument("--timeout", type=float, default=d.timeout_s, help="per-request timeout in s")
    p.add_argument("--max-tokens", type=int, default=d.max_tokens,
                   help="generation budget; large because reasoning models truncate thinking otherwise")
    p.add_argument("--reasoning-effort", default=None, help="passed through (K3: low / high / max)")
    p.add_argument("--seeds", type=int, default=d.seeds, help="seed 0 greedy, seeds >= 1 temperature 0.6 top_p 0.95")
    p.add_argument("--top-logprobs", type=int, default=d.top_logprobs,
                   help="alternatives per position in the logprob comparison")
    p.add_argument("--bootstrap-resamples", type=int, default=d.bootstrap_resamples,
                   help="resamples of the 95%% bootstrap interval of the paired difference")
    p.add_argument("--bootstrap-seed", type=int, default=d.bootstrap_seed,
                   help="seed of the bootstrap's resampling (recorded in the report)")
    p.add_argument("--dlogprob-bound", type=float, default=d.dlogprob_bound, metavar="NATS",
                   help="the verdict's bound on |delta logprob| at aligned greedy positions; streams may part only "
                        "where the baseline's margin is within twice it (default: bf16 rounding of logits below 32, "
                        "docs/ab.md)")
    p.add_argument("--fail-on-divergence", action="store_true",
                   help="exit with status 1 unless the verdict is 'agree' (for CI)")
    p.add_argument("--no-progress", action="store_true",
                   help="a status line every $K3NVFP4_PROGRESS_INTERVAL s instead of a progress bar")
    p.add_argument("--no-plots", action="store_true",
                   help="write report.json and summary.md only (without matplotlib the plots are skipped anyway)")
    p.add_argument("--out", type=Path, help="output directory (required unless printing launch commands)")


def _serve(args) -> int:
    from ..launch import ab_launch_commands
    from .serve import ServeConfig, run_serve_ab, summary_markdown
    from .verdict import verdict_line

    if args.print_launch or not args.arm:
        try:
            cmds = ab_launch_commands(args.model_path, tp=args.tp, ep=args.ep, nnodes=args.nnodes,
                                      extra_args=args.extra_args)
        except ValueError as e:
            raise ABError(f"serve --print-launch: {e}") from e
        for name, cmd in cmds.items():
            print(f"# {name}\n{cmd}\n")
        if not args.arm:
            print("Then: k3nvfp4-ab serve --arm marlin=http://HOST:30000 --arm triton_situ=http://HOST:30001 --out DIR")
        return 0
    if args.out is None:
        raise ABError("serve: --out DIR is required")
    _check_out(args.out)  # before any request: a run of hours must not fail at its end
    if not (args.dlogprob_bound > 0 and args.dlogprob_bound < float("inf")):
        raise ABError(f"serve: --dlogprob-bound must be a positive number of nats, got {args.dlogprob_bound}")
    if args.bootstrap_resamples < 1:
        raise ABError(f"serve: --bootstrap-resamples must be >= 1, got {args.bootstrap_resamples}")
    cfg = ServeConfig(arms=args.arm, out_dir=args.out, model=args.model, prompts=args.prompts,
                      prompts_format=args.prompts_format, choice_seed=args.choice_seed,
                      prompt_template=args.prompt_template, bootstrap_resamples=args.bootstrap_resamples,
                      bootstrap_seed=args.bootstrap_seed, limit=args.limit,
                      concurrency=args.concurrency, retries=args.retries, backoff_s=args.backoff,
                      timeout_s=args.timeout, max_tokens=args.max_tokens, reasoning_effort=args.reasoning_effort,
                      seeds=args.seeds, top_logprobs=args.top_logprobs, progress=not args.no_progress,
                      plots=not args.no_plots, dlogprob_bound=args.dlogprob_bound)
    rep = run_serve_ab(cfg)
    print(summary_markdown(rep))
    print(f"report: {args.out / 'report.json'}")
    print(verdict_line(rep.verdict))
    if args.fail_on_divergence and rep.verdict["verdict"] != "agree":
        print(f"k3nvfp4-ab serve: --fail-on-divergence: the verdict is {rep.verdict['verdict']!r}", file=sys.stderr)
        return 1
    return 0


def _check_out(out: Path) -> None:
    """--out must be a directory this run can write, checked before any work (common.outputs)."""
    try:
        check_output_dir(out, "--out")
    except OutputPathError as e:
        raise InputError(str(e)) from None


def _layer(args, as_script: bool) -> int:
    _check_out(args.out)  # before the weights load (and before the interpreter re-run)
    if as_script and args.device in (None, "cpu"):
        # Without CUDA the kernels must run in the interpreter, chosen when they are defined.
        from k3nvfp4.kernels.interpreter import rerun_with_interpreter

        rerun_with_interpreter("k3nvfp4.sglang_ext.ab.cli")
    from .layer import LayerABConfig, run_layer_ab

    cfg = LayerABConfig(
        out_dir=args.out, ckpt=args.ckpt, layer=args.layer, synthetic=args.synthetic, num_experts=args.experts,
        hidden_size=args.hidden, intermediate_size=args.intermediate, top_k=args.top_k, tokens=args.tokens,
        seed=args.seed, activations=args.activations, dtype=args.dtype,
        arms=None if args.arms is None else tuple(a.strip() for a in args.arms.split(",") if a.strip()),
        device=args.device, repeats=args.repeats, plots=not args.no_plots)
    rep = run_layer_ab(cfg)
    print(rep.summary_markdown())
    print(f"report: {args.out / 'report.json'}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `k3nvfp4-ab`; returns the exit status (0 ok, 2 environment/input error)."""
    parser = argparse.ArgumentParser(prog="k3nvfp4-ab", description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    sub = parser.add_subparsers(dest="cmd", metavar="{layer,serve}")
    _add_layer(sub)
    _add_serve(sub)
    args = parser.parse_args(argv)
    if args.cmd is None:  # no command: what the tool does and its two commands, not a bare usage error
        parser.print_help(sys.stderr)
        return 2
    try:
        return _serve(args) if args.cmd == "serve" else _layer(args, as_script=argv is None)
    except ABError as e:
        print(f"k3nvfp4-ab {args.cmd}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"k3nvfp4-ab {args.cmd}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
