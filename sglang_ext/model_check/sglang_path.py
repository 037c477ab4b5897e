"""SGLang's own serving path, step by step, with hooks to look between the steps.

What a scheduler process of ``python -m sglang.launch_server --model-path CKPT
--moe-runner-backend triton_situ`` does before it serves, in its order and with its functions:
``load_plugins()``; ``prepare_server_args`` (the CLI parser); ``publish`` (role "scheduler");
``init_distributed_environment`` + ``initialize_model_parallel`` + ``initialize_moe_config``;
``ModelConfig.from_server_args``; ``build_load_config``; ``get_model_loader``; then
``DefaultModelLoader.load_model``'s body: ``_get_quantization_config`` -> ``_initialize_model``
(the checkpoint's ``architectures`` select the EntryClass) -> ``load_weights_only`` (SGLang's
own weight iterator over the shards into ``model.load_weights``) -> ``postprocess_weights``
(every module's ``process_weights_after_loading``). The body is replayed here instead of
calling ``load_model`` so that the check can look at the parameters after loading and before
post-processing (triton_situ frees the ModelOpt tensors then).

Machine obstacles, worked around only here and only where they occur (each named):
- CPU, argument resolution (``CPU_SERVER_ARGS``): ``--device cpu`` (SGLang's get_device()
  raises without an accelerator) and ``--mamba-radix-cache-strategy no_buffer
  --disable-overlap-schedule`` (the KDA state cache's default extra_buffer asserts a GPU
  platform; no_buffer requires the overlap scheduler off); scheduler settings that the model
  class and its loading do not read.
- CPU, model construction: ``KimiK3LinearModel.__init__`` creates three CUDA streams
  (``torch.cuda.Stream()``), which fails without a CUDA driver; the constructor gets ``None``
  ("no side stream"), a value every forward path of the model checks for.
- CPU, more than one rank: SGLang's GPU communicators (pynccl, custom all-reduce) cannot start,
  so the groups are built without them and torch.distributed over gloo carries the
  collectives; the standard token dispatcher allocates its expert map on ``get_device()``,
  which knows no CPU, so it is told "cpu".
- CPU: the fused Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before
  the kernels are defined; the CLI re-executes itself with it).
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch

from ..names import BACKEND_NAME
from .ckpt_reader import read_config

PLUGIN_NAME = "k3nvfp4"
CPU_SERVER_ARGS = ["--device", "cpu", "--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule"]


class ModelCheckError(RuntimeError):
    """The check cannot run (environment, arguments or checkpoint); the message says why."""


@dataclass
class BuiltModel:
    """A model built by SGLang's loader path, not yet loaded."""

    model: torch.nn.Module
    model_config: Any
    load_config: Any
    loader: Any
    quant_config: Any
    device: torch.device
    # (prefix, layer, returned method) of every quant_config.get_quant_method call.
    quant_calls: list[tuple[str, torch.nn.Module, Any]] = field(default_factory=list)


def load_sglang_plugins() -> None:
    """SGLang's ``load_plugins()``, refusing to go on when the k3nvfp4 plugin did not register."""
    selected = os.environ.get("SGLANG_PLUGINS")
    if selected is not None and PLUGIN_NAME not in [s.strip() for s in selected.split(",")]:
        raise ModelCheckError(
            f"SGLANG_PLUGINS={selected!r} excludes the {PLUGIN_NAME} plugin; add {PLUGIN_NAME} "
            f"(or unset it) so that --moe-runner-backend {BACKEND_NAME} exists"
        )
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import MOE_RUNNER_BACKEND_CHOICES

    load_plugins()
    if BACKEND_NAME not in MOE_RUNNER_BACKEND_CHOICES:
        raise ModelCheckError(
            f"SGLang's load_plugins() did not register --moe-runner-backend {BACKEND_NAME}: "
            f"is the {PLUGIN_NAME} package installed in this environment (entry point "
            "group sglang.srt.plugins)?"
        )


