"""The console scripts' entry points: a Ctrl-C is a one-line message and exit 130, never a traceback.

Each tool's own ``main`` says what an interrupt leaves (the cast: "run the same command again to
resume"), but a tool imports torch, Triton and maybe SGLang before its ``main`` runs, for seconds:
an interrupt then would print a KeyboardInterrupt traceback from deep inside torch. So the
console scripts point here: this module imports only the standard library, imports the tool
inside the guard, then calls its ``main``.

``python -P -m k3nvfp4.common.entry MODULE [ARGS...]`` does the same for any module with a
``main()``: the form the tools re-execute themselves in when they switch the Triton interpreter on
(kernels/interpreter.py).
"""

from __future__ import annotations

import importlib
import sys

# Console script -> the module whose main() it runs (pyproject.toml's [project.scripts]).
TOOLS = {
    "k3nvfp4-cast": "k3nvfp4.checkpoint.cli",
    "k3nvfp4-tune": "k3nvfp4.kernels.tune",
    "k3nvfp4-ab": "k3nvfp4.sglang_ext.ab.cli",
}
INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C


def run_module(module: str, prog: str | None = None) -> int:
    """Import ``module`` and return ``module.main()`` (arguments from sys.argv), with a
    KeyboardInterrupt during the import or one the tool does not handle itself turned into
    ``<prog>: interrupted ...`` on stderr and exit status 130."""
    prog = prog or module
    try:
        main = importlib.import_module(module).main
    except KeyboardInterrupt:
        print(f"{prog}: interrupted while starting; nothing was done", file=sys.stderr)
        return INTERRUPTED
    try:
        return main()
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return INTERRUPTED


def cast() -> int:
    """``k3nvfp4-cast``."""
    return run_module(TOOLS["k3nvfp4-cast"], "k3nvfp4-cast")


def tune() -> int:
    """``k3nvfp4-tune``."""
    return run_module(TOOLS["k3nvfp4-tune"], "k3nvfp4-tune")


def ab() -> int:
    """``k3nvfp4-ab``."""
    return run_module(TOOLS["k3nvfp4-ab"], "k3nvfp4-ab")


def _prog_of(module: str) -> str:
    return next((prog for prog, m in TOOLS.items() if m == module), f"python -m {module}")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        print("usage: python -P -m k3nvfp4.common.entry MODULE [ARGS...]", file=sys.stderr)
        raise SystemExit(2)
    target = sys.argv[1]
    sys.argv = [target, *sys.argv[2:]]  # the tool parses its own arguments from sys.argv[1:]
    raise SystemExit(run_module(target, _prog_of(target)))
