"""FP4 tensor-core MoE modes (kernels/moe_fp4.py) in the Triton interpreter (Triton >= 3.8):
activation quantizers bit for bit against kernels/act_quant.py, their edge cases, the whole MoE
against the reference that quantizes the same way, and the E8M0 recovery with its refusals."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from k3nvfp4.kernels import act_quant as aq
from k3nvfp4.kernels import formats
from k3nvfp4.kernels import moe_fp4
from k3nvfp4.kernels.activation import GatedActivation
from k3nvfp4.kernels.moe import fused_moe_nvfp4
from k3nvfp4.kernels.moe_details.config import MoEConfig
from k3nvfp4.kernels.moe_details.weights import MXFP4MoETensors, NVFP4MoEWeights
from k3nvfp4.kernels.moe_fp4_details.weights import cast_mxfp4_moe
from k3nvfp4.kernels.moe_fp4 import E8M0RecoveryError, FP4MMAWeights, FP4MoEConfig, fused_moe_fp4
from k3nvfp4.kernels.moe_fp4_details import kernels as K
from k3nvfp4.kernels.moe_fp4_reference import fused_moe_fp4_reference
from k3nvfp4.kernels.testing import k3_like_modelopt_tensors, random_mxfp4_tensors, random_routing

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _quant_kernel(x: torch.Tensor, mode: str, static: float | None = None):
    R, Kd = x.shape
    if mode == "nvfp4":
        q = torch.empty(R, Kd // 2, dtype=torch.uint8, device=x.device)
        s = torch.empty(R, Kd // 16, dtype=torch.float8_e4m3fn, device=x.device)
        rs = torch.empty(R, dtype=torch.float32, device=x.device)
    else:
        q = torch.empty(R, Kd, dtype=torch.float8_e4m3fn, device=x.device)
        s = torch.empty(R, Kd // 32, dtype=torch.uint8, device=x.device)
        rs = torch.empty(1, dtype=torch.float32, device=x.device)
    K.quant_rows_kernel[(R,)](x, x.stride(0), q, s, rs, rs, Kd, 1.0 if static is None else static,
                              MODE=moe_fp4._MODE[mode], STATIC=static is not None, HAS_NUM_ROWS=False, BLOCK_K=64)
    return (q, s, rs) if mode == "nvfp4" else (q, s)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def _edge_rows(Kd: int = 128) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(8, Kd, generator=g)
    x[1] = 0.0                                           # all-zero row
    x[2, 7] = 3.0e7                                      # one huge outlier: the other blocks underflow
    x[3] *= 1e-30                                        # tiny row (fp32 subnormal-adjacent scales)
    x[4] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0] * (Kd // 8)) * (1 - 2 * (torch.arange(Kd) % 3 == 0))
    x[5, :16] = 1e-3                                     # a block 2^-19 below the row max: flushed
    x[5, 16:] = 1e3
    x[6] = torch.linspace(-448.0 * 3, 448.0 * 3, Kd)     # e4m3 midpoints / carries in MXFP8
    x[7, ::2] = -0.0
    return x.to(DEV)


@pytest.mark.parametrize("mode", ["nvfp4", "mxfp8"])
def test_activation_quantizer_bits_equal_reference(mode):
    x = _edge_rows()
    got = _quant_kernel(x, mode)
    ref = aq.quantize_nvfp4_rows(x) if mode == "nvfp4" else aq.quantize_mxfp8_rows(x)
    for g, r in zip(got, ref):
        assert torch.equal(_bits(g).cpu(), _bits(r).cpu())


def test_e4m3_rounding_of_the_quantizer_matches_torch_everywhere():
    # Every fp32 value that lands on an E4M3 code, a midpoint, or just beside one (MXFP8 block scale 1).
    codes = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (codes[1:] + codes[:-1]) / 2
    vals = torch.cat([codes, mids, torch.nextafter(mids, torch.zeros_like(mids)),
                      torch.nextafter(mids, torch.full_like(mids, 1e9))])
    vals = torch.cat([vals, -vals])
    n = -(-vals.numel() // 32) * 32
    x = torch.zeros(n)
    x[: vals.numel()] = vals
    x = x.reshape(-1, 32)
    x[:, 0] = 448.0  # block amax 448: E8M0 scale exactly 1, values quantized as they are
    x = torch.nn.functional.pad(x, (0, 32)).reshape(-1, 64).to(DEV)  # rows of 64 = 2 blocks
    got_q, got_e = _quant_kernel(x, "mxfp8")
    ref_q, ref_e = aq.quantize_mxfp8_rows(x)
    assert torch.equal(_bits(got_q).cpu(), _bits(ref_q).cpu()) and torch.equal(got_e.cpu(), ref_e.cpu())
    direct = x.cpu().clamp(-448, 448).to(torch.float8_e4m3fn)  # torch's RTNE cast
    assert torch.equal(_bits(ref_q).cpu()[:, :32], _bits(direct)[:, :32])


def test_nvfp4_quantizer_edge_cases_are_defined():
    x = _edge_rows().cpu()
    q, s, rs = aq.quantize_nvfp4_rows(x)
    deq = aq.dequantize_nvfp4_rows(q, s, rs)
    # all-zero row: row scale 1, codes and scales 0
    assert rs[1] == 1.0 and int(q[1].max()) == 0 and float(s[1].float().max()) == 0.0
    # outlier row: its block's scale is 448 exactly, every other block flushes to zero
    sf = s.float()
    assert sf[2, 0] == 448.0 and bool((sf[2, 1:] == 0).all()) and bool((deq[2, 16:] == 0).all())
    assert deq[2, 7] == pytest.approx(3.0e7, rel=1e-6)
    # block 2^-19.9 below the row max: amax_blk / (s_r * 6) < 2^-10 -> scale 0 -> flushed
    assert sf[5, 0] == 0 and bool((deq[5, :16] == 0).all()) and bool((sf[5, 1:] == 448.0).all())
    # the row max maps to 448 x 6 (dynamic scale): no block exceeds 448, values within 6
    assert float(sf.max()) <= 448.0 and float(deq.abs().max()) <= float(x.abs().max()) * (1 + 2**-3)
    # static scale too small: blocks overflow E4M3 -> saturate at 448, values at +-6 (code 7)
    q2, s2, rs2 = aq.quantize_nvfp4_rows(torch.full((1, 32), 100.0), static_scale=0.01)
    assert bool((s2.float() == 448.0).all()) and bool((formats.unpack_e2m1(q2) == 7).all()) and rs2[0] == pytest.approx(0.01)
    # and the kernel does the same with a static scale (overflowing and underflowing blocks)
    xs = torch.cat([torch.full((1, 64), 100.0), torch.full((1, 64), 1e-9)]).to(DEV)
    for g, r in zip(_quant_kernel(xs, "nvfp4", static=0.01), aq.quantize_nvfp4_rows(xs, static_scale=0.01)):
        assert torch.equal(_bits(g).cpu(), _bits(r).cpu())


def test_mxfp8_quantizer_never_saturates_and_avoids_e8m0_zero():
    x = _edge_rows().cpu()
    q, e = aq.quantize_mxfp8_rows(x)
    deq = aq.dequantize_mxfp8_rows(q, e)
    assert int(e.min()) >= 1  # byte 0 (decoded as 0 by Triton 3.8) never used
    blocks = x.reshape(8, -1, 32).abs().amax(-1)
    scale = formats.e8m0_to_float(e)
    nz = blocks > 2.0**-100
    assert bool((blocks[nz] / scale[nz] <= 448).all()) and bool((blocks[nz] / scale[nz] > 224).all())
    # values in E4M3's normal range after scaling (>= 2^-6): relative error <= 2^-4
    normal = (x.reshape(8, -1, 32).abs() / scale[:, :, None] >= 2.0**-6).reshape(8, -1)
    assert int(normal.sum()) > 700
    assert float(((deq - x).abs()[normal] / x.abs()[normal]).max()) <= 2.0**-4


def _mxfp4_weights(E, H, I, seed=0):
    t = MXFP4MoETensors(*random_mxfp4_tensors(E, H, I, seed=seed))
    return t, NVFP4MoEWeights.from_mxfp4(*t).to(DEV)


def _fp4_weights(t: MXFP4MoETensors) -> dict:
    """Each FP4 mode's weights, prepared from the MXFP4 tensors (as the plugin does at load)."""
    return {m: FP4MMAWeights.from_mxfp4(*t, act_quant=m).to(DEV) for m in ("nvfp4", "mxfp8")}


