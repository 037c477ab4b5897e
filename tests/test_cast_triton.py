"""The Triton scale kernel of the cast against the torch path, bit for bit.

Without CUDA the kernel runs in the Triton interpreter on CPU tensors (tests/conftest.py
sets TRITON_INTERPRET=1); with CUDA the same tests run the compiled kernel on the GPU,
always against the torch path on CPU."""

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from k3nvfp4.kernels import formats
from k3nvfp4.kernels.cast import MXFP4Weight, cast_expert, cast_mxfp4_to_nvfp4
from k3nvfp4.kernels.cast_details.scales_torch import e8m0_to_e4m3_torch
from k3nvfp4.kernels.cast_details.scales_triton import e8m0_to_e4m3_triton

# where the Triton kernel runs: the GPU when there is one, else the interpreter on CPU
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _e8m0(rng, shape, top, lo, zero_frac=0.0):
    e = rng.integers(lo, top + 1, size=shape).astype(np.uint8)
    e[rng.random(shape) < zero_frac] = 0
    e.reshape(-1)[0] = top
    return torch.from_numpy(e)


@pytest.mark.parametrize(
    "shape,top,lo,zero_frac",
    [
        ((3, 5), 127, 110, 0.0),  # all in range, fewer blocks than one program
        ((37, 29), 140, 100, 0.1),  # out-of-range and zero-exponent blocks, 1073 > BLOCK
        ((8, 4), 254, 0, 0.2),  # the whole byte range below the largest finite
        ((4, 6), 10, 0, 0.5),  # small max: nothing can be out of range
        ((2, 3), 0, 0, 1.0),  # every block e8m0 == 0
    ],
)
def test_scale_kernel_matches_torch(shape, top, lo, zero_frac):
    rng = np.random.default_rng(top + shape[0])
    e = _e8m0(rng, shape, top, lo, zero_frac)
    ref = e8m0_to_e4m3_torch(e, top)
    got = e8m0_to_e4m3_triton(e.to(KERNEL_DEVICE), top)
    assert got.scale_e4m3.dtype == torch.uint8 and got.scale_e4m3.shape == (shape[0], 2 * shape[1])
    assert torch.equal(got.scale_e4m3.cpu(), ref.scale_e4m3)
    assert got.out_of_range_blocks == ref.out_of_range_blocks == int((e.int() < top - 17).sum())
    assert got.zero_exponent_blocks == ref.zero_exponent_blocks == int((e == 0).sum())


