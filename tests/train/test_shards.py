"""--data: token shards from a local jsonl / text / parquet file and a `datasets` folder, memory-mapped,
give the same token streams, batches and weights as the in-memory --corpus path."""
import json

import numpy as np
import pytest
import torch

from train.config import TrainConfig
from train.corpus import CorpusError, generate_stories
from train.errors import TrainError
from train.loop import _sample, prepare_data, train
from train.shards import (HEADER_BYTES, META, ShardError, TokenStream, build_shards, default_shard_dir, open_shards,
                          read_shard)
from train.tokenizer import DEFAULT_TOKENIZER

TINY = dict(size="tiny", batch_size=4, seq_len=16, eval_every=2, eval_batches=2, calib_batches=1, progress=False,
            threads=1, model=dict(d_model=16, n_layer=2, n_head=2, max_seq_len=32))
SHARD_TOKENS = 2048        # several train shards, so that windows span shard boundaries


@pytest.fixture(scope="module")
def stories():
    return generate_stories(150, seed=11)


@pytest.fixture(scope="module")
def sources(tmp_path_factory, stories):
    """The same stories as a jsonl file, a text file, a parquet file and a datasets save_to_disk folder."""
    root = tmp_path_factory.mktemp("sources")
    (root / "s.jsonl").write_text("".join(json.dumps({"text": s}) + "\n" for s in stories))
    (root / "s.txt").write_text("\n\n".join(stories) + "\n")
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"text": stories, "id": list(range(len(stories)))})
    ds.to_parquet(str(root / "s.parquet"))
    ds.save_to_disk(str(root / "ds"))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(root / "dsdict"))
    return root


def _data(run_kw, tmp_path):
    run = TrainConfig(**{**TINY, "preset": "baseline", "out": str(tmp_path / "run"), **run_kw}).resolve()
    return prepare_data(run, tmp_path)


@pytest.mark.parametrize("source", ["s.jsonl", "s.txt", "s.parquet", "ds", "dsdict"])
def test_shards_read_back_memory_mapped_equal_the_in_memory_path(tmp_path, sources, source):
    shards = build_shards(sources / source, tmp_path / "tok", DEFAULT_TOKENIZER, shard_tokens=SHARD_TOKENS)
    assert len(shards.meta["shards"]["train"]) > 3                      # really several files
    assert all(isinstance(a, np.memmap) for a in shards.streams["train"].arrays)
    mem = _data({"corpus": str(sources / "s.jsonl")}, tmp_path)
    mapped = _data({"data": str(sources / source), "shards": str(tmp_path / "tok")}, tmp_path)
    assert np.array_equal(mapped.train.read(0, len(mapped.train)), mem.train.read(0, len(mem.train)))
    assert torch.equal(mapped.val, mem.val) and torch.equal(mapped.calib, mem.calib)
    assert {k: v for k, v in mapped.stats.items() if k != "shards"} == mem.stats
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    for _ in range(20):                                                 # batches of the training loop
        assert torch.equal(_sample(mapped.train, 8, 16, g1), _sample(mem.train, 8, 16, g2))


def test_training_on_shards_gives_the_weights_of_training_in_memory(tmp_path, sources):
    a = train(TrainConfig(**{**TINY, "preset": "internal-taper", "out": str(tmp_path / "a"), "steps": 4,
                             "corpus": str(sources / "s.jsonl")}))
    b = train(TrainConfig(**{**TINY, "preset": "internal-taper", "out": str(tmp_path / "b"), "steps": 4,
                             "data": str(sources / "s.jsonl")}))
    from safetensors.torch import load_file
    wa, wb = load_file(str(tmp_path / "a" / "model.safetensors")), load_file(str(tmp_path / "b" / "model.safetensors"))
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    assert [e["val_loss"] for e in a["evals"]] == [e["val_loss"] for e in b["evals"]]
    assert b["data"]["shards"] == str(tmp_path / "s.jsonl.tokens")       # default: beside --out


def test_shards_are_built_once_and_reused(tmp_path, sources, monkeypatch):
    kw = {"data": str(sources / "s.jsonl"), "shards": str(tmp_path / "tok")}
    _data(kw, tmp_path)
    stamp = (tmp_path / "tok" / META).stat().st_mtime_ns
    import train.shards
    monkeypatch.setattr(train.shards, "build_shards", lambda *a, **k: pytest.fail("rebuilt"))
    _data(kw, tmp_path)                                                 # reused
    _data({"data": str(tmp_path / "tok")}, tmp_path)                   # the shard directory itself as --data
    assert (tmp_path / "tok" / META).stat().st_mtime_ns == stamp


