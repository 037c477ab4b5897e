"""One MoE layer of a synthetic K3 checkpoint, cast by k3nvfp4-cast, through the fused kernel.

Chain: write_synthetic_checkpoint (MXFP4) -> k3nvfp4.checkpoint.cli.main (NVFP4) ->
load_moe_layer_nvfp4 (NVFP4MoELayer.weights) -> fused_moe_nvfp4, compared with (a) the reference on
the same NVFP4 tensors and (b) dense float64 experts decoded from the MXFP4 SOURCE (the cast is
exact for the synthetic data, so both sides hold the same numbers)."""

from __future__ import annotations

import json

import torch
from safetensors import safe_open

from k3nvfp4.checkpoint.cli import main as cast_main
from k3nvfp4.checkpoint.layer import load_moe_layer_nvfp4
from k3nvfp4.checkpoint.synthetic import write_synthetic_checkpoint
from k3nvfp4.kernels import formats, fused_moe_nvfp4, fused_moe_nvfp4_reference
from k3nvfp4.kernels.activation import GatedActivation
from k3nvfp4.kernels.testing import random_routing

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _source_expert(src, weight_map, layer, e, w):
    prefix = next(n for n in weight_map if f"layers.{layer}.block_sparse_moe.experts.{e}.{w}.weight_packed" in n)
    base = prefix[: -len(".weight_packed")]
    out = {}
    for suffix in ("weight_packed", "weight_scale"):
        with safe_open(str(src / weight_map[f"{base}.{suffix}"]), framework="pt") as f:
            out[suffix] = f.get_tensor(f"{base}.{suffix}")
    return formats.dequantize_mxfp4(out["weight_packed"], out["weight_scale"]).double()


def test_synthetic_checkpoint_layer_through_fused_moe(tmp_path):
    E, H, I, k, M, layer = 4, 64, 32, 2, 9, 1
    src = write_synthetic_checkpoint(
        tmp_path / "mxfp4", num_layers=2, num_experts=E, hidden_size=H, intermediate_size=I, top_k=k,
        num_shards=2, zero_exponent_fraction=0.0, seed=3,
    )
    dst = tmp_path / "nvfp4"
    assert cast_main(["--source_ckpt", str(src), "--output_ckpt", str(dst), "--workers", "1", "--no-progress"]) == 0

    t = load_moe_layer_nvfp4(dst, layer)
    assert t.hidden_act == "situ" and t.top_k == k
    w = t.weights.to(DEV)
    tw, ids = random_routing(M, k, E, device=DEV, seed=0)
    x = torch.randn(M, H, generator=torch.Generator().manual_seed(0)).to(DEV)
    kw = t.activation_kwargs()
    assert kw == dict(activation=GatedActivation.situ(4.0, 25.0), routed_scaling_factor=1.0)
    got = fused_moe_nvfp4(x, w, tw, ids, **kw)
    ref = fused_moe_nvfp4_reference(x, w, tw, ids, **kw)
    assert float((got - ref).norm() / ref.norm()) < 2e-5

    # Independent: dense experts decoded from the MXFP4 source, float64 math.
    weight_map = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    xd = x.cpu().double()
    expect = torch.zeros(M, H, dtype=torch.float64)
    for tok in range(M):
        for j in range(k):
            e = int(ids[tok, j])
            g = xd[tok] @ _source_expert(src, weight_map, layer, e, "w1").t()
            u = xd[tok] @ _source_expert(src, weight_map, layer, e, "w3").t()
            a = t.situ_beta * torch.tanh(g / t.situ_beta) * torch.sigmoid(g)
            a = a * t.situ_linear_beta * torch.tanh(u / t.situ_linear_beta)
            a = a.float().double()
            expect[tok] += float(tw[tok, j]) * (a @ _source_expert(src, weight_map, layer, e, "w2").t())
    assert float((got.cpu().double() - expect).norm() / expect.norm()) < 2e-5
