"""Static SASS measurement of FlashInfer's SM90 CUTLASS W4A16 MoE grouped GEMM (MXFP4 weights x BF16).

What is measured: the steady-state K loop of the Hopper mixed-input grouped GEMM that
``flashinfer.fused_moe.cutlass_fused_moe(..., use_w4_group_scaling=True)`` runs for BF16
activations and MXFP4 weights (uint8-packed E2M1 nibbles, one E8M0 scale per 32 weights) on
sm_90a -- ``CutlassMoeFCRunner<__nv_bfloat16, Fp4Type>`` (``isWFP4A16Quant`` in
``data/csrc/fused_moe/cutlass_backend/flashinfer_cutlass_fused_moe_binding.cu``), whose GEMMs go
through ``sm90_dispatch_moe_mixed_dtype_gemm_to_cutlass`` (``.../moe_gemm/
moe_gemm_template_dispatch_tma_ws_mixed_dtype.h``, post-MMA scale mode for W4A16) to
``sm90_generic_mixed_moe_gemm_kernelLauncher`` (``.../moe_gemm/launchers/
moe_gemm_tma_ws_mixed_input_launcher.inl``). Paths are inside the installed ``flashinfer``
package; ``...`` is ``data/csrc/nv_internal/tensorrt_llm/kernels/cutlass_kernels``. Same figures
as ``k3nvfp4.kernels.offline.sass`` reports for our Triton kernels and ``marlin_sass`` for marlin:
warp-instructions of one K-loop pass per FP4 weight it consumes.

How: FlashInfer JIT-builds this module from the CUTLASS sources in its wheel (about 248
translation units). This module builds only the tiles it measures (TILES, COOPERATIVE_TILES,
W4A8_VARIANTS): it writes a translation unit under
``build/peers/flashinfer/`` with FlashInfer's own kernel generator
(``jit/gemm/cutlass/generate_kernels.py``: ``generate_sm90_mixed_type_grouped_gemm_operations``
and ``get_file_content``, loaded standalone, nothing of FlashInfer is copied) -- it #includes the
installed launcher ``.inl`` and explicitly instantiates the launcher for one CTA tile -- and
compiles it to a cubin with the nvcc flags of FlashInfer's JIT for ``fused_moe_90``
(``jit/fused_moe.py: gen_cutlass_fused_moe_sm90_module`` and ``gen_cutlass_fused_moe_module``,
``jit/core.py: gen_jit_spec`` / ``sm90a_nvcc_flags``, ``jit/cpp_ext.py: build_common_cflags`` /
``build_cuda_cflags``), then disassembles it. No GPU is needed. The module's -D list and
``sm90a_nvcc_flags`` are read from those files; the generic ninja flags are mirrored here.
Deviations: ``-cubin`` instead of ``-c``; no ``-I`` for FlashInfer's generated-kernel folder (it
only holds the other generated .cu files); where the CUDA toolkit lacks ``curand_kernel.h``
(included by CUTLASS's ``tools/util`` headers the launcher pulls in) the pip ``nvidia`` package's
include folder is appended last as ``-isystem``; the H20-only
``-DFLASHINFER_SM90_MOE_PREBUILT_D_DESCRIPTOR=1`` (78-SM devices) is not an H200 flag.

The kernel: ``cutlass::device_kernel<GemmUniversalPrecomputedScheduler<...>>``
(``.../cutlass_extensions/include/cutlass_extensions/gemm/kernel/
sm90_gemm_array_tma_warpspecialized_pingpong_precomputed.hpp``), warp-specialized pingpong:
3 warpgroups (384 threads): a producer warpgroup (setmaxnreg 40) whose warp 0 issues the TMA loads
of weights, activations and scales, and two consumer warpgroups (setmaxnreg 232) that take turns
on whole output tiles, each running the full K loop of its tile. With swap_ab (required for the
mixed-input path) the CTA tile M is weight rows (output channels) and N is tokens, so the 64x16
tiles are the decode tiles. The mainloop (``.../cutlass_extensions/include/cutlass_extensions/
gemm/collective/sm90_mma_array_tma_gmma_rs_warpspecialized_mixed_input_.hpp``, ``mma``) runs one
k-tile per pass (``CUTLASS_PRAGMA_NO_UNROLL``; first and last k-tile peeled): it converts the E2M1
nibbles to BF16 with bit operations and a BF16 multiply by 2^126 (``HMUL2.BF16``; constant
0x7e80 in ``.../cutlass_extensions/include/cutlass_extensions/detail/collective/
mixed_input_utils.hpp``), issues K/16 register-A ``HGMMA.64x16x16.F32.BF16`` per warp into a
per-32-K-group intermediate accumulator, and applies each group's E8M0 scale to the fp32
accumulator with ``FFMA`` (``scale_intermediate`` / ``apply_groupwise_scale``). ptxas also emits one
no-op ``HGMMA.64x8x16 RZ`` per ``warpgroup_commit_batch``; those are counted as instructions but
not as MMAs.

The W4A8 peer (``use_wfp4afp8_humming``: FP8 activations, E8M0 scale applied before the MMA,
mainloop ``...MixedInputPreScale``, ``QGMMA.64x16x32.F32.E4M3.E4M3``) is built from the same
generator with ``act="e4m3"``; ``python -P bench/peers/flashinfer_sass.py --act e4m3`` prints its
rows (:func:`flashinfer_w4a8_rows`; its call model: peers/flashinfer_model.flashinfer_w4a8_call).

Facts recorded in each row:
* ``launches_per_call`` 11 with ``launch_sources`` (``LAUNCH_SOURCES``): the runner's ``runMoe``
  (``data/csrc/fused_moe/cutlass_backend/cutlass_fused_moe_kernels.cuh``) skips the fused prologue
  for SM90 mixed-input GEMMs, launches 3 sort kernels, the permute, the stride setup, and per GEMM a
  precomputed work-tile-map kernel plus the GEMM, the activation between the GEMMs and, since
  finalize fusion is disabled for SM90 mixed input, a separate finalize kernel. The Python side
  (``fused_moe/core.py``) only allocates.
* ``requires`` ``H % 128 == 0 and I % 128 == 0``: ``isProfileShapeSupported`` in the binding needs
  ``gemm_k % tile_k == 0`` (tile_k >= 128; GEMM1 k = H, GEMM2 k = I) and ``gemm_n % tile_m == 0``.
  The Kimi-K3 EP shards (H=3584, I=3072) qualify; TP16 (I=192) does not.
* ``bytes_per_weight`` 0.53125: an E2M1 nibble plus one E8M0 byte per 32 weights.
* The untuned default tactic is the first candidate, the 64x16x128 pingpong 1x1x1 config
  (``get_candidate_configs_sm90`` in ``.../cutlass_heuristic.cpp``; ``setRunnerProfiles`` takes
  ``mAllProfiles.front()``); the AutoTuner may pick others at runtime.
* ``shared_bytes``: static shared as ``cuobjdump -res-usage`` reports it plus the dynamic shared
  memory ``GemmUniversalAdapter`` launches with (``GemmKernel::SharedStorageSize``), read by a
  second small translation unit that names the kernel type (demangled from the cubin with
  ``llvm-cxxfilt`` / ``c++filt``) and instantiates a probe template on that constant. Null, with
  ``shared_bytes_note``, if no demangler is available or the probe does not compile.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess
import sys
import sysconfig
import types
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if str(pathlib.Path(__file__).resolve().parents[1]) not in sys.path:  # run as a script: bench/ holds peers
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from peers import nvcc_cache  # noqa: E402
from peers.nvcc_cache import Build, find_nvcc  # noqa: E402,F401  (find_nvcc: used by the tests)

if TYPE_CHECKING:
    from k3nvfp4.kernels.offline.sass import Instr, Loop

REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
KERNEL = "flashinfer_cutlass_w4a16_moe"

# (M, N, K) CTA tiles built and measured: every tile of FlashInfer's autotuner list for grouped
# weight-only GEMMs on sm90 (get_candidate_tiles_sm90 in .../cutlass_heuristic.cpp; each as its
# 1x1x1-cluster candidate, get_candidate_configs_sm90). The 64-row tiles run pingpong (TILES: 16,
# 32, 64 and 128 tokens x K 128, 256 and 512; the first, 64x16x128, is the untuned default
# tactic); the 128- and 256-row ones cooperative, the only schedule get_candidate_configs_sm90
# gives a tile that sm90_supports_coop admits (COOPERATIVE_TILES: both consumer warpgroups on one
# tile, half its rows each: 64, or 128 as two MMA atoms; measure(cooperative=True)). Each
# translation unit builds in 45-120 s with nvcc 13.0 (two in parallel on 2 cores, ~5 GB of memory
# each), plus a ~25 s SharedStorageSize probe each: 28 units per peer, about 20 minutes the first
# time, cached under build/peers/flashinfer/.
TILES: tuple[tuple[int, int, int], ...] = tuple((64, n, k) for n in (16, 32, 64, 128) for k in (128, 256, 512))
SCHEDULE = "pingpong"  # FlashInfer instantiates only pingpong for tile M < 128
COOPERATIVE_TILES: tuple[tuple[int, int, int], ...] = (
    *((128, n, k) for n in (16, 32, 64) for k in (128, 256, 512)),
    *((128, n, k) for n in (128, 256) for k in (128, 256)),
    (256, 128, 128), (256, 128, 256), (256, 256, 128))
CLUSTER = (1, 1, 1)

MXFP4_GROUP_SIZE = 32
BYTES_PER_WEIGHT = 0.5 + 1 / MXFP4_GROUP_SIZE  # 0.53125
REQUIRES = "H % 128 == 0 and I % 128 == 0"
HGMMA_K = 16  # K of one wgmma (BF16)
# The activation types of FlashInfer's SM90 MXFP4 grouped GEMMs (generate_sm90_mixed_type_grouped_gemm_operations):
# "bf16" is the W4A16 peer (post-MMA E8M0 scale, FFMA on the accumulator); "e4m3" is the W4A8 one
# (``use_wfp4afp8_humming``: the generator gives it mixed_input_scale_mode "pre_mma_e8m0", the
# E2M1 weights and their E8M0 scale turned into E4M3 before a QGMMA.64xNx32.E4M3.E4M3).
ACTS = ("bf16", "e4m3")

# Warps per CTA and which of them run per-k-tile work (pingpong: one tile in flight per consumer
# warpgroup; cooperative: both consumer warpgroups on one tile, 64 of its rows each).
CTA_WARPS = 12
WARP_SPECIALIZED = ("warp_specialized", "cooperative")
CONSUMER_WARPS = 4  # one consumer warpgroup runs the whole K loop of a tile
PRODUCER_WARPS = 1  # producer warpgroup warp 0 (ProducerWarpRole::Mainloop) issues the TMA loads

_CB = "data/csrc/fused_moe/cutlass_backend/cutlass_fused_moe_kernels.cuh"
_PREBUILD = ("data/csrc/nv_internal/tensorrt_llm/kernels/cutlass_kernels/moe_gemm/launchers/"
             "moe_gemm_tma_ws_mixed_input_prebuild.h")
_LAUNCHER = ("data/csrc/nv_internal/tensorrt_llm/kernels/cutlass_kernels/moe_gemm/launchers/"
             "moe_gemm_tma_ws_mixed_input_launcher.inl")
# One forward call, SM90 W4A16, no LoRA / min-latency / bias, in launch order.
LAUNCH_SOURCES: tuple[str, ...] = (
    f"blockExpertPrefixSumKernel: {_CB} threeStepBuildExpertMapsSortFirstToken (runMoe skips "
    "fusedBuildExpertMapsSortFirstToken when use_sm90_mixed_input_gemm)",
    f"globalExpertPrefixSumKernel: {_CB} threeStepBuildExpertMapsSortFirstToken",
    f"mergeExpertPrefixSumKernel: {_CB} threeStepBuildExpertMapsSortFirstToken",
    f"expandInputRowsKernel (permute): {_CB} expandInputRowsKernelLauncher",
    f"computeStridesTmaWarpSpecializedKernel: {_CB} setupTmaWarpSpecializedInputs -> "
    "computeStridesTmaWarpSpecialized (both GEMMs' strides and pointers)",
    f"build_precomputed_work_tile_map_kernel (GEMM1 tile map): {_PREBUILD} build_precomputed_work_tile_map, "
    f"called by {_LAUNCHER} sm90_generic_mixed_moe_gemm_kernelLauncher_impl",
    f"cutlass::device_kernel<GemmUniversalPrecomputedScheduler> (GEMM1, gate/up): {_LAUNCHER} gemm.run",
    f"doActivationKernel (SiTU/SwiGLU): {_CB} CutlassMoeFCRunner::gemm1 -> doActivation",
    f"build_precomputed_work_tile_map_kernel (GEMM2 tile map): {_PREBUILD} build_precomputed_work_tile_map",
    f"cutlass::device_kernel<GemmUniversalPrecomputedScheduler> (GEMM2, down): {_LAUNCHER} gemm.run",
    f"finalizeMoeRoutingKernel: {_CB} CutlassMoeFCRunner::gemm2 -> finalizeMoeRoutingKernelLauncher "
    "(setupTmaWarpSpecializedInputs disables fused finalize for SM90 mixed input)",
)

_NV = "data/csrc/nv_internal"
_INL_INCLUDE = "tensorrt_llm/kernels/cutlass_kernels/moe_gemm/launchers/moe_gemm_tma_ws_mixed_input_launcher.inl"
# Hashed into the cache key (with the FlashInfer version, which pins its CUTLASS copy).
_HASHED = (f"{_NV}/tensorrt_llm/kernels/cutlass_kernels/moe_gemm/launchers",
           f"{_NV}/tensorrt_llm/cutlass_extensions/include",
           f"{_NV}/tensorrt_llm/kernels/cutlass_kernels/include",
           "jit/gemm/cutlass/generate_kernels.py", "jit/gemm/cutlass/cutlass_library.py",
           "jit/fused_moe.py", "jit/core.py", "jit/cpp_ext.py")


@dataclass(frozen=True)
class Sources:
    """The installed FlashInfer's JIT sources and the flags read from its JIT module generator."""

    version: str
    package_dir: pathlib.Path  # .../site-packages/flashinfer
    module_flags: tuple[str, ...]  # sm90a_nvcc_flags + gen_cutlass_fused_moe_sm90_module's list
    include_flags: tuple[str, ...]  # -I / -isystem, in FlashInfer's order
    deviations: tuple[str, ...]

    @property
    def data(self) -> pathlib.Path:
        return self.package_dir / "data"


