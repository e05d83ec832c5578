"""Token shards: a corpus tokenized once into memory-mapped files, for data larger than memory.

    python -m train.shards SOURCE --out DIR [--tokenizer tokenizer.json] [--shard-tokens N]
    python -m train ... --data SOURCE [--shards DIR]      # builds DIR on first use, reuses it after
                                                          # (default DIR: SOURCE_NAME.tokens beside --out)

SOURCE: a .txt / .jsonl / .parquet file, a folder of them, or a folder written by `datasets`'
save_to_disk (train.corpus.iter_source_stories streams its stories). The stories are split
by index exactly as the in-memory corpus is (train.corpus.split_stories: every 20th story
validation, the next one calibration, the rest training), each story is tokenized and
followed by <|endoftext|> (train.tokenizer.encode_stories), and each split is written as
one or more shard files, so `--data F` trains on the same token streams, and draws the
same batches, as `--corpus F`.

A shard file `<split>_<nnnnnn>.bin` is nanoGPT / llm.c style: a header, then the tokens.

    header   HEADER_WORDS little-endian int64: MAGIC, VERSION, vocab_size, itemsize, count, 0 ...
    tokens   count ids, uint16 when the tokenizer's vocab fits (<= 65536), else uint32

DIR (core.outputs kind "token-shards") also holds shards.json (the tokenizer's sha256, the
source's fingerprint: every file's path, size and mtime, the split rule, story and token
counts, the shard list) and the tokenizer.json that produced them. A later run with the
same source and tokenizer reuses DIR; one that differs is refused by name (the shards of a
run being resumed are never rebuilt under it).
"""
from __future__ import annotations

from core.lifecycle import guard_startup
guard_startup(__name__)     # before the imports below: a Ctrl-C while they load exits 130 with one line

import argparse
import hashlib
import json
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from core.errors import UserError
from core.outputs import TOKEN_SHARDS, marker_kind, output_dir
from train.corpus import CorpusError, EOS, iter_source_stories, source_files
from train.interrupts import raise_if_interrupted

MAGIC = 20261129
VERSION = 1
HEADER_WORDS = 16                       # 128 bytes of int64
HEADER_BYTES = HEADER_WORDS * 8
META = "shards.json"
TOKENIZER = "tokenizer.json"
DEFAULT_SHARD_TOKENS = 100_000_000      # 200 MB of uint16 per shard, as nanoGPT / llm.c do
SPLIT_EVERY = 20                        # train.corpus.split_stories' rule
SPLITS = ("train", "val", "calib")
ENCODE_BATCH = 1024                     # stories per tokenizer call


class ShardError(UserError):
    """Token shards that cannot be used; one line naming the directory or file."""


# --- reading -----------------------------------------------------------------------------

class TokenStream:
    """One split's tokens as a single sequence over several arrays (memory-mapped shards, or one
    in-memory array): len(), read(start, n) and windows(starts, n) never load more than asked."""

    def __init__(self, arrays: list[np.ndarray]):
        self.arrays = [a for a in arrays if len(a)]
        self.ends = np.cumsum([len(a) for a in self.arrays], dtype=np.int64)

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def read(self, start: int, n: int) -> np.ndarray:
        """Tokens [start, start + n) as int64 (a window may span two shards)."""
        if start < 0 or start + n > len(self):
            raise IndexError(f"tokens [{start}, {start + n}) outside a stream of {len(self)}")
        out, i = [], int(np.searchsorted(self.ends, start, side="right"))
        while n > 0:
            first = start - (int(self.ends[i - 1]) if i else 0)
            part = self.arrays[i][first:first + n]
            out.append(part)
            start, n, i = start + len(part), n - len(part), i + 1
        return np.concatenate(out).astype(np.int64) if len(out) != 1 else out[0].astype(np.int64)

    def windows(self, starts, n: int):
        """torch int64 [len(starts), n]: the windows [s, s + n) for each start."""
        import torch
        return torch.from_numpy(np.stack([self.read(int(s), n) for s in starts]))


@dataclass
class ShardSet:
    directory: Path
    meta: dict
    streams: dict[str, TokenStream]       # split -> its tokens

    def stats(self) -> dict:
        """The data record of train_log.json (the same keys as the in-memory path)."""
        return {"stories": dict(self.meta["stories"]), "tokens": dict(self.meta["tokens"]),
                "tokenizer_vocab": self.meta["vocab_size"], "shards": str(self.directory)}


def _dtype(itemsize: int):
    return {2: np.uint16, 4: np.uint32}.get(itemsize)


