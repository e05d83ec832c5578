"""Token shards whose ids do not fit the vocabulary (tokens overwritten after tokenizing) are refused when
they are opened, with one line naming the shard file, the id and the vocabulary size; never an IndexError
from the embedding in the middle of a run."""
import json

import numpy as np
import pytest

from tests.cli.conftest import cli
from train.tokenizer import DEFAULT_TOKENIZER
from train.corpus import generate_stories
from train.shards import HEADER_BYTES, ShardError, build_shards, open_shards

SHARD_TOKENS = 2048
RUN = ["--preset", "baseline", "--steps", "2", "--eval-every", "2", "--batch-size", "2", "--seq-len", "16",
       "--eval-batches", "1", "--calib-batches", "1", "--d-model", "16", "--n-layer", "1", "--n-head", "2",
       "--max-seq-len", "32", "--quiet", "--threads", "1"]


@pytest.fixture
def shards(tmp_path):
    src = tmp_path / "s.jsonl"
    src.write_text("".join(json.dumps({"text": s}) + "\n" for s in generate_stories(150, seed=11)))
    s = build_shards(src, tmp_path / "tok", DEFAULT_TOKENIZER, shard_tokens=SHARD_TOKENS)
    assert len(s.meta["shards"]["train"]) > 2
    return s


def _overwrite_token(shard, index: int, value: int, dtype=np.uint16):
    data = bytearray(shard.read_bytes())
    at = HEADER_BYTES + index * np.dtype(dtype).itemsize
    data[at:at + np.dtype(dtype).itemsize] = np.array([value], dtype=dtype).tobytes()
    shard.write_bytes(bytes(data))


def test_python_m_train_refuses_an_id_beyond_the_vocabulary_in_one_line(shards, tmp_path):
    shard = shards.directory / "val_000000.bin"          # read by the evaluation at step 0
    _overwrite_token(shard, 3, 65535)
    r = cli("train", [*RUN, "--data", shards.directory, "--out", tmp_path / "run"])
    assert r.code == 1 and len(r.error_lines) == 1 and "Traceback" not in r.err, r.err
    line = r.error_lines[0]
    vocab = shards.meta["vocab_size"]
    assert str(shard) in line and "65535" in line and f"vocabulary size {vocab}" in line, line
    assert "python -m train.shards" in line
    assert not (tmp_path / "run").exists()


def test_the_first_id_past_the_tokenizer_is_refused_and_the_last_one_is_not(shards):
    vocab = shards.meta["vocab_size"]
    shard = shards.directory / "val_000000.bin"
    _overwrite_token(shard, 0, vocab - 1)
    open_shards(shards.directory)
    _overwrite_token(shard, 5, vocab)
    with pytest.raises(ShardError, match=rf"val_000000.bin: holds token id {vocab} at token 5; expected ids "
                                         rf"below the vocabulary size {vocab}"):
        open_shards(shards.directory)


def test_a_header_whose_vocabulary_differs_from_the_index_is_refused(shards):
    shard = shards.directory / "calib_000000.bin"
    data = bytearray(shard.read_bytes())
    data[16:24] = np.array([1 << 20], dtype="<i8").tobytes()      # header word 2: the vocabulary size
    shard.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=rf"calib_000000.bin: header says a vocabulary of {1 << 20}, shards.json "
                                         rf"says {shards.meta['vocab_size']}"):
        open_shards(shards.directory)
