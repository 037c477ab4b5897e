"""One routed-expert MoE layer in NVFP4 (:class:`NVFP4MoELayer`: weights + config facts), and its
loader from a ModelOpt NVFP4 checkpoint."""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from safetensors import safe_open

from ..kernels import NVFP4MoEWeights
from .layout import CONFIG_FILE, INDEX_FILE


@dataclass(frozen=True)
class NVFP4MoELayer:
    """The routed experts of one NVFP4 MoE layer plus the facts ``fused_moe_nvfp4`` needs.

    weights: the E loaded experts (in ``experts`` order) as :class:`NVFP4MoEWeights`
      (w13 uint8 [E, 2I, H/2] gate rows then up rows, w13_scale E4M3 bits [E, 2I, H/16],
      w13_scale_2 float32 [E, 2] (gate, up), w2 uint8 [E, H, I/2], w2_scale [E, H, I/16],
      w2_scale_2 float32 [E]; ``weights.to_modelopt()`` gives SGLang's ModelOpt tensors).
    hidden_act, situ_beta, situ_linear_beta (None = not set / no cap), top_k,
    routed_scaling_factor: the model's text config. experts: global ids of the loaded experts,
    num_global_experts: experts of the whole layer. source: where it came from, for reports.
    """

    weights: NVFP4MoEWeights
    top_k: int
    experts: tuple[int, ...]
    num_global_experts: int
    hidden_act: str = "situ"
    situ_beta: float | None = 4.0
    situ_linear_beta: float | None = 25.0
    routed_scaling_factor: float = 1.0
    layer: int | None = None  # layer number in the checkpoint (None: synthetic)
    source: str = ""

    def activation_kwargs(self) -> dict:
        """activation / situ_beta / situ_linear_beta / routed_scaling_factor keyword arguments of
        ``fused_moe_nvfp4`` (and its reference); an unset situ_beta keeps the kernels' 4.0."""
        kw = dict(activation=self.hidden_act, situ_linear_beta=self.situ_linear_beta,
                  routed_scaling_factor=self.routed_scaling_factor)
        if self.situ_beta is not None:
            kw["situ_beta"] = self.situ_beta
        return kw


def _text_config(ckpt: Path) -> dict:
    cfg = json.loads((ckpt / CONFIG_FILE).read_text())
    return cfg.get("text_config", cfg)


def load_moe_layer_nvfp4(
    ckpt_dir: str | os.PathLike, layer: int, experts: Sequence[int] | None = None
) -> NVFP4MoELayer:
    """Read the routed experts of MoE layer ``layer`` from an NVFP4 checkpoint (as written by
    ``k3nvfp4-cast``), stacked in SGLang's ModelOpt layout, with the layer's config facts. ``experts``: global expert ids to
    load, in this order (default: all of the layer). Each shard is opened once, lazily."""
    ckpt = Path(ckpt_dir)
    index_path = ckpt / INDEX_FILE
    if not index_path.is_file():
        raise FileNotFoundError(f"{index_path}: no safetensors index; is {ckpt} a checkpoint?")
    weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
    text = _text_config(ckpt)

    pat = re.compile(
        rf"^(?P<p>(?:language_model\.)?model\.layers\.{int(layer)}\.block_sparse_moe\.experts)\.(?P<e>\d+)\.w[123]\.weight$"
    )
    found: dict[int, str] = {}
    for name in weight_map:
        m = pat.match(name)
        if m:
            found[int(m["e"])] = m["p"]
    if not found:
        mx = [n for n in weight_map if re.search(rf"\.layers\.{int(layer)}\.block_sparse_moe\.experts\.\d+\.w[123]\.weight_packed$", n)]
        hint = " (it holds MXFP4 weight_packed tensors: cast it with k3nvfp4-cast first)" if mx else ""
        raise KeyError(f"{ckpt}: no NVFP4 routed experts for layer {layer} in {INDEX_FILE}{hint}")
    expert_ids = tuple(sorted(found)) if experts is None else tuple(int(e) for e in experts)
    missing = [e for e in expert_ids if e not in found]
    if missing:
        raise KeyError(f"{ckpt}: layer {layer} has no expert(s) {missing[:8]} (found {len(found)} experts)")

    wanted: list[str] = []
    for e in expert_ids:
        base = f"{found[e]}.{e}"
        for w in ("w1", "w3", "w2"):
            wanted += [f"{base}.{w}.weight", f"{base}.{w}.weight_scale", f"{base}.{w}.weight_scale_2"]
    by_shard: dict[str, list[str]] = defaultdict(list)
    for name in wanted:
        if name not in weight_map:
            raise KeyError(f"{ckpt}: {INDEX_FILE} lacks {name}")
        by_shard[weight_map[name]].append(name)
    got: dict[str, torch.Tensor] = {}
    for shard, names in by_shard.items():
        path = ckpt / shard
        if not path.is_file():
            raise FileNotFoundError(f"{path}: shard named by {INDEX_FILE} is missing")
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            for name in names:
                if name not in keys:
                    raise KeyError(f"{path}: tensor {name} (named by the index) is absent")
                got[name] = f.get_tensor(name)

    def stack(w: str, suffix: str) -> torch.Tensor:
        return torch.stack([got[f"{found[e]}.{e}.{w}.{suffix}"] for e in expert_ids])

    w1, w3 = stack("w1", "weight"), stack("w3", "weight")
    s1, s3 = stack("w1", "weight_scale"), stack("w3", "weight_scale")
    for t, n, dt in ((w1, "w1.weight", torch.uint8), (s1, "w1.weight_scale", torch.float8_e4m3fn)):
        if t.dtype != dt:
            raise TypeError(f"{ckpt}: layer {layer} {n} has dtype {t.dtype}, expected {dt} (ModelOpt NVFP4)")
    weights = NVFP4MoEWeights.from_modelopt(
        torch.cat([w1, w3], dim=1),
        torch.cat([s1, s3], dim=1),
        torch.stack(
            [stack("w1", "weight_scale_2").reshape(-1), stack("w3", "weight_scale_2").reshape(-1)], dim=1
        ).to(torch.float32),
        stack("w2", "weight"),
        stack("w2", "weight_scale"),
        stack("w2", "weight_scale_2").reshape(-1).to(torch.float32),
    )
    return NVFP4MoELayer(
        weights=weights,
        hidden_act=text.get("hidden_act", "silu"),
        situ_beta=text.get("activation_situ_beta"),
        situ_linear_beta=text.get("activation_situ_linear_beta"),
        top_k=int(text.get("num_experts_per_token", text.get("num_experts_per_tok", 0))),
        routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0)),
        experts=expert_ids,
        num_global_experts=int(text.get("num_experts", len(found))),
        layer=int(layer),
        source=f"{ckpt} layer {layer} experts {expert_ids[0]}..{expert_ids[-1]} ({len(expert_ids)})",
    )
