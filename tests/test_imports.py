"""The import graph of the package and of bench/ has no cycle (issue 27).

Read from the sources with ``ast``, not by importing them: every ``import`` / ``from ... import``
statement counts, at module level or inside a function, under ``if TYPE_CHECKING:`` too, since a
function-level import that closes a circle is the same circle, only hidden until the call. A
cycle is reported with its modules, so the fix (move the shared piece into a module both sides
import) can start from the message.

Module names are those Python sees: ``k3nvfp4.<subpackage>...`` for the package folders
(pyproject's package-dir) and, for bench/, the names its scripts import each other by with bench/
on sys.path (``peers.marlin.build``, ``sass_report``).
"""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {"common": "k3nvfp4.common", "kernels": "k3nvfp4.kernels", "checkpoint": "k3nvfp4.checkpoint",
                "sglang_ext": "k3nvfp4.sglang_ext", "demo": "k3nvfp4.demo"}
BENCH = "bench"


def _modules() -> dict[str, pathlib.Path]:
    """module name -> source file, for the package folders and bench/."""
    out = {}
    roots = [(REPO / folder, prefix.split(".")) for folder, prefix in PACKAGE_DIRS.items()]
    roots.append((REPO / BENCH, []))
    for root, prefix in roots:
        for path in sorted(root.rglob("*.py")):
            if "src" in path.relative_to(root).parts[:-1]:  # vendored peer sources are not ours
                continue
            parts = prefix + list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imported(module: str, path: pathlib.Path, modules: dict[str, pathlib.Path]) -> set[str]:
    """The project modules ``module`` imports anywhere in its source (each ``from X import y``
    counts as X.y where that is a module, else X)."""
    is_package = path.name == "__init__.py"
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".") if is_package else module.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            for alias in node.names:
                sub = f"{name}.{alias.name}"
                found.add(sub if sub in modules else name)
    return {m for m in found if m in modules and m != module}


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: _imported(m, p, modules) for m, p in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph)))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def test_the_walk_sees_the_project():
    """The graph covers every subpackage and bench/, and sees function-level imports (the kind
    that hides a circle): a guard against a walk that finds nothing and so no cycle."""
    graph = import_graph()
    for prefix in (*PACKAGE_DIRS.values(), "peers.marlin"):
        assert any(m.startswith(prefix) for m in graph), prefix
    # k3nvfp4.sglang_ext.register imports .plugin inside the function only.
    assert "k3nvfp4.sglang_ext.plugin" in graph["k3nvfp4.sglang_ext"]
    assert "k3nvfp4.checkpoint.plan" in graph["k3nvfp4.checkpoint.verify"]


def test_cycle_finder_finds_a_planted_cycle():
    g = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(g) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle():
    found = cycles(import_graph())
    if found:
        pytest.fail("import cycles (move the shared piece into a module both sides import):\n"
                    + "\n".join(" <-> ".join(c) for c in found))


# --- the pieces every kernel family reads --------------------------------------------------------

# The generic device model and the device / version probes: every family's heuristic and call
# model reads them, so they import nothing of the project. perf_model once imported moe_details
# (the W4A16 call model) while moe_details/config.py imported perf_model: a loop between folders
# that function-level imports hid (issue 37).
LEAVES = ("k3nvfp4.kernels.perf_model", "k3nvfp4.kernels.target")


def test_shared_leaves_import_nothing_of_ours():
    graph = import_graph()
    for leaf in LEAVES:
        assert leaf in graph, leaf
        assert not graph[leaf], (f"{leaf} imports {sorted(graph[leaf])}: it must import nothing of the project "
                                 "(a family's code that needs it lives beside the family: <family>_details/call_model.py)")


