"""The SGLang plugin (``--moe-runner-backend triton_situ``) against the installed sglang 0.5.23.

CPU only: the Triton kernels run in the interpreter (TRITON_INTERPRET=1, conftest.py). One
pytest process holds the single-rank layer tests; fresh processes are spawned only where a
test needs fresh registries (plugin exclusion, bad timeout) or a "spawn" child (as SGLang's
schedulers are started). Importing sglang costs about 12 s per process, so those are few and
shared. TP2 and EP2 over two gloo ranks are tests/test_model_class.py's (test_tp2_and_ep2: the
cast and the release through SGLang's model class, every rank's block output against the
independent reference, both ranks' outputs bit-equal, every tensor landed once).
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import socket
import subprocess
import sys
import textwrap
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from k3nvfp4.kernels.activation import ActivationKind, GatedActivation

PLUGIN = "k3nvfp4"
BACKEND = "triton_situ"
MOE_LAYER = 1  # layer 0 of a K3 checkpoint is the dense MLP
# Tiny K3-shaped MoE: H=64, I=64 (I per rank 32 under TP2), 8 experts, top-4.
CKPT_SHAPE = dict(num_layers=2, num_experts=8, hidden_size=64, intermediate_size=64, top_k=4)
NUM_TOKENS = 6
SEED = 1234
# fp32 activations run the kernels with IEEE fp32 dots: only summation order differs from
# SGLang's fp32 reference. bf16 activations round the GEMM1/SiTU intermediate to bf16 (the
# interpreter truncates) and the output to bf16.
FP32_TOL = 2e-6  # max |out - ref| / max |ref|; measured 3.3e-7 (trained-like synthetic magnitudes)
BF16_TOL = 1.5e-2  # measured 3.5e-3
# Short name -> SGLang's ModelOpt NVFP4 MoE parameter.
MODELOPT_PARAMS = {
    "w13": "w13_weight", "w13_scale": "w13_weight_scale", "w13_scale_2": "w13_weight_scale_2",
    "w2": "w2_weight", "w2_scale": "w2_weight_scale", "w2_scale_2": "w2_weight_scale_2",
}


def _child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["TRITON_INTERPRET"] = "1"
    env["PYTHONSAFEPATH"] = "1"
    env.update(extra)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- independent NVFP4 decoding for the reference (ml_dtypes' float4_e2m1fn) -----------------


def _e2m1_table() -> torch.Tensor:
    import ml_dtypes

    return torch.from_numpy(np.arange(16, dtype=np.uint8).view(ml_dtypes.float4_e2m1fn).astype(np.float32))


def _dequant(packed: torch.Tensor, scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """[..., rows, K/2] u8 nibbles (low = even element), [..., rows, K/16] e4m3, scale_2
    broadcastable to [..., rows, 1] -> fp32 [..., rows, K]."""
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()
    return _e2m1_table()[codes] * scale.float().repeat_interleave(16, dim=-1) * scale_2


def _dense_modelopt(t: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense fp32 w13 [E, 2I, H] (gate rows scaled by scale_2[:, 0], up rows by [:, 1]) and w2 [E, H, I]."""
    E, two_i, _ = t["w13"].shape
    half = torch.arange(two_i) >= two_i // 2
    s13 = torch.where(half[None, :], t["w13_scale_2"][:, 1:2], t["w13_scale_2"][:, 0:1])  # [E, 2I]
    w13 = _dequant(t["w13"], t["w13_scale"], s13[..., None])
    w2 = _dequant(t["w2"], t["w2_scale"], t["w2_scale_2"][:, None, None])
    return w13, w2


def _sglang_reference(w13: torch.Tensor, w2: torch.Tensor, x: torch.Tensor, topk_output, runner_config) -> torch.Tensor:
    """SGLang's own torch MoE (moe_forward_native with SituAndMul) on dense weights."""
    from sglang.srt.layers.moe.fused_moe_native import moe_forward_native

    dense = types.SimpleNamespace(num_experts=w13.shape[0], w13_weight=w13.to(x.dtype), w2_weight=w2.to(x.dtype))
    return moe_forward_native(dense, x, topk_output, runner_config)


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


# --- SGLang's layer, built and loaded as the model loader does --------------------------------


def _checkpoint_quant_config(ckpt: Path):
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp4Config

    cfg = json.loads((ckpt / "config.json").read_text())
    qcfg = cfg.get("quantization_config") or cfg["text_config"]["quantization_config"]
    return ModelOptFp4Config.from_config(qcfg), cfg.get("text_config", cfg)


