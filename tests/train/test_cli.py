"""`python -m train` and `python -m train.screen_dyt` as a user runs them: bad input gives one line and a non-zero exit."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMALL = ["--d-model", "16", "--n-layer", "2", "--n-head", "2", "--batch-size", "2", "--seq-len", "16",
         "--eval-batches", "1", "--calib-batches", "1", "--corpus-stories", "100", "--quiet", "--threads", "1"]


def _run(*args, module="train"):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, capture_output=True, text=True,
                          env=env, timeout=120)


@pytest.mark.parametrize("args, needle", [
    (["--preset", "layerless", "--out", "{out}"], "preset 'layerless': expected one of baseline"),
    (["--preset", "baseline", "--size", "huge", "--out", "{out}"], "size 'huge': expected one of tiny, small"),
    (["--preset", "baseline", "--corpus", "{tmp}/missing.txt", "--out", "{out}"], "missing.txt: not found"),
    (["--preset", "internal-taper", "--taper-steps", "0", "--out", "{out}"], "--taper-steps 0: expected a positive"),
    (["--preset", "all-taper", "--taper-steps", "-5", "--out", "{out}"], "--taper-steps -5: expected a positive"),
    (["--preset", "all-taper", "--aux-lambda", "-0.1", "--out", "{out}"], "--aux-lambda -0.1: expected a number >= 0"),
    (["--preset", "baseline", "--d-model", "30", "--n-head", "4", "--out", "{out}"], "n_head = 4; expected a divisor of d_model (30)"),
    (["--preset", "baseline", "--steps", "many", "--out", "{out}"], "'many' is not an integer"),
    (["--preset", "dyt", "--embed-std", "-1", "--out", "{out}"], "--embed-std -1.0: expected a positive number"),
    (["--preset", "all-taper", "--s-tgt", "big", "--out", "{out}"], "--s-tgt 'big': expected 'calib' or a positive number"),
])
def test_bad_input_one_line_nonzero_exit_nothing_written(tmp_path, args, needle):
    out = tmp_path / "ckpt"
    args = [a.format(out=out, tmp=tmp_path) for a in args]
    r = _run(*args)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("error: ") and needle in lines[0], lines[0]
    assert "Traceback" not in r.stderr
    assert not out.exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".ckpt")]  # no temp leftovers


def test_cli_trains_on_a_local_jsonl_file(tmp_path):
    from train.corpus import generate_stories
    corpus = tmp_path / "stories.jsonl"
    corpus.write_text("".join(json.dumps({"text": s}) + "\n" for s in generate_stories(60, seed=7)))
    out = tmp_path / "ckpt"
    r = _run("--preset", "internal-taper", "--out", str(out), "--steps", "4", "--eval-every", "2",
             "--corpus", str(corpus), *SMALL)
    assert r.returncode == 0, r.stderr
    assert "val loss" in r.stdout and "gate 0.0" in r.stdout
    log = json.loads((out / "train_log.json").read_text())
    assert log["run"]["corpus"] == str(corpus) and log["data"]["stories"]["train"] == 54
    assert log["command"].startswith("python -m train --preset internal-taper")


def test_screen_dyt_reports_saturation_verdict_and_caveat(tmp_path):
    r = _run(
        "--steps", "3", "--json", str(tmp_path / "screen.json"), "--d-model", "16", "--n-layer", "2", "--n-head", "2",
        "--batch-size", "2", "--seq-len", "16", "--eval-batches", "1", "--corpus-stories", "100", "--quiet",
        "--threads", "1", module="train.screen_dyt")
    assert r.returncode == 0, r.stderr
    assert "overall" in r.stdout and ("likely HELPS" in r.stdout or "likely HURTS" in r.stdout)
    assert "75% of the time in-sample" in r.stdout and "50% leave-one-scale-out" in r.stdout
    res = json.loads((tmp_path / "screen.json").read_text())
    assert set(res["layers"]) == {"blocks.0.ln_1", "blocks.0.ln_2", "blocks.1.ln_1", "blocks.1.ln_2", "ln_f"}
    assert 0.0 <= res["overall"] <= 1.0 and res["verdict"] in ("helps", "hurts") and res["threshold"] == 0.43


def test_screen_dyt_unknown_size_is_one_line(tmp_path):
    r = _run("--size", "huge", module="train.screen_dyt")
    assert r.returncode != 0 and len(r.stderr.strip().splitlines()) == 1
    assert "size 'huge'" in r.stderr


def test_killed_run_leaves_the_last_complete_checkpoint(tmp_path):
    import signal
    import time
    from models.checkpoint import load_checkpoint
    out = tmp_path / "ckpt"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "train", "--preset", "all-taper", "--out", str(out),
                             "--steps", "100000", "--eval-every", "1", "--warmup-steps", "1", "--taper-steps", "100000",
                             *SMALL], cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 90
        while time.time() < deadline:
            log = out / "train_log.json"
            if log.is_file() and len(json.loads(log.read_text())["evals"]) >= 3:
                break
            time.sleep(0.2)
        else:
            pytest.fail("no checkpoint after 90 s")
        proc.send_signal(signal.SIGKILL)   # no chance to clean up: the directory must still be whole
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    model = load_checkpoint(out)
    cfg = json.loads((out / "config.json").read_text())
    log = json.loads((out / "train_log.json").read_text())
    assert 0.0 < model.gate.value < 1.0 and cfg["gate"] == log["evals"][-1]["gate"]
    assert log["evals"][-1]["step"] >= 2 and log["calibration"]["step"] == 1


def test_help_documents_the_schedule_and_the_scale_loss():
    r = _run("--help")
    assert r.returncode == 0
    assert "L_aux = lambda * mean_tokens (log r(h) - log s_tgt)^2" in r.stdout
    for word in ("baseline", "internal-taper", "all-taper-noanchor", "dyt", "--taper-steps", "--aux-lambda", "--s-tgt"):
        assert word in r.stdout
