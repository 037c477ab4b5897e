"""k3nvfp4-cast on bad input: a clear message naming the file/tensor, a non-zero exit, and no
corrupted output (nothing half-written under a final name, no config/index/report)."""

from __future__ import annotations

import errno
import json
import os
import shutil
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from k3nvfp4.checkpoint import safetensors_io
from k3nvfp4.checkpoint.cli import main
from k3nvfp4.checkpoint.synthetic import write_synthetic_checkpoint

SCALE = "language_model.model.layers.1.block_sparse_moe.experts.1.w3.weight_scale"
PACKED = "language_model.model.layers.1.block_sparse_moe.experts.0.w2.weight_packed"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    return write_synthetic_checkpoint(tmp_path_factory.mktemp("bad") / "src", num_layers=2, num_experts=2,
                                      hidden_size=64, intermediate_size=32, num_shards=2, model_hidden_size=64)


@pytest.fixture
def src(pristine, tmp_path) -> Path:
    d = tmp_path / "src"
    shutil.copytree(pristine, d)
    return d


def _shard_of(src: Path, name: str) -> Path:
    wm = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    return src / wm[name]


def _rewrite(src: Path, name: str, fn) -> Path:
    path = _shard_of(src, name)
    t = load_file(str(path))
    t[name] = fn(t[name])
    save_file(t, str(path), metadata={"format": "pt"})
    return path


def _run(src: Path, out: Path, capsys, *extra: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = main(["--source_ckpt", str(src), "--output_ckpt", str(out), "--workers", "1", "--no-progress", *extra])
    return rc, capsys.readouterr().err


def _assert_no_corrupt_output(out: Path) -> None:
    for f in ("config.json", "model.safetensors.index.json", "cast_report.json", "hf_quant_config.json"):
        assert not (out / f).exists(), f
    if out.exists():
        assert not list(out.glob(".*.partial"))
        for f in out.glob("*.safetensors"):
            load_file(str(f))  # any shard under its final name is complete


def test_missing_shard(src, tmp_path, capsys):
    shard = _shard_of(src, PACKED)
    shard.unlink()
    rc, err = _run(src, tmp_path / "out", capsys)
    assert rc == 1 and str(shard) in err and "missing" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("damage", ["truncate", "header"])
def test_truncated_or_corrupt_shard(src, tmp_path, capsys, damage):
    shard = _shard_of(src, PACKED)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2] if damage == "truncate" else b"\x07" * 8 + data[8:])
    rc, err = _run(src, tmp_path / "out", capsys)
    assert rc == 1 and str(shard) in err
    assert ("truncated" in err) if damage == "truncate" else ("corrupt" in err)
    assert not (tmp_path / "out").exists()


def test_index_names_absent_tensor(src, tmp_path, capsys):
    idx = src / "model.safetensors.index.json"
    j = json.loads(idx.read_text())
    shard = j["weight_map"][PACKED]
    j["weight_map"]["language_model.model.layers.1.block_sparse_moe.experts.9.w1.weight_packed"] = shard
    idx.write_text(json.dumps(j))
    rc, err = _run(src, tmp_path / "out", capsys)
    assert rc == 1 and "experts.9.w1.weight_packed" in err and "absent" in err and shard in err
    assert not (tmp_path / "out").exists()


def test_nan_exponent(src, tmp_path, capsys):
    def poison(t):
        t = t.clone()
        t[1, 0] = 255
        return t

    path = _rewrite(src, SCALE, poison)
    out = tmp_path / "out"
    rc, err = _run(src, out, capsys)
    assert rc == 1 and "255" in err and "NaN" in err and SCALE.rsplit(".", 1)[0] in err and str(path) in err
    _assert_no_corrupt_output(out)
    # what the failed run left and how to go on (issue 29, item 7)
    assert f"{out} keeps " in err and "resume state (.k3nvfp4-cast/)" in err and "--overwrite" in err, err


W2_SCALE = PACKED.replace("weight_packed", "weight_scale")


