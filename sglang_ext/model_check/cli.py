"""``python -P -m k3nvfp4.sglang_ext.selfcheck --model CKPT``: the model-class self-check.

Runs SGLang 0.5.23's own loader path and Kimi-K3 model class on a checkpoint, cast NVFP4 or the
MXFP4 release (see
:mod:`k3nvfp4.sglang_ext.model_check`), prints one summary per check and exits 0 only when
every check holds. On a machine without a GPU the fused kernels run in the Triton interpreter
(the command re-executes itself with TRITON_INTERPRET=1).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

PROG = "python -P -m k3nvfp4.sglang_ext.selfcheck"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", type=Path, action="append", metavar="CKPT",
                    help="checkpoint directory: a ModelOpt NVFP4 checkpoint (k3nvfp4-cast output) or Kimi-K3's "
                         "MXFP4 release (compressed-tensors); repeat for several")  # fmt: skip
    ap.add_argument("--parallel", default="1x1", metavar="TPxEP[,TPxEP...]",
                    help="layouts to check, e.g. 1x1,2x1,2x2 (TP2 EP1, TP2 EP2); a world of N ranks runs in "
                         "N spawned processes (gloo on CPU, NCCL with one GPU per rank)")  # fmt: skip
    ap.add_argument("--layers", type=int, default=None,
                    help="build only the first N hidden layers (SGLang's --json-model-override-args "
                         "num_hidden_layers; only the shards holding them are read): for the real 1.6 TB checkpoint, "
                         "e.g. --layers 2 (dense layer 0 + the first MoE layer)")  # fmt: skip
    ap.add_argument("--routed-scaling-factor", default="2.5",
                    help="override for the check (default 2.5: a factor != 1 proves it is applied exactly once); "
                         "'keep' uses the checkpoint's")  # fmt: skip
    ap.add_argument("--tokens", type=int, default=8, help="tokens through the MoE block forward")
    ap.add_argument("--moe-layer", type=int, default=None, help="MoE block for the forward (default: the first)")
    ap.add_argument("--no-forward", action="store_true", help="skip post-processing's forward check")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="write the full report here")


def _parallel(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        try:
            tp, ep = (int(v) for v in item.lower().split("x"))
        except ValueError:
            raise SystemExit(f"{PROG}: --parallel {item!r}: expected TPxEP, e.g. 2x1") from None
        if tp < 1 or ep < 1 or tp % ep:
            raise SystemExit(f"{PROG}: --parallel {item!r}: tp must be a positive multiple of ep")
        out.append((tp, ep))
    return out


def summary(run: dict[str, Any]) -> str:
    """A few lines per check: verdict, counts, quant roles, forward errors."""
    head = f"{'PASSED' if run['ok'] else 'FAILED'}  {run['checkpoint']}  tp{run['tp_size']}/ep{run['ep_size']}"
    lines = [head]
    for r in run["ranks"]:
        if "tensors" not in r:
            continue
        t, p, f = r["tensors"], r["params"], r.get("forward")
        lines.append(
            f"  rank {r['rank']}: {r['model_class']} via {r['model_loader']} + {r['quant_config']}, "
            f"backend {r['moe_runner_backend']}, {r['num_hidden_layers']} layers; "
            f"{t['landed']}/{t['checkpoint']} tensors landed here"
            + (f", {t['experts_of_other_ranks']} on other EP ranks" if t["experts_of_other_ranks"] else "")
            + (f", {t['beyond_truncated_model']} beyond --layers" if t["beyond_truncated_model"] else "")
            + f"; {p['compared'] - p['mismatches']}/{p['compared']} parameters exact ({p['expert_checks']} local experts)"
        )  # fmt: skip
        roles = ", ".join(f"{role}: {'/'.join(sorted(m))}" for role, m in sorted(r["quant"]["by_role"].items()))
        lines.append(f"    quant methods: {roles}")
        if f:
            lines.append(
                f"    {f['prefix']} forward ({f['tokens']} tokens, {f['dtype']}, routed_scaling_factor "
                f"{f['routed_scaling_factor']}): normwise err {f['err']:.2e} (tol {f['tolerance']:g}); "
                f"with the factor applied 0x / 2x: {f['err_scaling_applied_0x'] or float('nan'):.2e} / "
                f"{f['err_scaling_applied_2x'] or float('nan'):.2e}; output RMS {f['out_rms']:.3g}"
            )  # fmt: skip
        lines.append(f"    time: {r['timings_s']}")
    for prob in run["problems"][:40]:
        lines.append(f"  problem: {prob}")
    if len(run["problems"]) > 40:
        lines.append(f"  ... {len(run['problems']) - 40} more problems (see --json)")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None, ap: argparse.ArgumentParser | None = None) -> int:
    from .run import CheckOptions, run_checks
    from .sglang_path import ModelCheckError

    if ap is None:
        ap = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
        add_arguments(ap)
    args = ap.parse_args(argv)
    if not args.model:
        ap.error("--model CKPT is required for the model-class check")
    for m in args.model:
        if not (m / "config.json").is_file():
            ap.error(f"--model {m}: no config.json there (expected a k3nvfp4-cast output or the MXFP4 release)")
    if args.json is not None:
        from ...common.outputs import OutputPathError, check_output_file

        try:  # before the checks, which load SGLang and the checkpoint
            check_output_file(args.json, "--json")
        except OutputPathError as e:
            print(f"{PROG}: error: {e}", file=sys.stderr)
            return 2
    rsf = None if args.routed_scaling_factor == "keep" else float(args.routed_scaling_factor)
    options = [
        CheckOptions(ckpt=m.resolve(), tp_size=tp, ep_size=ep, num_layers=args.layers, routed_scaling_factor=rsf,
                     tokens=args.tokens, seed=args.seed, moe_layer=args.moe_layer, forward=not args.no_forward)
        for m in args.model for tp, ep in _parallel(args.parallel)
    ]  # fmt: skip
    try:
        runs = run_checks(options)
    except (ModelCheckError, FileNotFoundError, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    for run in runs:
        print(summary(run))
    from . import noise

    said = [m for run in runs for r in run["ranks"] for m in r.get("sglang_known_messages", [])]
    if said:
        print("SGLang messages filtered from the output (known; they do not concern this check):")
        print("\n".join(noise.explain(said)))
    ok = all(r["ok"] for r in runs)
    if args.json:
        from ...common.files import write_json_atomic

        write_json_atomic(args.json, {"ok": ok, "runs": runs})
    print(f"model-class self-check: {'PASSED' if ok else 'FAILED'} ({sum(r['ok'] for r in runs)}/{len(runs)} checks)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
