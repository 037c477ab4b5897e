"""The model-class self-check: a cast checkpoint through SGLang's own Kimi-K3 model class.

``python -P -m k3nvfp4.sglang_ext.selfcheck --model CKPT [--parallel 1x1,2x1,2x2] [--layers N]``
(CPU or GPU) builds the model exactly as ``sglang.launch_server --moe-runner-backend
triton_situ`` would (ModelConfig from the checkpoint's config.json, SGLang's quant config with
the exclude globs rewritten by the model's name mapper, the EntryClass chosen by
``architectures``), loads it through SGLang's weight iterator and ``load_weights`` with every
weight loader instrumented, and proves:

- every checkpoint tensor lands (or belongs to another EP rank / a layer beyond ``--layers``),
  and every parameter holds exactly its (possibly fused, possibly sharded) checkpoint bytes;
  parameters the checkpoint leaves unfilled are listed;
- ModelOpt NVFP4 for exactly the routed experts, unquantized elsewhere; with the exclude list
  emptied, the same linears would be quantized (the globs do the work);
- ``postprocess_weights`` runs, and one MoE block's forward matches a plain-torch dequantized
  reference with routed_scaling_factor applied exactly once.

Modules: :mod:`.sglang_path` (SGLang's path and the CPU workarounds), :mod:`.ckpt_reader`,
:mod:`.expected` (the independent layout), :mod:`.instrument`, :mod:`.quant_audit`,
:mod:`.reference`, :mod:`.forward`, :mod:`.run` (:func:`run.check_rank`, :func:`run.run_checks`),
:mod:`.cli`. Nothing here is imported by the plugin's entry point.
"""
