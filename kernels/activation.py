"""The gated activation of the routed experts as one value: :class:`GatedActivation`.

Every MoE signature (the Triton families, their torch references, the torch_reference backend),
the plugin, the tuner and the A/B arms take this one value; its names come from one enum,
:class:`ActivationKind`, so an unknown name is refused where it is parsed (``ValueError`` naming
the name and the known ones) instead of silently running another activation.

  situ: g' = beta x tanh(g / beta) x sigmoid(g); u' = linear_beta x tanh(u / linear_beta)
        (u when linear_beta is None); out = g' x u'   (Kimi-K3's SiTU)
  silu: out = g x sigmoid(g) x u                       (SiLU-and-mul; beta, linear_beta unused)

with gate g = the first I columns of GEMM1's output (w1) and up u = the second I (w3).

No Triton and no tensor code here: the torch math is kernels/situ.py, the Triton epilogue
kernels/moe_details/activation.py, which both read the kernel id from this module.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

# Kernel ids of the ACT constexpr of GEMM1's epilogue (moe_details/activation.py gated_act).
ACT_SITU = 0
ACT_SILU = 1

# SGLang's SiTU default when gemm1_alpha is unset (SituAndMul), and Kimi-K3's config values.
DEFAULT_SITU_BETA = 4.0
K3_SITU_LINEAR_BETA = 25.0

# NVFP4's largest block value: e2m1 6 x e4m3 448. A static per-row scale bound / (6 x 448) maps
# the activation's bound onto the largest representable block.
_NVFP4_MAX = 6.0 * 448.0


class ActivationKind(str, enum.Enum):
    """The gated activations the kernels implement; ``.value`` is the name SGLang / configs use."""

    SITU = "situ"
    SILU = "silu"

    @property
    def kernel_id(self) -> int:
        """The ACT constexpr of GEMM1's epilogue."""
        return ACT_SITU if self is ActivationKind.SITU else ACT_SILU


ACTIVATION_NAMES: tuple[str, ...] = tuple(k.value for k in ActivationKind)


def activation_kind(name: str | ActivationKind, what: str = "activation") -> ActivationKind:
    """The kind named ``name``; ValueError naming ``what`` and the known names for any other."""
    if isinstance(name, ActivationKind):
        return name
    try:
        return ActivationKind(name)
    except ValueError:
        raise ValueError(f"{what}: expected one of {', '.join(ACTIVATION_NAMES)}, got {name!r}") from None


@dataclass(frozen=True)
class GatedActivation:
    """One gated activation with its parameters.

    kind: ActivationKind (a name is accepted and checked); beta: SiTU's gate scale (> 0, finite);
    linear_beta: SiTU's cap of the up branch (> 0, finite) or None (no cap). silu has no
    parameters: its value is always GatedActivation.silu() (beta 4.0, linear_beta None, unread).
    """

    kind: ActivationKind = ActivationKind.SITU
    beta: float = DEFAULT_SITU_BETA
    linear_beta: float | None = K3_SITU_LINEAR_BETA

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", activation_kind(self.kind))
        if self.kind is ActivationKind.SILU:  # one value per activation: silu has no parameters
            object.__setattr__(self, "beta", DEFAULT_SITU_BETA)
            object.__setattr__(self, "linear_beta", None)
            return
        object.__setattr__(self, "beta", _positive(self.beta, "beta"))
        if self.linear_beta is not None:
            object.__setattr__(self, "linear_beta", _positive(self.linear_beta, "linear_beta"))

    @classmethod
    def situ(cls, beta: float = DEFAULT_SITU_BETA, linear_beta: float | None = K3_SITU_LINEAR_BETA) -> "GatedActivation":
        return cls(ActivationKind.SITU, beta, linear_beta)

    @classmethod
    def silu(cls) -> "GatedActivation":
        return cls(ActivationKind.SILU, DEFAULT_SITU_BETA, None)

    @classmethod
    def parse(cls, name: str, beta: float | None = None,
              linear_beta: float | None = K3_SITU_LINEAR_BETA) -> "GatedActivation":
        """From a name and its parameters: beta None = not set (SGLang's 4.0), linear_beta None =
        no cap (a config that does not set it passes None); silu ignores both. The defaults give
        Kimi-K3's situ(4, 25). ValueError naming an unknown name."""
        kind = activation_kind(name)
        if kind is ActivationKind.SILU:
            return cls.silu()
        return cls(kind, DEFAULT_SITU_BETA if beta is None else beta, linear_beta)

    @property
    def name(self) -> str:
        return self.kind.value

    @property
    def kernel_id(self) -> int:
        """The ACT constexpr of GEMM1's epilogue."""
        return self.kind.kernel_id

    @property
    def has_linear_beta(self) -> bool:
        """True where the up branch is capped (the HAS_LINEAR_BETA constexpr)."""
        return self.kind is ActivationKind.SITU and self.linear_beta is not None

    def kernel_args(self) -> tuple[float, float]:
        """(beta, linear_beta) as the kernels' fp32 arguments (linear_beta 1.0 where unused)."""
        return float(self.beta), float(self.linear_beta) if self.has_linear_beta else 1.0

    @property
    def bound(self) -> float | None:
        """B with |out| < B for every input, or None where there is none (silu, uncapped situ).
        Capped SiTU: |beta tanh(g/beta) sigmoid(g)| < beta and |linear_beta tanh(u/linear_beta)|
        < linear_beta, so B = beta x linear_beta (100 for K3)."""
        if not self.has_linear_beta:
            return None
        return self.beta * self.linear_beta

    @property
    def nvfp4_static_scale(self) -> float | None:
        """The static NVFP4 row scale bound / (6 x 448) of the intermediate (no block can overflow
        E4M3), or None where the activation has no bound."""
        b = self.bound
        return None if b is None else b / _NVFP4_MAX

    def describe(self) -> str:
        """For logs and reports: "situ(beta=4, linear_beta=25)" / "silu"."""
        if self.kind is ActivationKind.SILU:
            return "silu"
        return f"situ(beta={self.beta:g}, linear_beta={'none' if self.linear_beta is None else format(self.linear_beta, 'g')})"


def _positive(v, name: str) -> float:
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise TypeError(f"GatedActivation.{name}: expected a number, got {type(v).__name__}") from None
    if not (f > 0 and math.isfinite(f)):
        raise ValueError(f"GatedActivation.{name}: must be a finite number > 0, got {f}")
    return f


K3_SITU = GatedActivation.situ()  # Kimi-K3's activation: situ, beta 4, linear_beta 25


def as_gated_activation(activation: object, what: str = "activation") -> GatedActivation:
    """``activation`` itself when it is a GatedActivation; TypeError naming ``what`` otherwise
    (a bare name carries no parameters: GatedActivation.parse(name, beta, linear_beta))."""
    if isinstance(activation, GatedActivation):
        return activation
    hint = f" (GatedActivation.parse({activation!r}, beta, linear_beta))" if isinstance(activation, str) else ""
    raise TypeError(f"{what}: expected a GatedActivation{hint}, got {type(activation).__name__}")
