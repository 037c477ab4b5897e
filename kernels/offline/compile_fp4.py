"""Compile the FP4 MMA kernels for a CUDA target WITHOUT a GPU (Triton -> PTX -> cubin with the
bundled ptxas) and report which MMA the GEMMs got: on sm100 ``tcgen05.mma`` with
``kind::mxf4nvf4 ... block16`` ("nvfp4") or ``kind::mxf8f6f4 ... block32`` ("mxfp8"); on sm90
the decomposed ``wgmma``. Used by tests/test_moe_fp4_compile.py and bench/sass_report.py; run it
with TRITON_INTERPRET unset:

    python -P -m k3nvfp4.kernels.offline.compile_fp4 --arch 100
"""

from __future__ import annotations

import argparse
import json
import re
import sys

from .compile_check import _require_compiler, compile_kernel


def compile_fp4_gemm(kind: str, act_quant: str, config, H: int, I: int, top_k: int, arch: int = 100,
                     intermediate_static: bool = True):
    """Compile GEMM1 ("gemm1", SiTU + intermediate quantization) or GEMM2 ("gemm2", with the
    skeleton's top-k combine) of one FP4 mode at one FP4MoEConfig (its split-K included) for
    sm<arch>. Returns Triton's CompiledKernel (asm: ttgir, ptx, cubin)."""
    _require_compiler()
    from ..moe_fp4_details import kernels as K

    mode = {"nvfp4": K.MODE_NVFP4, "mxfp8": K.MODE_MXFP8}[act_quant]
    nv = mode == K.MODE_NVFP4
    a_t = "*u8" if nv else "*fp8e4nv"
    as_t = "*fp8e4nv" if nv else "*u8"
    common = dict(a_ptr=a_t, as_ptr=as_t, ars_ptr="*fp32", w_ptr="*u8", ws_ptr=as_t, s2_ptr="*fp32",
                  tickets_ptr="*i32", sorted_ids_ptr="*i32", block_expert_ptr="*i32", num_padded_ptr="*i32",
                  num_pairs=17, top_k=top_k, H=H, I=I, inter_scale=0.0372)
    if kind == "gemm1":
        fn = K.fp4_gemm1_kernel
        args = dict(o_ptr=a_t, os_ptr=as_t, of_ptr="*fp32", part_ptr="*fp32", beta=4.0, linear_beta=25.0, **common)
        consts = dict(MODE=mode, OUT_F32=nv and not intermediate_static, ACT=0, HAS_LINEAR_BETA=True,
                      BLOCK_N=config.block_n1, BLOCK_K=config.block_k1, SPLIT_K=config.split_k1)
    else:
        fn = K.fp4_gemm2_kernel
        args = dict(topk_w_ptr="*fp32", topk_ids_ptr="*i32", stride_im=top_k, stride_ik=1, buf_ptr="*fp32",
                    out_ptr="*bf16", stride_om=H, stride_oh=1, num_experts=17, scale=1.0, **common)
        consts = dict(MODE=mode, INTER_STATIC=intermediate_static, BLOCK_N=config.block_n2, BLOCK_K=config.block_k2,
                      SPLIT_K=config.split_k2, ATOMIC=config.atomic_reduce)
    consts.update(BLOCK_M=config.block_m, SWAP_AB=config.swap_ab, EMULATE=False)
    return compile_kernel(fn, args, consts, arch, config.num_warps, config.num_stages)


