"""FlashInfer's fused MoE with SiTU: an arm of the layer A/B and a peer of bench/bench_moe.py.

Where it runs (installed FlashInfer 0.7.x, read from its sources):

- SM90 (Hopper): ``flashinfer.fused_moe.cutlass_fused_moe`` W4A16, MXFP4 weights x bf16
  activations (``use_w4_group_scaling=True``, uint8 weights: the binding's ``isWFP4A16Quant``),
  ``activation_type=ActivationType.Situ`` with per-expert ``situ_beta`` / ``situ_linear_beta``
  (float32 [E]; the CUTLASS ``SituAdaptor``) or ``ActivationType.Swiglu`` for SiLU. It needs
  H and I multiples of 128 (the K3 EP shards: H 3584, I 3072; not TP16's I = 192), bf16
  activations only, and MXFP4 weights: E2M1 nibbles with one E8M0 scale per 32 along K.
- SM100 / SM103 (Blackwell): ``cutlass_fused_moe`` NVFP4 x NVFP4 (W4A4): the layer's NVFP4
  weights as they are (weights viewed as int64: the binding's ``isNvfp4Quant``), bf16 activations
  quantized to NVFP4 by FlashInfer with a per-tensor global scale, the same SiTU arguments. H and I
  multiples of 64, one scale_2 for gate and up. Activation scales: the input's global scale is
  448 * 6 / amax(x), computed on the device per call (no calibration; ModelOpt's ``input_scale``
  where a checkpoint has one plays that role in SGLang); the intermediate's is
  448 * 6 / (beta * linear_beta), the bound of |SiTU| (SiLU: 1.0, FlashInfer's own default). Compare
  it with ``triton_situ:nvfp4`` (also W4A4). (FlashInfer's other Blackwell SiTU MoE,
  ``backend="cake"``, takes the K3 TP8 shard only and its own shuffled layout: not driven here.)
- anything else: ``not available: <reason>``.

FlashInfer #4597 reports that the SM90 MXFP4 path could silently run another activation in
place of SiTU; the installed 0.7.2 sources list ``SituAdaptor`` at index 10 of ``doActivation``'s
table, but only the arm's error against the plain-torch reference shows what the kernel runs, so
the layer A/B reports that error and never assumes it.

Layouts (``cutlass_fused_moe`` on SM90 W4A16; ``prepare_cutlass_w4a16_weights`` and the CUTLASS
sources of the installed package):

- ``fc1_expert_weights`` uint8 [E, 2I, H/2]: rows ``[up (w3); gate (w1)]``, the reverse of
  ModelOpt's ``w13`` (gate rows first): the activation kernels read the *linear* branch from the
  first I columns of the GEMM1 output and the *gate* from the second I. Nibbles as ModelOpt's
  (low nibble = even element), then ``interleave_moe_weights_for_sm90_mixed_gemm(w, "fp4")``
  (a CUDA kernel of FlashInfer) puts them in the mixed-input GEMM's register order.
- ``fc2_expert_weights`` uint8 [E, H, I/2], interleaved the same way.
- ``quant_scales`` = [fc1 scales, fc2 scales]: E8M0 bytes [E, rows, K/32] folded by
  ``interleave_moe_scales_for_sm90_mixed_gemm`` (plain torch) to [E, rows/64, K/128, 16, 16],
  viewed as int32 (what FlashInfer's own W4A16 runner passes).

On SM100 (the binding's ``isNvfp4Quant``; ``prepare_cutlass_nvfp4_weights`` and SGLang's
flashinfer_cutlass backend): fc1 / fc2 the same ``[up; gate]`` nibbles viewed as int64; block scales
E4M3 in CUTLASS's 128 x 4 swizzled layout (:func:`swizzled_scales`), rows padded to 128, viewed as int32; six quant_scales
(input global scale, fc1 block scales, fc1 alpha, intermediate global scale, fc2 block scales, fc2
alpha), alpha = scale_2 / the global scale of that GEMM's input.

The SM90 weights come from the layer's NVFP4 tensors: value = e2m1 x E4M3 scale (per 16) x scale_2 is
MXFP4 exactly when each 32-block's two E4M3 scales are one power of two 2^j and scale_2 is 2^m;
the E8M0 byte is then j + m + 127 (:func:`k3nvfp4.kernels.moe_fp4_details.weights.recover_e8m0`).
That holds for the MXFP4 release and its cast; random NVFP4 experts are not MXFP4, and the arm
says so. Nothing is re-quantized.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from k3nvfp4.kernels import target
from k3nvfp4.kernels.activation import ActivationKind, GatedActivation

if TYPE_CHECKING:
    from k3nvfp4.kernels.moe_details.weights import ModelOptMoETensors

SM90_SHAPE_MULTIPLE = 128  # H and I (isProfileShapeSupported / prepare_cutlass_w4a16_weights)
SM100_SHAPE_MULTIPLE = 64  # H (the activation scales' K alignment) and I (per-half 64-row scale padding)
E2M1_X_E4M3_MAX = 6.0 * 448.0  # the largest NVFP4 magnitude at block scale 448: a global scale's target
MXFP4_USE = "FlashInfer's SM90 W4A16 MoE (MXFP4 weights, one E8M0 scale per 32)"
# Set to 1 to let the arm JIT-build FlashInfer's fused-MoE module when no built copy exists (minutes of nvcc).
JIT_ENV = "K3NVFP4_FLASHINFER_JIT"


@dataclass(frozen=True)
class FlashInferMXFP4:
    """One layer's experts as MXFP4 in FlashInfer's row order, before the SM90 interleave.

    fc1       uint8 [E, 2I, H/2]   up (w3) rows, then gate (w1) rows; E2M1 nibbles, low = even element
    fc1_e8m0  uint8 [E, 2I, H/32]  E8M0 per 32 along H (the matrix's scale_2 folded in)
    fc2       uint8 [E, H, I/2]
    fc2_e8m0  uint8 [E, H, I/32]
    value = e2m1(nibble) * 2^(byte - 127).
    """

    fc1: torch.Tensor
    fc1_e8m0: torch.Tensor
    fc2: torch.Tensor
    fc2_e8m0: torch.Tensor

    @property
    def num_experts(self) -> int:
        return self.fc1.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.fc2.shape[1]

    @property
    def intermediate_size(self) -> int:
        return self.fc1.shape[1] // 2

    @classmethod
    def from_modelopt(cls, tensors: ModelOptMoETensors) -> "FlashInferMXFP4":
        """From the layer's ModelOpt NVFP4 tensors (the checkpoint's, or the cast of the MXFP4
        release); raises E8M0RecoveryError when the experts are not exactly MXFP4 (naming the
        first bad block)."""
        from k3nvfp4.kernels.moe_details.weights import gate_up_scale_2
        from k3nvfp4.kernels.moe_fp4_details.weights import recover_e8m0

        w13, s13, s13_2, w2, s2, s2_2 = tensors
        s13, s2 = _e4m3(s13), _e4m3(s2)
        E, I, H = w13.shape[0], w13.shape[1] // 2, w2.shape[1]
        g_u = gate_up_scale_2(s13_2, E).float()
        rows13 = torch.cat([g_u[:, :1].expand(E, I), g_u[:, 1:].expand(E, I)], dim=1)  # scale_2 per w13 row
        e13 = recover_e8m0(w13, s13, rows13, "w13", use=MXFP4_USE)
        e2 = recover_e8m0(w2, s2, s2_2.reshape(E, 1).float().expand(E, H), "w2", use=MXFP4_USE)
        return cls(_up_then_gate(w13, I), _up_then_gate(e13, I), w2.contiguous(), e2.contiguous())

    def to(self, device) -> "FlashInferMXFP4":
        return FlashInferMXFP4(*(t.to(device) for t in (self.fc1, self.fc1_e8m0, self.fc2, self.fc2_e8m0)))


def _up_then_gate(t: torch.Tensor, I: int) -> torch.Tensor:
    """[E, 2I, ...] gate rows then up rows (ModelOpt) -> up rows then gate rows (FlashInfer)."""
    return torch.cat([t[:, I:], t[:, :I]], dim=1).contiguous()


def interleaved_scales(e8m0: torch.Tensor) -> torch.Tensor:
    """E8M0 uint8 [E, rows, K/32] -> FlashInfer's SM90 folded scales uint8 [E, rows/64, K/128, 16, 16]
    (``interleave_moe_scales_for_sm90_mixed_gemm``: a reshape/permute, CPU or CUDA)."""
    from flashinfer.fused_moe import interleave_moe_scales_for_sm90_mixed_gemm

    return interleave_moe_scales_for_sm90_mixed_gemm(e8m0, group_size=32)


@dataclass(frozen=True)
class PreparedSM90:
    """What ``cutlass_fused_moe`` reads on SM90, built once per layer on the GPU.

    fc1 uint8 [E, 2I, H/2] and fc2 uint8 [E, H, I/2] interleaved for the mixed-input GEMM;
    fc1_scales int32 [E, 2I/64, H/128, 16, 4], fc2_scales int32 [E, H/64, I/128, 16, 4] (the folded
    E8M0 bytes viewed as int32); situ_beta / situ_linear_beta float32 [E] (None for SiLU)."""

    fc1: torch.Tensor
    fc2: torch.Tensor
    fc1_scales: torch.Tensor
    fc2_scales: torch.Tensor
    activation: GatedActivation
    situ_beta: torch.Tensor | None
    situ_linear_beta: torch.Tensor | None


def prepare_sm90(w: FlashInferMXFP4, activation: GatedActivation,
                 *, interleave_weights: Callable[[torch.Tensor], torch.Tensor] | None = None) -> PreparedSM90:
    """The SM90 tensors from :class:`FlashInferMXFP4` on its device. ``interleave_weights``
    defaults to FlashInfer's CUDA ``interleave_moe_weights_for_sm90_mixed_gemm(w, "fp4")``; tests on
    CPU pass the identity to check everything else (shapes, dtypes, scales, activation tensors)."""
    if interleave_weights is None:
        from flashinfer.fused_moe import interleave_moe_weights_for_sm90_mixed_gemm

        def interleave_weights(t: torch.Tensor) -> torch.Tensor:
            return interleave_moe_weights_for_sm90_mixed_gemm(t, "fp4")

    E, dev = w.num_experts, w.fc1.device
    beta, lin = _situ_tensors(activation, E, dev)
    return PreparedSM90(interleave_weights(w.fc1), interleave_weights(w.fc2),
                        interleaved_scales(w.fc1_e8m0).view(torch.int32), interleaved_scales(w.fc2_e8m0).view(torch.int32),
                        activation, beta, lin)


def sm90_call_kwargs(p: PreparedSM90, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     out: torch.Tensor | None, routed_scaling_factor: float = 1.0) -> dict[str, Any]:
    """Keyword arguments of one ``flashinfer.fused_moe.cutlass_fused_moe`` call (SM90 W4A16).

    x bf16 [M, H]; topk_weights float [M, k]; topk_ids int [M, k], local ids, -1 = not local (the
    kernels skip ids outside [0, E)); out bf16 [M, H] or None. routed_scaling_factor is folded into
    the top-k weights (the call has no such argument)."""
    kw: dict[str, Any] = dict(
        input=x, token_selected_experts=topk_ids.to(torch.int32).contiguous(),
        token_final_scales=(topk_weights.float() * routed_scaling_factor).contiguous(),
        fc1_expert_weights=p.fc1, fc2_expert_weights=p.fc2, output_dtype=torch.bfloat16,
        quant_scales=[p.fc1_scales, p.fc2_scales], use_w4_group_scaling=True, output=out,
        activation_type=_activation_type(p.activation),
    )
    if p.activation.kind is ActivationKind.SITU:
        kw.update(situ_beta=p.situ_beta, situ_linear_beta=p.situ_linear_beta)
    return kw


def _situ_tensors(activation: GatedActivation, E: int, dev) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """SiTU's per-expert beta / linear_beta float32 [E] (None, None for SiLU)."""
    if activation.kind is not ActivationKind.SITU:
        return None, None
    return (torch.full((E,), activation.beta, dtype=torch.float32, device=dev),
            torch.full((E,), float(activation.linear_beta), dtype=torch.float32, device=dev))


