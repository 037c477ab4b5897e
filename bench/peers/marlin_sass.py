"""Static SASS measurement of SGLang's marlin MoE kernel for NVFP4 weights on Hopper (sm_90a).

What is measured: the steady-state main K loop of SGLang 0.5.23's ``Marlin<...>`` MoE kernel
(``sglang/kernels/jit/csrc/gemm/marlin_moe/marlin_template.h``) with bf16 activations, FP4 e2m1
weights (``kFE2M1f``), fp8-e4m3 scales per 16 weights (``group_blocks == 1``) and the per-expert
global scale -- the kernel ``fused_marlin_moe`` runs for an NVFP4 checkpoint on Hopper -- in the
tile configurations SGLang's host heuristic picks for the Kimi-K3 shards (TP16: 896 experts,
H=3584, I=192; EP16: 56 local experts, H=3584, I=3072; top_k=16), for decode (moe_block_size 8)
and for moe_block_size 64. Same figures as ``k3nvfp4.kernels.offline.sass`` reports for our Triton
kernels: warp-instructions of one pass of the K loop per FP4 weight element it consumes, and
the issue-bound ceiling that implies as a fraction of H200 HBM bandwidth.

How: SGLang JIT-compiles marlin from the CUDA sources it ships, so this module writes a small
translation unit under ``build/peers/marlin/`` that #includes SGLang's own
``moe_wna16_marlin.cuh`` from the installed package (nothing of SGLang is copied) and
explicitly instantiates the candidate kernels, compiles it with nvcc to a cubin using the
flags of SGLang's JIT (``-std=c++20 -O3 --expt-relaxed-constexpr -DSGL_CUDA_ARCH=900``,
sm_90a), and disassembles it. Which candidate SGLang launches depends on the kernel's register
count (``determine_exec_config`` asks ``cudaFuncGetAttributes``), so the selection is replayed
here on the compiled registers with an H200 device model (132 SMs, 227 KiB opt-in shared
memory). No GPU is needed.

One pass of marlin's SASS K loop (the runtime ``stage_group_id`` loop inside ``while
(slice_iters)``; its ``pipe`` loop is fully unrolled) consumes ``stages`` K tiles of
``16 * thread_k_blocks`` K rows by ``16 * thread_n_blocks`` N columns of one expert's weight,
which is checked against the HMMA count of the loop.

Rows: one per (regime, shard, launched tile), measured on that shard's GEMM1 instantiation; the
GEMM2 instantiation (which differs only in the kZeroInactiveOutput flag) is reported under
``call_sites``. The counts are static (every instruction of the loop body once, the
``k3nvfp4.kernels.offline.sass`` convention); the body's forward branches guard the pipeline-refill
and A-reload paths, which a steady-state pass executes.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import pathlib
import re
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if str(pathlib.Path(__file__).resolve().parents[1]) not in sys.path:  # run as a script: bench/ holds peers
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from peers import nvcc_cache  # noqa: E402
from peers.nvcc_cache import Build, find_nvcc  # noqa: E402,F401  (find_nvcc: used by marlin/build.py and tests)

if TYPE_CHECKING:
    from k3nvfp4.kernels.offline.sass import Instr, Loop

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
KERNEL = "marlin_moe_nvfp4"

# H200 as SGLang's host code sees it (cudaDevAttrMultiProcessorCount, ...PerBlockOptin).
H200_SMS = 132
H200_MAX_SHARED_MEM_OPTIN = 232448  # 227 KiB

NVFP4_GROUP_SIZE = 16  # one fp8 scale per 16 weights -> group_blocks = 1
DECODE_TOKENS = 1
# Enough tokens that fused_marlin_moe's block-size loop ends at 64 for both shards.
MOE_BLOCK_64_TOKENS = 4096

# Kimi-K3 expert shards: experts held by one rank, hidden H, intermediate I per rank.
# TP32 (I = 96) is absent: no NVFP4 marlin tile divides its GEMM1 N (192) and K tiles at once.
SHARDS: dict[str, dict[str, int]] = {
    "TP8": {"experts": 896, "hidden": 3584, "intermediate": 384, "top_k": 16},
    "TP16": {"experts": 896, "hidden": 3584, "intermediate": 192, "top_k": 16},
    "EP8": {"experts": 112, "hidden": 3584, "intermediate": 3072, "top_k": 16},
    "EP16": {"experts": 56, "hidden": 3584, "intermediate": 3072, "top_k": 16},
    "EP32": {"experts": 28, "hidden": 3584, "intermediate": 3072, "top_k": 16},
}

_SOURCE_FILES = ("marlin_moe/kernel.h", "marlin_moe/marlin_template.h", "marlin_moe/moe_wna16_marlin.cuh",
                 "marlin/marlin.cuh", "marlin/marlin_dtypes.cuh", "marlin/dequant.h")


@dataclass(frozen=True)
class Tile:
    """The tile template parameters of one Marlin instantiation."""

    thread_m_blocks: int
    thread_n_blocks: int
    thread_k_blocks: int
    m_block_size_8: bool
    threads: int

    @property
    def label(self) -> str:
        return (f"thread_m_blocks={self.thread_m_blocks} thread_n={16 * self.thread_n_blocks} "
                f"thread_k={16 * self.thread_k_blocks} threads={self.threads}"
                + (" m_block_size_8" if self.m_block_size_8 else ""))


@dataclass(frozen=True)
class Flags:
    """The specialization flags fused_marlin_moe passes (moe_wna16_marlin.py: _jit_moe_wna16_marlin_module)."""

    is_ep: bool
    has_bias: bool
    expert_ids_are_sorted: bool
    zero_inactive_output: bool
    has_inactive_prefix_count: bool

    @property
    def label(self) -> str:
        return (f"kIsEP={int(self.is_ep)} kHasBias={int(self.has_bias)} "
                f"kExpertIdsAreSorted={int(self.expert_ids_are_sorted)} "
                f"kZeroInactiveOutput={int(self.zero_inactive_output)} "
                f"kHasInactivePrefixCount={int(self.has_inactive_prefix_count)}")


@dataclass(frozen=True)
class CallSite:
    """One moe_wna16_marlin_gemm call of fused_marlin_moe for one shard and regime."""

    shard: str
    gemm: str
    regime: str
    moe_block_size: int
    prob_m: int
    prob_n: int
    prob_k: int
    top_k: int
    flags: Flags

    @property
    def label(self) -> str:
        return f"{self.shard} {self.gemm} (prob_m={self.prob_m}, N={self.prob_n}, K={self.prob_k}, top_k={self.top_k})"


@dataclass(frozen=True)
class Sources:
    """SGLang's marlin MoE sources and the host-side constants read from them."""

    version: str
    gemm_dir: pathlib.Path  # .../sglang/kernels/jit/csrc/gemm
    include_dirs: tuple[pathlib.Path, ...]
    pipe_stages: int
    min_thread_n: int
    min_thread_k: int
    validity_margin: int
    launch_reserve: int
    device_max_reg_size: int
    small_batch_configs: tuple[tuple[int, int, int], ...]  # (thread_k, thread_n, num_threads), by priority
    large_batch_configs: tuple[tuple[int, int, int], ...]
    nvfp4_tiles: frozenset[Tile]  # what get_marlin_kernel instantiates for kFE2M1f, group_blocks 1

    @property
    def marlin_moe_dir(self) -> pathlib.Path:
        return self.gemm_dir / "marlin_moe"


