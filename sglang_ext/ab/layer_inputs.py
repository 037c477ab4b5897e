"""Inputs of the layer A/B: the MoE layer (synthetic K3-structured NVFP4 experts, or one loaded
from a checkpoint, as :class:`NVFP4MoELayer`), realistic routed hidden states, and saved
activation files. Everything is seeded and CPU-generated (same numbers on
every machine), then moved to the target device."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import torch

from k3nvfp4.checkpoint.layer import NVFP4MoELayer, load_moe_layer
from k3nvfp4.kernels.activation import ACTIVATION_NAMES
from k3nvfp4.kernels import NVFP4MoEWeights
from k3nvfp4.kernels.testing import k3_like_modelopt_tensors, realistic_hidden_states, sigmoid_topk_routing

from .errors import InputError


def synthetic_layer(num_experts: int = 8, hidden_size: int = 256, intermediate_size: int = 128, *,
                    top_k: int = 4, seed: int = 0) -> NVFP4MoELayer:
    """A SiTU layer (beta 4, linear beta 25) of random experts with K3's structure
    (:func:`k3nvfp4.kernels.testing.k3_like_modelopt_tensors`, kept as the layer's checkpoint tensors). H, I multiples of 16."""
    E, H, I = num_experts, hidden_size, intermediate_size
    if H % 16 or I % 16 or min(E, H, I) <= 0:
        raise InputError(f"--synthetic: hidden ({H}) and intermediate ({I}) must be positive multiples of 16, experts ({E}) > 0")
    if not 1 <= top_k <= E:
        raise InputError(f"--top-k {top_k} must lie in [1, experts={E}]")
    tensors = k3_like_modelopt_tensors(E, H, I, seed=seed)
    return NVFP4MoELayer(NVFP4MoEWeights.from_modelopt(*tensors), top_k, tuple(range(E)), num_global_experts=E,
                         source=f"synthetic E={E} H={H} I={I} seed={seed}", tensors=tensors)


def load_checkpoint_layer(ckpt: Path, layer: int | None, num_experts: int | None) -> NVFP4MoELayer:
    """Routed experts of `layer` (the first `num_experts` of them, default all) from an NVFP4
    checkpoint or from the MXFP4 release (read directly; the layer also carries their cast)."""
    ckpt = Path(ckpt)
    if layer is None:
        raise InputError("--ckpt needs --layer N (the MoE layer to compare)")
    if not ckpt.is_dir():
        raise InputError(f"--ckpt: checkpoint directory not found: {ckpt}")
    experts = list(range(num_experts)) if num_experts else None
    try:
        t = load_moe_layer(ckpt, layer, experts)
    except (FileNotFoundError, KeyError, ValueError, OSError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else str(e)
        raise InputError(f"--ckpt {ckpt} --layer {layer}: {msg}") from None
    act = t.hidden_act or "silu"
    if act not in ACTIVATION_NAMES:
        raise InputError(f"{ckpt}: hidden_act {act!r} is not supported ({' or '.join(ACTIVATION_NAMES)})")
    return replace(t, hidden_act=act, situ_beta=t.situ_beta if t.situ_beta is not None else 4.0)


@dataclass
class RoutedInputs:
    hidden_states: torch.Tensor  # [M, H] activation dtype
    topk_ids: torch.Tensor  # int32 [M, k], local expert ids
    topk_weights: torch.Tensor  # float32 [M, k]
    source: str


def realistic_routed_inputs(tokens: int, hidden_size: int, num_experts: int, top_k: int, *, seed: int = 0,
                            dtype: torch.dtype = torch.bfloat16) -> RoutedInputs:
    """Hidden states [M, H] in ``dtype`` with post-RMSNorm residual-stream statistics
    (:func:`k3nvfp4.kernels.testing.realistic_hidden_states`), routed as K3 by a random router
    (:func:`k3nvfp4.kernels.testing.sigmoid_topk_routing` of x @ router, random per-expert bias)."""
    M, H, E = tokens, hidden_size, num_experts
    if M <= 0:
        raise InputError(f"--tokens must be > 0, got {M}")
    g = torch.Generator().manual_seed(seed + 1_000_003)
    x, n_out = realistic_hidden_states(M, H, g)
    router = torch.randn(H, E, generator=g) / H**0.5 * 2.0
    bias = 0.1 * torch.randn(E, generator=g)
    w, ids = sigmoid_topk_routing(x @ router, bias, top_k)
    return RoutedInputs(x.to(dtype), ids, w,
                        f"synthetic M={M} seed={seed} (Student-t(5), log-normal channels, {n_out} outlier ch, RMS 1; sigmoid+bias top-{top_k})")


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
