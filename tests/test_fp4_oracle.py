"""The FP4 modes against the independent oracle (tests/fp4_spec.py, tests/fp4_moe_oracle.py: the
quantizers from the NVFP4 / OCP MX specifications with ml_dtypes and numpy, the whole call in
float64). Bit for bit: the oracle against hand-computed cases, kernels/act_quant.py and the Triton
quantizers (quant_rows_kernel, route_quant_kernel, the epilogue's tile quantizers, and what a real
fused_moe_fp4 call stores) over adversarial rows. To a stated bound: fused_moe_fp4 against the
float64 whole-call oracle. The static SiTU scale is derived from the activation's bound here."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import triton
import triton.language as tl

import fp4_moe_oracle as oracle
import fp4_spec as spec
from k3nvfp4.kernels import act_quant as aq
from k3nvfp4.kernels import moe_fp4
from k3nvfp4.kernels.activation import GatedActivation
from k3nvfp4.kernels.moe_details.routing import small_routing_launch
from k3nvfp4.kernels.moe_fp4 import FP4MMAWeights, FP4MoEConfig, fused_moe_fp4
from k3nvfp4.kernels.moe_fp4_details import kernels as K
from k3nvfp4.kernels.testing import random_mxfp4_tensors, random_routing

DEV = "cuda" if torch.cuda.is_available() else "cpu"
F32 = np.float32
MODE = {"nvfp4": K.MODE_NVFP4, "mxfp8": K.MODE_MXFP8}


# --- adversarial rows (float32 [R, 128]) -------------------------------------------------------


def _up(v):
    return np.nextafter(F32(v), F32(np.inf))


def _down(v):
    return np.nextafter(F32(v), F32(-np.inf))


def nvfp4_rows() -> np.ndarray:
    """Rows of 8 NVFP4 blocks. Rows 0-1: 2688 in block 0 makes the dynamic row scale exactly 1 and
    its block scale 448; the other blocks have amax 6 (block scale 1, so x / (b s) = x): E2M1
    midpoints, their fp32 neighbours, +-0, small negatives. Rows 2-3: block amax 6 m with m an E4M3
    midpoint (normal and subnormal, and 2^-10: flushed) or its neighbour: the block scale's ties."""
    g = np.random.default_rng(7)
    R, K = 16, 128
    x = np.zeros((R, K), F32)
    ties = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0], F32)
    pool = np.concatenate([ties, -ties, _up(ties), _down(ties), -_up(ties), -_down(ties),
                           np.array([-0.0, 0.0, -0.1, 0.2, -1e-30, 6.0, -6.0], F32)])
    for r in (0, 1):
        x[r, 0] = 2688.0 if r == 0 else -2688.0
        x[r, 1:16] = g.standard_normal(15) * 100
        body = np.resize(g.permutation(pool), 7 * 15).reshape(7, 15)
        for b in range(1, 8):
            x[r, 16 * b] = 6.0 if b % 2 else -6.0
            x[r, 16 * b + 1: 16 * b + 16] = body[b - 1]
    codes = np.arange(0, 127, dtype=np.uint8).view(spec.E4M3).astype(np.float64)
    mids = ((codes[1:] + codes[:-1]) / 2).astype(F32)  # E4M3 midpoints, exact in fp32
    picks = np.concatenate([mids[[0, 1, 2, 6, 7, 8, 40, 70, 100, 124]], _up(mids[[0, 8, 70]]), _down(mids[[1, 124]])])
    picks = np.concatenate([picks, [F32(2.0**-10), _up(2.0**-10)]])
    for i, m in enumerate(picks[:14]):
        r, b = 2 + i // 7, 1 + i % 7
        x[r, 0] = 2688.0
        blk = (g.uniform(-1, 1, 16) * 6 * m).astype(F32)
        blk[i % 16] = F32(6.0) * m * (1 if i % 3 else -1)  # the block's amax, exact
        x[r, 16 * b: 16 * b + 16] = blk
    x[4, 0] = 2688.0
    x[4, 16:32] = F32(6.0) * picks[14]
    x[4, 32:48] = F32(6.0) * picks[15]
    x[5] = 0.0                                             # zero row: row scale 1, all codes 0
    x[6] = -0.0                                            # negative-zero row: flushed to +0 codes
    x[7] = g.standard_normal(K)
    x[7, 37] = 3.0e7                                       # one huge outlier: the other blocks flush
    x[8] = g.standard_normal(K) * 1e-40                    # fp32 subnormals: s_r underflows to 0 -> 1
    x[9] = g.standard_normal(K) * 1e-37                    # s_r itself an fp32 subnormal
    x[9, ::5] = g.standard_normal(26) * 1e-42
    x[10] = g.standard_normal(K)
    x[10, 3] = -3.0e38                                     # outlier near fp32's max
    x[11] = g.standard_normal(K) * np.logspace(-6, 0, K)   # E4M3 subnormal block scales
    x[12, ::2] = -0.0
    x[12, 1::2] = g.standard_normal(K // 2)
    x[13:] = g.standard_normal((3, K)) * np.array([[1e-3], [1.0], [1e4]])
    return x


def mxfp8_rows() -> np.ndarray:
    """Rows of 4 MX blocks. Rows 0-7: each block's amax 448 (shared scale exactly 1) and E4M3
    codes, midpoints (normal and subnormal) and their fp32 neighbours, both signs. Then the shared
    exponent's edges (amax = 448 x 2^j and its neighbours), the E8M0 clamps (amax below 448 x
    2^-127, near fp32's max), zero / negative-zero blocks, an outlier, subnormals."""
    g = np.random.default_rng(11)
    codes = np.arange(0, 127, dtype=np.uint8).view(spec.E4M3).astype(np.float64)
    mids = ((codes[1:] + codes[:-1]) / 2).astype(F32)
    vals = np.concatenate([codes.astype(F32), mids, _up(mids), _down(mids)])
    vals = np.concatenate([vals, -vals])
    n_blocks = -(-vals.size // 31)
    body = np.zeros(n_blocks * 31, F32)
    body[: vals.size] = vals
    blocks = np.concatenate([np.full((n_blocks, 1), 448.0, F32), body.reshape(n_blocks, 31)], axis=1)
    blocks = np.concatenate([blocks, np.zeros(((-n_blocks) % 4, 32), F32)])
    tie_rows = blocks.reshape(-1, 128)
    edge = []
    for j in (-130, -127, -126, -20, -3, 0, 5, 100, 119):
        a = F32(np.ldexp(448.0, j)) if j > -127 else F32(np.ldexp(448.0, j))
        for amax in (a, _up(a), _down(a)):
            b = (g.uniform(-1, 1, 32) * amax).astype(F32)
            b[g.integers(32)] = -amax if j % 2 else amax
            edge.append(b)
    for amax in (F32(1.75 * 2.0**3), _up(1.75 * 2.0**3), F32(2.0**9), F32(3.0e38), F32(1e-45), F32(1e-39)):
        b = (g.uniform(-1, 1, 32) * amax).astype(F32)
        b[5] = amax
        edge.append(b)
    edge.append(np.zeros(32, F32))
    edge.append(np.full(32, -0.0, F32))
    out = g.standard_normal(32).astype(F32)
    out[9] = 3.0e7                                         # the other 31 values round to 0 or tiny
    edge.append(out)
    edge.append((g.standard_normal(32) * 1e-40).astype(F32))
    edge = np.concatenate(edge)
    edge = np.concatenate([edge, np.zeros((-edge.size) % 128, F32)]).reshape(-1, 128)
    return np.concatenate([tie_rows, edge]).astype(F32)


def _bits(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    return (t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t).numpy()


def _assert_nvfp4_equal(got_packed, got_scales, got_rs, ref: spec.NVFP4Rows, rows=slice(None)):
    np.testing.assert_array_equal(_bits(got_scales)[rows], ref.scale_bits[rows], err_msg="E4M3 block scales")
    np.testing.assert_array_equal(_bits(got_packed)[rows], ref.packed[rows], err_msg="E2M1 nibbles")
    if got_rs is not None:
        np.testing.assert_array_equal(got_rs.cpu().numpy()[rows].view(np.uint32), ref.row_scale[rows].view(np.uint32))


def _assert_mxfp8_equal(got_q, got_e, ref: spec.MXFP8Rows, rows=slice(None)):
    np.testing.assert_array_equal(_bits(got_e)[rows], ref.e8m0[rows], err_msg="E8M0 bytes")
    np.testing.assert_array_equal(_bits(got_q)[rows], ref.value_bits[rows], err_msg="E4M3 values")


# --- the oracle itself, by hand ----------------------------------------------------------------


def test_oracle_hand_computed_cases():
    # E2M1: ties to the even code (0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0), saturation, the sign of zero
    y = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 7.0, 1e30, -0.0, -0.2, _up(0.25), _down(0.75)], F32)
    assert spec.e2m1_codes(y).tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 7, 7, 8, 8, 1, 1]
    assert spec.e2m1_values(np.arange(16, dtype=np.uint8)).tolist() == [
        0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6]
    # NVFP4, row scale 1 (amax 2688): block of amax 6 * 1.0625 (E4M3 tie 1 | 1.125 -> 1, even)
    x = np.zeros((1, 32), F32)
    x[0, 0] = 2688.0
    x[0, 16], x[0, 17], x[0, 18] = 6.375, 1.0625 * 1.25, -1.0625 * 0.1
    q = spec.quantize_nvfp4(x)
    assert q.row_scale.tolist() == [1.0]
    assert q.scale_bits.view(spec.E4M3).astype(float).tolist() == [[448.0, 1.0]]
    # 6.375 / 1 -> 6 (saturates), 1.328125 -> 1.5 (nearest), -0.10625 -> -0 (code 8)
    assert q.codes[0, 16:19].tolist() == [7, 3, 8] and q.codes[0, 0] == 7
    # block ratio 1.1875 (1.125 | 1.25 tie -> 1.25), 2^-10 (0 | 2^-9 tie -> 0: flushed to +0)
    x[0, 16:] = 0
    x[0, 16], x[0, 17] = 6 * 1.1875, -6 * 2.0**-10
    q = spec.quantize_nvfp4(x)
    assert q.scale_bits.view(spec.E4M3).astype(float).tolist() == [[448.0, 1.25]]
    x[0, 16] = 0
    q = spec.quantize_nvfp4(x)
    assert q.scale_bits[0, 1] == 0 and (q.codes[0, 16:] == 0).all()
    # static scale 0.01, values 100: ratio 1666 -> E4M3 saturates at 448, elements at 6 (code 7)
    q = spec.quantize_nvfp4(np.full((1, 16), 100.0, F32), static_scale=0.01)
    assert q.scale_bits.view(spec.E4M3).astype(float).tolist() == [[448.0]] and (q.codes == 7).all()
    assert q.row_scale[0] == F32(0.01)
    # MXFP8 shared exponent: smallest k with 448 2^k >= amax; E8M0 byte k + 127 in [1, 254]
    amax = np.array([448.0, _up(448.0), 224.0, _up(224.0), 1.0, 0.0, 1e-45, 3.0e38, 2.0**-120], F32)
    assert spec.mx_shared_exponent(amax).tolist() == [0, 1, -1, 0, -8, 0, -157, 120, -128]
    xm = np.zeros((len(amax), 32), F32)
    xm[:, 0] = amax
    xm[:, 1] = -amax / 3
    m = spec.quantize_mxfp8(xm)
    assert m.e8m0[:, 0].tolist() == [127, 128, 126, 127, 119, 1, 1, 247, 1]
    # elements: 448 / 2^0 = 448 exactly; -448/3 = -149.33 -> E4M3 -144 (grid 8 above 128)
    assert m.value_bits[0, :2].view(spec.E4M3).astype(float).tolist() == [448.0, -144.0]


