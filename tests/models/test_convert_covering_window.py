"""Issue 42 item 1: Gemma 3 whose sliding window covers the KV cache (window >= capacity).

The converter drops such a window (it masks nothing: plain causal attention), but the local layers
keep their own rope base (rope_local_base_freq): the base of a layer is its layer type's, never the
mask's. Compared with transformers' own forward (not our torch model, which shared the bug):
prefill and KV-cached decode logits within ATOL (fp32; the 2026 families' bound of
tests/models/test_convert.py), through models.convert and through a saved checkpoint.
"""
import json

import pytest
import torch

from models.checkpoint import load_checkpoint, save_checkpoint
from models.convert import convert
from tests.hf_models import hf_model, our_cached_logits, save_hf

ATOL = 1e-4     # fp32; Gemma's sqrt(d) embedding scale and gains near 2 amplify rounding (1e-5 seen)


# (config changes, --max-seq-len): the window equal to max_position_embeddings (export.build --checkpoint HF),
# past it, and a window shorter than the model's length but >= --max-seq-len (models.convert --max-seq-len)
CASES = {"window-equals-max-positions": (dict(sliding_window=64), None),
         "window-past-max-positions": (dict(sliding_window=100), None),
         "capacity-under-window": (dict(sliding_window=24), 20),
         # the shipped form: rope_local_base_freq and rope_theta at the top level, no scaling
         "flat-config-capacity-at-window": (dict(sliding_window=16, rope_parameters=None, rope_theta=1e6,
                                                 rope_local_base_freq=10.0), 16)}


@pytest.mark.parametrize("case", list(CASES))
def test_local_layers_keep_their_rope_base_when_the_window_is_dropped(tmp_path, case):
    changes, max_seq_len = CASES[case]
    hf = hf_model("gemma3", **changes)
    folder = save_hf(hf, tmp_path / "hf")
    c = convert(folder, max_seq_len)
    cfg = c.model.cfg
    n = cfg.max_seq_len
    ids = torch.randint(0, hf.config.vocab_size, (2, n), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    assert ref.abs().max() > 1.0
    torch.testing.assert_close(c.model(ids).detach(), ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(our_cached_logits(c.model, ids, n // 2), ref, atol=ATOL, rtol=0)
    assert cfg.sliding_layers == [] and cfg.sliding_window is None              # the mask is dropped ...
    assert cfg.local_rope_layers == [0, 1] and cfg.local_rope_theta == 10.0     # ... the local base is not
    # runtime.generate --backend torch and train read the saved checkpoint: the same logits
    save_checkpoint(c.model, tmp_path / "ckpt", None, inputs=[folder])
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["local_rope_layers"] == [0, 1]
    with torch.no_grad():
        torch.testing.assert_close(load_checkpoint(tmp_path / "ckpt")(ids), ref, atol=ATOL, rtol=0)


def test_a_checkpoint_without_local_rope_layers_means_the_sliding_layers(tmp_path):
    """Format-3 checkpoints written before the field: the sliding layers are the local ones, as they were."""
    hf = hf_model("gemma3")     # window 7 < capacity 64: the mask stays
    c = convert(save_hf(hf, tmp_path / "hf"))
    save_checkpoint(c.model, tmp_path / "ckpt", None, inputs=[tmp_path / "hf"])
    where = tmp_path / "ckpt" / "config.json"
    raw = json.loads(where.read_text())
    assert raw["sliding_layers"] == [0, 1]
    del raw["local_rope_layers"]
    where.write_text(json.dumps(raw))
    model = load_checkpoint(tmp_path / "ckpt")
    assert model.cfg.local_rope_layers is None and [model.cfg.rope_kind(i) for i in range(3)] == \
        ["local", "local", "global"]
    ids = torch.randint(0, hf.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), hf(ids).logits, atol=ATOL, rtol=0)
