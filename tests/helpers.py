"""Small in-code fixtures shared by the tests: random-weight checkpoints and a tiny tokenizer."""
from __future__ import annotations

from pathlib import Path

import torch

from models.checkpoint import save_checkpoint
from models.decoder import Decoder, DecoderConfig

_TEXT = [
    "Once upon a time there was a little cat named Tom.",
    "Tom liked to play in the garden with his red ball.",
    "One day the sun was warm and the birds sang in the tall tree.",
    "Lily saw a big dog and she smiled. They were happy friends.",
]


def tiny_tokenizer_json(path: Path, vocab_size: int = 300) -> Path:
    """A byte-level BPE tokenizer trained on a few sentences; writes tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>"], show_progress=False)
    tok.train_from_iterator(_TEXT * 4, trainer)
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


def random_model(seed: int = 0, gate: float | None = None, randomize_norms: bool = True, **overrides) -> Decoder:
    """A Decoder with random weights; norm gains/biases and taper c are randomized too,
    so that a fold that ignores them cannot pass a numerical test."""
    base = dict(vocab_size=320, d_model=32, n_layer=2, n_head=4, max_seq_len=32)
    base.update(overrides)
    cfg = DecoderConfig(**base)
    torch.manual_seed(seed)
    model = Decoder(cfg)
    if randomize_norms:
        with torch.no_grad():
            for name, p in model.named_parameters():
                module = name.rsplit(".", 2)[-2] if name.count(".") else ""
                if "ln_" in name or module.endswith("_norm"):     # ln_1, ln_2, ln_f, q_norm, post_attn_norm, ...
                    p.copy_(torch.randn_like(p) * 0.2 + (1.0 if "weight" in name else 0.0))
                    if name.endswith("alpha"):
                        p.fill_(0.7)
        for i, layer in enumerate(model.taper_layers().values()):
            layer.c = 0.5 + 0.1 * i
    if gate is not None:
        model.set_gate(gate)
    return model.eval()


def write_checkpoint(dirpath: Path, model: Decoder) -> Path:
    tok = tiny_tokenizer_json(dirpath.parent / f".{dirpath.name}.tokenizer.json")
    return save_checkpoint(model, dirpath, tok)


def project_sources(root: Path) -> list[tuple[Path, str]]:
    """(path, its posix path under root) of the project's own .py files outside tests/, sorted: none under a
    hidden folder (.git, .venv) or a virtual environment (a folder holding pyvenv.cfg: the venv/ that .gitignore
    expects beside the code), which hold other projects' code."""
    import os
    found = []
    for dirpath, dirs, files in os.walk(root):
        here = Path(dirpath)
        dirs[:] = [d for d in dirs if not d.startswith(".") and not (here / d / "pyvenv.cfg").exists()
                   and not (here == root and d == "tests")]
        found += [(here / f, (here / f).relative_to(root).as_posix()) for f in files if f.endswith(".py")]
    return sorted(found, key=lambda pair: pair[1])


def snapshot(root: Path) -> dict[str, object]:
    """Every path under root (hidden ones too) -> file bytes, 'dir' or the link target: byte-for-byte comparisons."""
    import os
    out: dict[str, object] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                out[rel] = "dir"
            else:
                out[rel] = p.read_bytes()
    return out


def default_sigint():
    """preexec_fn for a child that must react to Ctrl-C as under a terminal: a shell starts
    background jobs with SIGINT ignored, and Python then never installs its handler (nor
    dies by SIGINT), which would hide exactly what the interrupt tests check."""
    import signal
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
