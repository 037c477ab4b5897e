"""k3nvfp4-cast with its worker pool (--workers 2; the CLI default is min(4, CPUs)): an error in a
shard that a second worker casts is named, exits non-zero, leaves nothing under a final name and
the source untouched; the repaired source is refused as other inputs of an unfinished cast, and
--overwrite gives the bytes of an uninterrupted cast; a 2-worker cast interrupted by SIGINT or
killed with its whole process group resumes to the same bytes as an uninterrupted one."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from k3nvfp4.checkpoint.cli import main
from k3nvfp4.checkpoint.synthetic import write_synthetic_checkpoint

FINAL = ("config.json", "model.safetensors.index.json", "cast_report.json", "hf_quant_config.json")


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("workers") / "src", num_layers=3, num_experts=2,
                                      hidden_size=64, intermediate_size=32, num_shards=4, model_hidden_size=64)


@pytest.fixture(scope="module")
def clean_cast(pristine, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("clean") / "out"
    assert main(["--source_ckpt", str(pristine), "--output_ckpt", str(out), "--workers", "2", "--no-progress"]) == 0
    return out


def _digests(d: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(d.iterdir()) if p.is_file()}


def _last_shard_scale(src: Path) -> tuple[str, Path]:
    """The first expert scale of the last shard that holds one (not the first shard: with two
    workers, another worker than the first shard's casts it while the first works)."""
    wm = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    scales = sorted((f, n) for n, f in wm.items() if n.endswith(".weight_scale") and ".experts." in n)
    last = scales[-1][0]
    assert last != sorted(set(wm.values()))[0]
    name = next(n for f, n in scales if f == last)
    return name, src / last


def test_bad_shard_in_a_second_worker_then_overwrite(pristine, clean_cast, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(pristine, src)
    name, shard = _last_shard_scale(src)
    t = load_file(str(shard))
    good = t[name].clone()
    t[name][0, 0] = 255  # E8M0 NaN: refused by name
    save_file(t, str(shard), metadata={"format": "pt"})
    before = _digests(src)

    out = tmp_path / "out"
    capsys.readouterr()
    rc = main(["--source_ckpt", str(src), "--output_ckpt", str(out), "--workers", "2", "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1 and str(shard) in err and name.rsplit(".", 1)[0] in err and "NaN" in err, err
    assert _digests(src) == before  # the source is never modified
    for f in FINAL:
        assert not (out / f).exists(), f
    assert not list(out.glob(".*.partial"))
    for f in out.glob("*.safetensors"):
        load_file(str(f))  # a shard under its final name is complete

    # The poisoned shard rewritten: an unfinished cast of other inputs is refused, by name.
    t[name] = good
    save_file(t, str(shard), metadata={"format": "pt"})
    capsys.readouterr()
    assert main(["--source_ckpt", str(src), "--output_ckpt", str(out), "--workers", "2", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "unfinished cast of other inputs" in err and shard.name in err and "--overwrite" in err, err

    # --overwrite redoes it: the result is the uninterrupted cast's bytes.
    assert main(["--source_ckpt", str(src), "--output_ckpt", str(out), "--workers", "2", "--no-progress",
                 "--overwrite"]) == 0
    a, b = _digests(out), _digests(clean_cast)
    a.pop("cast_report.json"), b.pop("cast_report.json")  # times differ
    assert a == b and len(a) > 4


def test_error_inside_a_spawned_worker_is_named(pristine, tmp_path):
    """Only the spawn pool casts (main_process_works=False): the refusal raised in a worker
    process reaches the caller with the file and the tensor named, and no final file is written."""
    from k3nvfp4.checkpoint.convert import CastOptions, run_cast
    from k3nvfp4.checkpoint.safetensors_io import CheckpointError

    src = tmp_path / "src"
    shutil.copytree(pristine, src)
    name, shard = _last_shard_scale(src)
    t = load_file(str(shard))
    t[name][0, 0] = 255
    save_file(t, str(shard), metadata={"format": "pt"})
    out = tmp_path / "out"
    with pytest.raises(CheckpointError) as info:  # the CLI's named error (exit 1), not a pool traceback
        run_cast(CastOptions(source=src, output=out, workers=2, progress=False, main_process_works=False))
    msg = str(info.value)
    assert str(shard) in msg and name.rsplit(".", 1)[0] in msg and "NaN" in msg, msg
    for f in FINAL:
        assert not (out / f).exists(), f
    assert not list(out.glob(".*.partial"))


@pytest.fixture(scope="module")
def larger(tmp_path_factory) -> tuple[Path, Path]:
    """12 shards (~7 MB): a 2-worker cast takes a few seconds, long enough to interrupt after its
    first shard is final. Returns (source, the uninterrupted cast of it)."""
    root = tmp_path_factory.mktemp("larger")
    src = write_synthetic_checkpoint(root / "src", num_layers=6, num_experts=8, hidden_size=256, intermediate_size=128,
                                     num_shards=12, model_hidden_size=256)
    ref = root / "ref"
    assert main(["--source_ckpt", str(src), "--output_ckpt", str(ref), "--workers", "2", "--no-progress"]) == 0
    return src, ref


@pytest.mark.parametrize("sig", ["SIGINT", "SIGKILL"])
def test_interrupted_multi_worker_cast_resumes_to_the_same_bytes(larger, tmp_path, sig):
    """The CLI in its own process group with --workers 2, signalled (SIGINT: Ctrl-C of the group;
    SIGKILL: a hard kill of every process) as soon as its first shard's completion is recorded; rerun
    with the same arguments it resumes, cleans any leftover partial file, and writes the bytes of
    the uninterrupted cast."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from k3nvfp4.checkpoint.convert import STATE_DIR

    src, ref = larger
    before = _digests(src)
    out = tmp_path / "out"
    cmd = [sys.executable, "-P", "-m", "k3nvfp4.checkpoint", "--source_ckpt", str(src), "--output_ckpt", str(out),
           "--workers", "2", "--no-progress"]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        # Synchronise on the event (a shard's completion record on disk), not on a sleep.
        while proc.poll() is None and not list((out / STATE_DIR).glob("model-*.json")):
            time.sleep(0.002)
        assert proc.poll() is None, f"the cast ended before it could be interrupted: {proc.communicate()[1][-2000:]}"
        os.killpg(proc.pid, getattr(signal, sig))
        _stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0
    if sig == "SIGINT":
        assert "interrupted" in stderr.lower(), stderr[-2000:]
    assert not (out / "cast_report.json").exists()
    assert _digests(src) == before

    rerun = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    report = json.loads((out / "cast_report.json").read_text())
    assert report["shards"]["resumed"] >= 1, report["shards"]
    assert not list(out.glob(".*.partial"))
    a, b = _digests(out), _digests(ref)
    a.pop("cast_report.json"), b.pop("cast_report.json")
    assert a == b
