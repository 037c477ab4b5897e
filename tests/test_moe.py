"""Fused NVFP4 gated MoE (Triton, interpreter on CPU) against its plain-torch reference, and the
reference against an independent numpy / ml_dtypes computation."""

from __future__ import annotations

import dataclasses

import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from k3nvfp4.kernels import (
    MoEConfig,
    NVFP4MoEWeights,
    fused_moe_nvfp4,
    fused_moe_nvfp4_reference,
)
from k3nvfp4.kernels.activation import K3_SITU, GatedActivation
from k3nvfp4.kernels.testing import random_nvfp4_moe_weights, random_routing

# CPU tensors run in the Triton interpreter (conftest sets TRITON_INTERPRET without CUDA); on a
# GPU machine the same cases run on the GPU.
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def W(*args, **kw) -> NVFP4MoEWeights:
    return random_nvfp4_moe_weights(*args, device=DEV, **kw)


def R(*args, **kw):
    return random_routing(*args, device=DEV, **kw)


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEV)

# Stated bounds. fp32 end to end: only summation order differs (fp32 dots, exact dequant), so an
# indexing or scale bug (O(1) error) cannot hide. bf16: the intermediate is rounded to bf16 (the
# interpreter truncates instead of rounding) and the kernel's dots see bf16 x; 1e-2 normwise.
FP32_REL = 2e-5
BF16_REL = 1e-2