def _activation_type(activation: GatedActivation):
    """FlashInfer's ActivationType of each ActivationKind (every kind has one: _activation_reason)."""
    from flashinfer.fused_moe import ActivationType

    return {ActivationKind.SITU: ActivationType.Situ, ActivationKind.SILU: ActivationType.Swiglu}[activation.kind]


def _activation_reason(activation: GatedActivation) -> str | None:
    """Why FlashInfer's CUTLASS MoE (either path) cannot run this activation, or None."""
    if activation.kind is ActivationKind.SITU and activation.linear_beta is None:
        return "SiTU without linear_beta: FlashInfer's CUTLASS SiTU always caps the up branch (no encoding for none)"
    return None


def sm90_layer_reason(dtype: torch.dtype, hidden_size: int, intermediate_size: int,
                      activation: GatedActivation) -> str | None:
    """Why the SM90 W4A16 path cannot take this layer (dtype, shape, activation), or None."""
    if dtype != torch.bfloat16:
        return f"FlashInfer's SM90 W4A16 MoE takes bf16 activations only, not {dtype}"
    bad = [f"{n} = {v}" for n, v in (("H", hidden_size), ("I", intermediate_size)) if v % SM90_SHAPE_MULTIPLE]
    if bad:
        return (f"FlashInfer's SM90 W4A16 MoE needs H and I multiples of {SM90_SHAPE_MULTIPLE} (the K3 EP shards; "
                f"not TP16's I = 192): {', '.join(bad)}")
    return _activation_reason(activation)


