"""Watching SGLang load: which checkpoint tensor each weight_loader call came from.

SGLang's ``load_weights`` pulls one (name, tensor) at a time from the weight iterator and
hands it to a parameter's ``weight_loader`` (or copies it into a fused parameter directly, as
K3 does for q_a/kv_a), then pulls the next. :func:`tap` remembers the name being processed;
:func:`instrument_loaders` wraps every parameter's ``weight_loader`` (SGLang's
``default_weight_loader`` for parameters without one, which is what SGLang would call) to log
the call against that name. A name with no call and no verified landing was skipped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch


@dataclass
class LoaderCall:
    param: str
    shard_id: Any = None
    expert_id: Any = None


@dataclass
class LoadLog:
    """Names SGLang's iterator produced (in order) and the loader calls made for each."""

    seen: list[str] = field(default_factory=list)
    calls: dict[str, list[LoaderCall]] = field(default_factory=dict)
    current: str | None = None


def tap(weights: Iterator[tuple[str, torch.Tensor]], log: LoadLog) -> Iterator[tuple[str, torch.Tensor]]:
    """Pass SGLang's weight iterator through, noting the name SGLang is about to load."""
    for name, tensor in weights:
        log.current = name
        log.seen.append(name)
        yield name, tensor
    log.current = None


def _wrap(param_name: str, loader: Callable, log: LoadLog) -> Callable:
    def weight_loader(param, loaded_weight, *args, **kwargs):
        # Linear loaders take (param, w, shard_id); FusedMoE's (param, w, name, shard_id=, expert_id=).
        shard_id = kwargs.get("shard_id", args[0] if args else None)
        log.calls.setdefault(log.current or "<outside load_weights>", []).append(
            LoaderCall(param_name, shard_id, kwargs.get("expert_id"))
        )
        return loader(param, loaded_weight, *args, **kwargs)

    weight_loader.__wrapped__ = loader  # type: ignore[attr-defined]
    return weight_loader


def instrument_loaders(model: torch.nn.Module, log: LoadLog) -> int:
    """Wrap the weight_loader of every parameter of ``model``; returns how many were wrapped."""
    from sglang.srt.model_loader.weight_utils import default_weight_loader

    n = 0
    for name, param in model.named_parameters():
        loader = getattr(param, "weight_loader", None) or default_weight_loader
        wrapped = _wrap(name, loader, log)
        if isinstance(getattr(type(param), "weight_loader", None), property):
            param._weight_loader = wrapped  # SGLang's BasevLLMParameter: a read-only property
        else:
            param.weight_loader = wrapped
        n += 1
    return n
