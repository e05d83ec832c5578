"""An output inside one of the command's input folders is refused (core.outputs), naming both and the fix:
writing there would change the input the command reads, and a later run would read its own output."""
from __future__ import annotations

import pytest

from core.errors import UserError
from core.outputs import BUILD, CHECKPOINT, REPORT_JSON, check_output_dir, check_output_file, output_dir


def test_a_directory_inside_an_input_folder_is_refused(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    for out in (hf / "ckpt", hf / "sub" / "deeper"):
        with pytest.raises(UserError) as e:
            check_output_dir(out, CHECKPOINT, inputs=[hf])
        msg = str(e.value)
        assert msg.startswith(f"{out}: ") and f"inside the command's input {hf}" in msg, msg
        assert "choose another --out outside" in msg, msg
    assert sorted(p.name for p in hf.iterdir()) == ["config.json"]          # nothing created
    with pytest.raises(UserError, match="inside the command's input"):
        with output_dir(hf / "ckpt", CHECKPOINT, inputs=[hf]):
            pass
    assert sorted(p.name for p in hf.iterdir()) == ["config.json"]


def test_a_file_inside_an_input_folder_is_refused_but_one_beside_an_input_file_is_not(tmp_path):
    build = tmp_path / "build"
    build.mkdir()
    with pytest.raises(UserError, match=f"inside the command's input {build}"):
        check_output_file(build / "r.json", REPORT_JSON, inputs=[build])
    check_output_file(build / "m.fused.onnx", REPORT_JSON, inputs=[build / "m.onnx"])   # beside its input file: fine
    check_output_dir(tmp_path / "other", BUILD, inputs=[build])                           # a sibling: fine
