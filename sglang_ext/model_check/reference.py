"""Plain-torch reference of one Kimi-K3 MoE block, straight from the checkpoint tensors.

Independent of SGLang's modules and of this project's kernels: NVFP4 and MXFP4 are decoded
from the E2M1 table and the E4M3 / E8M0 scales by hand, everything is computed in fp32 from the stored values.
The block (K3 latent MoE, docs/facts.md#kimi-k3-routed-experts):

    router   scores = sigmoid(x @ gate^T); selection on scores + e_score_correction_bias
             (grouped top-k when num_expert_group > 1); weights = the selected scores,
             renormalised, times routed_scaling_factor
    routed   latent = x @ routed_expert_down_proj^T  [T, H]  (RMSNorm if latent_moe_use_norm)
             y = sum_k w_k * W2_e @ act(W1_e @ latent, W3_e @ latent);  out = y @ routed_expert_up_proj^T
    shared   down @ act(gate @ x, up @ x)
    out      routed + shared

with act = SiTU (beta, linear_beta) or SiLU-and-mul.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

# E2M1 codes 0..7 (bit 3 is the sign).
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32


def dequant_nvfp4(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """uint8 [R, K/2] (low nibble = even element), float8_e4m3fn [R, K/16], fp32 scalar -> fp32 [R, K]."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()
    return table[codes] * scale.float().repeat_interleave(NVFP4_BLOCK, dim=-1) * scale_2.float()


def dequant_mxfp4(packed: torch.Tensor, e8m0: torch.Tensor) -> torch.Tensor:
    """uint8 [R, K/2] (low nibble = even element), uint8 E8M0 [R, K/32] (2^(e - 127); 255 = NaN)
    -> fp32 [R, K]."""
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()
    e = e8m0.view(torch.uint8).to(torch.float64)
    scale = torch.where(e == 255, torch.nan, torch.pow(2.0, e - 127)).float()
    return table[codes] * scale.repeat_interleave(MXFP4_BLOCK, dim=-1)


