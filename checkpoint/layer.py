"""One routed-expert MoE layer in the kernels' layout (:class:`NVFP4MoELayer`: weights + config
facts), and its loaders: from a ModelOpt NVFP4 checkpoint (the cast) and from the MXFP4 release
itself (compressed-tensors E2M1 nibbles with E8M0 scales per 32, read without a cast)."""

from __future__ import annotations

import json
import os
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import torch
from safetensors import safe_open

from ..kernels import NVFP4MoEWeights
from ..kernels.activation import GatedActivation
from ..kernels.moe_details.weights import ModelOptMoETensors, MXFP4MoETensors
from ..kernels.moe_fp4_details.weights import cast_mxfp4_moe
from .layout import CONFIG_FILE, INDEX_FILE


@dataclass(frozen=True)
class NVFP4MoELayer:
    """The routed experts of one NVFP4 MoE layer plus the facts ``fused_moe_nvfp4`` needs.

    weights: the E loaded experts (in ``experts`` order) as :class:`NVFP4MoEWeights`
      (w13 uint8 [E, 2I, H/2] gate rows then up rows, w13_scale E4M3 bits [E, 2I, H/16],
      w13_scale_2 float32 [E, 2] (gate, up), w2 uint8 [E, H, I/2], w2_scale [E, H, I/16],
      w2_scale_2 float32 [E]), the W4A16 mode's prepared weights.
    tensors: the checkpoint tensors as loaded (ModelOptMoETensors, or MXFP4MoETensors for the
      MXFP4 release), from which every other mode (an A/B arm) prepares its own weights; None
      where the layer was built from prepared weights only.
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
    source_format: str = "nvfp4"  # "nvfp4" (ModelOpt / synthetic) or "mxfp4" (the release, no cast)
    # MXFP4 sources only: the same experts through the closed-form cast (what k3nvfp4-cast writes),
    # as ModelOpt tensors and as the W4A16 weights prepared from them.
    cast_weights: NVFP4MoEWeights | None = None
    tensors: ModelOptMoETensors | MXFP4MoETensors | None = None
    cast_tensors: ModelOptMoETensors | None = None

    def modelopt_tensors(self) -> ModelOptMoETensors | None:
        """The layer's experts as ModelOpt NVFP4 tensors: the checkpoint's, or for the MXFP4
        release the closed-form cast's (what NVFP4 consumers - marlin, FlashInfer - are fed)."""
        return self.tensors if isinstance(self.tensors, ModelOptMoETensors) else self.cast_tensors

    def activation(self) -> GatedActivation:
        """The config's activation as one value (an unset situ_beta is SGLang's 4.0); ValueError
        for a hidden_act the kernels do not implement."""
        return GatedActivation.parse(self.hidden_act, self.situ_beta, self.situ_linear_beta)

    def activation_kwargs(self) -> dict:
        """activation / routed_scaling_factor keyword arguments of ``fused_moe_nvfp4`` (and of
        every reference: one MoE signature)."""
        return dict(activation=self.activation(), routed_scaling_factor=self.routed_scaling_factor)


def _text_config(ckpt: Path) -> dict:
    cfg = json.loads((ckpt / CONFIG_FILE).read_text())
    return cfg.get("text_config", cfg)


def load_moe_layer(ckpt_dir: str | os.PathLike, layer: int, experts: Sequence[int] | None = None) -> NVFP4MoELayer:
    """The routed experts of MoE layer ``layer`` from a ModelOpt NVFP4 checkpoint (the cast) or
    from the MXFP4 release (``weight_packed`` tensors), whichever ``ckpt_dir`` holds."""
    ckpt = Path(ckpt_dir)
    weight_map = _weight_map(ckpt)  # read once, for the format and the load
    mxfp4 = re.compile(r"\.block_sparse_moe\.experts\.\d+\.w[123]\.weight_packed$")
    if any(mxfp4.search(n) for n in weight_map):
        return _load_mxfp4(ckpt, weight_map, layer, experts)
    return _load_nvfp4(ckpt, weight_map, layer, experts)


def _weight_map(ckpt: Path) -> dict[str, str]:
    index_path = ckpt / INDEX_FILE
    if not index_path.is_file():
        raise FileNotFoundError(f"{index_path}: no safetensors index; is {ckpt} a checkpoint?")
    return json.loads(index_path.read_text())["weight_map"]


