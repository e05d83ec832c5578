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
