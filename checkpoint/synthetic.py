"""Synthetic Kimi-K3 MXFP4 checkpoints: the exact release layout, at any size.

The input of the tests, ``make demo`` and the cast benchmark. What it writes mirrors the
Kimi-K3 release (docs/facts.md#kimi-k3-routed-experts, #checkpoint-formats):

- ``config.json`` of a ``KimiK3ForConditionalGeneration`` with a nested ``text_config``
  (SiTU activation, latent MoE sizes, KDA ``linear_attn_config``) whose
  ``quantization_config`` is compressed-tensors ``mxfp4-pack-quantized``, group 32;
- ``model.safetensors.index.json`` and ``model-0000i-of-0000n.safetensors`` shards, split by
  bytes so the experts of one layer may span two shards;
- per routed expert ``language_model.model.layers.N.block_sparse_moe.experts.E.w{1,2,3}``
  ``.weight_packed`` (uint8 [out, in/2]) and ``.weight_scale`` (E8M0 uint8 [out, in/32]);
- layer 0 a dense BF16 MLP; BF16 attention (KDA layers with ``A_log`` stored zero-padded to
  head_dim as float32, MLA every fourth layer), shared experts, latent projections, router,
  norms, embeddings, lm_head;
- a small MoonViT3d vision tower and PatchMergerMLPV2 projector with the names and shapes
  SGLang 0.5.23's Kimi-K3 vision model loads (``kimi_k3_vl.py``: conv patch embedding, fused
  ``wqkv`` / ``wo`` attention with qkv_hidden_size != hidden_size, RMSNorm, bias-free MLP2,
  ``mm_projector.proj.0/proj.2/post_norm``), described by a complete ``vision_config``;
- tokenizer, chat template, generation_config.json and a ``*.py`` modelling file.

Random E2M1 bytes cover all 16 codes (``-0`` = code 8 included). E8M0 exponents spread over
about 12 binades below a per-matrix maximum; ``zero_exponent_fraction`` of the blocks get
byte 0 (2^-127) and ``out_of_range_fraction`` of them lie 18..40 binades below the maximum
(which no NVFP4 scale pair can represent exactly). The maximum sits where trained weights put
it: the matrix's RMS is about 1/sqrt(fan_in) (E8M0 bytes 120..122 for K3's H = 3584 and
I = 3072, a few more for small test sizes), so one MoE layer maps RMS-1 hidden states to
outputs of RMS O(1).
Every tensor is drawn from its own seeded generator, so contents depend on ``seed`` and the
tensor name only, not on the sharding.
"""

from __future__ import annotations

import argparse
import sys
import json
import math
import os
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch
from safetensors.torch import save_file

from ..common.cli import HelpFormatter
from .layout import (
    COMPRESSED_TENSORS_MXFP4_FORMAT,
    CONFIG_FILE,
    INDEX_FILE,
    expert_prefix,
    layer_prefix,
    shard_file_name,
)

_IN_RANGE_SPREAD = 12  # normal blocks: up to this many binades below the maximum
_BELOW_P = 0.25  # binomial(_IN_RANGE_SPREAD, _BELOW_P) binades below the maximum
# RMS of a uniformly random E2M1 code (values 0, .5, 1, 1.5, 2, 3, 4, 6, either sign).
_E2M1_RMS = math.sqrt(sum(v * v for v in (0, 0.5, 1, 1.5, 2, 3, 4, 6)) / 8)
# RMS of 2^-below over the binomial spread: sqrt(E[4^-below]).
_SPREAD_RMS = math.sqrt((1 - _BELOW_P + _BELOW_P / 4) ** _IN_RANGE_SPREAD)
_KMAX_JITTER = 1  # per-matrix maximum: +-1 binade around the fan-in target
_OUT_OF_RANGE_SPREAD = (18, 40)  # beyond the 17 binades an NVFP4 scale pair spans


@dataclass(frozen=True)
class _TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    make: Callable[[np.random.Generator], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape)) * torch.empty(0, dtype=self.dtype).element_size()


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _bf16(shape: tuple[int, ...], std: float | None = None) -> Callable[[np.random.Generator], torch.Tensor]:
    """Gaussian BF16; ``std`` defaults to 1/sqrt(fan_in) (the last dimension), the scale of
    trained projections, so activations stay O(1) through every layer."""
    if std is None:
        std = 1.0 / math.sqrt(shape[-1])

    def make(rng: np.random.Generator) -> torch.Tensor:
        x = rng.standard_normal(shape, dtype=np.float32)
        return torch.from_numpy(x * std).to(torch.bfloat16)

    return make


