"""The arms of the layer A/B. Each arm turns an NVFP4 MoE layer into a callable
`run(hidden_states, topk_weights, topk_ids) -> [M, H]`, or raises ArmUnavailable with the
reason. An unavailable arm is reported as such and never replaced by another one. ``ARMS`` (at the
end) is the one registry: name -> builder, the arms its output is compared with, and whether it
runs by default; a new arm is a builder and one line there.

- reference:   k3nvfp4.kernels.fused_moe_nvfp4_reference (plain torch, W4A16; always runs)
- triton_situ: k3nvfp4.kernels.fused_moe_nvfp4 (Triton; CUDA, or the interpreter on CPU) on the
               layer's weights: the NVFP4 checkpoint's, or the MXFP4 release's read directly
- triton_situ_cast: (MXFP4 layers only) the same kernels on the closed-form cast of those experts,
               i.e. what serving the k3nvfp4-cast checkpoint computes
- triton_situ:nvfp4 / triton_situ:mxfp8: the FP4 tensor-core modes (fused_moe_nvfp4 on the
               mode's FP4MMAWeights, prepared from the layer's checkpoint tensors - the ModelOpt
               tensors, or the MXFP4 release's - never from another arm's layout: W4A4 NVFP4
               activations / W4A8 MXFP8 activations against MXFP4 weights, native on Blackwell,
               decomposed elsewhere); their error against the reference and triton_situ is the
               accuracy cost of quantizing the activations
- triton_situ:e4m3: the Hopper W4A8 mode (fused_moe_nvfp4 on W4A8MoEWeights prepared from the
               layer's checkpoint tensors: E2M1 expanded exactly to E4M3, E4M3 activations with
               an fp32 scale per token per 128 columns, FP8 MMA; sm89 / sm90 or newer, or the
               interpreter); NVFP4 layers need power-of-two block scales (the cast's), else "not
               available" with the reason. Compared with the reference, triton_situ (W4A16) and
               triton_situ:mxfp8 (the other W4A8 numerics, K3's native)
- marlin:      SGLang's NVFP4 marlin MoE (sgl_kernel): weights repacked as
               ModelOptNvFp4FusedMoEMethod.process_weights_after_loading does for the marlin
               backend (w13 scale_2 collapsed to the gate column, then
               prepare_moe_nvfp4_layer_for_marlin), run through fused_marlin_moe with the
               arguments of SGLang's marlin MoE runner (gemm1_alpha = SiTU beta,
               clamp_limit = linear beta). For an MXFP4 layer marlin gets the cast's NVFP4
               tensors (SGLang's NVFP4 marlin; the release itself is served by its MXFP4
               marlin path, with the same values for every block inside the cast's window).
- flashinfer:  FlashInfer's fused MoE with SiTU (flashinfer_arm.py): on SM90 cutlass_fused_moe W4A16
               with the layer's experts as MXFP4 (recovered exactly from its NVFP4 tensors, which
               needs MXFP4-exact experts: the release or its cast), H and I multiples of 128 (the
               K3 EP shards); on SM100/SM103 cutlass_fused_moe NVFP4 x NVFP4 (W4A4) on the NVFP4
               experts; elsewhere "not available: <reason>". Its error against the reference is
               how a user sees whether FlashInfer ran SiTU (FlashInfer #4597).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

import torch

from k3nvfp4.kernels import target
from k3nvfp4.kernels.activation import ActivationKind

if TYPE_CHECKING:
    from k3nvfp4.checkpoint.layer import NVFP4MoELayer

RunFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# An arm's builder: (layer, device, activation dtype) -> (run, notes), or ArmUnavailable.
BuildFn = Callable[["NVFP4MoELayer", torch.device, torch.dtype], "tuple[RunFn, list[str]]"]


class ArmUnavailable(RuntimeError):
    """This arm cannot run here; the message is the reason shown in the report."""


def build_reference(ex: NVFP4MoELayer, device: torch.device, dtype: torch.dtype) -> tuple[RunFn, list[str]]:
    from k3nvfp4.kernels import fused_moe_nvfp4_reference

    w, kw = ex.weights.to(device), ex.activation_kwargs()
    return (lambda x, tw, ids: fused_moe_nvfp4_reference(x, w, tw, ids, **kw)), []


def _cast_weights(ex: NVFP4MoELayer):
    if ex.cast_weights is None:
        raise ArmUnavailable("the layer is NVFP4 already (no MXFP4 source to cast); this arm compares the MXFP4 "
                             "release read directly with its k3nvfp4-cast")  # fmt: skip
    return ex.cast_weights


def build_triton_situ(ex: NVFP4MoELayer, device: torch.device, dtype: torch.dtype, *,
                      cast: bool = False) -> tuple[RunFn, list[str]]:  # fmt: skip
    """fused_moe_nvfp4 (W4A16) on the layer's weights, or (``cast``) on the cast of its MXFP4 experts."""
    from k3nvfp4.kernels.interpreter import kernels_interpreted

    if device.type != "cuda" and not kernels_interpreted():
        raise ArmUnavailable(f"Triton kernels need a CUDA device; tensors are on {device} and TRITON_INTERPRET "
                             "is not set (set TRITON_INTERPRET=1 before triton is imported to run on CPU)")
    from k3nvfp4.kernels import fused_moe_nvfp4

    w, kw = (_cast_weights(ex) if cast else ex.weights).to(device), ex.activation_kwargs()
    notes = []
    if cast:
        notes.append("weights: the closed-form cast of the MXFP4 experts (what k3nvfp4-cast writes)")
    elif ex.source_format == "mxfp4":
        notes.append("weights: the MXFP4 release read directly (NVFP4MoEWeights.from_mxfp4, no cast)")
    if device.type != "cuda":
        # No word on timing here: the arm is not timed in the interpreter, which the timing column says.
        notes.append("Triton interpreter on CPU (fp32 dots)")
        if dtype != torch.float32:
            notes.append("The interpreter truncates fp32 -> bf16/fp16 casts where the reference rounds to nearest, "
                         "so the 16-bit intermediate differs by up to 1 ulp: expect rel err ~5e-3 vs the reference "
                         "here, not a kernel defect (with --dtype float32 the two agree to ~5e-7)")
    return (lambda x, tw, ids: fused_moe_nvfp4(x, w, tw, ids, **kw)), notes


