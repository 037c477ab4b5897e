"""SiTU-and-mul between the two marlin GEMMs: one elementwise Triton kernel, as SGLang runs it.

SGLang 0.5.23's fused_marlin_moe computes the gated SiTU of the GEMM1 output (bf16
[M * top_k, 2I], gate half then up half) with its own single Triton kernel (one program per
row and 1024 columns; fp32 math; tanh written as 2 * sigmoid(2x) - 1) into a bf16 [M * top_k, I]
buffer that GEMM2 reads. That kernel lives in sglang's Python package, which the GPU machine
does not have, so this is an independent kernel with the same launch shape and numerics
(tests/test_marlin_peer.py compares the two bit for bit in the interpreter):

    g' = beta * tanh(g / beta) * sigmoid(g);  u' = linear_beta * tanh(u / linear_beta);  out = g' * u'
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_N = 1024


@triton.jit
def _tanh_via_sigmoid(x):
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def _situ_mul_rows(x_ptr, out_ptr, n, beta, linear_beta, x_row_stride, out_row_stride,
                   BLOCK: tl.constexpr, SOFT_CAP_UP: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < n
    src = x_ptr + row * x_row_stride
    g = tl.load(src + cols, mask=keep, other=0.0).to(tl.float32)
    u = tl.load(src + n + cols, mask=keep, other=0.0).to(tl.float32)
    g = beta * _tanh_via_sigmoid(g / beta) * tl.sigmoid(g)
    if SOFT_CAP_UP:
        u = linear_beta * _tanh_via_sigmoid(u / linear_beta)
    tl.store(out_ptr + row * out_row_stride + cols, (g * u).to(out_ptr.dtype.element_ty), mask=keep)


def situ_and_mul_into(out: torch.Tensor, x: torch.Tensor, beta: float = 4.0, linear_beta: float | None = 25.0) -> torch.Tensor:
    """out [R, I] = SiTU(x[:, :I]) * soft_cap(x[:, I:]) for x [R, 2I] (row-contiguous); returns out."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x: expected [R, 2I], got shape {tuple(x.shape)}")
    R, n = x.shape[0], x.shape[1] // 2
    if tuple(out.shape) != (R, n):
        raise ValueError(f"out: expected shape {(R, n)}, got {tuple(out.shape)}")
    if x.stride(1) != 1 or out.stride(1) != 1:
        raise ValueError("x and out must have unit column stride")
    if R == 0:
        return out
    _situ_mul_rows[(R, triton.cdiv(n, BLOCK_N))](
        x, out, n, float(beta), float(linear_beta) if linear_beta is not None else 0.0, x.stride(0), out.stride(0),
        BLOCK=BLOCK_N, SOFT_CAP_UP=linear_beta is not None)
    return out
