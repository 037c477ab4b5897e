"""Inputs of the layer A/B: synthetic K3-structured NVFP4 experts, realistic routed hidden
states, and saved activation files. Everything is seeded and CPU-generated (same numbers on
every machine), then moved to the target device."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import InputError


@dataclass
class ModelOptExperts:
    """SGLang's ModelOpt NVFP4 MoE tensors of E local experts plus the activation facts."""

    w13: torch.Tensor  # uint8 [E, 2I, H/2], gate rows then up rows
    w13_scale: torch.Tensor  # float8_e4m3fn [E, 2I, H/16]
    w13_scale_2: torch.Tensor  # float32 [E, 2] (gate, up)
    w2: torch.Tensor  # uint8 [E, H, I/2]
    w2_scale: torch.Tensor  # float8_e4m3fn [E, H, I/16]
    w2_scale_2: torch.Tensor  # float32 [E]
    activation: str = "situ"
    situ_beta: float = 4.0
    situ_linear_beta: float | None = 25.0
    top_k: int = 4
    routed_scaling_factor: float = 1.0
    source: str = "synthetic"

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.w2.shape[1]

    @property
    def intermediate_size(self) -> int:
        return self.w2.shape[2] * 2

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.w13, self.w13_scale, self.w13_scale_2, self.w2, self.w2_scale, self.w2_scale_2


