"""bench/peers/marlin: SGLang's NVFP4 marlin MoE behind libk3marlin.so, the bench's marlin arm.

CPU: the torch scale processing equals SGLang's bit for bit; the SiTU kernel equals SGLang's bit
for bit (interpreter); the alignment choice follows SGLang's constants; a missing library is
reported by name. The library's nvcc build (~3-4 min on 2 cores, cached by source hash) and its
checks (exactly its k3m_* exports, no cudart / tvm-ffi, bad arguments refused before any CUDA
call, valid ones past SGLang's own host checks, the wrapper naming a bad tensor) are peer-build
checks: `bench/sass_report.py --check` runs them (bench/peers/marlin/selfcheck.py), not `make test`.
GPU (marker gpu, run by bench/gpu_check.sh with the library carried): marlin's MoE output
against fused_moe_nvfp4_reference on small TP- and EP-style shapes.
"""

from __future__ import annotations

import pathlib
import sys

import pytest
import torch

BENCH = pathlib.Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

from peers.marlin import activation, prepare  # noqa: E402
from peers.marlin import moe as marlin_moe  # noqa: E402
from peers.marlin.lib import MarlinLib, MarlinUnavailable, load  # noqa: E402


def test_missing_library_is_reported(tmp_path):
    with pytest.raises(MarlinUnavailable, match="not found: build it"):
        MarlinLib(tmp_path / "libk3marlin.so")


def _e4m3_scales(E: int, N: int, G: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(0, 127, (E, N, G), generator=g, dtype=torch.uint8)  # every non-negative finite code
    bits[0, 0, :4] = torch.tensor([0, 1, 7, 126], dtype=torch.uint8)  # zero, smallest subnormals, 448
    return bits.view(torch.float8_e4m3fn)


def test_scale_processing_equals_sglang():
    from sglang.srt.layers.quantization.marlin_utils import marlin_permute_scales
    from sglang.srt.layers.quantization.marlin_utils_fp4 import (
        nvfp4_marlin_process_global_scale,
        nvfp4_marlin_process_scales,
    )

    for E, N, K in ((3, 128, 256), (2, 384, 192)):
        s = _e4m3_scales(E, N, K // 16, seed=N)
        ours = prepare.process_block_scales(s)
        assert ours.shape == (E, K // 16, N) and ours.dtype == torch.float8_e4m3fn
        for e in range(E):  # SGLang's _permute_moe_fp4_scales_for_marlin, one expert at a time
            ref = nvfp4_marlin_process_scales(
                marlin_permute_scales(s[e].to(torch.bfloat16).T.contiguous(), size_k=K, size_n=N, group_size=16))
            assert torch.equal(ours[e].view(torch.uint8), ref.view(torch.uint8)), (E, N, K, e)
    s2 = torch.tensor([2.0**-9, 0.0123, 1.0, 3.5e-3], dtype=torch.float32)
    ref = nvfp4_marlin_process_global_scale(s2.to(torch.bfloat16))
    assert torch.equal(prepare.process_global_scale(s2), ref)


def test_transpose_nibbles_is_sglangs_int32_transpose():
    w = torch.randint(0, 256, (3, 64, 32), dtype=torch.uint8)
    t = prepare.transpose_nibbles(w)
    for e in range(3):
        assert torch.equal(t[e], w[e].view(torch.int32).T.contiguous())


def test_situ_kernel_equals_sglangs_bit_for_bit():
    from sglang.srt.layers.moe.fused_moe_triton.fused_marlin_moe import situ_and_mul

    from k3nvfp4.kernels.situ import situ_and_mul as situ_reference

    g = torch.Generator().manual_seed(3)
    x = (torch.randn(3, 2 * 1040, generator=g) * 12).to(torch.bfloat16)  # two column blocks, masked tail
    ours = activation.situ_and_mul_into(torch.empty(3, 1040, dtype=torch.bfloat16), x)
    theirs = torch.empty(3, 1040, dtype=torch.bfloat16)
    situ_and_mul(theirs, x, situ_beta=4.0, linear_beta=25.0)
    assert torch.equal(ours, theirs)
    ref = situ_reference(x.float()).float()  # exact tanh, fp32
    assert ((ours.float() - ref).abs() <= 2 ** -7 * ref.abs() + 1e-6).all()


def test_alignment_choice_follows_sglang():
    import importlib

    from sglang.kernels.ops.moe.moe_align_small_numel import SMALL_NUMEL_LIMIT

    # the module (its package re-exports a function of the same name)
    mab = importlib.import_module("sglang.srt.layers.moe.moe_runner.triton_utils.moe_align_block_size")

    assert marlin_moe.SMALL_NUMEL_LIMIT == SMALL_NUMEL_LIMIT
    assert marlin_moe.CUDA_SMALL_BATCH_MAX_BUCKETS == mab._CUDA_SMALL_BATCH_MAX_BUCKETS
    tp = [marlin_moe.align_path(M, 16, 896, False)[0] for M in (1, 4, 16, 1024)]
    assert tp == ["moe_align_single_token (CUDA JIT)", "moe_align_small_numel (Triton, sglang)",
                  "moe_align_block_size (CUDA JIT)", "moe_align_block_size (CUDA JIT)"]
    ep = [marlin_moe.align_path(M, 16, 896, True) for M in (1, 4, 16)]
    assert [p[0] for p in ep] == ["moe_align_small_numel (Triton, sglang)"] * 2 + ["moe_align_block_size (sgl_kernel)"]
    assert all(p[1] == "moe_align_block_size (CUDA JIT) in its place" for p in ep)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("E,global_experts,H,I,top_k,M", [
    (8, 8, 256, 128, 4, 1), (8, 8, 256, 128, 4, 37), (16, 16, 512, 192, 6, 300), (4, 16, 256, 128, 4, 9),
    (4, 16, 256, 128, 4, 200),
])
def test_marlin_moe_matches_reference_on_gpu(E, global_experts, H, I, top_k, M):
    from k3nvfp4.kernels import fused_moe_nvfp4_reference
    from k3nvfp4.kernels.testing import kimi_routing, random_nvfp4_moe_weights
    from k3nvfp4.kernels.tune import normwise_error

    lib = load()  # the carried library: its absence is a failure here, not a skip
    assert lib.usable_driver() is None, lib.usable_driver()
    dev = torch.device("cuda")
    w = random_nvfp4_moe_weights(E, H, I, device=dev, seed=E + M, block_scales="uniform",
                                 distinct_gate_up_scale_2=False)
    x = torch.randn(M, H, device=dev, generator=torch.Generator(dev).manual_seed(M)).to(torch.bfloat16)
    tw, ids = kimi_routing(M, top_k, global_experts, local_experts=range(E), device=dev, seed=M)
    mm = marlin_moe.MarlinMoE(lib, prepare.prepare_marlin_weights(w, lib), global_experts=global_experts)
    assert mm.is_ep == (E != global_experts)
    out = torch.full((M, H), float("nan"), dtype=torch.bfloat16, device=dev)
    mm(x, tw, ids, out=out)
    ref = fused_moe_nvfp4_reference(x, w, tw, ids, round_gemm1_output=True).float()
    assert normwise_error(out, ref) < 1e-2
