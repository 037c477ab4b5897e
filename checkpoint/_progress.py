"""Progress reporting from worker code: a per-process sink for "n source bytes done"."""

from __future__ import annotations

from typing import Callable

_sink: Callable[[int], None] = lambda n: None


def set_sink(fn: Callable[[int], None]) -> Callable[[int], None]:
    """Install ``fn`` as this process's sink; returns the previous one."""
    global _sink
    prev, _sink = _sink, fn
    return prev


def report(nbytes: int) -> None:
    _sink(nbytes)
