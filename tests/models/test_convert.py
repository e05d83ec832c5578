"""models.convert: Hugging Face folders (built here with transformers, random init) -> our decoder.

Converted logits equal transformers' own forward within 1e-5 (fp32) for every family and
option; every weight layout (one safetensors, shards with an index, pytorch_model.bin) reads;
every bad folder is one line naming the file and what is wrong.
"""
import json
import shutil

import pytest
import torch

from models.convert import HF_DEFAULTS, ConvertError, convert, is_hf_folder, main
from tests.hf_models import FAMILIES, hf_model, save_hf, transformers_classes

ATOL_FP32 = 1e-5   # two fp32 implementations of the same math: only summation order differs (~1e-6 seen)
# the 2026 families (issue 34's bound): their norms compute x * rsqrt(...) * (1 + w) in another order, and
# Gemma's sqrt(d) embedding scale and gains near 2 amplify the rounding (1.3e-5 seen on Gemma's logits of ~9)
ATOL_FAMILIES = 1e-4
OLD_FAMILIES = ("gpt2", "llama", "mistral", "qwen2")


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {name: (hf_model(name), save_hf(hf_model(name), root / name)) for name in FAMILIES}


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits if hasattr(model, "config") else model(ids)


def _hf_cached(hf, ids, prefill: int):
    """transformers' logits over its own KV cache: `prefill` tokens, then one token a call."""
    from export.transformers_check import transformers_cached_logits
    with torch.no_grad():
        return transformers_cached_logits(hf, ids, prefill)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_converted_logits_equal_transformers(folders, name):
    hf, path = folders[name]
    c = convert(path)
    atol = ATOL_FP32 if FAMILIES[name][0] in OLD_FAMILIES else ATOL_FAMILIES
    ids = torch.randint(0, hf.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    ref, got = _logits(hf, ids), _logits(c.model, ids)
    assert ref.abs().max() > 1.0        # a real signal, not near-zero logits of a dead model
    torch.testing.assert_close(got, ref, atol=atol, rtol=0)
    # the KV-cached decode path of the converted model agrees with transformers' own cached path (prefill 10,
    # then one token at a time; the same as the full forward but for longrope past its switch, as in transformers)
    with torch.no_grad():
        cache = c.model.cfg.cache_layout().allocate(2)
        steps, cache = c.model(ids[:, :10], torch.zeros(2, dtype=torch.long), cache)
        out = [steps]
        for t in range(10, 24):
            logits, cache = c.model(ids[:, t:t + 1], torch.full((2,), t), cache)
            out.append(logits)
    torch.testing.assert_close(torch.cat(out, 1), _hf_cached(hf, ids, 10), atol=atol, rtol=0)


def _our_greedy(model, prompt: list[int], n: int):
    """Greedy tokens (and the logits each was picked from) of our decoder over its KV cache."""
    with torch.no_grad():
        cache = model.cfg.cache_layout().allocate(1)
        logits, cache = model(torch.tensor([prompt]), torch.zeros(1, dtype=torch.long), cache)
        tokens, rows = [], []
        for t in range(n):
            row = logits[0, -1]
            tokens.append(int(row.argmax()))
            rows.append(row.numpy())
            logits, cache = model(torch.tensor([[tokens[-1]]]), torch.tensor([len(prompt) + t]), cache)
    return tokens, rows


@pytest.mark.parametrize("name", [n for n, (kind, _) in FAMILIES.items() if kind not in OLD_FAMILIES])
def test_greedy_tokens_equal_transformers_generate(folders, name):
    """40 tokens from a 7-token prompt, past every sliding window (7). longrope: up to its switch (16), where
    transformers' Phi-3 generate recomputes the whole cache with the long factors; our KV cache keeps the keys
    it wrote (a documented limit, said at conversion), so the streams may part after it."""
    from tests.runtime.greedy import compare_greedy
    hf, path = folders[name]
    prompt = [5, 17, 42, 99, 7, 250, 3]
    c = convert(path)
    n = 40
    if c.model.cfg.rope_scaling and c.model.cfg.rope_scaling["rope_type"] == "longrope":
        n = c.model.cfg.rope_scaling["original_max_position_embeddings"] - len(prompt) + 1
        assert any("longrope" in note for note in c.notes), c.notes
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=0)
    ref = out.sequences[0, len(prompt):].tolist()
    ours, rows = _our_greedy(c.model, prompt, n)
    assert compare_greedy(ref, [l[0].numpy() for l in out.logits], ours, rows) >= 0.75 * n


