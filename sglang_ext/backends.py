"""The plugin's MoE runner backends, one object per ``--moe-runner-backend`` name.

A backend object does three things for a FusedMoE layer (plus its device check):

- ``prepare_modelopt(method, layer)``: after SGLang loaded a ModelOpt NVFP4 layer (the cast
  checkpoint), replace its post-load processing;
- ``prepare_mxfp4(method, layer)``: the same for an MXFP4 layer (the release, read directly);
- ``apply(method, layer, dispatch_output)``: one forward of the layer.

The hooks (hooks.py on ModelOptNvFp4FusedMoEMethod, hooks_mxfp4.py on Mxfp4MoEMethod) resolve the
backend SGLang selected to one of these objects once per call (:func:`plugin_backend`) and either
hand the call to it or, for any backend that is not the plugin's, to SGLang's original
(:func:`plugin_hook`). A new backend is a class with these methods and a line in ``BACKENDS``
(and its runner core registered in plugin.py).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

from .backend_reference import TorchReferenceBackend
from .backend_triton import TritonSituBackend


class PluginBackend(Protocol):
    """What the hooks ask of a plugin backend."""

    name: str

    def check_device(self) -> None:
        """Raise ValueError (what it needs) when this process's device cannot run it."""

    def prepare_modelopt(self, method: Any, layer: Any) -> Any:
        """After loading a ModelOpt NVFP4 layer: what ``apply`` runs on, stored on the layer."""

    def prepare_mxfp4(self, method: Any, layer: Any) -> Any:
        """After loading an MXFP4 layer: the same."""

    def apply(self, method: Any, layer: Any, dispatch_output: Any) -> Any:
        """One forward: SGLang's dispatch output -> its combine input."""


BACKENDS: dict[str, PluginBackend] = {b.name: b for b in (TritonSituBackend(), TorchReferenceBackend())}


def plugin_backend(backend: Any) -> PluginBackend | None:
    """The plugin's backend object for a MoeRunnerBackend(-like) value or name; None for every
    backend of SGLang's own (and for None: nothing selected)."""
    if backend is None:
        return None
    return BACKENDS.get(getattr(backend, "value", backend))


def global_backend(method: Any = None) -> Any:
    """The backend chosen with --moe-runner-backend (SGLang's global choice)."""
    from sglang.srt.layers.moe.utils import get_moe_runner_backend

    return get_moe_runner_backend()


def plugin_hook(ours: Callable[..., Any], backend_of: Callable[[Any], Any] = global_backend) -> Callable[..., Any]:
    """An AROUND hook on a quant method's function: SGLang's original, with the same arguments,
    for a backend that is not the plugin's; else ``ours(backend, original_fn, method, *args,
    **kwargs)``. ``backend_of(method)``: the backend (value or name) the method runs with."""

    def hook(original_fn, self, *args, **kwargs):
        backend = plugin_backend(backend_of(self))
        if backend is None:
            return original_fn(self, *args, **kwargs)
        return ours(backend, original_fn, self, *args, **kwargs)

    hook.__name__ = hook.__qualname__ = getattr(ours, "__name__", "hook").lstrip("_") + "_hook"
    hook.__doc__ = ours.__doc__
    return hook
