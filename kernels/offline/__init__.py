"""Offline tooling of the kernels: compile them for a GPU architecture without a GPU, read the
SASS of their hot loops, and measure the tables the heuristics read (the W4A16 tile costs, the
FP4 modes' tile costs). Used by tests, bench/ and the ``--write`` regeneration commands.

Runtime code (the kernels, their heuristics, the device model, the SGLang plugin) never imports
this package: the heuristics import the generated table only (``kernels/cost_table.py``, through
``kernels/costs.py``). tests/test_imports.py enforces both.
"""
