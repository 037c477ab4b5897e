"""Ctrl-C in the command-line tools (issue 29, item 4): a one-line message and exit 130 whether
it lands while the tool imports torch or while it works, and exit 0 once the work is done."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
import time

from k3nvfp4.checkpoint import convert
from k3nvfp4.checkpoint.cli import main as cast_main
from k3nvfp4.checkpoint.synthetic import write_synthetic_checkpoint
from k3nvfp4.common import entry


def test_console_scripts_go_through_the_guard():
    """pyproject's scripts are entry.cast / tune / ab, and each names the module of its tool."""
    import tomllib
    from pathlib import Path

    scripts = tomllib.loads((Path(__file__).parents[1] / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {prog: f"k3nvfp4.common.entry:{prog.split('-')[1]}" for prog in entry.TOOLS}
    for prog, module in entry.TOOLS.items():
        assert callable(__import__(module, fromlist=["main"]).main), prog


def _module(tmp_path, monkeypatch, name: str, body: str) -> str:
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_interrupt_while_importing_the_tool(tmp_path, monkeypatch, capsys):
    mod = _module(tmp_path, monkeypatch, "tool_slow_import", "raise KeyboardInterrupt\ndef main(): return 0\n")
    assert entry.run_module(mod, "k3nvfp4-x") == 130
    assert capsys.readouterr().err == "k3nvfp4-x: interrupted while starting; nothing was done\n"


def test_interrupt_the_tool_does_not_handle(tmp_path, monkeypatch, capsys):
    mod = _module(tmp_path, monkeypatch, "tool_raises", "def main():\n    raise KeyboardInterrupt\n")
    assert entry.run_module(mod, "k3nvfp4-y") == 130
    assert capsys.readouterr().err == "k3nvfp4-y: interrupted\n"
    mod = _module(tmp_path, monkeypatch, "tool_ok", "def main():\n    return 3\n")
    assert entry.run_module(mod, "k3nvfp4-z") == 3


def _sigint_default() -> None:
    """In the child before exec: SIGINT at its default, so that Python installs its Ctrl-C handler.
    A shell runs a background job (`make test &` in a script) with SIGINT ignored, the child would
    inherit that and ignore the test's SIGINT (seen: exit 0); a terminal or CI already gives the default."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_sigint_during_the_torch_import_of_a_real_process():
    """A real SIGINT while the tuner's module imports torch (seen through -X importtime's lines):
    the message, exit 130, no traceback."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, "-P", "-X", "importtime", "-m", "k3nvfp4.common.entry",
                          "k3nvfp4.kernels.tune", "--help"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                         env=env, text=True, preexec_fn=_sigint_default)
    seen = []
    deadline = time.monotonic() + 120
    for line in p.stderr:  # importtime writes a line as each module finishes importing
        seen.append(line)
        if re.search(r"\|\s+torch\.\w", line) or time.monotonic() > deadline:
            break
    p.send_signal(signal.SIGINT)
    rest = p.stderr.read()
    rc = p.wait(timeout=120)
    err = "".join(seen) + rest
    lines = [ln for ln in err.splitlines() if not ln.startswith("import time:")]
    assert rc == 130, err[-3000:]
    assert lines == ["k3nvfp4-tune: interrupted while starting; nothing was done"], lines


def test_interrupt_after_the_cast_finished_is_not_an_error(tmp_path, monkeypatch, capsys):
    src = write_synthetic_checkpoint(tmp_path / "src", num_layers=2, num_experts=4, hidden_size=64,
                                     intermediate_size=32, num_shards=2, seed=3)
    out = tmp_path / "out"

    def interrupted_summary(report):
        raise KeyboardInterrupt

    monkeypatch.setattr(convert, "format_summary", interrupted_summary)
    assert cast_main(["--source-ckpt", str(src), "--output-ckpt", str(out), "--workers", "1"]) == 0
    err = capsys.readouterr().err.splitlines()[-1]
    assert err == (f"k3nvfp4-cast: interrupted after the cast had finished; {out} is complete "
                   f"(summary: {out / 'cast_report.json'})")
    assert (out / "cast_report.json").is_file()


def test_interrupt_during_the_cast_says_how_to_resume(tmp_path, monkeypatch, capsys):
    src = write_synthetic_checkpoint(tmp_path / "src", num_layers=2, num_experts=4, hidden_size=64,
                                     intermediate_size=32, num_shards=2, seed=3)

    def interrupted(task):
        raise KeyboardInterrupt

    monkeypatch.setattr(convert, "cast_shard", interrupted)
    out = tmp_path / "out"
    assert cast_main(["--source-ckpt", str(src), "--output-ckpt", str(out), "--workers", "1"]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == "k3nvfp4-cast: interrupted; run the same command again to resume"
    assert not (out / "cast_report.json").exists()