def build_triton_situ_fp4(ex: NVFP4MoELayer, device: torch.device, dtype: torch.dtype,
                          act_quant: str) -> tuple[RunFn, list[str]]:  # fmt: skip
    """fused_moe_nvfp4 on the mode's weights, prepared once from the layer's checkpoint tensors
    (kernels/modes.py); a mode the installed Triton or the weights cannot do is ArmUnavailable
    with the reason (never another mode)."""
    from k3nvfp4.kernels.interpreter import kernels_interpreted

    if device.type != "cuda" and not kernels_interpreted():
        raise ArmUnavailable(f"Triton kernels need a CUDA device; tensors are on {device} and TRITON_INTERPRET is not set")
    from k3nvfp4.kernels import fused_moe_nvfp4
    from k3nvfp4.kernels.modes import MODES
    from k3nvfp4.kernels.moe_fp4 import E8M0RecoveryError, check_fp4_mode_supported

    if ex.tensors is None:
        raise ArmUnavailable("the layer carries no checkpoint tensors to prepare this mode's weights from")
    try:
        check_fp4_mode_supported(act_quant, device)
        w = MODES[act_quant].prepare(ex.tensors).to(device)
    except E8M0RecoveryError as e:
        raise ArmUnavailable(f"mxfp8 needs E8M0-representable weight scales: {e}") from None
    except (RuntimeError, NotImplementedError) as e:
        raise ArmUnavailable(str(e)) from None
    kw = ex.activation_kwargs()
    notes = [f"act_quant={act_quant}: " + ("W4A4, NVFP4 activations (dynamic per-token scale) and NVFP4 intermediate"
                                            if act_quant == "nvfp4" else
                                            "W4A8, MXFP8 activations and intermediate against MXFP4 weights (K3's native numerics)")]  # fmt: skip
    if device.type == "cuda" and target.capability(device)[0] != 10:
        notes.append("not a Blackwell GPU: tl.dot_scaled runs decomposed (correctness, not speed)")
    return (lambda x, tw, ids: fused_moe_nvfp4(x, w, tw, ids, **kw)), notes


