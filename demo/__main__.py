"""``python -P -m k3nvfp4.demo``: see :mod:`k3nvfp4.demo.run` (imported inside the Ctrl-C guard)."""

from ..common.entry import run_module

raise SystemExit(run_module("k3nvfp4.demo.run", "python -m k3nvfp4.demo"))
