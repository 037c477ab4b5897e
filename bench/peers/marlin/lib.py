"""ctypes binding of libk3marlin.so (built by build.py; needs no sglang at run time).

Each method takes torch tensors, checks their dtype / shape / device / contiguity here (a
clear ValueError naming the tensor), passes their data pointers and sizes to the library, and
turns a nonzero return code into MarlinError with the library's message. Kernels are queued
on the current torch CUDA stream (capturable in a CUDA graph).
"""

from __future__ import annotations

import ctypes
import json
import os
import pathlib
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
DEFAULT_LIB = HERE.parents[2] / "build" / "peers" / "marlin" / "lib" / "libk3marlin.so"
LIB_ENV = "K3NVFP4_MARLIN_LIB"

# return codes (api.cu)
OK, EARG, ESGLANG, ECUDA = 0, 1, 2, 3
CODE_NAMES = {EARG: "bad argument", ESGLANG: "SGLang host code", ECUDA: "CUDA"}

_i = ctypes.c_int
_l = ctypes.c_int64
_p = ctypes.c_void_p

SIGNATURES: dict[str, tuple[Any, list[Any]]] = {
    "k3m_abi_version": (_i, []),
    "k3m_build_info": (ctypes.c_char_p, []),
    "k3m_last_error": (ctypes.c_char_p, []),
    "k3m_cuda_versions": (_i, [ctypes.POINTER(_i), ctypes.POINTER(_i)]),
    "k3m_repack_fp4": (_i, [_i, _p, _p, _p, _l, _l, _l]),
    "k3m_moe_align_block_size": (_i, [_i, _p, _p, _l, _l, _l, _p, _l, _p, _l, _p, _l, _p, _l, _i]),
    "k3m_moe_align_single_token": (_i, [_i, _p, _p, _l, _l, _p, _l, _p, _l, _p, _l, _i]),
    "k3m_marlin_gemm": (_i, [_i, _p, _p, _p, _p, _p, _p, _p, _l, _p, _l, _p, _l, _p, _l, _p, _p, _l,
                             _l, _l, _l, _l, _l, _l, _i, _i, _i, _i, _i]),
    "k3m_moe_topk_sum": (_i, [_i, _p, _p, _p, _l, _l, _l]),
}
ABI_VERSION = 1


class MarlinUnavailable(RuntimeError):
    """The library cannot be used here (missing, wrong ABI, no GPU driver...)."""


class MarlinError(RuntimeError):
    """A library call returned an error code."""

    def __init__(self, func: str, code: int, message: str):
        super().__init__(f"{func}: {CODE_NAMES.get(code, code)} error: {message}")
        self.func, self.code, self.message = func, code, message


def library_path() -> pathlib.Path:
    return pathlib.Path(os.environ.get(LIB_ENV) or DEFAULT_LIB)


