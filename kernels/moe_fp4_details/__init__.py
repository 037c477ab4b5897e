"""Private parts of the FP4 tensor-core MoE (kernels/moe_fp4.py): weights prep, jit kernels, compiles."""
