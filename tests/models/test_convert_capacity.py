"""A KV-cache capacity too small for export.build's verification (a prompt and 3 decode steps: 4 positions) is
refused by models.convert in one line, whether it comes from --max-seq-len or from the folder's
max_position_embeddings / n_positions (issue 42: 1-3 were accepted, and export.build then crashed in ONNX
Runtime's TensorScatter with a traceback). 4 converts and builds."""
import json

import pytest
import torch

from models.convert import MIN_CAPACITY, ConvertError, convert
from models.convert import main as convert_main

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    import contextlib
    import io
    root = tmp_path_factory.mktemp("cap")
    torch.manual_seed(0)
    models = {"llama": transformers.LlamaForCausalLM(transformers.LlamaConfig(
                  vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)),
              "gpt2": transformers.GPT2LMHeadModel(transformers.GPT2Config(
                  vocab_size=512, n_embd=32, n_layer=1, n_head=4, n_positions=64))}
    for name, m in models.items():
        with contextlib.redirect_stderr(io.StringIO()):
            m.eval().save_pretrained(root / name)
    return root


def _with(hf, tmp_path, name, **changes):
    import shutil
    path = tmp_path / name
    shutil.copytree(hf / name, path)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **changes}))
    return path


@pytest.mark.parametrize("capacity", [1, 3])
def test_a_too_small_max_seq_len_is_refused_in_one_line(hf, tmp_path, capsys, capacity):
    assert convert_main([str(hf / "llama"), "--out", str(tmp_path / "ck"), "--max-seq-len", str(capacity)]) == 1
    err = capsys.readouterr().err
    assert err == (f"error: --max-seq-len {capacity}: expected a KV-cache capacity of at least {MIN_CAPACITY} (a prompt "
                   f"and 3 decode steps, what export.build verifies), found {capacity}; pass --max-seq-len "
                   f"{MIN_CAPACITY} or more\n"), err
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("name, key", [("llama", "max_position_embeddings"), ("gpt2", "n_positions")])
def test_a_folder_whose_positions_are_too_few_is_refused_by_convert_and_export_build(hf, tmp_path, capsys, name, key):
    from export.build import main as build_main
    path = _with(hf, tmp_path, name, **{key: 1})
    with pytest.raises(ConvertError, match=f"{key} 1: expected a KV-cache capacity of at least {MIN_CAPACITY}"):
        convert(path)
    assert build_main(["--checkpoint", str(path), "--out", str(tmp_path / "build")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path / 'config.json'}: {key} 1: expected") and err.count("\n") == 1, err
    assert not (tmp_path / "build").exists()


def test_the_smallest_capacity_converts_and_builds(hf, tmp_path, capsys):
    from export.build import main as build_main
    assert convert_main([str(hf / "llama"), "--out", str(tmp_path / "ck"), "--max-seq-len", str(MIN_CAPACITY)]) == 0
    assert build_main(["--checkpoint", str(tmp_path / "ck"), "--out", str(tmp_path / "build")]) == 0, \
        capsys.readouterr().err


@pytest.mark.parametrize("capacity", [1, 3])
def test_export_build_refuses_our_own_checkpoint_of_a_too_small_capacity(tmp_path, capsys, capacity):
    """A checkpoint of ours (python -m train --max-seq-len 3, or an older convert) is refused by export.build
    in one line before the export; it crashed the verification in ONNX Runtime's TensorScatter."""
    from export.build import main as build_main
    from tests.helpers import random_model, write_checkpoint
    ckpt = write_checkpoint(tmp_path / "ckpt", random_model(seed=3, n_layer=1, max_seq_len=capacity))
    assert build_main(["--checkpoint", str(ckpt), "--out", str(tmp_path / "build")]) == 1
    err = capsys.readouterr().err
    assert err == (f"error: {ckpt}: expected a KV-cache capacity (max_seq_len) of at least {MIN_CAPACITY} (a prompt "
                   f"and 3 decode steps, what the build verifies), found {capacity}; write the checkpoint again with "
                   f"--max-seq-len {MIN_CAPACITY} or more\n"), err
    assert not (tmp_path / "build").exists()