@pytest.mark.parametrize(
    "edits,name,words",
    [
        ([(PACKED, lambda t: t.view(torch.int8))], PACKED, ["dtype I8", "U8"]),
        ([(SCALE, lambda t: t[:, :1].contiguous())], SCALE, ["shape [32, 1]", "expected [32, 2]"]),
        # A self-consistent w2 of the wrong size: [64, 64] instead of [H, I] = [64, 32].
        ([(PACKED, lambda t: torch.cat([t, t], 1)), (W2_SCALE, lambda t: torch.cat([t, t], 1))], PACKED,
         ["shape [64, 32]", "expected [64, 16]"]),
    ],
)
def test_wrong_dtype_or_shape(src, tmp_path, capsys, edits, name, words):
    for n, fn in edits:
        _rewrite(src, n, fn)
    rc, err = _run(src, tmp_path / "out", capsys)
    assert rc == 1 and name in err and all(w in err for w in words), err
    assert not (tmp_path / "out").exists()


def test_output_equal_to_or_inside_source(src, capsys):
    before = sorted(p.name for p in src.iterdir())
    for out in (src, src / "nvfp4"):
        rc, err = _run(src, out, capsys, "--overwrite")
        assert rc == 1 and "inside" in err
    assert sorted(p.name for p in src.iterdir()) == before
    rc, err = _run(src / "sub", src.parent, capsys)  # the output would contain the source
    assert rc == 1