def _expert_tensors(ckpt: Path, layer: int) -> list[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) of every routed-expert tensor of ``layer``, read from the shards."""
    from safetensors import safe_open

    weight_map = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    marker = f"model.layers.{layer}.block_sparse_moe.experts."
    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        if marker in name:
            by_shard.setdefault(shard, []).append(name)
    out = []
    for shard, names in sorted(by_shard.items()):
        with safe_open(str(ckpt / shard), framework="pt") as f:
            out += [(n, f.get_tensor(n)) for n in sorted(names)]
    assert out, f"no expert tensors of layer {layer} in {ckpt}"
    return out


def _build_layer(ckpt: Path, layer_idx: int, *, intermediate_size: int | None = None):
    """SGLang's FusedMoE with ModelOptFp4Config from the cast tool's config.json (not loaded)."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    qc, text = _checkpoint_quant_config(ckpt)
    prefix = f"language_model.model.layers.{layer_idx}.block_sparse_moe.experts"
    return FusedMoE(
        num_experts=text["num_experts"],
        hidden_size=text["routed_expert_hidden_size"],
        intermediate_size=intermediate_size or text["moe_intermediate_size"],
        layer_id=layer_idx,
        top_k=text["num_experts_per_token"],
        params_dtype=torch.bfloat16,
        reduce_results=False,
        quant_config=qc,
        prefix=prefix,
        activation=text["hidden_act"],
        gemm1_alpha=text["activation_situ_beta"],
        gemm1_clamp_limit=text["activation_situ_linear_beta"],
        routed_scaling_factor=text["routed_scaling_factor"],
        gate_up_interleaved=False,
    )


def _load_layer(layer, ckpt: Path, layer_idx: int) -> None:
    """Checkpoint name ...experts.{e}.{w1|w3|w2}.{suffix} -> ...experts.{w13|w2}_{suffix}, then
    SGLang's own param.weight_loader(param, tensor, name, shard_id, expert_id) (TP/EP sharding
    happens inside it)."""
    for name, tensor in _expert_tensors(ckpt, layer_idx):
        head, expert, shard_id, suffix = name.rsplit(".", 3)
        fused = "w13" if shard_id in ("w1", "w3") else "w2"
        param = getattr(layer, f"{fused}_{suffix}")
        param.weight_loader(param, tensor, f"{head}.{fused}_{suffix}", shard_id=shard_id, expert_id=int(expert))


def _inputs(hidden: int, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(SEED)
    x = torch.randn(NUM_TOKENS, hidden, generator=g)
    logits = torch.randn(NUM_TOKENS, num_experts, generator=g)
    return x, logits


def _route(layer, x: torch.Tensor, logits: torch.Tensor):
    from sglang.srt.layers.moe.topk import TopK

    topk = TopK(top_k=layer.top_k, layer_id=layer.layer_id, renormalize=True)
    topk.bind_runner_backend(layer.runner_backend)
    return topk.forward_native(x, logits)


def _forward(layer, x: torch.Tensor, logits: torch.Tensor) -> dict[str, torch.Tensor]:
    return {dt: layer.forward(x.to(getattr(torch, dt)), _route(layer, x, logits)) for dt in ("float32", "bfloat16")}


def _init_one_rank(port: int) -> None:
    """SGLang's distributed state for one gloo rank (TP1, EP1) with this backend."""
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.layers.moe.utils import initialize_moe_config
    from sglang.test.test_utils import publish_build_topology

    if parallel_state._WORLD is None:
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, backend="gloo", distributed_init_method=f"tcp://127.0.0.1:{port}",
        )
    publish_build_topology(world_rank=0, tp_size=1, ep_size=1, pp_size=1, moe_runner_backend=BACKEND)
    initialize_model_parallel(backend="gloo")
    initialize_moe_config()


# --- fixtures ----------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def nvfp4_checkpoint(tmp_path_factory) -> Path:
    """A tiny synthetic K3 MXFP4 checkpoint cast to NVFP4 by the project's cast CLI."""
    from k3nvfp4.checkpoint.cli import main as cast_main
    from k3nvfp4.checkpoint.synthetic import write_synthetic_checkpoint

    root = tmp_path_factory.mktemp("k3ckpt")
    src = write_synthetic_checkpoint(root / "mxfp4", num_shards=2, seed=7, **CKPT_SHAPE)
    out = root / "nvfp4"
    assert cast_main(["--source_ckpt", str(src), "--output_ckpt", str(out), "--workers", "1", "--no-progress"]) == 0
    return out


@pytest.fixture(scope="session")
def sglang_plugins():
    """SGLang's load_plugins() in this process, finding the plugin through its entry point."""
    old = os.environ.get("SGLANG_PLUGINS")
    os.environ["SGLANG_PLUGINS"] = PLUGIN  # SGLang's whitelist; keeps other installed plugins out
    try:
        from sglang.srt.plugins import load_plugins

        load_plugins()
    finally:
        if old is None:
            os.environ.pop("SGLANG_PLUGINS", None)
        else:
            os.environ["SGLANG_PLUGINS"] = old
    from sglang.srt.server_args import MOE_RUNNER_BACKEND_CHOICES

    assert BACKEND in MOE_RUNNER_BACKEND_CHOICES, "load_plugins() did not run the k3nvfp4 plugin"


