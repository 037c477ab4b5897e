"""Whether this package's Triton kernels run in Triton's CPU interpreter.

Triton picks the interpreter when a kernel is *defined* (``@triton.jit`` reads
TRITON_INTERPRET), i.e. when ``k3nvfp4.kernels`` is imported. Setting the variable later
changes nothing, so a process that wants CPU execution must set it before that import, and a
command-line tool started without it can only start over (:func:`rerun_with_interpreter`).
"""

from __future__ import annotations

import os
import sys

_TRUE = ("1", "true", "on", "yes")


def interpret_requested() -> bool:
    """TRITON_INTERPRET is set to a true value now (Triton's own reading where available)."""
    try:
        from triton import knobs

        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):  # Triton without knobs
        return os.environ.get("TRITON_INTERPRET", "").strip().lower() in _TRUE


def kernels_interpreted() -> bool:
    """True when the fused MoE kernels were defined for the interpreter AND it is requested now."""
    from .moe_details import kernels as moe_kernels

    return interpret_requested() and type(moe_kernels.gemm1_gated_kernel).__name__ == "InterpretedFunction"


def rerun_with_interpreter(module: str, *, even_with_cuda: bool = False) -> None:
    """For command-line tools that run the kernels on CPU: when they were defined without the
    interpreter, replace this process by ``python -P -m k3nvfp4.common.entry <module> <same
    arguments>`` (which runs ``<module>.main()``) with
    TRITON_INTERPRET=1. Returns (doing nothing) when the kernels already run in the interpreter,
    or when a CUDA device is present (unless ``even_with_cuda``)."""
    import torch

    if kernels_interpreted() or (torch.cuda.is_available() and not even_with_cuda):
        return
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    sys.stdout.flush()
    sys.stderr.flush()
    # Through k3nvfp4.common.entry: a Ctrl-C while the new process imports torch is one line, not a traceback.
    os.execve(sys.executable, [sys.executable, "-P", "-m", "k3nvfp4.common.entry", module, *sys.argv[1:]], env)