def measure_fp4_gemm(kind: str, act_quant: str, config, H: int = 3584, I: int = 384, top_k: int = 16,
                     arch: int = 100) -> dict:
    """Compile one FP4 GEMM (with split-K 2, the epilogue that costs the most registers) and
    measure its hot K loop statically: instructions per warp and iteration, registers, shared
    memory, spills, and the weights one iteration streams. Returns a dict with "loop_cost"
    (perf_model.LoopCost) and the details."""
    from dataclasses import replace

    from . import sass
    from .compile_check import loop_statics

    K_dim = H if kind == "gemm1" else I
    bk = config.block_k1 if kind == "gemm1" else config.block_k2
    split = min(2, K_dim // bk)
    cfg = replace(config, split_k1=split) if kind == "gemm1" else replace(config, split_k2=split)
    cost, st = loop_statics(compile_fp4_gemm(kind, act_quant, cfg, H, I, top_k, arch), config.num_warps)
    rows = 2 * config.block_n1 if kind == "gemm1" else config.block_n2
    return {
        "loop_cost": cost,
        "instructions_per_iteration": st.instructions,
        "weights_per_iteration": rows * bk,
        "warp_instr_per_weight": round(sass.warp_instr_per_weight(st.instructions, config.num_warps, rows * bk), 4),
        "registers": cost.registers, "local_bytes": cost.local_bytes, "shared_bytes": cost.shared_bytes,
        "mma_per_iteration": st.mma,
    }


def compile_route_quant(act_quant: str, arch: int = 100, H: int = 3584, E: int = 896, num_pairs: int = 1024):
    """Compile the first launch of an FP4-mode call (routing alignment in program 0, the tokens'
    quantization in the others) for sm<arch>. Returns Triton's CompiledKernel."""
    _require_compiler()
    from ..moe_details.routing import SMALL_NUM_WARPS
    from ..moe_fp4_details import kernels as K

    nv = act_quant == "nvfp4"
    args = dict(topk_ids_ptr="*i32", sorted_ids_ptr="*i32", block_expert_ptr="*i32", num_padded_ptr="*i32",
                shift_ptr="*i32", tickets_ptr="*i32", num_pairs=17, num_experts=E, fill_len=273, max_blocks=17,
                ticket_len=17, x_ptr="*bf16", stride_xm=H, q_ptr="*u8" if nv else "*fp8e4nv",
                s_ptr="*fp8e4nv" if nv else "*u8", rs_ptr="*fp32", K=H, static_scale=0.01)
    consts = dict(BLOCK_M=16, P=num_pairs, E_BINS=1 << E.bit_length(), FILL=1024, MODE=0 if nv else 1, STATIC=False,
                  BLOCK_K=512)
    return compile_kernel(K.route_quant_kernel, args, consts, arch, SMALL_NUM_WARPS, 1)


def mma_summary(compiled) -> dict:
    """What the PTX / TTGIR of a compiled GEMM say about its MMA."""
    ptx = compiled.asm["ptx"]
    ttgir = compiled.asm["ttgir"]
    tc = [ln.strip() for ln in ptx.splitlines() if "tcgen05.mma" in ln]
    kinds = sorted({m.group(0) for ln in tc for m in [re.search(r"kind::\w+", ln)] if m})
    blocks = sorted({m.group(0) for ln in tc for m in [re.search(r"block_scale(\.block\d+)?", ln)] if m})
    return {
        "tcgen05_mma": len(tc),
        "kinds": kinds,
        "block_scale": blocks,
        "wgmma": ptx.count("wgmma.mma_async"),
        "mma_sync": ptx.count("mma.sync"),
        "ttgir_dot_scaled": ttgir.count("tt.dot_scaled"),
        "shared_bytes": compiled.metadata.shared,
    }


def resource_summary(compiled) -> dict:
    """Registers and local-memory (spill) bytes of the GEMM, from the cubin (cuobjdump)."""
    from . import sass

    usage = sass.resource_usage(compiled.asm["cubin"])
    name = next(n for n in usage if "gemm" in n)
    return {"registers": usage[name].registers, "local_bytes": usage[name].local_bytes}


# (name, FP4MoEConfig kwargs): decode (swap-AB, 16-token blocks; GEMM1 split over K) and prefill
# (128-row blocks, the atomic top-k sum), as FP4MoEConfig.heuristic picks them for K3 TP16.
CONFIGS = (
    ("bm16_swap", dict(block_m=16, swap_ab=True, block_n1=64, block_n2=128, block_k1=128, block_k2=64,
                       split_k1=4, num_warps=4)),
    ("bm128_noswap", dict(block_m=128, swap_ab=False, block_n1=64, block_n2=128, block_k1=128, block_k2=64,
                          num_warps=8, atomic_reduce=True)),
)


def compile_all(arch: int = 100, H: int = 3584, I: int = 192, top_k: int = 16) -> list[dict]:
    """GEMM1 and GEMM2 of both FP4 modes at the CONFIGS, K3 TP16 shapes by default."""
    import triton

    from ..moe_fp4_details.config import FP4MoEConfig

    out = []
    for act_quant in ("nvfp4", "mxfp8"):
        for tag, kw in CONFIGS:
            cfg = FP4MoEConfig(num_stages=3, **kw)
            for kind in ("gemm1", "gemm2"):
                rec = {"kernel": f"{kind}_{act_quant}_{tag}", "arch": arch, "triton": triton.__version__}
                try:
                    c = compile_fp4_gemm(kind, act_quant, cfg, H, I, top_k, arch)
                    rec.update(mma_summary(c))
                    rec.update(resource_summary(c))
                except Exception as exc:  # reported, not hidden: the caller / test decides
                    rec["error"] = f"{type(exc).__name__}: {str(exc)[:400]}"
                out.append(rec)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3nvfp4.kernels.moe_fp4_details.compile_fp4",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=100, help="CUDA compute capability x10 (100 = B200, 90 = H200)")
    args = ap.parse_args(argv)
    json.dump(compile_all(args.arch), sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