@pytest.fixture(scope="session")
def one_rank(sglang_plugins):
    """SGLang's distributed state for one CPU rank with --moe-runner-backend triton_situ."""
    _init_one_rank(_free_port())


@pytest.fixture(scope="session")
def single_rank_run(one_rank, nvfp4_checkpoint):
    """The whole layer on one rank: (layer, checkpoint tensors, inputs, outputs, log records)."""
    from k3nvfp4.checkpoint.layer import load_moe_layer_nvfp4
    from k3nvfp4.sglang_ext import backend_triton

    layer = _build_layer(nvfp4_checkpoint, MOE_LAYER)
    _load_layer(layer, nvfp4_checkpoint, MOE_LAYER)
    loaded = {n: getattr(layer, param).data.clone() for n, param in MODELOPT_PARAMS.items()}
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    hooks_logger = logging.getLogger(backend_triton.__name__)
    hooks_logger.addHandler(handler)
    old_level = hooks_logger.level
    hooks_logger.setLevel(logging.INFO)
    backend_triton._logged_active = False
    try:
        layer.quant_method.process_weights_after_loading(layer)
    finally:
        hooks_logger.removeHandler(handler)
        hooks_logger.setLevel(old_level)
    x, logits = _inputs(layer.hidden_size, layer.num_experts)
    ckpt = load_moe_layer_nvfp4(nvfp4_checkpoint, MOE_LAYER)
    return types.SimpleNamespace(layer=layer, loaded=loaded, ckpt=ckpt, x=x, logits=logits,
                                 out=_forward(layer, x, logits), records=records)


# --- registration ------------------------------------------------------------------------------


def test_entry_point_is_installed():
    from importlib.metadata import entry_points

    eps = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert eps.get(PLUGIN) == "k3nvfp4.sglang_ext:register"


def test_plugin_import_is_light():
    """Importing the entry point's module pulls neither sglang nor triton nor torch."""
    code = "import sys, k3nvfp4.sglang_ext as m; print(sorted(k for k in ('sglang','triton','torch') if k in sys.modules))"
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120, env=_child_env())
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_server_args_accept_triton_situ(sglang_plugins):
    from sglang.srt.server_args import prepare_server_args

    args = prepare_server_args(["--model-path", "/nonexistent/kimi-k3-nvfp4", "--moe-runner-backend", BACKEND])
    assert args.moe_runner_backend == BACKEND


def test_register_is_idempotent(sglang_plugins):
    from sglang.srt.layers.moe.moe_runner.runner import _CUSTOM_RUNNER_CORE_FACTORIES
    from sglang.srt.plugins.hook_registry import HookRegistry
    from sglang.srt.server_args import MOE_RUNNER_BACKEND_CHOICES

    import k3nvfp4.sglang_ext as ext

    n_hooks = sum(len(v) for v in HookRegistry._hooks.values())
    ext.register()
    ext.register()
    assert MOE_RUNNER_BACKEND_CHOICES.count(BACKEND) == 1
    assert BACKEND in _CUSTOM_RUNNER_CORE_FACTORIES
    assert sum(len(v) for v in HookRegistry._hooks.values()) == n_hooks


_EXCLUDED_SCRIPT = textwrap.dedent(
    """
    import os, sys
    import sglang.srt.plugins as plugins
    from sglang.srt.server_args import prepare_server_args
    os.environ["SGLANG_PLUGINS"] = "some-other-plugin"
    plugins.load_plugins()
    try:
        prepare_server_args(["--model-path", "/nonexistent/m", "--moe-runner-backend", "triton_situ"])
        print("RESULT accepted")
    except SystemExit as e:
        print("RESULT rejected", e.code)
    # Second round, same process: the plugin selected but with an invalid timeout. SGLang's
    # load_plugins() swallows Exceptions from plugins; the plugin must still stop the launch.
    os.environ["SGLANG_PLUGINS"] = "k3nvfp4"
    os.environ["K3NVFP4_LOAD_TIMEOUT_S"] = "ten minutes"
    plugins._plugins_loaded = False
    try:
        plugins.load_plugins()
        print("RESULT timeout-accepted")
    except SystemExit as e:
        print("RESULT timeout-rejected", e.code)
    """
)