def read_shard(path: Path, vocab: int | None = None) -> np.ndarray:
    """One shard file, memory-mapped read-only, after checking its header against its size (and
    against `vocab`, the index's vocabulary size, when given) and every id against that vocabulary."""
    try:
        with open(path, "rb") as f:
            head = np.frombuffer(f.read(HEADER_BYTES), dtype="<i8")
        size = path.stat().st_size
    except OSError as e:
        raise ShardError(f"token shard {path}: expected a readable file, found {(e.strerror or str(e)).lower()}; "
                         "build the shards again (python -m train.shards)") from None
    if len(head) < HEADER_WORDS or head[0] != MAGIC or head[1] != VERSION:
        raise ShardError(f"token shard {path}: expected a header starting with magic {MAGIC} version {VERSION}, "
                         f"found {head[:2].tolist()}; build the shards again (python -m train.shards)")
    head_vocab, itemsize, count = int(head[2]), int(head[3]), int(head[4])
    dtype = _dtype(itemsize)
    if dtype is None or count < 0 or size != HEADER_BYTES + count * itemsize:
        raise ShardError(f"token shard {path}: header says {count} tokens of {itemsize} bytes, the file has "
                         f"{size - HEADER_BYTES} bytes after the header (truncated?); build the shards again")
    if vocab is not None and head_vocab != vocab:
        raise ShardError(f"token shard {path}: header says a vocabulary of {head_vocab}, {META} says {vocab}; "
                         "build the shards again (python -m train.shards)")
    if count == 0:
        return np.zeros(0, dtype=dtype)
    tokens = np.memmap(path, dtype=dtype, mode="r", offset=HEADER_BYTES, shape=(count,))
    _check_ids(path, tokens, head_vocab)
    return tokens


def _check_ids(path: Path, tokens: np.ndarray, vocab: int) -> None:
    """Every id below `vocab`, so none can index past the embedding; one vectorized pass over the
    memory-mapped file (a read of it, at disk speed), skipped when the dtype cannot hold a larger id."""
    if int(np.iinfo(tokens.dtype).max) < vocab:
        return
    if int(tokens.max()) >= vocab:
        at = int(np.argmax(tokens >= vocab))          # the first bad one
        raise ShardError(f"token shard {path}: holds token id {int(tokens[at])} at token {at}; expected ids below the "
                         f"vocabulary size {vocab} (it was overwritten or damaged after tokenizing); build the "
                         "shards again (python -m train.shards)")


