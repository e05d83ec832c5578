"""The bundled trained checkpoints in models/zoo: present, loadable, finished, and as good as reported."""
import json
from pathlib import Path

import pytest
import torch

from models.checkpoint import load_checkpoint, load_tokenizer

ZOO = Path(__file__).resolve().parents[2] / "models" / "zoo"
NAMES = ["baseline", "internal-taper", "all-taper", "dyt"]


def _log(name):
    return json.loads((ZOO / name / "train_log.json").read_text())


@pytest.mark.parametrize("name", NAMES)
def test_zoo_checkpoint_loads_and_is_finished(name):
    model = load_checkpoint(ZOO / name)
    load_tokenizer(ZOO / name)
    cfg = model.cfg
    assert (cfg.d_model, cfg.n_layer, cfg.n_head, cfg.vocab_size, cfg.max_seq_len) == (128, 4, 4, 2048, 256)
    if name.endswith("taper"):
        assert model.gate.value == 0.0
        raw = json.loads((ZOO / name / "config.json").read_text())
        assert raw["gate"] == 0.0 and all(c != 1.0 for c in raw["taper_c"].values())
    log = _log(name)
    assert log["preset"] == name and log["evals"][-1]["step"] == 1200
    with torch.no_grad():
        logits = model(torch.tensor([[0, 5, 9, 100]]))
    assert torch.isfinite(logits).all()


def test_zoo_val_losses_meet_the_reproduction_targets():
    base = _log("baseline")["evals"][-1]["val_loss"]
    assert _log("internal-taper")["evals"][-1]["val_loss"] <= base * 1.02
    assert _log("all-taper")["evals"][-1]["val_loss"] <= base * 1.03


def test_zoo_stays_small():
    total = sum(p.stat().st_size for p in ZOO.rglob("*") if p.is_file())
    assert total < 25 * 2**20