# --------------------------------------------------------------------------- locating the inputs


def _read_int(text: str, name: str, where: str) -> int:
    m = re.search(rf"\b{name}\s*=\s*([0-9 *]+);", text)
    if not m:
        raise RuntimeError(f"cannot read {name} from SGLang's {where}")
    value = 1
    for factor in m.group(1).split("*"):
        value *= int(factor)
    return value


def _read_configs(text: str, name: str) -> tuple[tuple[int, int, int], ...]:
    m = re.search(rf"thread_config_t\s+{name}\[\]\s*=\s*\{{(.*?)\}};", text, re.S)
    if not m:
        raise RuntimeError(f"cannot read {name} from SGLang's moe_wna16_marlin.cuh")
    body = re.sub(r"//[^\n]*", "", m.group(1))
    return tuple((int(a), int(b), int(c)) for a, b, c in re.findall(r"\{\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*\}", body))


def _macro_body(text: str, name: str) -> str:
    m = re.search(rf"#define\s+{name}\s*\([^)]*\)((?:[^\n]*\\\n)*[^\n]*)", text)
    if not m:
        raise RuntimeError(f"cannot find macro {name} in SGLang's moe_wna16_marlin.cuh")
    return m.group(1)


def _read_nvfp4_tiles(text: str) -> frozenset[Tile]:
    """The tiles NVFP4_GET_IF instantiates: its (N_BLOCKS, K_BLOCKS, NUM_THREADS) rows times the
    (thread_m_blocks, m_block_size_8) pairs of the _M1 / _M234 macros with group_blocks 1."""
    sub: dict[str, list[tuple[int, bool]]] = {}
    for macro in ("NVFP4_GET_IF_M1", "NVFP4_GET_IF_M234"):
        rows = re.findall(r"_GET_IF\(\s*W_TYPE\s*,\s*(\d+)\s*,\s*N_BLOCKS\s*,\s*K_BLOCKS\s*,\s*(true|false)\s*,"
                          r"\s*(-?\d+)\s*,\s*NUM_THREADS\s*,\s*false\s*\)", _macro_body(text, macro))
        sub[macro] = [(int(m), mb8 == "true") for m, mb8, gb in rows if gb == "1"]
    tiles = set()
    row = r"(NVFP4_GET_IF_M1|NVFP4_GET_IF_M234)\(\s*W_TYPE\s*,\s*(\d+)\s*,\s*(\d+)\s*,\s*(\d+)\s*\)"
    for macro, n, k, t in re.findall(row, _macro_body(text, "NVFP4_GET_IF")):
        for m, mb8 in sub[macro]:
            tiles.add(Tile(m, int(n), int(k), mb8, int(t)))
    if not tiles:
        raise RuntimeError("cannot read the NVFP4 instantiation list (NVFP4_GET_IF) from SGLang's moe_wna16_marlin.cuh")
    return frozenset(tiles)


