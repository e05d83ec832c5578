"""core.outputs: what a command may replace, and the atomic writer for directories and files."""
import json
import os
import stat

import pytest

from core.errors import UserError
from core.outputs import (BUILD, CHECKPOINT, FUSED_ONNX, MARKER, REPORT_JSON, check_output_dir, check_output_file,
                          claim_dir, file_signature, marker_kind, output_dir, output_file, replace_file_in, sign_json,
                          write_json)
from tests.helpers import snapshot


def _mode(p):
    return stat.S_IMODE(os.stat(p).st_mode)


def test_new_output_dir_is_written_with_marker_and_umask_modes(tmp_path):
    old = os.umask(0o022)
    try:
        with output_dir(tmp_path / "b", BUILD) as tmp:
            (tmp / "sub").mkdir()
            (tmp / "sub" / "f.txt").write_text("x")
            fd = os.open(tmp / "private", os.O_CREAT | os.O_WRONLY, 0o600)   # like mkstemp
            os.close(fd)
    finally:
        os.umask(old)
    out = tmp_path / "b"
    assert marker_kind(out) == "build"
    assert _mode(out) == 0o755 and _mode(out / "sub") == 0o755
    assert _mode(out / "sub" / "f.txt") == 0o644 and _mode(out / "private") == 0o644
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]       # no temporary left


def test_replaces_only_its_own_kind(tmp_path):
    with output_dir(tmp_path / "b", BUILD) as tmp:
        (tmp / "v1").write_text("1")
    with output_dir(tmp_path / "b", BUILD) as tmp:            # ours, same kind: replaced
        (tmp / "v2").write_text("2")
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == [MARKER, "v2"]
    with pytest.raises(UserError, match="holds a build written by tapernorm-deploy, not a checkpoint directory"):
        check_output_dir(tmp_path / "b", CHECKPOINT)


@pytest.mark.parametrize("case", ["non-empty", "file", "input", "parent-of-input", "model-onnx-name"])
def test_refused_outputs_leave_everything_unchanged(tmp_path, case):
    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.md").write_text("precious")
    inputs = []
    if case == "non-empty":
        out = user
    elif case == "file":
        out = user / "notes.md"
    elif case == "input":
        out, inputs = user, [user]
    elif case == "parent-of-input":
        (user / "ckpt").mkdir()
        out, inputs = user, [user / "ckpt"]
    else:                              # a file named like one of our outputs proves nothing
        (user / "model.onnx").write_text("mine")
        (user / "report.json").write_text("{}")
        out = user
    before = snapshot(tmp_path)
    with pytest.raises(UserError) as e:
        with output_dir(out, BUILD, inputs=inputs):
            raise AssertionError("must not be reached")
    assert "\n" not in str(e.value) and str(out) in str(e.value)
    assert snapshot(tmp_path) == before


def test_empty_dir_may_be_filled(tmp_path):
    (tmp_path / "e").mkdir()
    with output_dir(tmp_path / "e", BUILD) as tmp:
        (tmp / "x").write_text("1")
    assert (tmp_path / "e" / "x").read_text() == "1"


def test_users_dot_old_sibling_survives_a_replace(tmp_path):
    with output_dir(tmp_path / "X", BUILD) as tmp:
        (tmp / "a").write_text("1")
    mine = tmp_path / ".X.old"
    mine.mkdir()
    (mine / "keep").write_text("user's")
    with output_dir(tmp_path / "X", BUILD) as tmp:
        (tmp / "b").write_text("2")
    assert (mine / "keep").read_text() == "user's"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".X.old", "X"]


def test_exception_and_interrupt_remove_the_temporary_and_keep_the_old(tmp_path):
    with output_dir(tmp_path / "b", BUILD) as tmp:
        (tmp / "old").write_text("old")
    before = snapshot(tmp_path)
    for exc in (RuntimeError("boom"), KeyboardInterrupt()):
        with pytest.raises(type(exc)):
            with output_dir(tmp_path / "b", BUILD) as tmp:
                (tmp / "half").write_text("half")
                raise exc
        assert snapshot(tmp_path) == before