@dataclass(frozen=True)
class BlockConfig:
    """The config facts the block uses (from text_config)."""

    hidden_act: str
    situ_beta: float | None
    situ_linear_beta: float | None
    top_k: int
    renormalize: bool
    routed_scaling_factor: float
    num_expert_group: int
    topk_group: int
    scoring: str
    latent_norm_eps: float | None  # None: no latent RMSNorm

    @classmethod
    def from_text_config(cls, text: dict) -> "BlockConfig":
        def need(key: str):
            if key not in text:
                raise KeyError(f"config.json text_config has no {key!r} (needed by the MoE block reference)")
            return text[key]

        act = need("hidden_act")
        if act == "situ" and text.get("activation_situ_beta") is None:
            raise KeyError("config.json text_config: hidden_act 'situ' without activation_situ_beta")
        scoring = text.get("moe_router_activation_func", "sigmoid")
        if scoring != "sigmoid":
            raise ValueError(f"moe_router_activation_func {scoring!r}: the reference implements K3's sigmoid router")
        return cls(
            hidden_act=act,
            situ_beta=text.get("activation_situ_beta"),
            situ_linear_beta=text.get("activation_situ_linear_beta"),
            top_k=int(text["num_experts_per_token"] if "num_experts_per_token" in text else need("num_experts_per_tok")),
            renormalize=bool(text.get("moe_renormalize", True)),
            routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0)),
            num_expert_group=int(text.get("num_expert_group") or 1),
            topk_group=int(text.get("topk_group") or 1),
            scoring=scoring,
            latent_norm_eps=float(text.get("rms_norm_eps", 1e-6)) if text.get("latent_moe_use_norm") else None,
        )

    def act(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        if self.hidden_act == "situ":
            beta, lb = float(self.situ_beta), self.situ_linear_beta

            def situ(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
                g = beta * torch.tanh(g / beta) * torch.sigmoid(g)
                if lb is not None:
                    u = lb * torch.tanh(u / lb)
                return g * u

            return situ
        if self.hidden_act == "silu":
            return lambda g, u: torch.nn.functional.silu(g) * u
        raise ValueError(f"hidden_act {self.hidden_act!r}: the reference implements situ and silu")


@dataclass
class Routing:
    ids: torch.Tensor  # int64 [T, k]
    weights: torch.Tensor  # fp32 [T, k], routed_scaling_factor included
    scores: torch.Tensor  # fp32 [T, E] sigmoid scores
    selection: torch.Tensor  # fp32 [T, E] scores + bias, -inf outside the chosen groups


def route(logits: torch.Tensor, bias: torch.Tensor, cfg: BlockConfig, scale: float | None = None) -> Routing:
    """K3's router on fp32 logits [T, E]; ``scale`` overrides routed_scaling_factor."""
    scores = torch.sigmoid(logits.float())
    sel = scores + bias.float()
    T, E = sel.shape
    if cfg.num_expert_group > 1:
        groups = sel.view(T, cfg.num_expert_group, E // cfg.num_expert_group)
        group_score = groups.topk(2, dim=-1).values.sum(-1)
        keep = torch.zeros_like(group_score, dtype=torch.bool)
        keep.scatter_(1, group_score.topk(cfg.topk_group, dim=-1).indices, True)
        sel = sel.masked_fill(~keep.repeat_interleave(E // cfg.num_expert_group, dim=1), float("-inf"))
    ids = sel.topk(cfg.top_k, dim=-1).indices
    return Routing(ids, weights_for(scores, ids, cfg, scale), scores, sel)


def weights_for(scores: torch.Tensor, ids: torch.Tensor, cfg: BlockConfig, scale: float | None = None) -> torch.Tensor:
    """Routing weights of the experts ``ids`` [T, k] (renormalised, times the scaling factor)."""
    w = scores.gather(1, ids)
    if cfg.renormalize:
        w = w / w.sum(-1, keepdim=True)
    return w * (cfg.routed_scaling_factor if scale is None else scale)


@dataclass
class BlockTensors:
    """The checkpoint tensors of one MoE block (full, unsharded); experts decoded on demand."""

    gate: torch.Tensor  # [E, D]
    bias: torch.Tensor  # [E]
    down: torch.Tensor  # routed_expert_down_proj [H, D]
    up: torch.Tensor  # routed_expert_up_proj [D, H]
    latent_norm: torch.Tensor | None  # [H]
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None  # gate [S, D], up [S, D], down [D, S]
    expert: Callable[[int], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]  # e -> fp32 w1 [I,H], w3, w2 [H,I]


def block_reference(x: torch.Tensor, t: BlockTensors, cfg: BlockConfig, routing: Routing) -> dict[str, torch.Tensor]:
    """fp32 outputs of the block for hidden states ``x`` [T, D] under ``routing``:
    {"out", "routed", "shared"} ([T, D] each)."""
    act = cfg.act()
    x = x.float()
    latent = x @ t.down.float().T
    if t.latent_norm is not None:
        latent = latent * torch.rsqrt(latent.pow(2).mean(-1, keepdim=True) + cfg.latent_norm_eps) * t.latent_norm.float()
    y = torch.zeros_like(latent)
    cache: dict[int, tuple] = {}
    for tok in range(x.shape[0]):
        for j in range(routing.ids.shape[1]):
            e = int(routing.ids[tok, j])
            if e not in cache:
                cache[e] = t.expert(e)
            w1, w3, w2 = cache[e]
            h = act(w1 @ latent[tok], w3 @ latent[tok])
            y[tok] += routing.weights[tok, j] * (w2 @ h)
    routed = y @ t.up.float().T
    shared = torch.zeros_like(routed)
    if t.shared is not None:
        g, u, d = (w.float() for w in t.shared)
        shared = act(x @ g.T, x @ u.T) @ d.T
    return {"out": routed + shared, "routed": routed, "shared": shared}