class MarlinLib:
    """The loaded library. ``raw`` is the ctypes handle (for the argument-check tests)."""

    def __init__(self, path: str | os.PathLike | None = None):
        self.path = pathlib.Path(path) if path else library_path()
        if not self.path.is_file():
            raise MarlinUnavailable(
                f"{self.path} not found: build it on a machine with sglang 0.5.23 and nvcc "
                f"(python -P bench/peers/marlin/build.py) and carry it (build/peers/marlin/lib)")
        try:
            self.raw = ctypes.CDLL(str(self.path))
        except OSError as e:
            raise MarlinUnavailable(f"cannot load {self.path}: {e}") from e
        for name, (res, args) in SIGNATURES.items():
            fn = getattr(self.raw, name)
            fn.restype, fn.argtypes = res, args
        if self.raw.k3m_abi_version() != ABI_VERSION:
            raise MarlinUnavailable(f"{self.path}: ABI {self.raw.k3m_abi_version()}, expected {ABI_VERSION}: rebuild it")
        self.info: dict = json.loads(self.raw.k3m_build_info().decode())

    # ------------------------------------------------------------------ plumbing

    def call(self, name: str, *args) -> None:
        code = getattr(self.raw, name)(*args)
        if code != OK:
            raise MarlinError(name, code, self.raw.k3m_last_error().decode(errors="replace"))

    def cuda_versions(self) -> tuple[int, int]:
        """(driver, runtime) CUDA versions as 1000 * major + 10 * minor (runtime: this library's static cudart)."""
        d, r = _i(0), _i(0)
        code = self.raw.k3m_cuda_versions(ctypes.byref(d), ctypes.byref(r))
        if code != OK and r.value == 0:
            raise MarlinError("k3m_cuda_versions", code, self.raw.k3m_last_error().decode(errors="replace"))
        return d.value, r.value

    def usable_driver(self) -> str | None:
        """None when the driver can run this library's CUDA runtime, else why not."""
        try:
            driver, runtime = self.cuda_versions()
        except MarlinError as e:
            return str(e)
        if driver < runtime:
            return (f"the GPU driver supports CUDA {driver // 1000}.{driver % 1000 // 10}, the library's static "
                    f"runtime is CUDA {runtime // 1000}.{runtime % 1000 // 10} (built with nvcc "
                    f"{self.info['key']['nvcc_version']}): rebuild with an older nvcc or update the driver")
        return None

    @staticmethod
    def _stream_device(t) -> tuple[int, int]:
        import torch

        if t.device.type != "cuda":
            raise ValueError(f"tensors must be on a CUDA device, got {t.device}")
        return t.device.index, torch.cuda.current_stream(t.device).cuda_stream

    @staticmethod
    def _check(t, name: str, dtype, shape: tuple[int, ...] | None = None, device=None) -> None:
        if t.dtype != dtype:
            raise ValueError(f"{name}: expected dtype {dtype}, got {t.dtype}")
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        if device is not None and t.device != device:
            raise ValueError(f"{name} is on {t.device}, expected {device}")

    # ------------------------------------------------------------------ entry points

    def repack_fp4(self, qweight_t, out, size_k: int, size_n: int) -> None:
        """gptq_marlin_repack of E matrices: qweight_t int32 [E, size_k/8, size_n] -> out int32 [E, size_k/16, 2*size_n]."""
        import torch

        E = qweight_t.shape[0]
        self._check(qweight_t, "qweight_t", torch.int32, (E, size_k // 8, size_n))
        self._check(out, "out", torch.int32, (E, size_k // 16, 2 * size_n), qweight_t.device)
        dev, stream = self._stream_device(qweight_t)
        self.call("k3m_repack_fp4", dev, stream, qweight_t.data_ptr(), out.data_ptr(), E, size_k, size_n)

    def align_block_size(self, topk_ids, num_buckets: int, block_size: int, sorted_ids, expert_ids, num_post,
                         cumsum, write_inactive_prefix_count: bool) -> None:
        """SGLang's CUDA moe_align_block_size (ids in [-1, num_buckets - 2], int32)."""
        import torch

        self._check(topk_ids, "topk_ids", torch.int32)
        for n, t in (("sorted_ids", sorted_ids), ("expert_ids", expert_ids), ("num_tokens_post_pad", num_post),
                     ("cumsum_buffer", cumsum)):
            self._check(t, n, torch.int32, None, topk_ids.device)
        dev, stream = self._stream_device(topk_ids)
        self.call("k3m_moe_align_block_size", dev, stream, topk_ids.data_ptr(), topk_ids.numel(), num_buckets,
                  block_size, sorted_ids.data_ptr(), sorted_ids.numel(), expert_ids.data_ptr(), expert_ids.numel(),
                  num_post.data_ptr(), num_post.numel(), cumsum.data_ptr(), cumsum.numel(),
                  int(write_inactive_prefix_count))

    def align_single_token(self, topk_ids, block_size: int, sorted_ids, expert_ids, num_post,
                           write_inactive_prefix_count: bool) -> None:
        """SGLang's moe_align_single_token (M == 1, distinct ids)."""
        import torch

        self._check(topk_ids, "topk_ids", torch.int32)
        if topk_ids.dim() != 2 or topk_ids.shape[0] != 1:
            raise ValueError(f"topk_ids: expected shape [1, topk], got {tuple(topk_ids.shape)}")
        for n, t in (("sorted_ids", sorted_ids), ("expert_ids", expert_ids), ("num_tokens_post_pad", num_post)):
            self._check(t, n, torch.int32, None, topk_ids.device)
        dev, stream = self._stream_device(topk_ids)
        self.call("k3m_moe_align_single_token", dev, stream, topk_ids.data_ptr(), topk_ids.shape[1], block_size,
                  sorted_ids.data_ptr(), sorted_ids.numel(), expert_ids.data_ptr(), expert_ids.numel(),
                  num_post.data_ptr(), num_post.numel(), int(write_inactive_prefix_count))

    def marlin_gemm(self, a, c, b_q, b_scales, global_scale, workspace, sorted_ids, expert_ids, num_post,
                    topk_weights, c_tmp, *, moe_block_size: int, top_k: int, size_m: int, size_n: int, size_k: int,
                    mul_topk_weights: bool, is_ep: bool, zero_inactive_output: bool, use_atomic_add: bool,
                    use_fp32_reduce: bool) -> None:
        """One moe_wna16_marlin_gemm call (bf16 x NVFP4) as fused_marlin_moe makes it."""
        import torch

        E = b_q.shape[0]
        self._check(a, "a", torch.bfloat16, (size_m, size_k))
        dev = a.device
        self._check(c, "c", torch.bfloat16, (size_m * top_k, size_n), dev)
        self._check(b_q, "b_q_weight", torch.int32, (E, size_k // 16, 2 * size_n), dev)
        self._check(b_scales, "b_scales", torch.float8_e4m3fn, (E, size_k // 16, size_n), dev)
        self._check(global_scale, "global_scale", torch.bfloat16, (E,), dev)
        self._check(workspace, "workspace", torch.int32, None, dev)
        for n, t in (("sorted_token_ids", sorted_ids), ("expert_ids", expert_ids), ("num_tokens_post_padded", num_post)):
            self._check(t, n, torch.int32, None, dev)
        self._check(topk_weights, "topk_weights", torch.float32, None, dev)
        if topk_weights.numel() != size_m * top_k:
            raise ValueError(f"topk_weights: {topk_weights.numel()} weights, expected {size_m * top_k}")
        self._check(c_tmp, "c_tmp", torch.float32, None, dev)
        d, stream = self._stream_device(a)
        self.call("k3m_marlin_gemm", d, stream, a.data_ptr(), c.data_ptr(), b_q.data_ptr(), b_scales.data_ptr(),
                  global_scale.data_ptr(), workspace.data_ptr(), workspace.numel(), sorted_ids.data_ptr(),
                  sorted_ids.numel(), expert_ids.data_ptr(), expert_ids.numel(), num_post.data_ptr(), num_post.numel(),
                  topk_weights.data_ptr(), c_tmp.data_ptr() if c_tmp.numel() else None, c_tmp.numel(), E,
                  moe_block_size, top_k, size_m, size_n, size_k, int(mul_topk_weights), int(is_ep),
                  int(zero_inactive_output), int(use_atomic_add), int(use_fp32_reduce))

    def topk_sum(self, x, out) -> None:
        """out bf16 [M, K] = x bf16 [M, topk, K].sum(1) (SGLang's JIT moe_topk_sum)."""
        import torch

        if x.dim() != 3:
            raise ValueError(f"x: expected [M, topk, K], got shape {tuple(x.shape)}")
        M, T, K = x.shape
        self._check(x, "x", torch.bfloat16)
        self._check(out, "out", torch.bfloat16, (M, K), x.device)
        dev, stream = self._stream_device(x)
        self.call("k3m_moe_topk_sum", dev, stream, x.data_ptr(), out.data_ptr(), M, T, K)


_LOADED: dict[str, MarlinLib] = {}


def load(path: str | os.PathLike | None = None) -> MarlinLib:
    """The library at ``path`` (default: $K3NVFP4_MARLIN_LIB or build/peers/marlin/lib/libk3marlin.so), loaded once."""
    p = str(pathlib.Path(path) if path else library_path())
    if p not in _LOADED:
        _LOADED[p] = MarlinLib(p)
    return _LOADED[p]
