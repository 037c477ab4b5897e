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
keys, e.g. "1", "64") to MoEConfig field dicts. They are read from the directory in
``K3NVFP4_MOE_CONFIG_DIR`` when set, else from ``kernels/configs/`` of this package.
:func:`get_moe_config` takes the config of the nearest tuned batch size (in log space,
and only within 4x of M), else :func:`heuristic_moe_config`.
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

CONFIG_DIR_ENV = "K3NVFP4_MOE_CONFIG_DIR"
DEFAULT_CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"
# H200: 132 SMs. Used only by the heuristic to decide when the grid is too small.
_DEFAULT_NUM_SMS = 132
# A tuned batch size further than this factor from M is not trusted for M.
_MAX_TUNED_DISTANCE = 4
# Above this size of the deterministic path's fp32 [split_k2, M*k, H] buffer the heuristic reduces with atomics.
_MAX_PAIR_BUFFER_BYTES = 512 << 20


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

    @classmethod
    def from_dict(cls, d: dict) -> "MoEConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"MoEConfig: unknown keys {sorted(unknown)} (known: {sorted(known)})")
        return cls(**d)


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


@functools.lru_cache(maxsize=16)
def current_device_name(device=None) -> str:
    """CUDA device name as used in config file names (spaces -> '_', like SGLang), or 'cpu'."""
    import torch

    if not torch.cuda.is_available():
        return "cpu"
    return torch.cuda.get_device_name(device).replace(" ", "_")


@functools.lru_cache(maxsize=16)
def current_arch(device=None) -> int:
    """CUDA compute capability x 10 of the current device (90 = H100/H200), 90 without a GPU."""
    import torch

    if not torch.cuda.is_available():
        return 90
    major, minor = torch.cuda.get_device_capability(device)
    return 10 * major + minor


def config_file_name(E: int, H: int, I: int, device_name: str) -> str:
    """File name of the tuned configs of one shape on one device (SGLang style)."""
    return f"E={E},N={I},H={H},device_name={device_name},dtype=nvfp4.json"


def config_dir() -> pathlib.Path:
    """Directory searched for tuned configs: $K3NVFP4_MOE_CONFIG_DIR, else kernels/configs/."""
    env = os.environ.get(CONFIG_DIR_ENV)
    return pathlib.Path(env) if env else DEFAULT_CONFIG_DIR


@functools.lru_cache(maxsize=256)
def _load_configs_cached(path: str, mtime_ns: int) -> dict[int, MoEConfig]:
    with open(path) as f:
        raw = json.load(f)
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object mapping batch sizes to configs")
    out: dict[int, MoEConfig] = {}
    for key, value in raw.items():
        try:
            m = int(key)
        except ValueError as e:
            raise ValueError(f"{path}: key {key!r} is not a batch size") from e
        try:
            out[m] = MoEConfig.from_dict(value)
        except (TypeError, ValueError) as e:
            raise ValueError(f"{path}: batch size {key}: {e}") from e
    return out


def load_moe_configs(E: int, H: int, I: int, device_name: str, directory=None) -> dict[int, MoEConfig] | None:
    """Tuned configs {batch size: MoEConfig} of a shape and device, or None when no file exists."""
    path = pathlib.Path(directory) if directory is not None else config_dir()
    path = path / config_file_name(E, H, I, device_name)
    try:  # one stat per call (this runs on every fused_moe_nvfp4 call without a config)
        st = path.stat()
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return _load_configs_cached(str(path), st.st_mtime_ns)


def _largest_dividing(k: int, options: tuple[int, ...]) -> int:
    """The largest block in options that divides k (no masked K tail), else the smallest."""
    for b in sorted(options, reverse=True):
        if k % b == 0:
            return b
    return min(options)


