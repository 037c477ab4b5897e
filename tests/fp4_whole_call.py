"""One FP4-mode MoE call against the independent float64 oracle, to the bound of
tests/fp4_oracle_bound.py: the problem builders and the comparison shared by the interpreter tests
(tests/test_situ_accuracy.py) and the GPU tests (tests/test_moe_fp4_gpu.py), so that the GPU tests'
code path runs on every CPU test run too.

The oracle side sees only the stored bytes (E2M1 nibbles, E4M3 / E8M0 scale bytes, fp32 scale_2)
and the call's fp32 inputs; it decodes them with ml_dtypes and derives the static SiTU
intermediate scale from the activation's bound itself (fp4_moe_oracle.situ_static_scale).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

import fp4_moe_oracle as oracle
import fp4_oracle_bound as bound
from k3nvfp4.kernels.activation import K3_SITU, GatedActivation
from k3nvfp4.kernels.moe_fp4 import FP4MMAWeights, FP4MoEConfig, fused_moe_fp4
from k3nvfp4.kernels.testing import random_mxfp4_tensors, random_routing

_OUT_DTYPE = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


@dataclass(frozen=True)
class FP4Problem:
    """One call's operands: weights (FP4MMAWeights of the mode, on the device) and the oracle's
    OracleWeights decoded from the same stored bytes; x [M, H] (its dtype is the call's),
    topk_weights float32 [M, k], topk_ids int32 [M, k], on the device."""

    mode: str
    weights: FP4MMAWeights
    oracle_weights: oracle.OracleWeights
    x: torch.Tensor
    topk_weights: torch.Tensor
    topk_ids: torch.Tensor


def modelopt_tensors(E: int, H: int, I: int, seed: int) -> dict[str, np.ndarray]:
    """ModelOpt NVFP4 experts with general (not power-of-two) E4M3 block scales (bytes 40 .. 63:
    0.25 .. 1.875) and scale_2 in [0.02, 0.05]: what a W4A4 checkpoint stores."""
    g = np.random.default_rng(seed)
    return dict(w13=g.integers(0, 256, (E, 2 * I, H // 2), dtype=np.uint8),
                w13_scale=g.integers(40, 64, (E, 2 * I, H // 16), dtype=np.uint8),
                w13_scale_2=g.uniform(0.02, 0.05, (E, 2)).astype(np.float32),
                w2=g.integers(0, 256, (E, H, I // 2), dtype=np.uint8),
                w2_scale=g.integers(40, 64, (E, H, I // 16), dtype=np.uint8),
                w2_scale_2=g.uniform(0.02, 0.05, E).astype(np.float32))


def fp4_problem(mode: str, E: int, H: int, I: int, M: int, k: int, *, seed: int, scale: float = 1.0,
                dtype: torch.dtype = torch.float32, device: str = "cpu", source: str = "mxfp4") -> FP4Problem:
    """Random experts of mode "nvfp4" / "mxfp8" prepared from MXFP4 tensors (source "mxfp4", both
    modes: nvfp4 through the closed-form cast) or from ModelOpt NVFP4 tensors (source "modelopt",
    nvfp4 only); x = N(0, 1) x scale in float32, then cast to dtype; random top-k routing."""
    if source == "modelopt":
        t = modelopt_tensors(E, H, I, seed)
        fw = FP4MMAWeights.from_modelopt(*(torch.from_numpy(v) for v in t.values()), act_quant=mode)
        ow = oracle.oracle_weights(*t.values())
    elif source == "mxfp4":
        w13, e13, w2, e2 = random_mxfp4_tensors(E, H, I, seed=seed)
        fw = FP4MMAWeights.from_mxfp4(w13, e13, w2, e2, act_quant=mode)
        ow = oracle.oracle_weights(w13.numpy(), None, None, w2.numpy(), None, None, e8m0=(e13.numpy(), e2.numpy()))
    else:
        raise ValueError(f"source: expected 'mxfp4' or 'modelopt', got {source!r}")
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(M, H, generator=g) * scale).float().to(dtype)
    tw, ids = random_routing(M, k, E, seed=seed)
    return FP4Problem(mode, fw.to(device), ow, x.to(device), tw.to(device), ids.to(device))


def oracle_call(p: FP4Problem, *, activation: GatedActivation, intermediate_scale: str = "auto",
                input_scale: float | None = None, routed_scaling_factor: float | None = None) -> bound.WholeCall:
    """The oracle of fused_moe_fp4(p.x, p.weights, ..., activation=, intermediate_scale=,
    input_scale=, routed_scaling_factor=). The nvfp4 intermediate is static for "static", and for
    "auto" where the activation is capped SiTU (it then has a bound), with the oracle's own scale."""
    name, beta, lb = activation.name, float(activation.beta), activation.linear_beta
    bounded = name == "situ" and lb is not None
    static = p.mode == "nvfp4" and (intermediate_scale == "static" or (intermediate_scale == "auto" and bounded))
    return bound.whole_call(
        p.x.float().cpu().numpy(), p.oracle_weights, p.topk_weights.cpu().numpy(), p.topk_ids.cpu().numpy(),
        mode=p.mode, activation=name, beta=beta, linear_beta=lb, input_scale=input_scale,
        intermediate_static_scale=oracle.situ_static_scale(beta, lb) if static else None,
        routed_scaling_factor=routed_scaling_factor, out_dtype=_OUT_DTYPE[p.x.dtype])


@dataclass(frozen=True)
class Comparison:
    """rel_err: ||got - oracle|| / ||oracle|| (0 where both are 0); rel_bound: ||bound|| / ||oracle||;
    worst: max over elements of |got - oracle| / bound (<= 1 passes; 0 / 0 counts as 0)."""

    rel_err: float
    rel_bound: float
    worst: float

    def describe(self) -> str:
        return f"rel err {self.rel_err:.2e}, rel bound {self.rel_bound:.2e}, worst |err| / bound {self.worst:.3f}"


def compare_with_oracle(got: torch.Tensor, ref: bound.WholeCall) -> Comparison:
    """Assert |got - oracle| <= bound elementwise (got: the call's output, any float dtype)."""
    y = got.detach().double().cpu().numpy()
    if y.shape != ref.out.shape or not np.isfinite(y).all():
        raise AssertionError(f"output: shape {y.shape} (oracle {ref.out.shape}) or a non-finite value")
    err = np.abs(y - ref.out)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(err == 0, 0.0, err / ref.bound)
    norm = float(np.linalg.norm(ref.out))
    c = Comparison(float(np.linalg.norm(y - ref.out)) / norm if norm else float(np.linalg.norm(y)),
                   float(np.linalg.norm(ref.bound)) / norm if norm else float(np.linalg.norm(ref.bound)),
                   float(ratio.max()) if ratio.size else 0.0)
    if c.worst > 1.0:
        t, h = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
        raise AssertionError(f"kernel vs float64 oracle: out[{t}, {h}] = {y[t, h]!r}, oracle {ref.out[t, h]!r}, "
                             f"bound {ref.bound[t, h]:.3e} ({c.describe()})")
    return c


def run_against_oracle(p: FP4Problem, *, activation: GatedActivation = K3_SITU, intermediate_scale: str = "auto",
                       config: FP4MoEConfig | None = None, routed_scaling_factor: float | None = None,
                       deterministic: bool = False) -> tuple[torch.Tensor, Comparison, bound.WholeCall]:
    """fused_moe_fp4 on the problem, compared with its oracle (compare_with_oracle raises past the
    bound) -> (the call's output, the comparison, the oracle)."""
    got = fused_moe_fp4(p.x, p.weights, p.topk_weights, p.topk_ids, activation=activation,
                        intermediate_scale=intermediate_scale, config=config,
                        routed_scaling_factor=routed_scaling_factor, deterministic=deterministic)
    ref = oracle_call(p, activation=activation, intermediate_scale=intermediate_scale,
                      routed_scaling_factor=routed_scaling_factor)
    return got, compare_with_oracle(got, ref), ref