def _same(a: FP4MMAWeights, b: FP4MMAWeights) -> bool:
    fields = ("w13", "w13_scale", "w13_scale_2", "w2", "w2_scale", "w2_scale_2", "w13_e8m0", "w2_e8m0")
    return a.act_quant == b.act_quant and all(
        (getattr(a, f) is None and getattr(b, f) is None) or torch.equal(getattr(a, f).cpu(), getattr(b, f).cpu())
        for f in fields)


def test_e8m0_recovered_exactly_from_nvfp4():
    t, _ = _mxfp4_weights(3, 128, 64)
    mo = cast_mxfp4_moe(*t)  # the closed-form cast's ModelOpt tensors (what k3nvfp4-cast writes)
    f = FP4MMAWeights.from_modelopt(*mo, act_quant="mxfp8")
    assert torch.equal(f.w13_e8m0.cpu(), t.w13_e8m0) and torch.equal(f.w2_e8m0.cpu(), t.w2_e8m0)
    assert f.w13_scale is None and bool((f.w13_scale_2 == 1).all())  # scale_2 folded into E8M0
    # the recovered MXFP4 dequantizes to the NVFP4 values exactly
    ref13 = formats.dequantize_nvfp4(mo.w13, mo.w13_scale, 1.0) * mo.w13_scale_2[:, :1, None]
    assert torch.equal(formats.dequantize_mxfp4(f.w13, f.w13_e8m0), ref13)
    # from the release itself and from its cast: the same weights, bit for bit, in both modes
    assert _same(FP4MMAWeights.from_mxfp4(*t, act_quant="mxfp8"), f)
    assert _same(FP4MMAWeights.from_mxfp4(*t, act_quant="nvfp4"), FP4MMAWeights.from_modelopt(*mo, act_quant="nvfp4"))
    # NVFP4 quantized natively per 16 (power-of-two scales, but the two halves of a 32-block
    # differ): no E8M0 exists, refused; the nvfp4 mode takes it
    k3 = k3_like_modelopt_tensors(2, 64, 64, seed=3)
    with pytest.raises(E8M0RecoveryError, match="w13: .* two 16-block scales that differ"):
        FP4MMAWeights.from_modelopt(*k3, act_quant="mxfp8")
    assert FP4MMAWeights.from_modelopt(*k3, act_quant="nvfp4").w13_e8m0 is None
    # an E8M0 byte 255 (NaN), or 0 (Triton reads it as 0) on a block with values, is refused
    bad = t.w13_e8m0.clone()
    bad[0, 0, 0] = 0
    t0 = t.w13.clone()
    t0[0, 0, :16] = 0x11
    with pytest.raises(E8M0RecoveryError, match="w13_e8m0: 1 E8M0 byte"):
        FP4MMAWeights.from_mxfp4(t0, bad, t.w2, t.w2_e8m0, act_quant="mxfp8")


