"""Where the kernels run: the CUDA device, its architecture and the installed Triton.

Every device, architecture and version probe of the package is here, so that "which GPU is
this" has one answer and one place to change (a new architecture, a device model, a Triton
release the kernels need). torch and Triton are imported inside the functions: the SGLang
plugin's registration imports modules that call these probes, and stays light.
"""

from __future__ import annotations

import functools

__all__ = ["capability", "current_arch", "current_device_name", "model_device_name", "triton_release",
           "triton_version"]


def triton_version() -> tuple[int, int]:
    """(major, minor) of the installed Triton, e.g. (3, 8); a minor like "8rc1" counts as 8."""
    import triton

    parts = triton.__version__.split(".")
    return int(parts[0]), int("".join(c for c in parts[1] if c.isdigit()) or 0)


def triton_release() -> str:
    """The installed Triton's "major.minor" ("3.8"): the key of the measured cost tables."""
    import triton

    return ".".join(triton.__version__.split(".")[:2])


def capability(device=None) -> tuple[int, int] | None:
    """CUDA compute capability (major, minor) of ``device`` (None: the current CUDA device), or
    None when torch sees no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(device))


@functools.lru_cache(maxsize=16)
def current_arch(device=None) -> int:
    """Compute capability x 10 of the current CUDA device (90 = H100/H200, 100 = B200), 90
    without a GPU (the heuristics then plan for Hopper)."""
    cap = capability(device)
    return 90 if cap is None else 10 * cap[0] + cap[1]


@functools.lru_cache(maxsize=16)
def current_device_name(device=None) -> str:
    """CUDA device name as tuned-config file names use it (spaces -> '_', like SGLang), or 'cpu'."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name(device).replace(" ", "_")


def model_device_name(device) -> str:
    """The static device model (perf_model.DEVICES key) the FP4 heuristic plans for on a
    torch.device: "H200" on a Hopper GPU, else "B200" (also off-GPU: the FP4 modes' target)."""
    if device.type == "cuda" and capability(device)[0] == 9:
        return "H200"
    return "B200"