def _quantize_pow2_nvfp4(w: torch.Tensor, exp_max_shared: torch.Tensor | None = None):
    """float32 [R, C] -> (packed uint8 [R, C/2], e4m3 [R, C/16], scale_2 float32 0-dim), with the
    scale structure of the K3 cast: block scale 2^(k - m), scale_2 = 2^m, m = k_max - 8, where
    2^k is the smallest power of two >= block amax / 6 (so no element saturates)."""
    from k3nvfp4.kernels import formats

    R, C = w.shape
    blocks = w.view(R, C // 16, 16)
    amax = blocks.abs().amax(-1).clamp(min=2.0**-60)
    k = torch.ceil(torch.log2(amax / 6.0)).to(torch.int32)
    kmax = int(k.max()) if exp_max_shared is None else int(exp_max_shared)
    m = kmax - 8
    kk = (k - m).clamp(min=-9)  # blocks > 17 binades below the max lose precision, like out-of-range casts
    scale = formats.exp2_to_e4m3(kk, "synthetic weight_scale")
    codes = formats.float_to_e2m1(blocks / torch.exp2(kk.float() + m)[..., None]).view(R, C)
    return formats.pack_e2m1(codes), scale, torch.tensor(2.0**m, dtype=torch.float32)


def synthetic_experts(num_experts: int = 8, hidden_size: int = 256, intermediate_size: int = 128, *,
                      top_k: int = 4, seed: int = 0) -> ModelOptExperts:
    """Random NVFP4 experts with K3's structure: Gaussian weights (std 1/sqrt(fan_in), per-row
    log-normal spread), power-of-two scales as the bit-exact cast produces them, one scale_2
    shared by gate and up of an expert (what marlin requires). H, I multiples of 16."""
    E, H, I = num_experts, hidden_size, intermediate_size
    if H % 16 or I % 16 or min(E, H, I) <= 0:
        raise InputError(f"--synthetic: hidden ({H}) and intermediate ({I}) must be positive multiples of 16, experts ({E}) > 0")
    if not 1 <= top_k <= E:
        raise InputError(f"--top-k {top_k} must lie in [1, experts={E}]")
    g = torch.Generator().manual_seed(seed)
    w13q, w13s, w13s2, w2q, w2s, w2s2 = [], [], [], [], [], []
    for _ in range(E):
        w13 = torch.randn(2 * I, H, generator=g) / H**0.5 * torch.exp(0.3 * torch.randn(2 * I, 1, generator=g))
        w2 = torch.randn(H, I, generator=g) / I**0.5 * torch.exp(0.3 * torch.randn(H, 1, generator=g))
        kmax13 = torch.ceil(torch.log2(w13.view(2 * I, H // 16, 16).abs().amax(-1) / 6.0)).max()
        p, s, s2 = _quantize_pow2_nvfp4(w13, kmax13)
        w13q.append(p), w13s.append(s), w13s2.append(torch.stack([s2, s2]))
        p, s, s2 = _quantize_pow2_nvfp4(w2)
        w2q.append(p), w2s.append(s), w2s2.append(s2)
    return ModelOptExperts(torch.stack(w13q), torch.stack(w13s), torch.stack(w13s2), torch.stack(w2q),
                           torch.stack(w2s), torch.stack(w2s2), top_k=top_k,
                           source=f"synthetic E={E} H={H} I={I} seed={seed}")


def load_checkpoint_experts(ckpt: Path, layer: int | None, num_experts: int | None) -> ModelOptExperts:
    """Routed experts of `layer` (the first `num_experts` of them, default all) from an NVFP4 checkpoint."""
    from k3nvfp4.checkpoint.layer import load_moe_layer_nvfp4

    ckpt = Path(ckpt)
    if layer is None:
        raise InputError("--ckpt needs --layer N (the MoE layer to compare)")
    if not ckpt.is_dir():
        raise InputError(f"--ckpt: checkpoint directory not found: {ckpt}")
    experts = list(range(num_experts)) if num_experts else None
    try:
        t = load_moe_layer_nvfp4(ckpt, layer, experts)
    except (FileNotFoundError, KeyError, ValueError, OSError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        raise InputError(f"--ckpt {ckpt} --layer {layer}: {msg}") from None
    act = t.hidden_act or "silu"
    if act not in ("situ", "silu"):
        raise InputError(f"{ckpt}: hidden_act {act!r} is not supported (situ or silu)")
    return ModelOptExperts(t.w13, t.w13_scale, t.w13_scale_2, t.w2, t.w2_scale, t.w2_scale_2, activation=act,
                           situ_beta=t.situ_beta if t.situ_beta is not None else 4.0,
                           situ_linear_beta=t.situ_linear_beta, top_k=t.top_k,
                           routed_scaling_factor=t.routed_scaling_factor,
                           source=f"{ckpt} layer {layer} experts {t.experts[0]}..{t.experts[-1]} ({len(t.experts)})")


@dataclass
class RoutedInputs:
    hidden_states: torch.Tensor  # [M, H] activation dtype
    topk_ids: torch.Tensor  # int32 [M, k], local expert ids
    topk_weights: torch.Tensor  # float32 [M, k]
    source: str


def realistic_routed_inputs(tokens: int, hidden_size: int, num_experts: int, top_k: int, *, seed: int = 0,
                            dtype: torch.dtype = torch.bfloat16) -> RoutedInputs:
    """Hidden states with the statistics of a post-RMSNorm transformer residual stream:
    heavy-tailed values (Student-t, 5 dof), log-normal per-channel scales, a few outlier
    channels (x20), each row RMS-normalised to 1. Routing as K3 (DeepSeek-V3 style): sigmoid
    scores of a random router, per-expert bias added for the top-k selection only, weights =
    the selected scores renormalised to sum 1."""
    M, H, E = tokens, hidden_size, num_experts
    if M <= 0:
        raise InputError(f"--tokens must be > 0, got {M}")
    g = torch.Generator().manual_seed(seed + 1_000_003)
    z = _student_t(M, H, 5.0, g)
    chan = torch.exp(0.5 * torch.randn(H, generator=g))
    n_out = max(1, H // 512)
    chan[torch.randperm(H, generator=g)[:n_out]] *= 20.0
    x = z * chan
    x = x / x.pow(2).mean(-1, keepdim=True).sqrt()
    router = torch.randn(H, E, generator=g) / H**0.5 * 2.0
    scores = torch.sigmoid(x @ router)
    bias = 0.1 * torch.randn(E, generator=g)
    ids = torch.topk(scores + bias, top_k, dim=-1).indices
    w = torch.gather(scores, 1, ids)
    w = w / w.sum(-1, keepdim=True)
    return RoutedInputs(x.to(dtype), ids.to(torch.int32), w.float(),
                        f"synthetic M={M} seed={seed} (Student-t(5), log-normal channels, {n_out} outlier ch, RMS 1; sigmoid+bias top-{top_k})")


def _student_t(m: int, n: int, dof: float, g: torch.Generator) -> torch.Tensor:
    # t = N / sqrt(chi2_dof / dof), chi2 from a sum of squared normals (integer dof) - seeded via g.
    normal = torch.randn(m, n, generator=g)
    chi2 = torch.randn(int(dof), m, n, generator=g).pow(2).sum(0)
    return normal / (chi2 / dof).sqrt()


def load_activations(path: Path, hidden_size: int, num_experts: int, dtype: torch.dtype) -> RoutedInputs:
    """Read hidden_states [M, H], topk_ids [M, k], topk_weights [M, k] from .pt or .safetensors."""
    path = Path(path)
    if not path.is_file():
        raise InputError(f"--activations: file not found: {path}")
    try:
        if path.suffix == ".safetensors":
            from safetensors.torch import load_file

            d = load_file(str(path))
        else:
            d = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any reader failure is a bad input file
        raise InputError(f"--activations {path}: cannot read ({type(e).__name__}: {e})") from None
    if not isinstance(d, dict):
        raise InputError(f"--activations {path}: expected a dict of tensors, got {type(d).__name__}")
    for key in ("hidden_states", "topk_ids", "topk_weights"):
        if key not in d or not isinstance(d[key], torch.Tensor):
            raise InputError(f"--activations {path}: missing tensor '{key}' (has {sorted(d)})")
    x, ids, w = d["hidden_states"], d["topk_ids"], d["topk_weights"]
    if x.dim() != 2 or x.shape[1] != hidden_size:
        raise InputError(f"--activations {path}: hidden_states shape {tuple(x.shape)}, expected [M, {hidden_size}]")
    if ids.shape != w.shape or ids.dim() != 2 or ids.shape[0] != x.shape[0]:
        raise InputError(f"--activations {path}: topk_ids {tuple(ids.shape)} / topk_weights {tuple(w.shape)} "
                         f"must both be [M={x.shape[0]}, k]")
    if ids.dtype.is_floating_point or (ids.numel() and int(ids.max()) >= num_experts):
        raise InputError(f"--activations {path}: topk_ids must be integer ids < {num_experts} (-1 = not local)")
    return RoutedInputs(x.to(dtype), ids.to(torch.int32), w.float(), f"{path}")
