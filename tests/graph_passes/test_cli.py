"""python -m graph_passes: prints what it folded, writes atomically, one-line errors."""
import subprocess
import sys

import onnx

from tests.graph_passes.fixtures import assert_same, scale_to_linears, rng_vec


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "graph_passes", *map(str, args)], capture_output=True, text=True)


def test_cli_folds_and_reports(tmp_path):
    src, dst = tmp_path / "in.onnx", tmp_path / "out.onnx"
    m = scale_to_linears(shift=rng_vec(5, loc=0.0))
    onnx.save(m, src)
    r = _cli(src, "-o", dst)
    assert r.returncode == 0, r.stderr
    assert "detected 1 TaperNorm layer(s), gate 0: blocks.0.ln_1" in r.stdout
    assert "taper_scale: 1 folded, 0 skipped" in r.stdout and "blocks.0.ln_1: scale+shift -> mm0, mm1, mm2" in r.stdout
    assert "Mul 1->0" in r.stdout
    out = onnx.load(dst)
    assert {p.key: p.value for p in out.metadata_props}["tapernorm.gate"] == "0.0"   # metadata kept
    assert_same(m, out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.onnx", "out.onnx"]


def test_cli_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(b"not a model")
    for args in ([bad, "-o", tmp_path / "o.onnx"], [tmp_path / "none.onnx", "-o", tmp_path / "o.onnx"],
                 [bad, "-o", tmp_path / "o.onnx", "--passes", "nope"],
                 [bad, "-o", tmp_path / "no_dir" / "o.onnx"]):
        r = _cli(*args)
        assert r.returncode == 1 and r.stderr.startswith("error: ") and len(r.stderr.strip().splitlines()) == 1, r.stderr
    gate = scale_to_linears()
    gate.metadata_props[0].value = "0.5"
    onnx.save(gate, tmp_path / "gate.onnx")
    r = _cli(tmp_path / "gate.onnx", "-o", tmp_path / "o.onnx")
    assert r.returncode == 1 and "TaperNorm gate 0.5" in r.stderr
    assert not (tmp_path / "o.onnx").exists()


def test_cli_output_is_byte_identical_and_a_rerun_changes_nothing(tmp_path):
    from tests.graph_passes.fixtures import exploded_rmsnorm
    src = tmp_path / "in.onnx"
    onnx.save(exploded_rmsnorm(), src)
    for out in ("a.onnx", "b.onnx"):
        r = _cli(src, "-o", tmp_path / out)
        assert r.returncode == 0, r.stderr
    assert "channel_scale: 1 folded, 0 skipped" in r.stdout and "folded 1, skipped 0" in r.stdout
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()
    r = _cli(tmp_path / "a.onnx", "-o", tmp_path / "c.onnx")
    assert r.returncode == 0 and "folded 0, skipped 0" in r.stdout
    assert (tmp_path / "c.onnx").read_bytes() == (tmp_path / "a.onnx").read_bytes()


def _many_unfoldable(n: int = 12):
    """n per-channel gains, each read by a MatMul and a Relu: n candidates left alone, one note each."""
    from onnx import helper
    from tests.graph_passes.fixtures import init, model, rng_mat
    nodes, inits, outs = [], [], []
    for i in range(n):
        nodes += [helper.make_node("Mul", ["x", f"s{i}"], [f"h{i}"], name=f"norm{i}"),
                  helper.make_node("MatMul", [f"h{i}", f"W{i}"], [f"y{i}"], name=f"proj{i}"),
                  helper.make_node("Relu", [f"h{i}"], [f"z{i}"], name=f"act{i}")]
        inits += [init(f"s{i}", rng_vec(i)), init(f"W{i}", rng_mat(100 + i))]
        outs += [f"y{i}", f"z{i}"]
    return model(nodes, inits, outputs=outs)


def test_cli_prints_counts_ten_notes_per_pass_and_all_with_verbose(tmp_path, capsys):
    from graph_passes.__main__ import SHOWN_FINDINGS, main
    src = tmp_path / "in.onnx"
    onnx.save(_many_unfoldable(12), src)
    assert main([str(src), "-o", str(tmp_path / "a.onnx"), "--passes", "channel_scale"]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.startswith("  note: ")]
    assert "channel_scale: 0 folded, 12 skipped" in out and "folded 0, skipped 12" in out
    assert len(notes) == SHOWN_FINDINGS == 10 and "  ... 2 more (--verbose prints all)" in out
    assert all("left unfolded" in n and "is a Relu, not a MatMul/Gemm" in n for n in notes)
    assert main([str(src), "-o", str(tmp_path / "b.onnx"), "--passes", "channel_scale", "--verbose"]) == 0
    out = capsys.readouterr().out
    notes = [line for line in out.splitlines() if line.startswith("  note: ")]
    assert len(notes) == 12 and "more (--verbose" not in out
    assert sorted(n.split(":")[1].strip() for n in notes) == sorted(f"norm{i}" for i in range(12))
