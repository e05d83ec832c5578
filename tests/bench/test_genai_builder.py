"""bench.genai_builder: GenAI 0.18's builder reads a transformers-5 Gemma 3 config the way it was written for;
other configs are left as they are. (A whole build of a tiny Gemma 3 folder through it: -m slow.)"""
import pytest

from bench.genai_builder import _gemma3_rope_as_genai_reads_it


def test_gemma3_rope_settings_are_given_in_the_builders_terms():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Gemma3TextConfig(rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                         "full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                            "rope_theta": 1e6}})
    out = _gemma3_rope_as_genai_reads_it(cfg)
    assert out.rope_parameters["rope_type"] == "linear" and out.rope_parameters["factor"] == 8.0
    assert (out.rope_local_base_freq, out.rope_theta) == (1e4, 1e6)
    llama = transformers.LlamaConfig()
    before = dict(llama.rope_parameters)
    assert _gemma3_rope_as_genai_reads_it(llama).rope_parameters == before


@pytest.mark.slow
def test_a_tiny_gemma3_folder_builds_with_genais_builder(tmp_path):
    pytest.importorskip("onnxruntime_genai")
    import subprocess
    import sys
    from pathlib import Path
    from bench.scale import genai_input
    from bench.shapes import SHAPES, write_random_folder
    tiny = dict(SHAPES["gemma-3-1b"], hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=1, head_dim=16, intermediate_size=96, vocab_size=2048, sliding_window=8,
                _name_or_path="tiny-gemma-3")
    folder = genai_input(write_random_folder(tiny, tmp_path / "g", log=lambda *a: None), tmp_path / "in")
    proc = subprocess.run([sys.executable, "-m", "bench.genai_builder", "-i", str(folder), "-o", str(tmp_path / "out"),
                           "-p", "int4", "-e", "cpu", "-c", str(tmp_path / "cache")], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2])
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert (tmp_path / "out" / "genai_config.json").is_file()
