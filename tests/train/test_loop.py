"""Few-step training of every preset at tiny shapes, and what the checkpoints record."""
import json
import math

import pytest

from models.checkpoint import load_checkpoint
from train.loop import TrainConfig, TrainError, train
from train.presets import PRESETS

TINY = dict(size="tiny", batch_size=4, seq_len=16, eval_every=2, eval_batches=2, calib_batches=1,
            corpus_stories=200, progress=False,
            model=dict(d_model=16, n_layer=2, n_head=2, max_seq_len=32))


def _run(tmp_path, preset, steps=6, **kw):
    args = dict(TINY, preset=preset, out=str(tmp_path / preset), steps=steps)
    args.update(kw)
    return train(TrainConfig(**args)), tmp_path / preset


@pytest.mark.parametrize("preset", list(PRESETS))
def test_every_preset_trains_saves_and_loads(tmp_path, preset):
    log, out = _run(tmp_path, preset)
    model = load_checkpoint(out)
    assert sorted(p.name for p in out.iterdir()) == [".tapernorm-output.json", "config.json", "model.safetensors",
                                                     "tokenizer.json", "train_log.json", "train_state.json",
                                                     "train_state.safetensors"]
    assert [e["step"] for e in log["evals"]] == [0, 2, 4, 6]
    for e in log["evals"]:
        assert math.isfinite(e["val_loss"]) and e["prelogit_rms"] > 0 and e["max_abs_logit"] > 0
        assert set(e) >= {"step", "train_loss", "val_loss", "gate", "prelogit_rms", "max_abs_logit", "lr"}
    assert json.loads((out / "train_log.json").read_text())["evals"] == log["evals"]
    cfg = json.loads((out / "config.json").read_text())
    if PRESETS[preset]["model"]["norm"] == "taper":
        assert cfg["gate"] == 0.0 and model.gate.value == 0.0            # 6 steps >= warmup 2 + taper 2
        assert log["calibration"]["step"] == round(0.35 * 6)
        assert cfg["taper_c"] == pytest.approx(log["calibration"]["c"])
        assert all(c != 1.0 for c in cfg["taper_c"].values())              # calibrated, not the default
        assert [e["gate"] for e in log["evals"]][0] == 1.0
    else:
        assert cfg["gate"] is None and log["calibration"] is None
    if preset == "all-taper":
        assert log["aux"]["lambda"] == 0.1 and log["calibration"]["s_tgt"] > 0
    if preset == "dyt":   # the preset lifts the inputs of DyT to O(1) at init (see train/presets.py)
        assert log["run"]["embed_std"] == 0.2 and cfg["dyt_alpha_init"] == 1.0
    else:
        assert log["run"]["embed_std"] is None
    if preset == "all-taper-noanchor":
        assert cfg["final_norm"] is False and log["aux"]["lambda"] == 0.0


def test_unfinished_taper_checkpoint_records_its_nonzero_gate(tmp_path):
    log, out = _run(tmp_path, "internal-taper", steps=6, warmup_steps=2, taper_steps=8)
    cfg = json.loads((out / "config.json").read_text())
    expected = 0.5 * (1 + math.cos(math.pi * (6 - 2) / 8))                # gate of the next step, 6
    assert cfg["gate"] == pytest.approx(expected) and 0 < cfg["gate"] < 1
    assert load_checkpoint(out).gate.value == pytest.approx(expected)
    assert set(cfg["taper_c"]) == {"blocks.0.ln_1", "blocks.0.ln_2", "blocks.1.ln_1", "blocks.1.ln_2"}
    assert cfg["taper_c"] == pytest.approx(log["calibration"]["c"])
    assert [e["gate"] for e in log["evals"]] == pytest.approx([1.0, 1.0, 0.5 * (1 + math.cos(math.pi * 2 / 8)), expected])


def test_same_seed_same_data_order_across_presets(tmp_path):
    # Until calibration, an internal-taper model is the RMSNorm baseline: same init, same batches.
    a, _ = _run(tmp_path, "baseline", steps=2)
    b, _ = _run(tmp_path, "internal-taper", steps=2, warmup_steps=4, taper_steps=4)
    assert [e["val_loss"] for e in a["evals"]] == pytest.approx([e["val_loss"] for e in b["evals"]], rel=1e-6)


def test_out_that_is_not_a_checkpoint_is_refused(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "notes.txt").write_text("keep me")
    from core.errors import UserError
    with pytest.raises(UserError, match="did not write"):
        train(TrainConfig(**dict(TINY, preset="baseline", out=str(tmp_path / "x"), steps=1)))
    assert (tmp_path / "x" / "notes.txt").read_text() == "keep me"
