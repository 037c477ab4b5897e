"""Build libk3marlin.so: SGLang's marlin MoE path for NVFP4 behind a small C ABI (sm_90a).

The library is compiled on a machine that has the installed sglang package (its JIT CUDA
sources) and nvcc, and carried to the GPU machine as ONE file (no sglang, no tvm-ffi, no CUDA
toolkit needed there: cudart and libstdc++ are linked statically; only the driver is used).

Translation units (our sources in ``src/``, each #including SGLang's own files from the
installed package; nothing of SGLang is copied into this repository):

  gemm.cu      x4  moe_wna16_marlin_gemm<bf16, kIsEP, ..., kZeroInactiveOutput, ...> for the
                   two flag sets fused_marlin_moe uses per GEMM (TP: sorted ids + inactive-prefix
                   count; EP: neither) x (GEMM1, GEMM2 with kZeroInactiveOutput), restricted to the
                   NVFP4 kernel list (SGLang's NVFP4_GET_IF: 10 tiles each)
  repack.cu        gptq_marlin_repack (the weight repack SGLang runs at load time)
  align.cu         MoeAlignBlockSizeKernel + AlignSingleTokenKernel (routing alignment)
  topk_sum.cu      TopkSumKernel (the top-k sum, --use_fast_math as SGLang's JIT builds it)
  api.cu           the exported k3m_* functions (argument checks, error codes)

Flags: SGLang's JIT flags for sm_90a (``marlin_sass.nvcc_flags``). The build is cached by a
key over every input (SGLang's sources, ours, nvcc version, flags): an unchanged key reuses
``build/peers/marlin/lib/libk3marlin.so``.

  python -P bench/peers/marlin/build.py            # build (or reuse) and print the build info
  python -P bench/peers/marlin/build.py --check    # + exported symbols, linkage, argument checks
"""

from __future__ import annotations

import argparse
import concurrent.futures
import hashlib
import json
import os
import pathlib
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

HERE = pathlib.Path(__file__).resolve().parent
SRC = HERE / "src"
REPO_ROOT = HERE.parents[2]
if str(REPO_ROOT / "bench") not in sys.path:
    sys.path.insert(0, str(REPO_ROOT / "bench"))

from peers.marlin.elf import EXPORTS  # noqa: E402  (the ABI the version script exports)
from peers import marlin_sass  # noqa: E402  (source discovery and SGLang's JIT flags)

LIB_NAME = "libk3marlin.so"
DEFAULT_BUILD_DIR = REPO_ROOT / "build" / "peers" / "marlin"
ARCH = 90
# SGLang files the units include (beyond kernels/jit/include/sgl_kernel, hashed whole).
SGLANG_CSRC = ("gemm/marlin_moe/moe_wna16_marlin.cuh", "gemm/marlin_moe/marlin_template.h", "gemm/marlin_moe/kernel.h",
               "gemm/marlin/marlin.cuh", "gemm/marlin/marlin_dtypes.cuh", "gemm/marlin/dequant.h",
               "gemm/marlin/gptq_marlin_repack.cuh", "moe/moe_align_kernel.cu", "moe/align_single_token.cuh",
               "moe/topk_sum.cuh")
OUR_SOURCES = ("k3marlin_internal.h", "api.cu", "gemm.cu", "repack.cu", "align.cu", "topk_sum.cu")


@dataclass(frozen=True)
class Unit:
    name: str
    source: str
    defines: tuple[str, ...] = ()
    extra_flags: tuple[str, ...] = ()


UNITS = (
    Unit("gemm_ep0_z0", "gemm.cu", ("-DK3M_IS_EP=0", "-DK3M_ZERO_INACTIVE=0")),
    Unit("gemm_ep0_z1", "gemm.cu", ("-DK3M_IS_EP=0", "-DK3M_ZERO_INACTIVE=1")),
    Unit("gemm_ep1_z0", "gemm.cu", ("-DK3M_IS_EP=1", "-DK3M_ZERO_INACTIVE=0")),
    Unit("gemm_ep1_z1", "gemm.cu", ("-DK3M_IS_EP=1", "-DK3M_ZERO_INACTIVE=1")),
    Unit("repack", "repack.cu"),
    Unit("align", "align.cu"),
    Unit("topk_sum", "topk_sum.cu", extra_flags=("--use_fast_math",)),  # SGLang's JIT builds it so
    Unit("api", "api.cu"),
)


