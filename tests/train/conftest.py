import pytest
import torch

import train.loop as loop
from train.config import TrainConfig


@pytest.fixture(autouse=True)
def _one_thread():
    # the machine is shared and has 2 cores; tiny shapes are faster on one thread anyway
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def pretrained_layernorm(out, steps: int):
    """A 2-layer LayerNorm (GPT-2 architecture) model pretrained for `steps` steps into `out`:
    the source model of the train.finetune tests."""
    loop.train(TrainConfig(preset="layernorm", out=str(out), steps=steps, eval_every=steps, batch_size=4, seq_len=16,
                           eval_batches=1, calib_batches=1, corpus_stories=200, progress=False, threads=1,
                           model=dict(d_model=16, n_layer=2, n_head=2, max_seq_len=32)))
    return out
