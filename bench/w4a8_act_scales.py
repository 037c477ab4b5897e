"""Which activation scales for the Hopper W4A8 mode (issue 38): the error of one gated MoE expert
(GEMM1 -> SiTU(beta 4, linear_beta 25) -> intermediate quantized the same way -> GEMM2) with the
activations and the SiTU intermediate in E4M3 under each candidate scale granularity, computed in
float64 on CPU (exact GEMMs: the quantization alone), against

  exact     float64 activations (the bf16 tokens) and intermediate, the MXFP4 weights exactly;
  mxfp8     K3's native activation numerics: E4M3 with E8M0 power-of-two scales per 32 (smallest
            2^k with 448 x 2^k >= block amax), tokens and intermediate;
  w4a16     bf16 tokens (exact: they are bf16) and a bf16 intermediate (the W4A16 kernels' path).

Candidates (tokens and intermediate alike), each with fp32 scales amax / 448 (DeepSeek-V3) and
with power-of-two scales (smallest 2^k with 448 x 2^k >= amax):
  (a) per_token       one scale per row;
  (b) per_token_128   one per row per 128 columns (DeepSeek-V3's FP8 recipe);
  (c) per_token_32    one per row per 32 columns (MXFP8-like, for reference);
  (a') per_token + static intermediate: tokens per row, the intermediate with the one scale
       SiTU's bound gives, beta x linear_beta / 448 (what (a) needs to avoid a row-wide amax).
The W4A8 arms multiply the weights kernels/moe_w4a8_details/prep.py prepares (E4M3 expansion, per-row 2^r;
blocks below the 14-binade window re-encoded), the references the MXFP4 values exactly.

Data: weights "synthetic" = uniformly random E2M1 codes with E8M0 exponents spread as
checkpoint/synthetic.py spreads them (binomial(12, 1/4) binades below a fan-in-sized maximum,
5 % of blocks 18..40 binades lower, 5 % zero blocks), "trained-like" = Gaussian rows quantized
to power-of-two NVFP4 (kernels.testing.k3_like_nvfp4_moe_weights). Tokens bf16: "realistic" =
kernels.testing.realistic_hidden_states (Student-t(5), log-normal channels, outlier channels x20,
RMS 1) with each row's RMS 2^u, u uniform in [-1, 1], and 1/16 of the rows zero; "row-binades" =
row RMS 2^u, u in [-12, 4] (16 binades); "outliers" = "realistic" plus 4 massive columns (x100).
SiTU's relative sensitivity grows with |g| (sigmoid(g) ~ e^g for g << 0), so rows with large
GEMM1 outputs amplify every arm's input error alike: compare the arms with each other.

    python -P bench/w4a8_act_scales.py --out bench/results/w4a8-act-scales-cpu.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import pathlib
import platform
import sys

import numpy as np
import torch

from k3nvfp4.common.files import write_json_atomic
from k3nvfp4.kernels import formats
from k3nvfp4.kernels.testing import k3_like_nvfp4_moe_weights, realistic_hidden_states
from k3nvfp4.kernels.moe_w4a8_details.prep import prepare_w4a8_from_mxfp4, prepare_w4a8_from_nvfp4

BETA, LINEAR_BETA = 4.0, 25.0
E4M3_MAX = 448.0
SITU_BOUND = BETA * LINEAR_BETA


# ---------------------------------------------------------------------------------------------
# Quantizers (float64 results; the scale arithmetic in fp32 where the kernel would do it)


def pow2_at_least(amax: torch.Tensor) -> torch.Tensor:
    """float64: the smallest 2^k with 448 x 2^k >= amax (1 where amax = 0), exact."""
    a = amax.double()
    _, e = torch.frexp(torch.where(a > 0, a, torch.ones_like(a)))
    k = e.long() - 9
    for _ in range(3):
        k = torch.where(torch.ldexp(torch.full_like(a, E4M3_MAX), k - 1) >= a, k - 1, k)
        k = torch.where(torch.ldexp(torch.full_like(a, E4M3_MAX), k) < a, k + 1, k)
    return torch.where(a > 0, torch.ldexp(torch.ones_like(a), k), torch.ones_like(a))


def e4m3_groups(x: torch.Tensor, group: int, kind: str, static: float | None = None) -> torch.Tensor:
    """x float32 [R, K] -> float64 [R, K]: E4M3 with one scale per row per `group` columns (the last
    group may be shorter), kind "fp32" (amax / 448) or "pow2"; `static` = one given scale."""
    R, K = x.shape
    n = -(-K // group)
    xb = torch.nn.functional.pad(x.float(), (0, n * group - K)).view(R, n, group)
    if static is not None:
        s = torch.full((R, n), static, dtype=torch.float32)
    elif kind == "fp32":
        s = xb.abs().amax(-1) / E4M3_MAX
        s = torch.where(s > 0, s, torch.ones_like(s))
    else:
        s = pow2_at_least(xb.abs().amax(-1)).float()
    q = (xb / s[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).double()
    return (q * s.double()[..., None]).reshape(R, n * group)[:, :K]


def mxfp8(x: torch.Tensor) -> torch.Tensor:
    """MXFP8 quantize-dequantize (32-element blocks, E8M0 scales clamped to 2^[-127, 127])."""
    R, K = x.shape
    xb = x.double().view(R, K // 32, 32)
    s = pow2_at_least(xb.abs().amax(-1)).clamp(2.0**-127, 2.0**127)
    q = (xb / s[..., None]).clamp(-E4M3_MAX, E4M3_MAX).float().to(torch.float8_e4m3fn).double()
    return (q * s[..., None]).reshape(R, K)


def situ(h: torch.Tensor, I: int) -> torch.Tensor:
    """float64 SiTU of the GEMM1 output [R, 2I] (gate, then up)."""
    g, u = h[:, :I], h[:, I:]
    return BETA * torch.tanh(g / BETA) * torch.sigmoid(g) * LINEAR_BETA * torch.tanh(u / LINEAR_BETA)


ARMS = {  # name -> (token quantizer, intermediate quantizer), both float32 [R, K] -> float64
    "exact": (lambda x: x.double(), lambda a: a.double()),
    "w4a16": (lambda x: x.bfloat16().double(), lambda a: a.float().bfloat16().double()),
    "mxfp8": (mxfp8, mxfp8),
}
for _kind in ("fp32", "pow2"):
    for _name, _g in (("per_token", None), ("per_token_128", 128), ("per_token_32", 32)):
        ARMS[f"{_name}/{_kind}"] = ((lambda x, g=_g, k=_kind: e4m3_groups(x, g or x.shape[1], k)),
                                    (lambda a, g=_g, k=_kind: e4m3_groups(a, g or a.shape[1], k)))
    ARMS[f"per_token+static_intermediate/{_kind}"] = (
        (lambda x, k=_kind: e4m3_groups(x, x.shape[1], k)),
        (lambda a: e4m3_groups(a, a.shape[1], "fp32", static=SITU_BOUND / E4M3_MAX)))
REFERENCES = ("exact", "w4a16", "mxfp8")


# ---------------------------------------------------------------------------------------------
# Data


def synthetic_mxfp4(N: int, K: int, rng: np.random.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """One matrix as checkpoint/synthetic.py draws them: (packed uint8 [N, K/2], E8M0 [N, K/32])."""
    e2m1_rms = math.sqrt(sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8)
    spread_rms = math.sqrt((1 - 0.25 + 0.25 / 4) ** 12)
    kmax = 127 + round(-math.log2(e2m1_rms * spread_rms * math.sqrt(K)))
    e8 = kmax - rng.binomial(12, 0.25, (N, K // 32))
    u = rng.random(e8.shape)
    e8 = np.where(u < 0.05, kmax - rng.integers(18, 41, e8.shape), e8)
    zero = (u >= 0.05) & (u < 0.10)
    packed = rng.integers(0, 256, (N, K // 32, 16), dtype=np.uint8)
    packed[zero] = 0
    return torch.from_numpy(packed.reshape(N, K // 2)), torch.from_numpy(np.clip(e8, 1, 254).astype(np.uint8))


def expert_weights(kind: str, H: int, I: int, seed: int):
    """[(w13 exact float64 [2I, H], w2 exact [H, I], w13 W4A8 float64, w2 W4A8, prep counts)] per expert."""
    import warnings

    out = []
    if kind == "synthetic":
        rng = np.random.default_rng(seed)
        for _ in range(2):
            (p13, e13), (p2, e2) = synthetic_mxfp4(2 * I, H, rng), synthetic_mxfp4(H, I, rng)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # the counts are reported below
                q13, q2 = prepare_w4a8_from_mxfp4(p13, e13, "w13"), prepare_w4a8_from_mxfp4(p2, e2, "w2")
            out.append((formats.dequantize_mxfp4(p13, e13).double(), formats.dequantize_mxfp4(p2, e2).double(),
                        q13, q2))
    else:
        w = k3_like_nvfp4_moe_weights(2, H, I, seed=seed)
        q13s, s13, s2_13, q2s, s2, s2_2 = w.to_modelopt()
        for e in range(2):
            rows13 = s2_13[e].repeat_interleave(I)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                q13 = prepare_w4a8_from_nvfp4(q13s[e], s13[e], rows13, "w13")
                q2 = prepare_w4a8_from_nvfp4(q2s[e], s2[e], s2_2[e].reshape(1), "w2")
            out.append((formats.dequantize_nvfp4(q13s[e], s13[e], 1.0).double() * rows13.double()[:, None],
                        formats.dequantize_nvfp4(q2s[e], s2[e], s2_2[e]).double(), q13, q2))
    return [(a, b, c.dequantize(), d.dequantize(),
             {"out_of_window": c.out_of_window + d.out_of_window, "rounded": c.rounded + d.rounded,
              "blocks": c.offsets.numel() + d.offsets.numel()}) for a, b, c, d in out]


TOKEN_SETS = {  # name -> (row log2-RMS range, massive columns, their factor)
    "realistic": ((-1.0, 1.0), 0, 1.0),
    "row-binades": ((-12.0, 4.0), 0, 1.0),
    "outliers": ((-1.0, 1.0), 4, 100.0),
}


def tokens(kind: str, M: int, H: int, seed: int) -> torch.Tensor:
    """bf16 tokens as float32 [M, H] (module docstring)."""
    g = torch.Generator().manual_seed(seed)
    x, _ = realistic_hidden_states(M, H, g)
    (lo, hi), n_massive, factor = TOKEN_SETS[kind]
    x = x * torch.exp2(torch.empty(M, 1).uniform_(lo, hi, generator=g))
    if n_massive:
        x[:, torch.randperm(H, generator=g)[:n_massive]] *= factor
    x[torch.randperm(M, generator=g)[: max(1, M // 16)]] = 0.0
    return x.bfloat16().float()


# ---------------------------------------------------------------------------------------------
# Metrics


def _errors(y: torch.Tensor, ref: torch.Tensor) -> dict:
    """Normwise and per-row relative errors over the nonzero reference rows."""
    rows = ref.norm(dim=1) > 0
    per_row = (y - ref)[rows].norm(dim=1) / ref[rows].norm(dim=1)
    return {"normwise": float((y - ref).norm() / ref.norm()),
            "row_median": float(per_row.median()), "row_p99": float(torch.quantile(per_row, 0.99)),
            "row_max": float(per_row.max())}


def forward(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, qx, qa, I: int) -> torch.Tensor:
    h = qx(x) @ w13.t()
    a = situ(h, I)
    return qa(a.float() if qa is not ARMS["exact"][1] else a) @ w2.t()


def run(shapes: dict, M: int, seed: int) -> list[dict]:
    results = []
    for shape_name, (H, I) in shapes.items():
        for wkind in ("synthetic", "trained-like"):
            experts = expert_weights(wkind, H, I, seed)
            for xkind in TOKEN_SETS:
                x = tokens(xkind, M, H, seed)
                zero_rows = x.abs().amax(1) == 0
                ys = {arm: [] for arm in ARMS}
                for w13, w2, q13, q2, _ in experts:
                    for arm, (qx, qa) in ARMS.items():
                        ws = (w13, w2) if arm in REFERENCES else (q13, q2)
                        ys[arm].append(forward(x, *ws, qx, qa, I))
                y = {arm: torch.cat(v) for arm, v in ys.items()}
                zr = zero_rows.repeat(len(experts))
                row = {"shape": shape_name, "H": H, "I": I, "weights": wkind, "tokens": xkind, "M": M,
                       "experts": len(experts), "zero_rows": int(zero_rows.sum()),
                       "weight_blocks": {k: sum(e[4][k] for e in experts) for k in ("blocks", "out_of_window", "rounded")},
                       "arms": {}}
                for arm in ARMS:
                    if arm == "exact":
                        continue
                    r = {"vs_exact": _errors(y[arm], y["exact"]),
                         "zero_rows_exact_zero": bool((y[arm][zr] == 0).all())}
                    if arm not in REFERENCES:
                        r["vs_mxfp8"] = _errors(y[arm], y["mxfp8"])
                        r["vs_w4a16"] = _errors(y[arm], y["w4a16"])
                    row["arms"][arm] = r
                for arm in ARMS:
                    if arm in REFERENCES or arm == "exact":
                        continue
                    row["arms"][arm]["error_ratio_to_mxfp8"] = round(
                        row["arms"][arm]["vs_exact"]["normwise"] / row["arms"]["mxfp8"]["vs_exact"]["normwise"], 3)
                    row["arms"][arm]["error_ratio_to_w4a16"] = round(
                        row["arms"][arm]["vs_exact"]["normwise"] / row["arms"]["w4a16"]["vs_exact"]["normwise"], 3)
                results.append(row)
                print(f"{shape_name:>5} {wkind:>12} {xkind:>9}: " + "  ".join(
                    f"{a} {r['vs_exact']['normwise']:.2e}/{r['vs_exact']['row_p99']:.2e}"
                    for a, r in row["arms"].items()), flush=True)
    return results


# Per K step, what the kernel must do for each candidate (weights on the MMA's M side, tokens on N;
# a K-loop iteration of 128 = 4 FP8 wgmma of K 32; per accumulator element). docs/w4a8.md explains.
KERNEL_COST = {
    "per_token": {"scale_multiplies_per_128_k": 0, "where": "epilogue: acc x 2^r (row) x s_token (column)",
                  "wgmma_chain": "one chain over all K (Triton's sm90 default for FP8 dots, max_num_imprecise_acc 2^30) "
                                 "or a promotion FADD every 128 K if the tensor cores' accumulation is too coarse",
                  "intermediate_scale": "needs the amax of a token's whole I row: a reduction across the GEMM1 "
                                        "programs of that token (or a static bound, arm (a'))",
                  "scale_bytes_per_token_row": 4},
    "per_token_128": {"scale_multiplies_per_128_k": 1,
                      "where": "K loop: fresh wgmma accumulator per 128 K, then acc += tmp x s[token] (one FFMA per "
                               "accumulator element: the promotion DeepSeek-V3 does anyway)",
                      "wgmma_chain": "4 wgmma per chain; BLOCK_K = 128 per iteration",
                      "intermediate_scale": "amax over 128 columns: local to a GEMM1 tile of >= 128 output columns",
                      "scale_bytes_per_token_row": "4 per 128 columns (H = 3584: 28 scales, 112 B per token)"},
    "per_token_32": {"scale_multiplies_per_128_k": 4,
                     "where": "K loop: every wgmma (K 32) its own accumulator, waited for, then one FFMA each",
                     "wgmma_chain": "1 wgmma per chain: no async overlap without a second accumulator set",
                     "intermediate_scale": "local (32 columns)",
                     "scale_bytes_per_token_row": "4 per 32 columns (1 with E8M0 bytes)"},
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=64, help="tokens per expert (M)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="small shapes (H 512, I 256 / 192) for a smoke run")
    ap.add_argument("--out", type=pathlib.Path, help="JSON report")
    args = ap.parse_args(argv)
    torch.set_num_threads(2)
    shapes = ({"EP16": (512, 256), "TP16": (512, 192)} if args.quick else
              {"EP16": (3584, 3072), "TP16": (3584, 192)})
    rows = run(shapes, args.tokens, args.seed)
    import subprocess

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    res = {"device": f"CPU ({platform.processor() or platform.machine()}), float64 on torch", "date": dt.date.today().isoformat(),
           "git_commit": commit or None,
           "torch": torch.__version__, "numpy": np.__version__, "python": platform.python_version(),
           "command": "python -P bench/w4a8_act_scales.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "situ": {"beta": BETA, "linear_beta": LINEAR_BETA, "bound": SITU_BOUND},
           "kernel_cost_per_k_step": KERNEL_COST, "rows": rows}
    if args.out:
        write_json_atomic(args.out, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