def find_sources() -> Sources:
    """SGLang's marlin MoE sources, tvm_ffi's headers, and the host constants; RuntimeError if absent."""
    spec = importlib.util.find_spec("sglang")  # locates without importing (sglang's import is heavy)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("sglang is not installed")
    sglang_dir = pathlib.Path(list(spec.submodule_search_locations)[0])
    jit = sglang_dir / "kernels" / "jit"
    gemm_dir = jit / "csrc" / "gemm"
    missing = [f for f in _SOURCE_FILES if not (gemm_dir / f).is_file()]
    if missing or not (jit / "include" / "sgl_kernel").is_dir():
        raise RuntimeError(f"sglang at {sglang_dir} lacks the marlin MoE JIT sources: "
                           f"{', '.join(missing) or 'kernels/jit/include/sgl_kernel'}")
    tvm = importlib.util.find_spec("tvm_ffi")
    if tvm is None or not tvm.submodule_search_locations:
        raise RuntimeError("tvm_ffi (apache-tvm-ffi, SGLang's JIT dependency) is not installed: its headers are needed")
    tvm_dir = pathlib.Path(list(tvm.submodule_search_locations)[0])
    # What tvm_ffi.libinfo's find_include_path / find_dlpack_include_path return, without importing it.
    tvm_includes = [p for p in (tvm_dir / "include", tvm_dir / "3rdparty" / "dlpack" / "include") if p.is_dir()]
    if not (tvm_dir / "include" / "tvm" / "ffi").is_dir():
        raise RuntimeError(f"tvm_ffi at {tvm_dir} has no include/tvm/ffi headers")

    cuh = (gemm_dir / "marlin_moe" / "moe_wna16_marlin.cuh").read_text()
    marlin = (gemm_dir / "marlin" / "marlin.cuh").read_text()
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return Sources(
        version=version,
        gemm_dir=gemm_dir,
        include_dirs=(jit / "include", gemm_dir / "marlin_moe", *tvm_includes),
        pipe_stages=_read_int(marlin, "pipe_stages", "marlin/marlin.cuh"),
        min_thread_n=_read_int(marlin, "min_thread_n", "marlin/marlin.cuh"),
        min_thread_k=_read_int(marlin, "min_thread_k", "marlin/marlin.cuh"),
        validity_margin=_read_int(cuh, "kSharedMemoryValidityMargin", "moe_wna16_marlin.cuh"),
        launch_reserve=_read_int(cuh, "kSharedMemoryLaunchReserve", "moe_wna16_marlin.cuh"),
        device_max_reg_size=_read_int(cuh, "device_max_reg_size", "moe_wna16_marlin.cuh"),
        small_batch_configs=_read_configs(cuh, "small_batch_thread_configs"),
        large_batch_configs=_read_configs(cuh, "large_batch_thread_configs"),
        nvfp4_tiles=_read_nvfp4_tiles(cuh),
    )