def test_shards_of_another_tokenizer_or_a_changed_source_are_refused(tmp_path, sources):
    src = tmp_path / "mine.jsonl"
    src.write_bytes((sources / "s.jsonl").read_bytes())
    kw = {"data": str(src), "shards": str(tmp_path / "tok")}
    _data(kw, tmp_path)
    from tests.helpers import tiny_tokenizer_json
    other = tiny_tokenizer_json(tmp_path / "other" / "tokenizer.json")
    with pytest.raises(ShardError, match="another tokenizer"):
        _data({**kw, "tokenizer": str(other)}, tmp_path)
    with src.open("a") as f:
        f.write(json.dumps({"text": "One more story."}) + "\n")
    with pytest.raises(ShardError, match="differs"):
        _data(kw, tmp_path)


def test_a_damaged_shard_is_one_line(tmp_path, sources):
    build_shards(sources / "s.jsonl", tmp_path / "tok", DEFAULT_TOKENIZER, shard_tokens=SHARD_TOKENS)
    shard = tmp_path / "tok" / "train_000001.bin"
    assert read_shard(shard).shape == (SHARD_TOKENS,)
    shard.write_bytes(shard.read_bytes()[:HEADER_BYTES + 100])
    with pytest.raises(ShardError, match=r"train_000001.bin: header says 2048 tokens of 2 bytes, the file has 100"):
        open_shards(tmp_path / "tok")
    shard.write_bytes(b"\0" * 200)
    with pytest.raises(ShardError, match="expected a header starting with magic"):
        open_shards(tmp_path / "tok")


def test_token_stream_windows_span_shards():
    parts = [np.arange(0, 5, dtype=np.uint16), np.arange(5, 7, dtype=np.uint16), np.arange(7, 20, dtype=np.uint16)]
    s = TokenStream(parts)
    assert len(s) == 20 and s.read(3, 6).tolist() == [3, 4, 5, 6, 7, 8] and s.read(0, 20).tolist() == list(range(20))
    assert s.windows([0, 4, 14], 6).tolist() == [list(range(i, i + 6)) for i in (0, 4, 14)]
    with pytest.raises(IndexError):
        s.read(18, 3)


def test_a_short_corpus_splits_as_the_in_memory_path(tmp_path):
    # fewer than 20 stories: split_stories uses every = n, which streaming learns by holding the first 20 back
    src = tmp_path / "few.txt"
    src.write_text("\n\n".join(generate_stories(12, seed=3)))
    s = build_shards(src, tmp_path / "tok", DEFAULT_TOKENIZER)
    assert s.meta["stories"] == {"train": 10, "val": 1, "calib": 1}
    src.write_text("One.\n\nTwo.")
    with pytest.raises(CorpusError, match="2 stories; expected at least 3"):
        build_shards(src, tmp_path / "tok2", DEFAULT_TOKENIZER)


def test_datasets_folder_without_train_split_or_text_column(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_dict({"story": ["a", "b", "c"]})
    ds.save_to_disk(str(tmp_path / "notext"))
    with pytest.raises(CorpusError, match=r"has columns \['story'\]; expected a 'text' column"):
        build_shards(tmp_path / "notext", tmp_path / "t1", DEFAULT_TOKENIZER)
    datasets.DatasetDict({"validation": ds}).save_to_disk(str(tmp_path / "nosplit"))
    with pytest.raises(CorpusError, match=r"splits \['validation'\]; expected a 'train' split"):
        build_shards(tmp_path / "nosplit", tmp_path / "t2", DEFAULT_TOKENIZER)
    assert not (tmp_path / "t1").exists() and not (tmp_path / "t2").exists()


def test_data_settings_that_cannot_work_are_one_line(tmp_path, sources):
    base = {**TINY, "preset": "baseline", "out": str(tmp_path / "run")}
    for kw, needle in [({"data": str(tmp_path / "nope")}, "not found"),
                       ({"data": str(sources / "s.jsonl"), "corpus": str(sources / "s.txt")}, "expected one source"),
                       ({"data": str(sources / "s.jsonl"), "tokenizer": "train"}, "tokenized once"),
                       ({"shards": str(tmp_path / "tok")}, "only applies with --data"),
                       ({"data": str(sources / "s.jsonl"), "shards": str(tmp_path / "run" / "tok")}, "inside --out")]:
        with pytest.raises(TrainError, match=needle):
            TrainConfig(**{**base, **kw}).resolve()
    assert default_shard_dir(sources / "s.jsonl", tmp_path / "runs" / "a") == tmp_path / "runs" / "s.jsonl.tokens"
