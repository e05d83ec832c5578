"""--resume reads a run folder that may come from someone else: its state is data (safetensors + JSON),
never a pickle that runs code; an old pickled train_state.pt is refused by name, unread; a run of
train.finetune is not continued as a plain python -m train run."""
import json
import pickle
import shutil

import pytest
import torch
from safetensors.torch import load_file

import train.loop as loop
from tests.cli.conftest import cli, copy_tree
from tests.train.conftest import pretrained_layernorm
from train.config import TrainConfig

RESUME = ["--resume", "--quiet", "--threads", "1"]
OLD_STATE = "train_state.pt"


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A finished 4-step run of python -m train (resuming it loads the state and trains no step)."""
    out = tmp_path_factory.mktemp("safety") / "run"
    loop.train(TrainConfig(preset="internal-taper", out=str(out), steps=4, eval_every=2, batch_size=2, seq_len=16,
                           eval_batches=1, calib_batches=1, corpus_stories=100, progress=False, threads=1,
                           model=dict(d_model=16, n_layer=1, n_head=2, max_seq_len=32)))
    return out


class Payload:
    """Unpickling this creates `path`: what a crafted state file could do with any code it likes."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _plant_pickle(run, name, witness):
    """Replace the run's resume state by a pickle whose loading creates `witness`."""
    for f in (loop.RUN_STATE, loop.RUN_STATE_JSON, OLD_STATE):
        (run / f).unlink(missing_ok=True)
    torch.save({"step": 4, "model": Payload(witness)}, run / name)


def _one_error_line(r, *needles):
    assert r.code == 1 and len(r.error_lines) == 1 and "Traceback" not in r.err, r.err
    assert all(n in r.error_lines[0] for n in needles), r.err


def test_the_resume_state_is_safetensors_and_json(tiny_run):
    names = {p.name for p in tiny_run.iterdir()}
    assert {loop.RUN_STATE, loop.RUN_STATE_JSON} <= names and OLD_STATE not in names
    assert loop.RUN_STATE.endswith(".safetensors") and loop.RUN_STATE_JSON.endswith(".json")
    tensors = load_file(str(tiny_run / loop.RUN_STATE))
    plain = json.loads((tiny_run / loop.RUN_STATE_JSON).read_text())
    assert plain["step"] == 4 and any(k.startswith("model.") for k in tensors)
    assert tensors["torch_rng"].dtype == torch.uint8 and tensors["data_rng"].dtype == torch.uint8


def _old_pickle_is_refused(source, tmp_path, command: str, *needles: str) -> None:
    """A run folder whose state is the old pickle, with a payload: `command --resume` never runs it."""
    run = copy_tree(source, tmp_path / "run")
    witness = tmp_path / "payload-ran"
    _plant_pickle(run, OLD_STATE, witness)
    r = cli(command, ["--out", run, *RESUME])
    assert not witness.exists()
    _one_error_line(r, str(run / OLD_STATE), "run code", *needles)


def test_a_pickled_state_never_runs_and_is_refused_in_one_line(tiny_run, tmp_path):
    _old_pickle_is_refused(tiny_run, tmp_path, "train", "another --out")


def test_a_pickle_in_place_of_the_new_state_never_runs(tiny_run, tmp_path):
    run = copy_tree(tiny_run, tmp_path / "run")
    plain = (run / loop.RUN_STATE_JSON).read_text()
    witness = tmp_path / "payload-ran"
    _plant_pickle(run, loop.RUN_STATE, witness)
    (run / loop.RUN_STATE_JSON).write_text(plain)
    r = cli("train", ["--out", run, *RESUME])
    assert not witness.exists()
    _one_error_line(r, str(run / loop.RUN_STATE))
    (run / loop.RUN_STATE_JSON).write_bytes(pickle.dumps(Payload(witness)))   # and one in place of the JSON
    shutil.copyfile(tiny_run / loop.RUN_STATE, run / loop.RUN_STATE)
    r = cli("train", ["--out", run, *RESUME])
    assert not witness.exists()
    _one_error_line(r, str(run / loop.RUN_STATE_JSON))


def test_a_state_that_does_not_fit_the_model_is_one_line(tiny_run, tmp_path):
    from safetensors.torch import save_file
    run = copy_tree(tiny_run, tmp_path / "run")
    tensors = load_file(str(run / loop.RUN_STATE))
    tensors["model.wte.weight"] = tensors["model.wte.weight"][:3]
    save_file(tensors, str(run / loop.RUN_STATE))
    _one_error_line(cli("train", ["--out", run, *RESUME]), str(run))


@pytest.fixture(scope="module")
def finetune_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ft_safety")
    source = pretrained_layernorm(root / "pre", steps=2)
    r = cli("train.finetune", ["--from", source, "--method", "vanilla", "--out", root / "ft", "--steps", "2",
                               "--eval-every", "2", "--batch-size", "4", "--seq-len", "16", "--eval-batches", "1",
                               "--calib-batches", "1", "--corpus-stories", "200", "--quiet", "--threads", "1"])
    assert r.code == 0, r.err
    return root / "ft"


def test_finetune_resume_never_runs_a_pickled_state(finetune_run, tmp_path):
    _old_pickle_is_refused(finetune_run, tmp_path, "train.finetune")


def test_plain_train_refuses_to_resume_a_finetune_run(finetune_run, tmp_path):
    run = copy_tree(finetune_run, tmp_path / "ft")
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    r = cli("train", ["--out", run, *RESUME])
    _one_error_line(r, "python -m train.finetune", f"python -m train.finetune --out {run} --resume")
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before
