"""python -m bench.genai_builder -i HF_DIR -o OUT -p int4 -e cpu ...: ONNX Runtime GenAI's model builder
(`python -m onnxruntime_genai.models.builder`, the same arguments), made to read a Gemma 3 config.json the
way it was written for.

GenAI 0.18's builder reads `config.rope_parameters["rope_type"]` and `config.rope_local_base_freq`; under
transformers 5, Gemma3TextConfig keeps one rope settings dict per layer type (rope_parameters =
{"full_attention": ..., "sliding_attention": ...}) and no rope_local_base_freq, so the builder stops with
KeyError: 'rope_type' on every Gemma 3 folder (seen on Gemma-3-1B's shape). Here the config it loads is given
those two in its own terms: the global layers' settings as rope_parameters, the local layers' base as
rope_local_base_freq. Every other model type is loaded as it is. Used by bench.scale and bench.fold_vs_genai.
"""
from __future__ import annotations

from core.lifecycle import guard_startup
guard_startup(__name__)     # before the imports below: a Ctrl-C while they load exits 130 with one line

import runpy
import sys


def _gemma3_rope_as_genai_reads_it(config):
    rope = getattr(config, "rope_parameters", None)
    if getattr(config, "model_type", "") == "gemma3_text" and isinstance(rope, dict) and "full_attention" in rope:
        config.rope_local_base_freq = rope["sliding_attention"]["rope_theta"]
        config.rope_parameters = rope["full_attention"]
        config.rope_theta = rope["full_attention"]["rope_theta"]
    return config


def run(argv: list[str]) -> int:
    import transformers
    load = transformers.AutoConfig.from_pretrained

    def from_pretrained(*args, **kwargs):
        return _gemma3_rope_as_genai_reads_it(load(*args, **kwargs))
    transformers.AutoConfig.from_pretrained = from_pretrained
    sys.argv = ["onnxruntime_genai.models.builder", *argv]
    runpy.run_module("onnxruntime_genai.models.builder", run_name="__main__")
    return 0


def main(argv: list[str] | None = None) -> int:
    from core.lifecycle import run_cli
    return run_cli(run, sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    from core.lifecycle import exit_after
    exit_after(main)