def _expert_pattern(layer: int, suffix: str) -> re.Pattern:
    return re.compile(
        rf"^(?P<p>(?:language_model\.)?model\.layers\.{int(layer)}\.block_sparse_moe\.experts)\.(?P<e>\d+)\.w[123]\.{suffix}$"
    )


@dataclass
class _ExpertTensors:
    ids: tuple[int, ...]
    num_found: int
    get: Callable[[str, str], torch.Tensor]  # (proj, suffix) -> [E, ...] stacked over ids
    text: dict


def _ranges(ids: Sequence[int]) -> str:
    """Sorted ids as runs: [0, 1, 2, 5, 8, 9] -> "0-2, 5, 8-9"."""
    runs: list[list[int]] = []
    for i in sorted(ids):
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def _dense_hint(ckpt: Path, layer: int) -> str:
    """Where the config says the layer is dense (first_k_dense_replace), say so."""
    try:
        cfg = _text_config(ckpt)
    except (OSError, ValueError):
        return ""
    k, n = cfg.get("first_k_dense_replace"), cfg.get("num_hidden_layers")
    if not (isinstance(k, int) and 0 <= layer < k):
        return ""
    moe_layers = f"; the MoE layers are {k}-{n - 1}" if isinstance(n, int) else ""
    return f": layer {layer} is dense (first_k_dense_replace = {k}){moe_layers}"


def _moe_layers_hint(weight_map: dict[str, str], suffix: str) -> str:
    """The layers that do have routed experts of this format in the index, as ranges ("; its MoE
    layers are 1-60"), or that it has none; any layer index that is not one of them gets this."""
    pattern = re.compile(rf"^(?:language_model\.)?model\.layers\.(?P<l>\d+)\.block_sparse_moe\.experts\.\d+\.w1\.{suffix}$")
    layers = {int(m["l"]) for m in map(pattern.match, weight_map) if m}
    if not layers:
        return "; it has routed experts of this format in no layer"
    return f"; its layers with routed experts are {_ranges(sorted(layers))}"


def _read_experts(ckpt: Path, weight_map: dict[str, str], layer: int, experts: Sequence[int] | None,
                  suffixes: tuple[str, ...], not_found_hint: str) -> _ExpertTensors:  # fmt: skip
    """Stacked per-expert tensors ``suffixes`` of w1/w3/w2; each shard opened once."""
    found: dict[int, str] = {}
    pattern = _expert_pattern(layer, suffixes[0])
    for name in weight_map:
        m = pattern.match(name)
        if m:
            found[int(m["e"])] = m["p"]
    if not found:
        kind = "MXFP4" if suffixes[0] == "weight_packed" else "NVFP4"
        dense = _dense_hint(ckpt, layer)
        raise KeyError(f"{ckpt}: no {kind} routed experts for layer {layer} in {INDEX_FILE}{not_found_hint}"
                       + (dense or _moe_layers_hint(weight_map, suffixes[0])))
    expert_ids = tuple(sorted(found)) if experts is None else tuple(int(e) for e in experts)
    missing = [e for e in expert_ids if e not in found]
    if missing:
        raise KeyError(f"{ckpt}: layer {layer} has no expert(s) {_ranges(missing)} "
                       f"(it has {len(found)} experts: {_ranges(sorted(found))})")
    wanted = [f"{found[e]}.{e}.{w}.{suf}" for e in expert_ids for w in ("w1", "w3", "w2") for suf in suffixes]
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

    def get(w: str, suffix: str) -> torch.Tensor:
        return torch.stack([got[f"{found[e]}.{e}.{w}.{suffix}"] for e in expert_ids])

    return _ExpertTensors(expert_ids, len(found), get, _text_config(ckpt))


def _layer(weights: NVFP4MoEWeights, t: _ExpertTensors, ckpt: Path, layer: int, **extra) -> NVFP4MoELayer:
    text, ids = t.text, t.ids
    return NVFP4MoELayer(
        weights=weights,
        hidden_act=text.get("hidden_act", "silu"),
        situ_beta=text.get("activation_situ_beta"),
        situ_linear_beta=text.get("activation_situ_linear_beta"),
        top_k=int(text.get("num_experts_per_token", text.get("num_experts_per_tok", 0))),
        routed_scaling_factor=float(text.get("routed_scaling_factor", 1.0)),
        experts=ids,
        num_global_experts=int(text.get("num_experts", t.num_found)),
        layer=int(layer),
        source=f"{ckpt} layer {layer} experts {ids[0]}..{ids[-1]} ({len(ids)})",
        **extra,
    )