def _f32(shape: tuple[int, ...], fn: Callable[[np.random.Generator], np.ndarray]) -> Callable:
    def make(rng: np.random.Generator) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(fn(rng), dtype=np.float32).reshape(shape))

    return make


def _ones_bf16(shape: tuple[int, ...]) -> Callable[[np.random.Generator], torch.Tensor]:
    return lambda rng: torch.ones(shape, dtype=torch.bfloat16)


def _packed_e2m1(
    shape: tuple[int, int], scale_make: Callable[[np.random.Generator], torch.Tensor], scale_rng: Callable[[], np.random.Generator]
) -> Callable[[np.random.Generator], torch.Tensor]:
    """Random nibbles (all 16 codes); blocks whose E8M0 byte is 0 hold only +-0, as an MXFP4
    quantizer writes an all-zero block."""

    def make(rng: np.random.Generator) -> torch.Tensor:
        raw = np.frombuffer(rng.bytes(shape[0] * shape[1]), dtype=np.uint8).reshape(shape[0], -1, 16).copy()
        zero = scale_make(scale_rng()).numpy() == 0
        n = int(zero.sum())
        if n:
            signed_zeros = np.array([0x00, 0x08, 0x80, 0x88], dtype=np.uint8)  # (+-0, +-0) nibble pairs
            raw[zero] = signed_zeros[rng.integers(0, 4, size=(n, 16))]
        return torch.from_numpy(raw.reshape(shape))

    return make


def _e8m0_scales(
    shape: tuple[int, int], kmax_byte: int, out_of_range_fraction: float, zero_exponent_fraction: float
) -> Callable[[np.random.Generator], torch.Tensor]:
    def make(rng: np.random.Generator) -> torch.Tensor:
        n = shape[0] * shape[1]
        # Binomial spread: most blocks within a few binades of the maximum, a thin tail lower.
        below = rng.binomial(_IN_RANGE_SPREAD, _BELOW_P, size=n)
        scale = kmax_byte - below
        u = rng.random(n)
        oor = u < out_of_range_fraction
        zero = (u >= out_of_range_fraction) & (u < out_of_range_fraction + zero_exponent_fraction)
        lo, hi = _OUT_OF_RANGE_SPREAD
        scale = np.where(oor, kmax_byte - rng.integers(lo, hi + 1, size=n), scale)
        scale = np.clip(scale, 1, 254)
        scale = np.where(zero, 0, scale)
        return torch.from_numpy(scale.astype(np.uint8).reshape(shape))

    return make


def _kmax_byte(seed: int, key: str, fan_in: int) -> int:
    """E8M0 byte of a matrix's largest block scale: 2^(byte-127) puts the matrix's RMS near
    1/sqrt(fan_in) (what trained weights have), give or take _KMAX_JITTER binades."""
    target = -math.log2(_E2M1_RMS * _SPREAD_RMS * math.sqrt(fan_in))
    jitter = int(_rng(seed, f"kmax.{key}").integers(-_KMAX_JITTER, _KMAX_JITTER, endpoint=True))
    return 127 + round(target) + jitter


@dataclass(frozen=True)
class _ModelShape:
    """Sizes of the synthetic model (arguments of :func:`write_synthetic_checkpoint`, defaults resolved)."""

    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int  # routed experts' H
    intermediate_size: int  # routed experts' I
    model_hidden_size: int  # residual width D
    num_heads: int
    head_dim: int
    vocab_size: int
    num_shared_experts: int
    dense_intermediate_size: int

    @property
    def full_attn_layers(self) -> list[int]:
        """1-based layer numbers with MLA attention: every fourth; the others are KDA."""
        return [n + 1 for n in range(self.num_layers) if (n + 1) % 4 == 0]


