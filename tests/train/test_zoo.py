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
    assert total < 40 * 10**6          # issue 11: the whole zoo under 40 MB


# --- the GPT-2-architecture model and its fine-tunes (train.finetune, docs/training.md) -------------------

_VAL = {}


def _val_windows(run):
    """The run's held-out windows (the generated corpus is deterministic), built once for equal settings."""
    from train.loop import prepare_data
    import hashlib
    key = (run.corpus, run.corpus_stories, run.seq_len, run.batch_size, run.eval_batches,
           hashlib.sha256(Path(run.tokenizer).read_bytes()).hexdigest())
    if key not in _VAL:
        _VAL[key] = prepare_data(run, None).val
    return _VAL[key]


GPT2 = {"gpt2": None, "gpt2-fakeln": "fakeln", "gpt2-internal-taperln": "internal-taper",
        "gpt2-all-taperln": "all-taper"}


@pytest.mark.parametrize("name", list(GPT2))
def test_gpt2_zoo_checkpoint_is_what_it_says(name):
    model = load_checkpoint(ZOO / name)
    cfg, log = model.cfg, _log(name)
    assert (cfg.d_model, cfg.n_layer, cfg.n_head, cfg.vocab_size, cfg.pos_embedding, cfg.act) == \
        (128, 4, 4, 2048, "learned", "gelu_new")
    method = GPT2[name]
    if method is None:
        assert (cfg.norm, log["preset"], log["evals"][-1]["step"]) == ("layernorm", "layernorm", 1200)
        return
    assert log["recipe"]["finetune"] == method and log["evals"][-1]["step"] == 600
    if method == "fakeln":
        assert (cfg.norm, cfg.eps, cfg.layer_eps) == ("layernorm", 1e12, {}) and len(log["fakeln"]) == 9
    else:
        assert (cfg.norm, cfg.taper_base, cfg.taper_affine, model.gate.value) == ("taper", "ln", True, 0.0)
        assert cfg.taper_scope == method.split("-")[0]


@pytest.mark.parametrize("name", list(GPT2))
def test_gpt2_zoo_checkpoint_reproduces_its_logged_val_loss(name):
    """The shipped weights are the ones measured: their val loss on the run's own val windows is the logged one."""
    from train.config import TrainConfig
    from train.loop import evaluate
    log = _log(name)
    run = TrainConfig(**{**log["run"], "tokenizer": str(ZOO / name / "tokenizer.json")})
    val = _val_windows(run)
    got = evaluate(load_checkpoint(ZOO / name), val, run.batch_size)["val_loss"]
    assert got == pytest.approx(log["evals"][-1]["val_loss"], abs=1e-4)


# --- the Qwen3- and Gemma-3-architecture models and their all-taper fine-tunes (issue 34, docs/training.md) ---

FAMILIES = {"qwen3": None, "qwen3-all-taper": "all-taper", "gemma3": None, "gemma3-all-taper": "all-taper"}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_zoo_checkpoint_is_what_it_says(name):
    model = load_checkpoint(ZOO / name)
    cfg, log = model.cfg, _log(name)
    gemma = name.startswith("gemma3")
    assert (cfg.d_model, cfg.n_layer, cfg.n_head, cfg.kv_heads, cfg.hidden, cfg.pos_embedding, cfg.qk_norm) == \
        (64, 4, 4, 2, 64, "rope", "head")
    assert (cfg.norm_layout, cfg.sliding_layers) == (("sandwich", [0, 1, 2]) if gemma else ("pre", []))
    if FAMILIES[name] is None:
        assert (cfg.norm, log["preset"], log["evals"][-1]["step"]) == ("rmsnorm", "baseline", 1200)
        return
    assert log["recipe"]["finetune"] == "all-taper" and log["evals"][-1]["step"] == 600
    assert (cfg.norm, cfg.taper_scope, model.gate.value) == ("taper", "all", 0.0)
    assert sorted(model.taper_c()) == sorted(cfg.norm_names())          # QK-norms and sandwich norms tapered too


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_zoo_checkpoint_reproduces_its_logged_val_loss(name):
    test_gpt2_zoo_checkpoint_reproduces_its_logged_val_loss(name)
