"""``make demo``: a synthetic Kimi-K3 checkpoint, cast by ``k3nvfp4-cast --verify``, then one
MoE layer A/B (``k3nvfp4-ab layer``). Run it as ``python -P -m k3nvfp4.demo``; the code is in
:mod:`k3nvfp4.demo.run`. This package sits above ``k3nvfp4.checkpoint`` and
``k3nvfp4.sglang_ext``: the only place that uses both.
"""
