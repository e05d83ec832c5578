"""--dtype fp16 and weights beyond fp16's range: a finite fp32 weight above 65504 becomes inf in the cast,
the logits of the tokens it touches NaN, in the torch reference (cast the same way) as in the graph, so the
verification passed. Both routes check every weight before the cast and refuse in one line naming it."""
import pytest
import torch

from tests.cli.conftest import cli
from tests.helpers import random_model, write_checkpoint


@pytest.fixture(scope="module")
def out_of_range(tmp_path_factory):
    model = random_model(seed=1, n_layer=2, max_seq_len=32, tie_embeddings=False)
    with torch.no_grad():
        model.wte.weight[-1, 5] = 7e4       # the last token's embedding: no verification session feeds that token
    return write_checkpoint(tmp_path_factory.mktemp("fp16") / "ckpt", model)


@pytest.mark.parametrize("route, fuse", [("in-memory", ["--fuse"]), ("in-memory", []), ("streamed", ["--fuse"])])
def test_a_weight_beyond_fp16_is_refused_in_one_line_on_both_routes(out_of_range, tmp_path, route, fuse):
    r = cli("export.build", [*fuse, "--checkpoint", out_of_range, "--out", tmp_path / "b", "--dtype", "fp16",
                             "--route", route])
    err = r.err.strip().splitlines()
    assert r.code == 1 and len(err) == 1, r.err[-3000:]
    assert err[0] == ("error: wte.weight: expected weights within fp16's range (|w| <= 65504) "
                      "for --dtype fp16, found max |w| 70000; build with --dtype fp32 or --dtype bf16"), err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_the_same_checkpoint_builds_in_bf16(out_of_range, tmp_path):
    """The fix the line names works (bf16 has fp32's range)."""
    r = cli("export.build", ["--fuse", "--checkpoint", out_of_range, "--out", tmp_path / "b", "--dtype", "bf16"])
    assert r.code == 0, r.err[-3000:]
