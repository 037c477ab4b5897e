"""One production launch command (k3nvfp4.sglang_ext.launch): the README's launch blocks and
`k3nvfp4-ab serve --print-launch` come from it, and it carries what K3 needs to load."""

from __future__ import annotations

import pathlib
import shlex

import pytest

from k3nvfp4.sglang_ext import launch
from k3nvfp4.sglang_ext.ab import cli
from k3nvfp4.sglang_ext.launch import LaunchSpec

REPO = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", [*launch.README_BLOCKS, "print-launch"])
def test_readme_blocks_are_generated(name):
    text = (REPO / "README.md").read_text()
    begin, end = f"<!-- launch:{name}:begin -->\n", f"<!-- launch:{name}:end -->"
    assert begin in text and end in text, f"README.md lacks the {name} launch block"
    block = text.split(begin, 1)[1].split(end, 1)[0]
    assert block == launch.readme_block(name), (
        "README.md's launch block differs from k3nvfp4.sglang_ext.launch: run "
        "`python -P -m k3nvfp4.sglang_ext.launch --write-readme README.md`")


def test_production_launch_carries_what_k3_needs():
    cmd = launch.launch_command(LaunchSpec())
    env, body = cmd.split("\n\n", 1)
    assert "export K3NVFP4_LOAD_TIMEOUT_S=3600" in env.splitlines()  # SGLang's 480 s aborts a 1.6 TB load
    assert "export SGLANG_HOST_IP=" in env  # multi-node ranks never rendezvous without it
    argv = shlex.split(body.replace("\\\n", " ").replace("${NODE_RANK}", "0").replace("${HEAD_IP}", "h"))
    assert argv[:3] == ["python", "-m", "sglang.launch_server"]
    flags = dict(zip(argv[3::1], argv[4::1]))
    assert flags["--tp-size"] == "16" and flags["--nnodes"] == "2" and flags["--node-rank"] == "0"
    assert flags["--moe-runner-backend"] == "triton_situ" and flags["--dist-timeout"] == "3600"
    assert flags["--mamba-full-memory-ratio"] == "7.21"
    assert flags["--model-loader-extra-config"] == '{"enable_multithread_load": true}'
    assert "--disable-flashinfer-autotune" in argv and "--trust-remote-code" in argv
    single = launch.launch_command(LaunchSpec(nnodes=1, tp=8))
    assert "--nnodes" not in single and "SGLANG_HOST_IP" not in single and "--tp-size 8" in single


def test_print_launch_is_the_production_launch(capsys):
    assert cli.main(["serve", "--print-launch", "--model-path", "/m/k3-nvfp4"]) == 0
    out = capsys.readouterr().out
    for backend, port in (("marlin", 30000), ("triton_situ", 30001)):
        spec = LaunchSpec("/m/k3-nvfp4", backend, port=port)
        assert launch.one_line(spec) in out.splitlines()
    assert out.count("K3NVFP4_LOAD_TIMEOUT_S=3600 SGLANG_PLUGINS=k3nvfp4 python -m sglang.launch_server") == 2
    assert out.count("--tp-size 16 --nnodes 2") == 2 and "--tp-size 8" not in out


def test_bad_specs_are_named(capsys):
    with pytest.raises(ValueError, match="ep=3: must divide tp=16"):
        LaunchSpec(ep=3)
    with pytest.raises(ValueError, match="backend='triton'"):
        LaunchSpec(backend="triton")
    assert cli.main(["serve", "--print-launch", "--tp", "16", "--nnodes", "3"]) == 2
    assert "nnodes=3: must divide tp=16" in capsys.readouterr().err
