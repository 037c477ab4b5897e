"""The documented CPU server command (k3nvfp4.sglang_ext.cpu_server) without starting a server:
what it prints, its tokenizer folder, bad input. The servers it starts are exercised by
tests/test_real_server.py and tests/test_real_server_k3.py (tests/real_server.py uses it)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from k3nvfp4.sglang_ext import cpu_server
from k3nvfp4.sglang_ext.cpu import PYTHONPATH_DIR


def _run(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-P", "-m", "k3nvfp4.sglang_ext.cpu_server", *argv], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


def _model(path: Path, model_type: str) -> Path:
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps({"model_type": model_type}))
    return path


def test_print_for_a_k3_checkpoint(tmp_path):
    k3 = _model(tmp_path / "k3", "kimi_k3")
    proc = _run("--model", str(k3), "--moe-runner-backend", "torch_reference", "--port", "30002", "--print", "--",
                "--max-total-tokens", "8192", env={"K3NVFP4_CACHE_DIR": str(tmp_path / "cache")})
    assert proc.returncode == 0, proc.stderr
    assert "Warning" not in proc.stderr, proc.stderr
    lines = proc.stdout.splitlines()
    exports = dict(x[len("export "):].split("=", 1) for x in lines[:-1])
    assert exports["SGLANG_USE_CPU_ENGINE"] == exports["K3NVFP4_SGLANG_CPU"] == exports["TRITON_INTERPRET"] == "1"
    assert exports["SGLANG_PLUGINS"] == "k3nvfp4"
    assert exports["TORCHDYNAMO_DISABLE"] == "1"  # no inductor C++ compiles on the first requests
    assert exports["PYTHONPATH"].split(os.pathsep)[0] == str(PYTHONPATH_DIR)
    cmd = lines[-1].split()
    assert cmd[1:3] == ["-m", "sglang.launch_server"]
    flags = " ".join(cmd)
    assert "--moe-runner-backend torch_reference" in flags and "--device cpu" in flags and "--dtype float16" in flags
    assert "--host 127.0.0.1 --port 30002" in flags
    assert "--sleep-on-idle" in flags  # an idle scheduler would busy-poll a core
    # The tokenizer folder, written once into the cache; the extra flag after the CPU ones.
    tok = tmp_path / "cache" / cpu_server.TOKENIZER_DIR_NAME
    assert f"--tokenizer-path {tok}" in flags and (tok / "processing_tiny_k3.py").is_file()
    assert json.loads((tok / "processor_config.json").read_text())["processor_class"] == "TinyK3Processor"
    assert flags.index("--max-total-tokens 4096") < flags.index("--max-total-tokens 8192")
    assert not [p for p in tok.parent.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_other_models_get_no_k3_flags_and_their_own_tokenizer(tmp_path):
    llama = _model(tmp_path / "llama", "llama")
    cmd = cpu_server.server_command(llama, "triton_situ", port=1234)
    assert "--dtype" not in cmd and "--tokenizer-path" not in cmd and "--device" in cmd
    assert not cpu_server.is_kimi_k3(tmp_path / "missing")


@pytest.mark.parametrize("argv,message", [
    (["--model", "{tmp}/none"], "--model {tmp}/none: no config.json there"),
    (["--model", "{tmp}/k3", "--moe-runner-backend", "marlin"], "invalid choice: 'marlin'"),
    (["--model", "{tmp}/k3", "--port", "0"], "--port 0: expected 1..65535"),
    (["--model", "{tmp}/k3", "--tokenizer-path", "{tmp}/none"], "--tokenizer-path {tmp}/none: not a folder"),
])
def test_bad_input_is_one_line_and_exit_2(tmp_path, argv, message):
    _model(tmp_path / "k3", "kimi_k3")
    proc = _run(*[a.replace("{tmp}", str(tmp_path)) for a in argv])
    assert proc.returncode == 2 and message.replace("{tmp}", str(tmp_path)) in proc.stderr.splitlines()[-1], proc.stderr
    assert not (tmp_path / "k3" / "tokenizer.json").exists()


def test_a_users_dynamo_setting_wins():
    from k3nvfp4.sglang_ext.cpu_server import server_env

    assert server_env({})["TORCHDYNAMO_DISABLE"] == "1"
    assert server_env({"TORCHDYNAMO_DISABLE": "0"})["TORCHDYNAMO_DISABLE"] == "0"
