"""Checkpoint round trip is exact; every kind of bad checkpoint gives one clear line and a non-zero exit."""
import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.checkpoint import CheckpointError, all_finite, load_checkpoint, main
from tests.helpers import random_model, write_checkpoint


@pytest.mark.parametrize("overrides", [
    dict(norm="taper", taper_scope="internal", gate=0.0),
    dict(norm="taper", taper_scope="all", taper_base="ln", taper_affine=True, gate=0.4, tie_embeddings=False),
    dict(norm="dyt"),
    dict(norm="layernorm", mlp="swiglu"),
])
def test_round_trip_is_exact(tmp_path, overrides):
    model = random_model(**overrides)
    write_checkpoint(tmp_path / "ckpt", model)
    loaded = load_checkpoint(tmp_path / "ckpt")
    assert loaded.cfg == model.cfg
    assert loaded.gate.value == model.gate.value
    assert loaded.taper_c() == model.taper_c()
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    if model.cfg.tie_embeddings:
        assert loaded.lm_head.weight is loaded.wte.weight
    ids = torch.randint(0, 320, (2, 6))
    with torch.no_grad():
        assert torch.equal(model(ids), loaded(ids))


@pytest.fixture
def ckpt(tmp_path):
    return write_checkpoint(tmp_path / "ckpt", random_model(norm="taper", taper_scope="internal", gate=0.0))


def edit_config(ckpt, **changes):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg.update(changes)
    (ckpt / "config.json").write_text(json.dumps(cfg))


def edit_weight(ckpt, name, fn):
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors[name] = fn(tensors[name])
    save_file(tensors, str(ckpt / "model.safetensors"))


def nan_first(t):
    t = t.clone()
    t.view(-1)[0] = float("nan")
    return t


def inf_last(t):
    t = t.clone()
    t.view(-1)[-1] = float("inf")
    return t