@dataclass
class BuildResult:
    path: pathlib.Path
    cached: bool
    seconds: float
    info: dict

    @property
    def size_bytes(self) -> int:
        return self.path.stat().st_size


def _jit_root(src: marlin_sass.Sources) -> pathlib.Path:
    return src.gemm_dir.parents[1]  # .../sglang/kernels/jit


def _include_dirs(src: marlin_sass.Sources) -> list[pathlib.Path]:
    # SGLang's JIT include dirs (jit/include, tvm_ffi headers) + jit/csrc for the "gemm/...", "moe/..." paths.
    return [_jit_root(src) / "csrc", *src.include_dirs, SRC]


def _compile_flags(src: marlin_sass.Sources, unit: Unit, gen_dir: pathlib.Path) -> list[str]:
    # SGLang's JIT headers define non-inline functions and tables (one JIT module = one unit), so
    # each unit renames SGLang's namespace to its own (the macro reaches every use, ours included).
    rename = [] if unit.name == "api" else [f"-Dsglang=k3m_sglang_{unit.name}"]
    return [*marlin_sass.nvcc_flags(ARCH), "-Xcompiler", "-fPIC", "-Xcompiler", "-fvisibility=hidden",
            *rename, *unit.defines, *unit.extra_flags, *(f"-I{d}" for d in (gen_dir, *_include_dirs(src)))]


def _link_flags(version_script: pathlib.Path) -> list[str]:
    # Static cudart (nvcc's default, spelled out): the GPU machine needs only the driver (and the
    # libstdc++ / libgcc_s every torch process has loaded already). A static libstdc++ from this
    # Debian 12 toolchain would need glibc 2.36 (arc4random); dynamic, the library needs glibc
    # 2.34 and GLIBCXX_3.4.29 (checked by selfcheck). The version script exports k3m_* only.
    return ["-shared", "--cudart", "static", f"-gencode=arch=compute_{ARCH}a,code=sm_{ARCH}a",
            "-Xlinker", f"--version-script={version_script}", "-Xlinker", "--no-undefined", "-Xlinker", "-Bsymbolic"]


def build_key(src: marlin_sass.Sources, nvcc: tuple[str, str]) -> dict:
    """Everything the library depends on: an equal key means the cached library is this build."""
    h = hashlib.sha256()
    jit = _jit_root(src)
    files = [jit / "csrc" / f for f in SGLANG_CSRC]
    files += sorted(p for p in (jit / "include" / "sgl_kernel").rglob("*") if p.is_file())
    for p in files:
        h.update(str(p.relative_to(jit)).encode())
        h.update(p.read_bytes())
    ours = hashlib.sha256()
    for f in OUR_SOURCES:
        ours.update(f.encode())
        ours.update((SRC / f).read_bytes())
    return {"sglang_version": src.version, "sglang_sources_sha256": h.hexdigest(), "our_sources_sha256": ours.hexdigest(),
            "build_script_sha256": hashlib.sha256(pathlib.Path(__file__).read_bytes()).hexdigest(),
            "nvcc_version": nvcc[1], "arch": f"sm_{ARCH}a", "flags": marlin_sass.nvcc_flags(ARCH)}


