"""Checks of libk3marlin.so that need no GPU: exports, linkage, build info, argument checking.

  python -P bench/peers/marlin/selfcheck.py [--lib PATH] [--json OUT]

Argument checking: each bad call must return the "bad argument" code with a message naming the
argument, before any CUDA call (the pointers passed are fake, never dereferenced). On a machine
without a CUDA device a call with valid arguments must get past every check, ours and SGLang's
own host checks (tensor shapes, dtypes, flags), and fail at its first CUDA call: that shows the
checks come first and that the tensors the library describes to SGLang are the ones it expects. On a GPU machine that probe is not
made (it would launch kernels on fake pointers); the bench and the GPU test run real calls.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

HERE = pathlib.Path(__file__).resolve().parent
if str(HERE.parents[1]) not in sys.path:
    sys.path.insert(0, str(HERE.parents[1]))

from peers.marlin import elf as _elf  # noqa: E402
from peers.marlin.lib import EARG, ESGLANG, MarlinLib  # noqa: E402

ALLOWED_NEEDED = {"libc.so.6", "ld-linux-x86-64.so.2", "libstdc++.so.6", "libgcc_s.so.1", "libm.so.6",
                  "libdl.so.2", "libpthread.so.0", "librt.so.1"}
MAX_GLIBC = (2, 34)  # pthread_* symbols of glibc >= 2.34 (cudart static): Ubuntu 22.04+, Debian 12+

A = 0x10000  # a fake, 16-byte aligned device address (never dereferenced)


def gemm_args(**over) -> list:
    """A valid k3m_marlin_gemm argument list (TP16 decode GEMM1 shape) with overrides by name."""
    v = dict(device=0, stream=0, a=A, c=A, b_q=A, b_scales=A, global_scale=A, workspace=A, workspace_numel=528,
             sorted_ids=A, sorted_numel=128, expert_ids=A, expert_ids_numel=16, num_post=A, num_post_numel=2,
             topk_weights=A, c_tmp=None, c_tmp_numel=0, num_experts=896, moe_block_size=8, top_k=16, size_m=1,
             size_n=384, size_k=3584, mul_topk_weights=0, is_ep=0, zero_inactive_output=0, use_atomic_add=1,
             use_fp32_reduce=1)
    unknown = set(over) - set(v)
    if unknown:
        raise KeyError(unknown)
    v.update(over)
    return list(v.values())


# (function, arguments, substring the message must contain)
BAD_CALLS = [
    ("k3m_marlin_gemm", gemm_args(a=None), "a is a null pointer"),
    ("k3m_marlin_gemm", gemm_args(c=A + 8), "is not 16-byte aligned"),
    ("k3m_marlin_gemm", gemm_args(b_scales=None), "b_scales is a null pointer"),
    ("k3m_marlin_gemm", gemm_args(size_n=100), "size_n = 100"),
    ("k3m_marlin_gemm", gemm_args(size_k=3600), "size_k = 3600"),
    ("k3m_marlin_gemm", gemm_args(moe_block_size=24), "moe_block_size = 24"),
    ("k3m_marlin_gemm", gemm_args(num_post_numel=1), "num_tokens_post_padded holds 1"),
    ("k3m_marlin_gemm", gemm_args(expert_ids_numel=3), "expert_ids holds 3"),
    ("k3m_marlin_gemm", gemm_args(mul_topk_weights=1), "mul_topk_weights needs top_k == 1"),
    ("k3m_marlin_gemm", gemm_args(use_atomic_add=0), "c_tmp is empty"),
    ("k3m_marlin_gemm", gemm_args(device=-1), "device = -1"),
    ("k3m_repack_fp4", [0, 0, A, A, 4, 256, 96], "size_n = 96"),
    ("k3m_repack_fp4", [0, 0, A, None, 4, 256, 128], "out is a null pointer"),
    ("k3m_repack_fp4", [0, 0, A, A, 0, 256, 128], "num_experts = 0"),
    ("k3m_moe_align_block_size", [0, 0, A, 64, 9000, 8, A, 1024, A, 128, A, 2, A, 9001, 1], "num_buckets = 9000"),
    ("k3m_moe_align_block_size", [0, 0, A, 64, 897, 8, A, 100, A, 128, A, 2, A, 898, 1], "sorted_ids holds 100"),
    ("k3m_moe_align_block_size", [0, 0, A, 64, 897, 8, A, 512, A, 64, A, 1, A, 898, 1], "num_tokens_post_pad holds 1"),
    ("k3m_moe_align_block_size", [0, 0, A, 64, 897, 8, A + 4, 512, A, 64, A, 2, A, 898, 1], "sorted_ids = "),
    ("k3m_moe_align_single_token", [0, 0, A, 33, 8, A, 264, A, 33, A, 2, 1], "topk = 33"),
    ("k3m_moe_align_single_token", [0, 0, A, 16, 8, A, 100, A, 16, A, 2, 1], "sorted_ids holds 100"),
    ("k3m_moe_topk_sum", [0, 0, A, A, 4, 16, 12], "k = 12"),
    ("k3m_moe_topk_sum", [0, 0, None, A, 4, 16, 64], "in is a null pointer"),
]
# Valid arguments: past every check (only probed where no CUDA device exists).
# (function, arguments, the SGLang source whose host code must report the CUDA failure)
GOOD_CALLS = [
    ("k3m_marlin_gemm", gemm_args(), "moe_wna16_marlin.cuh"),
    ("k3m_marlin_gemm", gemm_args(is_ep=1, num_post_numel=1, num_experts=56, size_n=6144, zero_inactive_output=1),
     "moe_wna16_marlin.cuh"),
    ("k3m_marlin_gemm", gemm_args(size_m=16, top_k=1, mul_topk_weights=1, zero_inactive_output=1, size_n=3584,
                                  size_k=192), "moe_wna16_marlin.cuh"),
    ("k3m_repack_fp4", [0, 0, A, A, 4, 256, 128], "gptq_marlin_repack.cuh"),
    ("k3m_moe_align_block_size", [0, 0, A, 64, 897, 8, A, 512, A, 64, A, 2, A, 898, 1], "moe_align_kernel.cu"),
    ("k3m_moe_align_single_token", [0, 0, A, 16, 8, A, 128, A, 16, A, 2, 1], "align_single_token.cuh"),
    ("k3m_moe_topk_sum", [0, 0, A, A, 4, 16, 3584], "topk_sum.cuh"),
]


def linkage(lib_path: pathlib.Path) -> dict:
    """Exported symbols, DT_NEEDED, glibc requirement (binutils); 'not checked: why' without them."""
    out: dict = {"size_bytes": lib_path.stat().st_size}
    try:
        out["exports"] = _elf.exported_symbols(lib_path)
        out["needed"] = _elf.needed_libraries(lib_path)
        out["max_glibc"] = _elf.max_glibc(lib_path)
    except Exception as e:  # binutils may be missing on the GPU machine: reported, not fatal
        out["not_checked"] = f"{type(e).__name__}: {e}"
    return out


def run_checks(lib_path: str | None = None, cuda_present: bool | None = None) -> dict:
    """All checks; returns a report with 'failures' (empty when everything passed)."""
    lib = MarlinLib(lib_path)
    if cuda_present is None:
        import torch

        cuda_present = torch.cuda.is_available()
    rep: dict = {"library": str(lib.path), "build": {k: lib.info.get(k) for k in ("build_id", "built_utc", "key")},
                 "failures": []}
    fail = rep["failures"].append
    try:
        rep["cuda_driver"], rep["cuda_runtime"] = lib.cuda_versions()
    except Exception as e:  # no driver on a CPU box: the runtime version still comes back
        rep["cuda_versions_error"] = str(e)
    rep["linkage"] = link = linkage(lib.path)
    if "exports" in link:
        if link["exports"] != sorted(_elf.EXPORTS):
            fail(f"exports {link['exports']} != {sorted(_elf.EXPORTS)}")
        extra = set(link["needed"]) - ALLOWED_NEEDED
        if extra:
            fail(f"unexpected shared-library dependencies {sorted(extra)} (cudart / tvm-ffi must not be needed)")
        g = tuple(int(x) for x in link["max_glibc"].split("_")[1].split("."))
        if g > MAX_GLIBC:
            fail(f"needs {link['max_glibc']}, above GLIBC_{'.'.join(map(str, MAX_GLIBC))}")
    raw = lib.raw
    rep["bad_calls"] = []
    for name, args, expect in BAD_CALLS:
        code = getattr(raw, name)(*args)
        msg = raw.k3m_last_error().decode()
        rep["bad_calls"].append({"function": name, "code": code, "message": msg})
        if code != EARG or expect not in msg or not msg.startswith(name):
            fail(f"{name}{tuple(args)}: expected code {EARG} with {expect!r}, got {code}: {msg!r}")
    if raw.k3m_cuda_versions(None, None) != EARG:
        fail("k3m_cuda_versions(NULL, NULL) did not return the bad-argument code")
    rep["good_calls"] = []
    if not cuda_present:
        for name, args, source in GOOD_CALLS:
            code = getattr(raw, name)(*args)
            msg = raw.k3m_last_error().decode()
            rep["good_calls"].append({"function": name, "code": code, "message": msg})
            # past our checks and SGLang's own host checks, stopped by the first CUDA call
            if code != ESGLANG or "CUDA error" not in msg or source not in msg:
                fail(f"{name} with valid arguments: expected a CUDA error (no device here), got {code}: {msg!r}")
    if link.get("size_bytes", 0) >= 32 * 2**20:
        fail(f"{link['size_bytes']} bytes: the library must stay under 32 MiB (it travels in the 64 MiB working tree)")
    key = rep["build"].get("key") or {}
    if key.get("arch") != "sm_90a" or not key.get("sglang_version") or not key.get("nvcc_version"):
        fail(f"build key {key}: expected arch sm_90a with the sglang and nvcc versions")
    if (rep.get("cuda_runtime") or 0) < 12000:
        fail(f"CUDA runtime {rep.get('cuda_runtime')} < 12000")
    rep["wrapper_checks"] = wrapper_failures(lib)
    rep["failures"] += rep["wrapper_checks"]
    return rep


def wrapper_failures(lib: MarlinLib) -> list[str]:
    """The Python wrapper refuses bad tensors naming them, before any CUDA call."""
    import torch

    E, K, N = 2, 256, 128
    t = torch.zeros(E, K // 8, N, dtype=torch.int32)
    cases = [((t.float(), torch.zeros(E, K // 16, 2 * N, dtype=torch.int32), K, N), "qweight_t: expected dtype torch.int32"),
             ((t, torch.zeros(E, K // 16, N, dtype=torch.int32), K, N), "out: expected shape (2, 16, 256)"),
             ((t, torch.zeros(E, K // 16, 2 * N, dtype=torch.int32), K, N), "CUDA device")]
    out = []
    for args, expect in cases:
        try:
            lib.repack_fp4(*args)
        except ValueError as e:
            if expect not in str(e):
                out.append(f"repack_fp4: expected a ValueError with {expect!r}, got {e}")
        else:
            out.append(f"repack_fp4: expected a ValueError with {expect!r}, got no error")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--lib", default=None)
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    try:
        rep = run_checks(args.lib)
    except Exception as e:
        print(f"libk3marlin selfcheck: cannot run: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    key = rep["build"].get("key") or {}
    link = rep["linkage"]
    print(f"libk3marlin {rep['library']}: build {rep['build'].get('build_id')} ({rep['build'].get('built_utc')}), "
          f"nvcc {key.get('nvcc_version')}, {key.get('arch')}, sglang {key.get('sglang_version')}, "
          f"{link['size_bytes'] / 2**20:.2f} MiB")
    print(f"  CUDA runtime (static) {rep.get('cuda_runtime')}, driver {rep.get('cuda_driver')}"
          + (f" ({rep['cuda_versions_error']})" if "cuda_versions_error" in rep else ""))
    if "exports" in link:
        print(f"  exports: {', '.join(link['exports'])}")
        print(f"  needs: {', '.join(link['needed'])}; max {link['max_glibc']}")
    else:
        print(f"  linkage {link['not_checked']}")
    print(f"  argument checks: {len(rep['bad_calls'])} bad calls refused"
          + (f", {len(rep['good_calls'])} valid calls reached their first CUDA call" if rep["good_calls"] else
             " (valid-argument probe not made: a CUDA device is present)"))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(rep, indent=1) + "\n")
    for f in rep["failures"]:
        print(f"FAILED: {f}", file=sys.stderr)
    print("selfcheck " + ("FAILED" if rep["failures"] else "passed"))
    return 1 if rep["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
