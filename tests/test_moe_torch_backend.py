"""The torch_reference backend's math (kernels/moe_torch_backend.py) against independent references.

- Its decode against ml_dtypes (float4_e2m1fn, float8_e4m3fn, float8_e8m0fnu) on every code.
- Whole calls, ModelOpt NVFP4 and the MXFP4 release, against SGLang's own ``moe_forward_native``
  (SituAndMul with beta and linear_beta) on dense weights decoded here with ml_dtypes: fp32
  activations agree to summation order (the only difference: fp32 dots in another order, and
  SGLang's 16-bit roundings absent in fp32), 16-bit ones to the roundings SGLang adds (its GEMM
  outputs and per-expert outputs in the activation dtype; the reference keeps them in fp32).
- A case computed by hand in Python floats: gate and up with different scale_2, which must be
  applied before the (nonlinear) activation.
- Bad tensors named.
"""

from __future__ import annotations

import math
import types

import ml_dtypes
import numpy as np
import pytest
import torch

from k3nvfp4.kernels import moe_torch_backend as ref
from k3nvfp4.kernels.activation import GatedActivation

E, H, I, M, K = 6, 64, 64, 9, 3
# max |out - sglang| / max |sglang|. fp32: both sides are fp32 dots over <= 64 terms, orders
# differ (measured 2e-7). 16-bit: SGLang rounds its GEMM1 output, its GEMM2 output and each
# expert's contribution to the activation dtype, the reference only the intermediate and the
# sum: a few roundings of 2^-8 (bf16) / 2^-11 (fp16), measured up to 7e-3 / 9e-4.
TOL = {torch.float32: 2e-6, torch.bfloat16: 1.5e-2, torch.float16: 2e-3}


def _e2m1_np() -> np.ndarray:
    return np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32)


def _unpack(packed: torch.Tensor) -> np.ndarray:
    p = packed.numpy()
    codes = np.stack([p & 0xF, p >> 4], axis=-1).reshape(*p.shape[:-1], -1)
    return _e2m1_np()[codes]


def _dense_nvfp4(w: torch.Tensor, s: torch.Tensor, s2: np.ndarray) -> torch.Tensor:
    """ml_dtypes decode: [..., R, K/2] u8, [..., R, K/16] e4m3, s2 broadcastable [..., R, 1]."""
    scale = s.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    return torch.from_numpy(_unpack(w) * np.repeat(scale, 16, axis=-1) * s2)


def _dense_mxfp4(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    scale = s.numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32)
    return torch.from_numpy(_unpack(w) * np.repeat(scale, 32, axis=-1))