def test_excluded_plugin_rejects_backend_and_bad_timeout_stops_launch():
    out = subprocess.run(
        [sys.executable, "-P", "-c", _EXCLUDED_SCRIPT], capture_output=True, text=True, timeout=300,
        env=_child_env(), cwd="/",
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
    assert out.returncode == 0, out.stderr[-3000:]
    assert lines[0] == "RESULT rejected 2", (lines, out.stderr[-3000:])
    assert "invalid choice: 'triton_situ'" in out.stderr
    assert lines[1].startswith("RESULT timeout-rejected"), lines
    assert "K3NVFP4_LOAD_TIMEOUT_S='ten minutes' is not a number" in lines[1]


def test_spawn_child_sees_backend_and_timeout():
    """A multiprocessing "spawn" child (how SGLang starts schedulers) calling load_plugins()."""
    import multiprocessing

    from k3nvfp4.sglang_ext import selfcheck

    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    saved = {k: os.environ.get(k) for k in ("SGLANG_PLUGINS", "K3NVFP4_LOAD_TIMEOUT_S")}
    os.environ["SGLANG_PLUGINS"] = PLUGIN
    os.environ["K3NVFP4_LOAD_TIMEOUT_S"] = "7200"
    try:
        proc = ctx.Process(target=selfcheck.probe_into_queue, args=(queue,))
        proc.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    status = queue.get(timeout=300)
    proc.join(timeout=60)
    assert proc.exitcode == 0
    assert status == {
        "backend_choice": True,
        "runner_core": True,
        "hooks": {
            **{f"ModelOptNvFp4FusedMoEMethod.{m}": True
               for m in ("__init__", "create_weights", "process_weights_after_loading", "apply")},
            **{f"Mxfp4MoEMethod.{m}": True
               for m in ("__init__", "create_weights", "process_weights_after_loading", "create_moe_runner", "apply")},
        },
        "unbalanced_loading_timeout_s": 7200.0,
    }


# --- the load timeout --------------------------------------------------------------------------


@pytest.mark.parametrize("raw", ["abc", "0", "-30", "nan", "inf", "12s"])
def test_load_timeout_rejects_bad_values(raw):
    from k3nvfp4.sglang_ext.load_timeout import LoadTimeoutError, parse_load_timeout

    with pytest.raises(LoadTimeoutError, match="K3NVFP4_LOAD_TIMEOUT_S"):
        parse_load_timeout({"K3NVFP4_LOAD_TIMEOUT_S": raw})


def test_load_timeout_sets_sglang_global(sglang_plugins):
    from sglang.srt.model_executor.model_runner_components import load_model_utils

    from k3nvfp4.sglang_ext.load_timeout import apply_load_timeout, parse_load_timeout

    assert parse_load_timeout({}) is None and parse_load_timeout({"K3NVFP4_LOAD_TIMEOUT_S": " "}) is None
    before = load_model_utils.UNBALANCED_MODEL_LOADING_TIMEOUT_S
    try:
        assert apply_load_timeout({"K3NVFP4_LOAD_TIMEOUT_S": "5400"}) == 5400.0
        assert load_model_utils.UNBALANCED_MODEL_LOADING_TIMEOUT_S == 5400.0
        assert apply_load_timeout({}) is None  # unset: SGLang's value is left alone
        assert load_model_utils.UNBALANCED_MODEL_LOADING_TIMEOUT_S == 5400.0
    finally:
        load_model_utils.UNBALANCED_MODEL_LOADING_TIMEOUT_S = before


# --- the real layer on one rank ----------------------------------------------------------------


def test_layer_uses_plugin_runner(single_rank_run):
    from k3nvfp4.sglang_ext.runner import TritonSituRunnerCore

    layer = single_rank_run.layer
    assert type(layer.quant_method).__name__ == "ModelOptNvFp4FusedMoEMethod"
    assert layer.runner_backend.value == BACKEND
    assert isinstance(layer.runner.runner_core, TritonSituRunnerCore)
    assert layer.runner.runner_core.activation == GatedActivation.situ(4.0, 25.0)


def test_loaded_tensors_match_checkpoint(single_rank_run):
    """SGLang's weight_loader put the cast tool's tensors where the ModelOpt layout says."""
    ck, loaded = single_rank_run.ckpt.weights.to_modelopt(), single_rank_run.loaded
    assert torch.equal(loaded["w13"], ck.w13) and torch.equal(loaded["w2"], ck.w2)
    assert torch.equal(loaded["w13_scale"].view(torch.uint8), ck.w13_scale.view(torch.uint8))
    assert torch.equal(loaded["w2_scale"].view(torch.uint8), ck.w2_scale.view(torch.uint8))
    assert torch.equal(loaded["w13_scale_2"], ck.w13_scale_2) and torch.equal(loaded["w2_scale_2"], ck.w2_scale_2)


def test_process_weights_keeps_linear_scales(single_rank_run):
    from k3nvfp4.sglang_ext.backend_triton import WEIGHTS_ATTR

    layer, loaded = single_rank_run.layer, single_rank_run.loaded
    weights = getattr(layer, WEIGHTS_ATTR)
    w13, w13_scale, w13_scale_2, w2, w2_scale, w2_scale_2 = weights.to_modelopt()
    # Unswizzled, byte for byte what was loaded; gate/up scale_2 kept as two columns.
    assert torch.equal(w13_scale.view(torch.uint8), loaded["w13_scale"].view(torch.uint8))
    assert torch.equal(w2_scale.view(torch.uint8), loaded["w2_scale"].view(torch.uint8))
    assert torch.equal(w13, loaded["w13"]) and torch.equal(w2, loaded["w2"])
    assert w13_scale_2.shape == (layer.num_local_experts, 2) and torch.equal(w13_scale_2, loaded["w13_scale_2"])
    assert torch.equal(w2_scale_2, loaded["w2_scale_2"])
    assert layer.w13_blockscale_swizzled is None and layer.w2_blockscale_swizzled is None
    # No second copy of the experts: each ModelOpt parameter is either the kernels' own storage
    # or freed.
    kernel_storages = {t.untyped_storage().data_ptr() for t in vars(weights).values() if isinstance(t, torch.Tensor)}
    for param in MODELOPT_PARAMS.values():
        p = getattr(layer, param)
        assert p.numel() == 0 or p.untyped_storage().data_ptr() in kernel_storages, param
    assert not hasattr(layer, "g1_alphas")  # SGLang's FlashInfer post-processing did not run


def test_load_logs_backend_active(single_rank_run):
    msgs = [r.getMessage() for r in single_rank_run.records]
    active = [m for m in msgs if f"MoE runner backend {BACKEND} active" in m]
    assert len(active) == 1, msgs
    assert "8 local of 8 experts, hidden 64, intermediate/rank 64, moe tp 1/ep 1, activation situ" in active[0]
    assert "w13 [8, 8, 1, 512] + w2 [8, 4, 1, 512] kernel-native FP4 tiles (bit-placed e2m1, e5m3/16 block scales)" in active[0]
    print(active[0])


@pytest.mark.parametrize("dtype,tol", [("float32", FP32_TOL), ("bfloat16", BF16_TOL)])
def test_triton_situ_matches_sglang_native_reference(single_rank_run, dtype, tol):
    run = single_rank_run
    layer = run.layer
    w13, w2 = _dense_modelopt(run.loaded)
    topk_output = _route(layer, run.x, run.logits)
    # Reference in fp32 (an oracle for both activation dtypes); gemm1_alpha set explicitly.
    ref = _sglang_reference(w13, w2, run.x.float(), topk_output, layer.moe_runner_config)
    assert layer.moe_runner_config.gemm1_alpha == 4.0 and layer.moe_runner_config.gemm1_clamp_limit == 25.0
    out = run.out[dtype]
    assert out.dtype == getattr(torch, dtype) and out.shape == run.x.shape
    assert ref.abs().max() > 0.1
    err = _rel_err(out, ref)
    print(f"triton_situ vs SGLang native reference, {dtype}: max|diff|/max|ref| = {err:.2e} (bound {tol:.0e})")
    assert err <= tol


def test_linear_beta_cap_is_applied(single_rank_run):
    """The same layer without the linear_beta cap gives a different result: the cap is live."""
    import dataclasses

    run = single_rank_run
    w13, w2 = _dense_modelopt(run.loaded)
    topk_output = _route(run.layer, run.x, run.logits)
    cfg = dataclasses.replace(run.layer.moe_runner_config, gemm1_clamp_limit=None, layer=None)
    uncapped = _sglang_reference(w13, w2, run.x.float(), topk_output, cfg)
    capped = _sglang_reference(w13, w2, run.x.float(), topk_output, run.layer.moe_runner_config)
    assert _rel_err(run.out["float32"], capped) <= FP32_TOL
    assert _rel_err(uncapped, capped) > 10 * FP32_TOL


def test_separate_gate_up_scale_2(single_rank_run):
    """Gate and up halves with different weight_scale_2: applied before SiTU, each to its half."""
    from k3nvfp4.kernels import NVFP4MoEWeights

    from k3nvfp4.sglang_ext.backend_triton import WEIGHTS_ATTR

    run = single_rank_run
    layer = run.layer
    t = dict(run.loaded)
    t["w13_scale_2"] = t["w13_scale_2"] * torch.tensor([[0.5, 4.0]])  # gate / 2, up x 4
    saved = getattr(layer, WEIGHTS_ATTR)
    setattr(layer, WEIGHTS_ATTR, NVFP4MoEWeights.from_modelopt(
        t["w13"], t["w13_scale"], t["w13_scale_2"], t["w2"], t["w2_scale"], t["w2_scale_2"]))
    try:
        out = layer.forward(run.x, _route(layer, run.x, run.logits))
    finally:
        setattr(layer, WEIGHTS_ATTR, saved)
    w13, w2 = _dense_modelopt(t)
    ref = _sglang_reference(w13, w2, run.x, _route(layer, run.x, run.logits), layer.moe_runner_config)
    assert _rel_err(out, ref) <= FP32_TOL
    assert _rel_err(out, run.out["float32"]) > 1e-2


def test_silu_layer_matches_sglang_native_reference(one_rank, nvfp4_checkpoint):
    """apply also routes plain SiLU-and-mul (no SiTU parameters) to the kernels."""
    from sglang.srt.layers.moe.fused_moe_triton.layer import FusedMoE

    qc, text = _checkpoint_quant_config(nvfp4_checkpoint)
    layer = FusedMoE(
        num_experts=text["num_experts"], hidden_size=text["routed_expert_hidden_size"],
        intermediate_size=text["moe_intermediate_size"], layer_id=MOE_LAYER, top_k=text["num_experts_per_token"],
        params_dtype=torch.bfloat16, quant_config=qc,
        prefix=f"language_model.model.layers.{MOE_LAYER}.block_sparse_moe.experts", activation="silu",
    )
    _load_layer(layer, nvfp4_checkpoint, MOE_LAYER)
    loaded = {n: getattr(layer, p).data.clone() for n, p in MODELOPT_PARAMS.items()}  # freed by the next step
    layer.quant_method.process_weights_after_loading(layer)
    x, logits = _inputs(layer.hidden_size, layer.num_experts)
    topk_output = _route(layer, x, logits)
    out = layer.forward(x, topk_output)
    w13, w2 = _dense_modelopt(loaded)
    ref = _sglang_reference(w13, w2, x, topk_output, layer.moe_runner_config)
    assert ref.abs().max() > 0.1
    assert _rel_err(out, ref) <= FP32_TOL


def test_runner_maps_sglang_config(one_rank):
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig

    from k3nvfp4.sglang_ext.runner import activation_from_config, make_runner_core, routed_scaling_factor_for_runner

    assert activation_from_config(MoeRunnerConfig(activation="situ", gemm1_alpha=3.0, gemm1_clamp_limit=20.0)) == \
        GatedActivation(ActivationKind.SITU, 3.0, 20.0)
    # gemm1_alpha None means beta 4.0, as in SGLang's moe_forward_native; no clamp -> no cap.
    assert activation_from_config(MoeRunnerConfig(activation="situ")) == GatedActivation(ActivationKind.SITU, 4.0, None)
    assert activation_from_config(MoeRunnerConfig(activation="silu")).kind is ActivationKind.SILU
    with pytest.raises(NotImplementedError, match="SwiGLU"):
        activation_from_config(MoeRunnerConfig(activation="silu", gemm1_alpha=1.702, gemm1_clamp_limit=7.0))
    with pytest.raises(ValueError, match="got 'gelu'"):
        activation_from_config(MoeRunnerConfig(activation="gelu"))
    with pytest.raises(NotImplementedError, match="gated"):
        activation_from_config(MoeRunnerConfig(activation="silu", is_gated=False))
    # TopK folds routed_scaling_factor into the weights for ModelOpt NVFP4 layers off marlin.
    fused = types.SimpleNamespace(should_fuse_routed_scaling_factor_in_topk=True)
    assert routed_scaling_factor_for_runner(MoeRunnerConfig(routed_scaling_factor=2.5, layer=fused)) is None
    assert routed_scaling_factor_for_runner(MoeRunnerConfig(routed_scaling_factor=2.5)) == 2.5
    with pytest.raises(ValueError, match="ModelOpt NVFP4 and MXFP4 MoE layers only"):
        make_runner_core(MoeRunnerConfig(layer=types.SimpleNamespace(quant_method=object(), layer_name="m.experts")))


def test_layer_folds_routed_scaling_in_topk(single_rank_run):
    """Under triton_situ SGLang applies routed_scaling_factor in TopK, so the runner must not."""
    from k3nvfp4.sglang_ext.runner import routed_scaling_factor_for_runner

    layer = single_rank_run.layer
    assert layer.should_fuse_routed_scaling_factor_in_topk is True
    assert routed_scaling_factor_for_runner(layer.moe_runner_config) is None


def test_intermediate_per_rank_must_be_multiple_of_16(one_rank, nvfp4_checkpoint):
    with pytest.raises(ValueError, match="intermediate size per rank is 40 .*multiple of the NVFP4 block 16"):
        _build_layer(nvfp4_checkpoint, MOE_LAYER, intermediate_size=40)


# --- marlin's SiTU gate and untouched backends ---------------------------------------------------


class _RecordingRunner:
    def __init__(self):
        self.calls = []

    def run(self, dispatch_output, quant_info):
        self.calls.append((dispatch_output, quant_info))
        return "combined"


def _method_for(backend, activation: str):
    """ModelOptNvFp4FusedMoEMethod as create_moe_runner leaves it, with a recording runner."""
    from sglang.srt.layers.moe.moe_runner.base import MoeRunnerConfig
    from sglang.srt.layers.quantization.modelopt_quant import ModelOptFp4Config, ModelOptNvFp4FusedMoEMethod

    method = ModelOptNvFp4FusedMoEMethod(ModelOptFp4Config.from_config(
        {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": []}))
    method.moe_runner_config = MoeRunnerConfig(activation=activation, gemm1_alpha=4.0, gemm1_clamp_limit=25.0, num_experts=8)
    method._moe_runner_backend = backend
    method.runner = _RecordingRunner()
    layer = types.SimpleNamespace(
        _mega_moe_nvfp4=False, w13_weight=torch.zeros(1), w2_weight=torch.zeros(1), w13_weight_scale=torch.zeros(1),
        w2_weight_scale=torch.zeros(1), w13_weight_scale_2=torch.zeros(1), w2_weight_scale_2=torch.zeros(1),
        dispatcher=types.SimpleNamespace(local_expert_mapping=None),
    )
    return method, layer


def test_marlin_accepts_situ(one_rank):
    from sglang.srt.layers.moe.moe_runner.marlin import MarlinMoeQuantInfo
    from sglang.srt.layers.moe.utils import MoeRunnerBackend

    dispatch_output = object()
    method, layer = _method_for(MoeRunnerBackend.MARLIN, "situ")
    original_apply = type(method).apply.__wrapped__
    with pytest.raises(AssertionError, match="activation='situ' is unsupported"):
        original_apply(method, layer, dispatch_output)  # SGLang 0.5.23 alone rejects it
    assert method.apply(layer, dispatch_output) == "combined"
    ((got_dispatch, info),) = method.runner.calls
    assert got_dispatch is dispatch_output and isinstance(info, MarlinMoeQuantInfo)
    # Exactly what SGLang's own marlin branch builds for silu.
    silu_method, _ = _method_for(MoeRunnerBackend.MARLIN, "silu")
    silu_method.apply(layer, dispatch_output)
    ((_, silu_info),) = silu_method.runner.calls
    for field in ("w13_qweight", "w2_qweight", "w13_scales", "w2_scales", "w13_global_scale", "w2_global_scale"):
        assert getattr(info, field) is getattr(silu_info, field) is getattr(layer, {
            "w13_qweight": "w13_weight", "w2_qweight": "w2_weight", "w13_scales": "w13_weight_scale",
            "w2_scales": "w2_weight_scale", "w13_global_scale": "w13_weight_scale_2",
            "w2_global_scale": "w2_weight_scale_2"}[field])
    assert (info.expert_map, info.global_num_experts, info.weight_bits) == (None, -1, 4)


@pytest.mark.parametrize("backend_name", ["flashinfer_cutlass", "flashinfer_cutedsl", "triton"])
def test_other_backends_still_reject_situ(one_rank, backend_name):
    from sglang.srt.layers.moe.utils import MoeRunnerBackend

    method, layer = _method_for(MoeRunnerBackend(backend_name), "situ")
    with pytest.raises(AssertionError, match="activation='situ' is unsupported"):
        method.apply(layer, object())
    assert method.runner.calls == []


def test_each_plugin_backend_name_is_one_backend_object():
    """backends.BACKENDS: one object per registered name, resolved from a name or an enum-like
    value; SGLang's own backends (and none selected) resolve to None, so the hooks call SGLang."""
    from sglang.srt.layers.moe.utils import MoeRunnerBackend

    from k3nvfp4.sglang_ext.backends import BACKENDS, plugin_backend
    from k3nvfp4.sglang_ext.names import BACKEND_NAME, REFERENCE_BACKEND_NAME

    assert set(BACKENDS) == {BACKEND_NAME, REFERENCE_BACKEND_NAME}
    for name, backend in BACKENDS.items():
        assert backend.name == name
        assert plugin_backend(name) is plugin_backend(types.SimpleNamespace(value=name)) is backend
        assert all(callable(getattr(backend, m)) for m in ("check_device", "prepare_modelopt", "prepare_mxfp4", "apply"))
    assert plugin_backend(MoeRunnerBackend.MARLIN) is None and plugin_backend(None) is None


def test_hooks_pass_other_backends_through_unchanged(one_rank):
    """For any backend but triton_situ each hook calls SGLang's original with the same arguments
    and returns its result, touching nothing."""
    from sglang.srt.layers.moe.utils import MoeRunnerBackend
    from sglang.srt.runtime_context import get_flags

    from k3nvfp4.sglang_ext import hooks
    from k3nvfp4.sglang_ext.backend_triton import WEIGHTS_ATTR

    calls = []

    def original(*args, **kwargs):
        calls.append((args, kwargs))
        return "original-result"

    method = types.SimpleNamespace(_moe_runner_backend=MoeRunnerBackend.FLASHINFER_TRTLLM,
                                   moe_runner_config=types.SimpleNamespace(activation="situ"))
    layer = types.SimpleNamespace(w13_blockscale_swizzled="kept", w2_blockscale_swizzled="kept")
    moe_flags = get_flags().moe
    saved = moe_flags.runner_backend
    moe_flags.runner_backend = MoeRunnerBackend.FLASHINFER_TRTLLM
    try:
        assert hooks.init_hook(original, method, "qc") == "original-result"
        assert hooks.create_weights_hook(original, method, layer, 8, 64, 40, torch.bfloat16, weight_loader=1) == \
            "original-result"
    finally:
        moe_flags.runner_backend = saved
    assert hooks.process_weights_hook(original, method, layer) == "original-result"
    assert hooks.apply_hook(original, method, layer, "dispatch") == "original-result"
    assert calls == [
        ((method, "qc"), {}),
        ((method, layer, 8, 64, 40, torch.bfloat16), {"weight_loader": 1}),
        ((method, layer), {}),
        ((method, layer, "dispatch"), {}),
    ]
    assert layer.w13_blockscale_swizzled == "kept" and not hasattr(layer, WEIGHTS_ATTR)


def test_mxfp4_hooks_pass_other_backends_through_unchanged(one_rank):
    """The same for the Mxfp4MoEMethod hooks (the MXFP4 release under marlin and the others)."""
    from sglang.srt.layers.moe.utils import MoeRunnerBackend
    from sglang.srt.runtime_context import get_flags

    from k3nvfp4.sglang_ext import hooks_mxfp4

    calls = []

    def original(*args, **kwargs):
        calls.append((args, kwargs))
        return "original-result"

    method = types.SimpleNamespace(runner=types.SimpleNamespace(runner_backend=MoeRunnerBackend.MARLIN))
    layer = types.SimpleNamespace()
    moe_flags = get_flags().moe
    saved = moe_flags.runner_backend
    moe_flags.runner_backend = MoeRunnerBackend.MARLIN
    try:
        assert hooks_mxfp4.init_hook(original, method, prefix="p") == "original-result"
        assert hooks_mxfp4.create_weights_hook(original, method, layer, 8, 64, 64, torch.bfloat16, weight_loader=1) == \
            "original-result"
        assert hooks_mxfp4.process_weights_hook(original, method, layer) == "original-result"
        assert hooks_mxfp4.create_moe_runner_hook(original, method, layer, "cfg") == "original-result"
    finally:
        moe_flags.runner_backend = saved
    assert hooks_mxfp4.apply_hook(original, method, layer, "dispatch") == "original-result"
    assert calls == [
        ((method,), {"prefix": "p"}),
        ((method, layer, 8, 64, 64, torch.bfloat16), {"weight_loader": 1}),
        ((method, layer), {}),
        ((method, layer, "cfg"), {}),
        ((method, layer, "dispatch"), {}),
    ]
    assert vars(layer) == {}


def test_mxfp4_shard_shapes_are_checked(one_rank):
    """triton_situ on MXFP4: a per-rank intermediate size the 32-blocks cannot tile, a hidden size
    likewise, and bias parameters are refused with errors that say what to do."""
    from sglang.srt.layers.moe.utils import resolve_moe_runner_backend
    from sglang.srt.runtime_context import get_flags

    from k3nvfp4.sglang_ext import hooks_mxfp4

    layer = types.SimpleNamespace(moe_tp_size=4, num_local_experts=2)
    moe_flags = get_flags().moe
    saved = moe_flags.runner_backend
    moe_flags.runner_backend = resolve_moe_runner_backend("triton_situ")
    try:
        with pytest.raises(ValueError, match=r"intermediate size per rank is 48 .* multiple of the MXFP4 block 32"):
            hooks_mxfp4.create_weights_hook(None, types.SimpleNamespace(), layer, 2, 64, 48, torch.bfloat16)
        with pytest.raises(ValueError, match="hidden size 80 must be a multiple of the MXFP4 block 32"):
            hooks_mxfp4.create_weights_hook(None, types.SimpleNamespace(), layer, 2, 80, 64, torch.bfloat16)
        with pytest.raises(NotImplementedError, match="biases are not supported"):
            hooks_mxfp4.create_weights_hook(None, types.SimpleNamespace(), layer, 2, 64, 64, torch.bfloat16, with_bias=True)
        module = torch.nn.Module()
        module.num_local_experts = 2
        method = types.SimpleNamespace()
        assert hooks_mxfp4.create_weights_hook(None, method, module, 2, 64, 32, torch.bfloat16, weight_loader=7) is None
    finally:
        moe_flags.runner_backend = saved
    shapes = {n: (tuple(p.shape), p.dtype) for n, p in module.named_parameters()}
    assert shapes == {"w13_weight": ((2, 64, 32), torch.uint8), "w13_weight_scale": ((2, 64, 2), torch.uint8),
                      "w2_weight": ((2, 64, 16), torch.uint8), "w2_weight_scale": ((2, 64, 1), torch.uint8)}
    assert module.w13_weight_scale.quant_method == "group" and module.w2_weight.weight_loader == 7
    assert method.intermediate_size_per_partition == 32 and method.hidden_size == 64


# --- nothing of sglang changed -------------------------------------------------------------------


def test_installed_sglang_files_unchanged(single_rank_run, sglang_plugins):
    """Every file in sglang's RECORD still has its recorded sha256 after using the plugin."""
    from importlib.metadata import distribution

    dist = distribution("sglang")
    assert dist.version == "0.5.23"
    checked, changed = 0, []
    for f in dist.files:
        if f.hash is None:
            continue
        digest = hashlib.new(f.hash.mode, f.locate().read_bytes()).digest()
        if base64.urlsafe_b64encode(digest).rstrip(b"=").decode() != f.hash.value:
            changed.append(str(f))
        checked += 1
    assert checked > 1000 and changed == []

