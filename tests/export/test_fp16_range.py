"""--dtype fp16 and weights beyond fp16's range: a finite fp32 weight above 65504 becomes inf in the cast, the
logits of the tokens it touches NaN, in the torch reference (cast the same way) as in the graph, so a
verification alone could pass. The build refuses in one line naming the weight: a matrix when it is written
(after the fold: export/pipeline.py write_graph), a vector (gain, bias) when the graph is emitted
(export/emit.py), folded or not, and writes nothing."""
import pytest
import torch

from tests.cli.conftest import cli
from tests.helpers import random_model, write_checkpoint

MATRIX = ("error: wte.weight: expected weights within fp16's range (|w| <= 65504) for --dtype fp16, found one past "
          "it (after the fold); build with --dtype fp32 or --dtype bf16")
VECTOR = ("error: blocks.0.mlp.down_proj.bias: expected weights within fp16's range (|w| <= 65504) for --dtype fp16, "
          "found max |w| 70000; build with --dtype fp32 or --dtype bf16")


def _checkpoint(root, where: str):
    model = random_model(seed=1, n_layer=2, max_seq_len=32, tie_embeddings=False)
    with torch.no_grad():
        if where == "matrix":
            model.wte.weight[-1, 5] = 7e4       # the last token's embedding: no verification session feeds that token
        else:
            model.blocks[0].mlp.down_proj.bias[3] = 7e4
    return write_checkpoint(root / where, model)


@pytest.fixture(scope="module")
def out_of_range(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp16")
    return {where: _checkpoint(root, where) for where in ("matrix", "vector")}


@pytest.mark.filterwarnings("error")          # a warning would be more lines on the command's stderr
@pytest.mark.parametrize("where, fuse, line", [("matrix", ["--fuse"], MATRIX), ("matrix", [], MATRIX),
                                               ("vector", ["--fuse"], VECTOR)])
def test_a_weight_beyond_fp16_is_refused_in_one_line(out_of_range, tmp_path, where, fuse, line):
    r = cli("export.build", [*fuse, "--checkpoint", out_of_range[where], "--out", tmp_path / "b", "--dtype", "fp16"])
    err = r.err.strip().splitlines()
    assert r.code == 1 and len(err) == 1, r.err[-3000:]
    assert err[0] == line, err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_the_same_checkpoint_builds_in_bf16(out_of_range, tmp_path):
    """The fix the matrix's line names works (bf16 has fp32's range)."""
    r = cli("export.build", ["--fuse", "--checkpoint", out_of_range["matrix"], "--out", tmp_path / "b", "--dtype", "bf16"])
    assert r.code == 0, r.err[-3000:]


def test_a_vector_beyond_fp16_builds_in_bf16(out_of_range, tmp_path):
    """bf16 has fp32's range, for vectors as for matrices: the fp16 refusal's advice holds."""
    from export.options import BuildOptions
    from export.pipeline import build
    build(out_of_range["vector"], tmp_path / "b", BuildOptions(True, "bf16"), log=lambda *a: None)
