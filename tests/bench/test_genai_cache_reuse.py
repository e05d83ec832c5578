"""bench.decode's GenAI cache entries are reused only when the folder carries the marker of a cache entry
(core.outputs.is_earlier_output), never because it holds a genai_config.json (issue 42's marker sweep): a
folder of the user's at an entry's path is refused in one line, and a marked entry is reused without a build."""
import json

import pytest

from core.errors import UserError
from core.outputs import BENCH_CACHE, output_dir


class Built(Exception):
    """The build started: the entry was not reused."""


def _refuse_builds(monkeypatch):
    import bench.genai
    import bench.variants

    def build(*a, **k):
        raise Built
    monkeypatch.setattr(bench.genai, "write_llama", build)
    monkeypatch.setattr(bench.variants, "build_onnx", build)


def _entry(cache, name, marked: bool):
    """An entry folder with a genai_config.json and its info file beside it, marked as ours or not."""
    out = cache / name
    if marked:
        with output_dir(out, BENCH_CACHE) as tmp:
            (tmp / "genai_config.json").write_text("{}")
    else:
        out.mkdir(parents=True)
        (out / "genai_config.json").write_text("{}")
    info = {"path": str(out), "name": "theirs" if not marked else "ours"}
    out.with_name(out.name + ".json").write_text(json.dumps(info))
    return info


def _names(cache):
    from importlib.metadata import version
    og = version("onnxruntime-genai")
    return {"genai": f"genai-1M-cap64-int4-seed0-og{og}", "ours": "ours-genai-1M-cap64-all-taper-fused-int4-seed0"}


@pytest.mark.parametrize("which", ["genai", "ours"])
def test_an_unmarked_folder_with_a_genai_config_is_not_reused(tmp_path, monkeypatch, which):
    pytest.importorskip("onnxruntime_genai")
    from bench.genai import build_genai, build_ours_genai
    from bench.variants import SIZES
    _refuse_builds(monkeypatch)
    _entry(tmp_path, _names(tmp_path)[which], marked=False)
    with pytest.raises((Built, UserError)) as e:
        if which == "genai":
            build_genai("1M", SIZES["1M"], 64, "int4", tmp_path, log=lambda *a: None)
        else:
            build_ours_genai("1M", 64, "int4", tmp_path, log=lambda *a: None)
    if e.type is UserError:
        assert "did not write" in str(e.value), e.value
    assert (tmp_path / _names(tmp_path)[which] / "genai_config.json").read_text() == "{}"      # left as it was


@pytest.mark.parametrize("which", ["genai", "ours"])
def test_a_marked_entry_is_reused(tmp_path, monkeypatch, which):
    pytest.importorskip("onnxruntime_genai")
    from bench.genai import build_genai, build_ours_genai
    from bench.variants import SIZES
    _refuse_builds(monkeypatch)
    info = _entry(tmp_path, _names(tmp_path)[which], marked=True)
    got = (build_genai("1M", SIZES["1M"], 64, "int4", tmp_path, log=lambda *a: None) if which == "genai" else
           build_ours_genai("1M", 64, "int4", tmp_path, log=lambda *a: None))
    assert got == info
