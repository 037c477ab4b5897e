"""GPU-only checks of the fused NVFP4 MoE (run on an H200 by bench/gpu_check.sh): larger shapes
against the reference, no host synchronisation, CUDA-graph capture and replay."""

from __future__ import annotations

import pytest
import torch

from k3nvfp4.kernels import MoEConfig, fused_moe_nvfp4, fused_moe_nvfp4_reference
from k3nvfp4.kernels.activation import GatedActivation
from k3nvfp4.kernels.testing import random_nvfp4_moe_weights, random_routing

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def rel_err(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


# (E, H, I, top_k, M, num_global_experts): K3-like proportions at reduced size, plus an EP slice.
SHAPES = [
    (64, 1024, 192, 8, 1, None),
    (64, 1024, 192, 8, 37, None),
    (64, 1024, 192, 8, 512, None),
    (16, 512, 768, 4, 300, 64),
    (33, 144, 80, 8, 64, None),
]


@pytest.mark.parametrize("E,H,I,k,M,n_global", SHAPES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("activation", ["situ", "silu"])
def test_gpu_matches_reference(E, H, I, k, M, n_global, dtype, activation):
    w = random_nvfp4_moe_weights(E, H, I, device="cuda", seed=E + M)
    tw, ids = random_routing(M, k, E, device="cuda", seed=M, num_global_experts=n_global)
    x = torch.randn(M, H, device="cuda").to(dtype)
    act = GatedActivation.parse(activation)
    got = fused_moe_nvfp4(x, w, tw, ids, activation=act)
    ref = fused_moe_nvfp4_reference(x, w, tw, ids, activation=act)
    assert rel_err(got, ref) < (2e-5 if dtype == torch.float32 else 1e-2)


@pytest.mark.parametrize(
    "config",
    [
        MoEConfig(),
        MoEConfig(block_m=64, swap_ab=False, block_n1=64, block_k1=128, block_n2=128, num_warps1=8, num_warps2=8),
        MoEConfig(block_m=16, split_k1=4, split_k2=4, atomic_reduce=True),
    ],
)
def test_gpu_configs(config):
    E, H, I, k, M = 32, 768, 384, 8, 200
    w = random_nvfp4_moe_weights(E, H, I, device="cuda", seed=1)
    tw, ids = random_routing(M, k, E, device="cuda", seed=1)
    x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
    ref = fused_moe_nvfp4_reference(x, w, tw, ids)
    assert rel_err(fused_moe_nvfp4(x, w, tw, ids, config=config), ref) < 1e-2


def test_gpu_no_host_sync_and_cuda_graph_replay():
    E, H, I, k, M = 64, 1024, 192, 8, 16
    w = random_nvfp4_moe_weights(E, H, I, device="cuda", seed=3)
    tw, ids = random_routing(M, k, E, device="cuda", seed=3)
    x = torch.randn(M, H, device="cuda", dtype=torch.bfloat16)
    out = torch.empty_like(x)
    fused_moe_nvfp4(x, w, tw, ids, out=out)  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising op in the call raises
    try:
        fused_moe_nvfp4(x, w, tw, ids, out=out)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fused_moe_nvfp4(x, w, tw, ids, out=out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_moe_nvfp4(x, w, tw, ids, out=out)

    for seed in range(4):  # new routing and activations in the same buffers, then replay
        tw2, ids2 = random_routing(M, k, E, device="cuda", seed=100 + seed, num_global_experts=E * (1 + seed % 2))
        if seed == 3:
            ids2[:] = 5  # every pair on one expert
        x.copy_(torch.randn(M, H, device="cuda"))
        tw.copy_(tw2)
        ids.copy_(ids2)
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, fused_moe_nvfp4_reference(x, w, tw, ids)) < 1e-2