def load_moe_layer_nvfp4(
    ckpt_dir: str | os.PathLike, layer: int, experts: Sequence[int] | None = None
) -> NVFP4MoELayer:
    """Read the routed experts of MoE layer ``layer`` from an NVFP4 checkpoint (as written by
    ``k3nvfp4-cast``), stacked in SGLang's ModelOpt layout, with the layer's config facts. ``experts``: global expert ids to
    load, in this order (default: all of the layer). Each shard is opened once, lazily."""
    ckpt = Path(ckpt_dir)
    return _load_nvfp4(ckpt, _weight_map(ckpt), layer, experts)


def _load_nvfp4(ckpt: Path, weight_map: dict[str, str], layer: int, experts: Sequence[int] | None) -> NVFP4MoELayer:
    mx_pattern = _expert_pattern(layer, "weight_packed")
    mx = any(mx_pattern.match(n) for n in weight_map)
    hint = (" (it holds MXFP4 weight_packed tensors: cast it with k3nvfp4-cast, or read it directly with "
            "load_moe_layer_mxfp4)") if mx else ""  # fmt: skip
    t = _read_experts(ckpt, weight_map, layer, experts, ("weight", "weight_scale", "weight_scale_2"), hint)
    w1, w3 = t.get("w1", "weight"), t.get("w3", "weight")
    s1, s3 = t.get("w1", "weight_scale"), t.get("w3", "weight_scale")
    for x, n, dt in ((w1, "w1.weight", torch.uint8), (s1, "w1.weight_scale", torch.float8_e4m3fn)):
        if x.dtype != dt:
            raise TypeError(f"{ckpt}: layer {layer} {n} has dtype {x.dtype}, expected {dt} (ModelOpt NVFP4)")
    tensors = ModelOptMoETensors(
        torch.cat([w1, w3], dim=1),
        torch.cat([s1, s3], dim=1),
        torch.stack([t.get("w1", "weight_scale_2").reshape(-1), t.get("w3", "weight_scale_2").reshape(-1)], dim=1).to(torch.float32),
        t.get("w2", "weight"),
        t.get("w2", "weight_scale"),
        t.get("w2", "weight_scale_2").reshape(-1).to(torch.float32),
    )
    return _layer(NVFP4MoEWeights.from_modelopt(*tensors), t, ckpt, layer, tensors=tensors)


def load_moe_layer_mxfp4(
    ckpt_dir: str | os.PathLike, layer: int, experts: Sequence[int] | None = None
) -> NVFP4MoELayer:
    """The routed experts of MoE layer ``layer`` of the MXFP4 release (compressed-tensors
    ``weight_packed`` uint8 [rows, K/2] + ``weight_scale`` E8M0 uint8 [rows, K/32]), read
    directly into the kernels' layout (``NVFP4MoEWeights.from_mxfp4``); ``cast_weights`` holds
    the same experts through the closed-form cast, for comparisons."""
    ckpt = Path(ckpt_dir)
    return _load_mxfp4(ckpt, _weight_map(ckpt), layer, experts)


def _load_mxfp4(ckpt: Path, weight_map: dict[str, str], layer: int, experts: Sequence[int] | None) -> NVFP4MoELayer:
    t = _read_experts(ckpt, weight_map, layer, experts, ("weight_packed", "weight_scale"), "")
    packed = {w: t.get(w, "weight_packed") for w in ("w1", "w3", "w2")}
    e8m0 = {w: t.get(w, "weight_scale") for w in ("w1", "w3", "w2")}
    for w in packed:
        for x, n in ((packed[w], "weight_packed"), (e8m0[w], "weight_scale")):
            if x.dtype != torch.uint8:
                raise TypeError(f"{ckpt}: layer {layer} {w}.{n} has dtype {x.dtype}, expected uint8 (MXFP4)")
    tensors = MXFP4MoETensors(
        torch.cat([packed["w1"], packed["w3"]], dim=1), torch.cat([e8m0["w1"], e8m0["w3"]], dim=1),
        packed["w2"], e8m0["w2"],
    )  # fmt: skip
    cast = cast_mxfp4_moe(*tensors, backend="torch")
    return _layer(NVFP4MoEWeights.from_mxfp4(*tensors), t, ckpt, layer, source_format="mxfp4", tensors=tensors,
                  cast_tensors=cast, cast_weights=NVFP4MoEWeights.from_modelopt(*cast))
