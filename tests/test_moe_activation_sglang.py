"""Our SiTU / SiLU-and-mul (the reference's activation) against SGLang's own forward_native."""

from __future__ import annotations

import pytest
import torch

from k3nvfp4.kernels.activation import GatedActivation
from k3nvfp4.kernels.situ import gated_activation_f32, silu_and_mul, situ_and_mul

from sglang.srt.layers import activation  # noqa: E402  (sglang is a test dependency; tests only)


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2 * 80, generator=g) * 6  # spans tanh saturation of both branches
    x[0, :4] = torch.tensor([0.0, -0.0, 1e-6, -1e-6])
    x[1, 80:84] = torch.tensor([100.0, -100.0, 30.0, -30.0])
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("beta,linear_beta", [(4.0, 25.0), (4.0, None), (1.5, 2.0)])
def test_situ_matches_sglang_forward_native_bitwise(dtype, beta, linear_beta):
    x = _inputs(dtype)
    theirs = activation.SituAndMul(beta=beta, linear_beta=linear_beta).forward_native(x)
    ours = situ_and_mul(x, beta, linear_beta)
    assert ours.dtype == theirs.dtype == dtype
    assert torch.equal(ours, theirs)


def test_situ_linear_beta_caps_up_branch():
    x = _inputs(torch.float32)
    capped = situ_and_mul(x, 4.0, 25.0)
    uncapped = situ_and_mul(x, 4.0, None)
    # |up| = 100 is softly capped at 25 * tanh(4) ~ 24.98; the gate part is identical
    gate_part = gated_activation_f32(x[1:2, :80], torch.ones(1, 80), GatedActivation.situ(4.0, None))
    assert torch.allclose(capped[1, 0] / gate_part[0, 0], 25.0 * torch.tanh(torch.tensor(4.0)))
    assert torch.allclose(uncapped[1, 0] / gate_part[0, 0], torch.tensor(100.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_matches_sglang_forward_native(dtype):
    x = _inputs(dtype)
    theirs = activation.SiluAndMul().forward_native(x)
    ours = silu_and_mul(x)
    if dtype == torch.float32:
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    else:
        # SGLang computes in bf16, we in fp32 then round once (as marlin's epilogue): <= 2 ulp.
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=2 * 2**-8, atol=1e-6)


def test_reference_two_pass_mode_matches_sglang_activation():
    """fused_moe_nvfp4_reference(round_gemm1_output=True) = GEMM1 output rounded to bf16, then
    SGLang's SituAndMul.forward_native, as SGLang's two-pass runners compute it."""
    from k3nvfp4.kernels import formats, fused_moe_nvfp4_reference
    from k3nvfp4.kernels.testing import random_nvfp4_moe_weights, random_routing

    E, k, M, H, I = 3, 2, 7, 64, 32
    w = random_nvfp4_moe_weights(E, H, I, seed=5)
    tw, ids = random_routing(M, k, E, seed=5)
    x = (torch.randn(M, H, generator=torch.Generator().manual_seed(5)) * 3).to(torch.bfloat16)
    got = fused_moe_nvfp4_reference(x, w, tw, ids, round_gemm1_output=True).float()

    situ = activation.SituAndMul(beta=4.0, linear_beta=25.0)
    w13, s13, s13_2, w2, s2, s2_2 = w.to_modelopt()
    expect = torch.zeros(M, H)
    for t in range(M):
        for j in range(k):
            e = int(ids[t, j])
            gate_up = torch.cat([
                formats.dequantize_nvfp4(w13[e, :I], s13[e, :I], s13_2[e, 0]),
                formats.dequantize_nvfp4(w13[e, I:], s13[e, I:], s13_2[e, 1]),
            ])
            h = (x[t].float() @ gate_up.t()).to(torch.bfloat16)
            a = situ.forward_native(h).float()
            expect[t] += tw[t, j] * (a @ formats.dequantize_nvfp4(w2[e], s2[e], s2_2[e]).t())
    torch.testing.assert_close(got, expect.to(torch.bfloat16).float(), rtol=2**-7, atol=1e-6)
    # and the two-pass rounding is a real (small) difference from the fused numerics
    fused_numerics = fused_moe_nvfp4_reference(x, w, tw, ids).float()
    assert 0 < float((fused_numerics - got).norm() / got.norm()) < 2e-2
