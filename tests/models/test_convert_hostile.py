"""models.convert on folders that mislead: config keys transformers reads but we might not,
a tied config over a stored head, hostile pickles, mislabelled or broken files (issue 23).

Every folder is fx/llama (a tiny random-init LlamaForCausalLM, saved with the installed
transformers) edited one way. A case either converts to logits equal to what transformers
itself loads from the same folder (max abs diff <= 1e-5), or is one `error:` line naming
the object and the fix, with nothing written.
"""
import json
import shutil

import pytest
import torch

from models.convert import ConvertError, convert, main

transformers = pytest.importorskip("transformers")

ATOL_FP32 = 1e-5    # two fp32 implementations of the same math: only summation order differs
FX_LLAMA = dict(vocab_size=2048, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256)


def _randomized(model):
    """Every parameter random (matrices std 0.2, norm gains around 1): a dropped or misplaced tensor shows."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if p.dim() == 1 else 0.2 * torch.randn_like(p))
    return model.eval()


@pytest.fixture(scope="module")
def fx(tmp_path_factory):
    """Saved folders: fx/llama (untied head) and a tiny GPT-2, each written once."""
    import contextlib
    import io
    root = tmp_path_factory.mktemp("fx")
    torch.manual_seed(0)
    models = {"llama": transformers.LlamaForCausalLM(transformers.LlamaConfig(**FX_LLAMA)),
              "gpt2": transformers.GPT2LMHeadModel(transformers.GPT2Config(
                  vocab_size=2048, n_embd=64, n_layer=2, n_head=4, n_positions=64, tie_word_embeddings=False))}
    for name, m in models.items():
        with contextlib.redirect_stderr(io.StringIO()):     # transformers' progress bar
            _randomized(m).save_pretrained(root / name)
    return root


def _copy(fx, tmp_path, name="llama", **config_changes):
    """A copy of fx/<name> with config.json keys changed (a value None removes the key)."""
    path = tmp_path / "hf"
    shutil.copytree(fx / name, path)
    raw = json.loads((path / "config.json").read_text())
    for k, v in config_changes.items():
        raw.pop(k, None) if v is None else raw.__setitem__(k, v)
    (path / "config.json").write_text(json.dumps(raw))
    return path


def _transformers_logits(path, ids):
    """What transformers itself makes of the folder (its own config reading, its own tying rule)."""
    import contextlib
    import io
    with contextlib.redirect_stderr(io.StringIO()):
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(ids).logits


def _assert_same_as_transformers(path):
    ids = torch.randint(0, 2048, (2, 40), generator=torch.Generator().manual_seed(1))
    ref = _transformers_logits(path, ids)
    c = convert(path)
    with torch.no_grad():
        got = c.model(ids)
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(got, ref, atol=ATOL_FP32, rtol=0)
    return c


def _assert_one_line(path, tmp_path, capsys, *needles, absent=()):
    """convert raises one line holding every needle; the CLI prints just that and writes nothing."""
    with pytest.raises(ConvertError) as e:
        convert(path)
    msg = str(e.value)
    assert "\n" not in msg and all(n in msg for n in needles) and not any(a in msg for a in absent), msg
    capsys.readouterr()
    assert main([str(path), "--out", str(tmp_path / "ck")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and all(n in err for n in needles), err
    assert not (tmp_path / "ck").exists()
    return msg


# --- 1. rope settings: both keys, transformers' precedence -------------------------------------

ROPE_SUPPORTED = {
    # transformers 5 writes rope_parameters; a truthy rope_scaling replaces it whole (PreTrainedConfig
    # .convert_rope_params_to_dict: `rope_scaling or rope_parameters`), its theta included
    "rope_scaling linear beside rope_parameters": dict(rope_scaling={"rope_type": "linear", "factor": 4.0}),
    "rope_scaling with the legacy 'type' key": dict(rope_scaling={"type": "linear", "factor": 2.0}),
    "rope_scaling replaces rope_parameters' theta": dict(rope_scaling={"rope_type": "linear", "factor": 4.0},
                                                          rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
    "top-level rope_theta fills in": dict(rope_scaling={"rope_type": "linear", "factor": 4.0}, rope_theta=3e4),
    "llama3 without original_max_position_embeddings": dict(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "rope_theta": 5e5}),
    # transformers' llama family rotates the whole head whatever partial_rotary_factor says (default rope)
    "partial_rotary_factor beside rope_parameters": dict(partial_rotary_factor=0.5),
    "partial_rotary_factor inside rope_parameters": dict(rope_parameters={"rope_type": "default", "rope_theta": 1e4,
                                                                          "partial_rotary_factor": 0.5}),
    "empty rope_scaling leaves rope_parameters": dict(rope_scaling={}, rope_parameters={"rope_type": "linear",
                                                                                         "factor": 3.0}),
}


@pytest.mark.parametrize("case", list(ROPE_SUPPORTED))
def test_rope_settings_read_as_transformers_reads_them(fx, tmp_path, case):
    c = _assert_same_as_transformers(_copy(fx, tmp_path, **ROPE_SUPPORTED[case]))
    both = "rope_scaling" in ROPE_SUPPORTED[case] and ROPE_SUPPORTED[case]["rope_scaling"]
    assert any("rope_scaling" in n for n in c.notes) == bool(both), c.notes   # says which key it followed


ROPE_REFUSED = {
    "dynamic": (dict(rope_scaling={"rope_type": "dynamic", "factor": 4.0}),
                ("rope type 'dynamic' (supported: default, linear, llama3, yarn, longrope) from rope_scaling",)),
    "unknown type": (dict(rope_scaling={"rope_type": "foo", "factor": 4.0}),
                     ("rope type 'foo' (supported: default, linear, llama3, yarn, longrope) from rope_scaling",)),
    "longrope factors of the wrong length": (dict(rope_scaling={"rope_type": "longrope", "short_factor": [1.0],
                                                                "long_factor": [2.0]}),
                                             ("'rope_scaling.short_factor' is '1 numbers'",)),
    "linear without a factor": (dict(rope_scaling={"rope_type": "linear"}), ("'rope_scaling.factor' is missing",)),
    "negative factor": (dict(rope_scaling={"rope_type": "linear", "factor": -2.0}),
                        ("'rope_scaling.factor' is -2.0", "a positive number")),
    "rope_scaling a string": (dict(rope_scaling="yarn"), ("'rope_scaling' is 'yarn'", "expected an object")),
    # transformers' llama family computes cos/sin over the partial width, then fails on the whole head
    "partial rotary with a scaled rope": (dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4,
                                                                "partial_rotary_factor": 0.5}),
                                          ("partial_rotary_factor 0.5 with rope type 'linear'",)),
    "per-layer-type rope_parameters": (dict(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0}}),
                                       ("rope_parameters per layer type",)),
}


@pytest.mark.parametrize("case", list(ROPE_REFUSED))
def test_rope_settings_the_decoder_cannot_express_are_refused(fx, tmp_path, capsys, case):
    changes, needles = ROPE_REFUSED[case]
    _assert_one_line(_copy(fx, tmp_path, **changes), tmp_path, capsys, *needles)


def test_export_build_refuses_dynamic_rope_scaling_too(fx, tmp_path, capsys):
    from export.build import main as build_main
    path = _copy(fx, tmp_path, rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    assert build_main(["--checkpoint", str(path), "--out", str(tmp_path / "build")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "rope type 'dynamic'" in err, err
    assert not (tmp_path / "build").exists()


# --- 2. tie_word_embeddings over a stored head: transformers' rule ----------------------------

@pytest.mark.parametrize("name", ["llama", "gpt2"])
def test_tied_config_with_a_different_stored_head_keeps_the_head(fx, tmp_path, name):
    """transformers 5 ties only when the stored head equals the embedding; a different head is kept."""
    c = _assert_same_as_transformers(_copy(fx, tmp_path, name=name, tie_word_embeddings=True))
    assert not c.model.cfg.tie_embeddings
    assert any("tie_word_embeddings" in n for n in c.notes), c.notes


def test_tied_config_with_an_equal_stored_head_stays_tied(fx, tmp_path):
    from safetensors.torch import load_file, save_file
    path = _copy(fx, tmp_path, tie_word_embeddings=True)
    tensors = load_file(str(path / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
    save_file(tensors, str(path / "model.safetensors"))
    c = _assert_same_as_transformers(path)
    assert c.model.cfg.tie_embeddings and c.model.lm_head.weight is c.model.wte.weight


def test_tied_config_with_only_the_head_stored_uses_it_as_the_embedding(fx, tmp_path):
    """transformers swaps a tie whose source is missing: the embedding is the stored head."""
    from safetensors.torch import load_file, save_file
    path = _copy(fx, tmp_path, tie_word_embeddings=True)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.embed_tokens.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    c = _assert_same_as_transformers(path)
    assert c.model.cfg.tie_embeddings


# --- 3. a pickle that would run code -----------------------------------------------------------

class _RunsCode:
    """Unpickling this calls exec: a weights-only reader must refuse it before it runs."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return exec, (f"open({str(self.marker)!r}, 'w').close()",)