BAD = {
    "missing config": (lambda c: (c / "config.json").unlink(), r"config\.json: missing"),
    "missing weights": (lambda c: (c / "model.safetensors").unlink(), r"model\.safetensors: missing"),
    "missing tokenizer": (lambda c: (c / "tokenizer.json").unlink(), r"tokenizer\.json: missing"),
    "invalid json": (lambda c: (c / "config.json").write_text('{"norm": "taper",'), r"config\.json: not valid JSON"),
    "unknown norm": (lambda c: edit_config(c, norm="batchnorm"), r"config\.json: field norm = 'batchnorm'; expected one of"),
    "gate above 1": (lambda c: edit_config(c, gate=1.5), r"config\.json: field 'gate' is 1\.5; expected a number in \[0, 1\]"),
    "gate below 0": (lambda c: edit_config(c, gate=-0.1), r"field 'gate' is -0\.1"),
    "shape mismatch": (lambda c: edit_config(c, d_model=64), r"tensor '.*' has shape \[.*\]; config\.json implies"),
    "nan weight": (lambda c: edit_weight(c, "blocks.0.attn.q_proj.weight", nan_first), r"'blocks\.0\.attn\.q_proj\.weight' contains NaN or Inf"),
    "inf weight": (lambda c: edit_weight(c, "wte.weight", inf_last), r"'wte\.weight' contains NaN or Inf"),
    "corrupt safetensors": (lambda c: (c / "model.safetensors").write_bytes(b"\x00garbage"), r"not a readable safetensors file"),
    "missing taper c": (lambda c: edit_config(c, taper_c={}), r"field 'taper_c' has layers"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint_one_clear_line(ckpt, case, capsys):
    damage, pattern = BAD[case]
    damage(ckpt)
    with pytest.raises(CheckpointError, match=pattern):
        load_checkpoint(ckpt)
    assert main([str(ckpt)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err


def test_cli_exit_codes(ckpt):
    ok = subprocess.run([sys.executable, "-m", "models.checkpoint", str(ckpt)], capture_output=True, text=True)
    assert ok.returncode == 0 and "ok: taper (internal), gate 0.0" in ok.stdout
    (ckpt / "config.json").write_text("not json")
    bad = subprocess.run([sys.executable, "-m", "models.checkpoint", str(ckpt)], capture_output=True, text=True)
    assert bad.returncode == 1
    assert bad.stderr.startswith("error: ") and bad.stderr.count("\n") == 1 and "Traceback" not in bad.stderr


def test_failed_save_leaves_previous_checkpoint_intact(ckpt, monkeypatch):
    import models.checkpoint as mc
    before = (ckpt / "model.safetensors").read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(mc.shutil, "copyfile", boom)
    with pytest.raises(OSError):
        mc.save_checkpoint(random_model(seed=5), ckpt, ckpt / "tokenizer.json")
    assert (ckpt / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in ckpt.parent.iterdir() if p.name.startswith(".ckpt.") and p.is_dir()) == []
    load_checkpoint(ckpt)


# --- format 2 and the format-1 reader -------------------------------------------------------------

ZOO = __import__("pathlib").Path(__file__).resolve().parents[2] / "models" / "zoo"


def test_format_1_checkpoints_keep_loading_and_resave_as_format_3(tmp_path):
    """The bundled zoo is format 1: it loads as what format 1 meant, and a re-save is an equal format-3 model."""
    raw = json.loads((ZOO / "internal-taper" / "config.json").read_text())
    assert raw["format"] == 1 and "pos_embedding" not in raw
    model = load_checkpoint(ZOO / "internal-taper")
    cfg = model.cfg
    assert (cfg.pos_embedding, cfg.kv_heads, cfg.qkv_bias, cfg.out_bias, cfg.mlp_bias, cfg.hidden, cfg.act) == \
        ("learned", cfg.n_head, True, True, True, 4 * cfg.d_model, "gelu_new")
    from models.checkpoint import save_checkpoint
    save_checkpoint(model, tmp_path / "v2", ZOO / "internal-taper" / "tokenizer.json")
    assert json.loads((tmp_path / "v2" / "config.json").read_text())["format"] == 3
    again = load_checkpoint(tmp_path / "v2")
    ids = torch.randint(0, cfg.vocab_size, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(ids), again(ids))


def test_format_2_round_trip_of_the_hf_family_fields(tmp_path):
    model = random_model(norm="rmsnorm", mlp="swiglu", pos_embedding="rope", rope_theta=5e5, n_kv_head=2,
                         head_size=16, rotary_dim=8, rope_scaling={"rope_type": "linear", "factor": 4.0},
                         qkv_bias=True, out_bias=False, mlp_bias=False, mlp_hidden=50, activation="gelu",
                         tie_embeddings=False, layer_eps={"ln_f": 1e-3})
    write_checkpoint(tmp_path / "ck", model)
    loaded = load_checkpoint(tmp_path / "ck")
    assert loaded.cfg == model.cfg
    ids = torch.randint(0, 320, (2, 6))
    with torch.no_grad():
        assert torch.equal(model(ids), loaded(ids))


def test_format_3_round_trip_of_the_2026_family_fields(tmp_path):
    """Every format-3 field saved and loaded back, the model's output unchanged (sliding layers with their own
    rope base, QK-norms, sandwich norms, scales and soft-caps, NoPE layers)."""
    model = random_model(norm="rmsnorm", mlp="swiglu", pos_embedding="rope", n_layer=3, norm_layout="sandwich",
                         qk_norm="head", embed_scale=3.0, attn_scale=0.2, attn_softcap=4.0, final_softcap=6.0,
                         residual_scale=0.7, logits_divisor=1.5, sliding_window=3, sliding_layers=[0, 2],
                         local_rope_theta=50.0, nope_layers=[1],
                         rope_scaling={"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32})
    assert not torch.equal(model.blocks[0].attn.q_norm.weight, torch.ones(8))   # random_model moved the gains
    write_checkpoint(tmp_path / "ck", model)
    loaded = load_checkpoint(tmp_path / "ck")
    assert loaded.cfg == model.cfg
    ids = torch.randint(0, 320, (2, 9))
    with torch.no_grad():
        assert torch.equal(model(ids), loaded(ids))


def test_format_2_checkpoints_load_as_what_format_2_meant(tmp_path):
    from models.checkpoint import FORMAT_2_MEANT
    model = random_model(norm="rmsnorm", pos_embedding="rope")
    write_checkpoint(tmp_path / "ck", model)
    raw = json.loads((tmp_path / "ck" / "config.json").read_text())
    (tmp_path / "ck" / "config.json").write_text(json.dumps(
        {**{k: v for k, v in raw.items() if k not in FORMAT_2_MEANT}, "format": 2}))
    ids = torch.randint(0, 320, (2, 6))
    with torch.no_grad():
        assert torch.equal(model(ids), load_checkpoint(tmp_path / "ck")(ids))


def test_tokenizer_less_checkpoint_loads_and_says_so(tmp_path, capsys):
    from models.checkpoint import load_tokenizer, save_checkpoint
    save_checkpoint(random_model(), tmp_path / "ck", None)
    assert json.loads((tmp_path / "ck" / "config.json").read_text())["has_tokenizer"] is False
    load_checkpoint(tmp_path / "ck")
    assert main([str(tmp_path / "ck")]) == 0 and "no tokenizer.json (generation needs one)" in capsys.readouterr().out
    with pytest.raises(CheckpointError, match="converted from a folder without one, and generation needs it"):
        load_tokenizer(tmp_path / "ck")


@pytest.mark.parametrize("changes, pattern", [
    (dict(format=1), r"format 1 with format-2 or -3 field\(s\) .*pos_embedding"),
    (dict(format=4), r"field 'format' is 4; expected one of 1, 2, 3"),
    (dict(format=True), r"field 'format' is True"),
    (dict(format=2), r"format 2 with format-3 field\(s\) attn_scale, attn_softcap, embed_scale"),
    (dict(format=3, has_tokenizer="yes"), r"field 'has_tokenizer' is 'yes'; expected true or false"),
])
def test_format_fields_are_checked(ckpt, changes, pattern):
    edit_config(ckpt, **changes)
    with pytest.raises(CheckpointError, match=pattern):
        load_checkpoint(ckpt)


def test_a_hugging_face_folder_gets_the_convert_hint(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(CheckpointError, match=r"a Hugging Face model folder \(model_type 'llama'\), not a checkpoint; "
                                              r"convert it with python -m models.convert"):
        load_checkpoint(tmp_path / "hf")


@pytest.mark.parametrize("values, dtype, finite", [
    ([1.0, -2.0, 3.0], torch.float32, True),
    ([], torch.float32, True),
    ([1.0, float("nan")], torch.float32, False),
    ([1.0, float("inf")], torch.float32, False),
    ([float("-inf"), 2.0], torch.bfloat16, False),
    ([float("inf"), float("-inf")], torch.float32, False),      # the sum is NaN
    ([3e38, 3e38], torch.float32, True),                        # finite, the sum overflows: checked element-wise
    ([6e4, 6e4], torch.float16, True),
    ([6e4, float("nan")], torch.float16, False),
])
def test_all_finite_is_exactly_isfinite_all(values, dtype, finite):
    t = torch.tensor(values, dtype=dtype)
    assert all_finite(t) is finite is bool(torch.isfinite(t).all())