def open_shards(directory: str | Path) -> ShardSet:
    """The shards of `directory`, memory-mapped (nothing is read until a window is asked for)."""
    directory = Path(directory)
    if marker_kind(directory) != TOKEN_SHARDS.name:
        raise ShardError(f"{directory}: expected {TOKEN_SHARDS.what} (written by {TOKEN_SHARDS.writer}), found "
                         f"{'no such directory' if not directory.exists() else 'something else'}; build it with "
                         f"python -m train.shards SOURCE --out {directory}")
    try:
        meta = json.loads((directory / META).read_text())
        files = {split: [(directory / s["file"], int(s["tokens"])) for s in meta["shards"][split]] for split in SPLITS}
        vocab = int(meta["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ShardError(f"{directory / META}: expected the shard index, found an unreadable or incomplete file "
                         f"({type(e).__name__}); build the shards again") from None
    streams = {}
    for split, entries in files.items():
        arrays = []
        for path, expected in entries:
            a = read_shard(path, vocab)
            if len(a) != expected:
                raise ShardError(f"token shard {path}: holds {len(a)} tokens, {META} says {expected}; build the shards again")
            arrays.append(a)
        streams[split] = TokenStream(arrays)
    return ShardSet(directory, meta, streams)


# --- writing -----------------------------------------------------------------------------

def tokenizer_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def source_fingerprint(source: str | Path) -> dict:
    """What the shards were made from: every source file's path (relative), size and mtime."""
    source = Path(source)
    root = source if source.is_dir() else source.parent
    files = []
    for f in source_files(source):
        st = f.stat()
        files.append([str(f.relative_to(root)), st.st_size, st.st_mtime_ns])
    return {"path": str(source.resolve()), "files": files}


class _SplitWriter:
    """Appends a split's tokens to shard files of at most `shard_tokens` tokens each."""

    def __init__(self, directory: Path, split: str, vocab: int, dtype, shard_tokens: int):
        self.directory, self.split, self.vocab, self.dtype = directory, split, vocab, np.dtype(dtype)
        self.shard_tokens = shard_tokens
        self.shards: list[dict] = []
        self.f = None
        self.count = 0

    def _open(self) -> None:
        name = f"{self.split}_{len(self.shards):06d}.bin"
        self.f = open(self.directory / name, "wb")
        self.f.write(self._header(0).tobytes())
        self.shards.append({"file": name, "tokens": 0})
        self.count = 0

    def _header(self, count: int) -> np.ndarray:
        head = np.zeros(HEADER_WORDS, dtype="<i8")
        head[:5] = [MAGIC, VERSION, self.vocab, self.dtype.itemsize, count]
        return head

    def add(self, ids: np.ndarray) -> None:
        while len(ids):
            if self.f is None or self.count == self.shard_tokens:
                self._finish()
                self._open()
            take = ids[:self.shard_tokens - self.count]
            self.f.write(take.astype(self.dtype.newbyteorder("<"), copy=False).tobytes())
            self.count += len(take)
            ids = ids[len(take):]

    def _finish(self) -> None:
        """Write the open shard's final header (its token count) and close it."""
        if self.f is None:
            return
        self.f.seek(0)
        self.f.write(self._header(self.count).tobytes())
        self.f.close()
        self.f = None
        self.shards[-1]["tokens"] = self.count

    def close(self) -> None:
        self._finish()
        if not self.shards:                  # an empty split still gets its (empty) shard
            self._open()
            self._finish()


def _split_of(stories, every: int, what: str):
    """(split, story) pairs with train.corpus.split_stories' rule, streamed: i % every == 0 val, 1 calib.

    split_stories uses min(every, n) for a corpus of n < every stories; the first `every`
    stories are held back until it is known whether there are that many."""
    head = []
    it = iter(stories)
    for s in it:
        head.append(s)
        if len(head) == every:
            break
    if len(head) < 3:
        raise CorpusError(f"corpus {what}: {len(head)} stories; expected at least 3 (train, val and calibration "
                          "each need one)")
    every = min(every, len(head))

    def numbered():
        yield from head
        yield from it
    for i, s in enumerate(numbered()):
        r = i % every
        yield ("val" if r == 0 else "calib" if r == 1 else "train"), s


def build_shards(source: str | Path, out: str | Path, tokenizer_json: str | Path,
                 shard_tokens: int = DEFAULT_SHARD_TOKENS, progress: bool = False) -> ShardSet:
    """Tokenize `source` into token shards at `out` (atomically; replaces only earlier shards)."""
    from train.tokenizer import load_tokenizer
    source, out = Path(source), Path(out)
    tok = load_tokenizer(tokenizer_json)
    eos = tok.token_to_id(EOS)
    if eos is None:
        raise ShardError(f"tokenizer {tokenizer_json}: has no {EOS} token; expected one (it ends every story)")
    vocab = tok.get_vocab_size()
    dtype = np.uint16 if vocab <= 1 << 16 else np.uint32
    fingerprint = source_fingerprint(source)
    stories = {s: 0 for s in SPLITS}
    total = 0
    with output_dir(out, TOKEN_SHARDS, inputs=[source]) as tmp:
        writers = {s: _SplitWriter(tmp, s, vocab, dtype, shard_tokens) for s in SPLITS}
        bar = _bar(progress, source)
        pending: list[tuple[str, str]] = []

        def flush():
            nonlocal total
            for (split, _), enc in zip(pending, tok.encode_batch([s for _, s in pending])):
                writers[split].add(np.asarray(enc.ids + [eos], dtype=np.int64))   # [len(story) + 1]
                stories[split] += 1
                total += len(enc.ids) + 1
            if bar is not None:
                bar.update(len(pending))
                bar.set_postfix_str(f"{total:,} tokens", refresh=False)
            pending.clear()
        try:
            for pair in _split_of(iter_source_stories(source), SPLIT_EVERY, str(source)):
                pending.append(pair)
                if len(pending) == ENCODE_BATCH:
                    raise_if_interrupted()
                    flush()
            flush()
        finally:                # an error or a Ctrl-C prints its line below the bar, not at its end
            if bar is not None:
                bar.close()
        for w in writers.values():
            w.close()
        meta = {"format": VERSION, "tokenizer_sha256": tokenizer_sha256(tokenizer_json), "vocab_size": vocab,
                "eos_id": eos, "dtype": np.dtype(dtype).name, "source": fingerprint,
                "split": {"every": SPLIT_EVERY, "val": 0, "calib": 1, "rest": "train"}, "stories": stories,
                "tokens": {s: sum(x["tokens"] for x in w.shards) for s, w in writers.items()},
                "shards": {s: w.shards for s, w in writers.items()}}
        (tmp / META).write_text(json.dumps(meta, indent=1) + "\n")
        shutil.copyfile(tokenizer_json, tmp / TOKENIZER)
    return open_shards(out)


def _bar(progress: bool, source: Path):
    if not progress:
        return None
    from tqdm import tqdm
    # delay: a corpus refused at once (too few stories) says so in one line, with no bar before it
    return tqdm(desc=f"tokenizing {source.name}", unit=" stories", mininterval=2.0, delay=1.0, file=sys.stderr,
                dynamic_ncols=True)


# --- what a run uses ---------------------------------------------------------------------

def default_shard_dir(source: str | Path, out: str | Path) -> Path:
    """Where `--data SOURCE` keeps its shards unless --shards says otherwise: beside the run
    directory --out (where the run writes anyway; never into the folder of the user's data),
    named after the source, so runs in the same folder share them."""
    return Path(out).parent / (Path(source).resolve().name + ".tokens")


def is_shard_dir(path: str | Path) -> bool:
    return Path(path).is_dir() and marker_kind(Path(path)) == TOKEN_SHARDS.name


def check_shards_match(shards: ShardSet, tokenizer_json: str | Path, source: str | Path | None) -> None:
    """Refuse shards made with another tokenizer, or from another (or a changed) source."""
    d = shards.directory
    if shards.meta.get("tokenizer_sha256") != tokenizer_sha256(tokenizer_json):
        raise ShardError(f"{d}: was tokenized with {d / TOKENIZER}, this run uses {tokenizer_json} (another "
                         f"tokenizer); pass --tokenizer {d / TOKENIZER}, or --shards NEW_DIR to tokenize again")
    if source is not None and shards.meta.get("source") != source_fingerprint(source):
        raise ShardError(f"{d}: was made from {shards.meta.get('source', {}).get('path')} as it was then; "
                         f"--data {source} differs (other files, sizes or times); pass --shards NEW_DIR to "
                         "tokenize it again (or delete the old shards yourself)")


def shards_for(data: str, where: str | Path, tokenizer_json: str | Path, progress: bool) -> ShardSet:
    """The shards a run with --data reads: `data` itself when it is a shard directory, else
    `where` (--shards, or default_shard_dir), built now when it does not exist yet."""
    if is_shard_dir(data):
        s = open_shards(data)
        check_shards_match(s, tokenizer_json, None)
        return s
    where = Path(where)
    if is_shard_dir(where):
        s = open_shards(where)
        check_shards_match(s, tokenizer_json, data)
        return s
    return build_shards(data, where, tokenizer_json, progress=progress)


# --- the command -------------------------------------------------------------------------

def run(argv: list[str]) -> int:
    from core.errors import ArgumentParser, int_in
    from core.outputs import check_output_dir
    from train.tokenizer import DEFAULT_TOKENIZER
    p = ArgumentParser(prog="python -m train.shards", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a .txt / .jsonl / .parquet file, a folder of them, or a datasets save_to_disk folder")
    p.add_argument("--out", required=True, help="the shard directory (new, empty, or earlier shards to replace)")
    p.add_argument("--tokenizer", default=str(DEFAULT_TOKENIZER), help="tokenizer.json (default: the bundled one)")
    p.add_argument("--shard-tokens", type=int_in(1024, 1 << 40), default=DEFAULT_SHARD_TOKENS,
                   help=f"tokens per shard file (default {DEFAULT_SHARD_TOKENS:,})")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    a = p.parse_args(argv)
    if not Path(a.tokenizer).is_file():
        raise ShardError(f"tokenizer {a.tokenizer}: not found; pass an existing tokenizer.json")
    source_files(a.source)                          # a missing or empty source: one line, before writing
    check_output_dir(a.out, TOKEN_SHARDS, inputs=[a.source, a.tokenizer])
    s = build_shards(a.source, a.out, a.tokenizer, a.shard_tokens, progress=not a.quiet)
    n = {k: len(v) for k, v in s.streams.items()}
    files = sum(len(v) for v in s.meta["shards"].values())
    print(f"{a.out}: {sum(s.meta['stories'].values()):,} stories, {n['train']:,} train / {n['val']:,} val / "
          f"{n['calib']:,} calibration tokens ({s.meta['dtype']}) in {files} shard files")
    return 0


def main(argv: list[str] | None = None) -> int:
    from train.interrupts import run_train_cli
    return run_train_cli(run, argv)


if __name__ == "__main__":
    from core.lifecycle import exit_after
    exit_after(main)