def server_args_for(
    ckpt: Path, *, tp_size: int, ep_size: int, text_overrides: dict[str, Any]
) -> Any:
    """SGLang's ServerArgs from the launch command line a user would type."""
    from sglang.srt.server_args import prepare_server_args

    argv = ["--model-path", str(ckpt), "--trust-remote-code", "--moe-runner-backend", BACKEND_NAME,
            "--tp-size", str(tp_size), "--ep-size", str(ep_size)]  # fmt: skip
    if not torch.cuda.is_available():
        # CPU obstacles of SGLang's argument resolution (no model is affected): get_device()
        # raises without an accelerator, so the device is named; the KDA state cache's default
        # extra_buffer strategy asserts a GPU platform, so the scheduler-side no_buffer is chosen
        # (which SGLang allows only without the overlap scheduler).
        argv += CPU_SERVER_ARGS
    if text_overrides:
        # SGLang's --json-model-override-args; a nested (multimodal K3) config takes them
        # under text_config.
        nested = "text_config" in read_config(ckpt)
        argv += ["--json-model-override-args", json.dumps({"text_config": text_overrides} if nested else text_overrides)]
    try:
        return prepare_server_args(argv)
    except SystemExit as exc:  # argparse
        raise ModelCheckError(f"SGLang rejected the launch arguments {argv}: exit {exc.code}") from None


def cpu_multi_rank_communicators() -> None:
    """CPU obstacle (several ranks): no pynccl / custom all-reduce; the EP map on CPU."""
    from sglang.srt.distributed import parallel_state
    from sglang.srt.layers.moe.token_dispatcher import standard

    parallel_state.set_custom_all_reduce(False)
    if not getattr(parallel_state.init_model_parallel_group, "_k3nvfp4_cpu", False):
        make_group = parallel_state.init_model_parallel_group

        def cpu_group(*args, **kwargs):
            kwargs["use_pynccl"] = False
            return make_group(*args, **kwargs)

        cpu_group._k3nvfp4_cpu = True
        parallel_state.init_model_parallel_group = cpu_group
    standard.get_device = lambda *args, **kwargs: "cpu"