def test_device_probes_live_in_target():
    """Which GPU and arch a call runs on is asked in kernels/target.py only: nine modules once had
    their own probe, two of them with another meaning for the same name."""
    probes = ("get_device_capability(", "get_device_name(")
    found = []
    for module, path in _modules().items():
        if module.startswith("k3nvfp4.") and module != "k3nvfp4.kernels.target":
            text = path.read_text()
            found += [f"{module}: {p}" for p in probes if p in text]
    # The A/B report labels its device with the marketing name (spaces kept), a label, not a probe.
    assert found == ["k3nvfp4.sglang_ext.ab.layer: get_device_name("], found


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The kernels' import graph with each subfolder (moe_details/, moe_fp4_details/, offline/, ...)
    folded into one node: a loop through a folder is a loop even when no single module closes it."""
    def node(m: str) -> str:
        parts = m.split(".")
        return ".".join(parts[:3]) if len(parts) > 3 else m

    out: dict[str, set[str]] = {}
    for m, deps in graph.items():
        if m.startswith("k3nvfp4.kernels."):
            out.setdefault(node(m), set()).update(node(d) for d in deps if d.startswith("k3nvfp4.kernels."))
    return {m: {d for d in deps if d != m and d in out} for m, deps in out.items()}


def test_folder_graph_folds_folders():
    g = folder_graph({"k3nvfp4.kernels.a": {"k3nvfp4.kernels.d.x"}, "k3nvfp4.kernels.d.x": {"k3nvfp4.kernels.d.y"},
                      "k3nvfp4.kernels.d.y": {"k3nvfp4.kernels.a"}})
    assert g == {"k3nvfp4.kernels.a": {"k3nvfp4.kernels.d"}, "k3nvfp4.kernels.d": {"k3nvfp4.kernels.a"}}
    assert cycles(g) == [["k3nvfp4.kernels.a", "k3nvfp4.kernels.d"]]


def test_no_import_cycle_between_kernel_folders():
    folded = folder_graph(import_graph())
    assert "k3nvfp4.kernels.moe_details" in folded and "k3nvfp4.kernels.perf_model" in folded
    found = cycles(folded)
    if found:
        pytest.fail("import cycles between kernels/ modules and folders:\n" + "\n".join(" <-> ".join(c) for c in found))


# --- runtime code imports no offline tooling --------------------------------------------------

# Offline tooling: compilers, SASS readers, table generators, the tuner, the checkpoint tool, the
# A/B and model-check tools, the demo. Runtime code (the kernels, their heuristics and tables, the
# device model, the SGLang plugin) must reach none of them.
OFFLINE = ("k3nvfp4.kernels.offline", "k3nvfp4.kernels.tune", "k3nvfp4.checkpoint", "k3nvfp4.sglang_ext.ab",
           "k3nvfp4.sglang_ext.model_check", "k3nvfp4.sglang_ext.selfcheck", "k3nvfp4.demo")
# Where a forward starts: the kernels' public modules, and the plugin with what it loads in SGLang.
RUNTIME_ROOTS = ("k3nvfp4.kernels", "k3nvfp4.kernels.moe", "k3nvfp4.kernels.moe_fp4", "k3nvfp4.kernels.moe_torch_backend",
                 "k3nvfp4.sglang_ext", "k3nvfp4.sglang_ext.plugin")


def _is_offline(module: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in OFFLINE)


def _closure(graph: dict[str, set[str]], roots) -> dict[str, str]:
    """Every module reachable from roots (function-level imports included) -> the module that
    first imports it on the way."""
    seen = {r: r for r in roots}
    todo = list(roots)
    while todo:
        v = todo.pop()
        for w in sorted(graph[v]):
            if w not in seen:
                seen[w] = v
                todo.append(w)
    return seen


def test_runtime_code_reaches_no_offline_module():
    """Statically: no import statement anywhere on the runtime side, executed or not, leads to an
    offline module (the heuristics read the generated tables, not their generators)."""
    graph = import_graph()
    reach = _closure(graph, RUNTIME_ROOTS)
    assert "k3nvfp4.kernels.cost_table" in reach
    bad = sorted(m for m in reach if _is_offline(m))
    assert not bad, "runtime code imports offline tooling: " + ", ".join(f"{m} (from {reach[m]})" for m in bad)


_FORWARD = r"""
import json, sys, torch
import k3nvfp4.kernels
from k3nvfp4.kernels import fused_moe_nvfp4
from k3nvfp4.kernels.moe_fp4 import fused_moe_fp4
from k3nvfp4.kernels.modes import MODES
from k3nvfp4.kernels.testing import k3_like_modelopt_tensors, random_routing
t = k3_like_modelopt_tensors(4, 64, 64, seed=1)
tw, ids = random_routing(3, 2, 4, seed=2)
x = torch.randn(3, 64) / 8
a = fused_moe_nvfp4(x, MODES["none"].prepare(t), tw, ids)
b = fused_moe_fp4(x, MODES["nvfp4"].prepare(t), tw, ids)
assert torch.isfinite(a).all() and torch.isfinite(b).all()
print(json.dumps(sorted(m for m in sys.modules if m.startswith("k3nvfp4"))))
"""


def test_a_forward_loads_no_offline_module():
    """Dynamically: import k3nvfp4.kernels and run fused_moe_nvfp4 and fused_moe_fp4 (heuristic
    configs, so the tables are read) in the interpreter, in a fresh process; no module of OFFLINE
    is loaded."""
    import json
    import os
    import subprocess

    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-P", "-c", _FORWARD], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "k3nvfp4.kernels.cost_table" in loaded
    assert [m for m in loaded if _is_offline(m)] == []