def _tensor_plan(
    dims: _ModelShape, *, out_of_range_fraction: float, zero_exponent_fraction: float, seed: int
) -> list[_TensorSpec]:
    D, H, I = dims.model_hidden_size, dims.hidden_size, dims.intermediate_size
    proj = dims.num_heads * dims.head_dim
    specs: list[_TensorSpec] = []

    def bf16(name: str, *shape: int, std: float | None = None) -> None:
        specs.append(_TensorSpec(name, tuple(shape), torch.bfloat16, _bf16(tuple(shape), std)))

    def norm(name: str, n: int) -> None:
        specs.append(_TensorSpec(name, (n,), torch.bfloat16, _ones_bf16((n,))))

    specs.append(_TensorSpec("language_model.model.embed_tokens.weight", (dims.vocab_size, D), torch.bfloat16,
                             _bf16((dims.vocab_size, D), std=1.0)))
    for n in range(dims.num_layers):
        p = layer_prefix(n)
        norm(f"{p}.input_layernorm.weight", D)
        norm(f"{p}.post_attention_layernorm.weight", D)
        a = f"{p}.self_attn"
        if (n + 1) in dims.full_attn_layers:  # MLA
            hd = dims.head_dim
            q_lora, kv_lora, nope, rope, v = 2 * hd, hd, hd // 2, hd // 4, hd // 2
            bf16(f"{a}.q_a_proj.weight", q_lora, D)
            norm(f"{a}.q_a_layernorm.weight", q_lora)
            bf16(f"{a}.q_b_proj.weight", dims.num_heads * (nope + rope), q_lora)
            bf16(f"{a}.kv_a_proj_with_mqa.weight", kv_lora + rope, D)
            norm(f"{a}.kv_a_layernorm.weight", kv_lora)
            bf16(f"{a}.kv_b_proj.weight", dims.num_heads * (nope + v), kv_lora)
            bf16(f"{a}.o_proj.weight", D, dims.num_heads * v)
        else:  # KimiDeltaAttention
            for w in ("q_proj", "k_proj", "v_proj", "g_proj"):
                bf16(f"{a}.{w}.weight", proj, D)
            bf16(f"{a}.b_proj.weight", dims.num_heads, D)
            bf16(f"{a}.f_a_proj.weight", dims.head_dim, D)
            bf16(f"{a}.f_b_proj.weight", proj, dims.head_dim)
            for w in ("q_conv1d", "k_conv1d", "v_conv1d"):
                bf16(f"{a}.{w}.weight", proj, 1, 4, std=0.2)
            # Stored at head_dim: num_heads trained decays, then exact zeros (docs/facts.md#checkpoint-formats).
            specs.append(_TensorSpec(
                f"{a}.A_log", (dims.head_dim,), torch.float32,
                _f32((dims.head_dim,), lambda rng: np.concatenate(
                    [rng.uniform(-1.0, 2.5, dims.num_heads), np.zeros(dims.head_dim - dims.num_heads)])),
            ))
            specs.append(_TensorSpec(f"{a}.dt_bias", (proj,), torch.float32,
                                     _f32((proj,), lambda rng: rng.standard_normal(proj))))
            norm(f"{a}.o_norm.weight", dims.head_dim)
            bf16(f"{a}.o_proj.weight", D, proj)
        if n == 0:  # first_k_dense_replace = 1
            bf16(f"{p}.mlp.gate_proj.weight", dims.dense_intermediate_size, D)
            bf16(f"{p}.mlp.up_proj.weight", dims.dense_intermediate_size, D)
            bf16(f"{p}.mlp.down_proj.weight", D, dims.dense_intermediate_size)
            continue
        m = f"{p}.block_sparse_moe"
        bf16(f"{m}.gate.weight", dims.num_experts, D)
        specs.append(_TensorSpec(f"{m}.gate.e_score_correction_bias", (dims.num_experts,), torch.float32,
                                 _f32((dims.num_experts,), lambda rng: rng.standard_normal(dims.num_experts) * 0.01)))
        shared_i = I * dims.num_shared_experts
        bf16(f"{m}.shared_experts.gate_proj.weight", shared_i, D)
        bf16(f"{m}.shared_experts.up_proj.weight", shared_i, D)
        bf16(f"{m}.shared_experts.down_proj.weight", D, shared_i)
        bf16(f"{m}.routed_expert_down_proj.weight", H, D)
        bf16(f"{m}.routed_expert_up_proj.weight", D, H)
        for e in range(dims.num_experts):
            # w2 gets its own maximum (its own scale_2); w1/w3 share one.
            kmax = _kmax_byte(seed, f"{n}.{e}", fan_in=H)
            kmax_w2 = _kmax_byte(seed, f"w2.{n}.{e}", fan_in=I)
            for w, (rows, cols), k in (("w1", (I, H), kmax), ("w3", (I, H), kmax), ("w2", (H, I), kmax_w2)):
                base = f"{expert_prefix(n, e)}.{w}"
                scale_make = _e8m0_scales((rows, cols // 32), k, out_of_range_fraction, zero_exponent_fraction)
                scale_name = f"{base}.weight_scale"
                specs.append(_TensorSpec(
                    f"{base}.weight_packed", (rows, cols // 2), torch.uint8,
                    _packed_e2m1((rows, cols // 2), scale_make, lambda name=scale_name: _rng(seed, name)),
                ))
                specs.append(_TensorSpec(scale_name, (rows, cols // 32), torch.uint8, scale_make))
    specs.append(_TensorSpec("language_model.model.norm.weight", (D,), torch.bfloat16, _ones_bf16((D,))))
    specs.append(_TensorSpec("language_model.lm_head.weight", (dims.vocab_size, D), torch.bfloat16,
                             _bf16((dims.vocab_size, D))))
    _vision_tensors(specs, D)
    return specs


@dataclass(frozen=True)
class _VisionShape:
    """The synthetic vision tower: K3's structure (qkv width != hidden width, 2x2 patch merge)
    at a token size."""

    hidden: int = 64  # vt_hidden_size
    qkv_hidden: int = 96  # qkv_hidden_size (K3: 1536 against a 1024-wide tower)
    heads: int = 2
    layers: int = 2
    intermediate: int = 128
    patch: int = 14
    pos_emb: int = 8  # init_pos_emb_height = init_pos_emb_width
    pos_emb_time: int = 4
    merge: int = 2  # merge_kernel_size (merge x merge patches per projector row)


_VISION = _VisionShape()


def _vision_tensors(specs: list[_TensorSpec], text_hidden: int) -> None:
    """Vision tower + projector tensors, named and shaped as SGLang's KimiK3VisionTower /
    KimiK3MultiModalProjector parameters (bias-free, RMSNorm weights only)."""
    v = _VISION

    def add(name: str, *shape: int, std: float | None = None) -> None:
        specs.append(_TensorSpec(name, tuple(shape), torch.bfloat16, _bf16(tuple(shape), std)))

    def norm(name: str, n: int) -> None:
        specs.append(_TensorSpec(name, (n,), torch.bfloat16, _ones_bf16((n,))))

    # Conv2d with stride = kernel: fan-in 3 x patch x patch.
    add("vision_tower.patch_embed.proj.weight", v.hidden, 3, v.patch, v.patch, std=1 / math.sqrt(3 * v.patch**2))
    add("vision_tower.patch_embed.pos_emb.weight", v.pos_emb, v.pos_emb, v.hidden, std=0.02)
    for b in range(v.layers):
        blk = f"vision_tower.encoder.blocks.{b}"
        norm(f"{blk}.norm0.weight", v.hidden)
        norm(f"{blk}.norm1.weight", v.hidden)
        add(f"{blk}.wqkv.weight", 3 * v.qkv_hidden, v.hidden)
        add(f"{blk}.wo.weight", v.hidden, v.qkv_hidden)
        add(f"{blk}.mlp.fc0.weight", v.intermediate, v.hidden)
        add(f"{blk}.mlp.fc1.weight", v.hidden, v.intermediate)
    norm("vision_tower.encoder.final_layernorm.weight", v.hidden)
    merged = v.hidden * v.merge * v.merge
    add("mm_projector.proj.0.weight", merged, merged)
    add("mm_projector.proj.2.weight", text_hidden, merged)
    norm("mm_projector.post_norm.weight", text_hidden)


def _vision_config(text_hidden: int) -> dict:
    """``vision_config`` with every key SGLang's KimiK3VisionConfig reads (its defaults are the
    release's 27-layer, 1024-wide tower, so a small tower must state them all)."""
    v = _VISION
    return {
        "model_type": "kimi_k3_vision",
        "patch_size": v.patch,
        "init_pos_emb_height": v.pos_emb,
        "init_pos_emb_width": v.pos_emb,
        "init_pos_emb_time": v.pos_emb_time,
        "pos_emb_type": "divided_fixed",
        "pos_emb_interpolation_mode": "bilinear",
        "vt_hidden_size": v.hidden,
        "vt_num_attention_heads": v.heads,
        "vt_num_hidden_layers": v.layers,
        "vt_intermediate_size": v.intermediate,
        "qkv_hidden_size": v.qkv_hidden,
        "merge_kernel_size": [v.merge, v.merge],
        "merge_type": "sd2_tpool",
        "video_attn_type": "spatial_temporal",
        "mm_projector_type": "patchmergerv2",
        "mm_hidden_size": v.hidden,
        "projector_hidden_act": "gelu",
        "projector_ln_eps": 1e-5,
        "norm_type": "rmsnorm",
        "attn_bias": False,
        "patch_embed_proj_bias": False,
        "mlp_type": "mlp2",
        "linear_bias": False,
        "activation_func": "gelu_pytorch_tanh",
        "text_hidden_size": text_hidden,
    }


def _split_shards(specs: list[_TensorSpec], num_shards: int) -> list[list[_TensorSpec]]:
    """Contiguous split by bytes; each cut is then moved into the nearest run of one layer's
    expert tensors, so experts of a layer (even one matrix's packed/scale pair) span shards,
    as in the release."""
    total = sum(s.nbytes for s in specs)
    cuts, acc = [], 0
    for i, s in enumerate(specs):
        if len(cuts) < num_shards - 1 and acc * num_shards >= total * (len(cuts) + 1) and i > 0:
            cuts.append(i)
        acc += s.nbytes
    runs, start, run_layer = [], None, None  # [start, end) of consecutive expert tensors of one layer
    for i, s in enumerate(specs + [None]):
        layer = s.name.split(".experts.")[0] if s is not None and ".experts." in s.name else None
        if start is not None and layer != run_layer:
            runs.append((start, i))
            start = None
        if layer is not None and start is None:
            start, run_layer = i, layer
    for k, cut in enumerate(cuts):
        lo = cuts[k - 1] if k else 0
        hi = cuts[k + 1] if k + 1 < len(cuts) else len(specs)
        # a + odd offset: between a matrix's weight_packed and its weight_scale.
        mids = [m for a, b in runs if b - a >= 2 and lo < (m := a + ((b - a) // 2 | 1)) < hi]
        if mids:
            cuts[k] = min(mids, key=lambda m: abs(m - cut))
    bounds = [0, *cuts, len(specs)]
    return [specs[a:b] for a, b in zip(bounds, bounds[1:]) if b > a]


def _config(dims: _ModelShape) -> dict:
    kda_layers = [n + 1 for n in range(dims.num_layers) if (n + 1) not in dims.full_attn_layers]
    quant = {
        "quant_method": "compressed-tensors",
        "format": COMPRESSED_TENSORS_MXFP4_FORMAT,
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "format": COMPRESSED_TENSORS_MXFP4_FORMAT,
                "targets": ["re:.*block_sparse_moe\\.experts\\.\\d+\\.w[123]$"],
                "weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 32,
                            "symmetric": True, "dynamic": False, "scale_dtype": "torch.uint8"},
                "input_activations": None,
                "output_activations": None,
            }
        },
        "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\..*",
                   "re:vision_tower.*", "re:mm_projector.*"],
    }
    text = {
        "model_type": "kimi_linear",
        "architectures": ["KimiLinearForCausalLM"],
        "vocab_size": dims.vocab_size,
        "hidden_size": dims.model_hidden_size,
        "intermediate_size": dims.dense_intermediate_size,
        "num_hidden_layers": dims.num_layers,
        "num_attention_heads": dims.num_heads,
        "num_key_value_heads": dims.num_heads,
        "head_dim": dims.head_dim,
        "hidden_act": "situ",
        "activation_situ_beta": 4.0,
        "activation_situ_linear_beta": 25.0,
        "num_experts": dims.num_experts,
        "num_experts_per_token": dims.top_k,
        "moe_intermediate_size": dims.intermediate_size,
        "routed_expert_hidden_size": dims.hidden_size,
        "num_shared_experts": dims.num_shared_experts,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 1.0,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "q_lora_rank": 2 * dims.head_dim,
        "kv_lora_rank": dims.head_dim,
        "qk_nope_head_dim": dims.head_dim // 2,
        "qk_rope_head_dim": dims.head_dim // 4,
        "v_head_dim": dims.head_dim // 2,
        "mla_use_nope": True,
        "linear_attn_config": {
            "kda_layers": kda_layers,
            "full_attn_layers": dims.full_attn_layers,
            "num_heads": dims.num_heads,
            "head_dim": dims.head_dim,
            "short_conv_kernel_size": 4,
            "use_full_rank_gate": True,
        },
        "rms_norm_eps": 1e-5,
        "rope_theta": 50000.0,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "quantization_config": quant,
    }
    return {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "auto_map": {
            "AutoConfig": "configuration_kimi_k3.KimiK3Config",
            "AutoModelForCausalLM": "modeling_kimi_linear.KimiK3ForConditionalGeneration",
        },
        "text_config": text,
        "vision_config": _vision_config(dims.model_hidden_size),
        "media_placeholder_token_id": min(163605, dims.vocab_size - 1),
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.1",
    }


_SIDE_FILES = {
    "generation_config.json": json.dumps({"bos_token_id": 1, "eos_token_id": 2, "max_new_tokens": 4096}, indent=2),
    "tokenizer_config.json": json.dumps(
        {"tokenizer_class": "TikTokenTokenizer", "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
         "bos_token": "[BOS]", "eos_token": "[EOS]", "model_max_length": 4096}, indent=2),
    "tiktoken.model": "IQ== 0\nIg== 1\nIw== 2\nJA== 3\n",
    "chat_template.jinja": "{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['content'] }}<|im_end|>{% endfor %}"
                           "{% if add_generation_prompt %}<|im_assistant|>{% endif %}\n",
    "tokenization_kimi.py": '"""Synthetic stand-in for the release tokenizer code."""\n',
    "configuration_kimi_k3.py": '"""Synthetic stand-in for the release configuration code."""\n',
    "modeling_kimi_linear.py": '"""Synthetic stand-in for the release modelling code."""\n',
    "README.md": "Synthetic Kimi-K3 MXFP4 checkpoint written by k3nvfp4.checkpoint.synthetic.\n",
}


def _umask_mode(path: Path) -> None:
    """Give a file safetensors wrote (mode 0600) the mode the other files get, 0666 less the umask,
    as the cast's output shards have."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def write_synthetic_checkpoint(
    out_dir: str | os.PathLike,
    *,
    num_layers: int = 2,
    num_experts: int = 8,
    hidden_size: int = 256,
    intermediate_size: int = 128,
    num_shards: int = 3,
    out_of_range_fraction: float = 0.0,
    zero_exponent_fraction: float = 0.01,
    seed: int = 0,
    top_k: int = 4,
    model_hidden_size: int | None = None,
    num_heads: int = 6,
    head_dim: int = 8,
    vocab_size: int = 256,
    num_shared_experts: int = 2,
    dense_intermediate_size: int | None = None,
    progress: bool = False,
) -> Path:
    """Write a synthetic Kimi-K3 MXFP4 checkpoint to ``out_dir`` (created; must be empty or absent).

    num_layers: hidden layers in all (layer 0 is the dense MLP, layers 1.. are MoE);
    hidden_size / intermediate_size: the routed experts' H and I (w1/w3 [I, H], w2 [H, I]),
    multiples of 32; model_hidden_size: the residual width (default 2 * hidden_size, the
    latent-MoE ratio of K3); num_heads <= head_dim: KDA heads (A_log padded to head_dim).
    Every fourth layer (1-based) uses MLA attention, the others KDA.
    Returns the checkpoint directory.
    """
    if num_layers < 2:
        raise ValueError(f"num_layers={num_layers}: need >= 2 (layer 0 is dense, MoE layers start at 1)")
    for arg, v in (("hidden_size", hidden_size), ("intermediate_size", intermediate_size)):
        if v <= 0 or v % 32:
            raise ValueError(f"{arg}={v}: must be a positive multiple of 32 (the MXFP4 block)")
    if num_heads > head_dim:
        raise ValueError(f"num_heads={num_heads} > head_dim={head_dim}: A_log is stored padded to head_dim")
    if not 0.0 <= out_of_range_fraction + zero_exponent_fraction <= 1.0:
        raise ValueError("out_of_range_fraction + zero_exponent_fraction must lie in [0, 1]")
    out = Path(out_dir)
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out}: exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    dims = _ModelShape(
        num_layers=num_layers, num_experts=num_experts, top_k=top_k, hidden_size=hidden_size,
        intermediate_size=intermediate_size, model_hidden_size=model_hidden_size or 2 * hidden_size,
        num_heads=num_heads, head_dim=head_dim, vocab_size=vocab_size, num_shared_experts=num_shared_experts,
        dense_intermediate_size=dense_intermediate_size or 2 * intermediate_size,
    )
    specs = _tensor_plan(dims, out_of_range_fraction=out_of_range_fraction,
                         zero_exponent_fraction=zero_exponent_fraction, seed=seed)
    shards = _split_shards(specs, num_shards)
    weight_map: dict[str, str] = {}
    bar = None
    if progress:
        from ..common.progress import progress_bar

        bar = progress_bar(sum(s.nbytes for s in specs), "synthetic", unit="B", unit_scale=True)
    for i, shard in enumerate(shards):
        fname = shard_file_name(i, len(shards))
        tensors = {}
        for s in shard:
            t = s.make(_rng(seed, s.name))
            assert tuple(t.shape) == s.shape and t.dtype == s.dtype, s.name
            tensors[s.name] = t
            weight_map[s.name] = fname
        save_file(tensors, str(out / fname), metadata={"format": "pt"})
        _umask_mode(out / fname)
        del tensors
        if bar is not None:
            bar.update(sum(s.nbytes for s in shard))
    if bar is not None:
        bar.close()
    index = {"metadata": {"total_size": sum(s.nbytes for s in specs)}, "weight_map": dict(sorted(weight_map.items()))}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    cfg = _config(dims)
    (out / CONFIG_FILE).write_text(json.dumps(cfg, indent=2) + "\n")
    for name, text in _SIDE_FILES.items():
        (out / name).write_text(text)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3nvfp4.checkpoint.synthetic", description=__doc__.split("\n")[0],
                                 formatter_class=HelpFormatter)
    ap.add_argument("--out", required=True, help="output directory (absent or empty)")
    ap.add_argument("--layers", type=int, default=2, help="hidden layers incl. the dense layer 0")
    ap.add_argument("--experts", type=int, default=8, help="routed experts per MoE layer")
    ap.add_argument("--hidden", type=int, default=256, help="routed-expert hidden size H")
    ap.add_argument("--intermediate", type=int, default=128, help="routed-expert intermediate size I")
    ap.add_argument("--model-hidden", type=int, default=None, help="residual width (default 2*H)")
    ap.add_argument("--top-k", type=int, default=4, help="experts per token")
    ap.add_argument("--shards", type=int, default=3, help="safetensors shards to spread the tensors over")
    ap.add_argument("--out-of-range-fraction", type=float, default=0.0,
                    help="fraction of MXFP4 blocks more than 17 binades below their matrix's largest "
                         "(the cast re-quantizes those)")
    ap.add_argument("--zero-exponent-fraction", type=float, default=0.01,
                    help="fraction of blocks stored with E8M0 exponent 0 (all-zero blocks)")
    ap.add_argument("--seed", type=int, default=0, help="random seed of the tensors")
    args = ap.parse_args(argv)
    from ..common.outputs import OutputPathError, check_output_dir

    try:
        check_output_dir(args.out, "--out")
    except OutputPathError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        path = write_synthetic_checkpoint(
            args.out, num_layers=args.layers, num_experts=args.experts, hidden_size=args.hidden,
            intermediate_size=args.intermediate, model_hidden_size=args.model_hidden, top_k=args.top_k,
            num_shards=args.shards, out_of_range_fraction=args.out_of_range_fraction,
            zero_exponent_fraction=args.zero_exponent_fraction, seed=args.seed, progress=True,
        )
    except (ValueError, FileExistsError) as exc:
        print(f"error: {exc}")
        return 2
    size = sum(f.stat().st_size for f in path.iterdir())
    print(f"wrote {path} ({size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
