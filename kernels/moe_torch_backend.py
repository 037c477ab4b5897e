"""The ``torch_reference`` MoE backend's math: the served gated MoE in plain torch, read straight
from the checkpoint's tensors as SGLang loaded them.

Slow but exact, and independent of the Triton kernels: no kernel layout, no Triton, and none of
the project's decode code (``formats.py``, ``moe_details/``). Its own decode:

- E2M1 nibbles through the 16-entry table below (LOW nibble = EVEN element, bit 3 the sign);
- E4M3 block scales through torch's ``float8_e4m3fn`` dtype, E8M0 through ``float8_e8m0fnu``
  (2^(byte - 127); byte 0 is 2^-127, byte 255 NaN and refused at construction);
- NVFP4 (ModelOpt): value = e2m1 x e4m3(weight_scale per 16) x weight_scale_2, the gate rows
  (w1) with the gate's scale_2 and the up rows (w3) with the up's, BEFORE the activation
  (SiTU is nonlinear); MXFP4 (the release): value = e2m1 x 2^(e8m0 - 127) per 32.

Per call, for each local expert e that some (token, slot) routes to (SGLang's top-k output as
served; ids outside [0, E), e.g. EP's -1, contribute nothing):
  h = x @ W13[e]^T in fp32; a = act(h[:, :I], h[:, I:]) in fp32 (torch.tanh / torch.sigmoid),
  rounded to x's dtype (the intermediate every SGLang runner keeps in the activation dtype);
  y = a @ W2[e]^T in fp32; out = (sum over slots of topk_weight x y, fp32) x routed_scaling_factor,
  cast to x's dtype once.
Experts are dequantized to fp32 on each call (only the routed ones): nothing is cached, so the
memory cost is one expert's dense fp32 matrices at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .activation import K3_SITU, ActivationKind, GatedActivation, as_gated_activation

# E2M1 values by code 0..15: magnitudes 0, 0.5, 1, 1.5, 2, 3, 4, 6; codes 8..15 are negative.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # fmt: skip
NVFP4_GROUP = 16  # elements per E4M3 weight_scale
MXFP4_GROUP = 32  # elements per E8M0 weight_scale
E8M0_NAN_BYTE = 255


# --- decode ------------------------------------------------------------------------------------


def decode_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] (two E2M1 codes per byte, low nibble first) -> float32 [..., n]."""
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    codes = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2)
    return table[codes.long()]