def _key_id(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def _cached(lib: pathlib.Path, sidecar: pathlib.Path, key: dict) -> dict | None:
    if not (lib.is_file() and sidecar.is_file()):
        return None
    try:
        info = json.loads(sidecar.read_text())
    except (OSError, ValueError):
        return None
    return info if info.get("key") == key else None


def build(build_dir: str | os.PathLike = DEFAULT_BUILD_DIR, jobs: int | None = None, force: bool = False,
          log=print) -> BuildResult:
    """Build (or reuse) libk3marlin.so under ``build_dir/lib``; RuntimeError naming what is missing or failed."""
    src = marlin_sass.find_sources()
    nvcc = marlin_sass.find_nvcc()
    root = pathlib.Path(build_dir)
    lib_dir, obj_dir = root / "lib", root / "obj"
    lib, sidecar = lib_dir / LIB_NAME, lib_dir / "libk3marlin.json"
    key = build_key(src, nvcc)
    if not force and (info := _cached(lib, sidecar, key)) is not None:
        return BuildResult(lib, True, 0.0, info)

    t0 = time.monotonic()
    obj_dir.mkdir(parents=True, exist_ok=True)
    lib_dir.mkdir(parents=True, exist_ok=True)
    info = {"library": LIB_NAME, "abi_version": 1, "build_id": _key_id(key), "key": key,
            "built_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "units": [asdict(u) for u in UNITS], "exports": list(EXPORTS),
            "note": "SGLang's marlin MoE (NVFP4, bf16 activations) + gptq_marlin_repack + moe_align_block_size "
                    "+ moe_align_single_token + moe_topk_sum, from the installed sglang's JIT sources"}
    # The info travels inside the library (k3m_build_info), so the GPU run can report it.
    gen = obj_dir / "gen"
    gen.mkdir(exist_ok=True)
    (gen / "k3marlin_build_info.h").write_text(f"#pragma once\n#define K3M_BUILD_INFO {json.dumps(json.dumps(info))}\n")
    script = gen / "exports.map"
    script.write_text("{\n  global:\n" + "".join(f"    {s};\n" for s in EXPORTS) + "  local:\n    *;\n};\n")

    def compile_unit(u: Unit) -> tuple[Unit, float | None]:
        obj, objkey = obj_dir / f"{u.name}.o", obj_dir / f"{u.name}.key.json"
        cmd = [nvcc[0], "-c", *_compile_flags(src, u, gen), "-o", str(obj), str(SRC / u.source)]
        # An object is reused when its inputs are unchanged (the build info header only reaches api).
        ukey = {k: key[k] for k in ("sglang_sources_sha256", "our_sources_sha256", "nvcc_version")}
        ukey["command"] = cmd
        if u.name == "api":
            ukey["build_info"] = info["build_id"]
        if obj.is_file() and objkey.is_file() and json.loads(objkey.read_text()) == ukey:
            return u, None
        objkey.unlink(missing_ok=True)
        s = time.monotonic()
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
        if p.returncode != 0:
            raise RuntimeError(f"nvcc failed on {u.name} ({u.source}):\n{' '.join(cmd)}\n{(p.stdout + p.stderr)[-4000:]}")
        objkey.write_text(json.dumps(ukey))
        return u, time.monotonic() - s

    jobs = jobs or max(1, min(len(UNITS), os.cpu_count() or 1))
    unit_seconds = {}
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        for u, secs in pool.map(compile_unit, UNITS):
            unit_seconds[u.name] = None if secs is None else round(secs, 1)
            log(f"  {u.name:<12} " + ("object reused" if secs is None else f"compiled in {secs:.1f} s"))
    tmp = lib_dir / f".{LIB_NAME}.tmp"
    cmd = [nvcc[0], *_link_flags(script), "-o", str(tmp), *(str(obj_dir / f"{u.name}.o") for u in UNITS)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        raise RuntimeError(f"link failed:\n{' '.join(cmd)}\n{(p.stdout + p.stderr)[-4000:]}")
    os.replace(tmp, lib)
    seconds = time.monotonic() - t0
    info["build_seconds"] = round(seconds, 1)
    info["unit_seconds"] = unit_seconds
    info["jobs"] = jobs
    info["size_bytes"] = lib.stat().st_size
    sidecar.write_text(json.dumps(info, indent=1) + "\n")
    return BuildResult(lib, False, seconds, info)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--build-dir", default=str(DEFAULT_BUILD_DIR))
    p.add_argument("--force", action="store_true", help="rebuild even when the cache key matches")
    p.add_argument("--check", action="store_true", help="also check exports, linkage and argument checking")
    p.add_argument("--jobs", type=int, default=None)
    p.add_argument("--json", default=None, help="with --check: write the check report here")
    args = p.parse_args(argv)
    try:
        res = build(args.build_dir, jobs=args.jobs, force=args.force)
    except RuntimeError as e:
        print(f"libk3marlin: not built: {e}", file=sys.stderr)
        return 2
    print(f"libk3marlin: {res.path} ({res.size_bytes / 2**20:.2f} MiB, "
          f"{'cached' if res.cached else f'built in {res.seconds:.0f} s'}), build {res.info['build_id']}, "
          f"sglang {res.info['key']['sglang_version']}, nvcc {res.info['key']['nvcc_version']}, {res.info['key']['arch']}")
    if not args.check:
        return 0
    from peers.marlin import selfcheck

    return selfcheck.main(["--lib", str(res.path), *(["--json", args.json] if args.json else [])])


if __name__ == "__main__":
    sys.exit(main())
