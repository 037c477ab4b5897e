"""k3nvfp4-cast with --workers 2 (the CLI default is min(4, CPUs)) on a bad later shard: named,
exit 1, nothing under a final name, the source untouched; the repaired source is refused as other
inputs of the unfinished cast, and --overwrite gives the bytes of an uninterrupted cast. An error
raised inside a spawned worker reaches the caller by name. Interrupts (SIGINT, SIGKILL of the
group, a worker killed mid-shard) and their resumes are tests/test_checkpoint_pool.py's, which
steers the pool through marker files instead of racing the cast."""

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
    """The first expert scale of the last shard that holds one (not the first shard, so the run
    has written or started other shards when it fails; which process casts it is not steered
    here: the main process may take every shard before the pool is up)."""
    wm = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    scales = sorted((f, n) for n, f in wm.items() if n.endswith(".weight_scale") and ".experts." in n)
    last = scales[-1][0]
    assert last != sorted(set(wm.values()))[0]
    name = next(n for f, n in scales if f == last)
    return name, src / last


def test_bad_later_shard_with_two_workers_then_overwrite(pristine, clean_cast, tmp_path, capsys):
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
