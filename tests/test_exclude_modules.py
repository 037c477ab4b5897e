"""SGLang's own ModelOpt parser reads the cast's config and quantizes exactly the routed experts.

The written quantization_config (and hf_quant_config.json) go through
ModelOptFp4Config.from_config, the Kimi-K3 model class's hf_to_sglang_mapper and
packed_modules_mapping (as SGLang's loader applies them), then get_quant_method decides,
module prefix by module prefix, what SGLang would build for every module of the checkpoint
(fused projections included), in both prefix spellings (with/without ``language_model.``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from k3nvfp4.checkpoint.cli import main
from k3nvfp4.checkpoint.synthetic import write_synthetic_checkpoint

from sglang.srt.layers.quantization import modelopt_quant  # noqa: E402  (sglang is a test dependency)


@pytest.fixture(scope="module")
def cast_ckpt(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("excl")
    src = write_synthetic_checkpoint(root / "src", num_layers=5, num_experts=2, hidden_size=32, intermediate_size=32,
                                     num_shards=2, model_hidden_size=32)
    out = root / "out"
    assert main(["--source_ckpt", str(src), "--output_ckpt", str(out), "--workers", "1", "--no-progress"]) == 0
    return src, out


def _sglang_quant_configs(out: Path):
    from sglang.srt.models.kimi_k3 import KimiK3ForConditionalGeneration as K3

    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    legacy = json.loads((out / "hf_quant_config.json").read_text())
    configs = []
    for raw in (cfg, legacy):
        # What SGLang's loader does: pass the model's packed mapping, then map HF names.
        qc = modelopt_quant.ModelOptFp4Config.from_config({**raw, "packed_modules_mapping": dict(K3.packed_modules_mapping)})
        qc.packed_modules_mapping = dict(K3.packed_modules_mapping)
        qc.apply_weight_name_mapper(K3.hf_to_sglang_mapper)
        configs.append(qc)
    return configs, K3


def _runtime_modules(src: Path, mapper, packed: dict[str, list[str]]) -> tuple[set[str], set[str]]:
    """(linear module prefixes, FusedMoE prefixes) SGLang builds for this checkpoint, in its naming."""
    from safetensors import safe_open

    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    float2d: set[str] = set()
    moe: set[str] = set()
    for name, shard in index.items():
        mapped = mapper._map_name(name)
        if re.search(r"\.experts\.\d+\.w[123]\.weight_packed$", name):
            moe.add(re.sub(r"\.experts\.\d+\.w[123]\.weight_packed$", ".experts", mapped))
            continue
        if not name.endswith(".weight"):
            continue
        with safe_open(str(src / shard), "pt") as f:
            t = f.get_slice(name)
            if t.get_dtype() in ("BF16", "F16", "F32") and len(t.get_shape()) == 2:
                float2d.add(mapped[: -len(".weight")])
    linear = set(float2d)
    parents = {m.rsplit(".", 1)[0] for m in float2d}
    for parent in parents:
        have = {m.rsplit(".", 1)[1] for m in float2d if m.rsplit(".", 1)[0] == parent}
        for fused, shards in packed.items():
            if set(shards) <= have:  # SGLang may build the fused projection instead
                linear.add(f"{parent}.{fused}")
        if {"q_a_proj", "kv_a_proj_with_mqa"} <= have:  # MLA's fused A projection
            linear.add(f"{parent}.fused_qkv_a_proj_with_mqa")
    return linear, moe


def test_sglang_quantizes_exactly_the_routed_experts(cast_ckpt):
    from sglang.srt.layers.linear import ReplicatedLinear

    UnquantizedLinearMethod = modelopt_quant.UnquantizedLinearMethod
    from sglang.srt.layers.moe.fused_moe_triton import FusedMoE
    from sglang.srt.runtime_context import override_platform

    src, out = cast_ckpt
    configs, K3 = _sglang_quant_configs(out)
    linear, moe = _runtime_modules(src, K3.hf_to_sglang_mapper, K3.packed_modules_mapping)
    assert len(moe) == 4  # MoE layers 1..4
    assert any(m.endswith(".gate_up_proj") for m in linear) and any(m.endswith(".fused_qkvg_proj") for m in linear)
    assert any(m.endswith(".fused_qkv_a_proj_with_mqa") for m in linear)  # layer 3 is MLA
    lin = ReplicatedLinear.__new__(ReplicatedLinear)  # isinstance checks only; no parallel state needed
    fmoe = FusedMoE.__new__(FusedMoE)
    for qc in configs:
        for spelled in (lambda p: p, lambda p: p.removeprefix("language_model.")):
            for prefix in sorted(linear):
                method = qc.get_quant_method(lin, spelled(prefix))
                assert isinstance(method, UnquantizedLinearMethod), f"SGLang would quantize {spelled(prefix)}"
            for prefix in sorted(moe):
                assert not qc.is_layer_excluded(spelled(prefix)), f"SGLang would not quantize {spelled(prefix)}"
                # The NVFP4 MoE method refuses non-Blackwell devices in __init__; SGLang's scoped
                # test override lifts that check.
                with override_platform(is_blackwell=True):
                    method = qc.get_quant_method(fmoe, spelled(prefix))
                assert isinstance(method, modelopt_quant.ModelOptNvFp4FusedMoEMethod), spelled(prefix)


def test_exclude_globs_collapse_indices(cast_ckpt):
    _, out = cast_ckpt
    q = json.loads((out / "config.json").read_text())["quantization_config"]
    ex = q["exclude_modules"]
    assert "language_model.model.layers.*.self_attn.o_proj" in ex and "model.layers.*.self_attn.o_proj" in ex
    assert "language_model.lm_head" in ex and "language_model.model.embed_tokens" in ex
    assert not any(re.search(r"\.\d+\.", g) for g in ex)  # every index collapsed
    assert not any("experts.*.w" in g for g in ex)


def test_sglang_resolves_modelopt_from_the_written_config(cast_ckpt):
    from sglang.srt.configs.kimi_k3 import KimiK3Config
    from sglang.srt.model_loader.checkpoint_quantization import resolve_checkpoint_quant_spec

    _, out = cast_ckpt
    cfg = json.loads((out / "config.json").read_text())
    k3 = KimiK3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    spec = resolve_checkpoint_quant_spec(k3)
    assert spec is not None and spec.declared_method == "modelopt" and spec.config["quant_algo"] == "NVFP4"
    assert not hasattr(k3.text_config, "quantization_config") or k3.text_config.quantization_config is None
