"""Names of the Kimi-K3 checkpoint layout (MXFP4 source and ModelOpt NVFP4 output)."""

from __future__ import annotations

import re
from dataclasses import dataclass

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
HF_QUANT_CONFIG_FILE = "hf_quant_config.json"
REPORT_FILE = "cast_report.json"
# The cast's resume state inside its output directory (one record per finished shard).
STATE_DIR = ".k3nvfp4-cast"

COMPRESSED_TENSORS_MXFP4_FORMAT = "mxfp4-pack-quantized"
NVFP4_FORMAT = "nvfp4-pack-quantized"

# Optional wrapper prefix of the language model in the multimodal K3 checkpoint.
LANGUAGE_MODEL_PREFIX = "language_model."

# <base>.weight_packed / <base>.weight_scale with <base> = ...layers.N.block_sparse_moe.experts.E.wK
EXPERT_TENSOR_RE = re.compile(
    r"^(?P<base>(?P<layer_prefix>(?:language_model\.)?model\.layers\.(?P<layer>\d+))"
    r"\.block_sparse_moe\.experts\.(?P<expert>\d+)\.(?P<proj>w[123]))\.(?P<kind>weight_packed|weight_scale)$"
)
KDA_A_LOG_RE = re.compile(r"^(?P<module>.*\.self_attn)\.A_log$")


def layer_prefix(layer: int) -> str:
    return f"language_model.model.layers.{layer}"


def expert_prefix(layer: int, expert: int) -> str:
    return f"{layer_prefix(layer)}.block_sparse_moe.experts.{expert}"


def shard_file_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


@dataclass(frozen=True)
class ExpertMatrixName:
    """One routed-expert matrix of the checkpoint: ``<base>`` = ...experts.E.w{1,2,3}."""

    base: str
    layer: int
    expert: int
    proj: str  # "w1" (gate), "w3" (up) or "w2" (down)

    @property
    def group(self) -> tuple[int, int, str]:
        """Matrices that share one scale_2: (layer, expert, "w13") or (layer, expert, "w2")."""
        return (self.layer, self.expert, "w2" if self.proj == "w2" else "w13")


def parse_expert_tensor(name: str) -> tuple[ExpertMatrixName, str] | None:
    """``...experts.E.wK.weight_packed`` -> (ExpertMatrixName, "weight_packed"); else None."""
    m = EXPERT_TENSOR_RE.match(name)
    if m is None:
        return None
    return (
        ExpertMatrixName(m["base"], int(m["layer"]), int(m["expert"]), m["proj"]),
        m["kind"],
    )
