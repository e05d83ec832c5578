"""export.build --fuse --genai: the folder ONNX Runtime GenAI loads as it is (export/genai.py).

Checked with GenAI's own API: og.Model on the build folder, og.Generator greedy for a fixed
number of tokens, against runtime.generate on the same build's graph (our contract, our loop);
the two must pick the same tokens (ties handled as in tests/runtime/greedy.py). Every norm kind
of the zoo, a converted HF Llama and an LN-free GPT-2 and the 2026 families, fp32 and int4; the
default run covers each of those features once, the rest is slow.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.runtime.greedy import compare_greedy

ROOT = Path(__file__).resolve().parents[2]
ZOO = Path(os.environ.get("TAPERNORM_ZOO", ROOT / "models" / "zoo"))
NEW_TOKENS = 24
PROMPT = "Once upon a time there was a little girl"


def _og():
    try:
        import onnxruntime_genai as og
    except ImportError as e:
        pytest.skip(f"onnxruntime-genai does not import here ({e}); pip install '.[genai]'")
    return og


def _source(name: str, tmp: Path) -> Path:
    """A zoo checkpoint (skipped where absent) or a tiny HF folder with a tokenizer."""
    kind, what = name.split(":")
    if kind == "zoo":
        ckpt = ZOO / what
        if not (ckpt / "config.json").is_file():
            pytest.skip(f"zoo model {what!r} is absent ({ckpt})")
        return ckpt
    from tests.hf_models import hf_model, save_hf
    # ONNX Runtime's GroupQueryAttention rotates heads of a multiple of 16: the tiny Llama's 8 doubled
    changes = dict(hidden_size=64) if what.startswith("llama") else {}
    return save_hf(hf_model(what, **changes), tmp / what, tokenizer=True)


def _build(ckpt: Path, out: Path, *flags: str) -> dict:
    cmd = [sys.executable, "-m", "export.build", "--fuse", "--genai", *flags, "--checkpoint", str(ckpt), "--out", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return json.loads((out / "report.json").read_text())


def ours_greedy(graph: Path, prompt: list[int], n: int) -> tuple[list[int], list[np.ndarray]]:
    """runtime.generate's greedy loop on our graph: the tokens and the logits each was picked from."""
    from runtime.generate import GenerationConfig, generate
    from runtime.ort_session import OrtSession
    with OrtSession(graph) as session:
        result = generate(session, [prompt], GenerationConfig(max_new_tokens=n, keep_logits=True))
    return result.tokens[0], [row[0] for row in result.logits]


def genai_greedy(folder: Path, prompt: list[int], n: int) -> list[int]:
    """GenAI's own loop on the folder: append the prompt, then exactly n greedy tokens (no early stop)."""
    og = _og()
    model = og.Model(str(folder))
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + n, min_length=len(prompt) + n, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.asarray(prompt, np.int32))
    while not gen.is_done():
        gen.generate_next_token()
    return [int(t) for t in gen.get_sequence(0)][len(prompt):]


def genai_batch_greedy(folder: Path, texts: list[str], n: int) -> list[list[int]]:
    """GenAI's own loop on prompts it pads itself (og.Tokenizer.encode_batch: right padding, attention_mask
    0 there), at most n greedy tokens a row: each row's new tokens (a finished row's end is eos, then pad)."""
    og = _og()
    model = og.Model(str(folder))
    tok = og.Tokenizer(model)
    padded = max(len(tok.encode(t)) for t in texts)
    params = og.GeneratorParams(model)
    params.set_search_options(max_length=padded + n, do_sample=False, batch_size=len(texts))
    gen = og.Generator(model, params)
    gen.append_tokens(tok.encode_batch(texts))
    while not gen.is_done():
        gen.generate_next_token()
    return [[int(t) for t in gen.get_sequence(i)][padded:] for i in range(len(texts))]


