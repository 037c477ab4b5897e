"""Compile a W4A8 probe GEMM for sm90 WITHOUT a GPU and report its MMA and hot-loop statics: 4-bit
weights (packed E2M1 nibbles + one exponent offset per 32) expanded in registers to E4M3 by
moe_details/e4m3_expand.py, as the FIRST tl.dot operand, times FP8 activations loaded from memory.
The groundwork of the Hopper W4A8 mode (docs/w4a8.md): it shows that the expansion compiles and that
the GEMM gets FP8 wgmma (`.e4m3.e4m3`), and measures what the expansion costs per weight.
:func:`measure_w4a8_gemm` measures the mode's shipped GEMMs for bench/sass_report.py (its e4m3
rows, which tests/test_launch_configs.py and tests/test_memory_ordering.py check) and for the cost
table (offline/costs.py). Run it with TRITON_INTERPRET unset:

    python -P -m k3nvfp4.kernels.offline.compile_w4a8 [--block-n 64 --block-m 64 --block-k 128]

``--mode`` compiles the mode's own GEMMs instead (moe_w4a8_details/kernels.py: GEMM1 with SiTU and
the intermediate's quantization, GEMM2 with the skeleton's top-k combine, at the W4A8Config tiles
of W4A8_CONFIGS, K3 TP16 shapes) and reports each one's wgmma forms, registers and spills:

    python -P -m k3nvfp4.kernels.offline.compile_w4a8 --mode
"""

from __future__ import annotations

import argparse
import json
import re
import sys

import triton
import triton.language as tl

from ..moe_details.e4m3_expand import expand_e2m1_to_e4m3, is_normal_table
from ..moe_w4a8_details.kernels import _expanded_weights
from .compile import _require_compiler, compile_kernel

# The FP8 wgmma of Hopper: K = 32 per instruction, fp32 accumulators, E4M3 x E4M3.
WGMMA_E4M3 = re.compile(r"wgmma\.mma_async\.sync\.aligned\.m64n(\d+)k32\.f32\.e4m3\.e4m3")
# A from registers: the operand after the accumulator list is a second {...} register list.
_A_IN_REGISTERS = re.compile(r"\.e4m3\.e4m3\s*\{[^}]*\},\s*\{")


def fp8_wgmma_facts(ptx: str) -> dict:
    """What a compiled GEMM's PTX says about its MMA: the FP8 wgmma forms and count, any bf16 wgmma
    (a decomposition), and whether the first operand comes from registers."""
    return {"wgmma_forms": sorted({m.group(0) for m in WGMMA_E4M3.finditer(ptx)}),
            "wgmma_e4m3_in_ptx": len(WGMMA_E4M3.findall(ptx)),
            "wgmma_bf16_in_ptx": len(re.findall(r"wgmma\.mma_async[^;]*\.bf16\.bf16", ptx)),
            "a_in_registers": bool(_A_IN_REGISTERS.search(ptx))}


def _function_loop(cubin: bytes, name_part: str):
    """(name, sass.ResourceUsage, sass.LoopStats) of the cubin's function whose name holds
    ``name_part``: its registers and spills, and its hot loop."""
    from . import sass

    funcs = sass.disassemble(cubin)
    name = next(n for n in funcs if name_part in n)
    return name, sass.resource_usage(cubin)[name], sass.loop_stats(sass.hot_loop(funcs[name]))


