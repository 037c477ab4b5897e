"""Compile the MoE kernels for a CUDA target WITHOUT a GPU (Triton AST -> TTGIR -> PTX -> cubin
with the bundled ptxas), with the specialisations a real K3 launch gets (ints divisible by 16,
aligned pointers, unit strides as constants), and measure a compiled GEMM statically (its hot
loop, registers, shared memory, spills): the one offline compile path of both kernel families.

- W4A16 (moe_details): :func:`compile_gemm` / :func:`measure_gemm`; :func:`compile_all_w4a16`
  reports whether the GEMMs use wgmma and cp.async pipelining (tests/test_moe_compile.py).
- FP4 tensor-core modes (moe_fp4_details): :func:`compile_fp4_gemm` / :func:`measure_fp4_gemm`;
  :func:`compile_all_fp4` reports which MMA the GEMMs got: on sm100 ``tcgen05.mma`` with
  ``kind::mxf4nvf4 ... block16`` ("nvfp4") or ``kind::mxf8f6f4 ... block32`` ("mxfp8"); on sm90
  the decomposed ``wgmma`` (tests/test_moe_fp4_compile.py, bench/sass_report.py).

Used by the tests, the tuner's launch check, bench/ and the cost-table generator
(offline/costs.py). Run it with TRITON_INTERPRET unset:

    python -P -m k3nvfp4.kernels.offline.compile --family w4a16 [--arch 90]
    python -P -m k3nvfp4.kernels.offline.compile --family fp4 --arch 100
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import sys
from typing import Iterator


def _source(fn, args: dict, consts: dict):
    from triton.compiler.compiler import ASTSource

    sig, attrs, cx = {}, {}, dict(consts)
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name] = "constexpr"
            continue
        v = args[name]
        if isinstance(v, str):  # pointer type, 16-byte aligned
            sig[name] = v
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(v, float):
            sig[name] = "fp32"
        elif v == 1:  # Triton specialises 1 as a constant
            sig[name] = "constexpr"
            cx[name] = 1
        else:
            sig[name] = "i32"
            if v % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
    return ASTSource(fn, sig, constexprs=cx, attrs=attrs)


# Environment variables through which Triton takes another ptxas than its bundled one.
_PTXAS_ENV = ("TRITON_PTXAS_PATH", "TRITON_PTXAS_BLACKWELL_PATH")


@contextlib.contextmanager
def bundled_ptxas() -> Iterator[None]:
    """Compile with Triton's bundled ptxas: the tile tables and reports are measured with it, and
    another ptxas schedules differently. Libraries set these on import: FlashInfer's triton
    package points TRITON_PTXAS_BLACKWELL_PATH at any CUDA >= 13 ptxas on PATH, which changed
    sm_100 loops by 3-6 % in a test run after a test had imported it."""
    saved = {k: os.environ.pop(k) for k in _PTXAS_ENV if k in os.environ}
    try:
        yield
    finally:
        os.environ.update(saved)


def compile_kernel(fn, args: dict, consts: dict, arch: int, num_warps: int, num_stages: int):
    """triton.compile of a jit kernel for sm<arch> with a real launch's specialisations (_source)
    and Triton's bundled ptxas: the one offline compile path of the project."""
    import triton
    from triton.backends.compiler import GPUTarget

    with bundled_ptxas():
        return triton.compile(_source(fn, args, consts), target=GPUTarget("cuda", arch, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})


def _require_compiler() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("offline compile: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)")