# --------------------------------------------------------------------------- SGLang's host heuristic, replayed


def moe_block_size(tokens: int, top_k: int, experts: int) -> int:
    """fused_marlin_moe.py: fused_marlin_moe's block-size loop (experts = local experts, w1.shape[0])."""
    size = 8
    for size in (8, 16, 32, 48, 64):
        if tokens * top_k / experts / size < 0.9:
            break
    return size


def call_sites() -> list[CallSite]:
    """Both GEMMs of fused_marlin_moe for both shards and both regimes. TP16 passes no expert_map
    (sorted block ids + inactive-prefix count); EP16 passes the dispatcher's local_expert_mapping
    (modelopt_quant.py: get_marlin_quant_info), hence is_ep. GEMM2 also zeros inactive rows."""
    sites = []
    for regime, tokens in (("decode (moe_block 8)", DECODE_TOKENS), ("moe_block 64", MOE_BLOCK_64_TOKENS)):
        for shard, s in SHARDS.items():
            ep = shard.startswith("EP")
            bs = moe_block_size(tokens, s["top_k"], s["experts"])
            want = 8 if regime.startswith("decode") else 64
            if bs != want:
                raise RuntimeError(f"{shard}: {tokens} tokens give moe_block_size {bs}, not {want}")
            for gemm, m, n, k, top_k, zero in (
                ("GEMM1 gate/up", tokens, 2 * s["intermediate"], s["hidden"], s["top_k"], False),
                ("GEMM2 down", tokens * s["top_k"], s["hidden"], s["intermediate"], 1, True),
            ):
                flags = Flags(is_ep=ep, has_bias=False, expert_ids_are_sorted=not ep, zero_inactive_output=zero,
                              has_inactive_prefix_count=not ep)
                sites.append(CallSite(shard, gemm, regime, bs, m, n, k, top_k, flags))
    return sites