@triton.jit
def w4a8_probe_kernel(w_ptr, off_ptr, x_ptr, out_ptr, K, M, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    """out fp32 [N, M] = (E2M1 x 2^offset) [N, K] @ x [K, M]: w_ptr uint8 [N, K/2] (low nibble the
    even element), off_ptr int8 [N, K/32] in [-8, 6], x_ptr E4M3 [K, M] row-major. One program per
    BLOCK_N rows (the weights on the MMA's M side, as the W4A8 mode puts them)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        packed = tl.load(w_ptr + rn[:, None] * (K // 2) + (k0 // 2 + tl.arange(0, BLOCK_K // 2))[None, :])
        codes = tl.join(packed & 0xF, packed >> 4).reshape(BLOCK_N, BLOCK_K)  # even element first
        off = tl.load(off_ptr + rn[:, None] * (K // 32) + (k0 // 32 + tl.arange(0, BLOCK_K // 32))[None, :])
        off = tl.broadcast_to(off.to(tl.int32)[:, :, None], (BLOCK_N, BLOCK_K // 32, 32)).reshape(BLOCK_N, BLOCK_K)
        w = expand_e2m1_to_e4m3(codes, off).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
        x = tl.load(x_ptr + (k0 + tl.arange(0, BLOCK_K))[:, None] * M + rm[None, :])
        acc = tl.dot(w, x, acc)
    tl.store(out_ptr + rn[:, None] * M + rm[None, :], acc)


def compile_probe(block_n: int = 64, block_m: int = 64, block_k: int = 128, num_warps: int = 4,
                  num_stages: int = 3, arch: int = 90):
    """Triton's CompiledKernel of the probe for sm<arch> (asm: ttgir, ptx, cubin)."""
    _require_compiler()
    args = dict(w_ptr="*u8", off_ptr="*i8", x_ptr="*fp8e4nv", out_ptr="*fp32", K=3584, M=block_m)
    consts = dict(BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_K=block_k)
    return compile_kernel(w4a8_probe_kernel, args, consts, arch, num_warps, num_stages)


def probe_report(block_n: int = 64, block_m: int = 64, block_k: int = 128, num_warps: int = 4,
                 num_stages: int = 3) -> dict:
    """Compile the probe for sm90 and measure it: the wgmma forms in the PTX, whether A comes
    from registers, and the hot loop's SASS (instructions per warp, per weight, the opcode mix)."""
    from . import sass

    c = compile_probe(block_n, block_m, block_k, num_warps, num_stages)
    name, ru, st = _function_loop(c.asm["cubin"], "w4a8_probe")
    weights = block_n * block_k
    return {
        "kernel": name, "block_n": block_n, "block_m": block_m, "block_k": block_k, "num_warps": num_warps,
        "num_stages": num_stages, "triton": triton.__version__, **fp8_wgmma_facts(c.asm["ptx"]),
        "registers": ru.registers, "local_bytes": ru.local_bytes, "shared_bytes": c.metadata.shared,
        "loop_instructions_per_warp": st.instructions, "loop_mma_per_warp": st.mma,
        "warp_instr_per_weight": round(sass.warp_instr_per_weight(st.instructions, num_warps, weights), 4),
        "thread_instr_per_weight": round(32 * sass.warp_instr_per_weight(st.instructions, num_warps, weights), 2),
        "family_mix": st.family_mix, "opcode_mix": dict(list(st.opcode_mix.items())[:20]),
    }


# --- the fragment-order probe -------------------------------------------------------------------
# The shipped e4m3 GEMMs take the expanded tile through shared memory to reach wgmma's A fragment
# (docs/w4a8.md, "What the expansion costs"). This probe stores the nibbles in the fragment's own
# order and checks, compiled for sm90, that Triton then hands the expanded tile to the FP8 wgmma
# without a shared-memory trip (no local_alloc of the E4M3 operand), and what its loop costs.
#
# The layout: kernels/moe_w4a8_details/fragment.py; the loads and the expansion are the mode's own
# (moe_w4a8_details/kernels._expanded_weights -> moe_details/e4m3_expand.fragment_tile: the table +
# PRMT PTX when compiled, its plain-Triton twin in the interpreter), so the probe measures them alone.
@triton.jit
def w4a8_fragment_probe_kernel(w_ptr, off_ptr, x_ptr, out_ptr, K, R: tl.constexpr, BLOCK_M: tl.constexpr,
                               WB: tl.constexpr, NORMAL: tl.constexpr = False):
    """out fp32 [16 R, BLOCK_M] = W [16 R, K] @ x [K, BLOCK_M], one program: w_ptr int32 [R, K / 64,
    128] and off_ptr int8 [R, K / 64, 1024 / WB] in the fragment order above, x E4M3 [K, BLOCK_M]
    row-major."""
    rb = tl.arange(0, R)
    rm = tl.arange(0, BLOCK_M)
    acc = tl.zeros((16 * R, BLOCK_M), dtype=tl.float32)
    for q in range(0, K // 64):
        w = _expanded_weights(w_ptr, off_ptr, rb, q, K // 64, WB, R, 64, NORMAL)
        b = tl.load(x_ptr + (q * 64 + tl.arange(0, 64))[:, None] * BLOCK_M + rm[None, :])
        acc = tl.dot(w, b, acc)
    tl.store(out_ptr + tl.arange(0, 16 * R)[:, None] * BLOCK_M + rm[None, :], acc)


def fragment_probe_report(weight_block: int = 32, rows: int = 256, block_m: int = 16, num_warps: int = 4,
                          num_stages: int = 3, arch: int = 90, table: str = "full") -> dict:
    """Compile the fragment-order probe for sm<arch> (``rows`` weight rows x ``block_m`` tokens x 64
    K per iteration) and measure it: the E4M3 operands that go through shared memory (the ttgir's
    local_allocs of f8E4M3 tensors: the tokens always, the weights if the layouts do not line up),
    the FP8 wgmma forms, whether A comes from registers, registers, spills and the hot loop.
    table: the weights' E4M3 block table, "full" or "normal" (W4A8MoEWeights.w13_table)."""
    _require_compiler()
    from . import sass

    args = dict(w_ptr="*i32", off_ptr="*i8", x_ptr="*fp8e4nv", out_ptr="*fp32", K=3584)
    consts = dict(R=rows // 16, BLOCK_M=block_m, WB=weight_block, NORMAL=is_normal_table(table))
    c = compile_kernel(w4a8_fragment_probe_kernel, args, consts, arch, num_warps, num_stages)
    ttgir = c.asm["ttgir"]
    e4m3_allocs = sorted({m.group(1) for m in re.finditer(r"ttg\.local_alloc[^\n]*?tensor<(\d+x\d+)xf8E4M3FN", ttgir)})
    # A layout conversion of the expanded bytes (through scratch shared memory or shuffles): a
    # convert_layout of an E4M3 tensor, or of an 8-bit one of 3 or more dims (the joined bytes). The
    # offsets' [R, 128] int8 load is converted too (to the words' layout): cheap, and not counted.
    conversions = sum(1 for m in re.finditer(r"ttg\.convert_layout[^\n]*->\s*tensor<([\dx]+)x(f8E4M3FN|i8)\b", ttgir)
                      if m.group(2) == "f8E4M3FN" or m.group(1).count("x") >= 2)
    name, ru, st = _function_loop(c.asm["cubin"], "fragment_probe")
    weights = rows * 64
    return {
        "kernel": name, "weight_block": weight_block, "table": table, "rows": rows, "block_m": block_m, "block_k": 64,
        "num_warps": num_warps, "num_stages": num_stages, "triton": triton.__version__,
        "e4m3_operands_through_shared": e4m3_allocs, "byte_tile_conversions": conversions,
        "matrix_shared_ops_in_loop": {k: v for k, v in st.opcode_mix.items() if k.startswith(("STSM", "LDSM"))},
        **fp8_wgmma_facts(c.asm["ptx"]),
        "registers": ru.registers, "local_bytes": ru.local_bytes, "shared_bytes": c.metadata.shared,
        "loop_instructions_per_warp": st.instructions, "loop_mma_per_warp": st.mma,
        "warp_instr_per_weight": round(sass.warp_instr_per_weight(st.instructions, num_warps, weights), 4),
        "thread_instr_per_weight": round(32 * sass.warp_instr_per_weight(st.instructions, num_warps, weights), 2),
        "opcode_mix": dict(list(st.opcode_mix.items())[:16]),
    }


# (name, W4A8Config kwargs): decode (16-token blocks, GEMM1 split over K as the heuristic does for
# few blocks) and prefill (64-token blocks, the atomic top-k sum); K3 TP16 (H 3584, I 192) shapes.
W4A8_CONFIGS = (
    ("bm16_decode", dict(block_m=16, block_k1=64, block_k2=64, split_k1=4, split_k2=1)),
    ("bm64_prefill", dict(block_m=64, block_k1=64, block_k2=64, num_warps1=8, num_warps2=4, atomic_reduce=True)),
)


def compile_w4a8_gemm(kind: str, config, H: int = 3584, I: int = 192, top_k: int = 16, arch: int = 90,
                      weight_block: int = 32, table: str = "full"):
    """Compile the e4m3 mode's GEMM1 ("gemm1": expansion, E4M3 dot, promotion, SiTU, intermediate
    quantization, split-K) or GEMM2 ("gemm2": with the top-k combine) at one W4A8Config for
    sm<arch> with a real launch's specialisations; weight_block 32 (MXFP4) or 16 (NVFP4); table the
    weights' E4M3 block table ("full" or "normal", W4A8MoEWeights.w13_table / w2_table).
    Returns Triton's CompiledKernel (asm: ttgir, ptx, cubin)."""
    _require_compiler()
    from ..moe_w4a8_details import kernels as K

    common = dict(aq_ptr="*fp8e4nv", as_ptr="*fp32", w_ptr="*i32", off_ptr="*i8", rs_ptr="*fp32", tickets_ptr="*i32",
                  sorted_ids_ptr="*i32", block_expert_ptr="*i32", num_padded_ptr="*i32", num_pairs=17, top_k=top_k,
                  H=H, I=I)
    consts = dict(WB=weight_block, NORMAL=is_normal_table(table), BLOCK_M=config.block_m)
    if kind == "gemm1":
        fn = K.w4a8_gemm1_kernel
        args = dict(o_ptr="*fp8e4nv", os_ptr="*fp32", part_ptr="*fp32", beta=4.0, linear_beta=25.0, **common)
        consts.update(ACT=0, HAS_LINEAR_BETA=True, BLOCK_N=config.block_n1, BLOCK_K=config.block_k1,
                      SPLIT_K=config.split_k1)
    else:
        fn = K.w4a8_gemm2_kernel
        args = dict(topk_w_ptr="*fp32", topk_ids_ptr="*i32", stride_im=top_k, stride_ik=1, buf_ptr="*fp32",
                    out_ptr="*bf16", stride_om=H, stride_oh=1, num_experts=17, scale=1.0, **common)
        consts.update(BLOCK_N=config.block_n2, BLOCK_K=config.block_k2, SPLIT_K=config.split_k2,
                      ATOMIC=config.atomic_reduce)
    return compile_kernel(fn, args, consts, arch, config.warps(kind), config.num_stages)


def measure_w4a8_gemm(kind: str, config, H: int = 3584, I: int = 3072, top_k: int = 16, arch: int = 90,
                      weight_block: int = 32, compiled=None, table: str = "full") -> dict:
    """Compile one GEMM of the e4m3 mode at a W4A8Config (its split-K and top-k sum as given) for
    sm<arch> and measure it statically: the hot K loop's instructions per warp and iteration,
    registers, shared memory the launch requests, spills, the FP8 / bf16 wgmma in the PTX and
    whether the expanded weights are the register operand. Returns a dict with "loop_cost"
    (perf_model.LoopCost) and the details (bench/sass_report.py's e4m3 rows, offline/costs.py)."""
    from . import sass
    from .compile import loop_statics

    c = compiled or compile_w4a8_gemm(kind, config, H, I, top_k, arch, weight_block, table)
    warps = config.warps(kind)
    cost, st = loop_statics(c, warps)
    rows = 2 * config.block_n1 if kind == "gemm1" else config.block_n2
    bk = config.block_k1 if kind == "gemm1" else config.block_k2
    return {
        "loop_cost": cost,
        "instructions_per_iteration": st.instructions,
        "weights_per_iteration": rows * bk,
        "num_warps": warps,
        "warp_instr_per_weight": round(sass.warp_instr_per_weight(st.instructions, warps, rows * bk), 4),
        "registers": cost.registers, "local_bytes": cost.local_bytes, "shared_bytes": cost.shared_bytes,
        "mma_per_iteration": st.mma, "local_memory_ops_in_loop": st.local_memory_ops,
        "family_mix": st.family_mix, "opcode_mix": dict(list(st.opcode_mix.items())[:15]),
        **fp8_wgmma_facts(c.asm["ptx"]),
    }


def mode_report(arch: int = 90, H: int = 3584, I: int = 192, top_k: int = 16,
                weight_blocks: tuple[int, ...] = (32, 16), ptx_dir=None) -> list[dict]:
    """GEMM1 and GEMM2 of the e4m3 mode at W4A8_CONFIGS (weights from MXFP4 and from NVFP4): per
    kernel its FP8 wgmma forms and count in the PTX, any bf16 wgmma (a decomposition), registers,
    spill bytes, shared memory, and the hot loop's instructions per warp. A compile error is
    reported in the record, not hidden. ptx_dir (a pathlib.Path): each kernel that sums by last
    arrival (GEMM2 always, GEMM1 when split over K) also writes its PTX there, and its record
    names the file, the kernel's PTX parameters and the sum's buffer (the memory-ordering check of
    tests/ptx_ordering.py reads them)."""
    from ..moe_w4a8_details.config import W4A8Config

    out = []
    for tag, kw in W4A8_CONFIGS:
        cfg = W4A8Config(**kw)
        for kind in ("gemm1", "gemm2"):
            for wb in weight_blocks:
                rec = {"kernel": f"{kind}_e4m3_{tag}_wb{wb}", "config": cfg.label(), "arch": arch,
                       "triton": triton.__version__}
                try:
                    c = compile_w4a8_gemm(kind, cfg, H, I, top_k, arch, wb)
                    ptx = c.asm["ptx"]
                    _name, ru, st = _function_loop(c.asm["cubin"], "gemm")
                    rec.update(**fp8_wgmma_facts(ptx),
                               registers=ru.registers, local_bytes=ru.local_bytes, shared_bytes=c.metadata.shared,
                               loop_instructions_per_warp=st.instructions, loop_mma_per_warp=st.mma)
                    if ptx_dir is not None and (kind == "gemm2" or cfg.split_k1 > 1):
                        (ptx_dir / f"{rec['kernel']}.ptx").write_text(ptx)
                        rec.update(ptx=f"{rec['kernel']}.ptx", buffer="part_ptr" if kind == "gemm1" else "buf_ptr",
                                   params=[k for k, v in c.src.signature.items() if v != "constexpr"])
                except Exception as exc:  # reported, not hidden: the caller / test decides
                    rec["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
                out.append(rec)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -P -m k3nvfp4.kernels.offline.compile_w4a8",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--block-n", type=int, default=64, help="weight rows per program (MMA M side)")
    ap.add_argument("--block-m", type=int, default=64, help="tokens per program (MMA N side)")
    ap.add_argument("--block-k", type=int, default=128, help="K per loop iteration (a multiple of 32)")
    ap.add_argument("--num-warps", type=int, default=4)
    ap.add_argument("--num-stages", type=int, default=3)
    ap.add_argument("--mode", action="store_true",
                    help="compile the e4m3 mode's GEMM1 and GEMM2 (W4A8_CONFIGS) instead of the probe")
    ap.add_argument("--weight-block", type=int, choices=(16, 32), action="append",
                    help="with --mode: the weights' block (32 MXFP4, 16 NVFP4; default both)")
    ap.add_argument("--ptx-dir", help="with --mode: write the PTX of each last-arrival kernel into this folder")
    ap.add_argument("--fragment-probe", action="store_true",
                    help="compile the fragment-order probe (weights stored in wgmma's A-fragment order) for both "
                         "weight blocks instead")
    a = ap.parse_args(argv)
    if a.fragment_probe:
        json.dump([fragment_probe_report(wb) for wb in (32, 16)], sys.stdout, indent=1)
        print()
        return 0
    if a.mode:
        import pathlib

        ptx_dir = None
        if a.ptx_dir:
            ptx_dir = pathlib.Path(a.ptx_dir)
            ptx_dir.mkdir(parents=True, exist_ok=True)
        json.dump(mode_report(weight_blocks=tuple(a.weight_block or (32, 16)), ptx_dir=ptx_dir), sys.stdout, indent=1)
        print()
        return 0
    if a.block_k % 32:
        ap.error(f"--block-k {a.block_k}: must be a multiple of 32 (one exponent offset per 32 weights)")
    json.dump(probe_report(a.block_n, a.block_m, a.block_k, a.num_warps, a.num_stages), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
