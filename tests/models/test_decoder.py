"""The KV-cached decode path equals a full uncached forward, for every norm kind."""
import pytest
import torch

from tests.helpers import random_model

ATOL_FP32 = 1e-5  # cached vs uncached in fp32: only summation order differs

CONFIGS = {
    "rmsnorm": dict(norm="rmsnorm"),
    "layernorm": dict(norm="layernorm"),
    "dyt": dict(norm="dyt"),
    "taper-internal-g0.3": dict(norm="taper", taper_scope="internal", gate=0.3),
    "taper-internal-g0": dict(norm="taper", taper_scope="internal", gate=0.0),
    "taper-all-g0": dict(norm="taper", taper_scope="all", gate=0.0),
    "taper-all-ln-affine-g0.5": dict(norm="taper", taper_scope="all", taper_base="ln", taper_affine=True, gate=0.5),
    "rmsnorm-swiglu-untied": dict(norm="rmsnorm", mlp="swiglu", tie_embeddings=False),
    "noanchor": dict(norm="taper", taper_scope="all", final_norm=False, gate=0.0),
    # the Hugging Face families' options (format 2)
    "llama-like-gqa": dict(norm="rmsnorm", mlp="swiglu", pos_embedding="rope", n_kv_head=2, qkv_bias=False,
                           out_bias=False, mlp_bias=False, mlp_hidden=40, tie_embeddings=False),
    "rope-partial-mqa-linear": dict(pos_embedding="rope", rotary_dim=4, n_kv_head=1, head_size=16,
                                    rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "gpt2-erf-gelu-layer-eps": dict(norm="layernorm", activation="gelu", layer_eps={"blocks.0.ln_1": 1e3}),
}


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_plus_decode_equals_full_forward(name, batch):
    model = random_model(**CONFIGS[name])
    torch.manual_seed(1)
    ids = torch.randint(0, model.cfg.vocab_size, (batch, 12))
    with torch.no_grad():
        full = model(ids)
        cache = model.cfg.cache_layout().allocate(batch)
        logits, cache = model(ids[:, :7], torch.zeros(batch, dtype=torch.long), cache)
        steps = [logits]
        for t in range(7, 12):
            logits, cache = model(ids[:, t:t + 1], torch.full((batch,), t), cache)
            steps.append(logits)
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=ATOL_FP32, rtol=0)


def test_sequences_at_different_positions_in_one_batch():
    model = random_model(norm="taper", taper_scope="internal", gate=0.0)
    torch.manual_seed(2)
    a, b = torch.randint(0, 320, (1, 9)), torch.randint(0, 320, (1, 5))
    with torch.no_grad():
        cache = model.cfg.cache_layout().allocate(2)
        # right-pad b; its padded slots are masked and overwritten later
        ids = torch.cat([a, torch.cat([b, torch.zeros(1, 4, dtype=torch.long)], 1)])
        prefill, cache = model(ids, torch.zeros(2, dtype=torch.long), cache)
        nxt = torch.tensor([[11], [12]])
        step, cache = model(nxt, torch.tensor([9, 5]), cache)
        ref_a = model(torch.cat([a, nxt[:1]], 1))
        ref_b = model(torch.cat([b, nxt[1:]], 1))
    torch.testing.assert_close(prefill[0], ref_a[0, :9], atol=ATOL_FP32, rtol=0)
    torch.testing.assert_close(prefill[1, :5], ref_b[0, :5], atol=ATOL_FP32, rtol=0)
    torch.testing.assert_close(step[0, 0], ref_a[0, -1], atol=ATOL_FP32, rtol=0)
    torch.testing.assert_close(step[1, 0], ref_b[0, -1], atol=ATOL_FP32, rtol=0)


def test_cache_is_written_in_place():
    model = random_model()
    cache = model.cfg.cache_layout().allocate(2)
    ptr = cache[0][0].data_ptr()
    with torch.no_grad():
        _, new = model(torch.ones(2, 3, dtype=torch.long), torch.tensor([0, 4]), cache)
    assert new[0][0].data_ptr() == ptr
    assert new[0][0][0, :, :3].abs().sum() > 0 and new[0][0][0, :, 3:].abs().sum() == 0
    assert new[0][0][1, :, 4:7].abs().sum() > 0 and new[0][0][1, :, :4].abs().sum() == 0