# --------------------------------------------------------------------------- locating the inputs


def _version_at_least(version: str, want: str) -> bool:
    return tuple(int(x) for x in version.split(".")[:2]) >= tuple(int(x) for x in want.split(".")[:2])


def _list_literal(text: str, start: int, where: str) -> str:
    """The text of the [...] list literal that opens at or after text[start]."""
    i = text.index("[", start)
    depth = 0
    for j in range(i, len(text)):
        depth += {"[": 1, "]": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    raise RuntimeError(f"unterminated list in FlashInfer's {where}")


def read_module_flags(fused_moe_py: str, core_py: str, nvcc_version: str) -> list[str]:
    """sm90a_nvcc_flags (jit/core.py) + the -D list of gen_cutlass_fused_moe_sm90_module
    (jit/fused_moe.py), evaluating its ``"-D..." if is_cuda_version_at_least("12.8") else ""``."""
    out = []
    for name in ("common_nvcc_flags", "sm90a_nvcc_flags"):
        m = re.search(rf"^{name}\s*=", core_py, re.M)
        if not m:
            raise RuntimeError(f"cannot find {name} in FlashInfer's jit/core.py")
        out.append(re.findall(r'"(-[^"]+)"', _list_literal(core_py, m.end(), "jit/core.py")))
    common, sm90a = out
    if not re.search(r"^sm90a_nvcc_flags\s*=\s*\[[^\]]*\]\s*\+\s*common_nvcc_flags", core_py, re.M):
        raise RuntimeError("FlashInfer's sm90a_nvcc_flags is no longer [...] + common_nvcc_flags")
    m = re.search(r"def gen_cutlass_fused_moe_sm90_module\b.*?nvcc_flags\s*=\s*sm90a_nvcc_flags\s*\+", fused_moe_py,
                  re.S)
    if not m:
        raise RuntimeError("cannot find gen_cutlass_fused_moe_sm90_module's nvcc_flags in FlashInfer's "
                           "jit/fused_moe.py")
    body = _list_literal(fused_moe_py, m.end(), "jit/fused_moe.py")
    flags = []
    for item in re.findall(r'("-[^"]+"(?:\s+if\s+is_cuda_version_at_least\("[\d.]+"\)\s+else\s+"")?)', body):
        flag = re.match(r'"([^"]+)"', item).group(1)
        cond = re.search(r'is_cuda_version_at_least\("([\d.]+)"\)', item)
        if cond is None or _version_at_least(nvcc_version, cond.group(1)):
            flags.append(flag)
    if not any(f.startswith("-DCOMPILE_HOPPER_TMA_GROUPED_GEMMS") for f in flags):
        raise RuntimeError("FlashInfer's fused_moe sm90 flags lack -DCOMPILE_HOPPER_TMA_GROUPED_GEMMS")
    return sm90a + common + flags


def _find_package(name: str) -> pathlib.Path | None:
    spec = importlib.util.find_spec(name)  # locates without importing
    if spec is None or not spec.submodule_search_locations:
        return None
    return pathlib.Path(list(spec.submodule_search_locations)[0])


def _toolkit_includes(nvcc: str) -> list[pathlib.Path]:
    """The include folders nvcc itself adds (its INCLUDES line of --dryrun): the real toolkit's,
    also when nvcc on PATH is a wrapper script outside the toolkit."""
    try:
        out = subprocess.run([nvcc, "--dryrun", "-c", "-x", "cu", os.devnull, "-o", os.devnull],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return []
    m = re.search(r"INCLUDES=(.*)", out.stdout + out.stderr)
    return [pathlib.Path(p) for p in re.findall(r'-I"?([^"\s]+)', m.group(1))] if m else []


def _curand_include(cuda_home: pathlib.Path, nvcc: str) -> tuple[pathlib.Path | None, str | None]:
    """(extra -isystem dir, deviation note): None if the toolkit has curand_kernel.h."""
    if any((d / "curand_kernel.h").is_file() for d in (cuda_home / "include", *_toolkit_includes(nvcc))):
        return None, None
    nvidia = _find_package("nvidia")
    cands = sorted(nvidia.glob("*/include/curand_kernel.h")) if nvidia else []
    if not cands:
        raise RuntimeError(f"curand_kernel.h (CUTLASS tools/util headers need it) is neither in {cuda_home}/include "
                           "nor in a pip nvidia-curand package")
    where = ", ".join(str(d) for d in (cuda_home / "include", *_toolkit_includes(nvcc)))
    return cands[0].parent, f"-isystem {cands[0].parent} appended: no curand_kernel.h in the CUDA toolkit ({where})"


def find_sources(nvcc: tuple[str, str]) -> Sources:
    """FlashInfer's JIT sources and flags; RuntimeError naming what is missing."""
    pkg = _find_package("flashinfer")
    if pkg is None:
        raise RuntimeError("flashinfer (flashinfer-python) is not installed")
    need = [_LAUNCHER, f"{_NV}/tensorrt_llm/kernels/cutlass_kernels/moe_gemm/launchers/"
            "moe_gemm_tma_ws_mixed_input_launcher.h", "jit/gemm/cutlass/generate_kernels.py",
            "jit/gemm/cutlass/cutlass_library.py", "jit/fused_moe.py", "jit/core.py", "data/cutlass/include/cutlass",
            "data/cutlass/tools/util/include/cutlass"]
    missing = [p for p in need if not (pkg / p).exists()]
    if missing:
        raise RuntimeError(f"flashinfer at {pkg} lacks its JIT CUTLASS sources: {', '.join(missing)}")
    try:
        version = importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    module_flags = read_module_flags((pkg / "jit/fused_moe.py").read_text(), (pkg / "jit/core.py").read_text(),
                                     nvcc[1])

    data, nv = pkg / "data", pkg / _NV
    # jit/cpp_ext.py get_cuda_path: CUDA_HOME / CUDA_PATH, else two levels above `which nvcc`.
    cuda_home = pathlib.Path(os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
                             or pathlib.Path(nvcc[0]).parent.parent)
    # jit/cpp_ext.py build_common_cflags: -I extra_include_paths (gen_cutlass_fused_moe_module's),
    # -I vendored CCCL, then -isystem get_system_includes(cuda_home).
    inc = [f"-I{d}" for d in (nv, nv / "include", nv / "tensorrt_llm/cutlass_extensions/include",
                              nv / "tensorrt_llm/kernels/cutlass_kernels/include",
                              nv / "tensorrt_llm/kernels/cutlass_kernels")]
    inc += [f"-I{data / 'cccl' / d}" for d in ("cub", "libcudacxx/include", "thrust")]
    system = [pathlib.Path(sysconfig.get_path("include")), cuda_home / "include"]
    tvm = _find_package("tvm_ffi")
    if tvm is not None:  # tvm_ffi.libinfo.find_include_path / find_dlpack_include_path
        system += [p for p in (tvm / "include", tvm / "3rdparty" / "dlpack" / "include") if p.is_dir()]
    system += [data / "include", data / "csrc", data / "cutlass/include", data / "cutlass/tools/util/include",
               data / "spdlog/include"]
    seen: set[pathlib.Path] = set()
    for d in system:
        if d not in seen and d.is_dir():
            seen.add(d)
            inc += ["-isystem", str(d)]
    deviations = ["-cubin instead of ninja's -c (device code only)",
                  "no -I for FlashInfer's generated cutlass_instantiations/90 folder (only the other generated .cu)"]
    curand, note = _curand_include(cuda_home, nvcc[0])
    if curand is not None:
        inc += ["-isystem", str(curand)]
        deviations.append(note)
    return Sources(version, pkg, tuple(module_flags), tuple(inc), tuple(deviations))


# --------------------------------------------------------------------------- build


# jit/core.py gen_jit_spec (non-debug) and jit/cpp_ext.py build_common_cflags / build_cuda_cflags,
# in ninja's order: $common_cflags (defines; includes come from Sources), build_cuda_cflags' own
# flags and CompilationContext.COMMON_NVCC_FLAGS, then gen_jit_spec's cuda_cflags, then the
# module's extra_cuda_cflags (Sources.module_flags).
HOST_DEFINES = ("-DPy_LIMITED_API=0x03090000",
                "-D_GLIBCXX_USE_CXX11_ABI=1")  # torch._C._GLIBCXX_USE_CXX11_ABI of the torch wheels
BUILD_CUDA_CFLAGS = ("--compiler-options=-fPIC", "--expt-relaxed-constexpr",
                     "-static-global-template-stub=false",  # CUDA >= 12.8
                     "-DFLASHINFER_ENABLE_FP8_E8M0", "-DFLASHINFER_ENABLE_FP4_E2M1")
GEN_JIT_SPEC_CUDA_CFLAGS = ("-std=c++17", "--threads=1", "-use_fast_math", "-Xfatbin=-compress-all",
                            "--compress-mode=size", "-DFLASHINFER_ENABLE_F16", "-DFLASHINFER_ENABLE_BF16",
                            "-DFLASHINFER_ENABLE_FP8_E4M3", "-DFLASHINFER_ENABLE_FP8_E5M2", "-DNDEBUG", "-O3")


def nvcc_flags(src: Sources) -> list[str]:
    """Every nvcc flag but the include directories, in FlashInfer's ninja order."""
    return [*HOST_DEFINES, *BUILD_CUDA_CFLAGS, *GEN_JIT_SPEC_CUDA_CFLAGS, *src.module_flags]


def nvcc_command(src: Sources, nvcc: tuple[str, str], cu: pathlib.Path, cubin: pathlib.Path) -> list[str]:
    return [nvcc[0], "-cubin", *HOST_DEFINES, *src.include_flags, *BUILD_CUDA_CFLAGS, *GEN_JIT_SPEC_CUDA_CFLAGS,
            *src.module_flags, "-o", str(cubin), str(cu)]


def load_generator(package_dir: pathlib.Path) -> types.ModuleType:
    """FlashInfer's jit/gemm/cutlass/generate_kernels.py, loaded standalone (it only imports the
    standard library and its sibling cutlass_library.py), without importing flashinfer."""
    base = package_dir / "jit" / "gemm" / "cutlass"
    pkg = f"_k3nvfp4_flashinfer_cutlass_gen_{hashlib.sha256(str(base).encode()).hexdigest()[:8]}"
    if f"{pkg}.generate_kernels" in sys.modules:
        return sys.modules[f"{pkg}.generate_kernels"]
    parent = types.ModuleType(pkg)
    parent.__path__ = [str(base)]
    sys.modules[pkg] = parent
    mod = None
    for name in ("cutlass_library", "generate_kernels"):
        spec = importlib.util.spec_from_file_location(f"{pkg}.{name}", base / f"{name}.py")
        if spec is None or spec.loader is None:
            raise RuntimeError(f"cannot load FlashInfer's {base / name}.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    return mod


def is_single_warpgroup(kernel_type: str) -> bool:
    """Humming's single-warpgroup kernels (one warpgroup loads and multiplies) against CUTLASS's
    warp-specialized ones (a producer warpgroup and two consumer warpgroups: "warp_specialized",
    the pingpong schedule, or "cooperative")."""
    return kernel_type not in WARP_SPECIALIZED


def schedule_of(kernel_type: str) -> str:
    """The mainloop schedule parse_kernel_name reads from a warp-specialized kernel of this type."""
    return "cooperative" if kernel_type == "cooperative" else SCHEDULE


def _check_schedule(tile: tuple[int, int, int], info: dict[str, Any], kernel_type: str) -> None:
    """Raise where the built kernel's schedule is not the one ``kernel_type`` asked for."""
    if info["schedule"] != schedule_of(kernel_type):
        raise RuntimeError(f"tile {tile}: a {info['schedule']} kernel where {kernel_type} was built")


def operation(gen: types.ModuleType, tile: tuple[int, int, int], act: str = "bf16",
              kernel_type: str = "warp_specialized") -> Any:
    """The ``act`` (ACTS: bf16 or e4m3) x MXFP4 (ue8m0 scales, bf16 out) sm90 mixed grouped-GEMM
    operation of this tile from FlashInfer's own list (generate_sm90_mixed_type_grouped_gemm_operations).
    kernel_type: "warp_specialized" (the pingpong kernel), "cooperative" (the warp-specialized
    kernel on the cooperative schedule: both consumer warpgroups on one 128-row tile, what the
    binding runs for 128- and 256-row tiles), or for e4m3 one of SINGLE_WARPGROUP."""
    if act not in ACTS:
        raise ValueError(f"act {act!r}: expected one of {', '.join(ACTS)}")
    dt = gen.DataType
    want = (getattr(dt, act), gen.e2m1, dt.ue8m0, dt.bf16, dt.bf16)
    schedule = (gen.KernelScheduleType.TmaWarpSpecializedCooperative if kernel_type == "cooperative"
                else gen.KernelScheduleType.TmaWarpSpecializedPingpong)
    generated = "warp_specialized" if kernel_type == "cooperative" else kernel_type
    ops = [op for op in gen.generate_sm90_mixed_type_grouped_gemm_operations(True)
           if (op.act_type, op.weight_type, op.scalezero_type, op.bias_type, op.output_type) == want
           and tuple(op.cta_shape) == tile and tuple(op.cga_shape) == CLUSTER
           and op.mainloop_schedule == schedule
           and getattr(op, "sm90_mixed_input_kernel_type", "warp_specialized") == generated]
    if len(ops) != 1:
        what = "pingpong" if kernel_type == "warp_specialized" else kernel_type
        raise RuntimeError(f"FlashInfer's generator has {len(ops)} {act} x e2m1 {what} operations for tile {tile}")
    return ops[0]


def translation_unit(gen: types.ModuleType, tile: tuple[int, int, int], act: str = "bf16",
                     kernel_type: str = "warp_specialized") -> str:
    """FlashInfer's generated-file text (get_file_content) for the one launcher of this tile."""
    body = gen.get_file_content([_INL_INCLUDE], [operation(gen, tile, act, kernel_type)])
    what = SCHEDULE if kernel_type == "warp_specialized" else kernel_type
    head = (f"// Generated by bench/peers/flashinfer_sass.py with FlashInfer's generate_kernels.py: the SM90\n"
            f"// {act.upper()} x MXFP4 grouped-GEMM launcher for CTA tile {tile[0]}x{tile[1]}x{tile[2]} ({what}).\n")
    return head + body


def probe_unit(kernel_type: str) -> str:
    """A translation unit whose only kernel's mangled name carries GemmKernel's constants."""
    return (f'#include "{_INL_INCLUDE}"\n'
            "template <int SharedStorageSize, int MaxThreadsPerBlock> __global__ void k3nvfp4_probe() {}\n"
            f"using K3Kernel = {kernel_type};\n"
            "template __global__ void k3nvfp4_probe<K3Kernel::SharedStorageSize, "
            "int(K3Kernel::MaxThreadsPerBlock)>();\n")


def _sources_hash(src: Sources) -> str:
    h = hashlib.sha256()
    for rel in _HASHED:
        p = src.package_dir / rel
        for f in sorted(p.rglob("*")) if p.is_dir() else [p]:
            if f.is_file():
                h.update(str(f.relative_to(src.package_dir)).encode())
                h.update(f.read_bytes())
    return h.hexdigest()


def build_all(src: Sources, nvcc: tuple[str, str], tus: dict[str, str], out: pathlib.Path,
              raise_on_error: bool = True) -> dict[str, Build | str]:
    """Compile each translation unit to a cubin (nvcc_cache.build_all: in parallel, cached by
    FlashInfer's version and sources, nvcc, flags and the unit's text). A failed build raises, or
    with raise_on_error=False maps to its error text."""
    key = {"flashinfer_version": src.version, "flashinfer_sources_sha256": _sources_hash(src),
           "nvcc_version": nvcc[1], "flags": nvcc_flags(src)}
    return nvcc_cache.build_all(tus, out, key, lambda cu, cubin: nvcc_command(src, nvcc, cu, cubin),
                                raise_on_error=raise_on_error)


# --------------------------------------------------------------------------- measurement


def parse_kernel_name(function: str) -> dict[str, Any] | None:
    """Tile, schedule, stages, MMA atom and operand types from the mangled name of the mixed-input
    grouped GEMM's ``cutlass::device_kernel<...>``; None for any other function."""
    if not function.startswith("_ZN7cutlass13device_kernel") or "MixedInput" not in function:
        return None
    sched = re.search(r"KernelPtrArrayTmaWarpSpecialized(Pingpong|Cooperative)E+"
                      r"NS[0-9A-Z]*_IJNS[0-9A-Z]*_ILi(\d+)EEENS[0-9A-Z]*_ILi(\d+)EEENS[0-9A-Z]*_ILi(\d+)EEE", function)
    # the W4A8 (pre-MMA scale) mainloop is MixedInputPreScale
    stages = re.search(r"MainloopSm90ArrayTmaGmmaWarpSpecializedMixedInput(PreScale)?ILi(\d+)E", function)
    atom = re.search(r"\d+(MMA_(\d+)x(\d+)x(\d+)_([A-Z0-9]+)_(RS|SS))", function)
    if sched is None and stages and atom:
        # A tile whose K equals its M (128 x 16 x 128) mangles K as a back-reference (S..._):
        # read the tile from the demangled name instead.
        dem = demangle(function) or ""
        sched = re.search(r"KernelPtrArrayTmaWarpSpecialized(Pingpong|Cooperative)>, "
                          r"cute::tuple<cute::C<(\d+)>, cute::C<(\d+)>, cute::C<(\d+)> >", dem)
    if not (sched and stages and atom):
        return None
    return {
        "schedule": sched.group(1).lower(),
        "tile": tuple(int(sched.group(i)) for i in (2, 3, 4)),
        "stages": int(stages.group(2)),
        "scale_mode": "pre_mma" if stages.group(1) else "post_mma",
        # Humming's single-warpgroup kernels (one warpgroup loads and multiplies; no producer warp)
        "structure": "single_warpgroup" if "SingleWarpgroupPersistentGemm" in function else "warp_specialized",
        "mma_atom": atom.group(1),
        "atom_mnk": tuple(int(atom.group(i)) for i in (2, 3, 4)),
        "weight_type": "float_e2m1_t" if "float_e2m1_t" in function else None,
        "scale_type": "float_ue8m0_t" if "float_ue8m0_t" in function else None,
    }


def demangle(function: str) -> str | None:
    """The demangled name via llvm-cxxfilt or binutils c++filt (--no-recurse-limit: CUTLASS names
    are deeper than its default limit); None if neither can."""
    for cmd in (["llvm-cxxfilt"], ["c++filt", "--no-recurse-limit"]):
        if shutil.which(cmd[0]) is None:
            continue
        try:
            out = subprocess.run([*cmd, function], capture_output=True, text=True, timeout=60).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            continue
        if out and not out.startswith("_Z"):
            return out
    return None


def kernel_type_of(demangled: str) -> str:
    """The GemmKernel type: the template argument of ``cutlass::device_kernel<...>``."""
    head = "cutlass::device_kernel<"
    i = demangled.index(head) + len(head)
    depth = 0
    for j in range(i, len(demangled)):
        c = demangled[j]
        if c == "<":
            depth += 1
        elif c == ">":
            if depth == 0:
                return demangled[i:j].strip()
            depth -= 1
    raise ValueError("unbalanced template brackets in the demangled kernel name")


def _probe_values(funcs: dict[str, Any]) -> tuple[int, int] | None:
    for fn in funcs:
        m = re.search(r"k3nvfp4_probeILi(\d+)ELi(\d+)EEvv", fn)
        if m:
            return int(m.group(1)), int(m.group(2))
    return None


WGMMA_OPS = ("HGMMA", "QGMMA")  # warpgroup MMAs in SASS: BF16 / FP16, and FP8


def _count(mix: dict[str, int], *prefixes: str) -> int:
    """Instructions of a loop's opcode mix whose opcode starts with one of ``prefixes``."""
    return sum(n for op, n in mix.items() if op.startswith(prefixes))


def _copies(mix: dict[str, int]) -> dict[str, int]:
    """The loop's bulk loads (TMA and bulk copies), by opcode."""
    return {op: n for op, n in mix.items() if op.startswith(("UTMALDG", "UBLKCP"))}


def is_real_hgmma(ins: Instr) -> bool:
    """A warpgroup MMA that computes (HGMMA: BF16, QGMMA: FP8): ptxas's per-commit placeholders are
    ``HGMMA.64x8x16.F16 RZ, gdesc[URZ], RZ`` (the parser leaves the shape suffix, e.g. ``x8x16.F16``,
    at the head of the operands)."""
    return ins.base in WGMMA_OPS and re.match(r"(?:x[0-9]\S*\s+)?RZ\b", ins.operands) is None


def consumer_loop(instrs: list[Instr], expected_hgmma: int) -> Loop:
    """The mainloop k-tile pass: the smallest backward-branch loop holding exactly the HGMMAs one
    k-tile implies (the tile and persistent loops around it hold the peeled k-tiles too)."""
    from k3nvfp4.kernels.offline import sass

    fits = [lp for lp in sass.loops(instrs) if sum(is_real_hgmma(i) for i in lp.instrs) == expected_hgmma]
    if not fits:
        raise RuntimeError(f"no loop of the GEMM kernel holds the expected {expected_hgmma} HGMMA instructions")
    return min(fits, key=lambda lp: lp.size)


def producer_loop(instrs: list[Instr]) -> Loop:
    """The producer's k-tile loop: the smallest loop that issues TMA loads (UTMALDG) and no HGMMA."""
    from k3nvfp4.kernels.offline import sass

    fits = [lp for lp in sass.loops(instrs) if any(i.base == "UTMALDG" for i in lp.instrs)
            and not any(i.base in WGMMA_OPS for i in lp.instrs)]
    if not fits:
        raise RuntimeError("no TMA-load loop without HGMMA (the producer's k-tile loop) in the GEMM kernel")
    return min(fits, key=lambda lp: lp.size)


def setmaxnreg(instrs: list[Instr]) -> dict[str, int]:
    """USETMAXREG targets: TRY_ALLOC (consumer warpgroups) and DEALLOC (producer warpgroup)."""
    out = {}
    for i in instrs:
        if i.base == "USETMAXREG":
            m = re.search(r"0x([0-9a-f]+)\s*$", i.operands)
            if m:
                role = "producer" if "DEALLOC" in i.opcode else "consumer"
                out[role] = int(m.group(1), 16)
    return out


def measure(instrs: list[Instr], tile: tuple[int, int, int], atom_mnk: tuple[int, int, int],
            act: str = "bf16", cooperative: bool = False) -> dict[str, Any]:
    """Consumer and producer k-tile loops, their counts per weight, and the checked mapping
    (act: ACTS; what the loop converts differs, the structure is the same). cooperative: both
    consumer warpgroups share the tile, each one MMA atom's rows of it (the cooperative schedule),
    instead of one warpgroup per tile (pingpong)."""
    from k3nvfp4.kernels.offline import sass

    m_tile, n_tile, k_tile = tile
    am, an, ak = atom_mnk
    wgs = 2 if cooperative else 1  # consumer warpgroups on one tile
    wg_rows = m_tile // wgs  # weight rows each consumer warpgroup multiplies: 64, or 128 in a 256-row tile
    # pingpong: one MMA atom of rows per tile (FlashInfer makes pingpong kernels only below 128 rows);
    # cooperative: each warpgroup's half of the rows in whole atoms (two of them in a 256-row tile).
    if an != n_tile or (wg_rows != am if not cooperative else (m_tile % wgs or wg_rows % am)):
        what = "whole warpgroup MMAs on each half" if cooperative else "one warpgroup MMA"
        raise RuntimeError(f"MMA atom {atom_mnk} is not {what} of a {m_tile}x{n_tile} tile")
    exp = (wg_rows // am) * (k_tile // ak)  # MMAs per warp per k-tile: atoms along the rows x along K
    loop = consumer_loop(instrs, exp)
    st = sass.loop_stats(loop)
    real = sum(is_real_hgmma(i) for i in loop.instrs)
    placeholders = st.mma - real
    weights = m_tile * k_tile
    wg_weights = wg_rows * k_tile  # one consumer warpgroup's share of a k-tile
    if real * am * ak != wg_weights:
        raise RuntimeError(f"{real} HGMMA x {am}x{ak} weights do not cover the {wg_weights} weights of a "
                           "consumer warpgroup's k-tile")
    ploop = producer_loop(instrs)
    pst = sass.loop_stats(ploop)
    expect_tx = sum(i.opcode.startswith("SYNCS.ARRIVE.TRANS64") and ".RED" not in i.opcode for i in ploop.instrs)
    waits = sum(i.opcode.startswith("SYNCS.PHASECHK") for i in ploop.instrs)
    if expect_tx != 1:
        raise RuntimeError(f"producer loop [{ploop.start:#x}, {ploop.end:#x}] has {expect_tx} expect-tx arrives, "
                           "not the one of a single pipeline stage (k-tile)")
    tma = _copies(pst.opcode_mix)
    ffma, hmul2, prmt = (_count(st.opcode_mix, op) for op in ("FFMA", "HMUL2", "PRMT"))
    lds_u8 = st.opcode_mix.get("LDS.U8", 0)
    mma = "QGMMA" if act == "e4m3" else "HGMMA"
    groups = k_tile // MXFP4_GROUP_SIZE
    acc_per_thread = wg_rows * n_tile // 128
    consumer_wipw = sass.warp_instr_per_weight(st.instructions, CONSUMER_WARPS, wg_weights)
    total = (wgs * CONSUMER_WARPS * st.instructions + PRODUCER_WARPS * pst.instructions) / weights
    # Local-memory loads and stores in the consumer loop: the spills of a tile whose accumulators do
    # not fit the 232 registers (issue slots counted in `total`, their traffic not charged).
    spill_ops = _count(st.opcode_mix, "LDL", "STL")
    who = (f"the {wgs} x {CONSUMER_WARPS} warps of both consumer warpgroups, {wg_rows} rows each (cooperative)"
           if cooperative else f"the {CONSUMER_WARPS} warps of one consumer warpgroup")
    enclosing = sum(1 for lp in sass.loops(instrs) if lp.start <= loop.start and lp.end >= loop.end and lp != loop)
    mapping = (
        f"one pass of the consumer SASS loop [{loop.start:#x}, {loop.end:#x}] (the mainloop's "
        f"CUTLASS_PRAGMA_NO_UNROLL k-tile loop; first and last k-tile are peeled outside it; inside "
        f"{enclosing} larger loop(s): tile and persistent-scheduler loops) = one k-tile of {k_tile} (K) x "
        f"{m_tile} (M, weight rows; swap_ab) FP4 weights of one expert against {n_tile} tokens = {weights} "
        f"weights, run by {who}; checked: {real} "
        f"{mma}.{am}x{an}x{ak} per warp (expected {wg_rows}/{am} x K/{ak} = {exp}) x {am}x{ak} weights per "
        f"warpgroup {mma} = "
        f"{wg_weights} per warpgroup; plus {placeholders} no-op HGMMA.64x8x16 RZ commit placeholders (counted "
        f"as instructions only). Per pass per thread: "
        + (f"{ffma} FFMA applying the E8M0 scales to the fp32 "
           f"accumulator ({groups} groups of {MXFP4_GROUP_SIZE} x {acc_per_thread} accumulators = "
           f"{groups * acc_per_thread}) and {hmul2} HMUL2.BF16 (x2^126 after the E2M1 bit shuffle, 2 weights "
           f"each: {wg_weights // 128} weights per thread)" if act == "bf16" else
           f"{prmt} PRMT and {lds_u8} LDS.U8 (the E2M1 nibbles become E4M3 bytes with the E8M0 scale folded in "
           f"before the MMA, through byte tables in shared memory: the pre-MMA E8M0 scale mode; "
           f"{wg_weights // 128} weights per thread) and {ffma} FFMA (no scale on the accumulator)")
        + f". The producer warp's loop [{ploop.start:#x}, "
        f"{ploop.end:#x}] ({pst.instructions} instructions: {waits} empty-barrier wait, 1 expect-tx arrive, "
        f"{tma}) loads one pipeline stage = the same k-tile. warp_instr_per_weight = ({wgs * CONSUMER_WARPS} x "
        f"{st.instructions} + {PRODUCER_WARPS} x {pst.instructions}) / {weights}; "
        + ("producer warps 1-3 have no per-k-tile work" if cooperative else
           "the other 7 warps of the CTA (the second consumer warpgroup works on another tile in the same way; "
           "producer warps 1-3 have no per-k-tile work) are not counted"))
    return {"loop": loop, "stats": st, "real_hgmma": wgs * real, "consumer_warpgroups": wgs,
            "placeholders": placeholders, "weights": weights,
            "producer_loop": ploop, "producer_stats": pst, "consumer_per_weight": consumer_wipw,
            "per_weight": total, "mapping": mapping, "scale_ffma": ffma, "convert_hmul2": hmul2,
            "convert_prmt": prmt, "table_lds_u8": lds_u8, "spill_ops": spill_ops,
            "per_weight_without_spills": total - wgs * CONSUMER_WARPS * spill_ops / weights}


def _label(tile: tuple[int, int, int]) -> str:
    return f"{tile[0]}x{tile[1]}x{tile[2]}"


def _toolchain(build_dir: str | os.PathLike) -> tuple[tuple[str, str], Sources, types.ModuleType, pathlib.Path]:
    """What every peer build needs: nvcc (path, version), FlashInfer's sources, its kernel
    generator and the build folder (relative paths under the repository). Raises RuntimeError
    naming what is missing (cuobjdump, nvcc, FlashInfer's sources)."""
    nvcc_cache.require_cuobjdump()
    nvcc = find_nvcc()
    src = find_sources(nvcc)
    out = pathlib.Path(build_dir)
    return nvcc, src, load_generator(src.package_dir), out if out.is_absolute() else REPO_ROOT / out


def _dynamic_shared(kernels: dict[Any, tuple[str, str, int]], src: Sources, nvcc: tuple[str, str],
                    out: pathlib.Path) -> tuple[dict[Any, int], dict[Any, str], dict[str, Build | str]]:
    """The dynamic shared memory each kernel launches with (GemmKernel::SharedStorageSize), read by
    a probe unit naming the kernel's type. kernels: {key: (mangled function, unit name, CTA warps)};
    the probe also checks MaxThreadsPerBlock == 32 x warps. Returns ({key: bytes}, {key: why not},
    the probes' builds by name); a kernel without a demangler or whose probe fails gets a note."""
    from k3nvfp4.kernels.offline import sass

    probes, notes = {}, {}
    for key, (fn, name, _) in kernels.items():
        dem = demangle(fn)
        if dem is None:
            notes[key] = "no demangler (llvm-cxxfilt / c++filt) could demangle the kernel name"
        else:
            probes[f"{name}_smem_probe"] = (key, probe_unit(kernel_type_of(dem)))
    probe_builds = build_all(src, nvcc, {n: t for n, (_, t) in probes.items()}, out, raise_on_error=False)
    dynamic = {}
    for name, (key, _) in probes.items():
        pb = probe_builds[name]
        vals = _probe_values(sass.disassemble(pb.cubin)) if isinstance(pb, Build) else None
        warps = kernels[key][2]
        if vals is None:
            notes[key] = f"SharedStorageSize probe failed: {pb if isinstance(pb, str) else 'no probe kernel'}"[:600]
        elif vals[1] != 32 * warps:
            raise RuntimeError(f"{kernels[key][1]}: MaxThreadsPerBlock {vals[1]} != {32 * warps}")
        else:
            dynamic[key] = vals[0]
    return dynamic, notes, probe_builds


def flashinfer_rows(arch: int = 90, build_dir: str | os.PathLike = "build/peers/flashinfer") -> list[dict[str, Any]]:
    """One row per tile of TILES (pingpong) and COOPERATIVE_TILES, measured on the SASS of
    FlashInfer's own launcher instantiation.

    Raises RuntimeError naming what is missing (FlashInfer's sources, nvcc, Triton's cuobjdump) or
    what failed; the caller reports "not available: <reason>"."""
    if arch != 90:
        raise ValueError("only arch=90 (sm_90a) is modelled: the mixed-input grouped GEMM is Hopper-only")
    from k3nvfp4.kernels.offline import sass

    nvcc, src, gen, out = _toolchain(build_dir)

    tiles = TILES + COOPERATIVE_TILES
    kind = {t: "cooperative" if t in COOPERATIVE_TILES else "warp_specialized" for t in tiles}
    names = {t: f"flashinfer_w4a16_{_label(t)}" + ("_cooperative" if t in COOPERATIVE_TILES else "") for t in tiles}
    builds = build_all(src, nvcc, {names[t]: translation_unit(gen, t, "bf16", kind[t]) for t in tiles}, out)

    found: dict[tuple[int, int, int], dict[str, Any]] = {}
    for tile in tiles:
        b = builds[names[tile]]
        assert isinstance(b, Build)
        usage = sass.resource_usage(b.cubin)
        for fn, instrs in sass.disassemble(b.cubin).items():
            info = parse_kernel_name(fn)
            if info and info["tile"] == tile:
                found[tile] = {"function": fn, "instrs": instrs, "usage": usage[fn], "build": b, "info": info}
        if tile not in found:
            raise RuntimeError(f"no mixed-input device_kernel for tile {tile} in {b.path}")
        _check_schedule(tile, found[tile]["info"], kind[tile])

    dynamic, notes, probe_builds = _dynamic_shared(
        {tile: (f["function"], names[tile], CTA_WARPS) for tile, f in found.items()}, src, nvcc, out)

    rows = []
    for tile in tiles:
        f = found[tile]
        info, usage, b = f["info"], f["usage"], f["build"]
        m = measure(f["instrs"], tile, info["atom_mnk"], cooperative=kind[tile] == "cooperative")
        st, pst = m["stats"], m["producer_stats"]
        dyn = dynamic.get(tile)
        probe = probe_builds.get(f"{names[tile]}_smem_probe")
        rows.append({
            "kernel": KERNEL,
            "kernel_type": kind[tile],
            "regime": f"{'decode' if tile[1] == 16 else 'prefill'} (swap_ab: {tile[0]} weight rows x {tile[1]} "
                      "tokens per expert tile; " + ("FlashInfer's untuned default tactic)" if tile == TILES[0]
                                                     else "an autotuner candidate)"),
            "tile": {"M": tile[0], "N": tile[1], "K": tile[2], "schedule": info["schedule"],
                     "cluster": "x".join(map(str, CLUSTER)), "stages": info["stages"], "mma_atom": info["mma_atom"]},
            "arch": f"sm_{arch}a",
            "instructions_per_iteration": st.instructions,
            "producer_instructions_per_iteration": pst.instructions,
            "weights_per_iteration": m["weights"],
            "num_warps": CTA_WARPS,
            "loop_warps": {"consumer": CONSUMER_WARPS * m["consumer_warpgroups"], "producer": PRODUCER_WARPS},
            "warp_instr_per_weight": round(m["per_weight"], 4),
            "consumer_warp_instr_per_weight": round(m["consumer_per_weight"], 4),
            "hbm_ceiling_pct": round(100 * sass.hbm_ceiling(m["per_weight"]), 1),
            "registers": usage.registers,
            "setmaxnreg": setmaxnreg(f["instrs"]),
            "local_bytes": usage.local_bytes,
            "shared_bytes": None if dyn is None else usage.shared_bytes + dyn,
            "shared_static_bytes": usage.shared_bytes,
            "shared_dynamic_bytes": dyn,
            **({"shared_bytes_note": notes[tile]} if tile in notes else {}),
            "opcode_mix": dict(list(st.opcode_mix.items())[:15]),
            "family_mix": st.family_mix,
            "producer_opcode_mix": pst.opcode_mix,
            "mma_per_iteration": m["real_hgmma"],
            "hgmma_placeholders_per_iteration": m["placeholders"],
            "scale_ffma_per_iteration": m["scale_ffma"],
            "spill_ops_per_iteration": m["spill_ops"],
            "warp_instr_per_weight_without_spills": round(m["per_weight_without_spills"], 4),
            "iteration_mapping": m["mapping"],
            "bytes_per_weight": BYTES_PER_WEIGHT,
            "launches_per_call": len(LAUNCH_SOURCES),
            "launch_sources": list(LAUNCH_SOURCES),
            "requires": REQUIRES,
            "flashinfer_version": src.version,
            "nvcc_version": nvcc[1],
            "nvcc_command": " ".join(b.command),
            "flag_deviations": list(src.deviations),
            "function": f["function"],
            "cubin": str(b.path),
            "compile_seconds": round(b.seconds, 1),
            "recorded_compile_seconds": b.recorded_seconds,  # of the build that made the (cached) cubin
            "probe_compile_seconds": probe.recorded_seconds if isinstance(probe, Build) else None,
            "cached": b.cached,
        })
    return rows


# The W4A8 peer's kernels measured: the W4A16 peer's tiles (TILES, pingpong, and COOPERATIVE_TILES:
# the autotuner's whole 1x1x1-cluster list) and Humming's own single-warpgroup kernels (128 weight
# rows x 16 tokens x 128 K; the binding admits them for Humming only: PREFILL where K <= 384,
# ROLLING above).
W4A8_VARIANTS: tuple[tuple[str, tuple[int, int, int]], ...] = (
    *(("warp_specialized", t) for t in TILES),
    ("single_warpgroup_rolling", (128, 16, 128)), ("single_warpgroup_prefill", (128, 16, 128)),
    *(("cooperative", t) for t in COOPERATIVE_TILES))
# Warps per CTA of Humming's single-warpgroup kernels (no producer warpgroup).
SINGLE_WARPGROUP_WARPS = 4
# Where the binding admits each single-warpgroup kernel: the GEMM's K (PREFILL: K <= 384, ROLLING: above).
SINGLE_WARPGROUP_MAX_K = {"single_warpgroup_prefill": 384}
SINGLE_WARPGROUP_MIN_K = {"single_warpgroup_rolling": 385}


def measure_single_warpgroup(instrs: list[Instr], tile: tuple[int, int, int],
                             atom_mnk: tuple[int, int, int]) -> dict[str, Any]:
    """Humming's single-warpgroup kernel: its 4 warps load (UBLKCP) and multiply in one k-tile
    loop, the smallest loop holding the k-tile's (M / atom M) x (K / atom K) MMAs per warp."""
    from k3nvfp4.kernels.offline import sass

    m_tile, n_tile, k_tile = tile
    am, an, ak = atom_mnk
    if an != n_tile or m_tile % am:
        raise RuntimeError(f"MMA atom {atom_mnk} does not tile {tile}")
    exp = (m_tile // am) * (k_tile // ak)
    loop = consumer_loop(instrs, exp)
    st = sass.loop_stats(loop)
    weights = m_tile * k_tile
    copies = _copies(st.opcode_mix)
    mapping = (f"one pass of the SASS loop [{loop.start:#x}, {loop.end:#x}] = one k-tile of {k_tile} (K) x {m_tile} "
               f"(weight rows) FP4 weights against {n_tile} tokens = {weights} weights, run by the CTA's one "
               f"warpgroup (4 warps), which also issues the k-tile's loads ({copies}); checked: {exp} QGMMA."
               f"{am}x{an}x{ak} per warp (M/{am} x K/{ak}). warp_instr_per_weight = 4 x {st.instructions} / {weights}")
    spill_ops = _count(st.opcode_mix, "LDL", "STL")
    return {"loop": loop, "stats": st, "weights": weights, "real_hgmma": exp, "per_weight": 4 * st.instructions / weights,
            "mapping": mapping, "convert_prmt": _count(st.opcode_mix, "PRMT"),
            "table_lds_u8": st.opcode_mix.get("LDS.U8", 0), "scale_ffma": _count(st.opcode_mix, "FFMA"),
            "spill_ops": spill_ops, "per_weight_without_spills": 4 * (st.instructions - spill_ops) / weights}


def flashinfer_w4a8_rows(build_dir: str | os.PathLike = "build/peers/flashinfer") -> list[dict[str, Any]]:
    """The W4A8 peer (FlashInfer's SM90 MXFP4 x FP8 grouped GEMM, ``use_wfp4afp8_humming``: FP8
    activations, pre-MMA E8M0 scale), built and measured like flashinfer_rows at the kernels of
    W4A8_VARIANTS: one row per kernel (K loop, registers, shared memory, CTA warps, the call's
    launches), what peers/flashinfer_model.flashinfer_w4a8_call predicts from. Raises
    RuntimeError naming what is missing or failed, as flashinfer_rows."""
    from k3nvfp4.kernels.offline import sass

    nvcc, src, gen, out = _toolchain(build_dir)
    names = {v: f"flashinfer_w4a8_{_label(v[1])}" + ("" if v[0] == "warp_specialized" else f"_{v[0]}")
             for v in W4A8_VARIANTS}
    builds = build_all(src, nvcc, {names[v]: translation_unit(gen, v[1], "e4m3", v[0]) for v in W4A8_VARIANTS}, out)
    found = {}
    for kernel_type, tile in W4A8_VARIANTS:
        b = builds[names[(kernel_type, tile)]]
        assert isinstance(b, Build)
        usage = sass.resource_usage(b.cubin)
        hits = [(fn, instrs, info) for fn, instrs in sass.disassemble(b.cubin).items()
                for info in [parse_kernel_name(fn)] if info and info["tile"] == tile]
        if len(hits) != 1:
            raise RuntimeError(f"{len(hits)} mixed-input device_kernels for tile {tile} in {b.path}")
        fn, instrs, info = hits[0]
        if info["scale_mode"] != "pre_mma" or not info["mma_atom"].endswith("E4M3E4M3_RS"):
            raise RuntimeError(f"tile {tile}: {info['mma_atom']} ({info['scale_mode']}) is not the FP8 pre-MMA kernel")
        single = is_single_warpgroup(kernel_type)
        if (info["structure"] == "single_warpgroup") != single:
            raise RuntimeError(f"tile {tile}: a {info['structure']} kernel where {kernel_type} was built")
        if not single:
            _check_schedule(tile, info, kernel_type)
        found[(kernel_type, tile)] = (fn, instrs, info, usage[fn], b,
                                      SINGLE_WARPGROUP_WARPS if single else CTA_WARPS)
    dynamic, notes, _ = _dynamic_shared({v: (f[0], names[v], f[5]) for v, f in found.items()}, src, nvcc, out)
    rows = []
    for (kernel_type, tile), (fn, instrs, info, use, b, warps) in found.items():
        single = is_single_warpgroup(kernel_type)
        if single:
            m = measure_single_warpgroup(instrs, tile, info["atom_mnk"])
            st, pst = m["stats"], None
        else:
            m = measure(instrs, tile, info["atom_mnk"], act="e4m3", cooperative=kernel_type == "cooperative")
            st, pst = m["stats"], m["producer_stats"]
        dyn = dynamic.get((kernel_type, tile))
        rows.append({
            "kernel": "flashinfer_cutlass_w4a8_moe (MXFP4 x FP8, pre-MMA E8M0)",
            "kernel_type": kernel_type,
            "tile": {"M": tile[0], "N": tile[1], "K": tile[2], "schedule": info["schedule"],
                     "cluster": "x".join(map(str, CLUSTER)), "stages": info["stages"], "mma_atom": info["mma_atom"]},
            "arch": "sm_90a",
            "instructions_per_iteration": st.instructions,
            "producer_instructions_per_iteration": pst.instructions if pst else None,
            "weights_per_iteration": m["weights"],
            "warp_instr_per_weight": round(m["per_weight"], 4),
            "consumer_warp_instr_per_weight": None if single else round(m["consumer_per_weight"], 4),
            "num_warps": warps,
            "registers": use.registers,
            "local_bytes": use.local_bytes,
            "shared_bytes": None if dyn is None else use.shared_bytes + dyn,
            **({"shared_bytes_note": notes[(kernel_type, tile)]} if (kernel_type, tile) in notes else {}),
            "max_k": SINGLE_WARPGROUP_MAX_K.get(kernel_type),
            "min_k": SINGLE_WARPGROUP_MIN_K.get(kernel_type),
            "mma_per_iteration": m["real_hgmma"],
            "convert_prmt_per_iteration": m["convert_prmt"],
            "table_lds_u8_per_iteration": m["table_lds_u8"],
            "scale_ffma_per_iteration": m["scale_ffma"],
            "spill_ops_per_iteration": m["spill_ops"],
            "warp_instr_per_weight_without_spills": round(m["per_weight_without_spills"], 4),
            "opcode_mix": dict(list(st.opcode_mix.items())[:15]),
            "iteration_mapping": m["mapping"],
            "bytes_per_weight": BYTES_PER_WEIGHT,
            # runMoe takes the W4A16 path's branches; the FP8 quantization (one fp32 scale per row)
            # is fused into the permute (expandInputRowsKernel) and the activation (doActivation).
            "launches_per_call": len(LAUNCH_SOURCES),
            "requires": REQUIRES,
            "flashinfer_version": src.version,
            "nvcc_version": nvcc[1],
            "nvcc_command": " ".join(b.command),
            "function": fn,
            "compile_seconds": round(b.seconds, 1),
            "cached": b.cached,
        })
    return rows


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description="FlashInfer's SM90 MXFP4 MoE GEMMs, measured on their SASS (JSON rows)")
    ap.add_argument("--act", choices=ACTS, default="bf16",
                    help="bf16: the W4A16 peer's rows (default); e4m3: the W4A8 peer's rows")
    sys.exit(nvcc_cache.print_rows(flashinfer_w4a8_rows if ap.parse_args().act == "e4m3" else flashinfer_rows))
