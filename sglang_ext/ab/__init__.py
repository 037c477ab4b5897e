"""A/B of the triton_situ MoE backend against marlin: `k3nvfp4-ab layer` (one MoE layer,
tensor metrics) and `k3nvfp4-ab serve` (two OpenAI-compatible servers, token and accuracy
metrics). Import-light: torch, Triton kernels, sglang and matplotlib load only when used.

Programmatic entry points: k3nvfp4.sglang_ext.ab.layer.run_layer_ab(LayerABConfig(...)) and
k3nvfp4.sglang_ext.ab.serve.run_serve_ab(ServeConfig(...)).
"""