def test_config_rejects_bad_shapes():
    with pytest.raises(ValueError, match="n_head"):
        random_model(d_model=30, n_head=4)
    with pytest.raises(ValueError, match="taper_scope"):
        random_model(norm="taper")


def test_grouped_query_cache_holds_only_the_kv_heads():
    model = random_model(pos_embedding="rope", n_kv_head=2)
    assert model.cfg.cache_layout().shape(3) == (3, 2, 32, 8)
    assert model.blocks[0].attn.k_proj.weight.shape == (16, 32) and model.blocks[0].attn.q_proj.weight.shape == (32, 32)


def test_grouped_query_attention_equals_repeated_kv_heads():
    """GQA with n_kv_head = 2 is MHA whose k/v heads are each used by 2 query heads (HF repeat_kv)."""
    gqa = random_model(seed=4, pos_embedding="rope", n_kv_head=2)
    mha = random_model(seed=4, pos_embedding="rope")
    state = dict(gqa.state_dict())
    for i in range(2):
        for proj in ("k_proj", "v_proj"):
            w = state[f"blocks.{i}.attn.{proj}.weight"].view(2, 8, 32)           # [kv heads, D, d]
            b = state[f"blocks.{i}.attn.{proj}.bias"].view(2, 8)
            state[f"blocks.{i}.attn.{proj}.weight"] = w.repeat_interleave(2, dim=0).reshape(32, 32)
            state[f"blocks.{i}.attn.{proj}.bias"] = b.repeat_interleave(2, dim=0).reshape(32)
    mha.load_state_dict(state)
    ids = torch.randint(0, 320, (2, 10))
    with torch.no_grad():
        torch.testing.assert_close(gqa(ids), mha(ids), atol=ATOL_FP32, rtol=0)


def test_partial_rotary_matches_transformers_on_the_rotated_dims():
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    from models.decoder import DecoderConfig, apply_rope, rotary_embeddings
    cfg = DecoderConfig(d_model=64, n_head=4, pos_embedding="rope", rotary_dim=6, rope_theta=500.0)
    hf_cfg = transformers.LlamaConfig(hidden_size=24, num_attention_heads=4, head_dim=6,
                                      rope_parameters={"rope_type": "default", "rope_theta": 500.0})
    pos = torch.arange(7)[None].expand(2, 7)
    x = torch.randn(2, 4, 7, 16)                                          # [B, H, T, D]
    ours = apply_rope(x, *rotary_embeddings(cfg)["global"](pos))
    cos, sin = LlamaRotaryEmbedding(hf_cfg)(x, pos)
    theirs, _ = apply_rotary_pos_emb(x[..., :6], x[..., :6], cos, sin)
    torch.testing.assert_close(ours[..., :6], theirs, atol=1e-6, rtol=0)
    assert torch.equal(ours[..., 6:], x[..., 6:])


@pytest.mark.parametrize("field, value, needle", [
    ("n_kv_head", 3, "n_kv_head"), ("pos_embedding", "alibi", "pos_embedding"), ("activation", "tanh", "activation"),
    ("rotary_dim", 5, "rotary_dim"), ("rope_scaling", {"rope_type": "yarn"}, "rope_scaling"),
    ("layer_eps", {"blocks.9.ln_1": 1.0}, "layer_eps"), ("mlp_hidden", 0, "mlp_hidden"), ("qkv_bias", 1, "qkv_bias"),
])
def test_config_rejects_bad_format_2_fields(field, value, needle):
    extra = {"pos_embedding": "rope"} if field in ("rotary_dim", "rope_scaling") else {}
    with pytest.raises(ValueError, match=needle):
        random_model(**{**extra, field: value})


def test_rope_model_runs_in_fp16_with_float32_angles():
    """export.build --dtype fp16 runs the reference in fp16: the rotary angles stay float32 (as in HF)."""
    import copy
    model = random_model(pos_embedding="rope", n_kv_head=2, max_seq_len=32)
    half = copy.deepcopy(model).to(torch.float16)
    ids = torch.randint(0, 320, (2, 30))
    with torch.no_grad():
        ref, got = model(ids), half(ids)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.float(), ref, atol=2e-2, rtol=0)
