"""One MoE block of SGLang's loaded Kimi-K3 model against the plain-torch reference.

SGLang's ``KimiK3MoE.forward`` runs as served (its router, TopK, latent projections, shared
experts and the routed experts through ``--moe-runner-backend triton_situ``; on CPU the Triton
kernels in the interpreter); its TopK output is captured with a forward hook. The reference
(:mod:`.reference`) recomputes the block from the checkpoint tensors in fp32.

- Routing: SGLang's expert set per token must be a top-k of the reference's selection scores,
  exactly or within ``ROUTING_TIE`` of the k-th score (SGLang rounds router logits to bf16 on
  CPU); its weights must be the reference's for the same experts, routed_scaling_factor
  included (within ``WEIGHT_TOL``).
- Output: normwise error against the reference (routed through SGLang's experts) within
  ``tolerance``. With routed_scaling_factor != 1 the error against the same reference with the
  factor applied zero times or twice is reported too: both must exceed ``DISCRIMINATION``
  tolerances, which proves SGLang applies it exactly once.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .ckpt_reader import CheckpointReader, runtime_name
from .expert_format import ExpertFormat
from .reference import BlockConfig, BlockTensors, Routing, block_reference, route, weights_for

ROUTING_TIE = 2e-2  # selection-score slack for near ties (bf16 router logits)
WEIGHT_TOL = 2e-2  # max |w - w_ref| / max |w_ref|
BF16_TOL = 3e-2  # normwise output error, bf16 activations (interpreter truncates fp32 -> bf16)
# With K3NVFP4_ACT_QUANT set the activations are quantized too: the reference (unquantized
# activations) is then off by the quantization error (kernels/moe_fp4.py; test_moe_fp4 bounds).
ACT_QUANT_TOL = {"none": BF16_TOL, "mxfp8": 8e-2, "nvfp4": 0.15}
DISCRIMINATION = 3.0  # a wrong scaling's reference must lie this many tolerances away


@dataclass
class ForwardResult:
    prefix: str
    tokens: int
    dtype: str
    routed_scaling_factor: float
    act_quant: str  # K3NVFP4_ACT_QUANT of the run
    err: float  # ||out - ref|| / ||ref||
    max_err: float  # max |out - ref| / max |ref|
    err_scaling_applied_0x: float | None
    err_scaling_applied_2x: float | None
    out_rms: float
    ref_rms: float
    routed_rms: float
    shared_rms: float
    routing_exact_tokens: int
    routing_tie_tokens: int
    routing_bad_tokens: int
    weights_max_rel_err: float
    scaling_in_topk_weights: bool  # SGLang folded routed_scaling_factor into the top-k weights
    weights_mean_sum: float
    tolerance: float
    out_sha256: str
    problems: list[str]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def find_block(model: torch.nn.Module, layer: int | None) -> tuple[str, torch.nn.Module]:
    """(runtime prefix, KimiK3MoE) of MoE layer ``layer`` (default: the first MoE layer)."""
    from sglang.srt.models.kimi_k3 import KimiK3MoE

    blocks = [(n, m) for n, m in model.named_modules() if isinstance(m, KimiK3MoE)]
    if not blocks:
        raise ValueError("the model has no KimiK3MoE block")
    if layer is None:
        return blocks[0]
    for name, module in blocks:
        if module.layer_idx == layer:
            return name, module
    raise ValueError(f"--moe-layer {layer}: not a MoE layer of this model (MoE layers: {[m.layer_idx for _, m in blocks]})")


def block_tensors(reader: CheckpointReader, prefix: str, cfg: BlockConfig, fmt: ExpertFormat) -> BlockTensors:
    """Checkpoint tensors of the block at runtime ``prefix`` (checkpoint names via the mapper rules)."""
    rt2ck = {runtime_name(n): n for n in reader.names()}

    def get(suffix: str, required: bool = True) -> torch.Tensor | None:
        name = rt2ck.get(f"{prefix}.{suffix}")
        if name is None:
            if required:
                raise KeyError(f"checkpoint has no tensor for {prefix}.{suffix}")
            return None
        return reader.get(name)

    shared = None
    if f"{prefix}.shared_experts.gate_proj.weight" in rt2ck:
        shared = tuple(get(f"shared_experts.{p}_proj.weight") for p in ("gate", "up", "down"))

    def expert(e: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return tuple(fmt.dequant(get, e, w) for w in ("w1", "w3", "w2"))

    return BlockTensors(
        gate=get("gate.weight"), bias=get("gate.e_score_correction_bias"),
        down=get("routed_expert_down_proj.weight"), up=get("routed_expert_up_proj.weight"),
        latent_norm=get("routed_expert_norm.weight") if cfg.latent_norm_eps is not None else None,
        shared=shared, expert=expert,
    )  # fmt: skip


def _normwise(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def _rms(t: torch.Tensor) -> float:
    return float(t.float().pow(2).mean().sqrt())


def check_routing(sg_ids: torch.Tensor, ref: Routing) -> tuple[int, int, int]:
    """(tokens with exactly the reference's experts, near ties, wrong) for SGLang's ids [T, k]."""
    exact = tie = bad = 0
    kth = ref.selection.topk(sg_ids.shape[1], dim=-1).values[:, -1]
    for t in range(sg_ids.shape[0]):
        if set(sg_ids[t].tolist()) == set(ref.ids[t].tolist()):
            exact += 1
        elif bool((ref.selection[t, sg_ids[t]] >= kth[t] - ROUTING_TIE).all()) and len(set(sg_ids[t].tolist())) == sg_ids.shape[1]:
            tie += 1
        else:
            bad += 1
    return exact, tie, bad


def run_block(block: torch.nn.Module, prefix: str, reader: CheckpointReader, cfg: BlockConfig, fmt: ExpertFormat, *,
              tokens: int, seed: int, dtype: torch.dtype, device: torch.device) -> ForwardResult:  # fmt: skip
    """SGLang's block forward on seeded RMS-1 hidden states vs the reference."""
    from ..act_quant import selected_act_quant

    act_quant = selected_act_quant()
    tol = ACT_QUANT_TOL[act_quant]
    hidden = block.gate.weight.shape[1]
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)
    captured: dict[str, Any] = {}
    hook = block.topk.register_forward_hook(lambda mod, args, out: captured.setdefault("topk", out))
    try:
        with torch.no_grad():
            out = block(x.to(device).clone()).float().cpu()
    finally:
        hook.remove()
    topk = captured.get("topk")
    problems: list[str] = []
    if topk is None:
        raise RuntimeError(f"{prefix}: the block's TopK did not run")
    sg_ids = topk.topk_ids.long().cpu()
    sg_w = topk.topk_weights.float().cpu()

    t = block_tensors(reader, prefix, cfg, fmt)
    logits = x.float() @ t.gate.float().T
    ref_routing = route(logits, t.bias, cfg)
    exact, tie, bad = check_routing(sg_ids, ref_routing)
    if bad:
        problems.append(f"routing: {bad} of {tokens} tokens got experts outside the reference's top-{cfg.top_k}")
    # The reference follows SGLang's expert choice (identical unless near ties), with its own weights.
    w_ref = weights_for(ref_routing.scores, sg_ids, cfg)
    # SGLang folds routed_scaling_factor into the top-k weights for some quant methods (ModelOpt
    # NVFP4 off marlin), else the runner applies it after the sum: compare with what it chose.
    fused = bool(getattr(block.experts, "should_fuse_routed_scaling_factor_in_topk", False))
    w_cmp = w_ref if fused else weights_for(ref_routing.scores, sg_ids, cfg, scale=1.0)
    w_err = float((sg_w - w_cmp).abs().max() / w_cmp.abs().max())
    if w_err > WEIGHT_TOL:
        problems.append(f"routing weights differ from the reference (routed_scaling_factor "
                        f"{cfg.routed_scaling_factor} {'included' if fused else 'not included'}) by {w_err:.3g} > {WEIGHT_TOL}")  # fmt: skip
    ref = block_reference(x, t, cfg, Routing(sg_ids, w_ref, ref_routing.scores, ref_routing.selection))
    err = _normwise(out, ref["out"])
    max_err = float((out - ref["out"]).abs().max() / ref["out"].abs().max())
    rsf = cfg.routed_scaling_factor
    err0 = err2 = None
    if rsf != 1.0:
        err0 = _normwise(out, ref["routed"] / rsf + ref["shared"])
        err2 = _normwise(out, ref["routed"] * rsf + ref["shared"])
        if min(err0, err2) < DISCRIMINATION * tol:
            problems.append(f"routed_scaling_factor {rsf} does not separate: the references with it applied 0x "
                            f"({err0:.3g}) or 2x ({err2:.3g}) are within {DISCRIMINATION} x {tol} of the output")  # fmt: skip
    if not err <= tol:
        problems.append(f"block output differs from the reference: normwise {err:.3g} > {tol} (act_quant {act_quant})")
    return ForwardResult(
        prefix=prefix, tokens=tokens, dtype=str(dtype).removeprefix("torch."), routed_scaling_factor=rsf,
        act_quant=act_quant, err=err, max_err=max_err, err_scaling_applied_0x=err0, err_scaling_applied_2x=err2,
        out_rms=_rms(out), ref_rms=_rms(ref["out"]), routed_rms=_rms(ref["routed"]), shared_rms=_rms(ref["shared"]),
        routing_exact_tokens=exact, routing_tie_tokens=tie, routing_bad_tokens=bad,
        weights_max_rel_err=w_err, scaling_in_topk_weights=fused, weights_mean_sum=float(sg_w.sum(-1).mean()), tolerance=tol,
        out_sha256=hashlib.sha256(out.numpy().tobytes()).hexdigest(), problems=problems,
    )  # fmt: skip
