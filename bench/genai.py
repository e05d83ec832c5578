"""The ONNX Runtime GenAI peers: GenAI's C++ loop on an equal-shape random-init Llama built by
GenAI's own model builder (genai-<dtype>), and the same loop on our folded graph written as a
GenAI folder by export/genai.py (genai-ours-<dtype>: OURS_VARIANT with GroupQueryAttention).

    python -m onnxruntime_genai.models.builder -i HF_DIR -o OUT -p fp32|int4 -e cpu

HF_DIR is a transformers LlamaForCausalLM with our size's d_model, layers, heads and vocab,
a tied head, and an MLP hidden size of 8 d / 3 (rounded up to a multiple of 8) so that its
three MLP matrices hold the bytes of our two 4 d ones: the same weight bytes per token within
a few percent (RoPE instead of a position table, no biases). Random init (seeded): speed
does not depend on the values. The builder gives GroupQueryAttention (past and present
share one buffer), SkipSimplifiedLayerNormalization and, for int4, MatMulNBits (block 32,
accuracy level 4) with the tied embedding as GatherBlockQuantized over the head's weights.

onnxruntime-genai and onnx_ir are optional (`pip install onnxruntime-genai`): without them
bench.decode skips the peer and says why.
"""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.runners import Runner, Timing
from core.outputs import BENCH_CACHE, is_earlier_output, output_dir, replace_file_in

PRECISIONS = ("fp32", "int4")          # what the builder's -p takes that we compare (int8 is not a CPU option)
OURS_VARIANT = "all-taper-fused"       # every norm folded away: the graph GenAI's own builder cannot make
TOKENIZER = Path(__file__).resolve().parent.parent / "train" / "data" / "tokenizer.json"


def genai_status() -> str | None:
    """None when the GenAI peer can run here, else why not."""
    for mod, pkg in (("onnxruntime_genai", "onnxruntime-genai"), ("onnx_ir", "onnx-ir"), ("transformers", "transformers")):
        if importlib.util.find_spec(mod) is None:
            return f"{pkg} is not installed (pip install {pkg})"
    return None


def llama_mlp_hidden(d_model: int) -> int:
    """8 d / 3 rounded up to a multiple of 8: three d x h matrices ~ two d x 4d ones."""
    return -(-(8 * d_model // 3) // 8) * 8


def write_llama(shape: dict, capacity: int, out: Path, seed: int = 0) -> Path:
    """A random-init transformers Llama folder of our size's shape, with a tokenizer."""
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
    transformers.logging.set_verbosity_error()
    d = shape["d_model"]
    cfg = LlamaConfig(vocab_size=shape["vocab_size"], hidden_size=d, intermediate_size=llama_mlp_hidden(d),
                      num_hidden_layers=shape["n_layer"], num_attention_heads=shape["n_head"],
                      num_key_value_heads=shape["n_head"], max_position_embeddings=capacity,
                      tie_word_embeddings=True, rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).eval().save_pretrained(out)
    PreTrainedTokenizerFast(tokenizer_file=str(TOKENIZER), eos_token="<|endoftext|>",
                            bos_token="<|endoftext|>").save_pretrained(out)
    return out


def build_genai(size: str, shape: dict, capacity: int, precision: str, cache: Path, seed: int = 0, log=print) -> dict:
    """The GenAI build of this size and precision in `cache` (reused when present); its info.
    The builder's version is in the name: a newer onnxruntime-genai builds afresh beside the old.
    Its folders are written whole or not at all (core.outputs.output_dir, marked as cache entries)."""
    from importlib.metadata import version
    from core.onnx_writer import initializer_bytes
    from graph_passes.base import op_counts
    out = cache / f"genai-{size}-cap{capacity}-{precision}-seed{seed}-og{version('onnxruntime-genai')}"
    info_path = out.with_name(out.name + ".json")          # (with_suffix would cut the version's ".0")
    if is_earlier_output(out, BENCH_CACHE) and info_path.is_file():     # its marker, not its genai_config.json
        return json.loads(info_path.read_text())
    t0 = time.perf_counter()
    hf = cache / f"hf-llama-{size}-cap{capacity}-seed{seed}"
    with output_dir(hf, BENCH_CACHE) as tmp:
        write_llama(shape, capacity, tmp, seed)
    with output_dir(out, BENCH_CACHE) as tmp:
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf), "-o", str(tmp),
               "-p", precision, "-e", "cpu", "-c", str(cache / "genai-hf-cache")]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or not (tmp / "genai_config.json").is_file():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            raise RuntimeError(f"GenAI builder failed for {size} {precision}: {tail[0][:300]}")
    import onnx
    proto = onnx.load(str(out / "model.onnx"), load_external_data=False)
    info = {"path": str(out), "precision": precision, "weight_bytes": initializer_bytes(proto, per_step=True),
            "source": f"random:seed{seed} (transformers LlamaForCausalLM, MLP hidden {llama_mlp_hidden(shape['d_model'])})",
            "op_counts": op_counts(proto), "build_s": round(time.perf_counter() - t0, 2),
            "command": " ".join(cmd[1:]).replace(str(tmp), str(out))}
    replace_file_in(cache, info_path.name, json.dumps(info, indent=1))
    log(f"  built {size} genai-{precision}: {len(proto.graph.node)} nodes in {info['build_s']:.1f} s")
    return info


