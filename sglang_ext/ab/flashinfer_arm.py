"""FlashInfer's fused MoE with SiTU: an arm of the layer A/B and a peer of bench/bench_moe.py.

Where it runs (installed FlashInfer 0.7.x, read from its sources):

- SM90 (Hopper): ``flashinfer.fused_moe.cutlass_fused_moe`` W4A16, MXFP4 weights x bf16
  activations (``use_w4_group_scaling=True``, uint8 weights: the binding's ``isWFP4A16Quant``),
  ``activation_type=ActivationType.Situ`` with per-expert ``situ_beta`` / ``situ_linear_beta``
  (float32 [E]; the CUTLASS ``SituAdaptor``) or ``ActivationType.Swiglu`` for SiLU. It needs
  H and I multiples of 128 (the K3 EP shards: H 3584, I 3072; not TP16's I = 192), bf16
  activations only, and MXFP4 weights: E2M1 nibbles with one E8M0 scale per 32 along K.
- SM100 (Blackwell): FlashInfer's SiTU paths there are NVFP4 x NVFP4 (W4A4: ``cutlass_fused_moe``
  with NVFP4 weights, and the K3-TP8-only ``backend="cake"``); this arm, a W4A16 comparison, does
  not drive them: ``not available`` with that reason (never another path in its place).
- anything else: ``not available: <reason>``.

FlashInfer issue 4597 reports that the SM90 MXFP4 path could silently run another activation in
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

The weights come from the layer's NVFP4 tensors: value = e2m1 x E4M3 scale (per 16) x scale_2 is
MXFP4 exactly when each 32-block's two E4M3 scales are one power of two 2^j and scale_2 is 2^m;
the E8M0 byte is then j + m + 127 (:func:`k3nvfp4.kernels.moe_fp4_details.weights.recover_e8m0`).
That holds for the MXFP4 release and its cast; random NVFP4 experts are not MXFP4, and the arm
says so. Nothing is re-quantized.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

if TYPE_CHECKING:
    from k3nvfp4.kernels import NVFP4MoEWeights

SM90_SHAPE_MULTIPLE = 128  # H and I (isProfileShapeSupported / prepare_cutlass_w4a16_weights)
MXFP4_USE = "FlashInfer's SM90 W4A16 MoE (MXFP4 weights, one E8M0 scale per 32)"


class FlashInferUnavailable(RuntimeError):
    """FlashInfer's MoE cannot run here; the message is the reason."""


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
    def from_nvfp4(cls, weights: NVFP4MoEWeights) -> "FlashInferMXFP4":
        """From the kernels' weights (bit-exact ModelOpt tensors via ``to_modelopt``); raises
        E8M0RecoveryError when the experts are not exactly MXFP4 (naming the first bad block)."""
        from k3nvfp4.kernels.moe_details.weights import gate_up_scale_2
        from k3nvfp4.kernels.moe_fp4_details.weights import recover_e8m0

        w13, s13, s13_2, w2, s2, s2_2 = weights.to_modelopt()
        E, I, H = weights.num_experts, weights.intermediate_size, weights.hidden_size
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
    activation: str
    situ_beta: torch.Tensor | None
    situ_linear_beta: torch.Tensor | None


def prepare_sm90(w: FlashInferMXFP4, activation: str, situ_beta: float | None, situ_linear_beta: float | None,
                 *, interleave_weights: Callable[[torch.Tensor], torch.Tensor] | None = None) -> PreparedSM90:
    """The SM90 tensors from :class:`FlashInferMXFP4` on its device. ``interleave_weights``
    defaults to FlashInfer's CUDA ``interleave_moe_weights_for_sm90_mixed_gemm(w, "fp4")``; tests on
    CPU pass the identity to check everything else (shapes, dtypes, scales, activation tensors)."""
    if interleave_weights is None:
        from flashinfer.fused_moe import interleave_moe_weights_for_sm90_mixed_gemm

        def interleave_weights(t: torch.Tensor) -> torch.Tensor:
            return interleave_moe_weights_for_sm90_mixed_gemm(t, "fp4")

    E, dev = w.num_experts, w.fc1.device
    beta = lin = None
    if activation == "situ":
        beta = torch.full((E,), 4.0 if situ_beta is None else float(situ_beta), dtype=torch.float32, device=dev)
        lin = torch.full((E,), float(situ_linear_beta), dtype=torch.float32, device=dev)
    return PreparedSM90(interleave_weights(w.fc1), interleave_weights(w.fc2),
                        interleaved_scales(w.fc1_e8m0).view(torch.int32), interleaved_scales(w.fc2_e8m0).view(torch.int32),
                        activation, beta, lin)