def decode_e4m3(scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn (or its uint8 bits) [...] -> float32 [...] (torch's own conversion)."""
    if scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e4m3fn)
    return scale.to(torch.float32)


def decode_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes uint8 [...] -> float32 2^(byte - 127) [...] (torch's float8_e8m0fnu)."""
    return scale.view(torch.float8_e8m0fnu).to(torch.float32)


def _blocks(values: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """values fp32 [rows, K] x per-group scale fp32 [rows, K/group] -> fp32 [rows, K]."""
    return values * scale.repeat_interleave(group, dim=-1)


# --- expert weights as loaded ------------------------------------------------------------------


def _require(t: torch.Tensor, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name}: expected a tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {t.dtype}")
    if tuple(t.shape) != shape:
        raise ValueError(f"{name}: expected shape {shape}, got {tuple(t.shape)}")


def _expert_sizes(w13: torch.Tensor, group: int) -> tuple[int, int, int]:
    """(E, I, H) of packed w13 uint8 [E, 2I, H/2]; I and H must be multiples of the scale group."""
    if not isinstance(w13, torch.Tensor) or w13.dim() != 3:
        raise ValueError(f"w13_weight: expected uint8 [E, 2I, H/2], got {getattr(w13, 'shape', None)}")
    E, two_i, half_h = w13.shape
    I, H = two_i // 2, half_h * 2
    if two_i % 2 or I % group or H % group:
        raise ValueError(f"w13_weight: shape {tuple(w13.shape)} is not [E, 2I, H/2] with I, H multiples of {group}")
    return E, I, H


class _PackedExperts:
    """What both checkpoint formats' experts answer from their packed w13 [E, 2I, H/2]."""

    w13: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.w13.shape[0]

    @property
    def intermediate_size(self) -> int:
        return self.w13.shape[1] // 2


@dataclass(frozen=True)
class ModelOptNVFP4Experts(_PackedExperts):
    """One layer's local experts in SGLang's ModelOpt NVFP4 parameters (linear block scales).

    w13: uint8 [E, 2I, H/2] (gate rows then up rows); w13_scale: float8_e4m3fn [E, 2I, H/16];
    w13_scale_2: float32 [E, 2] (gate, up) or [E] (shared); w2: uint8 [E, H, I/2];
    w2_scale: float8_e4m3fn [E, H, I/16]; w2_scale_2: float32 [E].
    """

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w13_scale_2: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor
    w2_scale_2: torch.Tensor

    def __post_init__(self) -> None:
        E, I, H = _expert_sizes(self.w13, NVFP4_GROUP)
        _require(self.w13, "w13_weight", torch.uint8, (E, 2 * I, H // 2))
        _require(self.w13_scale, "w13_weight_scale", torch.float8_e4m3fn, (E, 2 * I, H // NVFP4_GROUP))
        s2_shape = (E, 2) if self.w13_scale_2.dim() == 2 else (E,)
        _require(self.w13_scale_2, "w13_weight_scale_2", torch.float32, s2_shape)
        _require(self.w2, "w2_weight", torch.uint8, (E, H, I // 2))
        _require(self.w2_scale, "w2_weight_scale", torch.float8_e4m3fn, (E, H, I // NVFP4_GROUP))
        _require(self.w2_scale_2, "w2_weight_scale_2", torch.float32, (E,))
        for name, t in (("w13_weight_scale", self.w13_scale), ("w2_weight_scale", self.w2_scale)):
            if torch.isnan(t.to(torch.float32)).any():
                raise ValueError(f"{name}: contains E4M3 NaN block scales; the checkpoint is corrupt")
        for name, t in (("w13_weight_scale_2", self.w13_scale_2), ("w2_weight_scale_2", self.w2_scale_2)):
            if not torch.isfinite(t).all():
                raise ValueError(f"{name}: contains non-finite values")

    def dense_expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ``e`` in fp32: w13 [2I, H] (gate rows x gate scale_2, up rows x up scale_2), w2 [H, I]."""
        I = self.intermediate_size
        w13 = _blocks(decode_e2m1(self.w13[e]), decode_e4m3(self.w13_scale[e]), NVFP4_GROUP)
        s2 = self.w13_scale_2[e].to(torch.float32).reshape(-1)
        gate_s2, up_s2 = (s2[0], s2[1]) if s2.numel() == 2 else (s2[0], s2[0])
        w13 = torch.cat([w13[:I] * gate_s2, w13[I:] * up_s2])
        w2 = _blocks(decode_e2m1(self.w2[e]), decode_e4m3(self.w2_scale[e]), NVFP4_GROUP)
        return w13, w2 * self.w2_scale_2[e].to(torch.float32)


@dataclass(frozen=True)
class MXFP4Experts(_PackedExperts):
    """One layer's local experts as released (compressed-tensors MXFP4, as SGLang loads them).

    w13: uint8 [E, 2I, H/2] (w1 rows then w3 rows); w13_scale: uint8 E8M0 [E, 2I, H/32];
    w2: uint8 [E, H, I/2]; w2_scale: uint8 E8M0 [E, H, I/32].
    """

    w13: torch.Tensor
    w13_scale: torch.Tensor
    w2: torch.Tensor
    w2_scale: torch.Tensor

    def __post_init__(self) -> None:
        E, I, H = _expert_sizes(self.w13, MXFP4_GROUP)
        _require(self.w13, "w13_weight", torch.uint8, (E, 2 * I, H // 2))
        _require(self.w13_scale, "w13_weight_scale", torch.uint8, (E, 2 * I, H // MXFP4_GROUP))
        _require(self.w2, "w2_weight", torch.uint8, (E, H, I // 2))
        _require(self.w2_scale, "w2_weight_scale", torch.uint8, (E, H, I // MXFP4_GROUP))
        for name, t in (("w13_weight_scale", self.w13_scale), ("w2_weight_scale", self.w2_scale)):
            n = int((t == E8M0_NAN_BYTE).sum())
            if n:
                raise ValueError(f"{name}: {n} E8M0 scale byte(s) are 255 (NaN); the checkpoint is corrupt")

    def dense_expert(self, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Expert ``e`` in fp32: w13 [2I, H], w2 [H, I]."""
        w13 = _blocks(decode_e2m1(self.w13[e]), decode_e8m0(self.w13_scale[e]), MXFP4_GROUP)
        w2 = _blocks(decode_e2m1(self.w2[e]), decode_e8m0(self.w2_scale[e]), MXFP4_GROUP)
        return w13, w2


Experts = ModelOptNVFP4Experts | MXFP4Experts


# --- the MoE -----------------------------------------------------------------------------------


def gated_activation(gate: torch.Tensor, up: torch.Tensor, activation: GatedActivation) -> torch.Tensor:
    """fp32 [..., I] x2 -> fp32 [..., I]. situ: beta tanh(g/beta) sigmoid(g) x (linear_beta
    tanh(u/linear_beta), or u when None); silu: g sigmoid(g) u. Written here again (not
    kernels/situ.py) so that this backend shares no math with what it checks."""
    act = as_gated_activation(activation)
    g, u = gate.to(torch.float32), up.to(torch.float32)
    if act.kind is ActivationKind.SITU:
        g_act = act.beta * torch.tanh(g / act.beta) * torch.sigmoid(g)
        if act.linear_beta is not None:
            u = act.linear_beta * torch.tanh(u / act.linear_beta)
    else:
        g_act = g * torch.sigmoid(g)
    return g_act * u


def moe_forward_reference(
    hidden_states: torch.Tensor,
    experts: Experts,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    activation: GatedActivation = K3_SITU,
    routed_scaling_factor: float | None = None,
) -> torch.Tensor:
    """The routed experts' output (see the module docstring for the numerics).

    hidden_states: [M, H] float16 / bfloat16 / float32; topk_weights: [M, K] (any float dtype,
    used in fp32); topk_ids: [M, K] integer local expert ids (outside [0, E): skipped)
    -> [M, H] in hidden_states' dtype.
    """
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states: expected [M, H], got {tuple(hidden_states.shape)}")
    M, H = hidden_states.shape
    if experts.w13.shape[2] * 2 != H:
        raise ValueError(f"hidden_states: hidden size {H} != the experts' {experts.w13.shape[2] * 2}")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != M:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} / topk_weights {tuple(topk_weights.shape)}: "
                         f"expected both [M={M}, K]")
    as_gated_activation(activation)
    dtype, I = hidden_states.dtype, experts.intermediate_size
    x = hidden_states.to(torch.float32)
    ids = topk_ids.to(torch.int64)
    tw = topk_weights.to(torch.float32)
    acc = torch.zeros(M, H, dtype=torch.float32, device=hidden_states.device)
    for e in torch.unique(ids).tolist():  # reference: the host sync is fine
        if not 0 <= e < experts.num_experts:
            continue
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        w13, w2 = experts.dense_expert(e)
        h = x[tok] @ w13.t()
        a = gated_activation(h[:, :I], h[:, I:], activation).to(dtype)
        y = a.to(torch.float32) @ w2.t()
        acc.index_add_(0, tok, y * tw[tok, slot][:, None])
    if routed_scaling_factor is not None:
        acc = acc * routed_scaling_factor
    return acc.to(dtype)
