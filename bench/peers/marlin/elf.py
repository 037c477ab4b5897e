"""What libk3marlin.so exports and links against, read from the ELF with binutils (no GPU, no
import of the library): build.py writes EXPORTS into the version script, selfcheck.py compares the
built library with it. A module of its own so that neither of those imports the other for it."""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

EXPORTS = ("k3m_abi_version", "k3m_build_info", "k3m_last_error", "k3m_cuda_versions", "k3m_repack_fp4",
           "k3m_moe_align_block_size", "k3m_moe_align_single_token", "k3m_marlin_gemm", "k3m_moe_topk_sum")


def exported_symbols(lib: pathlib.Path) -> list[str]:
    """Defined dynamic symbols of the library (nm -D --defined-only)."""
    nm = shutil.which("nm")
    if nm is None:
        raise RuntimeError("nm (binutils) not found")
    out = subprocess.run([nm, "-D", "--defined-only", str(lib)], capture_output=True, text=True, check=True).stdout
    return sorted(line.split()[-1] for line in out.splitlines() if line.strip() and line.split()[-2] in "TtDdBbRrVvWw")


def needed_libraries(lib: pathlib.Path) -> list[str]:
    """DT_NEEDED entries (readelf -d)."""
    readelf = shutil.which("readelf")
    if readelf is None:
        raise RuntimeError("readelf (binutils) not found")
    out = subprocess.run([readelf, "-d", str(lib)], capture_output=True, text=True, check=True).stdout
    return sorted(line.split("[")[1].split("]")[0] for line in out.splitlines() if "(NEEDED)" in line)


def max_glibc(lib: pathlib.Path) -> str:
    """Highest GLIBC_x.y symbol version the library needs (objdump -T)."""
    objdump = shutil.which("objdump")
    if objdump is None:
        raise RuntimeError("objdump (binutils) not found")
    out = subprocess.run([objdump, "-T", str(lib)], capture_output=True, text=True, check=True).stdout
    vers = {tuple(int(x) for x in v.split(".")) for v in re.findall(r"\bGLIBC_(2(?:\.\d+)+)\b", out)}
    return "GLIBC_" + ".".join(map(str, max(vers))) if vers else "none"