def test_what_each_family_becomes(folders):
    cfg = {name: convert(path).model.cfg for name, (_, path) in folders.items()}
    assert (cfg["gpt2"].norm, cfg["gpt2"].pos_embedding, cfg["gpt2"].act, cfg["gpt2"].tie_embeddings) == \
        ("layernorm", "learned", "gelu_new", True)
    assert cfg["gpt2-fakeln"].eps == 1e12
    assert (cfg["gpt2-untied"].mlp_hidden, cfg["gpt2-untied"].act, cfg["gpt2-untied"].tie_embeddings) == (40, "gelu", False)
    assert (cfg["llama"].norm, cfg["llama"].pos_embedding, cfg["llama"].kv_heads, cfg["llama"].qkv_bias) == \
        ("rmsnorm", "rope", 2, False)
    assert (cfg["qwen2"].qkv_bias, cfg["qwen2"].out_bias, cfg["qwen2"].mlp_bias) == (True, False, False)
    assert (cfg["mistral"].kv_heads, cfg["mistral"].head_dim, cfg["mistral"].cache_layout().shape(1)) == \
        (1, 16, (1, 1, 64, 16))
    assert cfg["llama-bias-llama3"].rope_scaling["rope_type"] == "llama3"
    # the 2026 families: what each feature maps to
    q3, yarn = cfg["qwen3"], cfg["qwen3-yarn-sliding"]
    assert (q3.qk_norm, q3.norm_layout, q3.head_dim, q3.d_model, q3.tie_embeddings, q3.qkv_bias) == \
        ("head", "pre", 16, 32, True, False)
    assert (yarn.rope_scaling["rope_type"], yarn.sliding_window, yarn.sliding_layers) == ("yarn", 7, [1, 2])
    g1, g2, g3 = cfg["gemma"], cfg["gemma2"], cfg["gemma3"]
    assert (g1.embed_scale, g1.act, g1.kv_heads, g1.norm_layout) == (32 ** 0.5, "gelu_new", 1, "pre")
    assert (g2.norm_layout, g2.attn_scale, g2.attn_softcap, g2.final_softcap, g2.sliding_layers) == \
        ("sandwich", 24 ** -0.5, 5.0, 8.0, [0, 2])
    assert (g3.norm_layout, g3.qk_norm, g3.sliding_layers, g3.local_rope_theta, g3.rope_theta,
            g3.rope_scaling["rope_type"], g3.attn_softcap) == ("sandwich", "head", [0, 1], 10.0, 1000.0, "linear", None)
    assert (cfg["phi3"].rotary_dim, cfg["phi3"].head_dim, cfg["phi3-longrope"].rope_scaling["rope_type"]) == \
        (4, 8, "longrope")
    assert (cfg["olmo2"].norm_layout, cfg["olmo2"].qk_norm, cfg["olmo2"].norm_width("blocks.0.attn.k_norm")) == \
        ("post", "proj", 16)
    assert cfg["smollm3"].nope_layers == [1, 3]
    gr = cfg["granite"]
    assert (gr.embed_scale, gr.attn_scale, gr.residual_scale, gr.logits_divisor) == (2.0, 0.3, 0.5, 4.0)


