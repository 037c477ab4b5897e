"""GPU checks of the FP4 tensor-core MoE modes (bench/gpu_check.sh runs `pytest -m gpu`): each mode
against the reference that quantizes the same way, where the installed Triton can run it on this
GPU; where it cannot, the clear error is what is checked (e.g. "nvfp4" on Hopper with Triton 3.6,
whose dot_scaled decomposition predates E4M3 block scales). The activation quantizers are compared
bit for bit with the independent spec oracle (tests/fp4_spec.py), not with kernels/act_quant.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import fp4_spec as spec
from k3nvfp4.kernels.moe_fp4 import FP4MMAWeights, FP4MoEConfig, check_fp4_mode_supported, fused_moe_fp4
from k3nvfp4.kernels.moe_fp4_reference import fused_moe_fp4_reference
from k3nvfp4.kernels.testing import random_routing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _weights(E, H, I, seed, act_quant):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randint(0, 256, (E, 2 * I, H // 2), dtype=torch.uint8, generator=g)
    w2 = torch.randint(0, 256, (E, H, I // 2), dtype=torch.uint8, generator=g)
    e13 = torch.randint(116, 122, (E, 2 * I, H // 32), dtype=torch.uint8, generator=g)
    e2 = torch.randint(117, 123, (E, H, I // 32), dtype=torch.uint8, generator=g)
    return FP4MMAWeights.from_mxfp4(w13, e13, w2, e2).to("cuda")


def _supported(act_quant):
    try:
        check_fp4_mode_supported(act_quant, torch.device("cuda"))
        return None
    except RuntimeError as exc:
        return str(exc)


@pytest.mark.parametrize("act_quant", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("E,H,I,k,M", [(16, 512, 192, 4, 3), (8, 256, 256, 2, 300)])
def test_gpu_fp4_modes_match_reference(act_quant, E, H, I, k, M):
    f = _weights(E, H, I, seed=E + M)
    tw, ids = random_routing(M, k, E, device="cuda", seed=M)
    x = torch.randn(M, H, device="cuda").to(torch.bfloat16)
    why = _supported(act_quant)
    if why is not None:  # the installed Triton cannot: the call must say so, never fall back
        print(f"{act_quant}: not supported here: {why}")
        with pytest.raises(RuntimeError, match="Triton"):
            fused_moe_fp4(x, f, tw, ids)
        return
    got = fused_moe_fp4(x, f, tw, ids)
    ref = fused_moe_fp4_reference(x, f, tw, ids)
    err = float((got.double() - ref.double()).norm() / ref.double().norm())
    print(f"{act_quant} E={E} H={H} I={I} M={M}: rel err vs reference {err:.3e}")
    assert err < 1e-2  # bf16 output rounding (2^-9) plus rare intermediate-rounding flips


@pytest.mark.parametrize("act_quant", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("cfg,M", [
    (FP4MoEConfig(block_m=16, swap_ab=True, block_n1=64, block_n2=128, block_k1=128, block_k2=128, split_k1=4,
                  split_k2=2), 5),
    (FP4MoEConfig(block_m=128, swap_ab=False, block_n1=128, block_n2=128, block_k1=128, block_k2=128, num_warps=8,
                  atomic_reduce=True), 300),
])
def test_gpu_fp4_split_k_and_atomic_top_k_match_reference(act_quant, cfg, M):
    """The skeleton's split-K (last arrival sums the slices) and the atomic top-k sum on a GPU,
    where programs really run concurrently."""
    if _supported(act_quant) is not None:
        pytest.skip(f"{act_quant} not supported by this Triton on this GPU (checked by the test above)")
    E, H, I, k = 8, 512, 256, 4
    f = _weights(E, H, I, seed=11)
    tw, ids = random_routing(M, k, E, device="cuda", seed=M)
    x = torch.randn(M, H, device="cuda").to(torch.bfloat16)
    got = fused_moe_fp4(x, f, tw, ids, config=cfg)
    ref = fused_moe_fp4_reference(x, f, tw, ids)
    err = float((got.double() - ref.double()).norm() / ref.double().norm())
    print(f"{act_quant} {cfg.label()} M={M}: rel err vs reference {err:.3e}")
    assert err < 1e-2
    if not cfg.atomic_reduce:  # slot-order sums: bitwise reproducible run to run
        assert torch.equal(got, fused_moe_fp4(x, f, tw, ids, config=cfg))


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