def heuristic_moe_config(
    E: int, H: int, I: int, top_k: int, M: int, num_sms: int = _DEFAULT_NUM_SMS, arch: int | None = None
) -> MoEConfig:
    """Default config when nothing is tuned, chosen from the static SASS report
    (bench/sass_report.py, sm90): every choice below keeps the hot K loop at <= 0.10
    warp-instructions per weight for block_m <= 64 (<= 0.12 at 128) and spills nothing.

    - block_m from the mean tokens per expert (M * top_k / E): 16 up to 16, 32 up to 64, 64 up
      to 512, else 128. block_m 128 runs the weights as the MMA's B operand (no swap-AB: a
      [rows, 128 tokens] accumulator pair would spill), which costs more instructions per
      weight and pays back only with several full 128-token blocks per expert.
    - swap_ab (weights on the MMA M side, from registers) for block_m <= 64.
    - GEMM1: block_n1 = 128 (256 weight rows per program: gate + up), block_k1 = 256 for
      block_m <= 32 (128 at block_m 64: the accumulators need the registers), 8 warps (2
      warpgroups of 64 weight rows each: no warp decodes a weight twice); at block_m 128,
      64 x 256 (the larger tiles spill on Triton 3.6).
    - GEMM2: block_n2 = 256; block_k2 the largest of 256 / 128 / 64 dividing I (no masked
      tail: K3's TP16 shard has I = 192), capped at 128 for block_m >= 64; 4 warps with
      block_k2 = 64 at block_m <= 32 (each warp then owns 64 rows, halving the per-iteration
      overhead; at block_m 64 that would spill), else 8. On Blackwell (arch >= 100: the
      weights go through shared memory to tcgen05) block_k2 <= 128, where 256 spills, and at
      block_m 32 with block_k2 128 the GEMM2 tile is 128 x 128 on 4 warps (256 wide spills in
      the epilogue there). At block_m 128 sm100's GEMM2 keeps 256 x 128 with 48 spilled bytes,
      outside the K loop (128 wide would cost 26% more instructions per weight).
    - arch: compute capability x 10 (None: the current device's, 90 without a GPU).
    - split-K when the expected number of programs (active experts x column tiles) is below
      2 x num_sms: enough K slices to reach it, capped at 8 and at K / block_k. Split-K adds no
      launch (the last K slice finishes the tile), so it is allowed at decode sizes.
    - atomic_reduce (fp32 atomics into [M, H], one memset more) only when the deterministic
      path's fp32 [split_k2, M*k, H] buffer would exceed 512 MiB (large prefill batches).
    """
    pairs = max(M * top_k, 1)
    per_expert = pairs / max(E, 1)
    if per_expert <= 16:
        block_m = 16
    elif per_expert <= 64:
        block_m = 32
    elif per_expert <= 512:
        block_m = 64
    else:
        block_m = 128
    swap = block_m <= 64
    active_blocks = min(E, pairs) + pairs // block_m
    # block_m 128 (no swap-AB): 64 x 256 tiles, the only GEMM1 shape at 128 tokens that spills on
    # neither Triton 3.6 nor 3.8.
    block_n1 = 64 if block_m == 128 else 128
    block_k1 = _largest_dividing(H, (256, 128, 64) if block_m != 64 else (128, 64))
    block_n2 = 256
    if arch is None:
        arch = current_arch()
    block_k2 = _largest_dividing(I, (256, 128, 64) if block_m <= 32 and arch < 100 else (128, 64))
    warps2 = 4 if block_k2 == 64 and block_m <= 32 else 8
    if arch >= 100 and block_m == 32 and block_k2 == 128:
        # sm100: 256 x 128 tiles at 32 tokens spill (the top-k epilogue); 128 x 128 on 4 warps
        # does not and issues fewer instructions per weight (bench/results/sass-sm100.json).
        block_n2, warps2 = 128, 4

    def split(k_dim: int, block_k: int, tiles: int) -> int:
        s = 1
        while tiles * s < 2 * num_sms and s < 8 and (s * 2) * block_k <= k_dim:
            s *= 2
        return s

    split_k1 = split(H, block_k1, active_blocks * -(-I // block_n1))
    split_k2 = split(I, block_k2, active_blocks * -(-H // block_n2))
    return MoEConfig(
        block_m=block_m,
        swap_ab=swap,
        block_n1=block_n1,
        block_k1=block_k1,
        split_k1=split_k1,
        num_warps1=8,
        num_stages1=3,
        block_n2=block_n2,
        block_k2=block_k2,
        split_k2=split_k2,
        num_warps2=warps2,
        num_stages2=3,
        atomic_reduce=split_k2 * pairs * H * 4 > _MAX_PAIR_BUFFER_BYTES,
    )


def get_moe_config(
    E: int, H: int, I: int, top_k: int, M: int, device_name: str | None = None, directory=None,
    arch: int | None = None,
) -> MoEConfig:
    """Config for one call: the tuned config of the nearest batch size when a file exists for
    (E, H, I, device), else :func:`heuristic_moe_config` (for ``arch``, None = this device's)."""
    if device_name is None:
        device_name = current_device_name()
    tuned = load_moe_configs(E, H, I, device_name, directory)
    if tuned:
        # Nearest in log space: a partly tuned file must not hand M=1's config to M=16384.
        m = max(M, 1)
        nearest = min(tuned, key=lambda t: (abs(math.log2(max(t, 1) / m)), t))
        if max(nearest, m) <= _MAX_TUNED_DISTANCE * min(max(nearest, 1), m):
            return tuned[nearest]
    return heuristic_moe_config(E, H, I, top_k, M, arch=arch)
