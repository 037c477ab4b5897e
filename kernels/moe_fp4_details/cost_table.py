"""GENERATED: do not edit. The FP4 modes' measured tile costs on sm100, read by
moe_fp4_details/costs.py (how they are measured: offline/fp4_costs.py).

Command: python -P -m k3nvfp4.kernels.offline.fp4_costs --write
Measured with Triton 3.8 on 2026-12-02.
"""

COMMAND = "python -P -m k3nvfp4.kernels.offline.fp4_costs --write"
TRITON = "3.8"
GENERATED = "2026-12-02"
# {tile_key: (instructions per warp-iteration, registers, shared bytes, local bytes)}
COSTS: dict[str, tuple[int, int, int, int]] = {
    'gemm1 mxfp8 bm128 noswap bn128 bk128 w8 s3': (209, 208, 99328, 0),
    'gemm1 mxfp8 bm128 noswap bn128 bk64 w8 s3': (142, 255, 49664, 8),
    'gemm1 mxfp8 bm128 noswap bn64 bk128 w8 s3': (204, 156, 66048, 0),
    'gemm1 mxfp8 bm128 noswap bn64 bk64 w8 s3': (132, 154, 33024, 0),
    'gemm1 mxfp8 bm16 swap bn64 bk128 w4 s3': (174, 56, 37376, 0),
    'gemm1 mxfp8 bm16 swap bn64 bk64 w4 s3': (126, 56, 18688, 0),
    'gemm1 nvfp4 bm128 noswap bn128 bk128 w8 s3': (209, 253, 50176, 0),
    'gemm1 nvfp4 bm128 noswap bn128 bk64 w8 s3': (161, 254, 25600, 0),
    'gemm1 nvfp4 bm128 noswap bn64 bk128 w8 s3': (163, 151, 33792, 0),
    'gemm1 nvfp4 bm128 noswap bn64 bk64 w8 s3': (156, 175, 16896, 0),
    'gemm1 nvfp4 bm16 swap bn64 bk128 w4 s3': (183, 80, 19456, 0),
    'gemm1 nvfp4 bm16 swap bn64 bk64 w4 s3': (135, 64, 9728, 0),
    'gemm2 mxfp8 bm128 noswap bn128 bk128 w8 s3': (196, 122, 66048, 0),
    'gemm2 mxfp8 bm128 noswap bn128 bk128 w8 s3 atomic': (196, 184, 66048, 0),
    'gemm2 mxfp8 bm128 noswap bn128 bk64 w8 s3': (129, 120, 33024, 0),
    'gemm2 mxfp8 bm128 noswap bn128 bk64 w8 s3 atomic': (129, 186, 33024, 0),
    'gemm2 mxfp8 bm16 swap bn128 bk128 w4 s3': (172, 77, 37376, 0),
    'gemm2 mxfp8 bm16 swap bn128 bk64 w4 s3': (124, 77, 18688, 0),
    'gemm2 nvfp4 bm128 noswap bn128 bk128 w8 s3': (164, 128, 33792, 0),
    'gemm2 nvfp4 bm128 noswap bn128 bk128 w8 s3 atomic': (164, 215, 33792, 0),
    'gemm2 nvfp4 bm128 noswap bn128 bk64 w8 s3': (155, 128, 16896, 0),
    'gemm2 nvfp4 bm128 noswap bn128 bk64 w8 s3 atomic': (155, 181, 16896, 0),
    'gemm2 nvfp4 bm16 swap bn128 bk128 w4 s3': (189, 88, 19456, 0),
    'gemm2 nvfp4 bm16 swap bn128 bk64 w4 s3': (135, 77, 9728, 0),
}