def test_scale_kernel_every_exponent_against_formats():
    # each in-window byte: the kernel's integer bit construction vs formats.exp2_to_e4m3
    top = 200
    e = torch.arange(top - 17, top + 1, dtype=torch.uint8).reshape(1, -1)
    got = e8m0_to_e4m3_triton(e.to(KERNEL_DEVICE), top).scale_e4m3.cpu().view(-1, 2)
    expected = formats.exp2_to_e4m3(e.reshape(-1).int() - top + 8).view(torch.uint8)
    assert torch.equal(got[:, 0], expected) and torch.equal(got[:, 1], expected)


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_cast_triton_backend_matches_torch_backend(seed):
    rng = np.random.default_rng(seed)
    rows, hidden = 32, 96
    top = int(rng.integers(30, 200))
    lo = top - 17 if seed % 2 == 0 else top - 30  # odd seeds: out-of-range blocks
    mats = [
        MXFP4Weight(
            torch.from_numpy(rng.integers(0, 256, (rows, hidden // 2)).astype(np.uint8)),
            _e8m0(rng, (rows, hidden // 32), top if i == 1 else top - 2, lo, 0.05 * (seed % 3)),
            f"l{seed}.e0.w{i}",
        )
        for i in (1, 3)
    ]
    ref, ref_stats = cast_mxfp4_to_nvfp4(mats, backend="torch")
    dev = [MXFP4Weight(w.packed.to(KERNEL_DEVICE), w.scale.to(KERNEL_DEVICE), w.name) for w in mats]
    got, got_stats = cast_mxfp4_to_nvfp4(dev, backend="triton")
    assert got_stats == ref_stats
    if lo < top - 17:
        assert got_stats.out_of_range_blocks > 0
    for r, g, src, d in zip(ref, got, mats, dev):
        assert g.packed.device.type == g.scale.device.type == KERNEL_DEVICE
        assert torch.equal(g.packed.cpu(), r.packed)
        assert torch.equal(g.scale.view(torch.uint8).cpu(), r.scale.view(torch.uint8))
        assert g.scale.dtype == torch.float8_e4m3fn
        assert float(g.scale_2) == float(r.scale_2) == 2.0 ** (top - 135)
        if ref_stats.out_of_range_blocks == 0:
            assert g.packed is d.packed
            assert torch.equal(
                formats.dequantize_nvfp4(g.packed, g.scale, g.scale_2).cpu(),
                formats.dequantize_mxfp4(src.packed, src.scale),
            )


@given(
    rows=st.integers(1, 9),
    nblocks=st.integers(1, 7),
    top=st.integers(0, 254),
    spread=st.integers(0, 60),
    zero_frac=st.sampled_from([0.0, 0.2]),
    seed=st.integers(0, 2**31 - 1),
)
def test_property_triton_equals_torch(rows, nblocks, top, spread, zero_frac, seed):
    rng = np.random.default_rng(seed)
    w = MXFP4Weight(
        torch.from_numpy(rng.integers(0, 256, (rows, 16 * nblocks)).astype(np.uint8)),
        _e8m0(rng, (rows, nblocks), top, max(top - spread, 0), zero_frac),
        "w",
    )
    (ref,), ref_stats = cast_mxfp4_to_nvfp4([w], backend="torch")
    dev = MXFP4Weight(w.packed.to(KERNEL_DEVICE), w.scale.to(KERNEL_DEVICE), w.name)
    (got,), got_stats = cast_mxfp4_to_nvfp4([dev], backend="triton")
    assert got_stats == ref_stats
    assert torch.equal(got.packed.cpu(), ref.packed)
    assert torch.equal(got.scale.view(torch.uint8).cpu(), ref.scale.view(torch.uint8))
    assert float(got.scale_2) == float(ref.scale_2)


def test_cast_expert_triton_backend_errors_like_torch():
    w = MXFP4Weight(
        torch.zeros(32, 16, dtype=torch.uint8, device=KERNEL_DEVICE),
        torch.full((32, 1), 255, dtype=torch.uint8, device=KERNEL_DEVICE),
        "x.w1",
    )
    with pytest.raises(ValueError, match=r"x\.w1: 32 E8M0 .*255"):
        cast_mxfp4_to_nvfp4([w], backend="triton")


def test_triton_backend_on_cpu_needs_the_interpreter(monkeypatch):
    w = MXFP4Weight(torch.zeros(1, 16, dtype=torch.uint8), torch.full((1, 1), 127, dtype=torch.uint8), "w")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
        cast_mxfp4_to_nvfp4([w], backend="triton")
    # "auto" on CPU tensors takes the torch path and needs no interpreter
    (n,), stats = cast_mxfp4_to_nvfp4([w], backend="auto")
    assert stats.all_exact and float(n.scale_2) == 2.0**-8


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cast_on_cuda_matches_cpu_torch_path():
    rng = np.random.default_rng(0)
    inter, hidden = 3072, 3584  # one K3 expert

    def mk(rows, cols, name, lo):
        p = torch.from_numpy(rng.integers(0, 256, (rows, cols // 2)).astype(np.uint8))
        return MXFP4Weight(p, _e8m0(rng, (rows, cols // 32), 127, lo, 1e-4), name)

    w1, w3, w2 = mk(inter, hidden, "w1", 112), mk(inter, hidden, "w3", 100), mk(hidden, inter, "w2", 110)
    ref = cast_expert(w1, w3, w2, backend="torch")
    gpu = [MXFP4Weight(w.packed.cuda(), w.scale.cuda(), w.name) for w in (w1, w3, w2)]
    got = cast_expert(*gpu, backend="auto")
    assert got[3] == ref[3] and ref[3].out_of_range_blocks > 0
    for r, g in zip(ref[:3], got[:3]):
        assert g.packed.is_cuda and g.scale.is_cuda
        assert torch.equal(g.packed.cpu(), r.packed)
        assert torch.equal(g.scale.view(torch.uint8).cpu(), r.scale.view(torch.uint8))
        assert float(g.scale_2) == float(r.scale_2)


@pytest.mark.parametrize("nonzero", [False, True])
def test_triton_backend_zero_block_fast_path_matches_torch(nonzero):
    # zero-exponent blocks holding only +-0 nibbles (what quantizers write), far below k_max:
    # the Triton path shares the fast path (no copy of the nibbles, E4M3 code 1 as scale)
    rng = np.random.default_rng(7 + nonzero)
    rows, nb = 16, 4
    e = _e8m0(rng, (rows, nb), 140, 123, 0.25)
    packed = rng.integers(0, 256, (rows, nb, 16)).astype(np.uint8)
    zero = e.numpy() == 0
    packed[zero] = np.array([0x00, 0x08, 0x80, 0x88], np.uint8)[rng.integers(0, 4, (int(zero.sum()), 16))]
    if nonzero:
        packed[np.argwhere(zero)[0][0], np.argwhere(zero)[0][1], 3] = 0x21  # one block with real values
    w = MXFP4Weight(torch.from_numpy(packed.reshape(rows, -1)), e, "w")
    (ref,), ref_stats = cast_mxfp4_to_nvfp4([w], backend="torch")
    dev = MXFP4Weight(w.packed.to(KERNEL_DEVICE), w.scale.to(KERNEL_DEVICE), w.name)
    (got,), got_stats = cast_mxfp4_to_nvfp4([dev], backend="triton")
    assert got_stats == ref_stats and ref_stats.out_of_range_blocks == int(zero.sum()) > 0
    assert ref_stats.all_exact != nonzero
    assert torch.equal(got.packed.cpu(), ref.packed) and torch.equal(got.scale.view(torch.uint8).cpu(), ref.scale.view(torch.uint8))
    assert (got.packed is dev.packed) != nonzero and (ref.packed is w.packed) != nonzero
    zero_halves = torch.from_numpy(zero).repeat_interleave(2, dim=1)
    if not nonzero:
        assert (got.scale.view(torch.uint8).cpu()[zero_halves] == 0x01).all()