def test_e8m0_compiled_recovery_equals_the_torch_path(monkeypatch):
    """recover_e8m0's compiled host pass (layout_host.e8m0_from_pow2_e4m3) against its torch path
    on exact MXFP4 blocks with every case of the rule: normal and subnormal power-of-two scales,
    zero halves (nibbles +-0, or scale 0, which may carry any scale), all-zero blocks (byte 127),
    per-row scale_2 exponents; and the same first-bad-block message on broken blocks."""
    from k3nvfp4.kernels.moe_details import layout_host
    from k3nvfp4.kernels.moe_fp4_details.weights import recover_e8m0

    g = torch.Generator().manual_seed(17)
    E, N, K = 3, 32, 128
    packed = torch.randint(0, 256, (E, N, K // 2), dtype=torch.uint8, generator=g)
    pow2 = torch.tensor([0x01, 0x02, 0x04, 0x08, 0x30, 0x38, 0x40, 0x70], dtype=torch.uint8)  # 2^-9 .. 2^7
    j = pow2[torch.randint(0, len(pow2), (E, N, K // 32), generator=g)]
    scale = j.repeat_interleave(2, dim=-1).clone()
    halves = packed.reshape(E, N, K // 16, 8)
    halves[:, :, 1::5] &= 0x88  # zero nibbles: the half may carry any scale
    scale[:, :, 1::5] = pow2[3]
    scale[:, :, 2::7] = 0  # zero scale
    packed.reshape(E, N, K // 32, 16)[:, ::4, 3] &= 0x88  # whole blocks zero -> byte 127
    scale_2 = torch.exp2(torch.randint(-2, 3, (E, N), generator=g).float())
    fast = recover_e8m0(packed, scale.view(torch.float8_e4m3fn), scale_2, "w")
    monkeypatch.setattr(layout_host, "e8m0_from_pow2_e4m3", lambda *a: None)
    slow = recover_e8m0(packed, scale.view(torch.float8_e4m3fn), scale_2, "w")
    assert torch.equal(fast, slow) and (fast == 127).any()
    monkeypatch.undo()
    bad = scale.clone()
    bad[1, 5, 6] = 0x39  # 2^0 x 1.125: not a power of two, in a half with non-zero nibbles
    packed.reshape(E, N, K // 16, 8)[1, 5, 6, 0] = 0x11
    with pytest.raises(E8M0RecoveryError, match=r"w: 1 block\(s\) .* first at expert 1, row 5, 32-block 3"):
        recover_e8m0(packed, bad.view(torch.float8_e4m3fn), scale_2, "w")


@pytest.mark.parametrize("H,I,named", [(48, 64, "hidden size H = 48 is"), (64, 80, "intermediate size I = 80 is"),
                                       (112, 96, "hidden size H = 112 and intermediate size I = 96 are")])
def test_fp4_modes_refuse_shapes_w4a16_accepts(H, I, named):
    """The FP4 modes' shape rule is multiples of 64 (docs/kernels.md, fused_moe_fp4, FP4MMAWeights):
    shapes that W4A16 takes (multiples of 16) are refused naming the argument that breaks it, when
    the FP4 layout is prepared (directly, or by fused_moe_fp4 on W4A16 weights)."""
    mo = k3_like_modelopt_tensors(2, H, I, seed=5)
    w = NVFP4MoEWeights.from_modelopt(*mo)  # W4A16's own layout accepts them
    msg = f"FP4MMAWeights: {named} not a multiple of 64: .* W4A16 .* multiples of 16"
    for act_quant in ("nvfp4", "mxfp8"):
        with pytest.raises(ValueError, match=msg):
            FP4MMAWeights.from_modelopt(*mo, act_quant=act_quant)
    # the FP4 family takes its own prepared weights only: no conversion of W4A16 weights at call time
    tw, ids = random_routing(2, 2, 2)
    with pytest.raises(TypeError, match="weights: expected FP4MMAWeights .* got NVFP4MoEWeights"):
        fused_moe_fp4(torch.zeros(2, H, device=DEV), w.to(DEV), tw.to(DEV), ids.to(DEV))


def test_e8m0_recovery_refuses_non_mxfp4_blocks():
    t, _ = _mxfp4_weights(2, 64, 64)
    e13 = t.w13_e8m0
    w13q, w13s, w13s2, w2q, w2s, w2s2 = cast_mxfp4_moe(*t)
    # a zero 16-half may carry any scale: accepted, the other half's exponent is used
    z13q, z13s = w13q.clone(), w13s.clone()
    z13q[0, 0, :8] = 0
    z13s[0, 0, 0] = torch.tensor(3.0).to(torch.float8_e4m3fn)
    got = FP4MMAWeights.from_modelopt(z13q, z13s, w13s2, w2q, w2s, w2s2, act_quant="mxfp8").w13_e8m0
    assert int(got[0, 0, 0]) == int(e13[0, 0, 0])
    bad = w13s.clone()
    bad[1, 5, 2] = torch.tensor(3.0).to(torch.float8_e4m3fn)  # re-quantized block: not a power of two
    with pytest.raises(E8M0RecoveryError, match=r"w13: 1 block.*expert 1, row 5, 32-block 1.*not a power of two"):
        FP4MMAWeights.from_modelopt(w13q, bad, w13s2, w2q, w2s, w2s2, act_quant="mxfp8")
    diff = w2s.clone()
    diff[0, 3, 0] = (diff[0, 3, 0].float() * 2).to(torch.float8_e4m3fn)  # the two halves disagree
    w2q_nz = w2q.clone()
    w2q_nz[0, 3, :16] = 0x11
    with pytest.raises(E8M0RecoveryError, match=r"w2: .*expert 0, row 3, 32-block 0.*differ"):
        FP4MMAWeights.from_modelopt(w13q, w13s, w13s2, w2q_nz, diff, w2s2, act_quant="mxfp8")
    with pytest.raises(E8M0RecoveryError, match=r"w2: weight_scale_2 .* not a power of two"):
        FP4MMAWeights.from_modelopt(w13q, w13s, w13s2, w2q, w2s, w2s2 * 1.5, act_quant="mxfp8")
    # the nvfp4 mode's weights (no E8M0 scales) cannot be relabelled as the mxfp8 mode's
    f = FP4MMAWeights.from_modelopt(w13q, w13s, w13s2 * 1.5, w2q, w2s, w2s2, act_quant="nvfp4")
    with pytest.raises(ValueError, match="act_quant='mxfp8' needs w13_e8m0 and w2_e8m0"):
        replace(f, act_quant="mxfp8")


def _case(E, H, I, M, k, seed, skew=False):
    """(x, the W4A16 weights, {mode: FP4MMAWeights}, topk_weights, topk_ids), every mode's
    weights prepared from the same MXFP4 tensors."""
    t, w = _mxfp4_weights(E, H, I, seed)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, H, generator=g)
    x[0] = 0.0  # all-zero token
    if M > 2:
        x[2, 3] = 500.0  # a single huge outlier
    tw, ids = random_routing(M, k, E, seed=seed)
    ids = ids.clone()
    ids[1, 0] = -1  # expert on another rank
    if skew:
        ids[:, 0] = 0  # every token's first slot to expert 0
        ids[3, :] = -1  # a token no local expert serves
    return x.to(DEV), w, _fp4_weights(t), tw.to(DEV), ids.to(DEV)


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("act_quant", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("swap_ab,skew,activation,split_k,atomic", [
    (True, False, "situ", (2, 2), False), (False, True, "situ", (1, 1), True), (True, True, "silu", (2, 1), False)])
def test_fused_moe_fp4_matches_reference(act_quant, swap_ab, skew, activation, split_k, atomic):
    # I = 128: with swap-AB two 64-column GEMM1 tiles (stacked gate + up: 128 MMA rows each), else one
    # 128-column tile (its intermediate quantized in two halves); 2 K steps per GEMM
    x, w, f, tw, ids = _case(4, 128, 128, 7, 3, seed=5, skew=skew)
    cfg = FP4MoEConfig(block_m=16, swap_ab=swap_ab, block_n1=64 if swap_ab else 128, block_n2=128, block_k1=64,
                       block_k2=64, split_k1=split_k[0], split_k2=split_k[1], atomic_reduce=atomic)
    f = f[act_quant]
    kw = dict(activation=GatedActivation.parse(activation), routed_scaling_factor=1.5)
    got = fused_moe_fp4(x, f, tw, ids, config=cfg, **kw)
    ref = fused_moe_fp4_reference(x, f, tw, ids, **kw)
    # Same quantized activations; fp32 sums of these short K products are exact in any order here
    assert float((got - ref).abs().max()) <= 1e-6 * float(ref.abs().max())
    if skew:
        assert bool((got[3] == 0).all())
    assert bool((got[0] == 0).all())  # the all-zero token
    if atomic:  # deterministic=True: the slot-order sum whatever the config
        det = fused_moe_fp4(x, f, tw, ids, config=cfg, deterministic=True, **kw)
        assert torch.equal(det, fused_moe_fp4(x, f, tw, ids, config=replace(cfg, atomic_reduce=False), **kw))
    # the one entry point runs the mode the weights were prepared for
    assert torch.equal(fused_moe_nvfp4(x, f, tw, ids, config=cfg, **kw), got)
    w16 = fused_moe_nvfp4(x, w, tw, ids, activation=kw["activation"], routed_scaling_factor=1.5)
    # sanity vs W4A16 (measured here: nvfp4 0.028-0.075, mxfp8 0.028-0.063; one NVFP4-quantized
    # N(0, 1) tensor alone is off by 0.095, an MXFP8 one by 0.027)
    assert _rel(got, w16) < (0.15 if act_quant == "nvfp4" else 0.08), _rel(got, w16)


def test_nvfp4_static_input_scale_and_dynamic_intermediate():
    x, w, fs, tw, ids = _case(3, 64, 128, 5, 2, seed=9)
    f, fm = fs["nvfp4"], fs["mxfp8"]
    in_s = float(x.abs().max()) / 2688 * 4  # coarser than dynamic: blocks stay in range
    for inter in ("static", "dynamic"):
        kw = dict(input_scale=in_s, intermediate_scale=inter)
        got = fused_moe_fp4(x, f, tw, ids, **kw)
        ref = fused_moe_fp4_reference(x, f, tw, ids, **kw)
        assert float((got - ref).abs().max()) <= 1e-6 * float(ref.abs().max())
    with pytest.raises(ValueError, match="no bound"):
        fused_moe_fp4(x, f, tw, ids, activation=GatedActivation.silu(), intermediate_scale="static")
    with pytest.raises(ValueError, match="input_scale: only for act_quant='nvfp4'"):
        fused_moe_fp4(x, fm, tw, ids, input_scale=1.0)
    with pytest.raises(ValueError, match="act_quant"):
        FP4MMAWeights.from_mxfp4(*random_mxfp4_tensors(3, 64, 128, seed=9), act_quant="fp8")
    with pytest.raises(ValueError, match="input_scale is the NVFP4 activation scale of the W4A4 weights"):
        fused_moe_nvfp4(x, w, tw, ids, input_scale=1.0)
    with pytest.raises(TypeError, match="config: the W4A4 weights .* take a FP4MoEConfig"):
        fused_moe_nvfp4(x, f, tw, ids, config=MoEConfig())
    with pytest.raises(ValueError, match="num_global_experts=2 is below the weights' 3 local experts"):
        fused_moe_fp4(x, fm, tw, ids, num_global_experts=2)
    # under EP the heuristic sizes the call for the local share of the pairs: it still runs
    ep = fused_moe_fp4(x, f, tw, ids, num_global_experts=48)
    assert float((ep - fused_moe_fp4_reference(x, f, tw, ids)).abs().max()) <= 1e-6 * float(ep.abs().max())


@pytest.mark.skipif(DEV == "cuda", reason="the kernels' own decomposition runs only in the interpreter")
def test_own_decomposition_equals_tl_dot_scaled(monkeypatch):
    # MXFP8 through tl.dot_scaled (interpreter) and through the EMULATE decomposition that the
    # interpreter uses for NVFP4: the same operand / scale conventions give the same result.
    x, w, fs, tw, ids = _case(3, 64, 64, 6, 2, seed=2)
    a = fused_moe_fp4(x, fs["mxfp8"], tw, ids)
    monkeypatch.setattr(moe_fp4, "check_fp4_mode_supported", lambda mode, device: True)
    b = fused_moe_fp4(x, fs["mxfp8"], tw, ids)
    assert torch.equal(a, b)


def test_error_budget_of_the_fp4_modes_adds_up():
    """bench/fp4_error_budget.py's decomposition (what bench/results/ab-layer-fp4-modes/README.md
    explains the W4A4 error with), at a small shape: activation and intermediate rounding are
    independent (they add in quadrature), the static intermediate scale costs about what a dynamic
    one does, and MXFP8 is several times more accurate than NVFP4."""
    import importlib.util
    import math
    import pathlib

    path = pathlib.Path(__file__).resolve().parent.parent / "bench" / "fp4_error_budget.py"
    spec = importlib.util.spec_from_file_location("fp4_error_budget", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    res = mod.run(E=4, H=512, I=128, M=16, top_k=2, seed=1)
    assert len(res["rows"]) == 4
    for row in res["rows"]:
        e = row["errors"]
        x, a = e["x nvfp4 (dynamic per token)"], e["intermediate nvfp4 (static SiTU bound)"]
        mode = e["mode nvfp4 (W4A4, static intermediate)"]
        assert 0.05 < row["x_rel_quant_error"]["nvfp4"] < 0.12  # one NVFP4 tensor: ~0.09
        assert x > row["x_rel_quant_error"]["nvfp4"]  # the gated product adds gate's and up's errors
        assert abs(mode - math.hypot(x, a)) < 0.1 * mode, (mode, x, a)
        assert abs(a - e["intermediate nvfp4 (dynamic per row)"]) < 0.1 * a
        assert e["mode mxfp8 (W4A8)"] < mode / 2.5


def test_e8m0_torch_path_in_expert_chunks_counts_and_names_across_chunks(monkeypatch):
    """The torch path of recover_e8m0 (CUDA, no numba) runs in expert chunks to bound its
    temporaries: with one expert per chunk, the same bytes, and a bad block in expert 2 is
    named with its expert number and the total count over all chunks."""
    from k3nvfp4.kernels.moe_details import layout_host
    from k3nvfp4.kernels.moe_fp4_details import weights as fw

    t, _ = _mxfp4_weights(4, 64, 64, seed=9)
    mo = cast_mxfp4_moe(*t)
    rows13 = mo.w13_scale_2.repeat_interleave(64, dim=1).cpu()
    whole = fw.recover_e8m0(mo.w13.cpu(), mo.w13_scale.cpu(), rows13, "w13")
    monkeypatch.setattr(layout_host, "e8m0_from_pow2_e4m3", lambda *a: None)
    monkeypatch.setattr(fw, "_RECOVERY_CHUNK_BLOCKS", 1)
    assert torch.equal(fw.recover_e8m0(mo.w13.cpu(), mo.w13_scale.cpu(), rows13, "w13"), whole)
    bad = mo.w13_scale.cpu().view(torch.uint8).clone()
    packed = mo.w13.cpu().clone()
    for e in (2, 3):
        bad[e, 7, 0] = 0x39  # 1.125: no power of two
        packed[e, 7, 0] = 0x11
    with pytest.raises(E8M0RecoveryError, match=r"w13: 2 block\(s\) .* first at expert 2, row 7, 32-block 0"):
        fw.recover_e8m0(packed, bad.view(torch.float8_e4m3fn), rows13, "w13")
