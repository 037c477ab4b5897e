"""Which quant method SGLang gave every linear, and whether the exclude globs are what decided.

Expected: the checkpoint format's method for exactly the routed experts (a k3nvfp4 cast:
``ModelOptNvFp4FusedMoEMethod``; the MXFP4 release: ``Mxfp4MoEMethod``); unquantized for attention, shared experts, the dense MLP, the latent
projections, lm_head and the embedding. The control builds a second quant config through the
same loader path from a copy of config.json whose ``exclude_modules`` is empty, and asks it
about the same layers with the same prefixes: every linear the model class asked the quant
config about must then be quantized, which proves the globs (not a default) keep them BF16.
Linears the model class builds without the quant config (K3's latent projections, the KDA
conv1d) are reported as such: no glob can change them.
"""

from __future__ import annotations

import json
import re
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from .ckpt_reader import CONFIG_FILE

ROUTED = "routed experts"
_DENSE_MLP = re.compile(r"\.layers\.\d+\.mlp\.(gate_up_proj|down_proj)$")
_HF_QUANT_CONFIG = "hf_quant_config.json"


@dataclass
class QuantEntry:
    prefix: str
    role: str
    layer_type: str
    method: str
    quantized: bool
    asked: bool  # the model class asked the quant config (else it passed none)
    control_method: str | None = None  # what the quant config without exclude_modules returns
    control_quantized: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def role_of(prefix: str, module: torch.nn.Module) -> str:
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    if isinstance(module, FusedMoE):
        return ROUTED
    if prefix.startswith(("vision_tower", "mm_projector")):
        return "vision"
    if ".shared_experts." in prefix:
        return "shared experts"
    if ".routed_expert_" in prefix:
        return "latent projections"
    if ".self_attn." in prefix:
        return "attention"
    if prefix.endswith("lm_head"):
        return "lm_head"
    if prefix.endswith("embed_tokens"):
        return "embedding"
    if _DENSE_MLP.search(prefix):
        return "dense MLP"
    return "other"


def is_quantized(method: Any) -> bool:
    return method is not None and not type(method).__name__.startswith("Unquantized")


def audit(model: torch.nn.Module, quant_calls: list[tuple[str, torch.nn.Module, Any]],
          control_config: Any | None, experts_method: str) -> tuple[list[QuantEntry], list[str]]:  # fmt: skip
    """(entries for every linear / MoE / embedding, problems); the routed experts must get
    ``experts_method`` (the checkpoint format's SGLang quant method)."""
    from sglang.srt.layers.linear import LinearBase
    from sglang.srt.layers.radix_attention import RadixAttention

    asked = {id(layer): prefix for prefix, layer, _ in quant_calls}
    entries, problems = [], []
    for prefix, module in model.named_modules():
        if isinstance(module, RadixAttention):
            continue  # KV-cache scales, checked after post-processing (kv_cache_scales)
        method = getattr(module, "quant_method", None)
        plain_linear = isinstance(module, torch.nn.Linear) and not isinstance(module, LinearBase)
        if method is None and not plain_linear:
            continue
        role = role_of(prefix, module)
        entry = QuantEntry(prefix, role, type(module).__name__,
                           type(method).__name__ if method is not None else "none (torch.nn.Linear)",
                           is_quantized(method), id(module) in asked)  # fmt: skip
        if entry.asked and control_config is not None and role != ROUTED:
            try:
                m0 = control_config.get_quant_method(module, asked[id(module)])
            except NotImplementedError as exc:
                # compressed-tensors matched a target and looked for a kernel scheme: it would
                # quantize this linear (MXFP4 weight-only linears have no scheme in SGLang).
                entry.control_method, entry.control_quantized = f"targeted, no scheme ({exc})", True
            else:
                entry.control_method = type(m0).__name__ if m0 is not None else None
                entry.control_quantized = is_quantized(m0)
        entries.append(entry)
        if entry.asked and entry.control_quantized is False and isinstance(module, LinearBase):
            problems.append(f"{prefix}: with exclude_modules emptied SGLang still gives {entry.control_method}; "
                            "the exclude globs are not what keeps it unquantized")  # fmt: skip
        if role == ROUTED:
            if entry.method != experts_method:
                problems.append(f"{prefix}: routed experts got {entry.method}, expected {experts_method}")
        elif entry.quantized:
            problems.append(f"{prefix}: {role} got {entry.method}; only the routed experts may be quantized")
    if not any(e.role == ROUTED for e in entries):
        problems.append("no FusedMoE layer with a quant method: the routed experts were not built")
    return entries, problems