def test_output_exists(src, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    rc, err = _run(src, out, capsys)
    assert rc == 1 and "--overwrite" in err
    rc, err = _run(src, out, capsys, "--overwrite")  # not ours: never deleted
    assert rc == 1 and "refusing" in err
    assert (out / "precious.txt").read_text() == "keep me"


def test_disk_write_failure(src, tmp_path, capsys, monkeypatch):
    class FullDisk:
        def __init__(self, f):
            self._f = f

        def write(self, data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def __getattr__(self, name):
            return getattr(self._f, name)

    real_enter = safetensors_io.StreamingWriter.__enter__

    def enter(self):
        w = real_enter(self)  # writes the header, then the disk is full
        self._f = FullDisk(self._f)
        return w

    def no_copy(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(safetensors_io.StreamingWriter, "__enter__", enter)
    monkeypatch.setattr(os, "copy_file_range", no_copy)
    out = tmp_path / "out"
    rc, err = _run(src, out, capsys)
    assert rc == 1 and "No space left on device" in err and ".safetensors" in err
    _assert_no_corrupt_output(out)
    assert not list(out.glob("*.safetensors"))


def _set_group_size(src: Path, size: int) -> None:
    cfg = json.loads((src / "config.json").read_text())

    def walk(d):
        if isinstance(d, dict):
            for k, v in d.items():
                if k == "group_size":
                    d[k] = size
                else:
                    walk(v)
        elif isinstance(d, list):
            for v in d:
                walk(v)

    walk(cfg)
    (src / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("workers", ["1", "2"])
@pytest.mark.parametrize("case", ["invalid_index_json", "group_size_16", "output_is_a_file"])
def test_refused_inputs_are_named(src, tmp_path, capsys, case, workers):
    """Refusals before any work, with the single process and with the pool: the file and what
    is wrong with it, exit 1 (an --output-ckpt that cannot be a directory: exit 2, the usage error it is,
    checked before the source is read), no output directory made (or the file left as it was)."""
    out = tmp_path / "out"
    if case == "invalid_index_json":
        (src / "model.safetensors.index.json").write_text("{not json")
        expected = (str(src / "model.safetensors.index.json"), "not valid JSON")
    elif case == "group_size_16":
        _set_group_size(src, 16)
        expected = (str(src / "config.json"), "group_size is 16, expected 32")
    else:
        out.write_text("keep me")
        expected = (f"--output-ckpt {out}", "exists and is not a directory")
    before = {p.name: p.read_bytes() for p in src.iterdir() if p.is_file()}
    capsys.readouterr()
    rc = main(["--source_ckpt", str(src), "--output_ckpt", str(out), "--workers", workers, "--no-progress"])
    err = capsys.readouterr().err
    assert rc == (2 if case == "output_is_a_file" else 1) and all(e in err for e in expected), err
    assert {p.name: p.read_bytes() for p in src.iterdir() if p.is_file()} == before
    if case == "output_is_a_file":
        assert out.read_text() == "keep me"
    else:
        assert not out.exists()


def test_already_cast_source_is_refused(src, tmp_path, capsys):
    """A ModelOpt NVFP4 checkpoint (this tool's own output) given as the source: named, exit 1."""
    cast = tmp_path / "cast"
    assert main(["--source_ckpt", str(src), "--output_ckpt", str(cast), "--workers", "1", "--no-progress"]) == 0
    capsys.readouterr()
    rc = main(["--source_ckpt", str(cast), "--output_ckpt", str(tmp_path / "again"), "--workers", "2",
               "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 1 and str(cast / "config.json") in err and "'modelopt', expected 'compressed-tensors'" in err, err
    assert not (tmp_path / "again").exists()


def test_tensor_missing_from_the_index(src, tmp_path, capsys):
    """A shard holds a tensor the index does not map there: named with its shard, exit 1."""
    shard = _shard_of(src, PACKED)
    t = load_file(str(shard))
    t["stray.tensor"] = torch.zeros(4)
    save_file(t, str(shard), metadata={"format": "pt"})
    rc, err = _run(src, tmp_path / "out", capsys)
    assert rc == 1 and str(shard) in err and "stray.tensor is not mapped to this shard" in err, err
    assert not (tmp_path / "out").exists()


def test_header_data_offsets_that_do_not_match(src, tmp_path, capsys):
    """A safetensors header whose data_offsets disagree with the tensor's dtype and shape."""
    import struct

    shard = _shard_of(src, PACKED)
    raw = shard.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    lo, hi = header[PACKED]["data_offsets"]
    header[PACKED]["data_offsets"] = [lo, hi + 64]
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    shard.write_bytes(struct.pack("<Q", len(hb)) + hb + raw[8 + n:])
    rc, err = _run(src, tmp_path / "out", capsys)
    assert rc == 1 and str(shard) in err and PACKED in err and f"data_offsets {lo}..{hi + 64} do not match" in err, err
    _assert_no_corrupt_output(tmp_path / "out")


# --- More header and mid-run branches (issue 26, item 4). The header refusals come from the
# plan, in the main process before a pool starts; --workers 2 is the multi-process setting.

LM_HEAD = "language_model.lm_head.weight"


def _run2(src: Path, out: Path, capsys, *extra: str) -> tuple[int, str]:
    return _run(src, out, capsys, "--workers", "2", *extra)


def _edit_header(path: Path, fn) -> None:
    """Rewrite a shard's JSON header with ``fn(header)`` (tensor data bytes kept as they are;
    data_offsets are relative to the end of the header, so its length may change)."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8: 8 + n])
    fn(header)
    new = json.dumps(header).encode()
    new += b" " * (-len(new) % 8)
    path.write_bytes(struct.pack("<Q", len(new)) + new + raw[8 + n:])


def test_unsupported_dtype(src, tmp_path, capsys):
    path = _shard_of(src, LM_HEAD)
    _edit_header(path, lambda h: h[LM_HEAD].update(dtype="F8_E8M0"))  # a tag safetensors has, the cast does not
    rc, err = _run2(src, tmp_path / "out", capsys)
    assert rc == 1 and f"{path}: tensor {LM_HEAD} has unsupported dtype F8_E8M0" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad,words", [
    (lambda b, e, size: [-2, e - b - 2], "do not match BF16"),  # the right length, before the data
    (lambda b, e, size: [str(b), str(e)], "are not two integers"),
    (lambda b, e, size: [b, e, e], "are not two integers"),
    (lambda b, e, size: [b + size, e + size], "truncated"),  # past the end of the file
])
def test_bad_data_offsets(src, tmp_path, capsys, bad, words):
    path = _shard_of(src, LM_HEAD)
    size = path.stat().st_size

    def edit(h):
        b, e = h[LM_HEAD]["data_offsets"]
        h[LM_HEAD]["data_offsets"] = bad(b, e, size)

    _edit_header(path, edit)
    rc, err = _run2(src, tmp_path / "out", capsys)
    assert rc == 1 and str(path) in err and f"tensor {LM_HEAD}" in err and words in err, err
    assert not (tmp_path / "out").exists()


def test_bad_shape_in_header(src, tmp_path, capsys):
    path = _shard_of(src, LM_HEAD)
    _edit_header(path, lambda h: h[LM_HEAD].update(shape=[-1, -1]))  # numel 1: would pass a size check
    rc, err = _run2(src, tmp_path / "out", capsys)
    assert rc == 1 and f"{path}: tensor {LM_HEAD}: shape [-1, -1] is not a list of non-negative integers" in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("change", ["truncate", "delete"])
def test_shard_changed_after_the_plan(src, tmp_path, capsys, monkeypatch, change):
    """A source shard cut short (or removed) after its header was read, just before it is
    cast: a short read naming the file and tensor, not a traceback, and nothing half-written."""
    from k3nvfp4.checkpoint import convert as convert_mod

    target = _shard_of(src, LM_HEAD)
    real = convert_mod.cast_shard

    def shrink_then_cast(task):
        if task.shard.name == target.name:
            if change == "truncate":
                os.truncate(target, target.stat().st_size - 64)  # the last tensor loses its tail
            else:
                target.unlink()
        return real(task)

    monkeypatch.setattr(convert_mod, "cast_shard", shrink_then_cast)
    out = tmp_path / "out"
    rc, err = _run(src, out, capsys)  # --workers 1: the patch must run in this process
    assert rc == 1 and str(target) in err, err
    assert ("short read of tensor" in err) if change == "truncate" else ("No such file or directory" in err), err
    _assert_no_corrupt_output(out)
    assert not (out / target.name).exists()


def test_missing_source_is_named_with_the_documented_spelling(tmp_path, capsys):
    """The error names the option as README and --help spell it (--source-ckpt), whichever
    spelling was typed (issue 29, item 5)."""
    for spelling in ("--source-ckpt", "--source_ckpt"):
        capsys.readouterr()
        rc = main([spelling, str(tmp_path / "nope"), "--output-ckpt", str(tmp_path / "out"), "--workers", "1",
                   "--no-progress"])
        err = capsys.readouterr().err
        assert rc == 1, err
        assert f"--source-ckpt {tmp_path / 'nope'}: not a directory" in err and "--source_ckpt" not in err
        assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("finished", [True, False])
def test_other_source_refusal_names_the_old_source(src, tmp_path, capsys, monkeypatch, finished):
    """Issue 40: refusing an output cast from another source listed every per-shard change but
    never the source it was cast from. Now: the old source path and the new, and at most four
    clauses with a count of the rest."""
    from k3nvfp4.checkpoint import convert

    other = write_synthetic_checkpoint(tmp_path / "other", num_layers=2, num_experts=2, hidden_size=64,
                                       intermediate_size=32, num_shards=2, model_hidden_size=64, seed=9)
    out = tmp_path / "out"
    args = ["--output-ckpt", str(out), "--workers", "1", "--no-progress"]
    if not finished:  # stop after the first shard: an unfinished cast whose state names its source
        real = convert.cast_shard
        calls = []

        def stop(task):
            calls.append(1)
            if len(calls) > 1:
                raise KeyboardInterrupt
            return real(task)

        monkeypatch.setattr(convert, "cast_shard", stop)
        assert main(["--source-ckpt", str(src), *args]) == 130
        monkeypatch.setattr(convert, "cast_shard", real)
    else:
        assert main(["--source-ckpt", str(src), *args]) == 0
    capsys.readouterr()
    assert main(["--source-ckpt", str(other), *args]) == 1
    err = capsys.readouterr().err.strip().splitlines()[0]
    what = "a finished cast" if finished else "an unfinished cast"
    assert err.startswith(f"k3nvfp4-cast: error: --output-ckpt {out}: {what} of {src.resolve()}, not of this "
                          f"--source-ckpt {other.resolve()} ("), err
    assert err.count(";") <= 5 and "pass --overwrite" in err


def test_clauses_are_capped():
    from k3nvfp4.checkpoint.convert import _clauses

    assert _clauses([]) == "unknown change"
    assert _clauses(["a", "b"]) == "a; b"
    assert _clauses([f"source s{i} changed" for i in range(11)]) == (
        "source s0 changed; source s1 changed; source s2 changed; source s3 changed; and 7 more change(s)")