# --- act_quant against the oracle --------------------------------------------------------------


@pytest.mark.parametrize("static", [None, 1.0, 0.01, 1e-30])
def test_act_quant_nvfp4_equals_oracle(static):
    x = nvfp4_rows()
    q, s, rs = aq.quantize_nvfp4_rows(torch.from_numpy(x), static)
    _assert_nvfp4_equal(q, s, rs, spec.quantize_nvfp4(x, static))


def test_act_quant_mxfp8_equals_oracle():
    x = mxfp8_rows()
    q, e = aq.quantize_mxfp8_rows(torch.from_numpy(x))
    _assert_mxfp8_equal(q, e, spec.quantize_mxfp8(x))


# --- the Triton quantizers against the oracle --------------------------------------------------


def _buffers(mode: str, R: int, Kd: int):
    if mode == "nvfp4":
        return (torch.empty(R, Kd // 2, dtype=torch.uint8, device=DEV),
                torch.empty(R, Kd // 16, dtype=torch.float8_e4m3fn, device=DEV),
                torch.empty(R, dtype=torch.float32, device=DEV))
    return (torch.empty(R, Kd, dtype=torch.float8_e4m3fn, device=DEV),
            torch.empty(R, Kd // 32, dtype=torch.uint8, device=DEV),
            torch.empty(1, dtype=torch.float32, device=DEV))


def _check(mode, bufs, x, static):
    if mode == "nvfp4":
        _assert_nvfp4_equal(*bufs, spec.quantize_nvfp4(x, static))
    else:
        _assert_mxfp8_equal(bufs[0], bufs[1], spec.quantize_mxfp8(x))


CASES = [("nvfp4", None), ("nvfp4", 0.01), ("mxfp8", None)]


# With a static scale and a 3e38 outlier the kernels' block ratio amax / (s x 6) overflows fp32 to
# inf before the clamp at 448 (the intended saturation); numpy says so under the interpreter.
OVERFLOW_OK = pytest.mark.filterwarnings("ignore:overflow encountered in divide:RuntimeWarning")


@OVERFLOW_OK
@pytest.mark.parametrize("mode,static", CASES)
def test_row_quantizer_kernels_equal_oracle(mode, static):
    """quant_rows_kernel (the dynamic intermediate; tokens above 1024 pairs) and route_quant_kernel
    (the tokens of every call up to 1024 pairs, programs 1 .. M), as fused_moe_fp4 launches them,
    with BLOCK_K = 64 < K: the row amax is taken over two chunks."""
    x = nvfp4_rows() if mode == "nvfp4" else mxfp8_rows()
    R, Kd = x.shape
    xt = torch.from_numpy(x).to(DEV)
    consts = dict(MODE=MODE[mode], STATIC=static is not None, BLOCK_K=64)
    scale = 1.0 if static is None else static
    bufs = _buffers(mode, R, Kd)
    K.quant_rows_kernel[(R,)](xt, xt.stride(0), *bufs, bufs[2], Kd, scale, HAS_NUM_ROWS=False, **consts, num_warps=4)
    _check(mode, bufs, x, static)
    bufs = _buffers(mode, R, Kd)
    ids = torch.zeros(R, 1, dtype=torch.int32, device=DEV)
    _, args, rconsts = small_routing_launch(ids, 1, 16)
    K.route_quant_kernel[(1 + R,)](*args, xt, xt.stride(0), *bufs, Kd, scale, **rconsts, **consts, num_warps=1)
    _check(mode, bufs, x, static)


@triton.jit
def _tile_quant_kernel(x_ptr, q_ptr, s_ptr, inter_scale, MODE: tl.constexpr, R: tl.constexpr, C: tl.constexpr):
    """One [R, C] tile through the quantizers of GEMM1's epilogue (_store_quantized): NVFP4 with a
    static row scale broadcast over the tile's rows, or MXFP8."""
    r = tl.arange(0, R)[:, None]
    x = tl.load(x_ptr + r * C + tl.arange(0, C)[None, :])
    if MODE == 0:
        q, s = K._quant_nvfp4(x, inter_scale + tl.zeros((R, 1), dtype=tl.float32), R, C)
        tl.store(q_ptr + r * (C // 2) + tl.arange(0, C // 2)[None, :], q)
        tl.store(s_ptr + r * (C // 16) + tl.arange(0, C // 16)[None, :], s)
    else:
        q, s = K._quant_mxfp8(x, R, C)
        tl.store(q_ptr + r * C + tl.arange(0, C)[None, :], q)
        tl.store(s_ptr + r * (C // 32) + tl.arange(0, C // 32)[None, :], s)


@OVERFLOW_OK
@pytest.mark.parametrize("mode,static", [("nvfp4", 1.0), ("nvfp4", 0.01), ("nvfp4", 2.0**-20), ("mxfp8", None)])
def test_epilogue_tile_quantizers_equal_oracle(mode, static):
    """The epilogue's quantizers on whole [16, 128] tiles (several rows at once, as GEMM1 holds
    them): the static scale saturates the large rows (0.01) or flushes blocks (2^-20 ... 1)."""
    x = nvfp4_rows() if mode == "nvfp4" else mxfp8_rows()[:16]
    R, Kd = x.shape
    xt = torch.from_numpy(x).to(DEV)
    q, s, _ = _buffers(mode, R, Kd)
    _tile_quant_kernel[(1,)](xt, q, s, 1.0 if static is None else static, MODE=MODE[mode], R=R, C=Kd)
    if mode == "nvfp4":
        _assert_nvfp4_equal(q, s, None, spec.quantize_nvfp4(x, static))
    else:
        _assert_mxfp8_equal(q, s, spec.quantize_mxfp8(x))


# --- the static SiTU scale, derived from the bound ---------------------------------------------


@pytest.mark.parametrize("beta,linear_beta", [(4.0, 25.0), (2.5, 7.0), (1.0, 1.0)])
def test_static_situ_scale_is_the_bound_over_6x448(beta, linear_beta):
    bound = oracle.situ_bound(beta, linear_beta)
    s = oracle.situ_static_scale(beta, linear_beta)
    assert GatedActivation.situ(beta, linear_beta).bound == bound
    assert GatedActivation.situ(beta, linear_beta).nvfp4_static_scale == s
    assert GatedActivation.silu().nvfp4_static_scale is None
    assert GatedActivation.situ(beta, None).nvfp4_static_scale is None
    # the bound holds over a wide grid and is approached (g, u -> +inf), so it is the tight one
    v = np.concatenate([-np.logspace(-8, 4, 400), np.logspace(-8, 4, 400)])
    g, u = np.meshgrid(v, v)
    a = np.abs(oracle.gated_activation_f64(g, u, "situ", beta, linear_beta))
    assert a.max() <= bound and a.max() > bound * (1 - 1e-12)  # float64 rounds tanh(2500) to 1
    assert a[(np.abs(g) < 5 * beta) & (np.abs(u) < 5 * linear_beta)].max() < bound  # strictly below
    # quantized with that scale, the extreme values neither saturate the block scale nor the elements
    ext = np.array([[bound, -bound * 0.999, bound * 0.5, 1e-3] + [0.0] * 12], F32)
    q = spec.quantize_nvfp4(ext, s)
    assert q.scale_bits.view(spec.E4M3).astype(float)[0, 0] == 448.0
    np.testing.assert_allclose(q.dequantize()[0, :2], [bound, -bound], rtol=1e-6)
    # a scale 10% below saturates: the largest value it can encode falls short of the bound
    assert spec.quantize_nvfp4(ext, s * 0.9).dequantize()[0, 0] < 0.91 * bound


# --- the whole call against the float64 oracle -------------------------------------------------


class LaunchRecorder:
    """Records the arguments of every launch of the named kernels of moe_fp4_details.kernels
    (tensors cloned after the launch: what it stored) and keeps the launcher to run one again."""

    def __init__(self, monkeypatch, names):
        self.calls = {}
        for name in names:
            fn = getattr(K, name)
            monkeypatch.setattr(fn, "run", self._wrap(name, fn, fn.run))

    def _wrap(self, name, fn, run):
        def recorded(*args, grid, warmup, **kwargs):
            result = run(*args, grid=grid, warmup=warmup, **kwargs)
            named = dict(zip(fn.arg_names, args), **kwargs)
            snap = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in named.items()}
            self.calls.setdefault(name, []).append((snap, args, kwargs, grid, run))
            return result
        return recorded

    def one(self, name):
        (call,) = self.calls[name]
        return call


def _nvfp4_weights(E, H, I, seed):
    """ModelOpt NVFP4 experts with general (not power-of-two) E4M3 block scales and scale_2."""
    g = np.random.default_rng(seed)
    t = dict(w13=g.integers(0, 256, (E, 2 * I, H // 2), dtype=np.uint8),
             w13_scale=g.integers(40, 64, (E, 2 * I, H // 16), dtype=np.uint8),  # E4M3 0.25 .. 1.875
             w13_scale_2=(g.uniform(0.02, 0.05, (E, 2))).astype(F32),
             w2=g.integers(0, 256, (E, H, I // 2), dtype=np.uint8),
             w2_scale=g.integers(40, 64, (E, H, I // 16), dtype=np.uint8),
             w2_scale_2=(g.uniform(0.02, 0.05, E)).astype(F32))
    f = FP4MMAWeights.from_modelopt(*(torch.from_numpy(v) for v in t.values()), act_quant="nvfp4").to(DEV)
    return f, oracle.oracle_weights(*t.values())


def _mxfp4_weights(E, H, I, seed):
    w13, e13, w2, e2 = random_mxfp4_tensors(E, H, I, seed=seed)
    f = FP4MMAWeights.from_mxfp4(w13, e13, w2, e2, act_quant="mxfp8").to(DEV)
    return f, oracle.oracle_weights(w13.numpy(), None, None, w2.numpy(), None, None, e8m0=(e13.numpy(), e2.numpy()))


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


WHOLE = [  # mode, intermediate_scale, activation, static input scale, GEMM1 tile (swap-AB, block_n1)
    ("nvfp4", "static", "situ", 0.01, (True, 64)),
    ("nvfp4", "dynamic", "silu", None, (False, 128)),
    ("mxfp8", "auto", "situ", None, (False, 128)),
]


@pytest.mark.parametrize("mode,inter,activation,in_s,tile", WHOLE)
def test_fused_moe_fp4_matches_float64_oracle(monkeypatch, mode, inter, activation, in_s, tile):
    """Stage by stage, then the whole call. Bounds and why:
    - the tokens' and the intermediate's quantization: bit for bit (same fp32 inputs, same rules);
    - GEMM1 + activation (the kernel's fp32 intermediate) vs float64: normwise <= 1e-5. The
      products of quantized operands are exact in fp32; what differs is the rounding of a sum of
      H = 128 terms in fp32 (~sqrt(H) 2^-24 = 7e-7 relative, worst case H 2^-24 = 8e-6 without
      cancellation), two scale products and the fp32 activation;
    - GEMM2 fed the kernel's own quantized intermediate vs float64: normwise <= 1e-5 (same reason,
      K = I = 128, plus the top-k sum);
    - the whole call vs the fully independent oracle (its intermediate quantized from fp32(float64
      activation)): the intermediate's noise above can move a value across an FP4 / E4M3 rounding
      boundary, flipping a code (each flip is one grid step; in dynamic NVFP4 the row scale may
      also differ by an ulp). With noise ~1e-6 of a block's range and grid steps ~1/6 of it, flips
      are rare: at most 1% of the codes. Then ||out - oracle|| <= 1e-5 ||oracle|| + B, where
      B = || sum over slots |w| s2 ||d_p|| ||W2_e||_2 ||_tokens bounds what the flipped
      intermediate d_p (kernel - oracle, dequantized) can do through GEMM2, and B itself must stay
      below 1e-3 of ||oracle|| (two orders under the FP4 quantization error itself)."""
    E, H, I, M, k = 4, 128, 128, 6, 2
    beta, lb = 4.0, 25.0
    f, w = (_nvfp4_weights if mode == "nvfp4" else _mxfp4_weights)(E, H, I, seed=3)
    g = np.random.default_rng(5)
    x = (g.standard_normal((M, H)) * (1.0 if mode == "mxfp8" else 3.0)).astype(F32)
    x[0] = 0.0                       # zero token
    x[1, ::3] = -0.0
    x[2, 3] = 500.0                  # one huge outlier
    tw, ids = random_routing(M, k, E, seed=5)
    ids = ids.clone()
    ids[3, 1] = -1                   # a slot served elsewhere
    swap_ab, bn1 = tile
    cfg = FP4MoEConfig(block_m=16, swap_ab=swap_ab, block_n1=bn1, block_n2=128, block_k1=64, block_k2=64,
                       split_k1=1, split_k2=2)
    rec = LaunchRecorder(monkeypatch, ["route_quant_kernel", "fp4_gemm1_kernel", "quant_rows_kernel",
                                       "fp4_gemm2_kernel"])
    kw = dict(activation=GatedActivation.parse(activation, beta, lb), routed_scaling_factor=1.5,
              input_scale=in_s, intermediate_scale=inter)
    got = fused_moe_fp4(torch.from_numpy(x).to(DEV), f, tw.to(DEV), ids.to(DEV), config=cfg, **kw)
    got = got.double().cpu().numpy()

    # 1. the tokens' quantization (route_quant_kernel): bit for bit
    rq = rec.one("route_quant_kernel")[0]
    if mode == "nvfp4":
        _assert_nvfp4_equal(rq["q_ptr"], rq["s_ptr"], rq["rs_ptr"], spec.quantize_nvfp4(x, in_s))
    else:
        _assert_mxfp8_equal(rq["q_ptr"], rq["s_ptr"], spec.quantize_mxfp8(x))

    # the kernel's fp32 intermediate: stored by GEMM1 (dynamic NVFP4) or by GEMM1 run once more with OUT_F32
    g1, g1_args, g1_kw, grid, run = rec.one("fp4_gemm1_kernel")
    P = g1["o_ptr"].shape[0]
    if g1_kw["OUT_F32"]:
        a_kernel = g1["of_ptr"]
    else:
        a_kernel = torch.full((P, I), float("nan"), device=DEV)
        args = list(g1_args)
        args[K.fp4_gemm1_kernel.arg_names.index("of_ptr")] = a_kernel
        run(*args, grid=grid, warmup=False, **dict(g1_kw, OUT_F32=True))
    a_kernel = a_kernel.cpu().numpy()
    sorted_ids = g1["sorted_ids_ptr"].cpu().numpy()
    n_padded = int(g1["num_padded_ptr"].cpu()[0])
    rows = np.nonzero(sorted_ids[:n_padded] < M * k)[0]   # rows of real pairs, in sorted order
    ref1 = oracle.gemm1(x, w, ids.numpy(), mode=mode, activation=activation, beta=beta, linear_beta=lb,
                        input_scale=in_s)
    order = np.argsort(sorted_ids[rows])                  # kernel rows in pair order
    rows = rows[order]
    assert np.array_equal(sorted_ids[rows], ref1.pairs)

    # 2. GEMM1 + activation vs float64
    err1 = _rel(a_kernel[rows].astype(np.float64), ref1.a)
    assert err1 <= 1e-5, err1

    # 3. the intermediate's quantization (GEMM1's epilogue, or quant_rows_kernel): bit for bit
    static_s = oracle.situ_static_scale(beta, lb) if inter == "static" else None
    if mode == "nvfp4":
        if inter == "static":
            assert g1["inter_scale"] == static_s == rec.one("fp4_gemm2_kernel")[0]["inter_scale"]
            iq, isc, irs = g1["o_ptr"], g1["os_ptr"], None
        else:
            qr = rec.one("quant_rows_kernel")[0]
            iq, isc, irs = qr["q_ptr"], qr["s_ptr"], qr["rs_ptr"]
        mine = spec.quantize_nvfp4(a_kernel[rows], static_s)
        _assert_nvfp4_equal(iq.cpu()[rows], isc.cpu()[rows], None if irs is None else irs.cpu()[rows], mine)
    else:
        mine = spec.quantize_mxfp8(a_kernel[rows])
        _assert_mxfp8_equal(g1["o_ptr"].cpu()[rows], g1["os_ptr"].cpu()[rows], mine)
    deq_kernel = mine.dequantize()

    # 4. GEMM2 fed the kernel's quantized intermediate vs float64
    out_same = oracle.gemm2(deq_kernel, ref1, w, tw.numpy(), M, 1.5)
    err2 = _rel(got, out_same)
    assert err2 <= 1e-5, err2

    # 5. the whole call vs the independent oracle
    q_o, deq_o = oracle.quantize_intermediate(ref1.a, mode, static_s)
    if mode == "nvfp4":
        flips = int((mine.codes != q_o.codes).sum() + (mine.scale_bits != q_o.scale_bits).sum() * 16)
        n_codes = mine.codes.size
    else:
        flips = int((mine.value_bits != q_o.value_bits).sum() + (mine.e8m0 != q_o.e8m0).sum() * 32)
        n_codes = mine.value_bits.size
    out_o = oracle.gemm2(deq_o, ref1, w, tw.numpy(), M, 1.5)
    d = np.linalg.norm(deq_kernel - deq_o, axis=1)
    w2_norm = np.array([np.linalg.norm(w.w2[e], 2) for e in range(E)])
    per_pair = np.abs(tw.numpy().reshape(-1)[ref1.pairs]) * w.s2[ref1.experts] * d * w2_norm[ref1.experts] * 1.5
    per_token = np.zeros(M)
    np.add.at(per_token, ref1.pairs // k, per_pair)
    B = float(np.linalg.norm(per_token))
    err = _rel(got, out_o)
    print(f"{mode}/{inter}/{activation}: gemm1 {err1:.2e}, gemm2 (same intermediate) {err2:.2e}, "
          f"whole call {err:.2e}, flipped codes {flips}/{n_codes}, flip bound {B / np.linalg.norm(out_o):.2e}")
    assert flips <= 0.01 * n_codes
    assert B <= 1e-3 * np.linalg.norm(out_o)
    assert np.linalg.norm(got - out_o) <= 1e-5 * np.linalg.norm(out_o) + B
    assert (got[0] == 0).all()  # the zero token
    # the oracle does quantize the intermediate: it sits at FP4 / FP8 quantization error (not at
    # accumulation noise) from the same call with an unquantized float64 intermediate
    unquantized = oracle.gemm2(ref1.a, ref1, w, tw.numpy(), M, 1.5)
    assert 1e-3 < _rel(out_o, unquantized) < 0.3
