"""No room for an output (ENOSPC, EDQUOT, EROFS), at the unit level: the errno found behind a foreign writer's
error, the file named by `writing`, the atomic writer naming the output rather than its temporary, and the
runner's one line. The commands on a real full file system: tests/cli/test_full_disk.py."""
import errno

import pytest

from core.errors import NoRoomError, io_errno
from core.lifecycle import forget_committed, run_cli
from core.outputs import (BENCH_RESULTS, CHECKPOINT, FUSED_ONNX, claim_dir, output_dir, output_file, replace_file_in,
                          replaced_file_in, writing)

QUOTA = "Disk quota exceeded; nothing was written (free space or choose another"


@pytest.fixture(autouse=True)
def _a_new_command():
    forget_committed()         # what run_cli does first: each test is one command's outputs
    yield
    forget_committed()


class SafetensorError(Exception):
    """What safetensors raises (its Rust writer's std::io::Error, as text)."""


class CheckpointException(BaseException):
    """torch.distributed.checkpoint's: every rank's failure, (exception, traceback) by rank."""

    def __init__(self, failures):
        super().__init__("CheckpointException ranks:dict_keys([1])")
        self.failures = failures


@pytest.mark.parametrize("e, code", [
    (OSError(errno.ENOSPC, "No space left on device"), errno.ENOSPC),
    (SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"), errno.ENOSPC),
    (Exception("Disk quota exceeded (os error 122)"), errno.EDQUOT),                      # tokenizers' save
    (CheckpointException({1: (OSError(errno.EROFS, "Read-only file system"), None)}), errno.EROFS),
    (NoRoomError("x", errno.EDQUOT), errno.EDQUOT),
    (ValueError("not an I/O error"), None),
    (OSError("no errno"), None),
])
def test_the_errno_behind_a_failed_write(e, code):
    assert io_errno(e) == code


def test_torch_saves_error_carries_the_write_it_was_raised_over():
    """torch.save onto a full disk: RuntimeError "[enforce fail at inline_container.cc:672] . unexpected pos",
    raised while the stream's OSError was handled; a stop or a message of ours raised so is not a write."""
    from core.errors import UserError

    def raised_over(outer):
        try:
            try:
                raise OSError(errno.ENOSPC, "No space left on device")
            except OSError:
                raise outer
        except BaseException as e:
            return e
    torch_save = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert io_errno(raised_over(torch_save)) == errno.ENOSPC
    for outer in (SystemExit(1), KeyboardInterrupt(), UserError("x: expected y; z")):
        assert io_errno(raised_over(outer)) is None


def test_a_cause_carries_its_errno():
    try:
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        except OSError as inner:
            raise RuntimeError("writer failed") from inner
    except RuntimeError as e:
        assert io_errno(e) == errno.EDQUOT


def test_writing_names_the_file_an_error_did_not_name(tmp_path):
    with pytest.raises(OSError) as caught:
        with writing(tmp_path / "model.safetensors"):
            raise SafetensorError("I/O error: No space left on device (os error 28)")
    assert (caught.value.errno, caught.value.filename) == (errno.ENOSPC, str(tmp_path / "model.safetensors"))
    with pytest.raises(OSError) as named:                 # one that names its file keeps it
        with writing(tmp_path / "a"):
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "b"))
    assert named.value.filename == str(tmp_path / "b")
    with pytest.raises(ValueError):                       # not an I/O error: as it was
        with writing(tmp_path / "a"):
            raise ValueError("bad")


@pytest.mark.parametrize("code, reason", [(errno.ENOSPC, "No space left on device"),
                                          (errno.EDQUOT, "Disk quota exceeded")])
def test_output_dir_names_the_outputs_file_and_keeps_the_earlier_output(tmp_path, code, reason):
    out = tmp_path / "ckpt"
    with output_dir(out, CHECKPOINT) as tmp:
        (tmp / "model.safetensors").write_bytes(b"old")
    forget_committed()                                   # a later command
    with pytest.raises(NoRoomError) as caught:
        with output_dir(out, CHECKPOINT) as tmp:
            (tmp / "sub").mkdir()
            with writing(tmp / "sub" / "model.safetensors"):
                raise SafetensorError(f"I/O error: {reason} (os error {code})")
    assert str(caught.value) == (f"{out}/sub/model.safetensors: {reason}; nothing was written (free space or choose "
                                 "another --out)")
    assert (out / "model.safetensors").read_bytes() == b"old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]          # no temporary left


def test_output_dir_names_itself_when_the_error_names_no_file(tmp_path):
    with pytest.raises(NoRoomError, match=rf"^{tmp_path}/b: Read-only file system; nothing was written \(make the file "
                                          r"system writable or choose another --cache\)$"):
        with output_dir(tmp_path / "b", CHECKPOINT, option="--cache"):
            raise OSError(errno.EROFS, "Read-only file system")


def test_output_file_names_the_output_and_its_data_file(tmp_path):
    out = tmp_path / "m.onnx"
    for suffix in ("", ".data"):
        with pytest.raises(NoRoomError) as caught:
            with output_file(out, FUSED_ONNX) as tmp:
                raise OSError(errno.ENOSPC, "No space left on device", f"{tmp}{suffix}")
        assert str(caught.value).startswith(f"{out}{suffix}: No space left on device; nothing was written (free space "
                                            "or choose another output path)")
    assert list(tmp_path.iterdir()) == []


def test_a_claimed_folder_says_which_files_are_complete(tmp_path):
    out = claim_dir(tmp_path / "results", BENCH_RESULTS, option="--out")
    replace_file_in(out, "results.json", "{}")
    with pytest.raises(NoRoomError) as caught:
        with replaced_file_in(out, "plot.png"):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert str(caught.value) == (f"{out}/plot.png: No space left on device; complete: {out}/results.json; nothing "
                                 "else was written (free space or choose another --out)")
    assert sorted(p.name for p in out.iterdir()) == [".tapernorm-output.json", "results.json"]


def test_the_runner_prints_one_line_naming_what_did_not_fit(capsys):
    def copy(argv):     # shutil.copyfile's error names (source, destination): the destination did not fit
        raise OSError(errno.ENOSPC, "No space left on device", "/input/tokenizer.json", None, "/out/tokenizer.json")

    def foreign(argv):  # a foreign writer's error outside any output we know of: no file to name
        raise SafetensorError("I/O error: Disk quota exceeded (os error 122)")
    assert run_cli(copy, []) == 1
    assert capsys.readouterr().err == ("error: /out/tokenizer.json: No space left on device; nothing was written "
                                       "(free space or choose another output path)\n")
    assert run_cli(foreign, []) == 1
    assert capsys.readouterr().err == f"error: {QUOTA} output path)\n"


def test_a_read_only_mount_is_refused_before_anything_is_written(small_fs):
    fs = small_fs.mount("64k", read_only=True)
    with pytest.raises(NoRoomError, match=r"ckpt: Read-only file system; nothing was written \(make the file system "
                                          r"writable or choose another --out\)$"):
        with output_dir(fs / "ckpt", CHECKPOINT):
            pytest.fail("the body must not run")
    with pytest.raises(NoRoomError, match=r"m.onnx: Read-only file system; .*choose another output path\)$"):
        with output_file(fs / "m.onnx", FUSED_ONNX):
            pytest.fail("the body must not run")
