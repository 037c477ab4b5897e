"""Tensor comparison metrics of the layer A/B (one arm's output `a` against a baseline `b`).

All computed in float64 from the arms' outputs (bf16/fp16 values are exact in float64):
- max_abs_err = max |a - b|
- rel_err (normwise) = ||a - b||_F / ||b||_F
- cosine = <a, b> / (||a|| ||b||) over the flattened tensors
- beyond_2ulp = share of elements with |a - b| > 2 ulp_bf16(|b|), where ulp_bf16(x) is the gap
  between consecutive bf16 numbers at x: 2^(floor(log2 x) - 7) for normal x, 2^-133 below the
  smallest normal (zeros included). Two correct bf16 roundings of the same fp32 value differ
  by at most 1 ulp, so elements beyond 2 ulp point at real numerical differences.
- per expert e: the same errors over the output rows of the tokens routed to e (a token with
  top-k experts appears under each of them - an attribution by grouping, not an isolated test).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

BF16_MANTISSA_BITS = 7
_MIN_NORMAL_EXP = -126


def ulp_bf16(x: torch.Tensor) -> torch.Tensor:
    """ulp of bf16 at |x| (float64 result, same shape)."""
    ax = x.double().abs()
    _, e = torch.frexp(ax)  # |x| = m * 2^e, m in [0.5, 1): floor(log2|x|) = e - 1
    # Subnormals and zero (frexp gives e = 0 there) share the smallest normal's ulp.
    e = torch.where(ax == 0, _MIN_NORMAL_EXP, torch.clamp(e - 1, min=_MIN_NORMAL_EXP))
    return torch.exp2((e - BF16_MANTISSA_BITS).double())


@dataclass
class ExpertError:
    expert: int
    tokens: int
    rel_err: float
    max_abs_err: float


@dataclass
class PairMetrics:
    """Errors of arm `a` against arm `b` (b is the baseline of relative errors and ulps)."""

    a: str
    b: str
    max_abs_err: float
    rel_err: float
    cosine: float
    beyond_2ulp: float
    elements: int
    exact_match: float  # share of bitwise-equal elements
    worst_experts: list[ExpertError] = field(default_factory=list)
    per_expert: list[ExpertError] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def compare_outputs(a: torch.Tensor, b: torch.Tensor, topk_ids: torch.Tensor, num_experts: int, *,
                    name_a: str = "a", name_b: str = "b", worst: int = 5) -> PairMetrics:
    """Metrics of output a [M, H] against baseline b [M, H]; topk_ids [M, k] groups rows by expert."""
    if a.shape != b.shape:
        raise ValueError(f"compare_outputs: {name_a} has shape {tuple(a.shape)}, {name_b} has {tuple(b.shape)}")
    a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
    d = (a64 - b64).abs()
    nb = b64.norm()
    na = a64.norm()
    rel = float(d.norm() / nb) if nb > 0 else (0.0 if d.norm() == 0 else float("inf"))
    cos = float((a64 * b64).sum() / (na * nb)) if na > 0 and nb > 0 else (1.0 if na == nb else 0.0)
    beyond = float((d > 2 * ulp_bf16(b64)).double().mean()) if d.numel() else 0.0
    ids = topk_ids.detach().long().cpu()
    per = []
    for e in range(num_experts):
        rows = (ids == e).any(dim=1)
        n = int(rows.sum())
        if n == 0:
            continue
        de, be = d[rows], b64[rows]
        nbe = be.norm()
        per.append(ExpertError(e, n, float(de.norm() / nbe) if nbe > 0 else float(de.norm()), float(de.max())))
    worst_list = sorted(per, key=lambda x: x.rel_err, reverse=True)[:worst]
    return PairMetrics(name_a, name_b, float(d.max()) if d.numel() else 0.0, rel, cos, beyond, d.numel(),
                       float((a64 == b64).double().mean()) if d.numel() else 1.0, worst_list, per)
