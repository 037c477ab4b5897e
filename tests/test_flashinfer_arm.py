"""FlashInfer as an arm of the layer A/B (sglang_ext/ab/flashinfer_arm.py), on CPU: no FlashInfer
kernel runs here, so what is checked is everything up to the call.

- The weight conversion (the layer's NVFP4 tensors -> MXFP4 in FlashInfer's [up; gate] order) is
  decoded with plain torch below (a hand-written E2M1 table, 2^(byte - 127)) and compared with the
  MXFP4 experts the layer was built from, and with the reference's own dequantization.
- FlashInfer's SM90 scale folding (its own function, plain torch) is read back with the index rule
  of its documented layout.
- A plain-torch forward with FlashInfer's documented semantics (GEMM1 output: linear branch in
  the first I columns, gate in the second) on the converted tensors reproduces the project's
  reference; with the halves swapped it does not (the check can fail).
- The keyword arguments the arm passes bind to the installed ``cutlass_fused_moe`` signature
  (``inspect.signature``, no call), with the shapes and dtypes its binding checks.
- On CPU the arm is "not available" with its reason, in a real layer A/B run.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from k3nvfp4.kernels import NVFP4MoEWeights, fused_moe_nvfp4_reference
from k3nvfp4.kernels.activation import K3_SITU, GatedActivation
from k3nvfp4.kernels.moe_fp4_details.weights import E8M0RecoveryError
from k3nvfp4.sglang_ext.ab import flashinfer_arm as fa
from k3nvfp4.sglang_ext.ab.layer import LayerABConfig, run_layer_ab
from k3nvfp4.sglang_ext.ab.layer_inputs import realistic_routed_inputs, synthetic_layer

E, H, I = 3, 256, 128  # the SM90 path's smallest shape: H, I multiples of 128
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def decode_mxfp4(packed: torch.Tensor, e8m0: torch.Tensor) -> torch.Tensor:
    """uint8 [..., N, K/2] (low nibble = even element) x E8M0 [..., N, K/32] -> float64 [..., N, K]."""
    nib = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2).long()
    val = E2M1.double()[nib & 7] * torch.where(nib & 8 > 0, -1.0, 1.0).double()
    scale = torch.pow(2.0, e8m0.double() - 127).repeat_interleave(32, dim=-1)
    return val * scale


def mxfp4_experts(seed=0):
    """Random MXFP4 experts (every nibble, E8M0 bytes over 9 binades) as raw tensors and as the
    kernels' weights."""
    g = torch.Generator().manual_seed(seed)
    raw = dict(w13=torch.randint(0, 256, (E, 2 * I, H // 2), dtype=torch.uint8, generator=g),
               w13_e8m0=torch.randint(116, 125, (E, 2 * I, H // 32), dtype=torch.uint8, generator=g),
               w2=torch.randint(0, 256, (E, H, I // 2), dtype=torch.uint8, generator=g),
               w2_e8m0=torch.randint(116, 125, (E, H, I // 32), dtype=torch.uint8, generator=g))
    return raw, NVFP4MoEWeights.from_mxfp4(raw["w13"], raw["w13_e8m0"], raw["w2"], raw["w2_e8m0"])


@pytest.fixture(scope="module")
def fi():
    """The installed FlashInfer's fused_moe package (imported once: ~10 s on 2 cores)."""
    return pytest.importorskip("flashinfer.fused_moe")


def test_conversion_keeps_every_value_and_puts_up_rows_first():
    raw, w = mxfp4_experts()
    mx = fa.FlashInferMXFP4.from_modelopt(w.to_modelopt())
    assert (mx.fc1.shape, mx.fc1_e8m0.shape, mx.fc2.shape, mx.fc2_e8m0.shape) == \
        ((E, 2 * I, H // 2), (E, 2 * I, H // 32), (E, H, I // 2), (E, H, I // 32))
    assert {t.dtype for t in (mx.fc1, mx.fc1_e8m0, mx.fc2, mx.fc2_e8m0)} == {torch.uint8}
    src13 = decode_mxfp4(raw["w13"], raw["w13_e8m0"])  # gate rows then up rows
    got13 = decode_mxfp4(mx.fc1, mx.fc1_e8m0)
    assert torch.equal(got13[:, :I], src13[:, I:]) and torch.equal(got13[:, I:], src13[:, :I])
    assert torch.equal(decode_mxfp4(mx.fc2, mx.fc2_e8m0), decode_mxfp4(raw["w2"], raw["w2_e8m0"]))
    # The nibbles themselves are the checkpoint's (nothing re-quantized), and so are the bytes here
    # (no all-zero block among random nibbles at these sizes).
    assert torch.equal(mx.fc1, torch.cat([raw["w13"][:, I:], raw["w13"][:, :I]], 1))
    assert torch.equal(mx.fc1_e8m0, torch.cat([raw["w13_e8m0"][:, I:], raw["w13_e8m0"][:, :I]], 1))
    # Against what the reference multiplies: the ModelOpt tensors' e2m1 x E4M3 x scale_2.
    from k3nvfp4.kernels import formats

    w13, s13, s13_2, w2, s2, s2_2 = w.to_modelopt()
    ref13 = formats.dequantize_nvfp4(w13, s13, 1.0).double()
    ref13[:, :I] *= s13_2[:, 0, None, None].double()
    ref13[:, I:] *= s13_2[:, 1, None, None].double()
    assert torch.equal(got13, torch.cat([ref13[:, I:], ref13[:, :I]], 1))
    assert torch.equal(decode_mxfp4(mx.fc2, mx.fc2_e8m0), formats.dequantize_nvfp4(w2, s2, s2_2).double())


def test_random_nvfp4_experts_are_not_mxfp4_and_say_why():
    layer = synthetic_layer(2, H, I, top_k=2, seed=0)  # E4M3 block scales with mantissas
    with pytest.raises(E8M0RecoveryError, match=r"w13: .* not exact MXFP4; first at expert 0.*FlashInfer's SM90 W4A16"):
        fa.FlashInferMXFP4.from_modelopt(layer.tensors)


def test_scale_folding_is_flashinfers_documented_layout(fi):
    """interleave_moe_scales_for_sm90_mixed_gemm (FlashInfer's, plain torch): [E, rows/64, K/128,
    16, 16] where each 64 x 128 block of weights keeps its 64 x 4 scale bytes as 16 rows of 16: byte
    (r, c) of the block at folded row r % 16, column 4 * (r // 16) + c."""
    _, w = mxfp4_experts(1)
    mx = fa.FlashInferMXFP4.from_modelopt(w.to_modelopt())
    for e8m0, rows, K in ((mx.fc1_e8m0, 2 * I, H), (mx.fc2_e8m0, H, I)):
        f = fa.interleaved_scales(e8m0)
        assert f.shape == (E, rows // 64, K // 128, 16, 16) and f.dtype == torch.uint8 and f.is_contiguous()
        e, r, k = torch.meshgrid(torch.arange(E), torch.arange(rows), torch.arange(K // 32), indexing="ij")
        back = f[e, r // 64, k // 4, r % 16, 4 * ((r % 64) // 16) + k % 4]
        assert torch.equal(back, e8m0)


def _flashinfer_semantics(mx, x, tw, ids, beta, linear_beta, swap_halves=False):
    """One MoE forward as FlashInfer's CUTLASS W4A16 path documents it, in float64: GEMM1 with
    fc1 ([up; gate] rows), SiTU(gate = columns I..2I, linear = columns 0..I), rounded to x's dtype,
    GEMM2, the top-k weighted sum."""
    w1, w2 = decode_mxfp4(mx.fc1, mx.fc1_e8m0), decode_mxfp4(mx.fc2, mx.fc2_e8m0)
    out = torch.zeros(x.shape[0], H, dtype=torch.float64)
    for t in range(x.shape[0]):
        for s in range(ids.shape[1]):
            e = int(ids[t, s])
            if e < 0:
                continue
            h = w1[e] @ x[t].double()
            lin, gate = (h[I:], h[:I]) if swap_halves else (h[:I], h[I:])
            act = beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * (linear_beta * torch.tanh(lin / linear_beta))
            out[t] += float(tw[t, s]) * (w2[e] @ act.to(x.dtype).double())
    return out


def test_flashinfer_semantics_on_the_converted_weights_give_the_reference():
    raw, w = mxfp4_experts(2)
    mx = fa.FlashInferMXFP4.from_modelopt(w.to_modelopt())
    inp = realistic_routed_inputs(6, H, E, 2, seed=3, dtype=torch.float32)
    ids = inp.topk_ids.clone()
    ids[0, 1] = -1  # a route of another EP rank: skipped by both
    ref = fused_moe_nvfp4_reference(inp.hidden_states, w, inp.topk_weights, ids,
                                    activation=GatedActivation.situ(4.0, 25.0)).double()
    for swap, ok in ((False, True), (True, False)):
        got = _flashinfer_semantics(mx, inp.hidden_states, inp.topk_weights, ids, 4.0, 25.0, swap_halves=swap)
        rel = float((got - ref).norm() / ref.norm())
        assert (rel < 1e-5) == ok, (swap, rel)  # the reference keeps its fp32 intermediate


@pytest.mark.parametrize("activation", ["situ", "silu"])
def test_call_arguments_bind_to_the_installed_cutlass_fused_moe(fi, activation):
    _, w = mxfp4_experts(3)
    mx = fa.FlashInferMXFP4.from_modelopt(w.to_modelopt())
    # On CPU FlashInfer's weight interleave (a CUDA kernel) cannot run: the identity stands in for
    # it here; it keeps shape and dtype (interleave_moe_weights_for_sm90_mixed_gemm: torch.empty_like).
    p = fa.prepare_sm90(mx, GatedActivation.parse(activation, 4.0, 25.0), interleave_weights=lambda t: t.clone())
    M, k = 5, 2
    x = torch.randn(M, H).bfloat16()
    tw, ids = torch.rand(M, k, dtype=torch.float32), torch.tensor([[0, 1], [2, -1], [1, 2], [0, 2], [-1, 1]])
    out = torch.empty(M, H, dtype=torch.bfloat16)
    kw = fa.sm90_call_kwargs(p, x, tw, ids, out, routed_scaling_factor=2.0)
    sig = inspect.signature(fi.cutlass_fused_moe)
    bound = sig.bind(**kw)  # every name exists; every required parameter is given
    assert {"input", "token_selected_experts", "token_final_scales", "fc1_expert_weights", "fc2_expert_weights",
            "output_dtype", "quant_scales"} <= set(bound.arguments)
    if activation == "situ":
        for name in ("situ_beta", "situ_linear_beta"):
            assert sig.parameters[name].kind is inspect.Parameter.KEYWORD_ONLY and name in bound.arguments
    # What the binding (isWFP4A16Quant) checks: bf16 input, int32 ids, fp32 scales, uint8 weights with
    # fc1 rows = 2 * (fc2 packed K) * 2, two quant scales.
    assert kw["input"].dtype == torch.bfloat16 and kw["output_dtype"] == torch.bfloat16 and kw["output"] is out
    assert kw["token_selected_experts"].dtype == torch.int32 and torch.equal(kw["token_selected_experts"], ids.int())
    assert kw["token_final_scales"].dtype == torch.float32 and torch.equal(kw["token_final_scales"], tw * 2.0)
    assert kw["fc1_expert_weights"].dtype == kw["fc2_expert_weights"].dtype == torch.uint8
    assert kw["fc1_expert_weights"].shape == (E, 2 * I, H // 2) and kw["fc2_expert_weights"].shape == (E, H, I // 2)
    assert kw["fc1_expert_weights"].shape[1] == kw["fc2_expert_weights"].shape[2] * 2 * 2
    assert kw["use_w4_group_scaling"] is True and not kw.get("use_packed_weights", False)
    s1, s2 = kw["quant_scales"]
    assert s1.dtype == s2.dtype == torch.int32
    assert s1.shape == (E, 2 * I // 64, H // 128, 16, 4) and s2.shape == (E, H // 64, I // 128, 16, 4)
    assert torch.equal(s1.view(torch.uint8), fa.interleaved_scales(mx.fc1_e8m0))
    # FlashInfer's own W4A16 runner (its unified API over the same call) validates these tensors
    # and passes the same quant_scales: its checks run here on a stand-in for the runner's state.
    from types import SimpleNamespace

    from flashinfer.fused_moe.runners import CutlassW4A16Runner as R

    me = SimpleNamespace(config=SimpleNamespace(routing=SimpleNamespace(num_experts=E),
                                                experts=SimpleNamespace(intermediate_size=I),
                                                activation=SimpleNamespace(is_gated=True)),
                         device=torch.device("cpu"), _required_weight_keys=R._required_weight_keys)
    me._validate_weight_storage = lambda ts: R._validate_weight_storage(me, ts)
    view = {"fc1_expert_weights": p.fc1, "fc2_expert_weights": p.fc2, "fc1_expert_scales": s1.view(torch.uint8),
            "fc2_expert_scales": s2.view(torch.uint8)}
    packed = R._pack_weight_inputs(me, view, H)  # raises on a shape or dtype it does not take
    qs = R._quant_scales(me, [None] * 6 + packed[2:])
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(qs, kw["quant_scales"]))
    if activation == "situ":
        assert kw["activation_type"] == fi.ActivationType.Situ and int(kw["activation_type"]) == 10
        assert kw["situ_beta"].dtype == kw["situ_linear_beta"].dtype == torch.float32
        assert torch.equal(kw["situ_beta"], torch.full((E,), 4.0)) and torch.equal(kw["situ_linear_beta"], torch.full((E,), 25.0))
    else:
        assert kw["activation_type"] == fi.ActivationType.Swiglu and "situ_beta" not in kw


def unswizzle(sw: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """CUTLASS's 128 x 4 scale layout read back byte by byte, from the atom's strides: scale (r, c)
    at ((r // 128) * (C / 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4."""
    E, _, C = sw.shape
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    at = ((r // 128) * (C // 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    return sw.reshape(E, -1)[:, at]


def test_sm100_nvfp4_weights_and_call_arguments(fi):
    """SM100 (NVFP4 x NVFP4): the layer's NVFP4 experts as they are in [up; gate] order, block scales
    in CUTLASS's 128 x 4 layout (read back byte by byte from the scale atom's strides),
    global scales and alphas by hand, the call bound to the installed signature and its tensors
    validated by FlashInfer's own NVFP4 runner code."""
    from types import SimpleNamespace

    from flashinfer.fused_moe.runners import CutlassNvfp4Runner as R
    from k3nvfp4.kernels import formats

    layer = synthetic_layer(E, H, I, top_k=2, seed=4)  # random NVFP4, one scale_2 for gate and up
    nv = fa.FlashInferNVFP4.from_modelopt(layer.tensors)
    w13, s13, s13_2, w2, s2, s2_2 = layer.weights.to_modelopt()
    ref13 = formats.dequantize_nvfp4(w13, s13, s13_2[:, 0]).double()
    got13 = formats.dequantize_nvfp4(nv.fc1, nv.fc1_scale, nv.fc1_scale_2).double()
    assert torch.equal(got13, torch.cat([ref13[:, I:], ref13[:, :I]], 1))
    assert torch.equal(nv.fc2, w2) and torch.equal(nv.fc2_scale_2, s2_2)

    p = fa.prepare_sm100(nv, GatedActivation.situ(4.0, 25.0))
    assert p.fc1.dtype == p.fc2.dtype == torch.int64 and p.fc1.shape == (E, 2 * I, H // 16)
    assert p.fc2.shape == (E, H, I // 16) and torch.equal(p.fc1.view(torch.uint8), nv.fc1)
    # The binding's FP4 checks: fc1 scales (E, align(I, 64) * 2, align(H, 64) / 64) int32, fc2 (E, align(H, 128), ...).
    assert p.fc1_scales.dtype == torch.int32 and p.fc1_scales.shape == (E, 2 * I, H // 64)
    assert p.fc2_scales.shape == (E, -(-H // 128) * 128, I // 64)
    for sw, lin in ((p.fc1_scales, nv.fc1_scale), (p.fc2_scales, s2)):
        assert torch.equal(unswizzle(sw.view(torch.uint8), *lin.shape[1:]), lin.view(torch.uint8))
    # Padding: rows beyond the matrix (H = 256 rows of fc2 fill two tiles exactly; a 192-row one pads).
    odd = torch.arange(2 * 192 * 8, dtype=torch.uint8).reshape(2, 192, 8).view(torch.float8_e4m3fn)
    sw = fa.swizzled_scales(odd)
    assert sw.shape == (2, 256, 8) and torch.equal(unswizzle(sw, 192, 8), odd.view(torch.uint8))
    assert int(sw.flatten(1).count_nonzero(dim=1).max()) <= 192 * 8  # the padding is zeros

    x = (torch.randn(5, H) * 3).bfloat16()
    tw, ids = torch.rand(5, 2), torch.tensor([[0, 1], [2, -1], [1, 2], [0, 2], [-1, 1]])
    kw = fa.sm100_call_kwargs(p, x, tw, ids, None)
    fi_sig = inspect.signature(fi.cutlass_fused_moe)
    fi_sig.bind(**kw)
    a1, bs1, alpha1, a2, bs2, alpha2 = kw["quant_scales"]
    assert a1.shape == () and a1.dtype == torch.float32
    assert float(a1) == pytest.approx(448 * 6 / float(x.float().abs().max()), rel=1e-6)
    assert torch.allclose(alpha1, nv.fc1_scale_2 / a1, rtol=1e-6) and alpha1.shape == (E,)
    assert float(a2) == pytest.approx(448 * 6 / (4.0 * 25.0)) and torch.allclose(alpha2, nv.fc2_scale_2 / a2)
    assert bs1 is p.fc1_scales and bs2 is p.fc2_scales and "use_w4_group_scaling" not in kw
    assert kw["activation_type"] == fi.ActivationType.Situ and torch.equal(kw["situ_linear_beta"], torch.full((E,), 25.0))
    # FlashInfer's NVFP4 runner over the same call validates the prepared tensors (a stand-in for its state).
    me = SimpleNamespace(config=SimpleNamespace(routing=SimpleNamespace(num_experts=E),
                                                experts=SimpleNamespace(intermediate_size=I),
                                                activation=SimpleNamespace(is_gated=True)),
                         device=torch.device("cpu"), _required_weight_keys=R._required_weight_keys)
    me._validate_weight_storage = lambda ts: R._validate_weight_storage(me, ts)
    view = {"fc1_expert_weights": nv.fc1, "fc2_expert_weights": nv.fc2, "fc1_act_global_scale": a1,
            "fc1_weight_block_scale": bs1.view(torch.uint8), "fc1_dequant_scale": alpha1, "fc2_act_global_scale": a2,
            "fc2_weight_block_scale": bs2.view(torch.uint8), "fc2_dequant_scale": alpha2}
    packed = R._pack_weight_inputs(me, view, H)
    assert torch.equal(packed[0], kw["fc1_expert_weights"]) and packed[0].dtype == torch.int64
    qs = R._quant_scales(me, [None] * 4 + packed)  # inputs: out, x, ids, weights, then these
    assert all(torch.equal(a, b) and a.dtype == b.dtype for a, b in zip(qs, kw["quant_scales"]))


def test_sm100_refuses_gate_and_up_scale_2_that_differ():
    from k3nvfp4.kernels.testing import random_nvfp4_moe_weights

    w = random_nvfp4_moe_weights(2, H, I, seed=0, distinct_gate_up_scale_2=True)
    with pytest.raises(ValueError, match=r"gate scale_2 != up scale_2; FlashInfer's NVFP4 MoE has one GEMM1 alpha"):
        fa.FlashInferNVFP4.from_modelopt(w.to_modelopt())


@pytest.mark.parametrize("args, why", [
    ((torch.float16, 256, 128, K3_SITU), "takes bf16 activations only, not torch.float16"),
    ((torch.bfloat16, 3584, 192, K3_SITU), "multiples of 128 (the K3 EP shards; not TP16's I = 192): I = 192"),
    ((torch.bfloat16, 256, 128, GatedActivation.situ(4.0, None)), "SiTU without linear_beta"),
])
def test_layers_the_sm90_path_cannot_take(args, why):
    assert why in fa.sm90_layer_reason(*args)
    assert fa.sm90_layer_reason(torch.bfloat16, 3584, 3072, K3_SITU) is None  # the K3 EP16 shard
    with pytest.raises(ValueError, match="got 'gelu'"):  # an activation the kernels lack never gets this far
        GatedActivation.parse("gelu")


def test_layers_the_sm100_path_cannot_take():
    assert "multiples of 64 here: I = 96" in fa.sm100_layer_reason(torch.bfloat16, 3584, 96, K3_SITU)
    assert "not torch.float32" in fa.sm100_layer_reason(torch.float32, 3584, 192, K3_SITU)
    for I_shard in (192, 384, 3072):  # K3 TP16, TP8, EP16
        assert fa.sm100_layer_reason(torch.bfloat16, 3584, I_shard, K3_SITU) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU answer")
def test_cpu_layer_ab_reports_flashinfer_not_available(tmp_path):
    from k3nvfp4.checkpoint.synthetic import write_synthetic_checkpoint

    mx = write_synthetic_checkpoint(tmp_path / "mx", num_layers=2, num_experts=2, hidden_size=128,
                                    intermediate_size=128, num_shards=1, top_k=1)
    rep = run_layer_ab(LayerABConfig(out_dir=tmp_path / "o", ckpt=mx, layer=1, tokens=2,
                                     arms=("reference", "flashinfer")))
    st = rep.arm("flashinfer").status
    assert st == ("not available: no CUDA device (device cpu, torch.cuda.is_available() = False); FlashInfer's "
                  "fused MoE runs CUDA kernels")
    assert [(p.a, p.b) for p in rep.pairs] == [] and "| flashinfer | not available: " in (tmp_path / "o" / "summary.md").read_text()