def build_triton_situ_e4m3(ex: NVFP4MoELayer, device: torch.device, dtype: torch.dtype) -> tuple[RunFn, list[str]]:
    """fused_moe_nvfp4 on the e4m3 mode's W4A8MoEWeights, prepared once from the layer's checkpoint
    tensors; a device without FP8 MMA or weights the mode cannot expand exactly (non-power-of-two
    NVFP4 block scales) is ArmUnavailable with the reason. Blocks re-encoded below their row's
    window are counted in the notes."""
    import warnings

    from k3nvfp4.kernels.interpreter import kernels_interpreted

    if device.type != "cuda" and not kernels_interpreted():
        raise ArmUnavailable(f"Triton kernels need a CUDA device; tensors are on {device} and TRITON_INTERPRET is not set")
    from k3nvfp4.kernels import fused_moe_nvfp4
    from k3nvfp4.kernels.modes import MODES
    from k3nvfp4.kernels.moe_w4a8 import check_w4a8_supported

    if ex.tensors is None:
        raise ArmUnavailable("the layer carries no checkpoint tensors to prepare this mode's weights from")
    try:
        check_w4a8_supported(device)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the count goes to the notes
            w = MODES["e4m3"].prepare(ex.tensors).to(device)
    except ValueError as e:
        raise ArmUnavailable(f"e4m3 expands only power-of-two block scales exactly: {e}") from None
    except (RuntimeError, NotImplementedError) as e:
        raise ArmUnavailable(str(e)) from None
    kw = ex.activation_kwargs()
    notes = ["act_quant=e4m3: W4A8 on Hopper, E2M1 weights expanded exactly to E4M3, E4M3 activations and "
             "intermediate with an fp32 scale per token per 128 columns",
             f"{w.out_of_window} weight blocks lie more than 14 binades below their row's largest "
             f"({w.rounded} of them changed by their re-encoding)",
             f"E4M3 tables: w13 {w.w13_table}, w2 {w.w2_table}"]
    return (lambda x, tw, ids: fused_moe_nvfp4(x, w, tw, ids, **kw)), notes


