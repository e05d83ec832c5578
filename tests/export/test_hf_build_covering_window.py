"""Issue 42 item 1 through export.build: Gemma 3 whose sliding window covers the cache.

`export.build --fuse --genai --checkpoint HF` of a tiny Gemma 3 with sliding_window >= max_position_embeddings
(the window is dropped: the build's capacity is max_position_embeddings): the built graph (ONNX Runtime's
GroupQueryAttention rewrite, graph_passes/ort_attention.py) and the GenAI folder are compared with
transformers' own forward and `generate`, not with our torch model (which the build verifies against, and
which shared the bug: the local layers rotated with the global base).
"""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.hf_models import hf_model, save_hf
from tests.runtime.greedy import compare_greedy

ROOT = Path(__file__).resolve().parents[2]
ATOL = 1e-4         # fp32 graph vs transformers' fp32 forward (the 2026 families' bound, tests/models/test_convert.py)
PROMPT = [5, 17, 42, 99, 7, 250, 3]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma3_window")
    hf = hf_model("gemma3", sliding_window=64)     # max_position_embeddings 64: the window covers the cache
    hf.generation_config.eos_token_id = None
    folder = save_hf(hf, root / "hf", tokenizer=True)
    out = root / "build"
    cmd = [sys.executable, "-m", "export.build", "--fuse", "--genai", "--checkpoint", str(folder), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([PROMPT]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                          output_logits=True, return_dict_in_generate=True)
    return out, ref.sequences[0, len(PROMPT):].tolist(), [row[0].numpy() for row in ref.logits], proc.stdout


def test_built_graph_equals_transformers(built):
    from runtime.generate import GenerationConfig, generate
    from runtime.ort_session import OrtSession
    out, ref_tokens, ref_logits, _ = built
    with OrtSession(out / "model.fused.onnx") as session:
        got = generate(session, [PROMPT], GenerationConfig(max_new_tokens=NEW_TOKENS, keep_logits=True))
    rows = [row[0] for row in got.logits]
    assert compare_greedy(ref_tokens, ref_logits, got.tokens[0], rows) == NEW_TOKENS
    # the prefill's last row and every cached step's, against transformers' own
    worst = max(float(np.abs(a - b).max()) for a, b in zip(rows, ref_logits))
    assert worst <= ATOL, worst


def test_build_checked_itself_against_transformers(built):
    """The build's own transformers_vs_ours check (export/transformers_check.py) ran and passed."""
    out, _, _, stdout = built
    assert any(line.startswith("  transformers_vs_ours max |d logits| ") for line in stdout.splitlines()), stdout
    found = json.loads((out / "report.json").read_text())["transformers_vs_ours"]
    assert found["logits_max_abs_diff"] <= ATOL


def test_genai_greedy_equals_transformers_generate(built):
    try:
        import onnxruntime_genai  # noqa: F401
    except ImportError as e:
        pytest.skip(f"onnxruntime-genai does not import here ({e})")
    from tests.export.test_genai import genai_greedy
    out, ref_tokens, ref_logits, _ = built
    theirs = genai_greedy(out, PROMPT, NEW_TOKENS)
    assert compare_greedy(ref_tokens, ref_logits, theirs) == NEW_TOKENS, (ref_tokens, theirs)