CASES = [
    # (source, --quantize or None): each of fp32 / int4, zoo / HF once by default. An int4 graph is checked
    # against its own dequantized weights (export/quant_reference.py), so a random-init HF model quantizes too.
    # (zoo:internal-taper int4: test_genai_folder_layout_and_tokenizer and the batch test)
    ("zoo:dyt", None),
    ("hf:llama", "int4"),
    ("hf:gpt2-fakeln", None),
    # the 2026 families (GenAI's generic decoder type: positions, norms and head are inside our graph):
    # Gemma 3's live QK-norms (kept on q and k), sandwich norms, sliding windows and local rope base
    ("hf:gemma3", "int4"),
    pytest.param("hf:qwen3", None, marks=pytest.mark.slow),
    pytest.param("hf:gemma2", None, marks=pytest.mark.slow),         # soft-caps
    pytest.param("hf:qwen3-yarn-sliding", "int4", marks=pytest.mark.slow),
    pytest.param("zoo:baseline", None, marks=pytest.mark.slow),          # RMSNorm
    pytest.param("zoo:baseline", "int4", marks=pytest.mark.slow),
    pytest.param("zoo:all-taper", None, marks=pytest.mark.slow),
    pytest.param("zoo:all-taper", "int4", marks=pytest.mark.slow),
    pytest.param("zoo:internal-taper", None, marks=pytest.mark.slow),
    pytest.param("zoo:dyt", "int4", marks=pytest.mark.slow),
    pytest.param("hf:llama", None, marks=pytest.mark.slow),
    pytest.param("hf:gpt2-fakeln", "int4", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("name,quantize", CASES)
def test_genai_greedy_equals_runtime_generate(tmp_path, name, quantize):
    _og()
    ckpt = _source(name, tmp_path)
    out = tmp_path / "build"
    report = _build(ckpt, out, *(["--quantize", quantize] if quantize else []))
    graph = out / (f"model.{quantize}.onnx" if quantize else "model.fused.onnx")
    assert report["graph"] == graph.name and report["genai"]["from"] == graph.name and report["attention"] == "gqa"
    assert report["genai"]["logits_max_abs_diff"] <= report["genai"]["atol"]
    config = json.loads((out / "genai_config.json").read_text())
    assert config["model"]["decoder"]["filename"] == "model.genai.onnx"
    assert config["search"]["past_present_share_buffer"] is True
    from models.checkpoint import load_tokenizer
    prompt = load_tokenizer(out).encode(PROMPT).ids
    ours, logits = ours_greedy(graph, prompt, NEW_TOKENS)
    theirs = genai_greedy(out, prompt, NEW_TOKENS)
    assert compare_greedy(ours, logits, theirs) >= NEW_TOKENS // 2, (ours, theirs)


@pytest.fixture(scope="module")
def taper_int4(tmp_path_factory):
    """The zoo's TaperNorm model built --fuse --genai --quantize int4 (once for the two tests below)."""
    _og()
    root = tmp_path_factory.mktemp("genai")
    out = root / "build"
    report = _build(_source("zoo:internal-taper", root), out, "--quantize", "int4")
    return out, report


def test_genai_folder_layout_and_tokenizer(taper_int4):
    """What GenAI's builder writes for a Llama (I/O names and dims, config keys), and og.Tokenizer
    reading our tokenizer gives the ids ours gives; the GenAI graph shares the build's weights file;
    GenAI's greedy tokens on it are runtime.generate's (the zoo's TaperNorm model, int4)."""
    og = _og()
    import onnx
    out, report = taper_int4
    assert report["graph"] == "model.int4.onnx" and not (out / "model.fused.onnx").exists()
    proto = onnx.load(str(out / "model.genai.onnx"), load_external_data=False)
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in (*proto.graph.input, *proto.graph.output)}
    assert list(dims)[:3] == ["input_ids", "attention_mask", "past_key_values.0.key"]
    assert dims["attention_mask"] == ["batch_size", "total_sequence_length"]
    assert dims["past_key_values.3.value"] == ["batch_size", 4, "past_sequence_length", 32]
    assert dims["present.0.key"] == ["batch_size", 4, "total_sequence_length", 32]
    assert dims["logits"] == ["batch_size", "sequence_length", 2048]
    assert "position" not in dims
    locations = {e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"}
    assert locations == {"model.int4.onnx.data"} and not (out / "model.genai.onnx.data").exists()
    decoder = json.loads((out / "genai_config.json").read_text())["model"]["decoder"]
    assert (decoder["num_hidden_layers"], decoder["num_key_value_heads"], decoder["head_size"]) == (4, 4, 32)
    from models.checkpoint import load_tokenizer
    tok = og.Tokenizer(og.Model(str(out)))
    prompt = load_tokenizer(out).encode(PROMPT).ids
    assert [int(i) for i in tok.encode(PROMPT)] == prompt
    ours, logits = ours_greedy(out / "model.int4.onnx", prompt, NEW_TOKENS)
    assert compare_greedy(ours, logits, genai_greedy(out, prompt, NEW_TOKENS)) >= NEW_TOKENS // 2


@pytest.mark.parametrize("flags,expected", [
    (["--genai"], "--genai: expected --fuse too"),
    (["--genai", "--fuse", "--attention", "plain"], "--genai: expected --attention gqa"),
    (["--genai", "--fuse", "--dtype", "fp16"], "--genai: expected --dtype fp32"),
])
def test_genai_refuses_what_it_cannot_build(tmp_path, flags, expected):
    proc = subprocess.run([sys.executable, "-m", "export.build", *flags, "--out", str(tmp_path / "o")],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(f"error: {expected}"), proc.stderr
    assert not (tmp_path / "o").exists()


def test_genai_graph_refuses_a_graph_without_group_query_attention():
    from export.genai import GenAIError, genai_graph
    from tests.export.oracle import export_onnx
    from tests.helpers import random_model
    proto = export_onnx(random_model(norm="rmsnorm"), None, "fp32", attention="fused")
    with pytest.raises(GenAIError, match=r"expected every cache read and written by GroupQueryAttention"):
        genai_graph(proto, "model.fused.onnx")


def test_genai_batch_of_different_lengths_equals_batch_1(taper_int4):
    """A batch GenAI pads itself (prompts of 4, 9 and 10 tokens, right-padded) picks, row by row, the
    tokens each prompt gets alone (GenAI at batch 1 and runtime.generate). A padded row's past length
    is its own, not the padded length: ReduceSum(mask) - sequence_length made the position of a padded
    row's prefill negative, and the learned positional embedding's Gather read rows from the end.
    (int4: the default run's int4 zoo GenAI folder.)"""
    _og()
    out, _ = taper_int4
    texts = ["Once upon a time", PROMPT, "The little dog ran to the park and saw"]
    from models.checkpoint import load_tokenizer
    prompts = [load_tokenizer(out).encode(t).ids for t in texts]
    assert len({len(p) for p in prompts}) == len(prompts), [len(p) for p in prompts]
    batch = genai_batch_greedy(out, texts, NEW_TOKENS)
    ids = json.loads((out / "genai_config.json").read_text())["model"]
    for prompt, text, row in zip(prompts, texts, batch):
        alone = genai_batch_greedy(out, [text], NEW_TOKENS)[0]      # up to eos (GenAI stops there)
        k = len(alone)
        ours, logits = ours_greedy(out / "model.int4.onnx", prompt, NEW_TOKENS)
        assert k >= 4 and compare_greedy(ours[:k], logits[:k], alone) >= k // 2, (ours, alone)
        assert compare_greedy(ours[:k], logits[:k], row[:k]) >= k // 2, (prompt, row, alone)
        if row[:k] == alone:         # then past its eos only eos / pad
            assert set(row[k:]) <= {ids["eos_token_id"], ids["pad_token_id"]}, (prompt, row, alone)


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    return _source("hf:llama", tmp_path_factory.mktemp("hf"))


@pytest.mark.parametrize("name, text, said", [
    ("tokenizer_config.json", "{not json", "expected JSON, found an error"),
    ("tokenizer_config.json", "[]", "expected a JSON object (GenAI's tokenizer reads it), found a list"),
    ("tokenizer_config.json", '{"tokenizer_class": 5}', "tokenizer_class: expected a string (GenAI's tokenizer reads "
                                                         "it), found 5"),
    ("tokenizer_config.json", '{"eos_token": 5}', "eos_token: expected a string or an object"),
    ("tokenizer_config.json", '{"model_max_length": "x"}', "model_max_length: expected a number"),
    ("tokenizer_config.json", '{"clean_up_tokenization_spaces": "no"}', "expected true or false"),
    ("special_tokens_map.json", '"x"', "expected a JSON object (GenAI's tokenizer reads it), found a string")])
def test_genai_refuses_a_tokenizer_file_genai_cannot_read_before_any_work(hf_llama, tmp_path, name, text, said):
    """--genai copied an HF folder's tokenizer files as they were: a malformed tokenizer_config.json built (exit 0)
    and og.Tokenizer failed on the finished folder ("Failed to parse config json", "type must be string")."""
    import shutil
    from tests.cli.conftest import cli
    src = tmp_path / "hf"
    shutil.copytree(hf_llama, src)
    (src / name).write_text(text)
    r = cli("export.build", ["--fuse", "--genai", "--checkpoint", src, "--out", tmp_path / "o"])
    err = r.err.strip().splitlines()
    assert r.code == 1 and len(err) == 1 and str(src / name) in err[0] and said in err[0], r.err[-2000:]
    assert not (tmp_path / "o").exists() and r.out == ""
