"""What ``k3nvfp4-tune`` searches for each kernel mode it tunes: the mode's config class, its
search spaces, where a search starts, the problem's weights, the reference a candidate's output
is checked against, the offline launch check and the tuned-file name. One :class:`TunedMode` per
mode; the search loop itself (kernels/tune.py) is shared.

- "none" (W4A16, MoEConfig): random NVFP4 experts; checked against fused_moe_nvfp4_reference.
- "e4m3" (the Hopper W4A8 mode, W4A8Config; docs/w4a8.md): random MXFP4 experts (the release's
  tensors) prepared by the mode; checked against fused_moe_w4a8_reference, the same quantization
  in plain torch. Its file is per weight block (W4A8Config.tuned_dtype): these weights have
  blocks of 32, so the tuned file serves the MXFP4 release; a cast (NVFP4) checkpoint reads the
  block-16 file, which this tuner does not write (its calls keep the heuristic). The file is
  not per E4M3 table: its times are those of the normal table (these weights' exponents lie
  within 6 binades of each other), and the launch check compiles each config under both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from ..moe_details.config import MoEConfig
from ..moe_w4a8_details.config import TOKEN_TILES, W4A8Config

# W4A16: each stage is field -> candidate values, tried as a product around the best config so
# far; "~" is the block_m ladder with swap_ab (tune._block_m_choices). A value may also be a dict
# of fields set together.
_W4A16_SPACES: dict[str, list[dict[str, list]]] = {
    # CPU / interpreter functional check: 2 configs.
    "tiny": [{"block_n1": [16, 32]}],
    # gpu_check.sh: a few configs per batch size around the heuristic.
    "small": [
        {"block_m": ["~"]},
        {"split_k1": [1, 2, 4]},
        {"split_k2": [1, 2]},
    ],
    "default": [
        {"block_m": ["~"]},
        {"block_n1": [32, 64, 128], "split_k1": [1, 2, 4, 8]},
        {"block_k1": [64, 128, 256], "num_warps1": [4, 8], "num_stages1": [2, 3, 4]},
        {"block_n2": [32, 64, 128, 256], "split_k2": [1, 2, 4]},
        {"block_k2": [64, 128, 256], "num_warps2": [4, 8], "num_stages2": [2, 3, 4]},
        {"atomic_reduce": [False, True]},
    ],
    # Wider staged search (block_m over the whole ladder is still local to the heuristic).
    "wide": [
        {"block_m": ["~"]},
        {"block_n1": [16, 32, 64, 128], "split_k1": [1, 2, 4, 8], "num_warps1": [4, 8]},
        {"block_k1": [64, 128, 256], "num_stages1": [2, 3, 4, 5]},
        {"block_n2": [32, 64, 128, 256], "split_k2": [1, 2, 4, 8], "num_warps2": [4, 8]},
        {"block_k2": [64, 128, 256], "num_stages2": [2, 3, 4, 5]},
        {"atomic_reduce": [False, True]},
    ],
}

# e4m3: block_m and GEMM1's num_warps go together (W4A8Config's TOKEN_TILES: 8 warps hold GEMM1's
# 256-row accumulators at 64 tokens); GEMM2's warps are searched with its column tile. block_n1
# stays 128 (wider GEMM1 tiles spill on sm90); GEMM1's K step is 64 or 128 (128 fits at 16 and 64
# tokens with the fragment-order weights, docs/w4a8.md); the offline launch check drops what
# spills anyway.
_TOKEN_TILES = [{"block_m": bm, "num_warps1": w} for bm, w in TOKEN_TILES]
_W4A8_SPACES: dict[str, list[dict[str, list]]] = {
    "tiny": [{"block_n2": [64, 128]}],
    "small": [
        {"tile": _TOKEN_TILES},
        {"split_k1": [1, 2, 4]},
        {"split_k2": [1, 2]},
    ],
    "default": [
        {"tile": _TOKEN_TILES},
        {"block_k1": [64, 128], "split_k1": [1, 2, 4, 8, 16]},
        {"block_n2": [64, 128], "split_k2": [1, 2, 4, 8], "num_warps2": [4, 8]},
        {"block_k2": [64, 128], "num_stages": [2, 3, 4]},
        {"atomic_reduce": [False, True]},
    ],
    "wide": [
        {"tile": _TOKEN_TILES},
        {"block_k1": [64, 128], "split_k1": [1, 2, 4, 8, 16], "num_stages": [2, 3, 4]},
        {"block_n2": [64, 128, 256], "split_k2": [1, 2, 4, 8, 16], "num_warps2": [4, 8]},
        {"block_k2": [64, 128]},
        {"atomic_reduce": [False, True]},
    ],
}
SPACE_NAMES = tuple(_W4A16_SPACES)
# The weight block the e4m3 tuner's weights have (the MXFP4 release's).
W4A8_TUNED_BLOCK = 32
assert SPACE_NAMES == tuple(_W4A8_SPACES)


def _w4a16_base(space: str, shape, M: int) -> MoEConfig:
    if space == "tiny":
        return MoEConfig(
            block_m=16, swap_ab=False, block_n1=16, block_k1=32, split_k1=1, num_warps1=4, num_stages1=1,
            block_n2=16, block_k2=32, split_k2=1, num_warps2=4, num_stages2=1, atomic_reduce=False,
        )  # fmt: skip
    return MoEConfig.heuristic(shape.E, shape.H, shape.I, shape.top_k, M, num_global_experts=shape.global_experts)


def _w4a8_base(space: str, shape, M: int) -> W4A8Config:
    if space == "tiny":  # the smallest tiles the mode allows, one stage (the interpreter's run)
        return W4A8Config(block_m=16, block_n1=128, block_n2=64, block_k1=64, block_k2=64, num_warps1=4,
                          num_stages=1)
    return W4A8Config.heuristic(shape.E, shape.H, shape.I, shape.top_k, M,
                                num_global_experts=shape.global_experts, weight_block=W4A8_TUNED_BLOCK)


def _w4a16_weights(shape, device, seed: int):
    from ..testing import random_nvfp4_moe_weights

    return random_nvfp4_moe_weights(shape.E, shape.H, shape.I, device=device, seed=seed, block_scales="uniform")


def _w4a8_weights(shape, device, seed: int):
    from ..modes import MODES
    from ..moe_details.weights import MXFP4MoETensors
    from ..testing import random_mxfp4_tensors

    tensors = MXFP4MoETensors(*(t.to(device) for t in random_mxfp4_tensors(shape.E, shape.H, shape.I, seed=seed)))
    return MODES["e4m3"].prepare(tensors)


def _w4a16_reference(x, weights, topk_weights, topk_ids, activation):
    from ..moe import fused_moe_nvfp4_reference

    return fused_moe_nvfp4_reference(x, weights, topk_weights, topk_ids, activation=activation)


def _w4a8_reference(x, weights, topk_weights, topk_ids, activation):
    from ..moe_w4a8_reference import fused_moe_w4a8_reference

    return fused_moe_w4a8_reference(x, weights, topk_weights, topk_ids, activation=activation)


def _w4a16_invalid(cfg: MoEConfig, shape) -> str | None:
    return None  # MoEConfig checks itself when built (tune._expand_stage drops what it refuses)


def _w4a8_invalid(cfg: W4A8Config, shape) -> str | None:
    try:
        cfg.check(shape.H, shape.I)
    except ValueError as e:
        return str(e)
    return None


def _w4a16_measure(kind: str, cfg: MoEConfig, shape, arch: int) -> Any:
    from ..offline.compile import measure_gemm

    return measure_gemm(kind, cfg, shape.H, shape.I, shape.top_k, arch)["loop_cost"]


def _w4a8_measure(kind: str, cfg: W4A8Config, shape, arch: int) -> Any:
    from ..moe_details.e4m3_expand import E4M3_TABLES
    from ..offline.compile_w4a8 import measure_w4a8_gemm
    from ..offline.costs import worst_row
    from ..perf_model import LoopCost

    # The tuned file serves weights of either E4M3 table (W4A8MoEWeights.w13_table), so a config
    # must launch under both: the worse of the two compiles, field by field (as the cost table).
    instr, regs, shared, local = worst_row([measure_w4a8_gemm(kind, cfg, shape.H, shape.I, shape.top_k, arch,
                                                              weight_block=W4A8_TUNED_BLOCK, table=t)
                                            for t in E4M3_TABLES])
    return LoopCost(instr, cfg.warps(kind), regs, shared, local)


def _w4a8_gemm_key(kind: str, cfg: W4A8Config) -> tuple:
    # the GEMM's cost-table tile (every compile knob but split-K) and its split-K
    return cfg.tile(kind), cfg.split_k1 if kind == "gemm1" else cfg.split_k2


def _w4a16_shape_error(shape) -> str | None:
    return None  # TuneShape already requires multiples of 16


def _w4a8_shape_error(shape) -> str | None:
    from ..moe_w4a8_details.weights import W4A8_SHAPE_MULTIPLE

    if shape.H % W4A8_SHAPE_MULTIPLE or shape.I % W4A8_SHAPE_MULTIPLE:
        return f"--mode e4m3 needs H and I multiples of {W4A8_SHAPE_MULTIPLE} (H = {shape.H}, I = {shape.I})"
    return None


def _w4a16_device_error(device: torch.device) -> str | None:
    return None


def _w4a8_device_error(device: torch.device) -> str | None:
    from ..moe_w4a8 import check_w4a8_supported

    try:
        check_w4a8_supported(device)
    except RuntimeError as e:
        return f"--mode e4m3: {e}"
    return None


@dataclass(frozen=True)
class TunedMode:
    """One kernel mode as the tuner sees it.

    name: the mode (K3NVFP4_ACT_QUANT value); config_type: its launch-config class;
    spaces: search space name -> stages (module comments); base: (space, TuneShape, M) -> the
    config the search starts from (the run-time heuristic except for "tiny"); weights:
    (TuneShape, device, seed) -> the mode's prepared weights; reference: (x, weights,
    topk_weights, topk_ids, activation) -> the output a candidate must match; invalid:
    (config, TuneShape) -> why the config cannot run the shape, or None; measure: (kind, config,
    TuneShape, arch) -> the offline compile's perf_model.LoopCost of one GEMM; gemm_key: (kind,
    config) -> what that compile depends on (its cache key); file_dtype: the dtype field of the
    tuned file's name (moe_details.config.config_file_name); shape_error (TuneShape) /
    device_error (a CUDA torch.device): why the mode cannot be tuned there, or None (the CLI's
    one-line refusals, before any work); default_tol: the normwise error a candidate may have
    against the reference (None: the dtype's default, tune.py)."""

    name: str
    config_type: type
    spaces: dict[str, list[dict[str, list]]]
    base: Callable[[str, Any, int], Any]
    weights: Callable[[Any, torch.device, int], Any]
    reference: Callable[..., torch.Tensor]
    invalid: Callable[[Any, Any], str | None]
    measure: Callable[[str, Any, Any, int], Any]
    gemm_key: Callable[[str, Any], Any]
    file_dtype: str
    shape_error: Callable[[Any], str | None]
    device_error: Callable[[torch.device], str | None]
    default_tol: float | None = None


TUNED_MODES: dict[str, TunedMode] = {
    "none": TunedMode("none", MoEConfig, _W4A16_SPACES, _w4a16_base, _w4a16_weights, _w4a16_reference,
                      _w4a16_invalid, _w4a16_measure, lambda kind, cfg: cfg.gemm(kind), "nvfp4",
                      _w4a16_shape_error, _w4a16_device_error),
    # The kernel and its reference round the same fp32 values to E4M3 but not always in the same
    # order of operations: an element near a rounding boundary can land one E4M3 step apart
    # (tests/test_moe_w4a8.py bounds it); 1e-2 normwise is what bench/bench_moe.py checks too.
    "e4m3": TunedMode("e4m3", W4A8Config, _W4A8_SPACES, _w4a8_base, _w4a8_weights, _w4a8_reference,
                      _w4a8_invalid, _w4a8_measure, _w4a8_gemm_key, W4A8Config.tuned_dtype(W4A8_TUNED_BLOCK),
                      _w4a8_shape_error, _w4a8_device_error, default_tol=1e-2),
}
