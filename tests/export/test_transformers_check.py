"""export.build of a Hugging Face folder checks our converted model against transformers itself (issue 42 item C).

The build's graph_vs_torch compares the graph with our torch model; a config our converter misreads makes both
wrong alike (issue 42: Gemma 3's lost local rope base passed it). So a Hugging Face build also runs
transformers' own forward on the folder (prefill + cached steps) and prints `transformers_vs_ours`, or one line
saying why it skipped it (transformers missing, the two models too large for memory); a mismatch fails the
build in one line and writes nothing.
"""
import json
import sys

import pytest

from tests.hf_models import hf_model, save_hf


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return save_hf(hf_model("qwen2"), tmp_path_factory.mktemp("tvo") / "qwen2")


def _check(folder, tokens=None):
    from export.report import BuildReport
    from export.transformers_check import transformers_check
    from models.weights import open_weights
    report, lines = BuildReport(str(folder), "(out)", "fp32", True), []
    transformers_check(open_weights(folder), report, lines.append, tokens)
    return report.transformers_vs_ours.to_json(), lines


def test_check_runs_and_says_what_it_compared(folder):
    found, lines = _check(folder)
    assert 0 <= found["logits_max_abs_diff"] <= found["atol"] and found["max_abs_ref"] > 1.0
    assert (found["prefill_tokens"], found["cached_steps"]) == (8, 4)
    assert lines == [f"      transformers_vs_ours max |d logits| {found['logits_max_abs_diff']:.3g} (prefill 8 tokens + "
                     f"4 cached steps; atol 0.0001 + 2e-06 x max|ref| {found['max_abs_ref']:.3g}; transformers "
                     f"{found['transformers']})"]


def test_skips_without_transformers(folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)      # import transformers raises ImportError
    found, lines = _check(folder)
    assert found == {"skipped": "transformers is not installed (pip install transformers to compare with it)"}
    assert lines == ["      transformers_vs_ours skipped: " + found["skipped"]]


def test_skips_a_model_too_large_to_hold(folder, monkeypatch):
    import core.inputs
    from export.memory import transformers_check_bytes
    from models.weights import open_weights
    need = transformers_check_bytes(open_weights(folder).cfg)
    monkeypatch.setattr(core.inputs, "available_memory", lambda: need - 1)
    found, _ = _check(folder)
    assert found["skipped"].startswith("transformers' model (fp32, and float64 past the fixed tolerance) needs ~")
    assert "available" in found["skipped"]


def test_checkpoints_of_ours_are_not_checked(tmp_path):
    from export.report import BuildReport
    from export.transformers_check import transformers_check
    from models.weights import open_weights
    from tests.helpers import random_model, write_checkpoint
    ckpt = write_checkpoint(tmp_path / "ckpt", random_model(norm="rmsnorm"))
    report = BuildReport(str(ckpt), "(out)", "fp32", True)
    transformers_check(open_weights(ckpt), report, None, None)
    assert report.transformers_vs_ours is None


def test_build_prints_the_check_and_a_mismatch_fails_it_in_one_line(folder, tmp_path, monkeypatch, capsys):
    """A whole build prints the line in its summary and report.json keeps it; a disagreement (here made by
    shifting transformers' logits) is one error line, a non-zero exit and no output folder."""
    import export.transformers_check as check
    from export.build import main
    out = tmp_path / "build"
    assert main(["--fuse", "--checkpoint", str(folder), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert any(line.startswith("  transformers_vs_ours max |d logits| ") for line in printed.splitlines()), printed
    from core.inputs import human_bytes
    from export.memory import transformers_check_bytes
    from models.weights import open_weights
    need = human_bytes(transformers_check_bytes(open_weights(folder).cfg))
    assert f"; then the transformers check, apart: up to ~{need} (skipped where that does not fit)" in printed, printed
    assert json.loads((out / "report.json").read_text())["transformers_vs_ours"]["prefill_tokens"] == 8

    real = check._transformers_vs_ours
    monkeypatch.setattr(check, "_transformers_vs_ours", lambda *a: (0.5, *real(*a)[1:]))
    bad = tmp_path / "bad"
    assert main(["--fuse", "--checkpoint", str(folder), "--out", str(bad)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: {folder}: transformers_vs_ours: expected") and \
        "found max |d| 0.5" in err[0], err
    assert not bad.exists()


def test_past_the_fixed_tolerance_transformers_own_rounding_is_measured(folder):
    """An ill-conditioned model may round past the fixed bound: then transformers runs in float64 and its own
    fp32 rounding (times the build's FP32_ROUNDING_SLACK) is allowed, as graph_vs_torch allows torch's."""
    from export.transformers_check import _transformers_vs_ours
    from models.weights import open_weights
    diff, scale, prefill, steps, slack = _transformers_vs_ours(open_weights(folder), None, lambda scale: -1.0)
    assert 0 < slack < 1e-3 and diff < 1e-4 and (prefill, steps) == (8, 4)
    assert _transformers_vs_ours(open_weights(folder), None, lambda scale: 1.0)[4] == 0.0     # not run otherwise


def test_the_checks_imports_run_beside_onnx_runtimes_check_and_are_done_before_it(folder, tmp_path, monkeypatch):
    """The build imports transformers' model code in a background thread while ONNX Runtime verifies the graph
    (export.transformers_check.TransformersImports), and the check waits for it before importing anything."""
    import threading

    import export.transformers_check as check
    import export.verify
    from export.build import main
    seen = {}
    real_session, real_check, real_import = export.verify.ort_session, check._transformers_vs_ours, \
        check.TransformersImports._import

    def session(*a, **k):
        seen.setdefault("at ONNX Runtime", [t.name for t in threading.enumerate()])
        return real_session(*a, **k)

    def compared(*a, **k):
        seen["at the check"] = [t.name for t in threading.enumerate()]
        return real_check(*a, **k)
    def slow_import(self):          # (a real import takes seconds; this process has transformers loaded already)
        import time
        time.sleep(2)
        real_import(self)
    monkeypatch.setattr(export.verify, "ort_session", session)
    monkeypatch.setattr(check, "_transformers_vs_ours", compared)
    monkeypatch.setattr(check.TransformersImports, "_import", slow_import)
    assert main(["--fuse", "--checkpoint", str(folder), "--out", str(tmp_path / "build")]) == 0
    assert "transformers-imports" in seen["at ONNX Runtime"]        # started as ONNX Runtime's check began
    assert "transformers-imports" not in seen["at the check"]       # and joined before the check


def test_imports_that_fail_are_left_to_the_check(tmp_path):
    """A model type transformers does not know: the background thread ends quietly (the check says why it skipped)."""
    from types import SimpleNamespace

    from export.transformers_check import TransformersImports
    imports = TransformersImports(SimpleNamespace(where=tmp_path, source="hf:no-such-model"))
    imports.wait()                  # never started: returns at once
    imports.start()
    imports.wait()
    assert not imports._thread.is_alive()
    ours = TransformersImports(SimpleNamespace(where=tmp_path, source="checkpoint"))
    ours.start()
    assert ours._thread is None     # a checkpoint of ours: nothing to import
