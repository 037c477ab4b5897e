"""Private pieces of ``k3nvfp4.kernels.cast``: the closed-form E8M0 -> E4M3 scale
computation (``scales_torch`` and its Triton twin ``scales_triton``) and the lossy
best-E4M3 re-quantization of out-of-range blocks (``requant``)."""
