"""Acceptance on the trained zoo: 64 greedy tokens from ORT on the fused build equal torch on the checkpoint.

Each zoo checkpoint is built into a temporary directory with
`python -m export.build --fuse` (export_onnx where export.build does not exist yet)
and generated from with both backends, through the API (logits kept, so ties can be
told apart) and through the CLI (the text a user sees).

Ties, explicitly: where the torch top-2 logits of a step are within TIE_GAP
(tests/runtime/greedy.py), either token is correct and the two streams may diverge
from there; comparison of that prompt stops at the tie, and its CLI texts are then
compared only up to the tie's token. Anything else must match exactly.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.runtime.conftest import REPO, has_export_build, make_build
from tests.runtime.greedy import compare_greedy

ZOO = Path(os.environ.get("TAPERNORM_ZOO", REPO / "models" / "zoo"))
NAMES = ["baseline", "internal-taper", "all-taper", "dyt"]
PROMPTS = ["Once upon a time", "Tom liked to play in the garden", "One day", "Lily saw a big dog and she"]
NEW_TOKENS = 64


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_zoo_ort_fused_build_equals_torch_checkpoint(name, tmp_path):
    ckpt = ZOO / name
    if not (ckpt / "config.json").is_file():
        pytest.skip(f"zoo model {name!r} is absent ({ckpt}/config.json not found; the zoo is trained by train/)")
    from runtime.generate import GenerationConfig, generate
    from runtime.model_files import load_tokenizer, resolve_onnx
    from runtime.ort_session import OrtSession
    from runtime.torch_session import TorchSession
    from tests.runtime.test_cli import cli

    build = make_build(ckpt, tmp_path / name)
    onnx = resolve_onnx(build)
    if has_export_build():
        assert onnx.name == "model.fused.onnx", f"export.build --fuse left no fused graph in {build}"
    tok = load_tokenizer(build)
    prompts = [tok.encode(p).ids for p in PROMPTS]
    cfg = GenerationConfig(max_new_tokens=NEW_TOKENS, keep_logits=True)   # no stop tokens: all 64
    with TorchSession(ckpt) as t, OrtSession(build) as o:
        rt, ro = generate(t, prompts, cfg), generate(o, prompts, cfg)
        # the batch of 4 prompts of different lengths gives each prompt's tokens when run alone
        for session, batch in ((t, rt), (o, ro)):
            for b, prompt in enumerate(prompts):
                alone = generate(session, [prompt], cfg)
                compare_greedy(alone.tokens[0], [l[0] for l in alone.logits], batch.tokens[b], [l[b] for l in batch.logits])
    compared = [compare_greedy(rt.tokens[b], [l[b] for l in rt.logits], ro.tokens[b], [l[b] for l in ro.logits])
                for b in range(len(prompts))]
    # the CLI prints the same text (up to a tie, where there is one); one prompt keeps the test short
    common = ["--prompt", PROMPTS[0], "--max-new-tokens", str(NEW_TOKENS), "--ignore-eos"]
    co, ct = cli("--model", build, "--backend", "ort", *common), cli("--model", ckpt, "--backend", "torch", *common)
    assert co.returncode == 0 and ct.returncode == 0, co.stderr + ct.stderr
    if compared[0] == NEW_TOKENS:
        assert co.stdout == ct.stdout
    else:
        upto = tok.decode(rt.tokens[0][:compared[0]])
        assert co.stdout.startswith(upto) and ct.stdout.startswith(upto)
    print(f"{name}: {onnx.name}, tokens compared per prompt {compared} of {NEW_TOKENS}")


@pytest.mark.slow
def test_fused_build_of_a_random_norm_free_checkpoint_equals_torch(tmp_path):
    """The same check without the zoo: a random all-taper model at gate 0 through export.build --fuse."""
    from runtime.generate import GenerationConfig, generate
    from runtime.model_files import resolve_onnx
    from runtime.ort_session import OrtSession
    from runtime.torch_session import TorchSession
    from tests.helpers import random_model, write_checkpoint
    model = random_model(seed=5, norm="taper", taper_scope="all", gate=0.0, d_model=64, max_seq_len=96)
    ckpt = write_checkpoint(tmp_path / "all-taper", model)
    build = make_build(ckpt, tmp_path / "build")
    if has_export_build():
        assert resolve_onnx(build).name == "model.fused.onnx"
    prompts = [[5, 17, 42], [7, 99, 3, 250, 11, 64, 8], [200], [31, 41, 59, 26, 53]]
    cfg = GenerationConfig(max_new_tokens=NEW_TOKENS, keep_logits=True)
    with TorchSession(ckpt) as t, OrtSession(build) as o:
        rt, ro = generate(t, prompts, cfg), generate(o, prompts, cfg)
    for b in range(len(prompts)):
        compare_greedy(rt.tokens[b], [l[b] for l in rt.logits], ro.tokens[b], [l[b] for l in ro.logits])
