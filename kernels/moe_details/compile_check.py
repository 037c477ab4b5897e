"""Compile every MoE kernel for a CUDA target WITHOUT a GPU (Triton AST -> TTGIR -> PTX -> cubin
with the bundled ptxas), with the specialisations a real K3 launch gets (ints divisible by 16,
aligned pointers, unit strides as constants). Reports whether the GEMMs use wgmma and cp.async
pipelining. Used by tests/test_moe_compile.py; run it with TRITON_INTERPRET unset:

    python -P -m k3nvfp4.kernels.moe_details.compile_check [--arch 90]
"""

from __future__ import annotations

import argparse
import json
import os
import sys


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


def compile_gemm(kind: str, config, H: int, I: int, top_k: int, arch: int = 90, dtype: str = "bf16"):
    """Compile GEMM1 ("gemm1", with SiTU) or GEMM2 ("gemm2") at one MoEConfig for sm<arch>, with
    the specialisations of a real launch. Returns Triton's CompiledKernel (asm: ttgir, ptx, cubin)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile_check: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)")
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget

    from . import kernels as K

    tl_dtype = {"bf16": tl.bfloat16, "fp16": tl.float16}[dtype]
    target = GPUTarget("cuda", arch, 32)
    if kind == "gemm1":
        sk, warps, stages = config.split_k1, config.num_warps1, config.num_stages1
        fn = K.gemm1_gated_kernel
        args = dict(x_ptr=f"*{dtype}", stride_xm=H, stride_xk=1, w_ptr="*u8", ws_ptr="*bf16", s2_ptr="*fp32",
                    k_tiles=-(-H // 64), out_ptr="*fp32" if sk > 1 else f"*{dtype}", sorted_ids_ptr="*i32",
                    block_expert_ptr="*i32", num_padded_ptr="*i32", num_pairs=17, top_k=top_k, H=H, I=I,
                    beta=4.0, linear_beta=25.0)
        consts = dict(ACT=0, HAS_LINEAR_BETA=True, BLOCK_N=config.block_n1, BLOCK_K=config.block_k1,
                      EVEN_K=H % config.block_k1 == 0)
    elif kind == "gemm2":
        sk, warps, stages = config.split_k2, config.num_warps2, config.num_stages2
        fn = K.gemm2_combine_kernel
        args = dict(a_ptr=f"*{dtype}", w_ptr="*u8", ws_ptr="*bf16", s2_ptr="*fp32", k_tiles=-(-I // 64),
                    topk_w_ptr="*fp32", out_ptr="*fp32", sorted_ids_ptr="*i32", block_expert_ptr="*i32",
                    num_padded_ptr="*i32", num_pairs=17, top_k=top_k, H=H, I=I, scale=1.0)
        use_atomic = config.atomic_reduce or sk > 1
        consts = dict(USE_ATOMIC=use_atomic, ROW_IS_TOKEN=config.atomic_reduce,
                      BLOCK_N=config.block_n2, BLOCK_K=config.block_k2, EVEN_K=I % config.block_k2 == 0)
    else:
        raise ValueError(f"kind: expected 'gemm1' or 'gemm2', got {kind!r}")
    consts.update(BLOCK_M=config.block_m, SPLIT_K=sk, SWAP_AB=config.swap_ab, DOT_DTYPE=tl_dtype,
                  PRECISION=None, USE_ASM=True)
    return triton.compile(_source(fn, args, consts), target=target,
                          options={"num_warps": warps, "num_stages": stages})


def compile_all(arch: int = 90, H: int = 3584, I: int = 192, top_k: int = 16, E: int = 896) -> list[dict]:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("compile_check: unset TRITON_INTERPRET (interpreted kernels cannot be compiled)")
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget

    from . import kernels as K
    from . import routing_kernels as RK

    target = GPUTarget("cuda", arch, 32)
    results = []

    def run(name, fn, args, consts, num_warps=4, num_stages=3):
        c = triton.compile(_source(fn, args, consts), target=target,
                           options={"num_warps": num_warps, "num_stages": num_stages})
        ttgir = c.asm["ttgir"]
        results.append({
            "kernel": name,
            "wgmma": ttgir.count("warp_group_dot"),
            "mma": ttgir.count("tt.dot") + ttgir.count("warp_group_dot"),
            "async_copy": ttgir.count("async_copy_global_to_local"),
            "shared_bytes": c.metadata.shared,
            "triton": triton.__version__,
        })

    # (block_m, swap_ab, block_n, block_k, split_k, warps): decode and prefill shapes.
    for bm, swap, bn, bk, sk, nw in [(16, True, 64, 128, 4, 4), (64, False, 128, 128, 1, 8)]:
        tag = f"bm{bm}_{'swap' if swap else 'noswap'}_bn{bn}_bk{bk}_sk{sk}"
        common = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, SPLIT_K=sk, SWAP_AB=swap, DOT_DTYPE=tl.bfloat16, PRECISION=None,
                      USE_ASM=True, EVEN_K=False)
        run(f"gemm1_{tag}", K.gemm1_gated_kernel,
            dict(x_ptr="*bf16", stride_xm=H, stride_xk=1, w_ptr="*u8", ws_ptr="*bf16", s2_ptr="*fp32",
                 k_tiles=-(-H // 64), out_ptr="*fp32" if sk > 1 else "*bf16", sorted_ids_ptr="*i32",
                 block_expert_ptr="*i32", num_padded_ptr="*i32", num_pairs=17, top_k=top_k, H=H, I=I, beta=4.0,
                 linear_beta=25.0),
            dict(ACT=0, HAS_LINEAR_BETA=True, **common), num_warps=nw)
        run(f"gemm2_{tag}", K.gemm2_combine_kernel,
            dict(a_ptr="*bf16", w_ptr="*u8", ws_ptr="*bf16", s2_ptr="*fp32", k_tiles=-(-I // 64),
                 topk_w_ptr="*fp32", out_ptr="*fp32", sorted_ids_ptr="*i32", block_expert_ptr="*i32",
                 num_padded_ptr="*i32", num_pairs=17, top_k=top_k, H=H, I=I, scale=1.0),
            dict(USE_ATOMIC=sk > 1, ROW_IS_TOKEN=False, **common), num_warps=nw)
    run("gated_activation", K.gated_activation_kernel,
        dict(part_ptr="*fp32", out_ptr="*bf16", num_padded_ptr="*i32", I=I,
             max_padded=256, beta=4.0, linear_beta=25.0),
        dict(ACT=0, HAS_LINEAR_BETA=True, SPLIT_K=4, BLOCK_M=16, BLOCK_N=64), num_stages=1)
    run("combine_topk", K.combine_topk_kernel,
        dict(buf_ptr="*fp32", topk_ids_ptr="*i32", stride_im=top_k, stride_ik=1, out_ptr="*bf16", stride_om=H,
             stride_oh=1, top_k=top_k, H=H, num_experts=E, scale=1.0),
        dict(BLOCK_H=1024), num_stages=1)
    run("routing_count", RK.count_and_rank_kernel,
        dict(topk_ids_ptr="*i32", counts_ptr="*i32", rank_ptr="*i32", sorted_ids_ptr="*i32", num_pairs=17,
             num_experts=E, fill_len=273), dict(BLOCK=256), num_stages=1)
    run("routing_offsets", RK.block_offsets_kernel,
        dict(counts_ptr="*i32", padded_start_ptr="*i32", block_expert_ptr="*i32", num_padded_ptr="*i32",
             num_experts=E, max_blocks=17), dict(BLOCK_M=16, E_POW2=1024, BLOCKS_PER_STEP=16), num_stages=1)
    run("routing_scatter", RK.scatter_pairs_kernel,
        dict(topk_ids_ptr="*i32", rank_ptr="*i32", padded_start_ptr="*i32", sorted_ids_ptr="*i32", num_pairs=17,
             num_experts=E), dict(BLOCK=256), num_stages=1)
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m k3nvfp4.kernels.moe_details.compile_check", description=__doc__.split("\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (90 = H100/H200)")
    args = ap.parse_args(argv)
    res = compile_all(args.arch)
    json.dump(res, sys.stdout, indent=1)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
