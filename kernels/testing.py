"""Random NVFP4 MoE problems for the tests, the tuner, the benchmarks and the layer A/B (no file I/O).

Every function draws from a CPU ``torch.Generator`` seeded with ``seed`` and only then moves the
result to ``device``: one seed gives the same numbers on every machine.

Weights (-> :class:`NVFP4MoEWeights`):
  random_nvfp4_moe_weights   uniform E2M1 codes, random E4M3 block scales (kernel tests, tuner)
  k3_like_nvfp4_moe_weights  Gaussian weights quantized with the scale structure of the bit-exact
                             MXFP4 -> NVFP4 cast of K3 (the A/B's synthetic layer)
Routing (-> topk_weights float32 [M, k], topk_ids int32 [M, k]; -1 = expert on another rank):
  random_routing             k distinct experts per token, uniformly drawn
  kimi_routing               K3 routing on random router logits (hot and cold experts)
  sigmoid_topk_routing       K3 routing from given router logits and bias
Activations:
  realistic_hidden_states    post-RMSNorm residual-stream statistics
"""

from __future__ import annotations

import torch

from . import formats
from .moe_details.weights import ModelOptMoETensors, NVFP4MoEWeights

__all__ = [
    "random_nvfp4_moe_weights",
    "k3_like_nvfp4_moe_weights",
    "random_routing",
    "kimi_routing",
    "sigmoid_topk_routing",
    "realistic_hidden_states",
]

# Fixed seed of the per-expert selection bias of kimi_routing: the same experts are hot for
# every batch size of one run, as with a real router.
_KIMI_BIAS_SEED = 12345


# --------------------------------------------------------------------------------------------
# Weights


def random_nvfp4_moe_weights(
    E: int,
    H: int,
    I: int,
    *,
    device: torch.device | str = "cpu",
    seed: int = 0,
    block_scales: str = "pow2",
    scale_exp_range: tuple[int, int] = (-3, 2),
    distinct_gate_up_scale_2: bool = True,
) -> NVFP4MoEWeights:
    """E experts, hidden H, intermediate I (multiples of 16): uniform random E2M1 nibbles,
    E4M3 block scales, scale_2 around 1/8..1/4 divided by sqrt(fan_in)/8, so that outputs stay
    O(1) for O(1) inputs.

    block_scales: "pow2" = 2^k, k uniform in ``scale_exp_range`` (mantissa bits 0);
    "uniform" = uniform in [0.5, 2) rounded to E4M3 (every mantissa pattern: exercises the
    scale decode fully). distinct_gate_up_scale_2: gate and up get different scale_2 (the
    per-half scaling before the activation), else one shared value (what marlin requires).
    """
    if block_scales not in ("pow2", "uniform"):
        raise ValueError(f"block_scales: expected 'pow2' or 'uniform', got {block_scales!r}")
    g = torch.Generator().manual_seed(seed)

    def nibbles(*shape: int) -> torch.Tensor:
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)

    def scales(*shape: int) -> torch.Tensor:
        if block_scales == "uniform":
            return (0.5 + 1.5 * torch.rand(shape, generator=g)).to(torch.float8_e4m3fn)
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