CONFIGS = {
    # Interpreter cost grows with the number of programs: the common configs use large tiles; the
    # others cover tails (small blocks), no swap, block_m 32, split-K and the atomic top-k sum.
    "default": MoEConfig(block_m=16, swap_ab=True, block_n1=64, block_k1=128, block_n2=128, block_k2=64),
    "noswap": MoEConfig(block_m=16, swap_ab=False, block_n1=16, block_k1=32, block_n2=64, block_k2=32),
    "bm32": MoEConfig(block_m=32, swap_ab=False, block_n1=64, block_k1=128, block_n2=16, block_k2=64),
    "splitk": MoEConfig(block_m=16, block_n1=64, block_k1=32, split_k1=2, block_n2=64, block_k2=32, split_k2=2),
    "atomic": MoEConfig(block_m=16, block_n1=32, block_k1=64, block_n2=64, block_k2=32, atomic_reduce=True),
    # The heuristic's deepest split: 16 one-step slices per GEMM.
    "splitk16": MoEConfig(block_m=16, block_n1=128, block_k1=32, split_k1=16, block_n2=128, block_k2=32, split_k2=16),
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def run_both(x, w, tw, ids, cfg="default", **kw):
    got = fused_moe_nvfp4(x, w, tw, ids, config=CONFIGS[cfg] if isinstance(cfg, str) else cfg, **kw)
    ref = fused_moe_nvfp4_reference(x, w, tw, ids, **kw)
    assert got.shape == ref.shape == x.shape and got.dtype == x.dtype
    return got, ref


# (E, top_k, M, H, I, activation, linear_beta, config)
FP32_CASES = [
    (1, 1, 1, 48, 16, "situ", 25.0, "default"),
    (4, 2, 3, 80, 48, "situ", None, "noswap"),
    (33, 8, 17, 48, 80, "situ", 25.0, "default"),
    (33, 2, 3, 144, 48, "silu", None, "default"),
    (4, 2, 64, 48, 16, "silu", 25.0, "bm32"),
    (33, 1, 64, 80, 16, "situ", 25.0, "splitk"),
    (4, 8, 17, 48, 48, "situ", 25.0, "atomic"),
    (4, 2, 17, 144, 48, "silu", None, "splitk"),
    (2, 1, 3, 512, 512, "situ", 25.0, "splitk16"),
]


@pytest.mark.parametrize("E,k,M,H,I,act,lb,cfg", FP32_CASES)
def test_fused_matches_reference_fp32(E, k, M, H, I, act, lb, cfg):
    w = W(E, H, I, seed=E * 1000 + M)
    tw, ids = R(M, k, E, seed=M + k)
    x = randn(M, H, seed=1)
    got, ref = run_both(x, w, tw, ids, cfg, activation=GatedActivation.parse(act, None, lb))
    assert ref.abs().max() > 0.05  # the case exercises non-trivial values
    assert rel_err(got, ref) < FP32_REL
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_matches_reference_16bit(dtype):
    E, k, M, H, I = 4, 2, 17, 80, 48
    w = W(E, H, I, seed=7)
    tw, ids = R(M, k, E, seed=3)
    x = randn(M, H, seed=2).to(dtype)
    got, ref = run_both(x, w, tw, ids, "default")
    assert rel_err(got, ref) < BF16_REL


def test_many_tokens_on_one_expert_and_empty_experts():
    E, M, H, I = 4, 40, 48, 16  # 40 pairs on expert 2: three 16-row blocks; experts 0, 1, 3 idle
    w = W(E, H, I, seed=3)
    ids = torch.full((M, 1), 2, dtype=torch.int32, device=DEV)
    tw = torch.rand(M, 1, generator=torch.Generator().manual_seed(0)).to(DEV)
    x = randn(M, H, seed=0)
    got, ref = run_both(x, w, tw, ids, "default")
    assert rel_err(got, ref) < FP32_REL


def test_minus_one_ids_contribute_nothing():
    E, k, M, H, I = 4, 4, 17, 48, 32
    w = W(E, H, I, seed=5)
    tw, ids = R(M, k, E, seed=5, num_global_experts=12)  # ~2/3 of ids are -1
    assert (ids == -1).any() and (ids >= 0).any()
    x = randn(M, H, seed=5)
    got, ref = run_both(x, w, tw, ids, "default")
    assert rel_err(got, ref) < FP32_REL
    # Same result as zeroing those slots' weights and pointing them at any real expert.
    ids0 = torch.where(ids < 0, torch.zeros_like(ids), ids)
    tw0 = torch.where(ids < 0, torch.zeros_like(tw), tw)
    got0 = fused_moe_nvfp4(x, w, tw0, ids0, config=CONFIGS["default"])
    torch.testing.assert_close(got, got0, rtol=1e-5, atol=1e-6)
    # A token whose ids are all -1 gets exactly zero.
    ids[0] = -1
    assert torch.equal(fused_moe_nvfp4(x, w, tw, ids)[0], torch.zeros(H, device=DEV))


def test_all_ids_dropped_gives_zeros():
    w = W(2, 32, 16, seed=1)
    x = randn(3, 32)
    ids = torch.full((3, 2), -1, dtype=torch.int64, device=DEV)
    tw = torch.ones(3, 2, device=DEV)
    assert torch.equal(fused_moe_nvfp4(x, w, tw, ids), torch.zeros(3, 32, device=DEV))


def test_gate_up_scale_2_applied_per_half_before_activation():
    E, k, M, H, I = 2, 2, 5, 32, 16
    w = W(E, H, I, seed=11)
    w13, s13, s13_2, w2, s2, s2_2 = w.to_modelopt()
    s13_2 = torch.tensor([[0.02, 0.3], [0.5, 0.01]], device=DEV)
    w = NVFP4MoEWeights.from_modelopt(w13, s13, s13_2, w2, s2, s2_2)
    swapped = NVFP4MoEWeights.from_modelopt(w13, s13, s13_2.flip(1), w2, s2, s2_2)
    tw, ids = R(M, k, E, seed=1)
    x = randn(M, H, seed=3) * 4
    got, ref = run_both(x, w, tw, ids, "default")
    assert rel_err(got, ref) < FP32_REL
    # Swapping gate/up scale_2 must change the answer (SiTU is not symmetric in gate/up).
    assert rel_err(fused_moe_nvfp4(x, swapped, tw, ids), ref) > 0.05


def test_non_contiguous_inputs_and_out():
    E, k, M, H, I = 4, 2, 9, 48, 32
    w = W(E, H, I, seed=2)
    tw_c, ids_c = R(M, k, E, seed=2)
    x_c = randn(M, H, seed=2)
    x = torch.zeros(M, 2 * H, device=DEV)
    x[:, ::2] = x_c
    x = x[:, ::2]  # column stride 2
    ids = ids_c.t().contiguous().t()
    tw = tw_c.t().contiguous().t()
    assert not (x.is_contiguous() or ids.is_contiguous() or tw.is_contiguous())
    out = torch.empty(M, H, device=DEV)
    res = fused_moe_nvfp4(x, w, tw, ids, out=out, config=CONFIGS["noswap"])
    assert res is out
    ref = fused_moe_nvfp4_reference(x_c, w, tw_c, ids_c)
    assert rel_err(out, ref) < FP32_REL
    xt = x_c.t().contiguous().t()  # row stride 1, column stride M
    assert rel_err(fused_moe_nvfp4(xt, w, tw, ids, config=CONFIGS["default"]), ref) < FP32_REL


def test_routed_scaling_factor_scales_the_sum():
    E, k, M, H, I = 4, 2, 5, 32, 16
    w = W(E, H, I, seed=4)
    tw, ids = R(M, k, E, seed=4)
    x = randn(M, H, seed=4)
    got, ref = run_both(x, w, tw, ids, "default", routed_scaling_factor=2.5)
    assert rel_err(got, ref) < FP32_REL
    plain = fused_moe_nvfp4_reference(x, w, tw, ids)
    torch.testing.assert_close(ref, plain * 2.5, rtol=1e-6, atol=1e-7)
    got_atomic = fused_moe_nvfp4(x, w, tw, ids, config=CONFIGS["atomic"], routed_scaling_factor=2.5)
    assert rel_err(got_atomic, ref) < FP32_REL


def test_deterministic_flag_overrides_atomic_config():
    E, k, M, H, I = 4, 2, 5, 32, 16
    w = W(E, H, I, seed=4)
    tw, ids = R(M, k, E, seed=4)
    x = randn(M, H)
    a = fused_moe_nvfp4(x, w, tw, ids, config=CONFIGS["atomic"], deterministic=True)
    b = fused_moe_nvfp4(x, w, tw, ids, config=CONFIGS["atomic"], deterministic=True)
    assert torch.equal(a, b)
    # deterministic=True runs the store path: the same bits as the config without atomics.
    plain = dataclasses.replace(CONFIGS["atomic"], atomic_reduce=False)
    assert torch.equal(a, fused_moe_nvfp4(x, w, tw, ids, config=plain))
    assert rel_err(a, fused_moe_nvfp4_reference(x, w, tw, ids)) < FP32_REL


def test_default_config_lookup_runs():
    w = W(4, 48, 16, seed=9)
    tw, ids = R(3, 2, 4, seed=9)
    x = randn(3, 48)
    assert rel_err(fused_moe_nvfp4(x, w, tw, ids), fused_moe_nvfp4_reference(x, w, tw, ids)) < FP32_REL


def test_empty_batch():
    w = W(2, 32, 16)
    x = torch.empty(0, 32, dtype=torch.bfloat16, device=DEV)
    ids = torch.empty(0, 2, dtype=torch.int32, device=DEV)
    tw = torch.empty(0, 2, device=DEV)
    y = fused_moe_nvfp4(x, w, tw, ids)
    assert y.shape == (0, 32) and y.dtype == torch.bfloat16
    assert fused_moe_nvfp4_reference(x, w, tw, ids).shape == (0, 32)


@given(
    E=st.integers(1, 6),
    k=st.integers(1, 3),
    M=st.integers(1, 20),
    h16=st.integers(1, 6),
    i16=st.integers(1, 5),
    act=st.sampled_from(["situ", "silu"]),
    lb=st.sampled_from([None, 25.0, 2.0]),
    cfg=st.sampled_from(sorted(CONFIGS)),
    drop=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_fused_matches_reference_hypothesis(E, k, M, h16, i16, act, lb, cfg, drop, seed):
    H, I = 16 * h16, 16 * i16
    w = W(E, H, I, seed=seed)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(-1 if drop else 0, E, (M, k), generator=g, dtype=torch.int64).to(DEV)  # repeats allowed
    tw = torch.rand(M, k, generator=g).to(DEV)
    x = torch.randn(M, H, generator=g).to(DEV)
    got, ref = run_both(x, w, tw, ids, cfg, activation=GatedActivation.parse(act, None, lb))
    if ref.abs().max() == 0:
        assert torch.equal(got, ref)
    else:
        assert rel_err(got, ref) < FP32_REL


# ---------------------------------------------------------------- reference vs independent oracle


def _np_dequant(packed: torch.Tensor, scale: torch.Tensor, scale_2: float) -> np.ndarray:
    """Independent NVFP4 decode: ml_dtypes float4_e2m1fn / float8_e4m3fn, float64 math."""
    p = packed.numpy()
    codes = np.stack([p & 0x0F, p >> 4], axis=-1).reshape(p.shape[0], -1).astype(np.uint8)
    vals = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float64)
    s = scale.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return vals * np.repeat(s, 16, axis=1) * scale_2


@pytest.mark.parametrize("act,lb", [("situ", 25.0), ("situ", None), ("silu", None)])
def test_reference_against_independent_numpy(act, lb):
    E, k, M, H, I = 3, 2, 6, 48, 32
    w = random_nvfp4_moe_weights(E, H, I, seed=21)  # plain torch reference: CPU everywhere
    tw, ids = random_routing(M, k, E, seed=21)
    ids[1, 0] = -1
    x = torch.randn(M, H, generator=torch.Generator().manual_seed(21))
    ref = fused_moe_nvfp4_reference(x, w, tw, ids, activation=GatedActivation.parse(act, None, lb), routed_scaling_factor=1.5)

    w13, s13, s13_2, w2, s2, s2_2 = w.to_modelopt()
    xn = x.double().numpy()
    expect = np.zeros((M, H))
    for t in range(M):
        for j in range(k):
            e = int(ids[t, j])
            if e < 0:
                continue
            gate_w = _np_dequant(w13[e, :I], s13[e, :I], float(s13_2[e, 0]))
            up_w = _np_dequant(w13[e, I:], s13[e, I:], float(s13_2[e, 1]))
            down_w = _np_dequant(w2[e], s2[e], float(s2_2[e]))
            g = np.einsum("h,ih->i", xn[t], gate_w)
            u = np.einsum("h,ih->i", xn[t], up_w)
            if act == "situ":
                a = 4.0 * np.tanh(g / 4.0) / (1 + np.exp(-g)) * (u if lb is None else lb * np.tanh(u / lb))
            else:
                a = g / (1 + np.exp(-g)) * u
            a = a.astype(np.float32).astype(np.float64)  # intermediate in the activation dtype
            expect[t] += float(tw[t, j]) * np.einsum("i,hi->h", a, down_w)
    expect *= 1.5
    np.testing.assert_allclose(ref.numpy(), expect, rtol=1e-5, atol=1e-5 * np.abs(expect).max())
    assert np.abs(expect).max() > 0.05


def test_dequant_matches_ml_dtypes_every_byte():
    """formats.dequantize_nvfp4 (used by the reference) equals the ml_dtypes decode for every
    packed byte and E4M3 scales from subnormal 2^-9 to 2^8 and non-powers of two."""
    from k3nvfp4.kernels import formats

    packed = torch.arange(256, dtype=torch.uint8).reshape(32, 8)
    scale_vals = torch.cat([torch.exp2(torch.arange(-9, 9).float()), torch.tensor([0.75, 1.25, 3.5, 448.0] * 3 + [0.0, 0.001953125])])
    scale = scale_vals.to(torch.float8_e4m3fn).reshape(32, 1)
    ours = formats.dequantize_nvfp4(packed, scale, 0.75)
    np.testing.assert_array_equal(ours.numpy().astype(np.float64), _np_dequant(packed, scale, 0.75))


# ---------------------------------------------------------------- validation


def _small():
    w = W(2, 32, 16)
    tw, ids = R(3, 2, 2)
    return randn(3, 32), w, tw, ids


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda a: {**a, "hidden_states": a["hidden_states"].to(torch.int32)}, "hidden_states"),
        (lambda a: {**a, "hidden_states": randn(3, 48)}, "hidden_states"),
        (lambda a: {**a, "hidden_states": randn(3, 32, 1)}, "hidden_states"),
        (lambda a: {**a, "topk_ids": a["topk_ids"].float()}, "topk_ids"),
        (lambda a: {**a, "topk_ids": a["topk_ids"][:2]}, "topk_ids"),
        (lambda a: {**a, "topk_weights": a["topk_weights"][:, :1]}, "top-k mismatch"),
        (lambda a: {**a, "topk_weights": a["topk_weights"].half()}, "topk_weights"),
        (lambda a: {**a, "weights": a["weights"].to_modelopt()}, "weights"),
        (lambda a: {**a, "activation": "situ"}, "activation"),  # a name, not a GatedActivation
        (lambda a: {**a, "out": torch.empty(3, 33, device=DEV)}, "out"),
    ],
)
@pytest.mark.parametrize("fn", [fused_moe_nvfp4, fused_moe_nvfp4_reference])
def test_bad_inputs_name_the_argument(fn, mutate, match):
    x, w, tw, ids = _small()
    args = mutate({"hidden_states": x, "weights": w, "topk_weights": tw, "topk_ids": ids, "activation": K3_SITU})
    with pytest.raises((TypeError, ValueError), match=match):
        fn(args.pop("hidden_states"), args.pop("weights"), args.pop("topk_weights"), args.pop("topk_ids"), **args)


