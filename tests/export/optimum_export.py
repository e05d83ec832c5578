"""Write tiny random-init GPT-2 / Llama / Qwen2 models as Hugging Face Optimum exports them.

Optimum's ONNX exporter (optimum-onnx 0.1.0) pins transformers < 4.58, so it
cannot live in the project's environment; run this script with a Python that has it:

    python3 -m venv /tmp/optimum-venv && /tmp/optimum-venv/bin/pip install torch==2.13.0 'optimum-onnx[onnxruntime]'
    /tmp/optimum-venv/bin/python tests/export/optimum_export.py OUT_DIR [gpt2 llama qwen2 gpt2-ln-free]

For each model it writes OUT_DIR/<model>/model.onnx (with past: input_ids,
attention_mask, [position_ids], past_key_values.N.key|value -> logits,
present.N.key|value), OUT_DIR/<model>/decoder_model.onnx (without past) and
OUT_DIR/<model>/decoder_model_merged.onnx (both merged under If(use_cache_branch)
by optimum.onnx.merge_decoders). The models are built here, with the recipe of
tests/export/hf_style.py (randomized norm gains and biases); no weights are downloaded.
tests/export/test_other_exporters.py runs it when OPTIMUM_PYTHON names such a Python.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

N_LAYER = 2
MODELS = ("gpt2", "llama", "qwen2", "gpt2-ln-free")


def build(kind: str):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(MODELS.index(kind))
    small = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=N_LAYER, num_attention_heads=2,
                 num_key_value_heads=1, max_position_embeddings=32)
    eps = 1e12 if kind == "gpt2-ln-free" else 1e-5
    if kind.startswith("gpt2"):
        model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=N_LAYER, n_head=2,
                                           layer_norm_epsilon=eps))
    elif kind == "llama":
        model = LlamaForCausalLM(LlamaConfig(**small))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**small))
    gain = eps ** 0.5 * 50.0 if eps > 1 else 1.0        # LN-free: gamma * sqrt(eps) / std, std ~0.02 (hf_style.py)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln_" in name or "norm" in name:
                p.copy_((torch.randn_like(p) * 0.2 + 1.0) * gain if name.endswith("weight") else torch.randn_like(p) * 0.2)
            elif name.endswith("bias"):
                p.copy_(torch.randn_like(p) * 0.02)
    return model.eval()


def export(kind: str, out: Path) -> None:
    import onnx
    from optimum.exporters.onnx import main_export
    from optimum.exporters.tasks import TasksManager
    from optimum.onnx import merge_decoders
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "hf"
        model = build(kind)
        model.save_pretrained(src)
        config_class = TasksManager.get_exporter_config_constructor("onnx", model, task="text-generation-with-past")
        for name, past_in in (("model.onnx", True), ("decoder_model.onnx", False)):
            # without past inputs but with present outputs: Optimum's "decoder_model" of a merged pair
            onnx_config = config_class(model.config, task="text-generation", use_past=True, use_past_in_inputs=past_in)
            dst = Path(tmp) / name
            main_export(str(src), dst, task="text-generation-with-past", do_validation=False,
                        library_name="transformers", custom_onnx_configs={"model": onnx_config})
            onnx.save(onnx.load(str(dst / "model.onnx")), str(out / name))
        merge_decoders(onnx.load(str(out / "decoder_model.onnx")), onnx.load(str(out / "model.onnx")),
                       save_path=str(out / "decoder_model_merged.onnx"))
    print(f"wrote {out}: model.onnx, decoder_model.onnx, decoder_model_merged.onnx")


if __name__ == "__main__":
    root = Path(sys.argv[1])
    for kind in sys.argv[2:] or MODELS:
        export(kind, root / kind)
