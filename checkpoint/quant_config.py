"""The ModelOpt NVFP4 quantization config of a cast checkpoint (config.json + hf_quant_config.json)."""

from __future__ import annotations

import copy
import re
from typing import Iterable

from .layout import COMPRESSED_TENSORS_MXFP4_FORMAT, LANGUAGE_MODEL_PREFIX, NVFP4_FORMAT
from .safetensors_io import CheckpointError

NVFP4_GROUP_SIZE = 16

# W4A4 variant: NVFP4 activations, dynamic per-block scales under a static per-tensor
# input_scale (written as 1.0 placeholders; the W4A16 serving paths ignore it).
_W4A4_INPUT_ACTIVATIONS = {
    "num_bits": 4,
    "type": "float",
    "strategy": "tensor_group",
    "group_size": NVFP4_GROUP_SIZE,
    "dynamic": "local",
}
_NVFP4_WEIGHTS = {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": NVFP4_GROUP_SIZE}


def source_quantization_config(config: dict, config_path: str) -> dict:
    """The compressed-tensors MXFP4 block of a K3 config (under text_config); validated."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        raise CheckpointError(f"{config_path}: no text_config; not a Kimi-K3 (multimodal) config")
    q = text.get("quantization_config") or config.get("quantization_config")
    if not isinstance(q, dict):
        raise CheckpointError(f"{config_path}: text_config has no quantization_config; is the source MXFP4?")
    method = str(q.get("quant_method", "")).lower()
    if method != "compressed-tensors":
        raise CheckpointError(
            f"{config_path}: quantization_config.quant_method is {q.get('quant_method')!r}, "
            "expected 'compressed-tensors' (MXFP4 source)"
        )
    formats = {q.get("format")} | {g.get("format") for g in (q.get("config_groups") or {}).values()}
    formats.discard(None)
    if formats != {COMPRESSED_TENSORS_MXFP4_FORMAT}:
        raise CheckpointError(
            f"{config_path}: quantization format {sorted(map(str, formats))}, expected {COMPRESSED_TENSORS_MXFP4_FORMAT!r}"
        )
    for gname, g in (q.get("config_groups") or {}).items():
        gs = (g.get("weights") or {}).get("group_size")
        if gs not in (None, 32):
            raise CheckpointError(f"{config_path}: config_groups.{gname}.weights.group_size is {gs}, expected 32")
    return q


# Projections SGLang's Kimi-K3 / DeepSeek-style models fuse at load time. Its
# is_layer_skipped() resolves a fused module through its shards by exact/prefix match only
# (no globs), so the fused names themselves must be listed too.
FUSED_PROJECTIONS: dict[str, tuple[str, ...]] = {
    "gate_up_proj": ("gate_proj", "up_proj"),
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "fused_qkvg_proj": ("q_proj", "k_proj", "v_proj", "g_proj"),
    "fused_qkvbfg_a_proj": ("q_proj", "k_proj", "v_proj", "b_proj", "f_a_proj", "g_a_proj"),
    "fused_fg_b_proj": ("f_b_proj", "g_b_proj"),
    "fused_qkv_a_proj_with_mqa": ("q_a_proj", "kv_a_proj_with_mqa"),
}


def _glob_regex(glob: str) -> re.Pattern[str]:
    # The same reading SGLang gives exclude_modules: '*' matches anything (dots included).
    return re.compile(".*".join(re.escape(p) for p in glob.split("*")))


def exclude_module_globs(unquantized_modules: Iterable[str], quantized_modules: Iterable[str]) -> list[str]:
    """exclude_modules for the modules that kept an unquantized 2-D float ``.weight``.

    Fused projections SGLang builds from excluded shards (``FUSED_PROJECTIONS``) are added.

    Numeric path components (layer, expert, block indices) collapse to ``*``; a collapsed
    glob that would also match a quantized module is replaced by its literal members.
    Every glob is written in both spellings SGLang may see for a language-model prefix
    (with and without ``language_model.``).
    """
    quantized = sorted(set(quantized_modules))
    modules = set(unquantized_modules)
    leaves: dict[str, set[str]] = {}
    for m in modules:
        parent, _, leaf = m.rpartition(".")
        leaves.setdefault(parent, set()).add(leaf)
    for parent, have in leaves.items():
        for fused, shards in FUSED_PROJECTIONS.items():
            if set(shards) <= have:
                modules.add(f"{parent}.{fused}")
    groups: dict[str, list[str]] = {}
    for m in sorted(modules):
        glob = ".".join("*" if part.isdigit() else part for part in m.split("."))
        groups.setdefault(glob, []).append(m)
    globs: list[str] = []
    for glob, members in groups.items():
        rx = _glob_regex(glob)
        if any(rx.fullmatch(q) for q in quantized):
            globs.extend(members)
        else:
            globs.append(glob)
    out: set[str] = set()
    for g in globs:
        out.add(g)
        if g.startswith(LANGUAGE_MODEL_PREFIX):
            out.add(g[len(LANGUAGE_MODEL_PREFIX):])
        elif g.startswith("model.") or g == "lm_head":
            out.add(LANGUAGE_MODEL_PREFIX + g)
    return sorted(out)


def nvfp4_quantization_config(exclude_modules: list[str], *, w4a4: bool) -> dict:
    """config.json's top-level quantization_config (flat ModelOpt form SGLang parses)."""
    return {
        "quant_method": "modelopt",
        "quant_algo": "NVFP4",
        "format": NVFP4_FORMAT,
        "group_size": NVFP4_GROUP_SIZE,
        "kv_cache_quant_algo": None,
        "weights": dict(_NVFP4_WEIGHTS),
        "input_activations": dict(_W4A4_INPUT_ACTIVATIONS) if w4a4 else None,
        "exclude_modules": list(exclude_modules),
    }


def hf_quant_config(exclude_modules: list[str], *, producer_version: str) -> dict:
    """The legacy hf_quant_config.json form (``{"quantization": {...}}``)."""
    return {
        "producer": {"name": "k3nvfp4-cast (closed-form MXFP4->NVFP4)", "version": producer_version},
        "quantization": {
            "quant_algo": "NVFP4",
            "kv_cache_quant_algo": None,
            "group_size": NVFP4_GROUP_SIZE,
            "exclude_modules": list(exclude_modules),
        },
    }


def output_config(config: dict, exclude_modules: list[str], *, w4a4: bool) -> dict:
    """The source config with the compressed-tensors block removed and ModelOpt's added on top."""
    out = copy.deepcopy(config)
    text = out.get("text_config", {})
    text.pop("quantization_config", None)
    out.pop("quantization_config", None)
    out["quantization_config"] = nvfp4_quantization_config(exclude_modules, w4a4=w4a4)
    return out
