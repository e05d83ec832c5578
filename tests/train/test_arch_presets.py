"""Every preset trains on every architecture (issue 42: --preset dyt, whose embed_std redraws the embedding
tables, raised "Decoder has no attribute 'wpe'" on the rope architectures, which have no position table)."""
import pytest

from train.loop import TrainConfig, train
from train.presets import ARCHS, architecture

TINY = dict(size="tiny", batch_size=2, seq_len=16, eval_every=1, eval_batches=1, calib_batches=1,
            corpus_stories=100, progress=False)


@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "gpt2"])
def test_the_dyt_preset_redraws_the_embedding_of_a_rope_architecture(tmp_path, arch):
    import torch
    from train.loop import Recipe
    model = dict(d_model=16, n_layer=1, n_head=2, max_seq_len=32, **architecture(arch, 16, 1, 2))
    run = TrainConfig(**TINY, preset="dyt", out=str(tmp_path / arch), steps=1, model=model).resolve()
    assert run.embed_std == 0.2
    m = Recipe().initial_model(run, fresh=True)
    assert not hasattr(m, "wpe") and abs(float(m.wte.weight.std()) - 0.2) < 0.02       # drawn at embed_std
    log = train(run)
    assert [e["step"] for e in log["evals"]] == [0, 1] and torch.isfinite(torch.tensor(log["evals"][-1]["val_loss"]))
