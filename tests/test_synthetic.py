"""The synthetic Kimi-K3 MXFP4 checkpoint has the release's layout, naming and statistics."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from k3nvfp4.checkpoint.synthetic import main as synthetic_main
from k3nvfp4.checkpoint.synthetic import write_synthetic_checkpoint

EXPERT = re.compile(r"^language_model\.model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.(weight_packed|weight_scale)$")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    return write_synthetic_checkpoint(
        tmp_path_factory.mktemp("syn") / "k3", num_layers=4, num_experts=6, hidden_size=128, intermediate_size=64,
        num_shards=3, out_of_range_fraction=0.05, zero_exponent_fraction=0.05, seed=3,
    )


def _tensors(ckpt: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(ckpt.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def test_config_is_k3(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK3ForConditionalGeneration"] and cfg["model_type"] == "kimi_k3"
    t = cfg["text_config"]
    assert t["hidden_act"] == "situ" and t["activation_situ_beta"] == 4.0 and t["activation_situ_linear_beta"] == 25.0
    assert t["num_experts"] == 6 and t["num_experts_per_token"] == 4
    assert t["moe_intermediate_size"] == 64 and t["routed_expert_hidden_size"] == 128 and t["hidden_size"] == 256
    assert t["first_k_dense_replace"] == 1 and t["num_hidden_layers"] == 4
    assert t["linear_attn_config"]["kda_layers"] == [1, 2, 3] and t["linear_attn_config"]["full_attn_layers"] == [4]
    q = t["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["format"] == "mxfp4-pack-quantized"
    assert q["config_groups"]["group_0"]["weights"]["group_size"] == 32
    assert "quantization_config" not in cfg
    for f in ("generation_config.json", "tiktoken.model", "tokenizer_config.json", "chat_template.jinja"):
        assert (ckpt / f).is_file()
    assert list(ckpt.glob("*.py"))


def test_sglang_reads_the_config(ckpt):
    from sglang.srt.configs.kimi_k3 import KimiK3Config

    cfg = json.loads((ckpt / "config.json").read_text())
    k3 = KimiK3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    assert k3.text_config.num_experts == 6 and k3.text_config.num_experts_per_tok == 4
    assert k3.text_config.is_kda_layer(0) and not k3.text_config.is_kda_layer(3)
    assert k3.quantization_config["quant_method"] == "compressed-tensors"


def test_index_and_shards(ckpt):
    index = json.loads((ckpt / "model.safetensors.index.json").read_text())
    wm = index["weight_map"]
    shards = sorted(set(wm.values()))
    assert shards == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    total = 0
    for s in shards:
        with safe_open(str(ckpt / s), "pt") as f:
            keys = set(f.keys())
            assert keys == {n for n, sh in wm.items() if sh == s}
            for k in keys:
                t = f.get_tensor(k)
                total += t.numel() * t.element_size()
    assert index["metadata"]["total_size"] == total
    # Experts of one layer straddle two shards (the tool must not assume otherwise).
    layer_shards = {}
    for n, s in wm.items():
        m = EXPERT.match(n)
        if m:
            layer_shards.setdefault(m[1], set()).add(s)
    assert any(len(v) > 1 for v in layer_shards.values())


def test_expert_tensors(ckpt):
    t = _tensors(ckpt)
    experts = {n: v for n, v in t.items() if EXPERT.match(n)}
    assert len(experts) == 3 * 6 * 3 * 2
    codes = torch.zeros(16, dtype=torch.long)
    scales = []
    for n, v in experts.items():
        _, _, proj, kind = EXPERT.match(n).groups()
        assert v.dtype == torch.uint8
        rows, cols = (64, 128) if proj in ("w1", "w3") else (128, 64)
        assert tuple(v.shape) == ((rows, cols // 2) if kind == "weight_packed" else (rows, cols // 32))
        if kind == "weight_packed":
            codes += torch.bincount((v & 0xF).reshape(-1).long(), minlength=16)
            scale = t[n.replace("weight_packed", "weight_scale")]
            zero = (scale == 0).reshape(-1)
            blocks = v.reshape(-1, 16)
            assert ((blocks[zero] & 0x77) == 0).all()  # zero-exponent blocks hold only +-0
        else:
            assert int(v.max()) < 255  # never NaN
            scales.append(v)
    assert (codes > 0).all()  # every E2M1 code, -0 (8) included
    # Exponent statistics per w1/w3 group: ~5% zero blocks, ~5% more than 17 binades below the max.
    s = torch.cat([x.reshape(-1) for x in scales]).numpy().astype(np.int64)
    assert 0.03 < (s == 0).mean() < 0.07
    w1 = [v for n, v in t.items() if n.endswith("w1.weight_scale")]
    kmax = [int(x.max()) for x in w1]
    assert len(set(kmax)) > 1  # spread across experts
    below = np.concatenate([(int(x.max()) - x.reshape(-1).numpy().astype(np.int64))[x.reshape(-1).numpy() > 0] for x in w1])
    assert 0.02 < (below > 17).mean() < 0.08 and np.isin(np.arange(0, 8), below).all()


def test_non_expert_tensors(ckpt):
    t = _tensors(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())["text_config"]
    nh, hd = cfg["linear_attn_config"]["num_heads"], cfg["linear_attn_config"]["head_dim"]
    a_logs = {n: v for n, v in t.items() if n.endswith(".A_log")}
    assert sorted(a_logs) == [f"language_model.model.layers.{i}.self_attn.A_log" for i in range(3)]
    for v in a_logs.values():
        assert v.dtype == torch.float32 and v.shape == (hd,) and (v[nh:] == 0).all() and (v[:nh] != 0).all()
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in t
    assert "language_model.model.layers.3.self_attn.kv_b_proj.weight" in t  # MLA layer
    assert "language_model.model.layers.1.block_sparse_moe.shared_experts.down_proj.weight" in t
    assert "language_model.lm_head.weight" in t and "language_model.model.embed_tokens.weight" in t
    floats = [v for n, v in t.items() if not EXPERT.match(n) and v.dtype != torch.float32]
    assert floats and all(v.dtype == torch.bfloat16 for v in floats)


def test_deterministic_and_shard_independent(tmp_path):
    kw = dict(num_layers=2, num_experts=2, hidden_size=64, intermediate_size=32, seed=7)
    a = write_synthetic_checkpoint(tmp_path / "a", num_shards=1, **kw)
    b = write_synthetic_checkpoint(tmp_path / "b", num_shards=2, **kw)
    c = write_synthetic_checkpoint(tmp_path / "c", num_shards=2, **{**kw, "seed": 8})
    ta, tb, tc = _tensors(a), _tensors(b), _tensors(c)
    assert ta.keys() == tb.keys()
    assert all(torch.equal(ta[k].view(torch.uint8), tb[k].view(torch.uint8)) for k in ta if ta[k].dim())
    n = "language_model.model.layers.1.block_sparse_moe.experts.0.w1.weight_packed"
    assert not torch.equal(ta[n], tc[n])


def test_cli(tmp_path, capsys):
    out = tmp_path / "cli"
    assert synthetic_main(["--out", str(out), "--layers", "2", "--experts", "2", "--hidden", "64",
                           "--intermediate", "32", "--shards", "2"]) == 0
    assert (out / "model-00002-of-00002.safetensors").is_file()
    assert synthetic_main(["--out", str(out)]) == 2  # not empty
    assert "not empty" in capsys.readouterr().out
    assert synthetic_main(["--out", str(tmp_path / "x"), "--hidden", "48"]) == 2
    assert "multiple of 32" in capsys.readouterr().out


def test_vision_tensors_are_what_sglang_builds(ckpt):
    """Names, shapes and dtypes of the vision tower + projector tensors equal the parameters of
    SGLang 0.5.23's own KimiK3VisionTower / KimiK3MultiModalProjector built from the config."""
    from sglang.srt.configs.kimi_k3 import KimiK3Config
    from sglang.srt.models.kimi_k3_vl import KimiK3MultiModalProjector, KimiK3VisionTower

    cfg = json.loads((ckpt / "config.json").read_text())
    k3 = KimiK3Config(**{k: v for k, v in cfg.items() if k not in ("architectures", "model_type")})
    with torch.device("meta"):
        modules = {"vision_tower": KimiK3VisionTower(k3.vision_config), "mm_projector": KimiK3MultiModalProjector(k3.vision_config)}
    expected = {f"{prefix}.{n}": tuple(p.shape) for prefix, m in modules.items() for n, p in m.named_parameters()}
    t = _tensors(ckpt)
    got = {n: tuple(v.shape) for n, v in t.items() if n.startswith(("vision_tower.", "mm_projector."))}
    assert got == expected
    assert all(t[n].dtype == torch.bfloat16 for n in got)
    assert got["vision_tower.patch_embed.proj.weight"] == (64, 3, 14, 14)  # a Conv2d weight
    assert k3.vision_config.qkv_hidden_size != k3.vision_config.vt_hidden_size  # as in K3 (1536 vs 1024)


