"""The shipped corpus generator, the committed tokenizer, and the loaders for local files and TinyStories."""
import builtins
import hashlib
import json

import pytest

from train.corpus import (EOS, CorpusError, generate_stories, load_corpus, load_text_file, load_tinystories,
                          split_stories)
from train.tokenizer import DEFAULT_TOKENIZER, encode_stories, load_tokenizer, train_tokenizer


def test_generator_is_deterministic_and_story_like():
    a, b = generate_stories(50, seed=3), generate_stories(50, seed=3)
    assert a == b
    assert generate_stories(50, seed=4) != a
    assert len(set(a)) == 50
    assert all(s[0].isupper() and s.rstrip().endswith((".", "!", "\"")) for s in a)
    assert 200 < sum(map(len, a)) / 50 < 3000
    # pinned: the committed tokenizer and the zoo were built from this stream; a change to the
    # generator must come with a new tokenizer.json and retrained zoo checkpoints
    digest = hashlib.sha256("\n".join(generate_stories(20, seed=1234)).encode()).hexdigest()[:16]
    assert digest == "8a495daa9a9d8412"


def test_committed_tokenizer_is_what_train_tokenizer_builds():
    from train.corpus import DEFAULT_GENERATED_STORIES
    rebuilt = train_tokenizer(generate_stories(DEFAULT_GENERATED_STORIES))
    assert json.loads(rebuilt.to_str()) == json.loads(DEFAULT_TOKENIZER.read_text())


def test_committed_tokenizer_round_trips_and_fits_the_model_vocab():
    tok = load_tokenizer(DEFAULT_TOKENIZER)
    assert 256 < tok.get_vocab_size() <= 2048
    assert tok.token_to_id(EOS) is not None
    text = generate_stories(3, seed=99)
    for s in text:
        assert tok.decode(tok.encode(s).ids) == s
    ids = encode_stories(tok, text)
    assert ids.count(tok.token_to_id(EOS)) == 3 and ids[-1] == tok.token_to_id(EOS)
    assert len(ids) < sum(map(len, text)) / 2.5       # BPE actually merges (~4 chars per token)
    assert tok.decode(tok.encode("Zebras éclair 123!").ids) == "Zebras éclair 123!"  # byte-level: any text


def test_tokenizer_training_is_reproducible():
    s = generate_stories(100, seed=5)
    a, b = train_tokenizer(s, 400), train_tokenizer(s, 400)
    assert a.to_str() == b.to_str()


def test_split_is_deterministic_and_disjoint():
    s = [f"story {i}" for i in range(100)]
    sp = split_stories(s)
    assert sp["val"] == [f"story {i}" for i in range(0, 100, 20)]
    assert sp["calib"] == [f"story {i}" for i in range(1, 100, 20)]
    assert len(sp["train"]) == 90 and not set(sp["train"]) & (set(sp["val"]) | set(sp["calib"]))
    with pytest.raises(CorpusError):
        split_stories(["one", "two"])


def test_local_txt_file_blank_lines_and_eos(tmp_path):
    p = tmp_path / "s.txt"
    p.write_text("First story.\nStill first.\n\nSecond story.\n\n\n")
    assert load_text_file(p) == ["First story.\nStill first.", "Second story."]
    p.write_text(f"One.{EOS}\n\nTwo.\n{EOS}Three.")
    assert load_text_file(p) == ["One.", "Two.", "Three."]
    assert load_corpus(str(p), limit=2) == ["One.", "Two."]


def test_local_jsonl_file_tinystories_layout(tmp_path):
    p = tmp_path / "s.jsonl"
    p.write_text(json.dumps({"text": "Once upon a time."}) + "\n\n" + json.dumps({"text": " Tom ran. ", "id": 2}) + "\n")
    assert load_text_file(p) == ["Once upon a time.", "Tom ran."]
    p.write_text('{"story": "no text field"}\n')
    with pytest.raises(CorpusError, match="line 1 has no string field 'text'"):
        load_text_file(p)
    p.write_text("not json\n")
    with pytest.raises(CorpusError, match="line 1 is not JSON"):
        load_text_file(p)


def test_missing_and_empty_files_are_one_line_errors(tmp_path):
    with pytest.raises(CorpusError, match="not found"):
        load_corpus(str(tmp_path / "nope.txt"))
    (tmp_path / "empty.txt").write_text("\n\n")
    with pytest.raises(CorpusError, match="holds no text"):
        load_text_file(tmp_path / "empty.txt")


def test_tinystories_without_datasets_says_how_to_install(monkeypatch):
    real_import = builtins.__import__

    def no_datasets(name, *a, **k):
        if name == "datasets":
            raise ImportError("no datasets")
        return real_import(name, *a, **k)
    monkeypatch.setattr(builtins, "__import__", no_datasets)
    with pytest.raises(CorpusError, match=r"tapernorm-deploy\[hf\]"):
        load_corpus("hf:roneneldan/TinyStories")


def test_tinystories_through_datasets_api(monkeypatch):
    # the real code path, with datasets.load_dataset replaced by a local stand-in (tests never download)
    import sys
    import types
    calls = {}

    class FakeDS:
        def __init__(self, rows):
            self.rows = rows

        def __len__(self):
            return len(self.rows)

        def select(self, idx):
            return FakeDS([self.rows[i] for i in idx])

        def __getitem__(self, key):
            assert key == "text"
            return [r["text"] for r in self.rows]

    def load_dataset(name, split):
        calls["args"] = (name, split)
        return FakeDS([{"text": "Lily ran. "}, {"text": ""}, {"text": "Tom sat."}, {"text": "Max hid."}])
    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    assert load_tinystories("train", limit=3) == ["Lily ran.", "Tom sat."]
    assert calls["args"] == ("roneneldan/TinyStories", "train")
    assert load_corpus("hf:roneneldan/TinyStories") == ["Lily ran.", "Tom sat.", "Max hid."]