# how the pickle names exec: GLOBAL (protocols 0-2; torch.save's default is 2) or STACK_GLOBAL (4, 5;
# torch's weights-only reader stops those at their FRAME opcode, before it sees the callable)
HOSTILE_PICKLES = {"torch.save, protocol 2": dict(pickle_protocol=2),
                   "torch.save, protocol 4": dict(pickle_protocol=4),
                   "torch.save, legacy format": dict(pickle_protocol=2, _use_new_zipfile_serialization=False),
                   "plain pickle.dump": None}


@pytest.mark.parametrize("case", list(HOSTILE_PICKLES))
def test_hostile_pytorch_bin_refused_in_one_line_without_running(fx, tmp_path, capsys, case):
    import pickle
    path = _copy(fx, tmp_path)
    (path / "model.safetensors").unlink()
    marker = tmp_path / "code-ran"
    payload = {"model.embed_tokens.weight": _RunsCode(marker)}
    if HOSTILE_PICKLES[case] is None:
        (path / "pytorch_model.bin").write_bytes(pickle.dumps(payload))
    else:
        torch.save(payload, path / "pytorch_model.bin", **HOSTILE_PICKLES[case])
    msg = _assert_one_line(path, tmp_path, capsys, "pytorch_model.bin", "could run code", "calls builtins.exec",
                           "safetensors", "trust", absent=("weights_only",))
    assert not marker.exists(), msg


