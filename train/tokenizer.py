"""The byte-level BPE tokenizer (vocab 2048) trained on the shipped corpus.

train/data/tokenizer.json is committed; it was produced by

    python -m train.tokenizer --out train/data/tokenizer.json

(deterministic: the generated corpus with its default seed, `tokenizers` BPE).
"""
from __future__ import annotations

from core.lifecycle import guard_startup
guard_startup(__name__)     # before the imports below: a Ctrl-C while they load exits 130 with one line

import argparse
import sys
from pathlib import Path

from train.corpus import DEFAULT_GENERATED_STORIES, EOS, generate_stories
from train.errors import TrainError

DEFAULT_TOKENIZER = Path(__file__).resolve().parent / "data" / "tokenizer.json"    # the shipped one
DEFAULT_VOCAB = 2048
ENCODE_CHUNK = 512      # stories per tokenizer call


def train_tokenizer(stories, vocab_size: int = DEFAULT_VOCAB):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[EOS], show_progress=False)
    tok.train_from_iterator(stories, trainer)
    return tok


def load_tokenizer(path: str | Path = DEFAULT_TOKENIZER):
    """A tokenizers.Tokenizer from a tokenizer.json; TrainError (one line) for a missing or unreadable file."""
    from tokenizers import Tokenizer
    from core.errors import first_line
    path = Path(path)
    if not path.is_file():
        raise TrainError(f"tokenizer {path}: not found; pass an existing tokenizer.json "
                         f"(build one with python -m train.tokenizer --out {path})")
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # tokenizers raises a plain Exception for a file that is not a tokenizer
        raise TrainError(f"tokenizer {path}: expected a tokenizers tokenizer.json, found an unreadable file "
                         f"({first_line(e)[:120]}); pass the tokenizer.json the model uses") from None


def encode_stories(tok, stories: list[str]) -> list[int]:
    """One token stream: each story followed by <|endoftext|>."""
    eos = tok.token_to_id(EOS)
    if eos is None:
        raise ValueError(f"tokenizer has no {EOS} token; train it with train.tokenizer")
    from train.interrupts import raise_if_interrupted
    out: list[int] = []
    for i in range(0, len(stories), ENCODE_CHUNK):     # in chunks: a Ctrl-C is seen between them
        raise_if_interrupted()
        for enc in tok.encode_batch(stories[i:i + ENCODE_CHUNK]):
            out.extend(enc.ids)
            out.append(eos)
    return out


def run(argv: list[str]) -> int:
    from core.errors import ArgumentParser, int_in
    from core.outputs import TOKENIZER, output_file
    p = ArgumentParser(prog="python -m train.tokenizer", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True,
                   help=f"tokenizer.json to write (a new file; the shipped one is {DEFAULT_TOKENIZER})")
    p.add_argument("--vocab-size", type=int_in(256 + 1, 1_000_000), default=DEFAULT_VOCAB)
    p.add_argument("--stories", type=int_in(10, 10_000_000), default=DEFAULT_GENERATED_STORIES)
    a = p.parse_args(argv)
    from core.outputs import check_output_file
    check_output_file(a.out, TOKENIZER)
    tok = train_tokenizer(generate_stories(a.stories), a.vocab_size)
    with output_file(a.out, TOKENIZER) as tmp:
        tok.save(str(tmp))
    print(f"wrote {a.out} (vocab {tok.get_vocab_size()})")
    return 0


def main(argv=None) -> int:
    from core.lifecycle import run_cli
    return run_cli(run, argv)


if __name__ == "__main__":
    from core.lifecycle import exit_after
    exit_after(main)