def test_ownership_is_rechecked_before_the_swap(tmp_path):
    """A directory that turns into a user's while we write is still not replaced."""
    out = tmp_path / "b"
    with pytest.raises(UserError, match="did not write"):
        with output_dir(out, BUILD) as tmp:
            (tmp / "ours").write_text("1")
            out.mkdir()
            (out / "theirs").write_text("user")
    assert [p.name for p in out.iterdir()] == ["theirs"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["b"]


def test_output_file_signatures(tmp_path):
    import onnx
    from onnx import TensorProto, helper
    from core.outputs import sign_onnx
    g = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(g)
    user_onnx = tmp_path / "user.onnx"
    onnx.save(model, user_onnx)
    with pytest.raises(UserError, match="not written by tapernorm-deploy"):
        check_output_file(user_onnx, FUSED_ONNX)
    ours = tmp_path / "ours.onnx"
    with output_file(ours, FUSED_ONNX) as tmp:
        onnx.save(sign_onnx(model), str(tmp))
    assert file_signature(ours) == "onnx"
    check_output_file(ours, FUSED_ONNX)                       # ours: may be replaced
    with pytest.raises(UserError, match="own input"):
        check_output_file(ours, FUSED_ONNX, inputs=[ours])
    with pytest.raises(UserError, match="found a directory"):
        check_output_file(tmp_path, FUSED_ONNX)
    write_json(tmp_path / "r.json", {"a": 1})
    assert json.loads((tmp_path / "r.json").read_text())["a"] == 1
    write_json(tmp_path / "r.json", {"a": 2})                  # replaced: ours
    (tmp_path / "u.json").write_text(json.dumps({"a": 1}))
    with pytest.raises(UserError):
        write_json(tmp_path / "u.json", {"a": 2})
    assert json.loads((tmp_path / "u.json").read_text()) == {"a": 1}
    assert sign_json({}, REPORT_JSON)["tapernorm_output"] == "report-json"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ours.onnx", "r.json", "u.json", "user.onnx"]


def test_png_signature(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from core.outputs import FIGURE, png_signature_metadata
    fig = plt.figure()
    with output_file(tmp_path / "f.png", FIGURE) as tmp:
        fig.savefig(tmp, format="png", metadata=png_signature_metadata())
    fig.savefig(tmp_path / "user.png", format="png")
    plt.close(fig)
    assert file_signature(tmp_path / "f.png") == "figure"
    assert file_signature(tmp_path / "user.png") is None


def test_claim_dir_and_replace_file_in(tmp_path):
    d = claim_dir(tmp_path / "r", BUILD)
    replace_file_in(d, "a.json", "{}")
    assert claim_dir(tmp_path / "r", BUILD) == d                # ours: reused
    (tmp_path / "u").mkdir()
    (tmp_path / "u" / "x").write_text("1")
    with pytest.raises(UserError):
        claim_dir(tmp_path / "u", BUILD)


def test_replaced_file_in_leaves_the_old_file_or_the_new_one(tmp_path):
    """A writer that takes a path (save_onnx) writes a temporary beside the file; a failure
    leaves the old file and no temporary."""
    from core.outputs import replaced_file_in
    d = claim_dir(tmp_path / "r", BUILD)
    replace_file_in(d, "g.onnx", b"old")
    with pytest.raises(RuntimeError):
        with replaced_file_in(d, "g.onnx") as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("interrupted")
    assert (d / "g.onnx").read_bytes() == b"old" and sorted(p.name for p in d.iterdir()) == [MARKER, "g.onnx"]
    with replaced_file_in(d, "g.onnx") as tmp:
        tmp.write_bytes(b"new")
    assert (d / "g.onnx").read_bytes() == b"new" and sorted(p.name for p in d.iterdir()) == [MARKER, "g.onnx"]


WRITER_THAT = """import os, signal, sys, time
from core.outputs import BUILD, output_dir
with output_dir(sys.argv[1], BUILD) as tmp:
    (tmp / "half.onnx").write_bytes(b"x" * 1000)
    if sys.argv[2] == "dies":
        os.kill(os.getpid(), signal.SIGKILL)        # no cleanup can run
    time.sleep(60)
"""


def test_a_killed_writers_temporary_is_removed_by_the_next_write(tmp_path):
    """SIGKILL leaves `.OUT.tmp-*` beside the output (it carries our temporary marker from the start); the
    next write of OUT removes it. A `.OUT.tmp-*` of the user's (no marker) and one of a live writer stay."""
    import subprocess
    import sys
    import time
    from pathlib import Path
    from core.outputs import output_dir
    out, root = tmp_path / "b", Path(__file__).resolve().parents[2]
    done = subprocess.run([sys.executable, "-c", WRITER_THAT, str(out), "dies"], cwd=root)
    assert done.returncode == -9
    (stale,) = tmp_path.glob(".b.tmp-*")
    assert (stale / "half.onnx").is_file()
    (tmp_path / ".b.tmp-mine").mkdir()
    (tmp_path / ".b.tmp-mine" / "notes.txt").write_text("mine")
    live = subprocess.Popen([sys.executable, "-c", WRITER_THAT, str(out), "lives"], cwd=root)
    try:
        deadline = time.time() + 30
        while not [p for p in tmp_path.glob(".b.tmp-*/half.onnx") if p.parent != stale]:
            assert time.time() < deadline and live.poll() is None
            time.sleep(0.05)
        (busy,) = {p.parent for p in tmp_path.glob(".b.tmp-*/half.onnx")} - {stale}
        with output_dir(out, BUILD) as tmp:
            (tmp / "m.onnx").write_text("x")
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".b.tmp-mine", busy.name, "b"])
        assert (tmp_path / ".b.tmp-mine" / "notes.txt").read_text() == "mine"
    finally:
        live.kill()
        live.wait()


@pytest.mark.parametrize("writer, maker", [("dir", "mkdtemp"), ("file", "mkstemp"), ("in", "mkstemp")])
def test_a_ctrl_c_the_instant_the_temporary_appears_leaves_none(tmp_path, monkeypatch, writer, maker):
    """The SIGINT that lands inside mkdtemp / mkstemp, after the file system has the temporary and before its
    name is returned (seen in CI: `runtime.triton repo` left .repo.tmp-*), removes it all the same."""
    import signal
    import threading
    import core.outputs
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals are delivered to the main thread only")
    real = getattr(core.outputs.tempfile, maker)

    def made_then_interrupted(*args, **kwargs):
        made = real(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGINT)
        return str(made) if maker == "mkdtemp" else made       # (a Python call: the handler runs by now)
    claim_dir(tmp_path / "c", BUILD)
    before = snapshot(tmp_path)
    monkeypatch.setattr(core.outputs.tempfile, maker, made_then_interrupted)
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            if writer == "dir":
                with output_dir(tmp_path / "b", BUILD):
                    pass
            elif writer == "file":
                write_json(tmp_path / "r.json", {}, REPORT_JSON)
            else:
                replace_file_in(tmp_path / "c", "x.txt", "x")
    finally:
        signal.signal(signal.SIGINT, old)
    assert snapshot(tmp_path) == before
