"""SGLang's known start-up messages on a self-check machine: filtered, and explained once each.

Building SGLang's Kimi-K3 model class on a CPU machine (or on a small synthetic checkpoint) makes
SGLang warn about things that do not concern the check: quantization methods K3 does not use,
CUDA kernels it cannot import, and fast paths the tiny synthetic shapes do not qualify for. The
self-check drops exactly these messages (by their text) and its summary lists the ones seen, one
line each with the reason; anything else SGLang says is printed as usual.
"""

from __future__ import annotations

import logging
import re
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class Noise:
    says: str  # what SGLang says, shortened
    pattern: str  # regex searched in the message
    why: str


KNOWN: tuple[Noise, ...] = (
    Noise("Only CUDA ... support AWQ / GGUF", r"Only CUDA, (HIP and XPU|MUSA and NPU) support (AWQ|GGUF)",
          "SGLang imports every quantization method at start-up; K3 uses neither AWQ nor GGUF"),
    Noise("Triton is not supported on current platform", r"Triton is not supported on current platform, roll back to CPU",
          "no GPU here: SGLang's FLA attention falls back to CPU (the check runs the Triton interpreter)"),
    Noise("does not support Intel AMX", r"does not support Intel AMX",
          "SGLang's CPU-backend probe; its CPU backend is not used"),
    Noise("Cannot detect CUDA architecture", r"Cannot detect CUDA architecture", "no GPU here"),
    Noise("No CUDA runtime is found", r"No CUDA runtime is found", "torch's extension loader on a machine without CUDA"),
    Noise("Ignore import error ... causal_conv1d_fn",
          r"Ignore import error when loading sglang\.srt\.models\.\w*mamba\w*: cannot import name 'causal_conv1d_fn'",
          "SGLang's Mamba model files need a CUDA kernel; Kimi-K3 does not use them"),
    Noise("K3 fused KDA decode disabled", r"K3 fused KDA decode disabled: unexpected conv/A_log/dt_bias layout",
          "SGLang's fused KDA decode needs K3's real head sizes; small synthetic checkpoints use the unfused path"),
    Noise("K3 SP collective requires SM100/SM103 ...", r"K3 SP collective requires",
          "the sequence-parallel collective needs SM100 and multicast; NCCL is used"),
    Noise("Kimi-K3 vision attention uses shape-aware auto selection",
          r"Kimi-K3 vision attention uses shape-aware auto selection", "informational (B300/GB300)"),
)
_COMPILED = [(n, re.compile(n.pattern)) for n in KNOWN]
_seen: set[str] = set()
_installed = False


def match(message: str) -> Noise | None:
    """The known message this text is, or None."""
    for n, rx in _COMPILED:
        if rx.search(message):
            return n
    return None


class _Filter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        try:
            n = match(record.getMessage())
        except Exception:  # a malformed record is not ours to judge
            return True
        if n is None:
            return True
        _seen.add(n.says)
        return False


_FILTER = _Filter()


def install() -> None:
    """Filter the known messages in this process: Python warnings, and log records on every
    handler (those that exist and those added later: SGLang configures its own)."""
    global _installed
    if _installed:
        return
    _installed = True
    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        n = match(str(message))
        if n is None:
            return show(message, category, filename, lineno, file, line)
        _seen.add(n.says)

    warnings.showwarning = showwarning
    add = logging.Logger.addHandler

    def add_handler(self, handler):
        handler.addFilter(_FILTER)
        return add(self, handler)

    logging.Logger.addHandler = add_handler
    for logger in [logging.getLogger(), *logging.Logger.manager.loggerDict.values()]:
        for h in getattr(logger, "handlers", []):
            h.addFilter(_FILTER)
    if logging.lastResort is not None:
        logging.lastResort.addFilter(_FILTER)


def seen() -> list[str]:
    """The known messages filtered so far in this process (their ``says``)."""
    return sorted(_seen)


def explain(says) -> list[str]:
    """One line per known message that was filtered: what SGLang said and why it does not matter."""
    why = {n.says: n.why for n in KNOWN}
    return [f'  "{s}": {why[s]}' for s in sorted(set(says)) if s in why]
