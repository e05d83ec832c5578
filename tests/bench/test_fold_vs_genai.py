"""bench.fold_vs_genai on a tiny Qwen3-shaped folder: the All-Taper checkpoint (every norm at g = 0, c
calibrated, the RMSNorm model's weights) folds to a graph with no normalization op and finite logits, the
profile child reads a norm share from ONNX Runtime's profiler, and (slow) the whole run against GenAI's
builder writes its report with interleaved pairs."""
import json
import sys
from pathlib import Path

import pytest

from bench.shapes import SHAPES, write_random_folder

ROOT = Path(__file__).resolve().parents[2]
TINY_QWEN3 = dict(SHAPES["qwen3-0.6b"], hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, intermediate_size=96, vocab_size=2048, bos_token_id=0,
                  eos_token_id=0, _name_or_path="tiny-qwen3")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return write_random_folder(TINY_QWEN3, tmp_path_factory.mktemp("fvg") / "tiny-qwen3", log=lambda *a: None)


def test_the_all_taper_checkpoint_folds_every_norm_and_stays_finite(folder, tmp_path):
    import torch
    from bench.fold_vs_genai import all_taper_checkpoint, profile_graph
    from export.options import BuildOptions
    from export.pipeline import build
    from models.checkpoint import load_checkpoint
    info = all_taper_checkpoint(folder, tmp_path / "ckpt", log=lambda *a: None)
    model = load_checkpoint(tmp_path / "ckpt")
    assert (model.cfg.norm, model.cfg.taper_scope, model.gate.value, model.cfg.qk_norm) == ("taper", "all", 0.0, "head")
    assert info["norms"] == len(model.cfg.norm_names()) == 2 * 4 + 1       # ln_1, q_norm, k_norm, ln_2 a layer; ln_f
    assert all(c > 0 for c in model.taper_c().values()) and len(set(model.taper_c().values())) > 1
    with torch.no_grad():
        assert torch.isfinite(model(torch.randint(0, 2048, (1, 9)))).all()
    report = build(tmp_path / "ckpt", tmp_path / "build", BuildOptions(fuse=True, attention="gqa"), log=lambda *a: None)
    assert report.norm_ops["fused"] == 0
    share = profile_graph(str(tmp_path / "build" / "model.fused.onnx"), steps=4, threads=1, genai=False)
    assert share["steps"] == 4 and share["f"] == 0.0 and share["node_us_per_step"] > 0


def test_the_table_says_the_target_and_whether_it_was_met():
    from bench.fold_vs_genai import table
    spread = {"min": 1.0, "median": 1.1, "max": 1.2}
    row = {"shape": "qwen3-0.6b", "genai_norm_share": 0.05, "profile": {"ours": {"f": 0.0}}, "ours_tokens_per_s": spread,
           "genai_tokens_per_s": spread, "ratio": spread, "target_ratio": 1.04, "met": True}
    text = table([row])
    assert "| qwen3-0.6b | 5.00 % | 0.00 % |" in text and "| 1.000 / 1.100 / 1.200 | 1.040 | yes |" in text


@pytest.mark.slow
def test_a_whole_run_against_genai_builds_profiles_and_pairs(folder, tmp_path):
    pytest.importorskip("onnxruntime_genai")
    import subprocess
    shape = tmp_path / "tiny-qwen3.json"
    shape.write_text(json.dumps(TINY_QWEN3))
    out = tmp_path / "r.json"
    proc = subprocess.run([sys.executable, "-m", "bench.fold_vs_genai", "run", "--shape", str(shape), "--work",
                           str(tmp_path / "work"), "--json", str(out), "--pairs", "2", "--decode-tokens", "8",
                           "--profile-steps", "4", "--threads", "1"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(out.read_text())["results"][0]
    assert len(r["pairs"]) == 2 and {p["first"] for p in r["pairs"]} == {"ours", "genai"}      # alternating
    assert r["profile"]["ours"]["f"] == 0.0 and r["profile"]["genai"]["f"] > 0                # GenAI's norms stay
    assert r["target_ratio"] == pytest.approx(1 + 0.8 * r["genai_norm_share"])


# --- issue 42: what the run reuses, refuses and reports ----------------------------------------------

def _no_children(monkeypatch):
    """bench.scale.measured (every child of a run) made to fail the test: a refusal comes before any child."""
    import bench.scale

    def measured(cmd, cap_bytes=0):
        raise AssertionError(f"a child ran: {cmd}")
    monkeypatch.setattr(bench.scale, "measured", measured)


@pytest.mark.parametrize("name, file", [("build-tiny-qwen3-all-taper-int4", "model.int4.onnx"),
                                        ("genai-tiny-qwen3-int4", "genai_config.json"),
                                        ("tiny-qwen3-all-taper", "model.safetensors")])
def test_a_users_folder_in_work_is_refused_whatever_files_it_holds(tmp_path, monkeypatch, capsys, name, file):
    """A folder at one of the run's paths that holds the file a step writes, but no marker, is the user's: it
    was reused as our build (its graph profiled and timed, exit 0); now the run refuses it in one line before
    any step runs, and leaves it as it was."""
    from bench.fold_vs_genai import main
    _no_children(monkeypatch)
    shape = tmp_path / "tiny-qwen3.json"
    shape.write_text(json.dumps(TINY_QWEN3))
    theirs = tmp_path / "work" / name
    theirs.mkdir(parents=True)
    (theirs / file).write_text("someone else's")
    code = main(["run", "--shape", str(shape), "--work", str(tmp_path / "work"), "--json", str(tmp_path / "r.json"),
                 "--pairs", "1"])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: {theirs}: exists and holds files tapernorm-deploy did not write") and \
        "--work" in err and len(err.strip().splitlines()) == 1, err
    assert [p.name for p in theirs.iterdir()] == [file] and (theirs / file).read_text() == "someone else's"
    assert not (tmp_path / "r.json").exists()


def test_a_childs_one_line_refusal_is_the_commands_one_line():
    """A child that refuses (its `error: ...` line, exit 1) was wrapped in a RuntimeError: a traceback and a
    request to report a bug. Now it is this command's user error, naming the step; a child's bug stays a bug."""
    from bench.fold_vs_genai import _child
    from core.errors import REPORT_BUG, UserError
    refuse = [sys.executable, "-c", "import sys; print('error: x: expected y, found z; do w', file=sys.stderr); "
                                    "sys.exit(1)"]
    with pytest.raises(UserError) as e:
        _child(refuse, "our build")
    assert str(e.value) == "our build: x: expected y, found z; do w"
    crash = [sys.executable, "-c", f"import sys; print('error: {REPORT_BUG}', file=sys.stderr); sys.exit(1)"]
    with pytest.raises(RuntimeError, match="our build failed"):
        _child(crash, "our build")


def test_taper_refuses_an_out_inside_its_input_folder(folder, capsys):
    """`taper HF --out HF/taper` wrote the checkpoint into the Hugging Face folder it reads (models.convert
    refuses the same); now one line, before any work, and the folder is left as it was."""
    from bench.fold_vs_genai import main
    from tests.helpers import snapshot
    before = snapshot(folder)
    code = main(["taper", str(folder), "--out", str(folder / "taper")])
    err = capsys.readouterr().err
    assert code == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: {folder / 'taper'}: it is inside the command's input {folder}"), err
    assert snapshot(folder) == before
