"""Offline checkpoint tooling: read Kimi-K3 MXFP4 checkpoints, write ModelOpt NVFP4 ones.

- ``synthetic.write_synthetic_checkpoint``: small checkpoints in the exact K3 MXFP4 layout;
- ``convert.run_cast`` / the ``k3nvfp4-cast`` CLI (``cli.main``): the streaming, resumable,
  verified MXFP4 -> NVFP4 cast, in one process or across nodes (``ranks``: who a rank is and
  which shards it casts; ``coordinator``: the ranks' gloo heartbeat; ``rank_checks``);
- ``layer.load_moe_layer_nvfp4``: one MoE layer of a cast checkpoint as an ``NVFP4MoELayer``
  (``NVFP4MoEWeights`` + hidden_act, SiTU betas, top_k, routed_scaling_factor).

The names below are imported on first use (PEP 562): importing the package imports none of its
modules, so ``python -m k3nvfp4.checkpoint.synthetic`` runs the module once, without runpy's
"found in sys.modules" warning. Nothing here depends on ``k3nvfp4.sglang_ext``.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "NVFP4MoELayer": "layer",
    "load_moe_layer_nvfp4": "layer",
    "write_synthetic_checkpoint": "synthetic",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