def quant_summary(entries: list[QuantEntry]) -> dict[str, Any]:
    """Methods per role, the control per role, the linears built without a quant config."""
    by_role: dict[str, dict[str, int]] = {}
    control: dict[str, dict[str, int]] = {}
    for e in entries:
        by_role.setdefault(e.role, {}).setdefault(e.method, 0)
        by_role[e.role][e.method] += 1
        c = control.setdefault(e.role, {"linears": 0, "asked": 0, "quantized_without_excludes": 0})
        c["linears"] += 1
        c["asked"] += int(e.asked)
        c["quantized_without_excludes"] += int(bool(e.control_quantized))
    return {"by_role": by_role, "control_by_role": control, "not_asked": sorted(e.prefix for e in entries if not e.asked),
            "entries": [e.to_dict() for e in entries]}  # fmt: skip


def kv_cache_scales(model: torch.nn.Module) -> tuple[list[dict[str, Any]], list[str]]:
    """After post-processing: the KV-cache methods of the (MLA) attention keep k/v scales of 1.0
    (the cast writes none; the KV cache dtype is --kv-cache-dtype's)."""
    from sglang.srt.layers.radix_attention import RadixAttention

    out, problems = [], []
    for prefix, module in model.named_modules():
        if not isinstance(module, RadixAttention) or getattr(module, "quant_method", None) is None:
            continue
        k, v = float(module.k_scale), float(module.v_scale)
        out.append({"prefix": prefix, "method": type(module.quant_method).__name__, "k_scale": k, "v_scale": v})
        if (k, v) != (1.0, 1.0):
            problems.append(f"{prefix}: KV-cache scales k={k} v={v}; the checkpoint declares none (expected 1.0)")
    return out, problems


def control_quant_config(ckpt: Path, server_args: Any, load_config: Any) -> Any:
    """SGLang's quant config for a copy of ``ckpt`` whose exclude_modules is empty (same loader path)."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_loader.loader import _get_quantization_config

    with tempfile.TemporaryDirectory(prefix="k3nvfp4-no-excludes-") as tmp_dir:
        tmp = Path(tmp_dir)
        for f in Path(ckpt).iterdir():
            if f.name not in (CONFIG_FILE, _HF_QUANT_CONFIG):
                (tmp / f.name).symlink_to(f.resolve())
        cfg = json.loads((Path(ckpt) / CONFIG_FILE).read_text())
        holders = [cfg] + ([cfg["text_config"]] if isinstance(cfg.get("text_config"), dict) else [])
        for holder in holders:
            q = holder.get("quantization_config")
            if isinstance(q, dict):
                for key in ("ignore", "modules_to_not_convert"):
                    q.pop(key, None)
                q["exclude_modules"] = []
                # compressed-tensors quantizes only what a config group targets: without the
                # ignore list, every Linear is targeted (else SGLang finds no scheme at all).
                for group in (q.get("config_groups") or {}).values():
                    group["targets"] = list(group.get("targets", [])) + ["Linear"]
                if "config_groups" in q:
                    q["ignore"] = []
        (tmp / CONFIG_FILE).write_text(json.dumps(cfg, indent=2))
        legacy = Path(ckpt) / _HF_QUANT_CONFIG
        if legacy.is_file():
            hq = json.loads(legacy.read_text())
            hq.get("quantization", {})["exclude_modules"] = []
            (tmp / _HF_QUANT_CONFIG).write_text(json.dumps(hq, indent=2))
        model_config = ModelConfig.from_server_args(server_args, model_path=str(tmp))
        return _get_quantization_config(model_config, load_config)
