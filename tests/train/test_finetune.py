"""train.finetune smoke tests: every method on a tiny pretrained GPT-2-architecture model, a few steps.

Each run must: start from exactly the source model (step-0 val loss equal to the source's), end
with its norms gone the method's way (TaperLN at g = 0 with calibrated c; every FakeLN norm fixed
and saved in the eps-trick form), save a checkpoint that computes what the training model
computed, and resume exactly.
"""
import json

import pytest
import torch
from safetensors.torch import load_file

import train.loop as loop
from models.checkpoint import load_checkpoint
from tests.cli.conftest import cli
from tests.train.conftest import pretrained_layernorm
from train.config import TrainConfig

TINY = ["--batch-size", "4", "--seq-len", "16", "--eval-batches", "1", "--calib-batches", "1",
        "--corpus-stories", "200", "--quiet", "--threads", "1"]
SAVED_VS_TRAINED = 1e-5   # fp32 val loss of the saved checkpoint vs the training model (eps trick: var/2e12 more)


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A 2-layer LayerNorm (GPT-2 architecture) model pretrained for 8 steps."""
    return pretrained_layernorm(tmp_path_factory.mktemp("ft") / "pre", steps=8)


def _finetune(source, out, method, *extra):
    return cli("train.finetune", ["--from", source, "--method", method, "--out", out, "--steps", "12",
                                  "--eval-every", "6", *TINY, *extra])


def _val_windows(log):
    from train.loop import prepare_data
    run = TrainConfig(**log["run"])
    return prepare_data(run, None).val


def _saved_val_loss(out, log):
    return loop.evaluate(load_checkpoint(out), _val_windows(log), 4)["val_loss"]


@pytest.mark.parametrize("method", ["internal-taper", "all-taper", "fakeln", "vanilla"])
def test_each_method_runs_and_ends_as_promised(source, tmp_path, method):
    extra = ["--fakeln-every", "2"] if method == "fakeln" else []
    r = _finetune(source, tmp_path / "ft", method, *extra)
    assert r.code == 0, r.err
    log = json.loads((tmp_path / "ft" / "train_log.json").read_text())
    src_log = json.loads((source / "train_log.json").read_text())
    assert log["recipe"]["finetune"] == method and log["evals"][-1]["step"] == 12
    # step 0 is the source model itself: TaperNorm at g = 1 and live FakeLN norms are the LayerNorms
    assert log["evals"][0]["val_loss"] == pytest.approx(src_log["evals"][-1]["val_loss"], abs=1e-5)
    cfg = json.loads((tmp_path / "ft" / "config.json").read_text())
    if method.endswith("taper"):
        assert (cfg["norm"], cfg["taper_scope"], cfg["taper_base"], cfg["taper_affine"], cfg["gate"]) == \
            ("taper", method.split("-")[0], "ln", True, 0.0)
        assert len(cfg["taper_c"]) == (5 if method == "all-taper" else 4) and log["calibration"]["step"] == 0
        assert (log["calibration"]["s_tgt"] is not None) == (method == "all-taper")
    elif method == "fakeln":
        assert (cfg["norm"], cfg["eps"], cfg["layer_eps"]) == ("layernorm", 1e12, {})
        assert [e["layer"] for e in log["fakeln"]] == ["blocks.0.ln_2", "blocks.1.ln_2", "blocks.0.ln_1",
                                                      "blocks.1.ln_1", "ln_f"]
        assert [e["step"] for e in log["fakeln"]] == [2, 4, 6, 8, 10] and all(e["std"] > 0 for e in log["fakeln"])
    else:
        assert cfg["norm"] == "layernorm" and cfg["eps"] == 1e-5
    # the checkpoint computes what the training model computed at its last evaluation
    assert _saved_val_loss(tmp_path / "ft", log) == pytest.approx(log["evals"][-1]["val_loss"], abs=SAVED_VS_TRAINED)


def test_fakeln_resume_ends_with_the_same_weights(source, tmp_path, monkeypatch):
    assert _finetune(source, tmp_path / "a", "fakeln", "--fakeln-every", "2").code == 0
    real, calls = loop.save_checkpoint, []

    def save_then_stop(*a, **k):
        real(*a, **k)
        calls.append(1)
        raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr(loop, "save_checkpoint", save_then_stop)
        r = _finetune(source, tmp_path / "b", "fakeln", "--fakeln-every", "2")
    assert r.code == 130 and "holds the checkpoint of step 6" in r.err and "train.finetune" in r.err
    # mid-run: two norms fixed (steps 2 and 4), the rest live; the checkpoint says so per layer and computes
    # what the training model computed
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    assert cfg["eps"] == 1e-5 and cfg["layer_eps"] == {"blocks.0.ln_2": 1e12, "blocks.1.ln_2": 1e12}
    log = json.loads((tmp_path / "b" / "train_log.json").read_text())
    assert _saved_val_loss(tmp_path / "b", log) == pytest.approx(log["evals"][-1]["val_loss"], abs=SAVED_VS_TRAINED)
    r = cli("train.finetune", ["--out", tmp_path / "b", "--resume", "--quiet", "--threads", "1"])
    assert r.code == 0, r.err
    a, b = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert json.loads((tmp_path / "b" / "train_log.json").read_text())["resumed_at"] == [6]


@pytest.mark.parametrize("argv, needle, code", [
    (["--method", "fakeln", "--out", "{t}/o"], "--from and --method are required", 2),
    (["--from", "{src}", "--method", "vanilla", "--out", "{t}/o", "--fakeln-every", "3"], "--fakeln-every", 2),
    (["--from", "{src}", "--method", "fakeln", "--out", "{t}/o", "--taper-steps", "3"], "--taper-steps", 2),
    (["--from", "{src}", "--method", "fakeln", "--out", "{t}/o", "--steps", "4", "--fakeln-every", "1"],
     "need more than --steps 4", 1),
    (["--from", "{t}/nothing", "--method", "vanilla", "--out", "{t}/o"], "not a checkpoint directory", 1),
    (["--out", "{src}", "--resume", "--steps", "3"], "drop --steps", 2),
    (["--out", "{src}", "--resume"], "not of train.finetune", 1),
])
def test_bad_usage_one_line(source, tmp_path, argv, needle, code):
    argv = [a.format(t=tmp_path, src=source) for a in argv] + ([] if "--resume" in argv else TINY)
    r = cli("train.finetune", argv)
    assert r.code == code and len(r.error_lines) == 1 and needle in r.error_lines[0], r.err
    assert not (tmp_path / "o").exists()


def test_taper_and_fakeln_refuse_models_without_real_norms(tmp_path):
    from tests.helpers import random_model, write_checkpoint
    taper = write_checkpoint(tmp_path / "taper", random_model(norm="taper", taper_scope="internal", gate=0.0))
    rms = write_checkpoint(tmp_path / "rms", random_model(norm="rmsnorm"))
    r = cli("train.finetune", ["--from", taper, "--method", "all-taper", "--out", tmp_path / "o", *TINY])
    assert r.code == 1 and "fine-tuning starts from a model with real LayerNorms or RMSNorms" in r.err
    r = cli("train.finetune", ["--from", rms, "--method", "fakeln", "--out", tmp_path / "o", *TINY])
    assert r.code == 1 and "--method fakeln replaces LayerNorms" in r.err
    assert not (tmp_path / "o").exists()


def test_finetune_from_a_hugging_face_folder(tmp_path):
    """--from takes an HF folder as it is (converted in memory), with its own tokenizer.json."""
    from tests.hf_models import hf_model, save_hf
    folder = save_hf(hf_model("gpt2"), tmp_path / "hf", tokenizer=True)
    r = cli("train.finetune", ["--from", folder, "--method", "all-taper", "--out", tmp_path / "ft", "--steps", "4",
                               "--eval-every", "2", *TINY])
    assert r.code == 0, r.err
    log = json.loads((tmp_path / "ft" / "train_log.json").read_text())
    assert log["recipe"]["from"] == str(folder) and log["run"]["tokenizer"] == str(folder / "tokenizer.json")
    model = load_checkpoint(tmp_path / "ft")
    assert (model.cfg.norm, model.cfg.taper_base, model.gate.value, model.cfg.max_seq_len) == ("taper", "ln", 0.0, 64)
    assert (tmp_path / "ft" / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()


@pytest.fixture(scope="module")
def family_sources(tmp_path_factory):
    """Tiny RMSNorm models of the Qwen3 and Gemma 3 architectures (python -m train --arch), pretrained 6 steps."""
    root = tmp_path_factory.mktemp("arch")
    out = {}
    for arch in ("qwen3", "gemma3"):
        r = cli("train", ["--preset", "baseline", "--arch", arch, "--d-model", "32", "--n-layer", "4", "--n-head", "4",
                          "--steps", "6", "--eval-every", "3", "--out", root / arch, *TINY])
        assert r.code == 0, r.err
        out[arch] = root / arch
    return out


@pytest.mark.parametrize("arch", ["qwen3", "gemma3"])
@pytest.mark.parametrize("method", ["internal-taper", "all-taper"])
def test_the_families_norms_taper_qk_and_sandwich_norms_included(family_sources, tmp_path, arch, method):
    """internal-taper tapers every norm but the final one (QK-norms and sandwich norms too), all-taper every norm;
    the run starts from the source model exactly, and ends at g = 0 with a calibrated c for each."""
    source = family_sources[arch]
    src_cfg = json.loads((source / "config.json").read_text())
    assert src_cfg["qk_norm"] == "head" and src_cfg["norm_layout"] == ("sandwich" if arch == "gemma3" else "pre")
    r = _finetune(source, tmp_path / "ft", method)
    assert r.code == 0, r.err
    log = json.loads((tmp_path / "ft" / "train_log.json").read_text())
    src_log = json.loads((source / "train_log.json").read_text())
    assert log["evals"][0]["val_loss"] == pytest.approx(src_log["evals"][-1]["val_loss"], abs=1e-5)
    cfg = json.loads((tmp_path / "ft" / "config.json").read_text())
    from models.decoder import DecoderConfig
    names = DecoderConfig.from_dict(cfg).norm_names()
    expected = names if method == "all-taper" else [n for n in names if n != "ln_f"]
    assert (cfg["gate"], sorted(cfg["taper_c"])) == (0.0, sorted(expected))
    assert any(n.endswith("q_norm") for n in expected) and (arch != "gemma3" or any("post_" in n for n in expected))
    assert all(c > 0 for c in cfg["taper_c"].values())


def test_fakeln_is_refused_for_an_rmsnorm_family_in_one_line(family_sources, tmp_path):
    r = _finetune(family_sources["qwen3"], tmp_path / "ft", "fakeln")
    assert r.code == 1 and r.err.count("\n") == 1 and "--method fakeln replaces LayerNorms" in r.err, r.err