def sm90_call_kwargs(p: PreparedSM90, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                     out: torch.Tensor | None, routed_scaling_factor: float = 1.0) -> dict[str, Any]:
    """Keyword arguments of one ``flashinfer.fused_moe.cutlass_fused_moe`` call (SM90 W4A16).

    x bf16 [M, H]; topk_weights float [M, k]; topk_ids int [M, k], local ids, -1 = not local (the
    kernels skip ids outside [0, E)); out bf16 [M, H] or None. routed_scaling_factor is folded into
    the top-k weights (the call has no such argument)."""
    from flashinfer.fused_moe import ActivationType

    kw: dict[str, Any] = dict(
        input=x, token_selected_experts=topk_ids.to(torch.int32).contiguous(),
        token_final_scales=(topk_weights.float() * routed_scaling_factor).contiguous(),
        fc1_expert_weights=p.fc1, fc2_expert_weights=p.fc2, output_dtype=torch.bfloat16,
        quant_scales=[p.fc1_scales, p.fc2_scales], use_w4_group_scaling=True, output=out,
        activation_type=ActivationType.Situ if p.activation == "situ" else ActivationType.Swiglu,
    )
    if p.activation == "situ":
        kw.update(situ_beta=p.situ_beta, situ_linear_beta=p.situ_linear_beta)
    return kw


def sm90_layer_reason(dtype: torch.dtype, hidden_size: int, intermediate_size: int, activation: str,
                      situ_linear_beta: float | None) -> str | None:
    """Why the SM90 W4A16 path cannot take this layer (dtype, shape, activation), or None."""
    if dtype != torch.bfloat16:
        return f"FlashInfer's SM90 W4A16 MoE takes bf16 activations only, not {dtype}"
    bad = [f"{n} = {v}" for n, v in (("H", hidden_size), ("I", intermediate_size)) if v % SM90_SHAPE_MULTIPLE]
    if bad:
        return (f"FlashInfer's SM90 W4A16 MoE needs H and I multiples of {SM90_SHAPE_MULTIPLE} (the K3 EP shards; "
                f"not TP16's I = 192): {', '.join(bad)}")
    if activation not in ("situ", "silu"):
        return f"activation {activation!r}: this arm runs SiTU or SiLU"
    if activation == "situ" and situ_linear_beta is None:
        return "SiTU without linear_beta: FlashInfer's CUTLASS SiTU always caps the up branch (no encoding for none)"
    return None


def unavailable_reason(device: torch.device, dtype: torch.dtype, hidden_size: int, intermediate_size: int,
                       activation: str, situ_linear_beta: float | None) -> str | None:
    """Why FlashInfer's SiTU MoE cannot run this layer on ``device``, or None when it can be tried.
    Checks what needs no FlashInfer import first (the device), so a CPU run never imports it."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return (f"no CUDA device (device {device}, torch.cuda.is_available() = {torch.cuda.is_available()}); "
                "FlashInfer's fused MoE runs CUDA kernels")
    major, minor = torch.cuda.get_device_capability(device)
    if major == 10:
        return (f"sm{major}{minor}: FlashInfer's Blackwell SiTU MoE is NVFP4 x NVFP4 (W4A4: cutlass_fused_moe with "
                "NVFP4 weights, or backend='cake' for the K3 TP8 shard only); this arm drives the SM90 W4A16 "
                "MXFP4 path and does not substitute another one")
    if (major, minor) != (9, 0):
        return f"sm{major}{minor}: FlashInfer's W4A16 MXFP4 MoE (cutlass_fused_moe, use_w4_group_scaling) is SM90 only"
    why = sm90_layer_reason(dtype, hidden_size, intermediate_size, activation, situ_linear_beta)
    if why:
        return why
    try:
        import flashinfer
        from flashinfer.fused_moe import cutlass_fused_moe  # noqa: F401
        from flashinfer.jit.fused_moe import gen_cutlass_fused_moe_sm90_module
    except Exception as e:  # noqa: BLE001 - any import failure makes the arm unavailable
        return f"flashinfer does not import ({type(e).__name__}: {str(e).strip().splitlines()[0][:200]})"
    try:
        spec = gen_cutlass_fused_moe_sm90_module()
        compiled = spec.is_compiled
    except Exception as e:  # noqa: BLE001
        return f"flashinfer {flashinfer.__version__}: its SM90 MoE module cannot be described ({type(e).__name__}: {e})"
    if not compiled and not _jit_allowed():
        return (f"flashinfer {flashinfer.__version__}: its SM90 fused-MoE module {spec.name} is not built (no AOT or "
                f"JIT-cache copy) and building it takes minutes of nvcc; set {JIT_ENV}=1 to let the arm build it")
    return None


JIT_ENV = "K3NVFP4_FLASHINFER_JIT"


def _jit_allowed() -> bool:
    import os

    return os.environ.get(JIT_ENV, "") not in ("", "0")


class FlashInferMoE:
    """``run(x, topk_weights, topk_ids, out=None) -> [M, H]`` through ``cutlass_fused_moe`` (SM90)."""

    def __init__(self, weights: FlashInferMXFP4, activation: str, situ_beta: float | None,
                 situ_linear_beta: float | None, routed_scaling_factor: float = 1.0) -> None:
        self.prepared = prepare_sm90(weights, activation, situ_beta, situ_linear_beta)
        self.routed_scaling_factor = routed_scaling_factor

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        from flashinfer.fused_moe import cutlass_fused_moe

        res = cutlass_fused_moe(**sm90_call_kwargs(self.prepared, x.to(torch.bfloat16).contiguous(), topk_weights,
                                                   topk_ids, out, self.routed_scaling_factor))
        return res[0] if isinstance(res, (list, tuple)) else res