def _nvfp4_experts(g: torch.Generator) -> ref.ModelOptNVFP4Experts:
    """Random nibbles, E4M3 block scales around 2^-3 (normal and subnormal codes), distinct
    gate/up scale_2 per expert."""
    def scales(*shape):
        return torch.randint(0x08, 0x40, shape, generator=g, dtype=torch.uint8).view(torch.float8_e4m3fn)
    return ref.ModelOptNVFP4Experts(
        torch.randint(0, 256, (E, 2 * I, H // 2), generator=g, dtype=torch.uint8), scales(E, 2 * I, H // 16),
        torch.rand(E, 2, generator=g) * 0.5 + 0.25,
        torch.randint(0, 256, (E, H, I // 2), generator=g, dtype=torch.uint8), scales(E, H, I // 16),
        torch.rand(E, generator=g) * 0.5 + 0.25)


def _mxfp4_experts(g: torch.Generator) -> ref.MXFP4Experts:
    return ref.MXFP4Experts(
        torch.randint(0, 256, (E, 2 * I, H // 2), generator=g, dtype=torch.uint8),
        torch.randint(121, 125, (E, 2 * I, H // 32), generator=g, dtype=torch.uint8),
        torch.randint(0, 256, (E, H, I // 2), generator=g, dtype=torch.uint8),
        torch.randint(121, 125, (E, H, I // 32), generator=g, dtype=torch.uint8))


def _routing(g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(M)]).to(torch.int32)
    w = torch.rand(M, K, generator=g)
    return w / w.sum(-1, keepdim=True), ids


def _sglang(w13: torch.Tensor, w2: torch.Tensor, x: torch.Tensor, tw, ids, beta, linear_beta) -> torch.Tensor:
    from sglang.srt.layers.moe.fused_moe_native import moe_forward_native
    from sglang.srt.layers.moe.moe_runner import MoeRunnerConfig
    from sglang.srt.layers.moe.topk import StandardTopKOutput

    layer = types.SimpleNamespace(num_experts=w13.shape[0], w13_weight=w13.to(x.dtype), w2_weight=w2.to(x.dtype))
    cfg = MoeRunnerConfig(activation="situ", gemm1_alpha=beta, gemm1_clamp_limit=linear_beta)
    return moe_forward_native(layer, x, StandardTopKOutput(tw, ids.long(), None), cfg)


def _rel(out: torch.Tensor, want: torch.Tensor) -> float:
    return float((out.float() - want.float()).abs().max() / want.float().abs().max())


def test_decode_matches_ml_dtypes_on_every_code():
    b = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    lo_hi = ref.decode_e2m1(b)  # [512]: (low, high) per byte
    want = _e2m1_np()[np.stack([b.numpy() & 0xF, b.numpy() >> 4], -1).reshape(-1)]
    assert np.array_equal(lo_hi.numpy(), want) and np.array_equal(np.signbit(lo_hi.numpy()), np.signbit(want))
    e4m3 = b.numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    got = ref.decode_e4m3(b).numpy()
    assert np.array_equal(got, e4m3, equal_nan=True)
    assert np.array_equal(ref.decode_e4m3(b.view(torch.float8_e4m3fn)).numpy(), e4m3, equal_nan=True)
    e8m0 = ref.decode_e8m0(b[:255]).numpy()
    assert np.array_equal(e8m0, b[:255].numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float32))
    assert [math.ldexp(1.0, int(k) - 127) for k in range(255)] == e8m0.tolist()  # 2^(byte-127), byte 0 = 2^-127


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["nvfp4", "mxfp4"])
def test_whole_call_matches_sglang_moe_forward_native(layout, dtype):
    g = torch.Generator().manual_seed(11)
    experts = _nvfp4_experts(g) if layout == "nvfp4" else _mxfp4_experts(g)
    if layout == "nvfp4":
        s2 = experts.w13_scale_2.numpy()
        rows = np.where(np.arange(2 * I)[None, :] < I, s2[:, :1], s2[:, 1:])  # gate rows, then up rows
        w13 = _dense_nvfp4(experts.w13, experts.w13_scale, rows[..., None])
        w2 = _dense_nvfp4(experts.w2, experts.w2_scale, experts.w2_scale_2.numpy()[:, None, None])
    else:
        w13, w2 = _dense_mxfp4(experts.w13, experts.w13_scale), _dense_mxfp4(experts.w2, experts.w2_scale)
    x = (torch.randn(M, H, generator=g) * 0.5).to(dtype)
    tw, ids = _routing(g)
    for beta, linear_beta in ((4.0, 25.0), (1.5, 0.75)):  # the second: the up cap bites
        out = ref.moe_forward_reference(x, experts, tw, ids, activation=GatedActivation.situ(beta, linear_beta))
        want = _sglang(w13, w2, x, tw, ids, beta, linear_beta)
        assert out.dtype == dtype and out.shape == (M, H)
        assert _rel(out, want) < TOL[dtype], (layout, dtype, beta, _rel(out, want))
    # routed_scaling_factor multiplies the sum; EP's -1 ids contribute nothing.
    scaled = ref.moe_forward_reference(x, experts, tw, ids, routed_scaling_factor=2.5)
    assert _rel(scaled, 2.5 * _sglang(w13, w2, x, tw, ids, 4.0, 25.0).float()) < TOL[dtype]
    remote = ids.clone()
    remote[:, 0] = -1
    kept = tw.clone()
    kept[:, 0] = 0.0
    out = ref.moe_forward_reference(x, experts, tw, remote)
    assert _rel(out, _sglang(w13, w2, x, kept, ids, 4.0, 25.0)) < TOL[dtype]


def test_scale_2_applied_before_the_activation_by_hand():
    """One token x = (1, 0, ..., 0), H = I = 16, one expert of two. Every w13 nibble is code 2
    (1.0), block scales 0.5 (gate rows) / 2 (up rows), scale_2 gate 3, up 0.25: gate = 1.5,
    up = 0.5 everywhere. w2 nibbles code 1 (0.5), scale 1, scale_2 4: out_k = topk_weight x
    rsf x sum_j 2 a_j = 0.7 x 1.5 x 16 x 2 x a."""
    h = i = 16
    w13 = torch.full((2, 2 * i, h // 2), 0x22, dtype=torch.uint8)
    s13 = torch.cat([torch.full((2, i, 1), 0.5), torch.full((2, i, 1), 2.0)], 1).to(torch.float8_e4m3fn)
    experts = ref.ModelOptNVFP4Experts(
        w13, s13, torch.tensor([[9.0, 9.0], [3.0, 0.25]]), torch.full((2, h, i // 2), 0x11, dtype=torch.uint8),
        torch.ones(2, h, 1).to(torch.float8_e4m3fn), torch.tensor([1.0, 4.0]))
    x = torch.zeros(1, h)
    x[0, 0] = 1.0
    beta, linear_beta = 4.0, 0.4
    a = beta * math.tanh(1.5 / beta) / (1 + math.exp(-1.5)) * (linear_beta * math.tanh(0.5 / linear_beta))
    a = float(np.float32(a))  # the intermediate is rounded to x's dtype (fp32 here)
    out = ref.moe_forward_reference(x, experts, torch.tensor([[0.7]]), torch.tensor([[1]]),
                                    activation=GatedActivation.situ(beta, linear_beta), routed_scaling_factor=1.5)
    np.testing.assert_allclose(out.numpy(), np.full((1, h), 0.7 * 1.5 * 16 * 2 * a), rtol=1e-6)
    # silu: g sigmoid(g) u
    out = ref.moe_forward_reference(x, experts, torch.tensor([[1.0]]), torch.tensor([[1]]), activation=GatedActivation.silu())
    np.testing.assert_allclose(out.numpy(), np.full((1, h), 32 * 1.5 / (1 + math.exp(-1.5)) * 0.5), rtol=1e-6)


def test_bad_tensors_are_named():
    g = torch.Generator().manual_seed(3)
    mx = _mxfp4_experts(g)
    bad = mx.w2_scale.clone()
    bad[0, 0, 0] = 255
    with pytest.raises(ValueError, match=r"w2_weight_scale: 1 E8M0 scale byte\(s\) are 255"):
        ref.MXFP4Experts(mx.w13, mx.w13_scale, mx.w2, bad)
    nv = _nvfp4_experts(g)
    with pytest.raises(TypeError, match="w13_weight_scale: expected dtype torch.float8_e4m3fn"):
        ref.ModelOptNVFP4Experts(nv.w13, nv.w13_scale.view(torch.uint8), nv.w13_scale_2, nv.w2, nv.w2_scale,
                                 nv.w2_scale_2)
    nan = nv.w2_scale.clone()
    nan.view(torch.uint8)[1, 2, 3] = 0x7F
    with pytest.raises(ValueError, match="w2_weight_scale: contains E4M3 NaN"):
        ref.ModelOptNVFP4Experts(nv.w13, nv.w13_scale, nv.w13_scale_2, nv.w2, nan, nv.w2_scale_2)
    with pytest.raises(ValueError, match=r"w2_weight_scale_2: expected shape \(6,\)"):
        ref.ModelOptNVFP4Experts(nv.w13, nv.w13_scale, nv.w13_scale_2, nv.w2, nv.w2_scale, nv.w2_scale_2[:3])
    with pytest.raises(ValueError, match="hidden size 32"):
        ref.moe_forward_reference(torch.zeros(2, 32), nv, torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int32))