def marlin_unavailable_reason(device: torch.device) -> str | None:
    """Why the marlin arm cannot run on `device`, or None when it can be tried."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return (f"no CUDA device (device {device}, torch.cuda.is_available() = {torch.cuda.is_available()}); "
                "SGLang's NVFP4 marlin MoE runs sgl_kernel CUDA kernels")
    try:
        import sgl_kernel  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure makes the arm unavailable
        return f"sgl_kernel does not import ({type(e).__name__}: {str(e).strip().splitlines()[0][:200]})"
    try:
        from sglang.srt.layers.moe.fused_moe_triton.fused_marlin_moe import fused_marlin_moe  # noqa: F401
        from sglang.srt.layers.quantization.marlin_utils_fp4 import prepare_moe_nvfp4_layer_for_marlin  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"sglang's marlin MoE does not import ({type(e).__name__}: {str(e)[:200]})"
    return None


def build_marlin(ex: NVFP4MoELayer, device: torch.device, dtype: torch.dtype) -> tuple[RunFn, list[str]]:
    if dtype not in (torch.bfloat16, torch.float16):
        raise ArmUnavailable(f"marlin runs bf16/fp16 activations, not {dtype}")
    reason = marlin_unavailable_reason(device)
    if reason:
        raise ArmUnavailable(reason)
    activation = ex.activation()  # ValueError for a name the kernels do not know (the report says so)
    from types import SimpleNamespace

    from sglang.srt.layers.moe.fused_moe_triton.fused_marlin_moe import fused_marlin_moe
    from sglang.srt.layers.quantization.marlin_utils import marlin_make_workspace
    from sglang.srt.layers.quantization.marlin_utils_fp4 import prepare_moe_nvfp4_layer_for_marlin

    mx = ex.source_format == "mxfp4"
    if ex.modelopt_tensors() is None:
        raise ArmUnavailable("the layer carries no ModelOpt tensors to prepare marlin's weights from")
    w13, w13_s, w13_s2, w2, w2_s, w2_s2 = (t.to(device) for t in ex.modelopt_tensors())
    notes = ["SGLang's NVFP4 marlin on the cast of the MXFP4 experts (SGLang serves the release with its MXFP4 "
             "marlin path: the same values for every block inside the cast's window)"] if mx else []  # fmt: skip
    # Marlin has one global scale for w1 and w3; SGLang keeps the gate column (and warns).
    differ = int((w13_s2[:, 0] != w13_s2[:, 1]).sum())
    if differ:
        notes.append(f"{differ} expert(s) have gate scale_2 != up scale_2; marlin uses the gate value for both "
                     "(as SGLang does), so its up half is mis-scaled there")
    layer = torch.nn.Module()
    P = lambda t: torch.nn.Parameter(t.contiguous(), requires_grad=False)  # noqa: E731
    layer.w13_weight, layer.w2_weight = P(w13.clone()), P(w2.clone())
    layer.w13_weight_scale, layer.w2_weight_scale = P(w13_s.clone()), P(w2_s.clone())
    layer.w13_weight_scale_2, layer.w2_weight_scale_2 = P(w13_s2[:, 0].clone()), P(w2_s2.clone())
    layer.moe_runner_config = SimpleNamespace(is_gated=True)
    layer.intermediate_size_per_partition = ex.weights.intermediate_size
    layer.params_dtype = dtype
    prepare_moe_nvfp4_layer_for_marlin(layer, group_size=16)
    E = ex.weights.num_experts
    situ = activation.kind is ActivationKind.SITU
    clamp = activation.linear_beta if situ else None
    alpha = activation.beta if situ else None

    def run(x: torch.Tensor, tw: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        return fused_marlin_moe(
            hidden_states=x.contiguous(), w1=layer.w13_weight, w2=layer.w2_weight,
            w1_scale=layer.w13_weight_scale, w2_scale=layer.w2_weight_scale,
            gating_output=torch.empty(x.shape[0], E, dtype=x.dtype, device=x.device),
            topk_weights=tw, topk_ids=ids.to(torch.int32),
            w1_global_scale=layer.w13_weight_scale_2, w2_global_scale=layer.w2_weight_scale_2,
            workspace=marlin_make_workspace(x.device, max_blocks_per_sm=4), num_bits=4, is_k_full=True,
            inplace=False, routed_scaling_factor=ex.routed_scaling_factor, clamp_limit=clamp, gemm1_alpha=alpha,
            activation=activation.name, is_gated=True,
        ).to(x.dtype)

    return run, notes


def build_flashinfer(ex: NVFP4MoELayer, device: torch.device, dtype: torch.dtype) -> tuple[RunFn, list[str]]:
    """FlashInfer's SiTU MoE (flashinfer_arm): SM90 W4A16 on the experts as MXFP4, SM100 NVFP4 x NVFP4 on
    them as they are; where it cannot run, or the experts do not have the form it takes,
    ArmUnavailable with the reason."""
    from k3nvfp4.kernels.moe_fp4 import E8M0RecoveryError

    from .flashinfer_arm import FlashInferMoE, FlashInferMXFP4, flashinfer_weights, unavailable_reason

    w, activation = ex.weights, ex.activation()
    reason = unavailable_reason(device, dtype, w.hidden_size, w.intermediate_size, activation)
    if reason:
        raise ArmUnavailable(reason)
    if ex.modelopt_tensors() is None:
        raise ArmUnavailable("the layer carries no ModelOpt tensors to prepare FlashInfer's weights from")
    try:
        fw = flashinfer_weights(ex.modelopt_tensors(), device)
    except E8M0RecoveryError as e:
        raise ArmUnavailable(f"the experts are not exactly MXFP4 ({e})") from None
    except ValueError as e:
        raise ArmUnavailable(str(e)) from None
    run = FlashInferMoE(fw, activation, ex.routed_scaling_factor)
    import flashinfer

    if isinstance(fw, FlashInferMXFP4):
        path = ("cutlass_fused_moe W4A16 (SM90): the layer's experts as MXFP4 (E8M0 per 32 recovered exactly from "
                "the NVFP4 tensors), bf16 activations")
    else:
        path = ("cutlass_fused_moe NVFP4 x NVFP4 (SM100, W4A4): the layer's NVFP4 experts, activations quantized to "
                "NVFP4 by FlashInfer (global scale 448*6/amax(x) per call); compare with triton_situ:nvfp4")
    act = ("ActivationType.Situ with per-expert situ_beta / situ_linear_beta; whether it ran SiTU is its error "
           "against the reference (FlashInfer #4597)" if activation.kind is ActivationKind.SITU else "SwiGLU (SiLU)")
    return (lambda x, tw, ids: run(x, tw, ids)), [f"flashinfer {flashinfer.__version__} {path}; {act}"]


@dataclass(frozen=True)
class Arm:
    """One arm of the layer A/B: how it is built, which arms its output is compared with (``a vs
    b`` rows of the report, the reference first), and whether it runs without --arms
    (``default``: "always", "mxfp4" for MXFP4 layers only, or "no")."""

    build: BuildFn
    compare_with: tuple[str, ...] = ("reference",)
    default: str = "no"


def _fp4_mode(act_quant: str) -> BuildFn:
    return lambda ex, device, dtype: build_triton_situ_fp4(ex, device, dtype, act_quant)


# Every arm, by name (the order of the report). A new arm: its builder above and one line here.
ARMS: dict[str, Arm] = {
    "reference": Arm(build_reference, compare_with=(), default="always"),
    "triton_situ": Arm(build_triton_situ, ("reference", "triton_situ_cast", "marlin", "flashinfer"), "always"),
    "triton_situ_cast": Arm(lambda ex, device, dtype: build_triton_situ(ex, device, dtype, cast=True),
                            default="mxfp4"),
    "triton_situ:nvfp4": Arm(_fp4_mode("nvfp4"), ("reference", "triton_situ")),
    "triton_situ:mxfp8": Arm(_fp4_mode("mxfp8"), ("reference", "triton_situ")),
    "triton_situ:e4m3": Arm(build_triton_situ_e4m3, ("reference", "triton_situ", "triton_situ:mxfp8")),
    "marlin": Arm(build_marlin, default="always"),
    "flashinfer": Arm(build_flashinfer, default="always"),
}
ARM_NAMES = tuple(ARMS)


def default_arms(ex: NVFP4MoELayer) -> tuple[str, ...]:
    """The arms a layer A/B runs when --arms is not given."""
    wanted = ("always", "mxfp4") if ex.source_format == "mxfp4" else ("always",)
    return tuple(name for name, arm in ARMS.items() if arm.default in wanted)


def arm_pairs() -> list[tuple[str, str]]:
    """(a, b) pairs compared where both ran: every arm against the reference, then the others."""
    first = [(a, "reference") for a, arm in ARMS.items() if "reference" in arm.compare_with]
    return first + [(a, b) for a, arm in ARMS.items() for b in arm.compare_with if b != "reference"]


def build_arm(name: str, ex: NVFP4MoELayer, device: torch.device, dtype: torch.dtype) -> tuple[RunFn, list[str]]:
    """Callable and notes of arm `name`; raises ArmUnavailable (reason) or ValueError (unknown name)."""
    arm = ARMS.get(name)
    if arm is None:
        raise ValueError(f"unknown arm {name!r}; choose from {', '.join(ARM_NAMES)}")
    return arm.build(ex, device, dtype)