def test_expert_magnitudes_are_trained_like(ckpt):
    """Each expert matrix has RMS about 1/sqrt(fan_in) (E8M0 maxima where trained weights put
    them), so RMS-1 inputs give O(1) outputs; decoded with ml_dtypes, independent of the package."""
    import ml_dtypes

    t = _tensors(ckpt)
    ratios = []
    for n, packed in t.items():
        m = EXPERT.match(n)
        if not m or m[4] != "weight_packed":
            continue
        p = packed.numpy()
        codes = np.stack([p & 0x0F, p >> 4], axis=-1).reshape(p.shape[0], -1)
        scale = t[n.replace("weight_packed", "weight_scale")].numpy().view(ml_dtypes.float8_e8m0fnu).astype(np.float64)
        w = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64) * np.repeat(scale, 32, axis=1)
        ratios.append(np.sqrt((w**2).mean()) * np.sqrt(w.shape[1]))  # RMS x sqrt(fan_in)
    ratios = np.array(ratios)
    assert len(ratios) == 3 * 6 * 3
    # +-1 binade of per-matrix jitter and +-0.5 of rounding around 1; out-of-range / zero blocks lower it a bit.
    print(f"RMS x sqrt(fan_in): min {ratios.min():.3f} median {np.median(ratios):.3f} max {ratios.max():.3f}")
    assert 0.25 < ratios.min() and ratios.max() < 4 and 0.5 < np.median(ratios) < 2


def test_shards_have_the_mode_of_the_other_files(ckpt):
    """Shards written by safetensors (0600 on their own) get 0666 less the umask, like config.json
    and the cast's output (issue 29, item 11)."""
    import os
    import stat

    umask = os.umask(0)
    os.umask(umask)
    want = 0o666 & ~umask
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in ckpt.iterdir() if p.is_file()}
    assert modes["config.json"] == want
    shards = {n: m for n, m in modes.items() if n.endswith(".safetensors")}
    assert shards and set(shards.values()) == {want}, shards
