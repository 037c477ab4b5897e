"""The routed experts' checkpoint format: ModelOpt NVFP4 (the cast) or compressed-tensors MXFP4
(the release, served directly).

Each format states, independently of SGLang's loader, which checkpoint tensors one expert has,
which SGLang quant method the routed experts must get, which FusedMoE parameters hold them on
a rank (w13 = w1 rows then w3 rows, sliced for MoE-TP) and how the reference decodes them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from .ckpt_reader import CONFIG_FILE, text_config
from .reference import dequant_mxfp4, dequant_nvfp4

# (proj, checkpoint suffix) -> tensor, for one expert.
ExpertTensors = dict[tuple[str, str], torch.Tensor]
Slicer = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class ExpertFormat:
    """One checkpoint format of the routed experts."""

    name: str
    method: str  # SGLang quant method class of the routed experts
    suffixes: tuple[str, ...]  # checkpoint tensors of each of w1, w3, w2
    params: tuple[str, ...]  # FusedMoE parameters the checkpoint fills
    weight_suffix: str  # the nibbles' suffix (the tensor the others go with)
    decode: Callable[..., torch.Tensor]  # the reference's decoder, called with the ``suffixes`` tensors

    def expected(self, t: ExpertTensors, rows: Slicer, cols: Slicer, layer: Any, e_local: int) -> dict[str, torch.Tensor]:
        """What each of ``params`` must hold for local expert ``e_local`` (``rows`` / ``cols``:
        this rank's MoE-TP slice of w1/w3 rows and of w2 columns)."""
        w = self.weight_suffix
        out = {
            "w13_weight": torch.cat([rows(t["w1", w]), rows(t["w3", w])]),
            "w13_weight_scale": torch.cat([rows(t["w1", "weight_scale"]), rows(t["w3", "weight_scale"])]),
            "w2_weight": cols(t["w2", w]),
            "w2_weight_scale": cols(t["w2", "weight_scale"]),
        }
        if "w13_weight_scale_2" in self.params:
            s13 = layer.w13_weight_scale_2.data[e_local]
            out["w13_weight_scale_2"] = (
                torch.stack([t["w1", "weight_scale_2"], t["w3", "weight_scale_2"]]).reshape(-1)
                if s13.numel() == 2 else t["w1", "weight_scale_2"].reshape(s13.shape)
            )  # fmt: skip
            out["w2_weight_scale_2"] = t["w2", "weight_scale_2"].reshape(())
        return out

    def dequant(self, get: Callable[[str], torch.Tensor], e: int, proj: str) -> torch.Tensor:
        """fp32 [rows, K] of expert ``e``'s ``proj`` from the checkpoint (``get(suffix)``)."""
        return self.decode(*(get(f"experts.{e}.{proj}.{suffix}") for suffix in self.suffixes))


MODELOPT_NVFP4 = ExpertFormat(
    name="ModelOpt NVFP4",
    method="ModelOptNvFp4FusedMoEMethod",
    suffixes=("weight", "weight_scale", "weight_scale_2"),
    params=("w13_weight", "w13_weight_scale", "w13_weight_scale_2", "w2_weight", "w2_weight_scale", "w2_weight_scale_2"),
    weight_suffix="weight",
    decode=dequant_nvfp4,
)
COMPRESSED_TENSORS_MXFP4 = ExpertFormat(
    name="compressed-tensors MXFP4",
    method="Mxfp4MoEMethod",
    suffixes=("weight_packed", "weight_scale"),
    params=("w13_weight", "w13_weight_scale", "w2_weight", "w2_weight_scale"),
    weight_suffix="weight_packed",
    decode=dequant_mxfp4,
)


def expert_format(config: dict[str, Any]) -> ExpertFormat:
    """The routed experts' format from config.json's quantization_config (top level or text_config)."""
    q = config.get("quantization_config") or text_config(config).get("quantization_config")
    if not isinstance(q, dict):
        raise ValueError(f"{CONFIG_FILE}: no quantization_config; the check expects a ModelOpt NVFP4 "
                         "(cast) or compressed-tensors MXFP4 (release) checkpoint")  # fmt: skip
    method = q.get("quant_method")
    if method == "modelopt":
        return MODELOPT_NVFP4
    formats = [q.get("format")] + [g.get("format") for g in (q.get("config_groups") or {}).values()]
    if method == "compressed-tensors" and any("mxfp4" in str(f) for f in formats):
        return COMPRESSED_TENSORS_MXFP4
    raise ValueError(f"{CONFIG_FILE}: quantization_config quant_method {method!r} format {q.get('format')!r}: "
                     "the check knows ModelOpt NVFP4 and compressed-tensors mxfp4-pack-quantized")  # fmt: skip
