"""One FP4-mode MoE call against the independent float64 oracle, to the bound of
tests/fp4_oracle_bound.py: the problem builders and the comparison shared by the interpreter tests
(tests/test_situ_accuracy.py) and the GPU tests (tests/test_moe_fp4_gpu.py), so that the GPU tests'
code path runs on every CPU test run too.

The oracle side sees only the stored bytes (E2M1 nibbles, E4M3 / E8M0 scale bytes, fp32 scale_2)
and the call's fp32 inputs; it decodes them with ml_dtypes and derives the static SiTU
intermediate scale from the activation's bound itself (fp4_moe_oracle.situ_static_scale).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np
import torch

import fp4_moe_oracle as oracle
import fp4_oracle_bound as bound
from k3nvfp4.kernels.activation import K3_SITU, GatedActivation
from k3nvfp4.kernels.moe_fp4 import FP4MMAWeights, FP4MoEConfig, fused_moe_fp4
from k3nvfp4.kernels.moe_fp4_details import kernels as _k
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


class KernelRecorder:
    """Within ``with``, records the named arguments of every launch of GEMM1 and of the row
    quantizer (moe_fp4_details.kernels) by wrapping their launchers' ``run`` (what kernel[grid](...)
    calls, on a GPU and in the interpreter alike); the tensors are kept by reference (each buffer
    is written once per call), read after the call."""

    NAMES = ("fp4_gemm1_kernel", "quant_rows_kernel")

    def __init__(self):
        self.calls: dict[str, list[dict]] = {}
        self._saved = []

    def __enter__(self) -> "KernelRecorder":
        for name in self.NAMES:
            fn = getattr(_k, name)
            own = fn.__dict__.get("run")
            run = fn.run

            def recorded(*args, grid, warmup, _fn=fn, _run=run, _name=name, **kwargs):
                result = _run(*args, grid=grid, warmup=warmup, **kwargs)
                self.calls.setdefault(_name, []).append(dict(zip(_fn.arg_names, args), **kwargs))
                return result

            fn.run = recorded
            self._saved.append((fn, own))
        return self

    def __exit__(self, *exc) -> None:
        for fn, own in self._saved:
            if own is None:
                del fn.run
            else:
                fn.run = own
        self._saved.clear()

    def intermediate(self, mode: str, ref: bound.WholeCall, M: int, k: int) -> np.ndarray:
        """The call's quantized intermediate for the oracle's served pairs (pair order), decoded
        -> float64 [P, I]: GEMM1's epilogue output (static NVFP4, MXFP8) or the row quantizer's
        (dynamic NVFP4), its rows mapped to pairs through GEMM1's sorted pair ids."""
        (g1,) = self.calls["fp4_gemm1_kernel"]
        sorted_ids = g1["sorted_ids_ptr"].cpu().numpy()
        n_padded = int(g1["num_padded_ptr"].cpu()[0])
        real = np.nonzero(sorted_ids[:n_padded] < M * k)[0]
        row_of = dict(zip(sorted_ids[real].tolist(), real.tolist()))
        rows = np.array([row_of[p] for p in ref.gemm1.pairs.tolist()], dtype=np.int64)
        inter = [c for c in self.calls.get("quant_rows_kernel", []) if c.get("HAS_NUM_ROWS")]
        if g1["OUT_F32"]:
            (qr,) = inter
            q, s, rs = qr["q_ptr"], qr["s_ptr"], qr["rs_ptr"].cpu().numpy()
        else:
            q, s, rs = g1["o_ptr"], g1["os_ptr"], g1["inter_scale"]
        return bound.decode_intermediate(mode, rows, _bytes(q), _bytes(s), rs)


def _bytes(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    return (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t).numpy()


@dataclass(frozen=True)
class OracleCheck:
    """What run_against_oracle found: whole, the call against the oracle with the windows of the
    intermediate's codes; stage, the call against GEMM2 of the call's own intermediate (arithmetic
    only: the tight one); changed_codes: the intermediate values where the call's code differs from
    the oracle's (each inside its window)."""

    whole: Comparison
    stage: Comparison
    changed_codes: int

    def describe(self) -> str:
        return (f"whole call: {self.whole.describe()}; own intermediate: {self.stage.describe()}; "
                f"changed codes {self.changed_codes}")


def run_against_oracle(p: FP4Problem, *, activation: GatedActivation = K3_SITU, intermediate_scale: str = "auto",
                       config: FP4MoEConfig | None = None, routed_scaling_factor: float | None = None,
                       deterministic: bool = False) -> tuple[torch.Tensor, OracleCheck, bound.WholeCall]:
    """fused_moe_fp4 on the problem against its oracle, three ways (each raises AssertionError past
    its bound): the output within the whole-call bound; the call's own quantized intermediate
    (recorded) within the oracle's windows, value for value; the output within the arithmetic-only
    bound of GEMM2 fed that intermediate. -> (the call's output, the check, the oracle)."""
    with KernelRecorder() as rec:
        got = fused_moe_fp4(p.x, p.weights, p.topk_weights, p.topk_ids, activation=activation,
                            intermediate_scale=intermediate_scale, config=config,
                            routed_scaling_factor=routed_scaling_factor, deterministic=deterministic)
        got_host = got.detach().cpu()
    ref = oracle_call(p, activation=activation, intermediate_scale=intermediate_scale,
                      routed_scaling_factor=routed_scaling_factor)
    whole = compare_with_oracle(got_host, ref)
    M, k = p.topk_ids.shape
    mine = rec.intermediate(p.mode, ref, M, k)
    outside = (mine < ref.window_lo) | (mine > ref.window_hi)
    if outside.any():
        i, j = np.argwhere(outside)[0]
        raise AssertionError(f"the call's intermediate [{i}, {j}] (pair {ref.gemm1.pairs[i]}) = {mine[i, j]!r} lies "
                             f"outside the oracle's window [{ref.window_lo[i, j]!r}, {ref.window_hi[i, j]!r}] "
                             f"({int(outside.sum())} values outside)")
    out2, bound2 = bound.gemm2_with_bound(mine, mine, mine, ref.gemm1, p.oracle_weights, p.topk_weights.cpu().numpy(),
                                          M, routed_scaling_factor, ref.out_dtype)
    stage = compare_with_oracle(got_host, _replace_out(ref, out2, bound2))
    changed = np.abs(mine - ref.deq) > 2.0**-10 * np.maximum(np.abs(mine), np.abs(ref.deq))  # not a row scale's ulp
    return got, OracleCheck(whole, stage, int(changed.sum())), ref


def _replace_out(ref: bound.WholeCall, out: np.ndarray, b: np.ndarray) -> bound.WholeCall:
    return replace(ref, out=out, bound=b)
