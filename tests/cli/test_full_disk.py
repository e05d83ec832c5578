"""A full disk, a full quota or a read-only file system under every command that writes: one `error:` line
naming the output (never a temporary path, never the input) with the fix, exit 1, no partial output, and
an earlier output of ours left whole. Each command runs on a real tmpfs (tests/conftest.py small_fs) that a
ballast file fills; where tmpfs cannot be mounted the tests skip, saying why. The torchrun / --fsdp paths
are in tests/train/test_distributed.py and tests/train/test_fsdp.py."""
from __future__ import annotations

import errno
import json
import re
from pathlib import Path

import pytest

from tests.cli.conftest import COMMANDS, Result, cli as entry_point, copy_tree
from tests.helpers import snapshot

ROOM = 4096               # bytes left free once a file system is filled (one page): less than any output
TRAIN = ["--preset", "all-taper", "--warmup-steps", "1", "--taper-steps", "1", "--eval-every", "1", "--batch-size",
         "4", "--seq-len", "16", "--eval-batches", "1", "--calib-batches", "1", "--corpus-stories", "100",
         "--d-model", "16", "--n-layer", "2", "--n-head", "2", "--max-seq-len", "32", "--threads", "1", "--quiet"]
FINETUNE = ["--method", "internal-taper", "--steps", "1", "--eval-every", "1", "--batch-size", "4", "--seq-len", "16",
            "--eval-batches", "1", "--calib-batches", "2", "--corpus-stories", "200", "--quiet", "--threads", "1"]


def cli(command: str, argv: list) -> Result:
    """tests.cli.conftest.cli, and bench.scale (not among the fuzzed COMMANDS: its `run` builds real sizes)."""
    if command in COMMANDS:
        return entry_point(command, argv)
    import contextlib
    import importlib
    import io
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = importlib.import_module(command).main([str(a) for a in argv])
    return Result(code, out.getvalue(), err.getvalue())


def no_room_line(r, out: Path, option: str = "--out", reason: str = "No space left on device") -> str:
    """The one error line of a command that found no room for `out` (the path or a file under it)."""
    assert r.code == 1 and "Traceback" not in r.err and len(r.error_lines) == 1, r.err[-3000:]
    fix = "free space" if reason != "Read-only file system" else "make the file system writable"
    pattern = (rf"error: {re.escape(str(out))}(/[^:]+)?: {reason}; nothing was written "
               rf"\({fix} or choose another {re.escape(option)}\)")
    assert re.fullmatch(pattern, r.error_lines[0]), r.error_lines[0]
    return r.error_lines[0]


def only_ballast(fs: Path) -> None:
    """Nothing but the ballast (and what was there before) on the file system: no temporary left."""
    assert [p.name for p in fs.iterdir() if ".tmp-" in p.name or ".work-" in p.name or ".old-" in p.name] == []


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory) -> Path:
    from tests.hf_models import hf_model, save_hf
    return save_hf(hf_model("llama"), tmp_path_factory.mktemp("full_disk") / "llama", tokenizer=True)


@pytest.fixture(scope="module")
def text_corpus(tmp_path_factory) -> Path:
    from train.corpus import generate_stories
    path = tmp_path_factory.mktemp("full_disk") / "stories.txt"
    path.write_text("\n\n".join(generate_stories(60, seed=1)) + "\n")
    return path


@pytest.fixture(scope="module")
def tiny_shape(tmp_path_factory) -> Path:
    from tests.bench.test_scale import TINY
    path = tmp_path_factory.mktemp("full_disk") / "tiny-llama.json"
    path.write_text(json.dumps(dict(TINY["llama"], num_hidden_layers=2)))
    return path


@pytest.fixture(scope="module")
def bench_results(tmp_path_factory) -> Path:
    from core.outputs import BENCH_RESULTS, claim_dir
    from tests.bench.test_report import _results
    d = claim_dir(tmp_path_factory.mktemp("full_disk") / "results", BENCH_RESULTS)
    (d / "results.json").write_text(json.dumps(_results()))
    return d


# command -> (argv given the output path and the fixtures, how its option is named in the fix)
REPLACING = {
    "models.convert": (lambda out, f: ["models.convert", f["hf"], "--out", out], "--out"),
    "export.build": (lambda out, f: ["export.build", "--checkpoint", f["ckpt"], "--out", out], "--out"),
    "graph_passes": (lambda out, f: ["graph_passes", f["unfused"] / "model.onnx", "-o", out], "output path"),
    "runtime.triton repo": (lambda out, f: ["runtime.triton", "repo", "--build", f["build"], "--out", out], "--out"),
    "train.shards": (lambda out, f: ["train.shards", f["corpus"], "--out", out, "--quiet"], "--out"),
    "bench.scale make": (lambda out, f: ["bench.scale", "make", f["shape"], "--out", out, "--dtype", "fp32"], "--out"),
    "bench.report": (lambda out, f: ["bench.report", f["results"], "--out", out], "--out"),
}