def init_parallel(server_args: Any, *, rank: int, world_size: int, port: int) -> torch.device:
    """publish + distributed groups + MoE flags, as run_scheduler_process does; returns the device."""
    from sglang.srt.distributed import parallel_state
    from sglang.srt.distributed.parallel_state import (
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from sglang.srt.layers.moe.utils import initialize_moe_config
    from sglang.srt.runtime_context import SpawnRanks, get_parallel, publish, reset_context

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    elif world_size > 1:
        cpu_multi_rank_communicators()
    world = parallel_state._WORLD
    if world is not None and world.world_size != world_size:
        raise ModelCheckError(
            f"this process already holds a {world.world_size}-rank torch.distributed world; "
            f"a {world_size}-rank check needs fresh processes"
        )
    reset_context()
    publish(server_args, role="scheduler", ranks=SpawnRanks(world_rank=rank, gpu_id=rank if cuda else None))
    if world is not None:  # keep the WORLD group of an earlier run in this process
        get_parallel().override_permanently(world_group=world)
    else:
        init_distributed_environment(
            world_size=world_size, rank=rank, local_rank=rank, backend="nccl" if cuda else "gloo",
            distributed_init_method=f"tcp://127.0.0.1:{port}",
        )  # fmt: skip
    if model_parallel_is_initialized():
        destroy_model_parallel()
    initialize_model_parallel(backend="nccl" if cuda else "gloo")
    initialize_moe_config()
    return torch.device("cuda", rank) if cuda else torch.device("cpu")


def teardown_parallel() -> None:
    """Drop the model-parallel groups (the WORLD group stays for a later run in this process)."""
    from sglang.srt.distributed.parallel_state import destroy_model_parallel, model_parallel_is_initialized

    if model_parallel_is_initialized():
        destroy_model_parallel()


@contextlib.contextmanager
def _no_cuda_streams_on_cpu() -> Iterator[None]:
    """CPU obstacle (model construction): torch.cuda.Stream() -> None, see the module docstring."""
    if torch.cuda.is_available():
        yield
        return
    real = torch.cuda.Stream
    torch.cuda.Stream = lambda *args, **kwargs: None  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.Stream = real  # type: ignore[assignment]


def _record_quant_calls(quant_config: Any, calls: list) -> None:
    """Record every quant_config.get_quant_method(layer, prefix) the model class makes."""
    original = quant_config.get_quant_method

    def get_quant_method(layer, prefix):
        method = original(layer, prefix)
        calls.append((prefix, layer, method))
        return method

    quant_config.get_quant_method = get_quant_method


def build_model(server_args: Any, *, rank: int, device: torch.device) -> BuiltModel:
    """ModelConfig -> load config -> loader -> quant config -> the model class, as SGLang does."""
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.model_executor.model_runner_components.load_model_utils import build_load_config
    from sglang.srt.model_loader.loader import (
        DefaultModelLoader,
        _get_quantization_config,
        _initialize_model,
        get_model_loader,
    )
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    model_config = ModelConfig.from_server_args(server_args)
    load_config = build_load_config(
        server_args=server_args, tp_rank=rank, remote_instance_weight_transporter_engine=None,
        remote_instance_weight_transporter_session_id="", draft_model_idx=None, weight_cache_mode="off",
        weight_cache_socket=None,
    )  # fmt: skip
    loader = get_model_loader(load_config, model_config)
    if not isinstance(loader, DefaultModelLoader) or not model_config._is_already_quantized():
        raise ModelCheckError(
            f"SGLang chose {type(loader).__name__} (quantization {model_config.quantization!r}); "
            "a checkpoint written by k3nvfp4-cast loads through the default loader as pre-quantized ModelOpt NVFP4"
        )
    quant_config = _get_quantization_config(model_config, load_config)
    calls: list = []
    if quant_config is not None:
        _record_quant_calls(quant_config, calls)
    with set_default_torch_dtype(model_config.dtype), device, _no_cuda_streams_on_cpu():
        model = _initialize_model(model_config, load_config, quant_config)
    return BuiltModel(model, model_config, load_config, loader, quant_config, device, calls)


def weight_iterator(built: BuiltModel, keep_file: Any = None) -> Iterator[tuple[str, torch.Tensor]]:
    """SGLang's own weight iterator over the checkpoint's shards (the resolved-source form the
    startup path uses); ``keep_file(path) -> bool`` may drop whole shards (truncated models)."""
    resolved = built.loader.resolve_model_weights(built.model_config, built.model)
    for source in resolved:
        files = tuple(f for f in source.weight_files if keep_file is None or keep_file(f))
        source = type(source)(source=source.source, hf_folder=source.hf_folder, weight_files=files,
                              use_safetensors=source.use_safetensors)  # fmt: skip
        yield from built.loader._get_weights_iterator(source.source, resolved_source=source)


def load_weights(built: BuiltModel, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """DefaultModelLoader.load_weights_only: SGLang's iterator wrappers, then model.load_weights."""
    from sglang.srt.model_loader.loader import DefaultModelLoader
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    with set_default_torch_dtype(built.model_config.dtype):
        DefaultModelLoader.load_weights_only(built.model, weights, built.device)


def postprocess_weights(built: BuiltModel) -> None:
    """DefaultModelLoader.postprocess_weights: every module's process_weights_after_loading."""
    from sglang.srt.model_loader.loader import DefaultModelLoader
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    with set_default_torch_dtype(built.model_config.dtype):
        DefaultModelLoader.postprocess_weights(built.model, built.device)
    built.model.eval()