def test_damaged_pickle_is_unreadable_not_hostile_and_without_torchs_advice(fx, tmp_path, capsys):
    """A pickle the weights-only reader stops in for damage (no code asked for) is a damaged file."""
    path = _copy(fx, tmp_path)
    (path / "model.safetensors").unlink()
    (path / "pytorch_model.bin").write_bytes(b"\x80\x02\xff")    # protocol 2, then no such opcode
    _assert_one_line(path, tmp_path, capsys, "pytorch_model.bin: not a readable PyTorch weights file",
                     "Unsupported operand", absent=("weights_only", "could run code"))


# --- 4. messages that name the real problem ----------------------------------------------------

def test_gpt2_weights_labelled_llama_name_the_mismatch_not_memory(fx, tmp_path, capsys):
    path = _copy(fx, tmp_path, name="gpt2", model_type="llama")
    _assert_one_line(path, tmp_path, capsys, "model_type 'llama'", "gpt2", "transformer.wte.weight",
                     absent=("GiB", "needs"))


def test_config_too_big_for_its_weights_is_named_before_the_memory_estimate(fx, tmp_path, capsys):
    # hidden_size and num_hidden_layers left out: transformers' defaults (4096, 32 layers) do not fit the weights
    path = _copy(fx, tmp_path, hidden_size=None, num_hidden_layers=None, intermediate_size=None)
    _assert_one_line(path, tmp_path, capsys, "'model.embed_tokens.weight' has shape [2048, 64]",
                     "config.json implies [2048, 4096]", absent=("GiB",))


def test_missing_untied_head_is_named_as_in_the_file(fx, tmp_path, capsys):
    from safetensors.torch import load_file, save_file
    path = _copy(fx, tmp_path)
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["lm_head.weight"]
    save_file(tensors, str(path / "model.safetensors"))
    _assert_one_line(path, tmp_path, capsys, "lack tensor 'lm_head.weight'", absent=("model.lm_head",))


def _dangling(p):
    p.unlink()
    p.symlink_to(p.parent / "gone.safetensors")


def _looping(p):
    p.unlink()
    p.symlink_to(p)


def _directory(p):
    p.unlink()
    p.mkdir()


BROKEN_WEIGHTS = {"dangling symlink": (_dangling, "broken symlink"), "looping symlink": (_looping, "symlink loop"),
                  "directory": (_directory, "a directory")}


@pytest.mark.parametrize("case", list(BROKEN_WEIGHTS))
def test_broken_weights_file_is_named_with_its_problem(fx, tmp_path, capsys, case):
    damage, problem = BROKEN_WEIGHTS[case]
    path = _copy(fx, tmp_path)
    damage(path / "model.safetensors")
    _assert_one_line(path, tmp_path, capsys, f"{path / 'model.safetensors'}:", problem, absent=("no weights found",))


def test_our_own_checkpoint_is_pointed_at_export_build(tmp_path, capsys):
    from pathlib import Path
    ours = Path(__file__).resolve().parents[2] / "models" / "zoo" / "baseline"
    _assert_one_line(ours, tmp_path, capsys, "already a checkpoint", f"export.build --checkpoint {ours}",
                     absent=("model_type",))