def test_weights_validation_names_the_tensor():
    w13, s13, s13_2, w2, s2, s2_2 = W(2, 32, 16).to_modelopt()
    with pytest.raises(TypeError, match="w13"):
        NVFP4MoEWeights.from_modelopt(w13.float(), s13, s13_2, w2, s2, s2_2)
    with pytest.raises(ValueError, match="w13_scale"):
        NVFP4MoEWeights.from_modelopt(w13, s13[:, :, :1], s13_2, w2, s2, s2_2)
    with pytest.raises(ValueError, match="w2_scale"):
        NVFP4MoEWeights.from_modelopt(w13, s13, s13_2, w2, s2[:1], s2_2)
    with pytest.raises(TypeError, match="w13_scale_2"):
        NVFP4MoEWeights.from_modelopt(w13, s13, s13_2.half(), w2, s2, s2_2)
    with pytest.raises(ValueError, match="w2_scale_2"):
        NVFP4MoEWeights.from_modelopt(w13, s13, s13_2, w2, s2, s2_2[:1])
    with pytest.raises(ValueError, match="multiple of 16"):  # H = 40
        NVFP4MoEWeights.from_modelopt(
            torch.zeros(2, 32, 20, dtype=torch.uint8, device=DEV), s13, s13_2, w2, s2, s2_2
        )
    with pytest.raises(ValueError, match="multiple of 16"):  # I = 8
        NVFP4MoEWeights.from_modelopt(w13[:, :16], s13[:, :16], s13_2, w2, s2, s2_2)
    # [E] gate/up scale_2 is accepted (one scale for both halves); round trip is exact.
    w = NVFP4MoEWeights.from_modelopt(w13, s13, s13_2[:, 0].contiguous(), w2, s2, s2_2)
    assert torch.equal(w.w13_scale_2[:, 1], s13_2[:, 0])
    back = NVFP4MoEWeights.from_modelopt(w13, s13, s13_2, w2, s2, s2_2).to_modelopt()
    assert back[1].dtype == torch.float8_e4m3fn
    for a, b in zip(back, (w13, s13, s13_2, w2, s2, s2_2)):
        assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                           b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)


