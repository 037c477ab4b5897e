"""Offline checkpoint tooling: read Kimi-K3 MXFP4 checkpoints, write ModelOpt NVFP4 ones."""
