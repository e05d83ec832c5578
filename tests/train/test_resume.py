"""train --out holds the run: never overwritten by an earlier step, resumed exactly."""
import json

import pytest
import torch
from safetensors.torch import load_file

import train.loop as loop
from train.config import TrainConfig
from train.errors import TrainError
from train.loop import RUN_STATE, resume_config, train

TINY = dict(size="tiny", batch_size=4, seq_len=16, eval_every=2, eval_batches=1, calib_batches=1,
            corpus_stories=200, progress=False, threads=1, model=dict(d_model=16, n_layer=2, n_head=2, max_seq_len=32))


def _cfg(out, **kw):
    return TrainConfig(**{**TINY, "preset": "all-taper", "out": str(out), "steps": 8, "warmup_steps": 3,
                          "taper_steps": 2, **kw})


def _interrupt_after_saves(monkeypatch, n):
    real, calls = loop.save_checkpoint, []

    def save_then_stop(*a, **k):
        real(*a, **k)
        calls.append(1)
        if len(calls) == n:
            raise KeyboardInterrupt
    monkeypatch.setattr(loop, "save_checkpoint", save_then_stop)


@pytest.mark.parametrize("stop_after", [1, 2])   # step 2: before calibration (step 3); step 4: after it
def test_resume_ends_with_the_same_weights_as_an_uninterrupted_run(tmp_path, monkeypatch, stop_after):
    log_a = train(_cfg(tmp_path / "a"))
    with monkeypatch.context() as m:
        _interrupt_after_saves(m, stop_after)
        with pytest.raises(KeyboardInterrupt):
            train(_cfg(tmp_path / "b"))
    held = json.loads((tmp_path / "b" / "train_log.json").read_text())["step"]
    assert held == 2 * stop_after
    log_b = train(resume_config(tmp_path / "b"), resume=True)
    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "a" / "config.json").read_text()) == json.loads((tmp_path / "b" / "config.json").read_text())
    assert [e["val_loss"] for e in log_a["evals"]] == [e["val_loss"] for e in log_b["evals"]]
    assert log_b["resumed_at"] == [held]


def test_nothing_is_written_before_the_first_evaluation(tmp_path, monkeypatch):
    monkeypatch.setattr(loop, "save_checkpoint", lambda *a, **k: (_ for _ in ()).throw(KeyboardInterrupt))
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(tmp_path / "r"))
    assert not (tmp_path / "r").exists()
    assert list(tmp_path.iterdir()) == []                     # no work directory left either


def test_a_new_run_never_replaces_a_held_run_and_resume_needs_one(tmp_path):
    train(_cfg(tmp_path / "r", steps=2))
    before = (tmp_path / "r" / "model.safetensors").read_bytes()
    with pytest.raises(TrainError, match="holds a training run at step 2; continue it with --resume"):
        train(_cfg(tmp_path / "r", steps=2))
    assert (tmp_path / "r" / "model.safetensors").read_bytes() == before
    with pytest.raises(TrainError, match="no training run to resume"):
        train(_cfg(tmp_path / "empty"), resume=True)
    assert (tmp_path / "r" / RUN_STATE).is_file()


def test_resume_of_a_finished_run_changes_nothing(tmp_path):
    train(_cfg(tmp_path / "r", steps=2))
    before = (tmp_path / "r" / "model.safetensors").read_bytes()
    log = train(resume_config(tmp_path / "r"), resume=True)
    assert log["evals"][-1]["step"] == 2
    assert (tmp_path / "r" / "model.safetensors").read_bytes() == before


def test_weights_that_turn_nan_are_never_written(tmp_path, monkeypatch):
    real, calls = loop.evaluate, []

    def poison(model, *a, **k):
        calls.append(1)
        if len(calls) == 2:                                  # the evaluation of step 2
            with torch.no_grad():
                model.wte.weight[0, 0] = float("nan")
        return real(model, *a, **k)
    monkeypatch.setattr(loop, "evaluate", poison)
    with pytest.raises(TrainError, match="NaN or Inf at step 2; nothing written"):
        train(_cfg(tmp_path / "r"))
    assert not (tmp_path / "r").exists()