@pytest.mark.parametrize("model_type", sorted(HF_DEFAULTS))
def test_defaults_table_matches_transformers(model_type):
    """A config.json may leave defaults out: ours must be transformers' own."""
    config_cls, _ = transformers_classes(model_type)
    theirs = config_cls()
    table = HF_DEFAULTS[model_type]
    derived = {"num_key_value_heads": table.get("num_attention_heads"),          # None means "as many as heads"
               "head_dim": table.get("hidden_size", 1) // table.get("num_attention_heads", 1)}
    for key, ours in table.items():
        if ours is None and key in derived and getattr(theirs, key) is not None:
            ours = derived[key]
        if model_type == "gemma3_text" and key in ("rope_theta", "rope_local_base_freq"):   # per layer type
            value = theirs.rope_parameters["full_attention" if key == "rope_theta" else "sliding_attention"]["rope_theta"]
        elif key == "rope_theta" and not hasattr(theirs, "rope_theta"):
            value = theirs.rope_parameters["rope_theta"]
        elif key == "sliding_window" and model_type in ("qwen2", "qwen3"):    # set (to its default) only when in use
            value = config_cls(use_sliding_window=True).sliding_window
        elif key == "sliding_window_pattern":
            value = theirs._sliding_window_pattern
        else:
            value = getattr(theirs, key)
        assert value == ours, (model_type, key, value, ours)


def test_sharded_safetensors_and_pytorch_bin_read_the_same(folders, tmp_path):
    hf, path = folders["qwen2"]
    ref = convert(path).model.state_dict()
    sharded = save_hf(hf, tmp_path / "sharded", max_shard_size="20KB")
    assert len(list(sharded.glob("model-*.safetensors"))) > 2 and (sharded / "model.safetensors.index.json").is_file()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    shutil.copy(path / "config.json", bin_dir)
    torch.save(hf.state_dict(), bin_dir / "pytorch_model.bin")
    bin_sharded = tmp_path / "bin_sharded"          # pytorch_model-0000i-of-00002.bin with their index
    bin_sharded.mkdir()
    shutil.copy(path / "config.json", bin_sharded)
    state, names = hf.state_dict(), sorted(hf.state_dict())
    halves = {f"pytorch_model-0000{i + 1}-of-00002.bin": names[i::2] for i in range(2)}
    for file, part in halves.items():
        torch.save({k: state[k] for k in part}, bin_sharded / file)
    (bin_sharded / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: f for f, part in halves.items() for k in part}}))
    for folder in (sharded, bin_dir, bin_sharded):
        got = convert(folder).model.state_dict()
        assert got.keys() == ref.keys()
        assert all(torch.equal(got[k], ref[k]) for k in ref), folder


def test_half_precision_weights_are_read_into_fp32(folders, tmp_path):
    import copy
    hf, _ = folders["gpt2"]
    half = save_hf(copy.deepcopy(hf).to(torch.bfloat16), tmp_path / "bf16")
    got = convert(half).model
    assert all(p.dtype == torch.float32 for p in got.parameters())
    ref = hf.state_dict()["transformer.h.0.attn.c_proj.weight"].to(torch.bfloat16).float().t()
    assert torch.equal(got.blocks[0].attn.out_proj.weight, ref)


def test_cli_writes_a_checkpoint_that_loads_with_or_without_tokenizer(folders, tmp_path, capsys):
    from models.checkpoint import load_checkpoint
    hf, path = folders["llama"]
    assert main([str(path), "--out", str(tmp_path / "ck")]) == 0
    captured = capsys.readouterr()
    assert "without tokenizer.json" in captured.out and "generation needs a tokenizer" in captured.err
    raw = json.loads((tmp_path / "ck" / "config.json").read_text())
    assert raw["format"] == 3 and raw["has_tokenizer"] is False and not (tmp_path / "ck" / "tokenizer.json").exists()
    ids = torch.randint(0, 320, (1, 9))
    torch.testing.assert_close(_logits(load_checkpoint(tmp_path / "ck"), ids), _logits(hf, ids), atol=ATOL_FP32, rtol=0)
    with_tok = save_hf(hf, tmp_path / "with_tok", tokenizer=True)
    assert main([str(with_tok), "--out", str(tmp_path / "ck2"), "--max-seq-len", "40"]) == 0
    assert (tmp_path / "ck2" / "tokenizer.json").read_bytes() == (with_tok / "tokenizer.json").read_bytes()
    assert load_checkpoint(tmp_path / "ck2").cfg.max_seq_len == 40
    assert is_hf_folder(path) and not is_hf_folder(tmp_path / "ck")


def _edit_config(path, **changes):
    raw = json.loads((path / "config.json").read_text())
    raw.update(changes)
    (path / "config.json").write_text(json.dumps(raw))


def _mismatched_shard(path):
    from safetensors.torch import load_file, save_file
    shard = sorted(path.glob("model-*.safetensors"))[-1]
    tensors = load_file(str(shard))
    name = sorted(tensors)[0]
    tensors[name] = torch.zeros(3, 5)
    save_file(tensors, str(shard))


