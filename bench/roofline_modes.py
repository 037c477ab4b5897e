"""First-principles time of one routed-MoE call per activation mode: B200 (W4A16 / W4A8 MXFP8 /
W4A4 NVFP4) next to H200 (W4A16), for the K3 TP16 and EP16 shards.

Model (a lower bound, no kernel inefficiency): time = max(bytes / HBM bandwidth, FLOPs / MMA peak).
- Weights: every distinct expert the batch touches is read once: 3 * H * I FP4 weights at
  0.5 B + 1/16 B of E4M3 block scales. Distinct experts: E_local * (1 - (1 - k/896)^M) (uniform
  top-16 routing over 896 experts).
- Per (token, expert) route: the activations read once (H elements in the mode's format: bf16
  2 B, MXFP8 1 + 1/32 B, NVFP4 0.5 + 1/16 B), the intermediate written and read once (2 * I
  elements, same format), GEMM2's fp32 row written once (4 * H B; the combine's read is not counted).
- FLOPs: 2 * routes * 3 * H * I on the mode's MMA (bf16, FP8, FP4 dense peaks).
Peaks: B200 8 TB/s, 2.25 / 4.5 / 9 PFLOP/s dense bf16 / FP8 / FP4; H200 4.8 TB/s, 0.989 PFLOP/s bf16.

    python -P bench/roofline_modes.py            # Markdown table on stdout
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

NUM_EXPERTS, TOP_K = 896, 16
B200 = {"bw": 8.0e12, "bf16": 2.25e15, "mxfp8": 4.5e15, "nvfp4": 9.0e15}
H200 = {"bw": 4.8e12, "bf16": 0.989e15}
ACT_BYTES = {"bf16": 2.0, "mxfp8": 1 + 1 / 32, "nvfp4": 0.5 + 1 / 16}
WEIGHT_BYTES = 0.5 + 1 / 16


@dataclass(frozen=True)
class Shard:
    name: str
    local_experts: int
    H: int
    I: int

    def distinct(self, M: int) -> float:
        return self.local_experts * (1 - (1 - TOP_K / NUM_EXPERTS) ** M)

    def routes(self, M: int) -> float:
        return M * TOP_K * self.local_experts / NUM_EXPERTS


SHARDS = (Shard("TP16", 896, 3584, 192), Shard("EP16", 56, 3584, 3072))


def call_time(shard: Shard, M: int, act: str, peaks: dict) -> tuple[float, float]:
    """(memory-bound time, MMA-bound time) in seconds of one call."""
    routes = shard.routes(M)
    weights = shard.distinct(M) * 3 * shard.H * shard.I * WEIGHT_BYTES
    a = ACT_BYTES[act]
    acts = routes * ((shard.H + 2 * shard.I) * a + 4 * shard.H)
    flops = 2 * routes * 3 * shard.H * shard.I
    return (weights + acts) / peaks["bw"], flops / peaks[act]


def table(ms: tuple[int, ...] = (1, 16, 64, 256, 1024, 4096, 16384)) -> str:
    rows = ["| shard | M | B200 W4A16 | B200 W4A8 mxfp8 | B200 W4A4 nvfp4 | best mode vs W4A16 | H200 W4A16 |",
            "|---|---:|---:|---:|---:|---:|---:|"]
    for shard in SHARDS:
        for M in ms:
            cells, times = [], {}
            for act in ("bf16", "mxfp8", "nvfp4"):
                mem, mma = call_time(shard, M, act, B200)
                times[act] = max(mem, mma)
                cells.append(f"{1e6 * times[act]:.1f} us ({'MMA' if mma > mem else 'HBM'})")
            hm, hc = call_time(shard, M, "bf16", H200)
            gain = times["bf16"] / min(times["mxfp8"], times["nvfp4"])
            rows.append(f"| {shard.name} | {M} | " + " | ".join(cells) + f" | {gain:.2f}x | {1e6 * max(hm, hc):.1f} us |")
    return "\n".join(rows)


def main(argv=None) -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    print(table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
