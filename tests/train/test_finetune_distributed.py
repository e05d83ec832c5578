"""train.finetune data-parallel: torchrun --nproc-per-node 2 (gloo, CPU) against one process with the
same global batch, and --grad-accum 2 on one process. FakeLN freezes each norm's std from sums
all-reduced over the ranks (train/recipes.py measure_std), the taper methods calibrate c the same way
(train/loop.py _calibrate): every rank must end with the weights, std and c of one process."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import train.loop as loop
from tests.cli.conftest import cli
from tests.train.conftest import pretrained_layernorm

ROOT = Path(__file__).resolve().parents[2]
# as in test_distributed.py: half-batch matmuls on each rank round differently from one full-batch
# matmul (fp32, ~1e-7 relative per step); a few AdamW steps keep the weights within this
WEIGHT_ATOL = 1e-6
# std and c come from float64 sums of fp32 activations; the ranks' activations are those of one process
# (measured: std within 3e-11 of one process's ~0.028, c within 1e-14). c: absolute, as in test_distributed.py;
# the std (~0.03 here) relative, so that a std measured on one rank's half of the windows cannot pass.
STAT_TOL = 1e-6
FT = ["--steps", "6", "--eval-every", "3", "--batch-size", "4", "--seq-len", "16", "--eval-batches", "1",
      "--calib-batches", "2", "--corpus-stories", "200", "--quiet", "--threads", "1"]
METHOD_ARGS = {"fakeln": ["--fakeln-every", "1"], "all-taper": []}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A 2-layer LayerNorm (GPT-2 architecture) model pretrained for 4 steps."""
    return pretrained_layernorm(tmp_path_factory.mktemp("ftd") / "pre", steps=4)


def _training_state(out: Path) -> dict:
    """The training model's tensors (FakeLN's saved checkpoint scales gamma by 1e6 / std: compare these)."""
    return loop.load_run_state(out)["model"]


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def _log(out: Path) -> dict:
    return json.loads((out / loop.LOG_NAME).read_text())


@pytest.mark.parametrize("method", ["fakeln", pytest.param("all-taper", marks=pytest.mark.slow)])
def test_two_ranks_and_grad_accum_match_one_process(source, tmp_path, method):
    argv = ["--from", str(source), "--method", method, *FT, *METHOD_ARGS[method]]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "-m", "train.finetune", "--out", str(tmp_path / "ddp"), *argv],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        one = cli("train.finetune", [*argv, "--out", tmp_path / "one"])          # meanwhile, in this process
        accum = cli("train.finetune", [*argv, "--out", tmp_path / "accum", "--grad-accum", "2"])
        out, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert one.code == 0 and accum.code == 0, one.err + accum.err
    assert proc.returncode == 0, err[-3000:]
    assert out.count(f"{method} from") == 1                          # rank 0 reports; rank 1 stays quiet
    ref, ref_log = _training_state(tmp_path / "one"), _log(tmp_path / "one")
    for name in ("ddp", "accum"):
        log = _log(tmp_path / name)
        assert _max_diff(_training_state(tmp_path / name), ref) <= WEIGHT_ATOL, name
        if method == "fakeln":                                       # every norm frozen, each at its step
            assert [e["layer"] for e in log["fakeln"]] == [e["layer"] for e in ref_log["fakeln"]]
            assert len(log["fakeln"]) == 5
            for got, want in zip(log["fakeln"], ref_log["fakeln"]):
                assert got["step"] == want["step"], (name, got, want)
                assert got["std"] == pytest.approx(want["std"], rel=STAT_TOL, abs=0), (name, got, want)
        else:
            assert log["calibration"]["c"].keys() == ref_log["calibration"]["c"].keys()
            for layer, c in ref_log["calibration"]["c"].items():
                assert abs(log["calibration"]["c"][layer] - c) <= STAT_TOL, (name, layer)
            assert abs(log["calibration"]["s_tgt"] - ref_log["calibration"]["s_tgt"]) <= STAT_TOL
        assert [e["val_loss"] for e in log["evals"]] == pytest.approx([e["val_loss"] for e in ref_log["evals"]],
                                                                      abs=1e-5)
    ddp_log = _log(tmp_path / "ddp")
    assert ddp_log["recipe"] == ref_log["recipe"]
    assert [(p["world_size"], p["per_rank_batch"], p["backend"]) for p in ddp_log["parallel"]] == [(2, 2, "gloo")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["accum", "ddp", "one"]   # no work directory left


def test_finetune_on_token_shards_gives_the_weights_of_the_same_text_in_memory(source, tmp_path):
    """--data: the corpus tokenized with the model's own tokenizer into shards, memory-mapped."""
    from safetensors.torch import load_file
    from train.corpus import generate_stories
    text = tmp_path / "s.jsonl"
    text.write_text("".join(json.dumps({"text": s}) + "\n" for s in generate_stories(150, seed=11)))
    argv = ["--from", str(source), "--method", "vanilla", "--steps", "2", "--eval-every", "2", "--batch-size", "4",
            "--seq-len", "16", "--eval-batches", "1", "--calib-batches", "1", "--quiet", "--threads", "1"]
    mem = cli("train.finetune", [*argv, "--out", tmp_path / "mem", "--corpus", text])
    mapped = cli("train.finetune", [*argv, "--out", tmp_path / "mapped", "--data", text, "--shards", tmp_path / "tok"])
    assert mem.code == 0 and mapped.code == 0, mem.err + mapped.err
    assert json.loads((tmp_path / "tok" / "shards.json").read_text())["tokenizer_sha256"]
    a, b = load_file(str(tmp_path / "mem" / "model.safetensors")), load_file(str(tmp_path / "mapped" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
