"""One production launch command (k3nvfp4.sglang_ext.launch): the launch blocks of README.md and
docs/ (launch.README_FILES) and `k3nvfp4-ab serve --print-launch` come from it, and it carries
what K3 needs to load."""

from __future__ import annotations

import pathlib
import shlex

import pytest

from k3nvfp4.sglang_ext import launch
from k3nvfp4.sglang_ext.ab import cli
from k3nvfp4.sglang_ext.launch import LaunchSpec

REPO = pathlib.Path(__file__).resolve().parent.parent


BLOCKS = [(rel, name) for rel, names in launch.README_FILES.items() for name in names]


def test_every_block_lives_in_one_file():
    names = [name for _, name in BLOCKS]
    assert sorted(names) == sorted(launch.BLOCK_NAMES), "README_FILES must name every block exactly once"
    for rel in launch.README_FILES:  # no stale copy of another file's block
        text = (REPO / rel).read_text()
        for name in launch.BLOCK_NAMES:
            if name not in launch.README_FILES[rel]:
                assert f"<!-- launch:{name}:" not in text, f"{rel} holds the {name} block, which lives elsewhere"


@pytest.mark.parametrize("rel,name", BLOCKS)
def test_readme_blocks_are_generated(rel, name):
    text = (REPO / rel).read_text()
    block = launch.block_text(text, name)
    assert block is not None, f"{rel} lacks the {name} launch block"
    assert block == launch.readme_block(name), (
        f"{rel}'s {name} launch block differs from k3nvfp4.sglang_ext.launch: run "
        "`python -P -m k3nvfp4.sglang_ext.launch --write-readme .` in the repository root")


def test_write_readme_regenerates_every_file(tmp_path):
    for rel, names in launch.README_FILES.items():
        stale = "".join(f"before\n<!-- launch:{n}:begin -->\nstale\n<!-- launch:{n}:end -->\nafter\n" for n in names)
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(stale)
    assert launch.main(["--write-readme", str(tmp_path)]) == 0
    for rel, name in BLOCKS:
        text = (tmp_path / rel).read_text()
        assert launch.block_text(text, name) == launch.readme_block(name)
        assert "stale" not in text and text.startswith("before\n") and text.endswith("after\n")
    (tmp_path / "docs" / "ab.md").write_text("no markers\n")
    with pytest.raises(SystemExit, match="ab.md: markers <!-- launch:print-launch:begin -->"):
        launch.write_readme(tmp_path)


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