def sm100_layer_reason(dtype: torch.dtype, hidden_size: int, intermediate_size: int,
                       activation: GatedActivation) -> str | None:
    """Why the SM100 NVFP4 path cannot take this layer (dtype, shape, activation), or None."""
    if dtype != torch.bfloat16:
        return f"this arm feeds FlashInfer's SM100 NVFP4 MoE bf16 activations (it quantizes them), not {dtype}"
    bad = [f"{n} = {v}" for n, v in (("H", hidden_size), ("I", intermediate_size)) if v % SM100_SHAPE_MULTIPLE]
    if bad:
        return f"FlashInfer's SM100 NVFP4 MoE needs H and I multiples of {SM100_SHAPE_MULTIPLE} here: {', '.join(bad)}"
    return _activation_reason(activation)


def unavailable_reason(device: torch.device, dtype: torch.dtype, hidden_size: int, intermediate_size: int,
                       activation: GatedActivation) -> str | None:
    """Why FlashInfer's SiTU MoE cannot run this layer on ``device``, or None when it can be tried.
    Checks what needs no FlashInfer import first (the device), so a CPU run never imports it."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return (f"no CUDA device (device {device}, torch.cuda.is_available() = {torch.cuda.is_available()}); "
                "FlashInfer's fused MoE runs CUDA kernels")
    major, minor = target.capability(device)
    arch = major * 10 + minor
    if arch in (100, 103):
        why = sm100_layer_reason(dtype, hidden_size, intermediate_size, activation)
    elif arch == 90:
        why = sm90_layer_reason(dtype, hidden_size, intermediate_size, activation)
    else:
        why = (f"sm{arch}: this arm drives FlashInfer's SM90 W4A16 MXFP4 MoE and its SM100/SM103 NVFP4 one "
               "(cutlass_fused_moe)")
    if why:
        return why
    try:
        import flashinfer
        from flashinfer.fused_moe import cutlass_fused_moe  # noqa: F401
        from flashinfer.jit import fused_moe as jit_moe
    except Exception as e:  # noqa: BLE001 - any import failure makes the arm unavailable
        return f"flashinfer does not import ({type(e).__name__}: {str(e).strip().splitlines()[0][:200]})"
    try:
        gen = {90: "gen_cutlass_fused_moe_sm90_module", 100: "gen_cutlass_fused_moe_sm100_module",
               103: "gen_cutlass_fused_moe_sm103_module"}[arch]
        spec = getattr(jit_moe, gen)()
        compiled = spec.is_compiled
    except Exception as e:  # noqa: BLE001
        return f"flashinfer {flashinfer.__version__}: its sm{arch} MoE module cannot be described ({type(e).__name__}: {e})"
    if not compiled and not _jit_allowed():
        return (f"flashinfer {flashinfer.__version__}: its sm{arch} fused-MoE module {spec.name} is not built (no AOT or "
                f"JIT-cache copy) and building it takes minutes of nvcc; set {JIT_ENV}=1 to let the arm build it")
    return None


@dataclass(frozen=True)
class FlashInferNVFP4:
    """One layer's NVFP4 experts in FlashInfer's row order, scales linear (before the swizzle).

    fc1          uint8 [E, 2I, H/2]            up (w3) rows, then gate (w1) rows; E2M1, low nibble = even element
    fc1_scale    float8_e4m3fn [E, 2I, H/16]
    fc1_scale_2  float32 [E]                   one for gate and up (FlashInfer has one GEMM1 alpha per expert)
    fc2          uint8 [E, H, I/2]
    fc2_scale    float8_e4m3fn [E, H, I/16]
    fc2_scale_2  float32 [E]
    value = e2m1 x E4M3 x scale_2, the ModelOpt tensors' values bit for bit.
    """

    fc1: torch.Tensor
    fc1_scale: torch.Tensor
    fc1_scale_2: torch.Tensor
    fc2: torch.Tensor
    fc2_scale: torch.Tensor
    fc2_scale_2: torch.Tensor

    @classmethod
    def from_modelopt(cls, tensors: ModelOptMoETensors) -> "FlashInferNVFP4":
        """From the layer's ModelOpt NVFP4 tensors; ValueError when an expert's gate and up
        scale_2 differ (one alpha per expert: folding the ratio into E4M3 scales is not exact)."""
        from k3nvfp4.kernels.moe_details.weights import gate_up_scale_2

        w13, s13, s13_2, w2, s2, s2_2 = tensors
        s13, s2 = _e4m3(s13), _e4m3(s2)
        E, I = w13.shape[0], w13.shape[1] // 2
        g_u = gate_up_scale_2(s13_2, E).float()
        differ = int((g_u[:, 0] != g_u[:, 1]).sum())
        if differ:
            raise ValueError(f"{differ} expert(s) have gate scale_2 != up scale_2; FlashInfer's NVFP4 MoE has one "
                             "GEMM1 alpha per expert")
        return cls(_up_then_gate(w13, I), _up_then_gate(s13, I), g_u[:, 0].contiguous(), w2.contiguous(),
                   s2.contiguous(), s2_2.reshape(E).float().contiguous())

    def to(self, device) -> "FlashInferNVFP4":
        return FlashInferNVFP4(*(getattr(self, f).to(device) for f in
                                 ("fc1", "fc1_scale", "fc1_scale_2", "fc2", "fc2_scale", "fc2_scale_2")))


def swizzled_scales(scale: torch.Tensor) -> torch.Tensor:
    """E4M3 [E, rows, K/16] -> CUTLASS's 128 x 4 block-scale layout, uint8 [E, R, C] with R = rows
    padded to 128 and C = K/16 padded to 4 (zeros), what FlashInfer's CUTLASS NVFP4 MoE reads.

    CUTLASS's scale atom (``Sm1xxBlkScaledConfig::SfAtom``, K-major): rows ((32, 4) : (16, 4)),
    scale columns (4 : 1), 512 bytes per 128 x 4 tile, tiles row-major over (R/128, C/4). So scale
    (r, c) lands at byte ((r // 128) * (C / 4) + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4
    + c % 4 of its expert; the result is that buffer shaped [E, R, C] (a reshape/permute, any device)."""
    E, rows, cols = scale.shape
    R, C = -(-rows // 128) * 128, -(-cols // 4) * 4
    padded = torch.zeros(E, R, C, dtype=torch.uint8, device=scale.device)
    padded[:, :rows, :cols] = scale.view(torch.uint8) if scale.dtype != torch.uint8 else scale
    # [E, R/128, 4 (row quarter), 32 (row in quarter), C/4, 4] -> [E, R/128, C/4, 32, 4, 4]
    tiles = padded.reshape(E, R // 128, 4, 32, C // 4, 4).permute(0, 1, 4, 3, 2, 5)
    return tiles.contiguous().reshape(E, R, C)


@dataclass(frozen=True)
class PreparedSM100:
    """What ``cutlass_fused_moe`` reads on SM100 (NVFP4 x NVFP4), built once per layer.

    fc1 int64 [E, 2I, H/16], fc2 int64 [E, H, I/16] (the nibbles, 16 per int64); fc1_scales int32
    [E, 2I padded to 128, H/64], fc2_scales int32 [E, H padded to 128, I/64] (swizzled E4M3 viewed as
    int32); fc1_scale_2 / fc2_scale_2 float32 [E]; act2_global float32 0-dim, the intermediate's
    global scale; situ_beta / situ_linear_beta float32 [E] (None for SiLU)."""

    fc1: torch.Tensor
    fc2: torch.Tensor
    fc1_scales: torch.Tensor
    fc2_scales: torch.Tensor
    fc1_scale_2: torch.Tensor
    fc2_scale_2: torch.Tensor
    act2_global: torch.Tensor
    activation: GatedActivation
    situ_beta: torch.Tensor | None
    situ_linear_beta: torch.Tensor | None


def prepare_sm100(w: FlashInferNVFP4, activation: GatedActivation) -> PreparedSM100:
    """The SM100 tensors from :class:`FlashInferNVFP4` on its device (plain torch: runs on CPU too)."""
    E, dev = w.fc1.shape[0], w.fc1.device
    beta, lin = _situ_tensors(activation, E, dev)
    bound = activation.bound  # the intermediate's bound (None for SiLU: a global scale of 1)
    act2 = torch.tensor(E2M1_X_E4M3_MAX / bound if bound else 1.0, dtype=torch.float32, device=dev)
    return PreparedSM100(w.fc1.view(torch.int64), w.fc2.view(torch.int64),
                         swizzled_scales(w.fc1_scale).view(torch.int32), swizzled_scales(w.fc2_scale).view(torch.int32),
                         w.fc1_scale_2, w.fc2_scale_2, act2, activation, beta, lin)


def sm100_call_kwargs(p: PreparedSM100, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                      out: torch.Tensor | None, routed_scaling_factor: float = 1.0) -> dict[str, Any]:
    """Keyword arguments of one ``cutlass_fused_moe`` call on SM100 (NVFP4 x NVFP4, bf16 in and out).

    quant_scales (the binding's FP4 order): [input global scale (0-dim, 448 * 6 / amax(x), on the
    device), fc1 block scales, fc1 alpha = scale_2 / input global scale (per expert), the
    intermediate's global scale, fc2 block scales, fc2 alpha = scale_2 / intermediate global scale].
    FlashInfer quantizes x * global scale to NVFP4 and multiplies each GEMM's output by its alpha."""
    amax = x.abs().amax().float().clamp(min=torch.finfo(torch.float32).tiny)
    act1 = (E2M1_X_E4M3_MAX / amax).reshape(())
    kw: dict[str, Any] = dict(
        input=x, token_selected_experts=topk_ids.to(torch.int32).contiguous(),
        token_final_scales=(topk_weights.float() * routed_scaling_factor).contiguous(),
        fc1_expert_weights=p.fc1, fc2_expert_weights=p.fc2, output_dtype=torch.bfloat16,
        quant_scales=[act1, p.fc1_scales, (p.fc1_scale_2 / act1).contiguous(), p.act2_global, p.fc2_scales,
                      (p.fc2_scale_2 / p.act2_global).contiguous()],
        output=out, activation_type=_activation_type(p.activation),
    )
    if p.activation.kind is ActivationKind.SITU:
        kw.update(situ_beta=p.situ_beta, situ_linear_beta=p.situ_linear_beta)
    return kw


def _jit_allowed() -> bool:
    return os.environ.get(JIT_ENV, "") not in ("", "0")


class FlashInferMoE:
    """``run(x, topk_weights, topk_ids, out=None) -> [M, H]`` through ``cutlass_fused_moe``: SM90 W4A16
    from :class:`FlashInferMXFP4`, SM100 NVFP4 x NVFP4 from :class:`FlashInferNVFP4`."""

    def __init__(self, weights: FlashInferMXFP4 | FlashInferNVFP4, activation: GatedActivation,
                 routed_scaling_factor: float = 1.0) -> None:
        if isinstance(weights, FlashInferMXFP4):
            self.prepared, self._kwargs = prepare_sm90(weights, activation), sm90_call_kwargs
        else:
            self.prepared, self._kwargs = prepare_sm100(weights, activation), sm100_call_kwargs
        self.routed_scaling_factor = routed_scaling_factor

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        from flashinfer.fused_moe import cutlass_fused_moe

        res = cutlass_fused_moe(**self._kwargs(self.prepared, x.to(torch.bfloat16).contiguous(), topk_weights,
                                               topk_ids, out, self.routed_scaling_factor))
        return res[0] if isinstance(res, (list, tuple)) else res


def flashinfer_weights(tensors: ModelOptMoETensors, device: torch.device) -> FlashInferMXFP4 | FlashInferNVFP4:
    """The experts (the layer's ModelOpt NVFP4 tensors) in the form the GPU's path takes (SM90:
    MXFP4; SM100/SM103: NVFP4), on ``device``. Raises E8M0RecoveryError (SM90, experts not exactly
    MXFP4) or ValueError (SM100, gate/up scale_2)."""
    if target.capability(device)[0] == 10:
        return FlashInferNVFP4.from_modelopt(tensors).to(device)
    return FlashInferMXFP4.from_modelopt(tensors).to(device)


def _e4m3(scale: torch.Tensor) -> torch.Tensor:
    """E4M3 block scales as float8_e4m3fn (SGLang may hold their uint8 bits)."""
    return scale.view(torch.float8_e4m3fn) if scale.dtype == torch.uint8 else scale
