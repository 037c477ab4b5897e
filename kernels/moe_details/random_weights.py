"""Random NVFP4 MoE weights and routings for tests, benchmarks and the tuner (no file I/O)."""

from __future__ import annotations

import torch

from .weights import NVFP4MoEWeights


def random_nvfp4_moe_weights(
    E: int,
    H: int,
    I: int,
    *,
    device: torch.device | str = "cpu",
    seed: int = 0,
    scale_exp_range: tuple[int, int] = (-3, 2),
    distinct_gate_up_scale_2: bool = True,
) -> NVFP4MoEWeights:
    """Uniform random nibbles, power-of-two E4M3 scales 2^[lo, hi], scale_2 around 1/8..1/4
    (gate != up when distinct_gate_up_scale_2), so that outputs stay O(1) for O(1) inputs."""
    g = torch.Generator().manual_seed(seed)

    def nibbles(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)

    def scales(*shape: int) -> torch.Tensor:
        lo, hi = scale_exp_range
        k = torch.randint(lo, hi + 1, shape, generator=g).float()
        return torch.exp2(k).to(torch.float8_e4m3fn)

    s2_gate = 0.125 + 0.125 * torch.rand(E, generator=g)
    s2_up = 0.125 + 0.125 * torch.rand(E, generator=g) if distinct_gate_up_scale_2 else s2_gate
    w13_scale_2 = torch.stack([s2_gate, s2_up], dim=1) / (H**0.5 / 8)
    w2_scale_2 = (0.125 + 0.125 * torch.rand(E, generator=g)) / (I**0.5 / 8)
    w = NVFP4MoEWeights.from_modelopt(
        nibbles(E, 2 * I, H // 2),
        scales(E, 2 * I, H // 16),
        w13_scale_2.float(),
        nibbles(E, H, I // 2),
        scales(E, H, I // 16),
        w2_scale_2.float(),
    )
    return w.to(device)


def random_routing(
    M: int,
    top_k: int,
    num_experts: int,
    *,
    device: torch.device | str = "cpu",
    seed: int = 0,
    num_global_experts: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights float32 [M, k] renormalised, topk_ids int32 [M, k]): k distinct experts per
    token (with repeats only when k exceeds the expert count) drawn from num_global_experts (default num_experts); global ids >= num_experts are
    mapped to -1, as an expert-parallel rank holding experts [0, num_experts) sees them."""
    g = torch.Generator().manual_seed(seed)
    n_global = num_global_experts or num_experts
    if top_k <= n_global:
        ids = torch.rand(M, n_global, generator=g).topk(top_k, dim=1).indices
    else:  # more slots than experts: repeats are unavoidable (and legal)
        ids = torch.randint(0, n_global, (M, top_k), generator=g)
    ids = torch.where(ids < num_experts, ids, torch.full_like(ids, -1)).to(torch.int32)
    w = torch.rand(M, top_k, generator=g) + 0.1
    w = (w / w.sum(dim=1, keepdim=True)).float()
    return w.to(device), ids.to(device)