def build_ours_genai(size: str, capacity: int, precision: str, cache: Path, seed: int = 0, log=print,
                     verify: bool = True) -> dict:
    """A GenAI folder in `cache` over our OURS_VARIANT graph of this size (--attention gqa, quantized
    for int4), reused when present; its info (as build_genai's, with the runner's name)."""
    from bench.variants import VARIANTS, base_model, build_onnx, quantized_name
    from core.onnx_writer import save_onnx
    from export.genai import GENAI_CONFIG, GENAI_GRAPH, genai_config, genai_graph
    out = cache / f"ours-genai-{size}-cap{capacity}-{OURS_VARIANT}-{precision}-seed{seed}"
    info_path = out.with_name(out.name + ".json")
    if is_earlier_output(out, BENCH_CACHE) and info_path.is_file():     # its marker, not its genai_config.json
        return json.loads(info_path.read_text())
    t0 = time.perf_counter()
    built = build_onnx(size, [OURS_VARIANT], capacity, cache, seed, log, dtypes=(precision,), attention="gqa",
                       verify=verify)
    graph = built[quantized_name(OURS_VARIANT, precision)]
    import onnx
    cfg = base_model(size, VARIANTS[OURS_VARIANT].kind, capacity, seed)[0].cfg
    ids = {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}       # as write_llama's; runs never stop early
    with output_dir(out, BENCH_CACHE) as tmp:          # written whole or not at all
        save_onnx(genai_graph(onnx.load(graph.path), graph.path), tmp / GENAI_GRAPH)
        (tmp / GENAI_CONFIG).write_text(json.dumps(genai_config(cfg, GENAI_GRAPH, ids), indent=4) + "\n")
    info = {"path": str(out), "precision": precision, "name": f"genai-ours-{precision}",
            "weight_bytes": graph.weight_bytes, "source": f"{graph.source} ({OURS_VARIANT} with GenAI's I/O)",
            "op_counts": graph.op_counts, "build_s": round(time.perf_counter() - t0, 2),
            "verified": graph.verified}
    replace_file_in(cache, info_path.name, json.dumps(info, indent=1))
    log(f"  built {size} genai-ours-{precision}: {OURS_VARIANT} as a GenAI folder in {info['build_s']:.1f} s")
    return info


def genai_window(config: dict) -> int:
    """The sliding window of a GenAI folder's genai_config.json (Gemma 3's), or 0. Its GroupQueryAttention
    refuses a KV cache shorter than the window, so a run sets max_length to at least that and stops after
    its own number of tokens."""
    return int(config["model"]["decoder"].get("sliding_window", {}).get("window_size", 0))


class GenAIRunner(Runner):
    """onnxruntime_genai: append_tokens(prompt), then generate_next_token until exactly n new
    tokens (min_length = max_length: no early stop), greedy. Batch 1 only. On GenAI's own build
    (build_genai) or on our graph (build_ours_genai: info carries the name genai-ours-<dtype>)."""
    kind = "peer"
    max_batch = 1

    def __init__(self, info: dict, threads: int):
        self.name = info.get("name", f"genai-{info['precision']}")
        self.path, self.threads, self.weight_bytes = info["path"], threads, info["weight_bytes"]
        self.source = info["source"]

    def _activate(self):
        import onnxruntime_genai as og
        cfg = json.loads((Path(self.path) / "genai_config.json").read_text())
        cfg["model"]["decoder"]["session_options"]["intra_op_num_threads"] = self.threads
        replace_file_in(Path(self.path), "genai_config.json", json.dumps(cfg, indent=1))
        self.window = genai_window(cfg)
        self.og = og
        self.model = og.Model(self.path)

    def generate(self, prompts, n):
        og = self.og
        prompt = np.ascontiguousarray(prompts[0], np.int32)
        params = og.GeneratorParams(self.model)
        params.set_search_options(max_length=max(len(prompt) + n, self.window), min_length=len(prompt) + n,
                                  do_sample=False)
        gen = og.Generator(self.model, params)
        t0 = time.perf_counter()
        gen.append_tokens(prompt)                    # the prefill
        stamps = []
        for _ in range(n):
            gen.generate_next_token()                # picks a token, runs the model on it
            stamps.append(time.perf_counter())
        got = len(gen.get_sequence(0)) - len(prompt)
        if got != n:
            raise RuntimeError(f"GenAI generated {got} tokens, expected {n}")
        return Timing(stamps[0] - t0, list(np.diff(stamps)), stamps[-1] - t0)

    def close(self):
        self.model = None
