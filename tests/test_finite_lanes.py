"""No lane of either kernel family computes 0/0 or inf x 0, whatever the allocator left in the
buffers the kernels read (issue 26, item 5).

The kernels read whole row blocks unmasked, padding rows included. The FP4 family's GEMM1 used
to leave the intermediate's padding rows unwritten, so GEMM2 (and the dynamic row quantizer)
fed uninitialised bytes to their MMAs: NaN / inf there made numpy warn "invalid value
encountered in multiply / matmul / divide" on lanes that are never stored (the warnings of
`make test` in test_ab_layer's FP4 arms and test_launches' mxfp8 calls, depending on what the
allocator handed out). Here every ``torch.empty`` of the calls is poisoned (fp32 / bf16 with NaN
or +inf, float8 bytes with NaN or 0, uint8 with 0xFF: E8M0 NaN), numpy's RuntimeWarnings are
errors, and the test asserts that
- the intermediate rows GEMM2 reads (all rows of the used blocks) hold finite values when it
  launches, while the rows past the used blocks still hold the poison (the poison did land);
- the output is finite and bit-identical to an unpoisoned call.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from k3nvfp4.kernels import MoEConfig, NVFP4MoEWeights, fused_moe_nvfp4
from k3nvfp4.kernels.moe_details import kernels as w4a16_kernels
from k3nvfp4.kernels.moe_fp4 import FP4MMAWeights, FP4MoEConfig, check_fp4_mode_supported, fused_moe_fp4
from k3nvfp4.kernels.moe_fp4_details import kernels as fp4_kernels
from k3nvfp4.kernels.testing import random_mxfp4_tensors, random_routing

pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@dataclasses.dataclass(frozen=True)
class Poison:
    name: str
    wide: float  # fp32 / bf16 / fp16 fill
    fp8: int  # byte of float8 buffers (E4M3 values and scales)
    u8: int  # byte of uint8 buffers (packed E2M1, E8M0 scales)


POISONS = [Poison("nan", float("nan"), 0xFF, 0xFF), Poison("inf", float("inf"), 0x00, 0xFF)]


@pytest.fixture(params=POISONS, ids=[p.name for p in POISONS])
def poison(request, monkeypatch):
    """torch.empty returning poisoned memory for the duration of a test."""
    p = request.param
    empty = torch.empty

    def poisoned(*args, **kwargs):
        t = empty(*args, **kwargs)
        if t.dtype.is_floating_point and t.element_size() > 1:
            t.fill_(p.wide)
        elif t.dtype.is_floating_point:
            t.view(torch.uint8).fill_(p.fp8)
        elif t.dtype == torch.uint8:
            t.fill_(p.u8)
        return t

    monkeypatch.setattr(torch, "empty", poisoned)
    return p


class _Gemm2Spy:
    """Stands in for a GEMM2 kernel object: at launch, copies the named arguments (the
    intermediate buffers and num_padded, complete at that point), then launches."""

    def __init__(self, kernel, names: tuple[str, ...]):
        self.kernel, self.names, self.seen = kernel, names, []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            bound = dict(zip(self.kernel.arg_names, args)) | kwargs
            self.seen.append({n: bound[n].clone() for n in self.names})
            return launch(*args, **kwargs)

        return run


def _finite(t: torch.Tensor) -> torch.Tensor:
    """Per-element finiteness of an intermediate buffer: E8M0 bytes (uint8 scale tensors) are
    NaN only at 0xFF; packed E2M1 bytes are always finite (callers pass them as such)."""
    if t.dtype == torch.uint8:
        return t != 0xFF
    return torch.isfinite(t.float())


_CLEAN: dict[str, torch.Tensor] = {}


def _clean(key: str, call) -> torch.Tensor:
    """The unpoisoned result of one case (computed once for both poisons)."""
    if key not in _CLEAN:
        _CLEAN[key] = call()
    return _CLEAN[key]


E, H, I, K, M = 4, 128, 128, 2, 3  # 6 pairs in blocks of 16: padding rows in every block


@pytest.fixture(scope="module")
def problem():
    w = NVFP4MoEWeights.from_mxfp4(*random_mxfp4_tensors(E, H, I, seed=5)).to(DEV)
    tw, ids = random_routing(M, K, E, seed=5, device=DEV)
    x = torch.randn(M, H, generator=torch.Generator().manual_seed(5)).to(DEV)
    return w, tw, ids, x


def test_w4a16_lanes_stay_finite_over_poisoned_buffers(problem, poison, monkeypatch):
    """bf16, both GEMMs split over K (GEMM1's fp32 partials and GEMM2's top-k rows poisoned too)."""
    w, tw, ids, x = problem
    dtype, cfg = torch.bfloat16, MoEConfig(block_k1=64, split_k1=2, block_n2=128, block_k2=64, split_k2=2)
    x = x.to(dtype)
    spy = _Gemm2Spy(w4a16_kernels.gemm2_combine_kernel, ("a_ptr", "num_padded_ptr"))
    monkeypatch.setattr(w4a16_kernels, "gemm2_combine_kernel", spy)
    y = fused_moe_nvfp4(x, w, tw, ids, config=cfg)
    (seen,) = spy.seen
    used = int(seen["num_padded_ptr"][0])
    inter = seen["a_ptr"]
    assert 0 < used < inter.shape[0] and bool(_finite(inter[:used]).all())
    assert not bool(_finite(inter[used:]).any())  # never written: the poison is what GEMM2 would read
    assert bool(torch.isfinite(y).all())
    monkeypatch.undo()  # the same call on unpoisoned memory
    assert torch.equal(y, _clean(f"w4a16 {dtype} {cfg}", lambda: fused_moe_nvfp4(x, w, tw, ids, config=cfg)))


FP4 = [
    ("mxfp8", "auto", FP4MoEConfig(block_n1=64, block_k1=64, split_k1=2, block_n2=128, block_k2=64, split_k2=2)),
    ("nvfp4", "auto", FP4MoEConfig(block_n1=64, block_k1=64, block_n2=128, block_k2=64)),
    ("nvfp4", "dynamic", FP4MoEConfig(block_n1=64, block_k1=64, split_k1=2, block_n2=128, block_k2=64)),
]


@pytest.mark.parametrize("act_quant,inter,cfg", FP4, ids=["mxfp8-split-k", "nvfp4-static", "nvfp4-dynamic-split-k"])
def test_fp4_lanes_stay_finite_over_poisoned_buffers(problem, poison, monkeypatch, act_quant, inter, cfg):
    check_fp4_mode_supported(act_quant, torch.device(DEV))
    w, tw, ids, x = problem
    fw = FP4MMAWeights.from_mxfp4(*random_mxfp4_tensors(E, H, I, seed=5), act_quant=act_quant).to(DEV)  # problem's experts
    # GEMM2's operands: values (packed E2M1 for nvfp4: every code is finite, so not checked),
    # block scales, and the dynamic NVFP4 row scales.
    checked = ("as_ptr",) + (("a_ptr",) if act_quant == "mxfp8" else ()) + (("ars_ptr",) if inter == "dynamic" else ())
    spy = _Gemm2Spy(fp4_kernels.fp4_gemm2_kernel, checked + ("num_padded_ptr",))
    monkeypatch.setattr(fp4_kernels, "fp4_gemm2_kernel", spy)
    kw = dict(intermediate_scale=inter, config=cfg)
    y = fused_moe_fp4(x, fw, tw, ids, **kw)
    (seen,) = spy.seen
    used = int(seen["num_padded_ptr"][0])
    for name in checked:
        buf = seen[name]
        assert 0 < used < buf.shape[0] and bool(_finite(buf[:used]).all()), name
        if not (poison.fp8 == 0 and buf.dtype == torch.float8_e4m3fn):  # zero bytes are finite E4M3
            assert not bool(_finite(buf[used:]).any()), name  # never written: the poison landed
    assert bool(torch.isfinite(y).all())
    monkeypatch.undo()  # the same call on unpoisoned memory
    assert torch.equal(y, _clean(f"fp4 {kw}", lambda: fused_moe_fp4(x, fw, tw, ids, **kw)))