def test_cpu_tensors_without_interpreter_raise(monkeypatch):
    w = random_nvfp4_moe_weights(2, 32, 16)  # CPU tensors, also on a GPU machine
    tw, ids = random_routing(3, 2, 2)
    x = torch.randn(3, 32)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        fused_moe_nvfp4(x, w, tw, ids)


# ---------------------------------------------------------------- the shared Triton FP4 decode

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from k3nvfp4.kernels.moe_details import layout  # noqa: E402
from k3nvfp4.kernels.moe_details.kernels import _load_weight_tile  # noqa: E402


@triton.jit
def _decode_tile_kernel(w_ptr, s_ptr, out_ptr, rt_end, k_tiles, K,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_ASM: tl.constexpr, SCALE_FMT: tl.constexpr,
                        PER_WORD: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rt = tl.minimum(pid_n * (BLOCK_N // 16) + tl.arange(0, BLOCK_N // 16), rt_end - 1)
    w = _load_weight_tile(w_ptr, s_ptr, rt, k_tiles, pid_k * BLOCK_K, BLOCK_N, BLOCK_K, False, USE_ASM, SCALE_FMT, PER_WORD)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    mask = (cols < K)[None, :]
    tl.store(out_ptr + rows[:, None] * K + cols[None, :], w.to(tl.float32), mask=mask)


def _every_byte_and_scale(rows: int, k: int):
    """Nibble bytes cycling through all 256 values; E4M3 scales through every finite pattern:
    zero, subnormals (2^-9 ..), 448, and the negative ones."""
    n_bytes = rows * k // 2
    packed = (torch.arange(n_bytes) % 256).to(torch.uint8).reshape(rows, k // 2)
    finite = torch.tensor([b for b in range(256) if (b & 0x7F) != 0x7F], dtype=torch.uint8)
    idx = torch.arange(rows * k // 16) * 7 % finite.numel()  # 7 is coprime to 254: all patterns
    scale = finite[idx].reshape(rows, k // 16).view(torch.float8_e4m3fn)
    return packed, scale


def _decode_tiles(w, s, fmt, rows: int, k: int, block_n: int, block_k: int, per_word: bool) -> torch.Tensor:
    grid_rows = -(-rows // block_n) * block_n
    out = torch.full((grid_rows, k), float("nan"), device=DEV)
    _decode_tile_kernel[(grid_rows // block_n, -(-k // block_k))](
        w.to(DEV), s.to(DEV), out, rows // 16, w.shape[1], k, BLOCK_N=block_n, BLOCK_K=block_k, USE_ASM=DEV == "cuda",
        SCALE_FMT=fmt.kernel_id, PER_WORD=per_word)
    return out.cpu()


@pytest.mark.parametrize("per_word", [False, True])
@pytest.mark.parametrize("block_n,block_k,rows,k", [(64, 128, 128, 256), (32, 32, 48, 80), (16, 256, 16, 176)])
def test_triton_fp4_decode_every_byte_and_scale(block_n, block_k, rows, k, per_word):
    """The kernels' one FP4 decode (fp4.py via the tile loader) against formats.py: all 256 packed
    bytes x all finite E4M3 scales (negative and zero ones too: the layout folds their signs into
    the nibbles), bit for bit incl. signed zeros, times 2^-ACC_SHIFT; K tails, half K tiles
    (block_k 32) and clamped row tiles (rows < grid: they re-read the last tile). Inline PTX on
    a GPU, the plain-Triton twin in the interpreter."""
    from k3nvfp4.kernels import formats

    packed, scale = _every_byte_and_scale(rows, k)
    nibbles, s, _ = layout.pack_nvfp4_scales(packed, scale)
    out = _decode_tiles(layout.pack_e2m1_tiles(nibbles), s, layout.E5M3_16, rows, k, block_n, block_k, per_word)
    ref = formats.dequantize_nvfp4(packed, scale, 1.0) / layout.ACC_SCALE
    got = out[:rows]
    assert torch.equal(got, ref)
    assert torch.equal(torch.signbit(got), torch.signbit(ref))  # -0 weight x scale stays -0
    assert torch.signbit(ref).sum() > (ref == 0).logical_and(torch.signbit(ref)).sum() > 0
    last = ref[rows - 16 : rows].repeat((out.shape[0] - rows) // 16, 1)
    assert torch.equal(out[rows:], last)  # clamped row tiles re-read the last tile


@pytest.mark.parametrize("per_word", [False, True])
@pytest.mark.parametrize("block_n,block_k,rows,k", [(64, 128, 128, 256), (32, 32, 48, 96), (16, 256, 16, 160)])
def test_triton_fp4_decode_e8m0_blocks(block_n, block_k, rows, k, per_word):
    """The same decode from the MXFP4 release's layout (one E8M0 byte per 32, E8M0_32): every
    packed byte x block exponents across 126 binades below the matrix's largest, exact, with the
    32-block's two K steps and the second block of a K tile (block_k 32: picked at run time)."""
    from k3nvfp4.kernels import formats

    packed = (torch.arange(rows * k // 2) % 256).to(torch.uint8).reshape(rows, k // 2)
    e8m0 = (torch.arange(rows * k // 32) * 5 % 127 + 128).to(torch.uint8).reshape(rows, k // 32)
    m = int(e8m0.max()) - 127 - 8  # from_mxfp4's scale_2 exponent
    out = _decode_tiles(layout.pack_e2m1_tiles(packed), layout.pack_e8m0_scale_tiles(e8m0, m), layout.E8M0_32,
                        rows, k, block_n, block_k, per_word)
    e2m1 = formats.e2m1_to_float(formats.unpack_e2m1(packed)).double()  # float64: 6 x 2^127 overflows fp32
    ref = e2m1 * torch.exp2(e8m0.double() - 127 - m).repeat_interleave(32, dim=-1) / layout.ACC_SCALE
    assert torch.equal(out[:rows].double(), ref) and torch.equal(out[:rows].signbit(), ref.signbit())


# ---------------------------------------------------------------- the fused top-k combine (arrival counters)

import contextlib  # noqa: E402

from k3nvfp4.kernels.testing import kimi_routing  # noqa: E402


@contextlib.contextmanager
def programs_in_order(order: str, seed: int = 0):
    """Run the interpreter's programs of every launch in another order: "reverse" or "shuffle"
    (a seeded permutation per launch). The interpreter runs programs one after another, so this
    changes which program of a tile / token arrives last and in which order they arrive."""
    from triton.runtime import interpreter as ti

    builder = ti.interpreter_builder
    orig_dim, orig_idx = builder.set_grid_dim, builder.set_grid_idx
    state = {"dims": (1, 1, 1), "perm": None}
    g = torch.Generator().manual_seed(seed)

    def set_grid_dim(nx, ny, nz):
        n = nx * ny * nz
        state["dims"] = (nx, ny, nz)
        state["perm"] = (torch.arange(n - 1, -1, -1) if order == "reverse" else torch.randperm(n, generator=g)).tolist()
        return orig_dim(nx, ny, nz)

    def set_grid_idx(x, y, z):
        nx, ny, nz = state["dims"]
        lin = state["perm"][(x * ny + y) * nz + z]
        return orig_idx(lin // (ny * nz), (lin // nz) % ny, lin % nz)

    builder.set_grid_dim, builder.set_grid_idx = set_grid_dim, set_grid_idx
    try:
        yield
    finally:
        builder.set_grid_dim, builder.set_grid_idx = orig_dim, orig_idx


@triton.jit
def _arrival_kernel(ticket_ptr, out_ptr):
    pid = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    tl.store(out_ptr + pid, tl.atomic_add(ticket_ptr, 1))


@pytest.mark.skipif(DEV == "cuda", reason="programs_in_order drives the interpreter; a GPU orders programs itself")
def test_program_order_patch_changes_arrival_order():
    """The helper below really reorders programs (else the determinism tests would prove nothing)."""
    arrivals = {}
    for order in ("natural", "reverse", "shuffle"):
        ticket, out = torch.zeros(1, dtype=torch.int32), torch.full((12,), -1, dtype=torch.int32)
        with programs_in_order(order) if order != "natural" else contextlib.nullcontext():
            _arrival_kernel[(3, 4)](ticket, out)
        arrivals[order] = out.tolist()
        assert sorted(arrivals[order]) == list(range(12))
    assert arrivals["natural"] == list(range(12))
    assert arrivals["reverse"] == list(range(11, -1, -1))
    assert arrivals["shuffle"] not in (arrivals["natural"], arrivals["reverse"])


COMBINE_CASES = [
    # (config, E, k, M, H, I): split-K GEMM1 + GEMM2 (both finished by the last slice), the
    # plain path, no swap-AB.
    ("splitk", 8, 4, 9, 128, 64),
    ("default", 8, 4, 9, 128, 64),
    ("noswap", 5, 3, 6, 64, 32),
]


@pytest.mark.skipif(DEV == "cuda", reason="program order is the interpreter's")
@pytest.mark.parametrize("cfg,E,k,M,H,I", COMBINE_CASES)
def test_combine_is_bitwise_independent_of_program_order(cfg, E, k, M, H, I):
    """Deterministic mode: the same bits whatever order the programs run (and so arrive) in,
    including the split-K slices; ids of other ranks (-1), a token with no local expert, a
    token routed twice to one expert, routed_scaling_factor and out= on a strided view."""
    w = W(E, H, I, seed=E + M)
    tw, ids = R(M, k, E, seed=M, num_global_experts=2 * E)  # about half the ids are -1
    ids[0] = -1  # no expert of this rank: exact zeros
    ids[1, :2] = ids[1, 0].clamp(min=0)  # the same expert in two slots
    x = randn(M, H, seed=M)
    kw = dict(routed_scaling_factor=2.5, deterministic=True, config=CONFIGS[cfg])
    ref = fused_moe_nvfp4_reference(x, w, tw, ids, routed_scaling_factor=2.5)
    results = []
    for order in ("natural", "reverse", "shuffle"):
        store = torch.full((M, 2 * H), float("nan"), device=DEV)
        out = store[:, ::2]  # strided destination; NaN where nothing would be written
        with programs_in_order(order, seed=M) if order != "natural" else contextlib.nullcontext():
            res = fused_moe_nvfp4(x, w, tw, ids, out=out, **kw)
        assert res is out
        results.append(out.clone())
    assert torch.equal(results[0][0], torch.zeros(H, device=DEV))
    assert rel_err(results[0], ref) < FP32_REL
    for r in results[1:]:
        assert torch.equal(r, results[0])
    assert torch.isnan(store[:, 1::2]).all()  # nothing written outside the view


@pytest.mark.skipif(DEV == "cuda", reason="program order is the interpreter's")
def test_atomic_combine_in_any_program_order_matches_reference():
    """atomic_reduce (the documented non-deterministic option): any arrival order gives the
    reference within the fp32 bound; the last arrival of each token writes it exactly once."""
    E, k, M, H, I = 8, 4, 9, 128, 64
    w = W(E, H, I, seed=3)
    tw, ids = R(M, k, E, seed=3, num_global_experts=12)
    x = randn(M, H, seed=3)
    ref = fused_moe_nvfp4_reference(x, w, tw, ids, routed_scaling_factor=0.5)
    for order in ("reverse", "shuffle"):
        with programs_in_order(order, seed=7):
            got = fused_moe_nvfp4(x, w, tw, ids, config=CONFIGS["atomic"], routed_scaling_factor=0.5)
        assert rel_err(got, ref) < FP32_REL


@pytest.mark.parametrize("cfg,M", [("splitk", 1), ("atomic", 1), ("default", 2)])
def test_decode_sizes_with_kimi_routing(cfg, M):
    """M = 1 / 2 with K3-like skewed routing over a rank's share of the experts (EP: ids outside
    the local range are -1), twice: deterministic configs give identical bits."""
    E_global, E, k, H, I = 32, 8, 8, 128, 64
    w = W(E, H, I, seed=M)
    tw, ids = kimi_routing(M, k, E_global, local_experts=range(8, 16), skew=2.0, seed=M, device=DEV)
    x = randn(M, H, seed=M)
    a = fused_moe_nvfp4(x, w, tw, ids, config=CONFIGS[cfg])
    b = fused_moe_nvfp4(x, w, tw, ids, config=CONFIGS[cfg])
    ref = fused_moe_nvfp4_reference(x, w, tw, ids)
    if ref.abs().max() == 0:
        assert torch.equal(a, ref)
    else:
        assert rel_err(a, ref) < FP32_REL
    if cfg != "atomic":
        assert torch.equal(a, b)
