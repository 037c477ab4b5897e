"""Speed of one arm from the same requests that are graded for accuracy.

- latency: wall time of a request as the client saw it (request sent to body received,
  retries included), percentiles p50 / p90 / p99 by numpy's default linear interpolation
  (the (n-1)*q-th order statistic, interpolated), and the mean;
- output tokens/s per request: the server's own usage.completion_tokens / latency, over the
  requests that report usage and took a positive time (p10 / p50 / p90 and mean);
- aggregate output tokens/s: total completion tokens of the arm / wall span of its requests
  (earliest start to latest end). The arms' requests run side by side, so each arm's span is
  its own, not the run's.

Requests without usage counts are counted (``requests_without_usage``) and left out of the
token figures.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np


@dataclass
class ArmSpeed:
    requests: int
    latency_s: dict[str, float]  # p50, p90, p99, mean
    tokens_per_s_per_request: dict[str, float] | None  # p10, p50, p90, mean; None without usage
    total_completion_tokens: int
    wall_span_s: float
    aggregate_tokens_per_s: float | None
    requests_without_usage: int

    def to_dict(self) -> dict:
        return asdict(self)


def _pct(x: np.ndarray, qs: Sequence[int]) -> dict[str, float]:
    out = {f"p{q}": float(np.percentile(x, q)) for q in qs}
    out["mean"] = float(x.mean())
    return out


def arm_speed(latency_s: Sequence[float], completion_tokens: Sequence[int | None], start_s: Sequence[float],
              end_s: Sequence[float]) -> ArmSpeed:
    """Speed figures of one arm's requests (one entry per request in each sequence; times in s
    on one clock)."""
    lat = np.asarray(latency_s, dtype=np.float64)
    if lat.size == 0 or not (len(completion_tokens) == len(start_s) == len(end_s) == lat.size):
        raise ValueError("arm_speed: needs one latency, token count, start and end per request (and at least one)")
    with_usage = [(t, l) for t, l in zip(completion_tokens, lat) if t is not None]
    rates = np.asarray([t / l for t, l in with_usage if l > 0], dtype=np.float64)
    total = int(sum(t for t, _ in with_usage))
    span = float(max(end_s) - min(start_s))
    return ArmSpeed(int(lat.size), _pct(lat, (50, 90, 99)), _pct(rates, (10, 50, 90)) if rates.size else None, total,
                    span, total / span if with_usage and span > 0 else None, int(lat.size - len(with_usage)))
