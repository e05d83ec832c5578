"""A checkpoint's rope_scaling that its rope type cannot be computed from is one line naming config.json's
field, from models.checkpoint and export.build alike (issue 42: a longrope without 'factor' passed the key
check and raised KeyError where the model was built, a traceback)."""
import json

import pytest

from tests.helpers import random_model, write_checkpoint

HEAD = 8        # d_model 32 / 4 heads: 4 frequencies a set
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.3], "long_factor": [2.0, 2.1, 2.2, 2.3],
            "original_max_position_embeddings": 16, "factor": 4.0}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("rope") / "ckpt",
                            random_model(seed=1, norm="rmsnorm", pos_embedding="rope", mlp="swiglu",
                                         rope_scaling=LONGROPE))


def _edited(ckpt, tmp_path, scaling):
    import shutil
    path = tmp_path / "edited"
    shutil.copytree(ckpt, path)
    raw = json.loads((path / "config.json").read_text())
    raw["rope_scaling"] = scaling
    (path / "config.json").write_text(json.dumps(raw))
    return path


def test_the_longrope_checkpoint_loads(ckpt, capsys):
    from models.checkpoint import main
    assert main([str(ckpt)]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("scaling, needle", [
    ({k: v for k, v in LONGROPE.items() if k != "factor"}, "expected a longrope scaling with 'factor' or "
                                                           "'attention_factor'"),
    ({**LONGROPE, "factor": "four"}, "expected numbers its rope_type can be computed from"),
    ({**LONGROPE, "short_factor": [1.0]}, "expected short_factor and long_factor of 4 numbers each"),
    ({**LONGROPE, "long_factor": [1.0, 2.0, 3.0]}, "expected numbers its rope_type can be computed from"),
])
def test_an_uncomputable_rope_scaling_is_one_line(ckpt, tmp_path, capsys, scaling, needle):
    from export.build import main as build_main
    from models.checkpoint import main
    path = _edited(ckpt, tmp_path, scaling)
    assert main([str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path / 'config.json'}: field rope_scaling = ") and needle in err, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert build_main(["--checkpoint", str(path), "--out", str(tmp_path / "build")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"error: {path / 'config.json'}: field rope_scaling = ") and err.count("\n") == 1, err
    assert not (tmp_path / "build").exists()


def test_a_longrope_with_an_attention_factor_needs_no_factor(ckpt, tmp_path, capsys):
    from models.checkpoint import main
    scaling = {**{k: v for k, v in LONGROPE.items() if k != "factor"}, "attention_factor": 1.2}
    assert main([str(_edited(ckpt, tmp_path, scaling))]) == 0, capsys.readouterr().err
