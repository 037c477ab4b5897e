"""SGLang's real server on CPU, for trying the plugin and the server A/B without a GPU.

``python -P -m k3nvfp4.sglang_ext.cpu_server`` starts it (docs/serving.md, "Try it on CPU").
What it needs lives here:

- ``pythonpath/``: the folder the server's PYTHONPATH starts with: ``sitecustomize.py`` (the CPU
  workarounds for SGLang 0.5.23, each naming what it answers), the ``sgl_kernel`` stand-in
  (the installed sgl_kernel loads CUDA at import) and ``fla_interpreter_math.py``;
- ``tokenizer.py``: a word-level tokenizer and the text-only processor a synthetic Kimi-K3
  checkpoint needs (its own tokenizer files are stand-ins), written as a --tokenizer-path folder.
"""

from pathlib import Path

PYTHONPATH_DIR = Path(__file__).resolve().parent / "pythonpath"
