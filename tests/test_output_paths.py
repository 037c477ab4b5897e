"""Output locations are checked before any work, in every command of the package that writes
one (issue 40): one line naming the argument and the path, exit 2, nothing created or changed.
The A/B commands' own tests (test_ab_serve.py, test_ab_layer.py) also show that no request is
sent and no weight is loaded first."""

from __future__ import annotations

import os

import pytest

from k3nvfp4.common.outputs import OutputPathError, check_output_dir, check_output_file


@pytest.fixture
def blocker(tmp_path):
    f = tmp_path / "outfile"
    f.write_text("keep\n")
    return f


def test_check_output_dir(tmp_path, blocker):
    assert check_output_dir(tmp_path / "new" / "deeper", "--out") == tmp_path / "new" / "deeper"
    assert not (tmp_path / "new").exists()  # nothing created
    assert check_output_dir(tmp_path, "--out") == tmp_path  # an existing directory is fine
    with pytest.raises(OutputPathError, match=rf"^--out {blocker}: exists and is not a directory"):
        check_output_dir(blocker, "--out")
    with pytest.raises(OutputPathError, match=rf"^--out {blocker}/a/b: cannot create the directory: {blocker} is a file"):
        check_output_dir(blocker / "a" / "b", "--out")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes anywhere: a read-only folder cannot be made")
def test_check_output_not_writable(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        with pytest.raises(OutputPathError, match="is not writable"):
            check_output_dir(ro / "x", "--out")
        with pytest.raises(OutputPathError, match="is not writable"):
            check_output_dir(ro, "--out")
    finally:
        ro.chmod(0o755)


def test_check_output_file(tmp_path, blocker):
    assert check_output_file(blocker, "--json") == blocker  # an existing file is replaced later
    assert check_output_file(tmp_path / "a" / "r.json", "--json") == tmp_path / "a" / "r.json"
    with pytest.raises(OutputPathError, match=rf"^--json {tmp_path}: is a directory"):
        check_output_file(tmp_path, "--json")
    with pytest.raises(OutputPathError, match=rf"^--json {blocker}/r.json: cannot create the file: {blocker} is a file"):
        check_output_file(blocker / "r.json", "--json")


def _one_line(err: str, prefix: str) -> None:
    assert len(err.strip().splitlines()) == 1 and err.startswith(prefix), err


def test_cast_output_is_a_file(tmp_path, blocker, capsys):
    from k3nvfp4.checkpoint.cli import main

    # The source does not even exist: the output is checked first, before the source is read.
    assert main(["--source-ckpt", str(tmp_path / "nosrc"), "--output-ckpt", str(blocker), "--no-progress"]) == 2
    _one_line(capsys.readouterr().err, f"k3nvfp4-cast: error: --output-ckpt {blocker}: exists and is not a directory")
    assert blocker.read_text() == "keep\n"


def test_synthetic_out_is_a_file(blocker, capsys):
    from k3nvfp4.checkpoint.synthetic import main

    assert main(["--out", str(blocker)]) == 2
    _one_line(capsys.readouterr().err, f"error: --out {blocker}: exists and is not a directory")


@pytest.mark.parametrize("flag", ["--out-dir", "--report"])
def test_tune_outputs_checked_first(blocker, capsys, flag):
    from k3nvfp4.kernels.tune import main

    target = str(blocker) if flag == "--out-dir" else str(blocker / "r.json")
    # --device cpu outside the interpreter would raise: the check comes before, so it never gets there.
    assert main(["--E", "4", "--H", "64", "--I", "32", "--top-k", "2", "--device", "cpu", flag, target]) == 2
    _one_line(capsys.readouterr().err, f"k3nvfp4-tune: error: {flag} {target}: ")


def test_model_check_json_checked_first(tmp_path, blocker, capsys, monkeypatch):
    from k3nvfp4.sglang_ext.model_check import cli, run

    monkeypatch.setattr(run, "run_checks", lambda options: pytest.fail("checks ran before the --json check"))
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text("{}")
    assert cli.main(["--model", str(ck), "--json", str(blocker / "r.json")]) == 2
    _one_line(capsys.readouterr().err, f"{cli.PROG}: error: --json {blocker}/r.json: cannot create the file")
