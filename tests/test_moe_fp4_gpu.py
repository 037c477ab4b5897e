"""GPU checks of the FP4 tensor-core MoE modes (bench/gpu_check.sh runs `pytest -m gpu`): each mode's
whole call against the independent float64 oracle (tests/fp4_moe_oracle.py: ml_dtypes / numpy, no
kernel code), elementwise, to the bound tests/fp4_oracle_bound.py derives (fp32 GEMM1 and SiTU, the
intermediate codes the kernel's rounding may flip, fp32 GEMM2, one ulp of the bf16 output), where
the installed Triton can run it on this GPU; where it cannot, the clear error is what is checked
(e.g. "nvfp4" on Hopper with Triton 3.6, whose dot_scaled decomposition predates E4M3 block
scales). The problems, the call and the comparison are tests/fp4_whole_call.py's, which the
interpreter tests of tests/test_situ_accuracy.py run on every CPU run too. The activation
quantizers are compared bit for bit with the spec oracle (tests/fp4_spec.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fp4_spec as spec
from fp4_whole_call import fp4_problem, run_against_oracle
from k3nvfp4.kernels.moe_fp4 import FP4MoEConfig, check_fp4_mode_supported, fused_moe_fp4

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _supported(act_quant, device="cuda"):
    try:
        check_fp4_mode_supported(act_quant, torch.device(device))
        return None
    except RuntimeError as exc:
        return str(exc)


def check_call_against_oracle(act_quant, E, H, I, k, M, *, seed, config=None, device="cuda"):
    """One call of the mode on bf16 tokens N(0, 1) (experts prepared from random MXFP4 tensors)
    against the float64 oracle (fp4_whole_call.run_against_oracle: the whole call within the
    derived bound, the call's own intermediate codes within the oracle's windows, the output within
    the arithmetic-only bound of GEMM2 fed them: under 1% of the output, one bf16 ulp being 0.8%;
    at most 1% of the intermediate's codes differ from the oracle's). Returns the call's output,
    or None where the installed Triton cannot run the mode on this device: then the call must say
    so, never fall back.
    tests/test_situ_accuracy.py runs this function in the interpreter (device "cpu")."""
    p = fp4_problem(act_quant, E, H, I, M, k, seed=seed, dtype=torch.bfloat16, device=device)
    why = _supported(act_quant, device)
    if why is not None:
        print(f"{act_quant}: not supported here: {why}")
        with pytest.raises(RuntimeError, match="Triton"):
            fused_moe_fp4(p.x, p.weights, p.topk_weights, p.topk_ids, config=config)
        return None
    got, c, _ = run_against_oracle(p, config=config)  # raises past the bound
    label = "heuristic" if config is None else config.label()
    print(f"{act_quant} E={E} H={H} I={I} k={k} M={M} {label}: {c.describe()}")
    assert c.stage.rel_bound <= 1e-2, c.describe()  # one bf16 ulp (2^-7) + fp32 arithmetic
    assert c.changed_codes <= 0.01 * p.topk_ids.numel() * I, c.describe()
    if config is not None and not config.atomic_reduce:  # slot-order sums: bitwise reproducible run to run
        assert torch.equal(got, fused_moe_fp4(p.x, p.weights, p.topk_weights, p.topk_ids, config=config))
    return got


@pytest.mark.parametrize("act_quant", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("E,H,I,k,M", [(16, 512, 192, 4, 3), (8, 256, 256, 2, 300)])
def test_gpu_fp4_modes_match_float64_oracle(act_quant, E, H, I, k, M):
    check_call_against_oracle(act_quant, E, H, I, k, M, seed=E + M)


@pytest.mark.parametrize("act_quant", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("cfg,M", [
    (FP4MoEConfig(block_m=16, swap_ab=True, block_n1=64, block_n2=128, block_k1=128, block_k2=128, split_k1=4,
                  split_k2=2), 5),
    (FP4MoEConfig(block_m=128, swap_ab=False, block_n1=128, block_n2=128, block_k1=128, block_k2=128, num_warps=8,
                  atomic_reduce=True), 300),
])
def test_gpu_fp4_split_k_and_atomic_top_k_match_float64_oracle(act_quant, cfg, M):
    """The skeleton's split-K (last arrival sums the slices) and the atomic top-k sum on a GPU,
    where programs really run concurrently: any summation order is inside the bound."""
    if _supported(act_quant) is not None:
        pytest.skip(f"{act_quant} not supported by this Triton on this GPU (checked by the test above)")
    check_call_against_oracle(act_quant, 8, 512, 256, 4, M, seed=11, config=cfg)


@pytest.mark.parametrize("act_quant", ["nvfp4", "mxfp8"])
def test_gpu_activation_quantizers_bit_exact(act_quant):
    if _supported(act_quant) is not None:
        pytest.skip(f"{act_quant} not supported by this Triton on this GPU (checked by the test above)")
    from k3nvfp4.kernels.moe_fp4_details import kernels as K

    x = torch.randn(64, 512, device="cuda") * torch.logspace(-20, 20, 64, device="cuda")[:, None]
    x[3] = 0
    x[5, 9] = 1e9
    R, Kd = x.shape
    if act_quant == "nvfp4":
        bufs = (torch.empty(R, Kd // 2, dtype=torch.uint8, device="cuda"),
                torch.empty(R, Kd // 16, dtype=torch.float8_e4m3fn, device="cuda"),
                torch.empty(R, dtype=torch.float32, device="cuda"))
        ref = spec.quantize_nvfp4(x.cpu().numpy())
        ref = (ref.packed, ref.scale_bits, ref.row_scale.view(np.uint32))
    else:
        bufs = (torch.empty(R, Kd, dtype=torch.float8_e4m3fn, device="cuda"),
                torch.empty(R, Kd // 32, dtype=torch.uint8, device="cuda"),
                torch.empty(1, dtype=torch.float32, device="cuda"))
        ref = spec.quantize_mxfp8(x.cpu().numpy())
        ref = (ref.value_bits, ref.e8m0)
    K.quant_rows_kernel[(R,)](x, Kd, *bufs, bufs[2], Kd, 1.0, MODE=0 if act_quant == "nvfp4" else 1,
                              STATIC=False, HAS_NUM_ROWS=False, BLOCK_K=512)
    for g, r in zip(bufs, ref):  # E2M1 nibbles / E4M3 or E8M0 scale bytes / fp32 row-scale bits
        np.testing.assert_array_equal(_raw_bytes(g), r.view(np.uint8))


def _raw_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's bytes (uint8 numpy, same leading shape), whatever its dtype."""
    t = t.cpu().contiguous()
    return t.view(torch.uint8).numpy() if t.dtype != torch.float32 else t.numpy().view(np.uint8)
