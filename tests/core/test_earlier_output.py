"""core.outputs.is_earlier_output: the one test a command makes before it reuses what it finds at one of its
own paths (issue 42): the marker of that kind decides, never the files a folder holds."""
from __future__ import annotations

import os

from core.outputs import BENCH_CACHE, BUILD, MARKER, SCALE_FOLDER, is_earlier_output, output_dir, temporary_dir


def test_only_a_finished_marked_output_of_the_kind_counts(tmp_path):
    theirs = tmp_path / "theirs"
    theirs.mkdir()
    (theirs / "model.int4.onnx").write_text("not ours")
    assert not is_earlier_output(theirs, BUILD)
    assert not is_earlier_output(tmp_path / "missing", BUILD)
    with output_dir(tmp_path / "cache", BENCH_CACHE) as tmp:
        (tmp / "genai_config.json").write_text("{}")
    assert is_earlier_output(tmp_path / "cache", BENCH_CACHE)
    assert not is_earlier_output(tmp_path / "cache", BUILD)                  # ours, but of another kind
    os.symlink(tmp_path / "cache", tmp_path / "link")
    assert not is_earlier_output(tmp_path / "link", BENCH_CACHE)
    tmp = temporary_dir(tmp_path / "build", "tmp", BUILD)                   # a writer's temporary: not finished
    assert (tmp / MARKER).is_file() and not is_earlier_output(tmp, BUILD)


def test_an_output_older_than_what_it_was_made_from_is_stale(tmp_path):
    with output_dir(tmp_path / "folder", SCALE_FOLDER):
        pass
    with output_dir(tmp_path / "build", BUILD):
        pass
    assert is_earlier_output(tmp_path / "build", BUILD, made_after=tmp_path / "folder")
    st = (tmp_path / "folder" / MARKER).stat()
    os.utime(tmp_path / "build" / MARKER, ns=(st.st_atime_ns, st.st_mtime_ns - 10**9))      # the input is newer
    assert not is_earlier_output(tmp_path / "build", BUILD, made_after=tmp_path / "folder")
    assert not is_earlier_output(tmp_path / "build", BUILD, made_after=tmp_path / "missing")
