"""Offline checkpoint tooling: read Kimi-K3 MXFP4 checkpoints, write ModelOpt NVFP4 ones.

- ``synthetic.write_synthetic_checkpoint``: small checkpoints in the exact K3 MXFP4 layout;
- ``convert.run_cast`` / the ``k3nvfp4-cast`` CLI (``cli.main``): the streaming, resumable,
  verified MXFP4 -> NVFP4 cast;
- ``layer.load_moe_layer_nvfp4``: one MoE layer of a cast checkpoint as an ``NVFP4MoELayer``
  (``NVFP4MoEWeights`` + hidden_act, SiTU betas, top_k, routed_scaling_factor).
"""

from .layer import NVFP4MoELayer, load_moe_layer_nvfp4
from .synthetic import write_synthetic_checkpoint

__all__ = ["NVFP4MoELayer", "load_moe_layer_nvfp4", "write_synthetic_checkpoint"]