def random_mxfp4_tensors(E: int, H: int, I: int, *, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random MXFP4 experts as the release stores them (CPU): (w13 uint8 [E, 2I, H/2], its E8M0
    bytes [E, 2I, H/32], w2 uint8 [E, H, I/2], E8M0 [E, H, I/32]); exponents around 2^-6, so that
    outputs of N(0, 1) inputs stay O(1). NVFP4MoEWeights.from_mxfp4 casts them bit-exactly, and
    both FP4 tensor-core modes can run the result (its E8M0 scales are recoverable)."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randint(0, 256, (E, 2 * I, H // 2), dtype=torch.uint8, generator=g)
    w2 = torch.randint(0, 256, (E, H, I // 2), dtype=torch.uint8, generator=g)
    e13 = torch.randint(118, 124, (E, 2 * I, H // 32), dtype=torch.uint8, generator=g)
    e2 = torch.randint(119, 125, (E, H, I // 32), dtype=torch.uint8, generator=g)
    return w13, e13, w2, e2


def _quantize_pow2_nvfp4(w: torch.Tensor):
    """float32 [R, C] -> (packed uint8 [R, C/2], e4m3 [R, C/16], scale_2 float32 0-dim), with the
    scale structure of the K3 cast: block scale 2^(k - m), scale_2 = 2^m, m = k_max - 8 (k_max
    over all rows: the rows share the one scale_2), where 2^k is the smallest power of two >=
    block amax / 6 (so no element saturates)."""
    R, C = w.shape
    blocks = w.view(R, C // 16, 16)
    amax = blocks.abs().amax(-1).clamp(min=2.0**-60)
    k = torch.ceil(torch.log2(amax / 6.0)).to(torch.int32)
    kmax = int(k.max())
    m = kmax - 8
    kk = (k - m).clamp(min=-9)  # blocks > 17 binades below the max lose precision, like out-of-range casts
    scale = formats.exp2_to_e4m3(kk, "synthetic weight_scale")
    codes = formats.float_to_e2m1(blocks / torch.exp2(kk.float() + m)[..., None]).view(R, C)
    return formats.pack_e2m1(codes), scale, torch.tensor(2.0**m, dtype=torch.float32)


def k3_like_nvfp4_moe_weights(
    E: int, H: int, I: int, *, device: torch.device | str = "cpu", seed: int = 0
) -> NVFP4MoEWeights:
    """The W4A16 weights of :func:`k3_like_modelopt_tensors` (same arguments), on ``device``."""
    return NVFP4MoEWeights.from_modelopt(*k3_like_modelopt_tensors(E, H, I, seed=seed)).to(device)


def k3_like_modelopt_tensors(E: int, H: int, I: int, *, seed: int = 0) -> ModelOptMoETensors:
    """E experts, hidden H, intermediate I (positive multiples of 16) with K3's structure, as the
    ModelOpt checkpoint tensors (CPU): Gaussian weights (std 1/sqrt(fan_in), per-row log-normal
    spread) quantized with power-of-two E4M3 scales as the bit-exact cast produces them, and one
    scale_2 shared by gate and up of an expert (w13_scale_2[:, 0] == w13_scale_2[:, 1], what
    marlin requires)."""
    if H % 16 or I % 16 or min(E, H, I) <= 0:
        raise ValueError(f"hidden ({H}) and intermediate ({I}) must be positive multiples of 16, experts ({E}) > 0")
    g = torch.Generator().manual_seed(seed)
    w13q, w13s, w13s2, w2q, w2s, w2s2 = [], [], [], [], [], []
    for _ in range(E):
        w13 = torch.randn(2 * I, H, generator=g) / H**0.5 * torch.exp(0.3 * torch.randn(2 * I, 1, generator=g))
        w2 = torch.randn(H, I, generator=g) / I**0.5 * torch.exp(0.3 * torch.randn(H, 1, generator=g))
        # gate and up rows quantized together: the two halves share one scale_2
        p, s, s2 = _quantize_pow2_nvfp4(w13)
        w13q.append(p), w13s.append(s), w13s2.append(torch.stack([s2, s2]))
        p, s, s2 = _quantize_pow2_nvfp4(w2)
        w2q.append(p), w2s.append(s), w2s2.append(s2)
    return ModelOptMoETensors(*(torch.stack(t) for t in (w13q, w13s, w13s2, w2q, w2s, w2s2)))


# --------------------------------------------------------------------------------------------
# Routing


def _local_ids(ids: torch.Tensor, local_experts: range | None) -> torch.Tensor:
    """Global expert ids -> this rank's ids (int32): ``local_experts[j]`` becomes j, the rest -1."""
    if local_experts is None:
        return ids.to(torch.int32)
    if local_experts.step != 1:
        raise ValueError(f"local_experts: expected a contiguous range, got {local_experts}")
    local = ids - local_experts.start
    return torch.where((local >= 0) & (local < len(local_experts)), local, torch.full_like(local, -1)).to(torch.int32)


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
    token (repeats only when k exceeds the expert count) drawn uniformly from num_global_experts
    (default num_experts); global ids >= num_experts become -1, as an expert-parallel rank
    holding experts [0, num_experts) sees them."""
    g = torch.Generator().manual_seed(seed)
    n_global = num_global_experts or num_experts
    if top_k <= n_global:
        ids = torch.rand(M, n_global, generator=g).topk(top_k, dim=1).indices
    else:  # more slots than experts: repeats are unavoidable (and legal)
        ids = torch.randint(0, n_global, (M, top_k), generator=g)
    ids = _local_ids(ids, range(num_experts))
    w = torch.rand(M, top_k, generator=g) + 0.1
    w = (w / w.sum(dim=1, keepdim=True)).float()
    return w.to(device), ids.to(device)


def sigmoid_topk_routing(
    logits: torch.Tensor, bias: torch.Tensor, top_k: int, *, local_experts: range | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """K3 (DeepSeek-V3 style) routing: scores = sigmoid(logits [M, G]); the top_k distinct
    experts of scores + bias [G] are chosen (the bias steers selection only); weights = the
    chosen scores renormalised to sum 1. Returns (topk_weights float32 [M, k], topk_ids int32
    [M, k]); with ``local_experts`` (this rank's contiguous global range) ids are local and
    experts outside it are -1."""
    scores = torch.sigmoid(logits.float())
    chosen = torch.topk(scores + bias, top_k, dim=-1).indices
    weights = scores.gather(1, chosen)
    weights = weights / weights.sum(-1, keepdim=True)
    return weights.float().contiguous(), _local_ids(chosen, local_experts).contiguous()


def kimi_routing(
    M: int,
    top_k: int,
    num_experts: int,
    *,
    local_experts: range | None = None,
    skew: float = 1.0,
    device: torch.device | str = "cpu",
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`sigmoid_topk_routing` over ``num_experts`` (global) experts with standard normal
    router logits and a fixed per-expert bias of std ``skew`` (the same hot experts for every
    seed and M). local_experts: this rank's range of global ids (default: all, no -1)."""
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k}: must lie in [1, num_experts={num_experts}]")
    bias = skew * torch.randn(num_experts, generator=torch.Generator().manual_seed(_KIMI_BIAS_SEED))
    logits = torch.randn(M, num_experts, generator=torch.Generator().manual_seed(seed))
    w, ids = sigmoid_topk_routing(logits, bias, top_k, local_experts=local_experts)
    return w.to(device), ids.to(device)


# --------------------------------------------------------------------------------------------
# Activations


def realistic_hidden_states(M: int, H: int, generator: torch.Generator) -> tuple[torch.Tensor, int]:
    """float32 [M, H] with the statistics of a post-RMSNorm transformer residual stream:
    heavy-tailed values (Student-t, 5 dof), log-normal per-channel scales, max(1, H // 512)
    outlier channels (x20), each row RMS-normalised to 1. Draws from ``generator`` (CPU).
    Returns (hidden states, number of outlier channels)."""
    z = _student_t(M, H, 5, generator)
    chan = torch.exp(0.5 * torch.randn(H, generator=generator))
    n_out = max(1, H // 512)
    chan[torch.randperm(H, generator=generator)[:n_out]] *= 20.0
    x = z * chan
    return x / x.pow(2).mean(-1, keepdim=True).sqrt(), n_out


def _student_t(m: int, n: int, dof: int, g: torch.Generator) -> torch.Tensor:
    # t = N / sqrt(chi2_dof / dof), chi2 from a sum of squared normals (integer dof) - seeded via g.
    normal = torch.randn(m, n, generator=g)
    chi2 = torch.randn(dof, m, n, generator=g).pow(2).sum(0)
    return normal / (chi2 / dof).sqrt()