def compile_gemm(kind: str, config, H: int, I: int, top_k: int, arch: int = 90, dtype: str = "bf16", scale_fmt: int = 0):
    """Compile GEMM1 ("gemm1", with SiTU) or GEMM2 ("gemm2") at one MoEConfig for sm<arch>, with
    the specialisations of a real launch. Returns Triton's CompiledKernel (asm: ttgir, ptx, cubin)."""
    _require_compiler()
    import triton.language as tl

    from ..moe_details import kernels as K

    tl_dtype = {"bf16": tl.bfloat16, "fp16": tl.float16}[dtype]
    g = config.gemm(kind)
    if kind == "gemm1":
        fn, K_dim = K.gemm1_gated_kernel, H
        args = dict(x_ptr=f"*{dtype}", stride_xm=H, stride_xk=1, w_ptr="*u8", ws_ptr="*u8", s2_ptr="*fp32",
                    k_tiles=-(-H // 64), out_ptr=f"*{dtype}", part_ptr="*fp32" if g.split_k > 1 else f"*{dtype}",
                    tickets_ptr="*i32", sorted_ids_ptr="*i32", block_expert_ptr="*i32", num_padded_ptr="*i32",
                    num_pairs=17, top_k=top_k, H=H, I=I, beta=4.0, linear_beta=25.0)
        consts = dict(ACT=0, HAS_LINEAR_BETA=True)
    else:
        fn, K_dim = K.gemm2_combine_kernel, I
        args = dict(a_ptr=f"*{dtype}", w_ptr="*u8", ws_ptr="*u8", s2_ptr="*fp32", k_tiles=-(-I // 64),
                    topk_w_ptr="*fp32", topk_ids_ptr="*i32", stride_im=top_k, stride_ik=1, buf_ptr="*fp32",
                    out_ptr=f"*{dtype}", stride_om=H, stride_oh=1, tickets_ptr="*i32", sorted_ids_ptr="*i32",
                    block_expert_ptr="*i32", num_padded_ptr="*i32", num_pairs=17, top_k=top_k, num_experts=17,
                    H=H, I=I, scale=1.0)
        consts = dict(ATOMIC=g.atomic_reduce)
    consts.update(BLOCK_M=g.block_m, BLOCK_N=g.block_n, BLOCK_K=g.block_k, SPLIT_K=g.split_k, SWAP_AB=g.swap_ab,
                  DOT_DTYPE=tl_dtype, PRECISION=None, USE_ASM=True, EVEN_K=K_dim % g.block_k == 0, SCALE_FMT=scale_fmt,
                  PER_WORD=K.per_word_scales(g.num_warps))
    return compile_kernel(fn, args, consts, arch, g.num_warps, g.num_stages)


def loop_statics(compiled, num_warps: int):
    """(perf_model.LoopCost, sass.LoopStats) of a compiled GEMM (the cubin's function whose name
    holds "gemm"): its hot K loop's instructions per warp and iteration, registers, spill bytes and
    the shared memory the launch requests (Triton's metadata.shared: what it checks against the
    device at launch)."""
    from . import sass
    from ..perf_model import LoopCost

    cubin = compiled.asm["cubin"]
    funcs = sass.disassemble(cubin)
    name = next(n for n in funcs if "gemm" in n)
    ru = sass.resource_usage(cubin)[name]
    st = sass.loop_stats(sass.hot_loop(funcs[name]))
    return LoopCost(st.instructions, num_warps, ru.registers, compiled.metadata.shared, ru.local_bytes), st


def measure_gemm(kind: str, config, H: int, I: int, top_k: int, arch: int = 90, scale_fmt: int = 0) -> dict:
    """Compile one GEMM of a MoEConfig for sm<arch> and measure it statically: the hot K loop's
    instructions per warp and iteration (k3nvfp4.kernels.sass), registers, spill bytes and the
    shared memory the launch requests (Triton's metadata.shared: what it checks against the
    device at launch). Returns a dict with "loop_cost" (perf_model.LoopCost) and the details."""
    from . import sass

    g = config.gemm(kind)
    cost, st = loop_statics(compile_gemm(kind, config, H, I, top_k, arch, scale_fmt=scale_fmt), g.num_warps)
    return {
        "loop_cost": cost,
        "instructions_per_iteration": st.instructions,
        "weights_per_iteration": g.weights_per_iteration,
        "num_warps": g.num_warps,
        "warp_instr_per_weight": round(sass.warp_instr_per_weight(st.instructions, g.num_warps,
                                                                  g.weights_per_iteration), 4),
        "registers": cost.registers,
        "local_bytes": cost.local_bytes,
        "shared_bytes": cost.shared_bytes,
        "mma_per_iteration": st.mma,
        "local_memory_ops_in_loop": st.local_memory_ops,
        "family_mix": st.family_mix,
        "opcode_mix": dict(list(st.opcode_mix.items())[:15]),
    }


def compile_all_w4a16(arch: int = 90, H: int = 3584, I: int = 192, top_k: int = 16, E: int = 896) -> list[dict]:
    _require_compiler()
    import triton

    from ..moe_details import routing_kernels as RK
    from ..moe_details.config import MoEConfig

    results = []

    def record(name, c):
        ttgir = c.asm["ttgir"]
        results.append({
            "kernel": name,
            "wgmma": ttgir.count("warp_group_dot"),
            "mma": ttgir.count("tt.dot") + ttgir.count("warp_group_dot"),
            "async_copy": ttgir.count("async_copy_global_to_local"),
            "shared_bytes": c.metadata.shared,
            "triton": triton.__version__,
        })

    def run(name, fn, args, consts, num_warps=4, num_stages=3):
        record(name, compile_kernel(fn, args, consts, arch, num_warps, num_stages))

    # (block_m, swap_ab, block_n, block_k, split_k, warps): decode and prefill shapes.
    for bm, swap, bn, bk, sk, nw in [(16, True, 64, 128, 4, 4), (64, False, 128, 128, 1, 8)]:
        tag = f"bm{bm}_{'swap' if swap else 'noswap'}_bn{bn}_bk{bk}_sk{sk}"
        cfg = MoEConfig(block_m=bm, swap_ab=swap, block_n1=bn, block_k1=bk, split_k1=sk, num_warps1=nw,
                        block_n2=bn, block_k2=bk, split_k2=sk, num_warps2=nw)
        for kind in ("gemm1", "gemm2"):
            record(f"{kind}_{tag}", compile_gemm(kind, cfg, H, I, top_k, arch))
    # GEMM2 with the fp32-atomic top-k sum (the large-batch reduction).
    atomic = MoEConfig(block_m=64, swap_ab=False, block_n2=128, block_k2=128, num_warps2=8, atomic_reduce=True)
    record("gemm2_bm64_noswap_bn128_bk128_sk1_atomic", compile_gemm("gemm2", atomic, H, I, top_k, arch))
    bins = 1 << E.bit_length()  # > E
    run("routing_small", RK.align_small_kernel,
        dict(topk_ids_ptr="*i32", sorted_ids_ptr="*i32", block_expert_ptr="*i32", num_padded_ptr="*i32",
             shift_ptr="*i32", tickets_ptr="*i32", num_pairs=17, num_experts=E, fill_len=273, max_blocks=17,
             ticket_len=17), dict(BLOCK_M=16, P=1024, E_BINS=bins, FILL=1024), num_warps=8, num_stages=1)
    run("routing_count", RK.count_and_rank_kernel,
        dict(topk_ids_ptr="*i32", counts_ptr="*i32", rank_ptr="*i32", sorted_ids_ptr="*i32", tickets_ptr="*i32",
             num_pairs=17, num_experts=E, fill_len=273, ticket_len=17), dict(BLOCK=256), num_stages=1)
    run("routing_offsets", RK.block_offsets_kernel,
        dict(counts_ptr="*i32", padded_start_ptr="*i32", block_expert_ptr="*i32", num_padded_ptr="*i32",
             num_experts=E, max_blocks=17), dict(BLOCK_M=16, E_POW2=1024, BLOCKS_PER_STEP=16), num_stages=1)
    run("routing_scatter", RK.scatter_pairs_kernel,
        dict(topk_ids_ptr="*i32", rank_ptr="*i32", padded_start_ptr="*i32", sorted_ids_ptr="*i32", num_pairs=17,
             num_experts=E), dict(BLOCK=256), num_stages=1)
    return results

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
FP4_CONFIGS = (
    ("bm16_swap", dict(block_m=16, swap_ab=True, block_n1=64, block_n2=128, block_k1=128, block_k2=64,
                       split_k1=4, num_warps=4)),
    ("bm128_noswap", dict(block_m=128, swap_ab=False, block_n1=64, block_n2=128, block_k1=128, block_k2=64,
                          num_warps=8, atomic_reduce=True)),
)


def compile_all_fp4(arch: int = 100, H: int = 3584, I: int = 192, top_k: int = 16) -> list[dict]:
    """GEMM1 and GEMM2 of both FP4 modes at the FP4_CONFIGS, K3 TP16 shapes by default."""
    import triton

    from ..moe_fp4_details.config import FP4MoEConfig

    out = []
    for act_quant in ("nvfp4", "mxfp8"):
        for tag, kw in FP4_CONFIGS:
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
    ap = argparse.ArgumentParser(prog="python -P -m k3nvfp4.kernels.offline.compile", description=__doc__.split("\n")[0])
    ap.add_argument("--family", choices=("w4a16", "fp4"), default="w4a16",
                    help="W4A16 kernels (default arch 90) or the FP4 tensor-core modes (default arch 100)")
    ap.add_argument("--arch", type=int, default=None, help="CUDA compute capability x10 (90 = H100/H200, 100 = B200)")
    args = ap.parse_args(argv)
    if args.family == "w4a16":
        res = compile_all_w4a16(args.arch or 90)
    else:
        res = compile_all_fp4(args.arch or 100)
    json.dump(res, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