def cache_size(src: Sources, thread_k: int, thread_n: int, thread_m_blocks: int) -> int:
    """moe_wna16_marlin.cuh: get_kernel_cache_size (+ get_scales_cache_size) for 4-bit weights,
    group size 16, no act-order, no zero points."""
    pack_factor = 32 // 4
    tb_m = 16 * thread_m_blocks
    sh_meta = tb_m * 4
    sh_a = src.pipe_stages * tb_m * thread_k * 2
    sh_b = src.pipe_stages * (thread_k * thread_n // pack_factor) * 4
    sh_red = tb_m * (thread_n + 8) * 2
    sh_bias = thread_n * 2
    tmp = max(sh_b, sh_red, min(sh_b, sh_red) + sh_bias)
    groups = -(-thread_k // NVFP4_GROUP_SIZE)
    sh_s = groups * thread_n * 2 * src.pipe_stages
    return tmp + sh_a + sh_s + sh_meta


def candidates(src: Sources, site: CallSite) -> list[tuple[Tile, int]]:
    """(tile, cache bytes) of every thread config determine_exec_config would query for this call,
    in its priority order: is_valid_config passes and get_marlin_kernel has an NVFP4 instantiation."""
    m_blocks = -(-site.moe_block_size // 16)
    out = []
    for tk, tn, threads in (src.large_batch_configs if m_blocks > 1 else src.small_batch_configs):
        if site.prob_k % tk or site.prob_n % tn or tn < src.min_thread_n or tk < src.min_thread_k or threads < 128:
            continue
        size = cache_size(src, tk, tn, m_blocks)
        if size + src.validity_margin > H200_MAX_SHARED_MEM_OPTIN:
            continue
        tile = Tile(m_blocks, tn // 16, tk // 16, site.moe_block_size == 8, threads)
        if tile in src.nvfp4_tiles:
            out.append((tile, size))
    return out


def select(src: Sources, site: CallSite, registers: dict[tuple[Tile, Flags], int]) -> tuple[Tile, int, list[str]]:
    """moe_wna16_marlin.cuh: determine_exec_config -> (tile, blocks per SM, notes per candidate).
    The candidate allowing strictly more resident blocks (by registers and shared memory) wins.
    Its one shape-specific override (SGL_CUDA_ARCH == 900) is for MXFP4 (group size 32): not NVFP4."""
    best: tuple[Tile, int] | None = None
    notes = []
    for tile, size in candidates(src, site):
        regs = registers[(tile, site.flags)]
        allow = min(src.device_max_reg_size // (max(regs, 1) * tile.threads * 4),
                    H200_MAX_SHARED_MEM_OPTIN // (size + src.validity_margin + src.launch_reserve))
        allow = max(min(allow, 4 if tile.thread_m_blocks == 1 else 2), 1)
        if tile.thread_m_blocks > 1:
            problem_blocks = site.prob_n // (16 * tile.thread_n_blocks) * site.prob_m * site.top_k * 4
            if problem_blocks < H200_SMS * allow:
                allow = max(problem_blocks // H200_SMS, 1)
        notes.append(f"{tile.label}: {regs} registers, {size} B shared -> {allow} blocks/SM")
        if best is None or allow > best[1]:
            best = (tile, allow)
    if best is None:
        raise RuntimeError(f"no NVFP4 marlin config is valid for {site.label}")
    return best[0], best[1], notes


# --------------------------------------------------------------------------- build


def nvcc_flags(arch: int) -> list[str]:
    """SGLang's JIT device flags (utils/arch.py: get_default_target_flags, compile/toolchain.py: target_flags)."""
    return [f"-DSGL_CUDA_ARCH={arch * 10}", "-std=c++20", "-O3", "--expt-relaxed-constexpr",
            f"-gencode=arch=compute_{arch}a,code=sm_{arch}a"]


def _template_args(src: Sources, tile: Tile, flags: Flags) -> list[str]:
    b = lambda v: "true" if v else "false"  # noqa: E731
    # The _GET_IF macro's argument order; S_TYPE is kFE4M3fn for kFE2M1f with group_blocks 1.
    return ["bf16_t", "host::kFE2M1f.id()", "host::kFE4M3fn.id()", str(tile.threads), str(tile.thread_m_blocks),
            str(tile.thread_n_blocks), str(tile.thread_k_blocks), b(tile.m_block_size_8), "pipe_stages", "1", "false",
            b(flags.is_ep), b(flags.has_bias), b(flags.expert_ids_are_sorted), b(flags.zero_inactive_output),
            b(flags.has_inactive_prefix_count)]


def translation_unit(src: Sources, insts: list[tuple[Tile, Flags]]) -> str:
    lines = [
        f"// Generated by bench/peers/marlin_sass.py for sglang {src.version}: explicit instantiations of",
        "// SGLang's marlin MoE kernel (bf16 x NVFP4), compiled from the installed package's own sources.",
        '#include "moe_wna16_marlin.cuh"',
        "namespace sglang::device::marlin_moe {",
    ]
    for tile, flags in insts:
        args = ", ".join(_template_args(src, tile, flags))
        lines.append(f"template __global__ void Marlin<{args}>(MARLIN_KERNEL_PARAMS);")
    lines.append("}  // namespace sglang::device::marlin_moe")
    return "\n".join(lines) + "\n"


def _sources_hash(src: Sources) -> str:
    h = hashlib.sha256()
    for f in _SOURCE_FILES:
        h.update((src.gemm_dir / f).read_bytes())
    return h.hexdigest()


def build_all(src: Sources, nvcc: tuple[str, str], arch: int, tus: dict[str, str],
              out: pathlib.Path) -> dict[str, Build]:
    """Compile each translation unit to a cubin (nvcc_cache.build_all: in parallel, cached by
    SGLang's version and sources, nvcc, flags and the unit's text)."""
    key = {"sglang_version": src.version, "sglang_sources_sha256": _sources_hash(src), "nvcc_version": nvcc[1],
           "flags": nvcc_flags(arch)}
    includes = [f"-I{d}" for d in src.include_dirs]
    return nvcc_cache.build_all(
        tus, out, key, lambda cu, cubin: [nvcc[0], "-cubin", *nvcc_flags(arch), *includes, "-o", str(cubin), str(cu)])


# --------------------------------------------------------------------------- measurement


def _instantiation_of(function: str) -> tuple[Tile, Flags] | None:
    """Template arguments from the mangled name of a Marlin<...> instantiation."""
    m = re.search(r"marlin_moe6MarlinI13__nv_bfloat16(.*?)EEv", function)
    if not m:
        return None
    vals = [int(v.replace("n", "-")) for _, v in re.findall(r"L([lib])(n?\d+)E", m.group(1))][2:]
    threads, tm, tn, tk, mb8, _stages, _gb, _zpf, ep, bias, srt, zero, prefix = vals
    return Tile(tm, tn, tk, bool(mb8), threads), Flags(bool(ep), bool(bias), bool(srt), bool(zero), bool(prefix))


def expected_mma_per_warp(src: Sources, tile: Tile) -> int:
    """HMMAs one warp issues per pass: stages x b_sh_wr_iters x matmul(k), where matmul issues, per
    j in 0..3, one mma_trans (m_block_size_8) or 2 mma per m block (marlin_template.h)."""
    b_sh_wr_iters = 8 * tile.thread_n_blocks * tile.thread_k_blocks // tile.threads  # b_sh_stage / b_sh_wr_delta
    per_k = 4 * (1 if tile.m_block_size_8 else 2 * tile.thread_m_blocks)
    return src.pipe_stages * b_sh_wr_iters * per_k


def marlin_hot_loop(instrs: list[Instr], expected_mma: int) -> Loop:
    """The K-loop pass: k3nvfp4's hot_loop if its MMA count is the one the template implies,
    else the smallest backward-branch loop holding exactly that many MMAs."""
    from k3nvfp4.kernels.offline import sass

    loop = sass.hot_loop(instrs)
    if sass.loop_stats(loop).mma == expected_mma:
        return loop
    fits = [lp for lp in sass.loops(instrs) if sass.loop_stats(lp).mma == expected_mma]
    if not fits:
        raise RuntimeError(f"no loop of the marlin kernel holds the expected {expected_mma} MMA instructions")
    return min(fits, key=lambda lp: lp.size)


def _measure(src: Sources, instrs: list[Instr], tile: Tile) -> dict[str, Any]:
    from k3nvfp4.kernels.offline import sass

    exp = expected_mma_per_warp(src, tile)
    loop = marlin_hot_loop(instrs, exp)
    st = sass.loop_stats(loop)
    warps = tile.threads // 32
    n_tile, k_tile = 16 * tile.thread_n_blocks, 16 * tile.thread_k_blocks
    weights = src.pipe_stages * k_tile * n_tile
    # Each HMMA m16n8k16 carries 256 weights as the 16x16 operand (mma_trans, m_block_size_8) or
    # 128 weights as the k16 x n8 operand, then shared by thread_m_blocks HMMAs.
    per_mma = 256 if tile.m_block_size_8 else 128 // tile.thread_m_blocks
    if warps * st.mma * per_mma != weights:
        raise RuntimeError(f"HMMA count {st.mma}/warp x {warps} warps does not cover {weights} weights")
    enclosing = [lp for lp in sass.loops(instrs) if lp.start <= loop.start and lp.end >= loop.end and lp != loop]
    nesting = (f"inside {len(enclosing)} larger loop(s), the outermost being while (slice_iters)" if enclosing
               else "with no enclosing loop")
    per_weight = sass.warp_instr_per_weight(st.instructions, warps, weights)
    return {
        "loop": loop, "stats": st, "warps": warps, "weights": weights, "per_weight": per_weight,
        "mapping": (
            f"one pass of the SASS loop [{loop.start:#x}, {loop.end:#x}] (the runtime stage_group loop; the "
            f"{src.pipe_stages}-stage pipe loop is unrolled inside it; {nesting}) = {src.pipe_stages} K tiles of "
            f"{k_tile} (K) x {n_tile} (N) FP4 weights of one expert = {weights} weights per thread block of "
            f"{warps} warps; checked: {st.mma} HMMA/warp in the loop (expected {exp}) x {warps} warps x "
            f"{per_mma} weights/HMMA = {weights}"),
    }


def _template_params(src: Sources, tile: Tile, flags: Flags) -> dict[str, Any]:
    return {
        "scalar_t": "bf16", "w_type": "kFE2M1f", "s_type": "kFE4M3fn", "threads": tile.threads,
        "thread_m_blocks": tile.thread_m_blocks, "thread_n_blocks": tile.thread_n_blocks,
        "thread_k_blocks": tile.thread_k_blocks, "m_block_size_8": tile.m_block_size_8, "stages": src.pipe_stages,
        "group_blocks": 1, "is_zp_float": False, "kIsEP": flags.is_ep, "kHasBias": flags.has_bias,
        "kExpertIdsAreSorted": flags.expert_ids_are_sorted, "kZeroInactiveOutput": flags.zero_inactive_output,
        "kHasInactivePrefixCount": flags.has_inactive_prefix_count,
    }


@dataclass
class Statics:
    """The compiled marlin instantiations: SGLang's sources, nvcc, and per (tile, flags) the
    function's instructions, resource usage and build."""

    src: Sources
    nvcc: tuple[str, str]
    funcs: dict[tuple[Tile, Flags], dict[str, Any]]

    @property
    def registers(self) -> dict[tuple[Tile, Flags], int]:
        return {inst: f["usage"].registers for inst, f in self.funcs.items()}

    def measure(self, tile: Tile, flags: Flags) -> dict[str, Any]:
        """Hot-loop figures of one instantiation (see _measure), cached."""
        f = self.funcs[(tile, flags)]
        if "measured" not in f:
            f["measured"] = _measure(self.src, f["instrs"], tile)
        return f["measured"]


def marlin_statics(arch: int = 90, build_dir: str | os.PathLike = "build/peers/marlin") -> Statics:
    """Build (or reuse) every instantiation SGLang's selection queries for the Kimi-K3 call sites
    and disassemble them. Raises RuntimeError naming what is missing or what failed."""
    if arch != 90:
        raise ValueError("only arch=90 (sm_90a, H200 device model) is modelled")
    from k3nvfp4.kernels.offline import sass

    nvcc_cache.require_cuobjdump()
    src = find_sources()
    nvcc = find_nvcc()
    out = pathlib.Path(build_dir)
    out = out if out.is_absolute() else REPO_ROOT / out
    regimes = {"decode": "decode (moe_block 8)", "moe_block64": "moe_block 64"}
    insts: dict[str, list[tuple[Tile, Flags]]] = {name: [] for name in regimes}
    for site in call_sites():
        name = "decode" if site.moe_block_size == 8 else "moe_block64"
        for tile, _ in candidates(src, site):
            if (tile, site.flags) not in insts[name]:
                insts[name].append((tile, site.flags))
    builds = build_all(src, nvcc, arch, {f"marlin_nvfp4_{n}": translation_unit(src, v) for n, v in insts.items()}, out)
    funcs: dict[tuple[Tile, Flags], dict[str, Any]] = {}
    for b in builds.values():
        usage = sass.resource_usage(b.cubin)
        for fn, instrs in sass.disassemble(b.cubin).items():
            inst = _instantiation_of(fn)
            if inst is not None:
                funcs[inst] = {"function": fn, "instrs": instrs, "usage": usage[fn], "build": b}
    missing = [f"{t.label} {f.label}" for v in insts.values() for t, f in v if (t, f) not in funcs]
    if missing:
        raise RuntimeError(f"instantiations missing from the cubins: {missing}")
    return Statics(src, nvcc, funcs)


def marlin_rows(arch: int = 90, build_dir: str | os.PathLike = "build/peers/marlin") -> list[dict[str, Any]]:
    """One row per (regime, shard, tile) SGLang launches for the Kimi-K3 shards, measured on its SASS.

    Raises RuntimeError naming what is missing (SGLang's sources, tvm_ffi headers, nvcc, Triton's
    cuobjdump) or what failed; the caller reports "not available: <reason>"."""
    from k3nvfp4.kernels.offline import sass

    st = marlin_statics(arch, build_dir)
    src, nvcc, funcs, registers = st.src, st.nvcc, st.funcs, st.registers
    sites = call_sites()

    # One row per (regime, shard, tile): both GEMMs of a shard launch the same tile; their flags
    # (kZeroInactiveOutput) shift the loop by an instruction or two, reported per call site.
    groups: dict[tuple[str, str, Tile], list[tuple[CallSite, int, list[str]]]] = {}
    for site in sites:
        tile, blocks, notes = select(src, site, registers)
        groups.setdefault((site.regime, site.shard, tile), []).append((site, blocks, notes))

    rows = []
    for (regime, shard, tile), used in groups.items():
        flags = used[0][0].flags  # measured on the first call site's instantiation (GEMM1)
        f = funcs[(tile, flags)]
        m = st.measure(tile, flags)
        stats = m["stats"]
        by_site = {}
        for site, blocks, _ in used:
            ms = st.measure(tile, site.flags)
            by_site[site.label] = {
                "instructions_per_iteration": ms["stats"].instructions,
                "warp_instr_per_weight": round(ms["per_weight"], 4),
                "registers": funcs[(tile, site.flags)]["usage"].registers,
                "blocks_per_sm": blocks,
                "flags": site.flags.label,
            }
        rows.append({
            "kernel": KERNEL,
            "regime": regime,
            "shard": shard,
            "template_params": _template_params(src, tile, flags),
            "arch": f"sm_{arch}a",
            "instructions_per_iteration": stats.instructions,
            "weights_per_iteration": m["weights"],
            "num_warps": m["warps"],
            "warp_instr_per_weight": round(m["per_weight"], 4),
            "hbm_ceiling_pct": round(100 * sass.hbm_ceiling(m["per_weight"]), 1),
            "registers": f["usage"].registers,
            "local_bytes": f["usage"].local_bytes,
            "opcode_mix": dict(list(stats.opcode_mix.items())[:15]),
            "family_mix": stats.family_mix,
            "mma_per_iteration": stats.mma,
            "iteration_mapping": m["mapping"],
            "nvcc_version": nvcc[1],
            "sglang_version": src.version,
            # Where SGLang launches this tile, and why (its selection replayed on these registers).
            "call_sites": by_site,
            "selection": {s.label: notes for s, _, notes in used},
            "function": f["function"],
            "cubin": str(f["build"].path),
            "compile_seconds": round(f["build"].seconds, 1),
            "cached": f["build"].cached,
        })
    return rows


if __name__ == "__main__":
    sys.exit(nvcc_cache.print_rows(marlin_rows))
