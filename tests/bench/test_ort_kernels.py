"""bench.ort_kernels: the kernel timings behind the GenAI comparison run, on tiny shapes."""
import json

import pytest

from bench import ort_kernels


def test_times_both_kernels_and_writes_the_figures(tmp_path, capsys):
    out = tmp_path / "kernels.json"
    assert ort_kernels.main(["--rounds", "1", "--d-model", "64", "--vocab", "256", "--capacity", "48",
                             "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    mnb = [r for r in rows if r["op"] == "MatMulNBits"]
    att = [r for r in rows if r["op"] == "GroupQueryAttention"]
    assert [(r["K"], r["N"]) for r in mnb[::2]] == [(64, 256), (256, 64), (64, 256)]
    assert {r["accuracy_level"] for r in mnb} == {0, 4} and all(r["GB_per_s"] > 0 for r in mnb)
    assert [r["cached"] for r in att[::2]] == [17, 24, 32] and {r["scale"] for r in att} == {"default", 1.0}
    assert all(len(r["us"]) == 1 and r["us"][0] > 0 for r in rows)
    assert "GroupQueryAttention 1 heads" in capsys.readouterr().out


def test_times_the_fp16_cache_as_the_build_writes_it(tmp_path, capsys):
    """--kv-cache fp32,fp16: the fp16 GroupQueryAttention (all its tensors fp16) beside the fp32 one, per depth."""
    out = tmp_path / "kernels.json"
    assert ort_kernels.main(["--rounds", "1", "--d-model", "64", "--vocab", "256", "--capacity", "48",
                             "--kv-cache", "fp32,fp16", "--json", str(out)]) == 0
    att = [r for r in json.loads(out.read_text())["rows"] if r["op"] == "GroupQueryAttention"]
    assert [(r["cached"], r["kv_cache"], r["scale"]) for r in att[:3]] == [(17, "fp32", "default"), (17, "fp32", 1.0),
                                                                           (17, "fp16", "default")]
    assert len(att) == 9 and all(r["us"][0] > 0 for r in att)
    assert "17 cached, fp16 cache" in capsys.readouterr().out


def test_a_width_that_is_not_whole_heads_is_one_error_line(capsys):
    assert ort_kernels.main(["--d-model", "100"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--d-model 100" in err[0] and "multiple of 64" in err[0]