@pytest.fixture
def inputs(hf_llama, tiny_ckpt, tiny_build, tiny_unfused_build, text_corpus, tiny_shape, bench_results):
    return {"hf": hf_llama, "ckpt": tiny_ckpt, "build": tiny_build, "unfused": tiny_unfused_build,
            "corpus": text_corpus, "shape": tiny_shape, "results": bench_results}


def run(command: str, fs: Path, inputs: dict):
    """(the command's result, its output path on `fs`)."""
    out = fs / ("out.onnx" if command == "graph_passes" else "out")
    argv = REPLACING[command][0](out, inputs)
    return cli(argv[0], argv[1:]), out


@pytest.mark.parametrize("command", sorted(REPLACING))
def test_a_full_disk_writes_nothing_and_keeps_the_earlier_output(command, small_fs, inputs):
    option = REPLACING[command][1]
    fs = small_fs.mount("16m")
    small_fs.fill(fs, ROOM)
    r, out = run(command, fs, inputs)
    no_room_line(r, out, option)                                  # a new output: nothing written
    if command == "bench.report":       # a results folder is claimed (made, marked) first, then filled file by file
        assert [p.name for p in out.iterdir()] == [".tapernorm-output.json"]
    else:
        assert not out.exists()
    only_ballast(fs)

    (fs / ".ballast").unlink()
    if command == "export.build":       # an earlier build of ours, as this run (no --fuse) makes it, copied not built
        copy_tree(inputs["unfused"], out)
    else:
        assert run(command, fs, inputs)[0].code == 0
    before = snapshot(fs)
    small_fs.fill(fs, ROOM)
    no_room_line(run(command, fs, inputs)[0], out, option)        # replacing it: the earlier one stays whole
    (fs / ".ballast").unlink()
    assert snapshot(fs) == before


@pytest.mark.parametrize("command", ["models.convert", "graph_passes"])
def test_a_read_only_file_system_is_one_line_and_the_earlier_output_stays(command, small_fs, inputs):
    fs = small_fs.mount("16m")
    assert run(command, fs, inputs)[0].code == 0
    before = snapshot(fs)
    small_fs.read_only(fs)
    r, out = run(command, fs, inputs)
    no_room_line(r, out, REPLACING[command][1], "Read-only file system")
    assert snapshot(fs) == before


def test_a_full_quota_is_the_same_line(monkeypatch, tmp_path, hf_llama):
    """EDQUOT (no quota to fill here): safetensors' writer refusing as it would, its error naming no file."""
    import models.checkpoint

    def over_quota(*a, **k):
        raise OSError(errno.EDQUOT, "Disk quota exceeded")
    monkeypatch.setattr(models.checkpoint, "save_file", over_quota)
    out = tmp_path / "ckpt"
    line = no_room_line(cli("models.convert", [hf_llama, "--out", out]), out, reason="Disk quota exceeded")
    assert line.startswith(f"error: {out}/model.safetensors: ")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["train", "train.finetune"])
def test_train_with_no_room_for_its_first_checkpoint_writes_nothing(command, small_fs, hf_llama):
    fs = small_fs.mount("64k")
    out = fs / "run"
    argv = TRAIN + ["--steps", "1"] if command == "train" else ["--from", hf_llama, *FINETUNE]
    no_room_line(cli(command, [*argv, "--out", out]), out)
    assert list(fs.iterdir()) == []


def test_train_that_fills_the_disk_mid_run_keeps_its_last_checkpoint_and_says_which(small_fs, monkeypatch):
    """The disk fills after the checkpoint of step 1: the one of step 2 does not fit, step 1 stays whole and
    named; with space again, --resume ends the run."""
    import train.loop as loop
    fs = small_fs.mount("16m")
    out = fs / "run"
    real, held = loop.save_checkpoint, {}

    def save_then_fill(*a, **k):
        real(*a, **k)
        if not held:
            held["snapshot"] = snapshot(out)
            small_fs.fill(fs, ROOM)
    monkeypatch.setattr(loop, "save_checkpoint", save_then_fill)
    r = cli("train", [*TRAIN, "--steps", "3", "--out", out])
    assert r.code == 1 and len(r.error_lines) == 1 and "Traceback" not in r.err, r.err[-3000:]
    assert re.fullmatch(rf"error: {re.escape(str(out))}/[^:]+: No space left on device at the checkpoint of step 2; "
                        rf"{re.escape(str(out))} holds the last complete checkpoint, of step 1 \(free space, then "
                        rf"continue with: python -m train --out {re.escape(str(out))} --resume\)",
                        r.error_lines[0]), r.err
    assert snapshot(out) == held["snapshot"]
    only_ballast(fs)
    monkeypatch.setattr(loop, "save_checkpoint", real)
    (fs / ".ballast").unlink()
    r = cli("train", ["--out", out, "--resume", "--quiet"])
    assert r.code == 0, r.err[-3000:]
    assert json.loads((out / "train_log.json").read_text())["step"] == 3