BAD = {
    "unsupported model type": (lambda p: _edit_config(p, model_type="bert"),
                               "model_type 'bert' is not supported; supported: gpt2, llama, mistral, qwen2, qwen3, "
                               "gemma, gemma2, gemma3_text, phi3, olmo2, smollm3, granite"),
    # what stays out of the families: mixture-of-experts and the multimodal Gemma 3
    "model_type not a string": (lambda p: _edit_config(p, model_type=[]), "model_type [] is not supported; supported:"),
    "qwen3 mixture of experts": (lambda p: _edit_config(p, model_type="qwen3_moe"),
                                 "model_type 'qwen3_moe' is not supported (a mixture-of-experts model; the converter "
                                 "takes dense decoders only); supported:"),
    "multimodal gemma 3": (lambda p: _edit_config(p, model_type="gemma3"),
                           "model_type 'gemma3' is not supported (the multimodal Gemma 3; its text decoder alone is "
                           "supported: a folder whose config.json has model_type gemma3_text"),
    "no weights": (lambda p: (p / "model.safetensors").unlink(), "no weights found; expected model.safetensors"),
    "missing shard": ("sharded", lambda p: sorted(p.glob("model-*.safetensors"))[0].unlink(), "missing; model.safetensors.index.json lists it"),
    "shape mismatch in a shard": ("sharded", _mismatched_shard, "has shape [3, 5]; config.json implies"),
    "config disagrees with weights": (lambda p: _edit_config(p, intermediate_size=64), "config.json implies [64, 32]"),
    "unsupported rope type": (lambda p: _edit_config(p, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4}),
                              "rope type 'dynamic' (supported: default, linear, llama3, yarn, longrope)"),
    "unsupported activation": (lambda p: _edit_config(p, hidden_act="gelu_fast"), "hidden_act 'gelu_fast'"),
    "corrupt bin": (lambda p: ((p / "model.safetensors").unlink(), (p / "pytorch_model.bin").write_bytes(b"\x80junk")),
                    "not a readable PyTorch weights file"),
    "extra tensor": (lambda p: _add_tensor(p), "has no place in the llama layout"),
    "config not json": (lambda p: (p / "config.json").write_text("{"), "expected a readable JSON file"),
    # found by the property test below: listing 2**40 layers' norms took every byte of memory (OOM kill)
    "absurd layer count": (lambda p: _edit_config(p, num_hidden_layers=2**40), "at most 4,096 layers"),
}


def _add_tensor(path):
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(path / "model.safetensors"))
    tensors["model.layers.0.self_attn.q_norm.weight"] = torch.ones(8)
    save_file(tensors, str(path / "model.safetensors"))


@pytest.mark.parametrize("case", list(BAD))
def test_bad_folder_one_line_nothing_written(folders, tmp_path, case, capsys):
    spec = BAD[case]
    layout, damage, needle = spec if len(spec) == 3 else ("single", *spec)
    hf, _ = folders["llama"]
    path = save_hf(hf, tmp_path / "hf", **({"max_shard_size": "20KB"} if layout == "sharded" else {}))
    damage(path)
    with pytest.raises(ConvertError, match=None) as e:
        convert(path)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert main([str(path), "--out", str(tmp_path / "ck")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and needle in err, err
    assert not (tmp_path / "ck").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


JSON_VALUES = [None, True, False, 0, -3, 1, 7, 2**40, 1.5, -0.5, float("nan"), "", "x", "silu", [], [1], {}, {"a": 1},
               {"rope_type": "linear"}, {"rope_type": "llama3", "factor": "x"}]


@pytest.mark.parametrize("name", ["gpt2", "qwen2"])
def test_any_config_value_converts_or_gives_one_line(folders, tmp_path, name):
    """Property: whatever one config key holds, convert succeeds or raises ConvertError (never a traceback)."""
    from hypothesis import HealthCheck, given, settings, strategies as st
    from core.errors import UserError
    _, path = folders[name]
    keys = sorted(json.loads((path / "config.json").read_text()))
    work = tmp_path / "hf"
    shutil.copytree(path, work)
    original = (path / "config.json").read_text()

    @settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(keys + ["rope_scaling", "partial_rotary_factor", "sliding_window"]),
           st.sampled_from(JSON_VALUES))
    def check(key, value):
        raw = json.loads(original)
        raw[key] = value
        (work / "config.json").write_text(json.dumps(raw))
        try:
            convert(work)
        except UserError as e:
            assert "\n" not in str(e)
    check()
