"""Where the FP4 tensor-core modes' error comes from: the routed-expert output of one MoE layer
with FP4 weights, computed in fp32 with each quantization switched on alone and together, for
synthetic and for trained-like weights and activations. Plain torch on CPU (the quantizers of
kernels/act_quant.py, the kernels' exact rules), no GPU:

    python -P bench/fp4_error_budget.py --out bench/results/fp4-error-budget.json

Errors are normwise, ||y - y_ref|| / ||y_ref||, against the same layer with unquantized
activations and intermediate (y_ref; the FP4 weights are the same in every arm), at the K3 TP16
shard width (H = 3584, I = 192) by default.

Arms: activations only (NVFP4 dynamic per token / static input scale / MXFP8), the SiTU
intermediate only (NVFP4 with the static bound scale beta x linear_beta / 2688 / NVFP4 dynamic
per row / MXFP8), and the two modes as the kernels run them (nvfp4 = W4A4 with the static
intermediate, mxfp8 = W4A8).

Data: weights "uniform" = uniformly random E2M1 codes with E8M0 block scales (what the synthetic
checkpoints hold: every code equally likely, a flat magnitude distribution) or "trained-like" =
Gaussian rows with log-normal row scales quantized as the K3 cast does (kernels.testing.
k3_like_nvfp4_moe_weights); activations "gaussian" = N(0, 1) or "heavy-tailed" = post-RMSNorm-like
(Student-t(5), log-normal channel scales, outlier channels: kernels.testing.realistic_hidden_states).
"""

from __future__ import annotations

import argparse
import datetime as dt
import pathlib
import sys

import torch

from k3nvfp4.common.files import write_json_atomic
from k3nvfp4.kernels import act_quant as aq
from k3nvfp4.kernels import formats
from k3nvfp4.kernels.moe_details.weights import NVFP4MoEWeights
from k3nvfp4.kernels.activation import GatedActivation
from k3nvfp4.kernels.situ import gated_activation_f32
from k3nvfp4.kernels.testing import (k3_like_nvfp4_moe_weights, kimi_routing, random_mxfp4_tensors,
                                     realistic_hidden_states)

BETA, LINEAR_BETA = 4.0, 25.0
SITU = GatedActivation.situ(BETA, LINEAR_BETA)


def _nvfp4(static: float | None):
    def q(x: torch.Tensor) -> torch.Tensor:
        return aq.dequantize_nvfp4_rows(*aq.quantize_nvfp4_rows(x, static))
    return q


def _mxfp8(x: torch.Tensor) -> torch.Tensor:
    return aq.dequantize_mxfp8_rows(*aq.quantize_mxfp8_rows(x))


def _none(x: torch.Tensor) -> torch.Tensor:
    return x


def _dense(w: NVFP4MoEWeights) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 [E, 2I, H] and [E, H, I]: the FP4 weights every arm shares."""
    q13, s13, s2_13, q2, s2, s2_2 = w.to_modelopt()
    w13 = formats.dequantize_nvfp4(q13, s13, 1.0) * s2_13.repeat_interleave(w.intermediate_size, 1)[:, :, None]
    w2 = formats.dequantize_nvfp4(q2, s2, 1.0) * s2_2[:, None, None]
    return w13, w2


def moe_fp32(x, w13, w2, tw, ids, quant_x, quant_a) -> torch.Tensor:
    """Routed experts in fp32 with the given quantize-dequantize of the activations and the
    intermediate (each token quantized once for all its experts, as the kernels do)."""
    I = w2.shape[2]
    xq = quant_x(x)
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        h = xq[tok] @ w13[e].t()
        a = gated_activation_f32(h[:, :I], h[:, I:], SITU)
        out.index_add_(0, tok, (quant_a(a) @ w2[e].t()) * tw[tok, slot][:, None])
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def run(E: int, H: int, I: int, M: int, top_k: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    weights = {
        "uniform": NVFP4MoEWeights.from_mxfp4(*random_mxfp4_tensors(E, H, I, seed=seed)),
        "trained-like": k3_like_nvfp4_moe_weights(E, H, I, seed=seed),
    }
    acts = {"gaussian": torch.randn(M, H, generator=g), "heavy-tailed": realistic_hidden_states(M, H, g)[0]}
    tw, ids = kimi_routing(M, top_k, E, seed=seed)
    inter_static = SITU.nvfp4_static_scale
    arms = {
        "x nvfp4 (dynamic per token)": (_nvfp4(None), _none),
        "x nvfp4 (static input scale)": (None, _none),  # filled per activation set below
        "x mxfp8": (_mxfp8, _none),
        "intermediate nvfp4 (static SiTU bound)": (_none, _nvfp4(inter_static)),
        "intermediate nvfp4 (dynamic per row)": (_none, _nvfp4(None)),
        "intermediate mxfp8": (_none, _mxfp8),
        "mode nvfp4 (W4A4, static intermediate)": (_nvfp4(None), _nvfp4(inter_static)),
        "mode nvfp4 (W4A4, dynamic intermediate)": (_nvfp4(None), _nvfp4(None)),
        "mode mxfp8 (W4A8)": (_mxfp8, _mxfp8),
    }
    rows = []
    for wname, w in weights.items():
        w13, w2 = _dense(w)
        for xname, x in acts.items():
            ref = moe_fp32(x, w13, w2, tw, ids, _none, _none)
            h = x @ w13[ids[0, 0]].t()
            a = gated_activation_f32(h[:, :I], h[:, I:], SITU)
            # A static input scale as a W4A4 checkpoint calibrates it: the batch's max / 2688.
            static_in = float(x.abs().max()) / aq.NVFP4_ROW_RANGE
            row = {"weights": wname, "activations": xname,
                   "x_rel_quant_error": {"nvfp4": _rel(_nvfp4(None)(x), x), "mxfp8": _rel(_mxfp8(x), x)},
                   "intermediate_abs_max": float(a.abs().max()), "intermediate_rms": float(a.pow(2).mean().sqrt()),
                   "errors": {}}
            for arm, (qx, qa) in arms.items():
                qx = qx or _nvfp4(static_in)
                row["errors"][arm] = round(_rel(moe_fp32(x, w13, w2, tw, ids, qx, qa), ref), 5)
            rows.append(row)
            print(f"{wname:>12} {xname:>12}: " + ", ".join(f"{k} {v:.4f}" for k, v in row["errors"].items()),
                  flush=True)
    return {"shape": dict(E=E, H=H, I=I, M=M, top_k=top_k), "seed": seed, "situ": dict(beta=BETA, linear_beta=LINEAR_BETA),
            "intermediate_static_scale": inter_static, "rows": rows}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=3584)
    ap.add_argument("--intermediate", type=int, default=192)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=pathlib.Path, help="JSON report")
    args = ap.parse_args(argv)
    res = run(args.experts, args.hidden, args.intermediate, args.tokens, args.top_k, args.seed)
    res.update(date=dt.date.today().isoformat(), torch=torch.__version__,
               command="python -P bench/fp4_error_budget.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    if args.out:
        write_json_atomic(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
