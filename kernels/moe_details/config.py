"""Launch configurations of the fused NVFP4 MoE kernels, and the tuned-config lookup.

Knobs of :class:`MoEConfig` (the tuner's search space; every field is a real kernel knob):

- ``block_m``      tokens per program. Also the routing alignment: each expert's token list is
                   padded to a multiple of ``block_m``. Shared by GEMM1 and GEMM2. {16, 32, 64, 128}.
- ``swap_ab``      put tokens on the MMA N side (compute W @ X^T): the weight rows fill the MMA M
                   side (>= 64 on Hopper wgmma) while a tiny per-expert token count sits on N (16).
                   Use for decode (block_m <= 32). Both GEMMs.
- ``block_n1``     GEMM1 output columns per program, per half: the program computes gate AND up
                   for these columns (2 * block_n1 weight rows). {16, 32, 64, 128}.
- ``block_k1``     GEMM1 reduction step over H: whole 64-element K tiles of the weight layout
                   (16 bytes per lane), or half a tile (32). {32, 64, 128, 256}.
- ``split_k1``     GEMM1 split over H. > 1 writes fp32 partial sums [split_k1, pad, 2I]; the last
                   K slice of a tile to finish sums them in slice order and applies the
                   activation (same launch, deterministic). {1, 2, 4, 8}.
- ``num_warps1``, ``num_stages1``: Triton launch knobs of GEMM1.
- ``block_n2``     GEMM2 output columns (of H) per program. {16, 32, 64, 128, 256, 512}.
- ``block_k2``     GEMM2 reduction step over I, as block_k1. {32, 64, 128, 256}.
- ``split_k2``     GEMM2 split over I: per-slice fp32 rows summed by the token's last arrival in
                   a fixed order (deterministic; same launch), or atomics with ``atomic_reduce``.
- ``num_warps2``, ``num_stages2``: Triton launch knobs of GEMM2.
- ``atomic_reduce`` GEMM2 reduction over top-k: False = each (K slice, token, slot) row is stored
                   to an fp32 [split_k2, M*k, H] buffer and summed in GEMM2's epilogue by the
                   token's last arrival in slot order (deterministic, bitwise reproducible);
                   True = fp32 atomic adds into [M, H] (less memory traffic at large M; a memset
                   more per call; summation order not fixed).

Tuned configs are JSON files named in the style of SGLang's fused_moe_triton configs::

    E={E},N={I},H={H},device_name={device_name},dtype=nvfp4.json

(``N`` is the per-shard intermediate size I, as in SGLang), mapping batch sizes (string
keys, e.g. "1", "64") to MoEConfig field dicts. They are looked up in :func:`config_dirs`, first
match wins: ``$K3NVFP4_MOE_CONFIG_DIR`` when set, else the per-user directory
(``$XDG_CONFIG_HOME/k3nvfp4/moe_configs``, default ``~/.config/k3nvfp4/moe_configs``), then the
configs shipped in ``kernels/configs/`` of this package (read only: the tuner never writes into the
installed package; it writes to ``--out-dir``, else :func:`config_dir`).
:func:`get_moe_config` takes the config of the nearest tuned batch size (in log space,
and only within 4x of M), else :meth:`MoEConfig.heuristic`.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import pathlib
import stat
from dataclasses import dataclass

from ..costs import Tile, tile_cost
from ..target import current_arch, current_device_name

CONFIG_DIR_ENV = "K3NVFP4_MOE_CONFIG_DIR"
DEFAULT_CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"
# A tuned batch size further than this factor from M is not trusted for M.
_MAX_TUNED_DISTANCE = 4
# Above this size of the deterministic path's fp32 [split_k2, M*k, H] buffer the heuristic reduces with atomics.
_MAX_PAIR_BUFFER_BYTES = 512 << 20
# Candidates within _TIE of the fastest predicted time tie (fewest warp-instructions wins); those
# within the loop budget win over faster ones only up to _BUDGET_SLACK. A stricter preference
# would trade time for a per-pass count: at M = 1024 the 16-token tiles that meet 0.09 per pass
# stream each expert twice (0.145 per useful weight, 3-5 % slower), and at prefill on sm_100 the
# in-budget tiles were predicted 10-38 % slower.
_TIE = 1.01
_BUDGET_SLACK = 1.02


def _near(scored: list, slack: float) -> list:
    """The entries of (time, ...) tuples within ``slack`` x the fastest time."""
    fastest = min(s[0] for s in scored)
    return [s for s in scored if s[0] <= slack * fastest]


def _prefer(scored: list, in_budget) -> list:
    """The in-budget entries within _BUDGET_SLACK of the fastest (empty if none)."""
    return [s for s in _near(scored, _BUDGET_SLACK) if in_budget(s)]


def config_from_dict(config_type: type, d: dict):
    """A launch-config dataclass (MoEConfig, W4A8Config) from one tuned-file entry; unknown keys
    are refused by name (a file written for another mode or version)."""
    known = {f.name for f in dataclasses.fields(config_type)}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"{config_type.__name__}: unknown keys {sorted(unknown)} (known: {sorted(known)})")
    return config_type(**d)


@dataclass(frozen=True)
class MoEConfig:
    """Block sizes and launch knobs of the two MoE GEMMs (see the module docstring)."""

    block_m: int = 16
    swap_ab: bool = True
    block_n1: int = 64
    block_k1: int = 128
    split_k1: int = 1
    num_warps1: int = 4
    num_stages1: int = 3
    block_n2: int = 64
    block_k2: int = 128
    split_k2: int = 1
    num_warps2: int = 4
    num_stages2: int = 3
    atomic_reduce: bool = False

    def __post_init__(self) -> None:
        def pow2(name: str, lo: int) -> None:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo or v & (v - 1):
                raise ValueError(f"MoEConfig.{name}={v!r}: must be a power of two >= {lo}")

        pow2("block_m", 16)
        pow2("block_n1", 16)
        pow2("block_n2", 16)
        pow2("block_k1", 32)  # half a 64-wide K tile of the weight layout at least
        pow2("block_k2", 32)
        pow2("split_k1", 1)
        pow2("split_k2", 1)
        pow2("num_warps1", 1)
        pow2("num_warps2", 1)
        for name in ("num_stages1", "num_stages2"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"MoEConfig.{name}={v!r}: must be an int >= 1")

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def gemm(self, kind: str) -> "GemmLaunch":
        """The knobs GEMM1 ("gemm1") or GEMM2 ("gemm2") compiles with."""
        if kind == "gemm1":
            return GemmLaunch(kind, self.block_m, self.swap_ab, self.block_n1, self.block_k1, self.split_k1,
                              self.num_warps1, self.num_stages1, False)
        if kind == "gemm2":
            return GemmLaunch(kind, self.block_m, self.swap_ab, self.block_n2, self.block_k2, self.split_k2,
                              self.num_warps2, self.num_stages2, self.atomic_reduce)
        raise ValueError(f"kind: expected 'gemm1' or 'gemm2', got {kind!r}")

    def tile(self, kind: str) -> Tile:
        """GEMM1's or GEMM2's tile: its row key in the cost table (a W4A16 row covers both top-k
        reductions and every split-K, so neither is part of it)."""
        g = self.gemm(kind)
        return Tile(kind, g.block_m, g.swap_ab, g.block_n, g.block_k, g.num_warps, g.num_stages)

    @staticmethod
    def cost_mode(scale_format=None) -> str:
        """The cost table's mode of W4A16 weights in a layout.ScaleFormat (None: E5M3_16, NVFP4):
        "w4a16 e5m3/16" or "w4a16 e8m0/32" (kernels/costs.py)."""
        from .layout import E5M3_16

        return f"w4a16 {(scale_format or E5M3_16).name}"

    @classmethod
    def from_dict(cls, d: dict) -> "MoEConfig":
        return config_from_dict(cls, d)

    @classmethod
    def heuristic(cls, E: int, H: int, I: int, top_k: int, M: int, *, num_sms: int | None = None,
                  arch: int | None = None, num_global_experts: int | None = None, scale_format=None) -> "MoEConfig":
        """Default config when nothing is tuned: the fastest under the static performance model
        (perf_model through moe_details/call_model.py) of the tile shapes in :data:`TILES`, with
        the costs measured offline for the architecture and the weights' scale format
        (layout.E5M3_16, the default, or E8M0_32; kernels/costs.py), split-K chosen per GEMM.

        - E: local experts (the weights' leading dimension); num_global_experts: the experts the
          top-k ids range over (None = E: no expert parallelism). Under EP only ~E / E_global of
          the (token, slot) pairs are local, so blocks are sized for the local pairs, not
          M x top_k / E.
        - arch: compute capability x 10 (None: the current device's, 90 without a GPU); the
          device model is the H200 below 100 and the B200 from 100, with num_sms overriding its
          SM count.
        - Tiles that cannot launch (shared memory, registers) or spill are never chosen. Split-K
          is 1 to 16 per GEMM. block_m (shared by both GEMMs) is the one whose call is fastest;
          within 1% of the fastest time the candidate issuing the fewest warp-instructions wins
          (the model's time is bytes-bound at most M; fewer instructions leave issue slack for
          what the model does not see). Candidates within the loop budget
          (perf_model.loop_budget: warp-instructions per useful weight pass, tile padding and K
          tails not useful) win over faster ones that miss it, up to 2% of predicted time: never
          at the price of streaming an expert's weights twice.
        - atomic_reduce (fp32 atomics into [M, H], one memset more) only when the deterministic
          path's fp32 [split_k2, M*k, H] buffer would exceed 512 MiB (large prefill batches).

        Cached per shape: the model runs once, not per call."""
        return _heuristic(E, H, I, top_k, M, num_sms, arch, num_global_experts, scale_format)


@dataclass(frozen=True)
class GemmLaunch:
    """One GEMM's share of a MoEConfig: what its compiled binary depends on (a cache key for
    offline compiles; see MoEConfig.gemm)."""

    kind: str  # "gemm1" (gate + up, SiTU/SiLU epilogue) or "gemm2" (down, top-k combine)
    block_m: int
    swap_ab: bool
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    atomic_reduce: bool  # GEMM2 only

    @property
    def weights_per_iteration(self) -> int:
        """Weight elements one K-loop iteration of a program consumes (GEMM1: gate and up rows)."""
        rows = 2 * self.block_n if self.kind == "gemm1" else self.block_n
        return rows * self.block_k

    def label(self) -> str:
        return (f"bm{self.block_m} {'swap' if self.swap_ab else 'noswap'} bn{self.block_n} bk{self.block_k}"
                f" sk{self.split_k} w{self.num_warps} s{self.num_stages}")


def _tiles() -> tuple[Tile, ...]:
    # (block_m, block_n, block_k, warps). Fewer than 4 warps is no warpgroup: mma.sync with the
    # weights from registers, on sm90 and on sm100 alike (4+ warps use wgmma / tcgen05).
    g1 = [(16, 32, 256, 2), (16, 64, 256, 4), (16, 128, 256, 8), (16, 64, 128, 4), (16, 64, 128, 2),
          (32, 32, 256, 2), (32, 64, 256, 4), (32, 128, 256, 8), (32, 64, 128, 2),
          (64, 64, 128, 4), (64, 128, 128, 8), (64, 32, 256, 2)]
    # (16, 512, 64, 4): 32 words per lane at bk64 halves the per-iteration overhead of K = I = 192 or 384
    # (TP16, TP8), whose 16-word bk64 tiles issue 0.091-0.094 per weight.
    g2 = [(16, 256, 32, 2), (16, 256, 64, 4), (16, 512, 64, 4), (16, 256, 128, 4), (16, 256, 128, 8), (16, 256, 256, 8),
          (16, 128, 64, 4), (16, 128, 128, 4), (16, 256, 64, 2), (16, 256, 128, 2), (16, 128, 128, 2),
          (16, 128, 64, 2),
          (32, 256, 32, 4), (32, 256, 64, 4), (32, 256, 128, 8), (32, 256, 256, 8), (32, 128, 64, 4),
          (32, 128, 128, 4), (32, 128, 64, 2), (32, 64, 256, 2),
          (64, 256, 32, 8), (64, 256, 64, 8), (64, 256, 128, 8), (64, 128, 128, 8), (64, 128, 64, 2)]
    out = [Tile("gemm1", bm, True, bn, bk, w, 3) for bm, bn, bk, w in g1]
    # 128 tokens: weights as the MMA's B operand (no swap); 2 stages keep 64 x 256 under 227 KiB.
    out += [Tile("gemm1", 128, False, 64, 256, 8, 2), Tile("gemm1", 128, False, 64, 128, 8, 3)]
    out += [Tile("gemm2", bm, True, bn, bk, w, 3) for bm, bn, bk, w in g2]
    out += [Tile("gemm2", 128, False, 256, 128, 8, 3), Tile("gemm2", 128, False, 128, 128, 8, 3)]
    return tuple(out)


# The heuristic's tile shapes (its config space besides split-K and the reduction); each has a
# measured row per architecture and scale format in kernels/cost_table.py.
TILES = _tiles()


def config_file_name(E: int, H: int, I: int, device_name: str, dtype: str = "nvfp4") -> str:
    """File name of the tuned configs of one shape on one device (SGLang style). dtype names the
    kernel mode the configs are for: "nvfp4" (W4A16, MoEConfig), "w4a8_e4m3_b16" / "w4a8_e4m3_b32"
    (the Hopper W4A8 mode's W4A8Config, per weight block: moe_w4a8_details/config.py)."""
    return f"E={E},N={I},H={H},device_name={device_name},dtype={dtype}.json"


def user_config_dir() -> pathlib.Path:
    """The per-user directory of tuned configs: $XDG_CONFIG_HOME/k3nvfp4/moe_configs (default
    ~/.config/k3nvfp4/moe_configs)."""
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return pathlib.Path(base) / "k3nvfp4" / "moe_configs"


def config_dir() -> pathlib.Path:
    """Where tuned configs are written by default (the tuner without --out-dir):
    $K3NVFP4_MOE_CONFIG_DIR when set, else :func:`user_config_dir`. Never the installed package."""
    env = os.environ.get(CONFIG_DIR_ENV)
    return pathlib.Path(env) if env else user_config_dir()


def config_dirs() -> tuple[pathlib.Path, ...]:
    """Where tuned configs are looked up, in order: :func:`config_dir`, then the configs shipped
    with the package (kernels/configs/)."""
    return (config_dir(), DEFAULT_CONFIG_DIR)


@functools.lru_cache(maxsize=256)
def _load_configs_cached(path: str, mtime_ns: int, config_type: type) -> dict[int, object]:
    with open(path) as f:
        raw = json.load(f)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object mapping batch sizes to configs")
    out: dict[int, object] = {}
    for key, value in raw.items():
        try:
            m = int(key)
        except ValueError as e:
            raise ValueError(f"{path}: key {key!r} is not a batch size") from e
        try:
            out[m] = config_type.from_dict(value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: batch size {key}: {e}") from e
    return out


def load_tuned_configs(name: str, config_type: type, directory=None) -> dict[int, object] | None:
    """Tuned configs {batch size: config_type} from the file ``name`` (:func:`config_file_name`) in
    ``directory``, else in the first of :func:`config_dirs` that has it; None when none has it.
    config_type: the mode's config class (its ``from_dict`` parses one entry)."""
    for d in (pathlib.Path(directory),) if directory is not None else config_dirs():
        path = d / name
        try:  # a stat or two per call (this runs on every call without a config)
            st = path.stat()
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            return _load_configs_cached(str(path), st.st_mtime_ns, config_type)
    return None


def nearest_tuned(tuned: dict[int, object] | None, M: int):
    """The tuned config of the batch size nearest M in log space, or None when there is none
    within a factor of 4 (a partly tuned file must not hand M=1's config to M=16384)."""
    if not tuned:
        return None
    m = max(M, 1)
    nearest = min(tuned, key=lambda t: (abs(math.log2(max(t, 1) / m)), t))
    return tuned[nearest] if max(nearest, m) <= _MAX_TUNED_DISTANCE * min(max(nearest, 1), m) else None


def load_moe_configs(E: int, H: int, I: int, device_name: str, directory=None) -> dict[int, MoEConfig] | None:
    """Tuned W4A16 configs {batch size: MoEConfig} of a shape and device (:func:`load_tuned_configs`)."""
    return load_tuned_configs(config_file_name(E, H, I, device_name), MoEConfig, directory)


@functools.lru_cache(maxsize=4096)
def _heuristic(E: int, H: int, I: int, top_k: int, M: int, num_sms: int | None, arch: int | None,
               num_global_experts: int | None, scale_format) -> MoEConfig:
    """MoEConfig.heuristic, cached (its docstring says what it picks)."""
    from ..perf_model import B200, H200, Shard, expected_routing, loop_budget
    from .call_model import our_gemm
    from .layout import E5M3_16

    scale_format = scale_format or E5M3_16
    mode = MoEConfig.cost_mode(scale_format)
    if arch is None:
        arch = current_arch()
    device = B200 if arch >= 100 else H200
    if num_sms is not None:
        device = dataclasses.replace(device, sms=num_sms)
    E_global = max(num_global_experts or E, E)
    shard = Shard("call", E, E_global, H, I, top_k)
    pairs = max(M * top_k, 1)
    budget = loop_budget(M)

    def options(kind: str, block_m: int) -> list:
        tiles = []
        for t in TILES:
            if t.kind != kind or t.block_m != block_m:
                continue
            cost = tile_cost(t, arch, mode)
            if cost is None or cost.local_bytes:
                continue
            tiles.append((t, cost))
        # A tile wider than K computes padding only past K, and its K-tail compile (registers,
        # spills) is not the measured one: taken only when no tile fits K. GEMM1 column tiles
        # that cover I exactly come first: padding rows are streamed, not useful work.
        K = H if kind == "gemm1" else I
        tiles = [tc for tc in tiles if tc[0].block_k <= K] or tiles
        if kind == "gemm1":
            tiles = [tc for tc in tiles if I % tc[0].block_n == 0] or tiles
        return tiles

    # The reduction is not the model's to choose: atomics only where even one slice's fp32 rows
    # would not fit, and no split that pushes the rows past the limit.
    atomic = pairs * H * 4 > _MAX_PAIR_BUFFER_BYTES

    def best_gemm(kind: str, block_m: int, routing):
        K = H if kind == "gemm1" else I
        scored = []
        for tile, cost in options(kind, block_m):
            steps = -(-K // tile.block_k)
            for split in (1, 2, 4, 8, 16):
                if split > 1 and -(-steps // split) * (split - 1) >= steps:
                    break  # a slice would be empty
                if kind == "gemm2" and not atomic and split * pairs * H * 4 > _MAX_PAIR_BUFFER_BYTES:
                    break
                launch = GemmLaunch(kind, block_m, tile.swap_ab, tile.block_n, tile.block_k, split,
                                    tile.num_warps, tile.num_stages, kind == "gemm2" and atomic)
                pred = our_gemm(device, shard, M, launch, cost, routing, fmt=scale_format)
                if pred.launchable:
                    scored.append((pred.time_s, pred.warp_instructions, split, launch, pred))
        if not scored:
            return None
        within = _prefer(scored, lambda s: s[4].warp_instr_per_useful_weight <= budget)
        pick = min(within or _near(scored, _TIE), key=lambda s: (s[1], s[2]))
        return (*pick, bool(within))

    calls = []  # (time, both GEMMs within the budget, warp-instructions, launches): time first, for _near
    for block_m in (16, 32, 64, 128):
        routing = expected_routing(shard, M, block_m)
        g1, g2 = best_gemm("gemm1", block_m, routing), best_gemm("gemm2", block_m, routing)
        if g1 is not None and g2 is not None:
            calls.append((g1[0] + g2[0], g1[5] and g2[5], g1[1] + g2[1], g1[3], g2[3]))
    calls = [c for c in calls if I % c[3].block_n == 0] or calls  # as options() for the tiles
    if not calls:
        raise RuntimeError(f"MoEConfig.heuristic: no measured tile launches for E={E}, H={H}, I={I} on sm_{arch}")
    within = _prefer(calls, lambda c: c[1])
    _, _, _, l1, l2 = min(within or _near(calls, _TIE), key=lambda c: c[2])
    return MoEConfig(
        block_m=l1.block_m, swap_ab=l1.swap_ab,
        block_n1=l1.block_n, block_k1=l1.block_k, split_k1=l1.split_k, num_warps1=l1.num_warps,
        num_stages1=l1.num_stages,
        block_n2=l2.block_n, block_k2=l2.block_k, split_k2=l2.split_k, num_warps2=l2.num_warps,
        num_stages2=l2.num_stages, atomic_reduce=l2.atomic_reduce,
    )


def get_moe_config(
    E: int, H: int, I: int, top_k: int, M: int, device_name: str | None = None, directory=None,
    arch: int | None = None, num_global_experts: int | None = None, scale_format=None,
) -> MoEConfig:
    """Config for one call: the tuned config of the nearest batch size when a file exists for
    (E, H, I, device), else :meth:`MoEConfig.heuristic` (for ``arch``, None = this device's;
    num_global_experts: the experts top-k ids range over, None = E)."""
    if device_name is None:
        device_name = current_device_name()
    tuned = nearest_tuned(load_moe_configs(E, H, I, device_name, directory), M)
    if tuned is not None:
        return tuned
    return MoEConfig.heuristic(E, H, I, top_k, M, arch=arch, num_global_experts=num_global_experts,
                               scale_format=scale_format)
