"""`python -P -m k3nvfp4.sglang_ext.selfcheck` on a core install (no SGLang): one clear line and
exit 2, not a ModuleNotFoundError traceback (issue 40, item 11). SGLang is hidden from a child
interpreter by a meta-path finder that refuses every `sglang` module, as on an install without it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

BLOCK = """
import sys
class NoSGLang:
    def find_spec(self, name, path=None, target=None):
        if name == "sglang" or name.startswith("sglang."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, NoSGLang())
from k3nvfp4.sglang_ext import selfcheck
sys.exit(selfcheck.main(sys.argv[1:]))
"""


@pytest.mark.parametrize("with_model", [False, True])
def test_selfcheck_without_sglang_is_one_line(tmp_path, with_model):
    argv = []
    if with_model:
        (tmp_path / "config.json").write_text("{}")
        argv = ["--model", str(tmp_path)]
    r = subprocess.run([sys.executable, "-P", "-c", BLOCK, *argv], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "TRITON_INTERPRET": "1"})
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert lines[0].startswith("python -P -m k3nvfp4.sglang_ext.selfcheck: error: SGLang is not installed here "
                               "(No module named 'sglang")
    assert '.[sglang]' in lines[0]


def test_plugin_check_prints_no_sglang_warning():
    """docs/development.md: runnable modules print no warning. The plugin check (with SGLang)
    prints its JSON and nothing on stderr: SGLang's AWQ / GGUF start-up warnings on a machine
    without CUDA are silenced in selfcheck.plugin_status, by their text."""
    pytest.importorskip("sglang")
    r = subprocess.run([sys.executable, "-P", "-m", "k3nvfp4.sglang_ext.selfcheck"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "AWQ" not in r.stderr and "GGUF" not in r.stderr, r.stderr
    assert '"backend_choice": true' in r.stdout
