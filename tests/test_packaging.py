"""Packaging and module hygiene a new user meets first.

- Building the package prints no warning of this project's making (setuptools used to warn
  about the license table and about package-data folders missing from ``packages``).
- ``python -P -m <module>`` of the project's runnable modules prints no warning (runpy used to
  warn that the synthetic-checkpoint module was imported by its package before it ran).
- ``k3nvfp4.checkpoint`` depends on nothing of ``k3nvfp4.sglang_ext`` (the demo, which uses
  both, lives above them in ``k3nvfp4.demo``).
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
_IGNORE = shutil.ignore_patterns(".venv", "build", "dist", ".git", "*.egg-info", "__pycache__", ".pytest_cache",
                                 ".hypothesis", "gpu_out")  # fmt: skip


def _env() -> dict[str, str]:
    env = {**os.environ, "PYTHONSAFEPATH": "1"}
    env.pop("PYTHONWARNINGS", None)  # what a user sees: Python's default filters
    return env


@pytest.fixture(scope="module")
def built_wheel(tmp_path_factory) -> tuple[Path, str]:
    """(wheel, pip's output) of a non-editable build of a copy of the checkout."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO, src, ignore=_IGNORE)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(tmp / "dist"), str(src)],
        capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    (wheel,) = (tmp / "dist").glob("kimi_k3_nvfp4-*.whl")
    return wheel, out


def test_wheel_build_prints_no_project_warning(built_wheel):
    wheel, out = built_wheel
    for marker in ("Warning", "deprecated", "is absent from the `packages`"):
        assert marker not in out, out[-4000:]
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ("k3nvfp4/common/files.py", "k3nvfp4/demo/__main__.py", "k3nvfp4/sglang_ext/model_check/run.py",
              "k3nvfp4/sglang_ext/ab/data/default_prompts.jsonl", "k3nvfp4/checkpoint/synthetic.py"):  # fmt: skip
        assert f in names, f
    assert not any(n.startswith(("kernels/", "checkpoint/", "sglang_ext/", "demo/", "common/")) for n in names)
    # Every module and data file under the package folders is in the wheel (a subpackage missing
    # from pyproject's list used to ship a package whose FP4 modes could not be imported).
    for folder in ("common", "kernels", "checkpoint", "sglang_ext", "demo"):
        for f in (REPO / folder).rglob("*"):
            if f.is_file() and f.suffix in (".py", ".json", ".jsonl") and "__pycache__" not in f.parts:
                assert f"k3nvfp4/{f.relative_to(REPO).as_posix()}" in names, f"{f.relative_to(REPO)} missing from the wheel"
    metadata = next(n for n in names if n.endswith(".dist-info/METADATA"))
    meta = zipfile.ZipFile(wheel).read(metadata).decode()
    assert "License-Expression: Apache-2.0" in meta
    # The serve A/B's HTTP client is declared where it is needed, not in the core install.
    httpx_extras = sorted(line.split('extra == "')[1].rstrip('"') for line in meta.splitlines()
                          if line.startswith("Requires-Dist: httpx") and 'extra == "' in line)
    assert httpx_extras == ["ab", "sglang", "test"], httpx_extras
    assert not any(line.startswith("Requires-Dist: httpx") and "extra ==" not in line for line in meta.splitlines())


def test_installed_wheel_imports_every_module_and_runs_the_fp4_arms(built_wheel, tmp_path):
    """The wheel installed non-editably (pip --target, the checkout out of sys.path): every module
    imports, and the A/B tool's FP4-mode arms run in the interpreter (a subpackage missing from
    the wheel used to end this in ModuleNotFoundError)."""
    wheel, _ = built_wheel
    site = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                          capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    env = {**_env(), "PYTHONPATH": str(site), "TRITON_INTERPRET": "1"}
    code = (
        "import importlib, pkgutil, k3nvfp4\n"
        f"assert k3nvfp4.__path__[0].startswith({str(site)!r}), k3nvfp4.__path__\n"
        "names = [m.name for m in pkgutil.walk_packages(k3nvfp4.__path__, 'k3nvfp4.') if not m.name.endswith('__main__')]\n"
        "for n in names: importlib.import_module(n)\n"
        "print(len(names))"
    )
    proc = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=600, env=env,
                          cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert int(proc.stdout.split()[-1]) >= 80  # every module of the package folders
    proc = subprocess.run(
        [sys.executable, "-P", "-m", "k3nvfp4.sglang_ext.ab.cli", "layer", "--synthetic", "--experts", "4", "--hidden",
         "64", "--intermediate", "64", "--top-k", "2", "--tokens", "4", "--device", "cpu",
         "--arms", "reference,triton_situ:mxfp8,triton_situ:nvfp4", "--out", str(tmp_path / "ab")],
        capture_output=True, text=True, timeout=900, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "ModuleNotFoundError" not in proc.stdout + proc.stderr
    import json

    arms = {a["name"]: a["status"] for a in json.loads((tmp_path / "ab" / "report.json").read_text())["arms"]}
    assert arms["reference"] == "ok"
    assert arms["triton_situ:nvfp4"] == "ok", arms  # the FP4 modes run in the interpreter (Triton >= 3.8)
    # mxfp8 needs MXFP4-representable weights; random NVFP4 ones are refused by the mode's own check,
    # which means its code imported and ran.
    assert arms["triton_situ:mxfp8"] == "ok" or arms["triton_situ:mxfp8"].startswith(
        "not available: mxfp8 needs E8M0-representable weight scales"), arms


@pytest.mark.parametrize(
    "argv",
    [
        ["k3nvfp4.checkpoint.synthetic", "--out", "{tmp}/syn", "--layers", "2", "--experts", "2", "--hidden", "32",
         "--intermediate", "32", "--shards", "1"],
        ["k3nvfp4.checkpoint", "--help"],
        ["k3nvfp4.checkpoint.cli", "--help"],
        ["k3nvfp4.demo", "--help"],
        ["k3nvfp4.kernels.tune", "--help"],
        ["k3nvfp4.sglang_ext.ab.cli", "--help"],
        ["k3nvfp4.sglang_ext.launch", "--nnodes", "1", "--tp", "8"],
    ],
    ids=lambda a: a[0],
)  # fmt: skip
def test_module_runs_print_no_warning(argv, tmp_path):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    proc = subprocess.run([sys.executable, "-P", "-m", *argv], capture_output=True, text=True, timeout=300,
                          env=_env(), cwd=tmp_path)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "Warning" not in proc.stderr, proc.stderr[-4000:]


def _imports(path: Path) -> set[str]:
    """Absolute and package-relative module names imported by ``path`` (resolved against k3nvfp4)."""
    pkg = ["k3nvfp4", path.parent.name]
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = pkg[: len(pkg) - node.level + 1] if node.level else []
            mod = ".".join(base + ([node.module] if node.module else []))
            out.add(mod)
            out.update(f"{mod}.{a.name}" for a in node.names)
    return out


def test_checkpoint_does_not_depend_on_sglang_ext():
    files = sorted((REPO / "checkpoint").glob("*.py"))
    assert files
    for f in files:
        bad = sorted(m for m in _imports(f) if m.startswith("k3nvfp4.sglang_ext") or m.startswith("sglang"))
        assert bad == [], f"{f.name} imports {bad}"
    modules = [f"k3nvfp4.checkpoint.{f.stem}" for f in files if f.stem != "__main__"]
    code = ("import importlib, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "print(sorted(m for m in sys.modules if m.startswith(('k3nvfp4.sglang_ext', 'sglang'))))")  # fmt: skip
    proc = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.strip() == "[]"
