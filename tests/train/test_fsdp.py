"""--fsdp (train/sharded.py): torchrun --nproc-per-node 2 (gloo, CPU) with every block, the embedding / head
and the root fully_shard-ed, against one process with the same global batch; a sharded run killed mid-way
and resumed by one process; the consolidated checkpoint (streamed tensor by tensor) loads and builds;
the per-rank memory estimate and its refusal."""
import errno
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import train.loop as loop
from models.checkpoint import load_checkpoint, save_checkpoint
from tests.cli.conftest import cli
from tests.train.conftest import pretrained_layernorm
from tests.train.test_distributed import TINY, _argv
from train.config import TrainConfig
from train.distributed import Parallel
from train.errors import TrainError
from train.memory import estimate_rank_memory
from train.sharded import SHARDED_STATE, write_streamed_weights

ROOT = Path(__file__).resolve().parents[2]
# Sharded, each rank computes on half the global batch (as under DDP) and the gradients are
# reduce-scattered as their mean: the rounding differences of test_distributed.py (measured 1.8e-7 after
# 6 steps of TINY); over a resumed run they grow as there (1e-5 there too); the bound is 1e-5.
WEIGHT_ATOL = 1e-5
# c and FakeLN's std come from float64 sums of fp32 activations all-reduced over ranks (as under DDP)
STAT_TOL = 1e-6
FT = ["--steps", "6", "--eval-every", "3", "--batch-size", "4", "--seq-len", "16", "--eval-batches", "1",
      "--calib-batches", "2", "--corpus-stories", "200", "--quiet", "--threads", "1"]
METHOD_ARGS = {"fakeln": ["--fakeln-every", "1"], "all-taper": [], "internal-taper": [], "vanilla": []}


def _torchrun(module: str, argv: list, nproc: int = 2) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")   # a rank that aborts shows where
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m",
           module, *[str(a) for a in argv]]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: int = 300) -> tuple[str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, err[-3000:]
    return out, err


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def sharded_model_state(run_dir: Path, like: dict) -> dict:
    """The training model's tensors from a run's sharded resume state (read whole, in this process)."""
    import torch.distributed.checkpoint as dcp
    state = {"model": {k: torch.empty_like(v) for k, v in like.items()}}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")   # one process, on purpose
        dcp.load(state, checkpoint_id=str(run_dir / SHARDED_STATE), no_dist=True)
    return state["model"]


def test_train_fsdp_two_ranks_match_one_process_and_the_checkpoint_builds(tmp_path):
    proc = _torchrun("train", ["--out", tmp_path / "fsdp", *_argv(TINY), "--fsdp"])
    one = loop.train(TrainConfig(**TINY, out=str(tmp_path / "one")))
    out, err = _finish(proc)
    assert out.count("all-taper/tiny") == 1 and "memory per rank (estimated, sharded (--fsdp), 2 rank(s)" in out
    fsdp = json.loads((tmp_path / "fsdp" / loop.LOG_NAME).read_text())
    ref = load_file(str(tmp_path / "one" / "model.safetensors"))
    assert _max_diff(load_file(str(tmp_path / "fsdp" / "model.safetensors")), ref) <= WEIGHT_ATOL
    assert _max_diff(sharded_model_state(tmp_path / "fsdp", loop.load_run_state(tmp_path / "one")["model"]),
                     loop.load_run_state(tmp_path / "one")["model"]) <= WEIGHT_ATOL
    for name, c in one["calibration"]["c"].items():
        assert abs(fsdp["calibration"]["c"][name] - c) <= STAT_TOL, name
    assert fsdp["calibration"]["s_tgt"] == pytest.approx(one["calibration"]["s_tgt"], abs=STAT_TOL)
    assert [e["gate"] for e in fsdp["evals"]] == [e["gate"] for e in one["evals"]]
    par = fsdp["parallel"][0]
    assert (par["world_size"], par["fsdp"], par["backend"]) == (2, True, "gloo")
    # the optimizer state is sharded: rank 0 holds about half of one process's (shards round up)
    whole = one["parallel"][0]["measured"]["optimizer_state_bytes_rank0"]
    assert 0.45 * whole <= par["measured"]["optimizer_state_bytes_rank0"] <= 0.6 * whole
    model = load_checkpoint(tmp_path / "fsdp")              # the consolidated checkpoint is an ordinary one
    assert model.gate.value == 0.0 and model.taper_c() == pytest.approx(one["calibration"]["c"], abs=STAT_TOL)
    built = cli("export.build", ["--fuse", "--checkpoint", tmp_path / "fsdp", "--out", tmp_path / "build"])
    assert built.code == 0, built.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["build", "fsdp", "one"]   # no work directory left


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A 2-layer LayerNorm (GPT-2 architecture) model pretrained for 4 steps."""
    return pretrained_layernorm(tmp_path_factory.mktemp("fsdp") / "pre", steps=4)


@pytest.mark.parametrize("method", ["fakeln", "all-taper", pytest.param("internal-taper", marks=pytest.mark.slow),
                                    pytest.param("vanilla", marks=pytest.mark.slow)])
def test_finetune_fsdp_two_ranks_match_one_process(source, tmp_path, method):
    argv = ["--from", source, "--method", method, *FT, *METHOD_ARGS[method]]
    proc = _torchrun("train.finetune", [*argv, "--out", tmp_path / "fsdp", "--fsdp"])
    one = cli("train.finetune", [*argv, "--out", tmp_path / "one"])          # meanwhile, in this process
    out, err = _finish(proc)
    assert one.code == 0, one.err
    assert out.count(f"{method} from") == 1
    ref, ref_log = loop.load_run_state(tmp_path / "one")["model"], json.loads((tmp_path / "one" / loop.LOG_NAME).read_text())
    log = json.loads((tmp_path / "fsdp" / loop.LOG_NAME).read_text())
    assert _max_diff(sharded_model_state(tmp_path / "fsdp", ref), ref) <= WEIGHT_ATOL
    if method == "fakeln":            # the saved checkpoint holds gamma * 1e6 / std: compare it relatively
        assert [(e["step"], e["layer"]) for e in log["fakeln"]] == [(e["step"], e["layer"]) for e in ref_log["fakeln"]]
        for got, want in zip(log["fakeln"], ref_log["fakeln"]):
            assert got["std"] == pytest.approx(want["std"], rel=STAT_TOL, abs=0), (got, want)
        a, b = load_file(str(tmp_path / "fsdp" / "model.safetensors")), load_file(str(tmp_path / "one" / "model.safetensors"))
        assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], rtol=1e-4, atol=WEIGHT_ATOL) for k in a)
        assert json.loads((tmp_path / "fsdp" / "config.json").read_text())["eps"] == 1e12
    else:
        assert _max_diff(load_file(str(tmp_path / "fsdp" / "model.safetensors")),
                         load_file(str(tmp_path / "one" / "model.safetensors"))) <= WEIGHT_ATOL
    if method in ("all-taper", "internal-taper"):
        for layer, c in ref_log["calibration"]["c"].items():
            assert abs(log["calibration"]["c"][layer] - c) <= STAT_TOL, layer
    assert load_checkpoint(tmp_path / "fsdp").cfg == load_checkpoint(tmp_path / "one").cfg


def _kill_after_step(proc, out: Path, step: int) -> None:
    """SIGKILL torchrun and both ranks once `out` holds the checkpoint of `step` (the run goes on meanwhile)."""
    deadline = time.time() + 200
    while not (out / loop.LOG_NAME).is_file() or json.loads((out / loop.LOG_NAME).read_text())["step"] < step:
        assert proc.poll() is None and time.time() < deadline, f"no checkpoint of step {step}"
        time.sleep(0.01)
    for pid in [proc.pid, *_children(proc.pid)]:     # the ranks run in sessions of their own
        os.kill(pid, signal.SIGKILL)
    proc.communicate(timeout=60)


def _children(pid: int) -> list[int]:
    kids = [int(k) for task in Path(f"/proc/{pid}/task").iterdir()
            for k in (task / "children").read_text().split()]
    return kids + [d for k in kids for d in _children(k)]


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the ranks through /proc (Linux)")
def test_a_killed_fsdp_run_resumes_with_one_process_and_ends_as_an_uninterrupted_one(tmp_path):
    cfg = {**TINY, "steps": 12, "warmup_steps": 2, "taper_steps": 3, "eval_every": 1}
    out = tmp_path / "fsdp"
    proc = _torchrun("train", ["--out", out, *_argv(cfg), "--fsdp"])
    try:
        _kill_after_step(proc, out, 4)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    held = json.loads((out / loop.LOG_NAME).read_text())["step"]
    assert 4 <= held < 12 and (out / SHARDED_STATE).is_dir()
    resumed = loop.train(loop.resume_config(out), resume=True)   # one process reads the two ranks' shards
    alone = loop.train(TrainConfig(**cfg, out=str(tmp_path / "alone")))
    assert resumed["resumed_at"] == [held] and resumed["evals"][-1]["step"] == 12
    assert [(p["world_size"], p["fsdp"]) for p in resumed["parallel"]] == [(2, True), (1, False)]
    ref = loop.load_run_state(tmp_path / "alone")["model"]
    assert _max_diff(sharded_model_state(out, ref), ref) <= WEIGHT_ATOL
    assert _max_diff(load_file(str(out / "model.safetensors")),
                     load_file(str(tmp_path / "alone" / "model.safetensors"))) <= WEIGHT_ATOL
    assert [e["val_loss"] for e in resumed["evals"]] == pytest.approx([e["val_loss"] for e in alone["evals"]], abs=1e-5)


def test_streamed_weights_are_the_checkpoint_writers_file(tmp_path):
    """write_streamed_weights's own safetensors writer, against safetensors' (through save_checkpoint)."""
    from models.decoder import Decoder
    from train.loop import Recipe
    model = Decoder(TrainConfig(**TINY).decoder_config())
    save_checkpoint(model, tmp_path / "ref", None)
    write_streamed_weights(tmp_path / "streamed.safetensors", model, Recipe())
    a, b = load_file(str(tmp_path / "streamed.safetensors")), load_file(str(tmp_path / "ref" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_every_sharded_rank_runs_as_many_forwards(tmp_path):
    windows = torch.arange(7 * 3).view(7, 3)
    counts, rows = [], 0
    for rank in (0, 1):
        batches = list(Parallel(rank=rank, world_size=2, sharded=True).batches(windows, 2))
        counts.append(len(batches))
        rows += sum(len(b) for b in batches)
    assert counts == [2, 2] and rows == 7                   # rank 1's 3 rows: a batch of 2, one of 1
    assert len(list(Parallel(rank=1, world_size=2).batches(windows[:5], 1))) == 2
    assert len(list(Parallel(rank=1, world_size=2, sharded=True).batches(windows[:5], 1))) == 3   # one empty


def test_the_estimate_shards_what_fsdp_shards():
    cfg = TrainConfig(**TINY).decoder_config()
    ddp = estimate_rank_memory(cfg, 2, 16, world=2, fsdp=False)
    fsdp = estimate_rank_memory(cfg, 2, 16, world=2, fsdp=True)
    assert fsdp.optimizer * 2 == pytest.approx(ddp.optimizer, abs=8)      # shards round up: one element
    assert fsdp.activations == ddp.activations
    ckpt = estimate_rank_memory(cfg, 2, 16, world=2, fsdp=True, checkpoint=True)
    assert ckpt.activations < fsdp.activations
    assert fsdp.total < ddp.total
    # loading: DDP holds the model and its source whole; a sharded rank its shard and one whole tensor
    assert ddp.loading == 2 * 4 * cfg.approx_param_count()
    table = max(cfg.vocab_size, cfg.hidden) * cfg.d_model
    assert fsdp.loading == 4 * (-(-cfg.approx_param_count() // 2) + table) < ddp.loading
    assert fsdp.peak == max(fsdp.total, fsdp.loading)


def test_a_run_that_cannot_fit_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr("core.inputs.available_memory", lambda: 1 << 20)
    with pytest.raises(TrainError, match=r"training all-taper: needs about .* per rank \(replicated \(DDP\).*use --fsdp"):
        loop.train(TrainConfig(**TINY, out=str(tmp_path / "r")))
    assert list(tmp_path.iterdir()) == []


def test_checkpointed_activations_give_the_same_weights(tmp_path):
    """--checkpoint-activations recomputes each block in backward: the same arithmetic, the same weights."""
    cfg = {**TINY, "steps": 4, "eval_every": 4}
    loop.train(TrainConfig(**cfg, out=str(tmp_path / "plain")))
    log = loop.train(TrainConfig(**cfg, out=str(tmp_path / "ckpt"), checkpoint_activations=True))
    assert log["parallel"][0]["checkpoint_activations"] is True
    a, b = load_file(str(tmp_path / "plain" / "model.safetensors")), load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert _max_diff(a, b) <= 1e-7


# --- sharded building: each rank's rows only ----------------------------------------------------------

def _virtual_shards(model, rank: int, world: int) -> dict:
    """What shard_targets gives rank `rank` of `world` under fully_shard, as plain tensors (no process group)."""
    from train.sharded import shard_rows
    targets = {}
    for name, p in model.named_parameters():
        start, stop = shard_rows(p.shape[0], rank, world) if p.dim() else (0, 0)
        targets[name] = (torch.empty((stop - start, *p.shape[1:])) if p.dim() else torch.empty(()), start)
    return targets


def _build_rank(recipe, run, rank: int, world: int, fresh: bool = True) -> dict:
    """sharded_initial_model's filling for one virtual rank: {name: its local rows}."""
    import copy
    from train.sharded import fill_shards, meta_model, replay_init
    model, vectors, _ = meta_model(recipe, run)
    skeleton = copy.deepcopy(model)
    targets = _virtual_shards(model, rank, world)
    source = recipe.source_weights(run) if fresh else None
    fill_shards(targets, vectors, source)
    if fresh and source is None:
        replay_init(skeleton, targets, recipe.init_draws(run))
    return {k: t for k, (t, _) in targets.items()}


@pytest.mark.parametrize("world", [2, 3])
def test_replayed_init_gives_each_rank_the_rows_of_one_process(world):
    """`train` from scratch under --fsdp: the concatenated ranks' rows are torch.equal to one process's init
    (embed_std draws included, a tied head, 3 ranks: uneven shards), and the generator ends where it does."""
    from train.loop import Recipe
    run = TrainConfig(**{**TINY, "embed_std": 0.5}, out="unused")
    run.resolve()
    torch.manual_seed(7)
    plain = Recipe().initial_model(run, fresh=True)
    after = torch.get_rng_state()
    ranks = []
    for rank in range(world):
        torch.manual_seed(7)
        ranks.append(_build_rank(Recipe(), run, rank, world))
        assert torch.equal(torch.get_rng_state(), after)
    for name, p in plain.named_parameters():
        whole = torch.cat([r[name] for r in ranks]) if p.dim() else ranks[0][name]
        assert torch.equal(whole, p.detach()), name


def test_a_fresh_finetune_reads_each_ranks_rows_of_from(source):
    """train.finetune --fsdp (fakeln: FrozenStdLayerNorm, the std buffer): the ranks' rows are --from's
    weights; TaperNorm's gamma_tilde / beta_tilde (not in --from) are what one process builds."""
    from train.finetune import build_parser, finetune_config
    from train.recipes import FineTune
    for method in ("fakeln", "internal-taper"):
        a = build_parser().parse_args(["--from", str(source), "--method", method, "--out", "unused", *FT])
        recipe = FineTune(method, str(source), 1)
        run = finetune_config(method, recipe.source_weights(None), a)
        run.resolve()
        plain = recipe.initial_model(run, fresh=True)
        ranks = [_build_rank(recipe, run, rank, 2) for rank in (0, 1)]
        for name, p in plain.named_parameters():
            assert torch.equal(torch.cat([r[name] for r in ranks]), p.detach()), (method, name)


PEAK_SCRIPT = r"""
import json, resource, sys, torch
from models.decoder import Decoder, DecoderConfig
from models.checkpoint import save_checkpoint
from tests.train.test_fsdp import _build_rank
from train.config import TrainConfig
from train.loop import Recipe
from train.recipes import FineTune
cfg = dict(vocab_size=512, d_model=256, n_layer=32, n_head=4, max_seq_len=64, norm="layernorm")
mode, src = sys.argv[1], sys.argv[2]
if mode == "write":
    save_checkpoint(Decoder(DecoderConfig(**cfg)), src, None)
    print(json.dumps({"grew": 0, "model": 0}))
    sys.exit(0)
torch.set_num_threads(1)
run = TrainConfig(preset="layernorm", out="unused", model=cfg, steps=1, seq_len=32, progress=False)
run.resolve()
recipe = Recipe() if mode == "scratch" else FineTune("vanilla", src)
def peak():                     # the high-water mark of resident memory since the reset below
    line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024
def current():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize()
with torch.device("meta"):    # torch's first meta-device use loads ~70 MB of its own, whatever the model
    Decoder(DecoderConfig(**{**cfg, "n_layer": 1}))
# the peak so far (imports) may exceed what the build adds: reset the high-water mark to now
open("/proc/self/clear_refs", "w").write("5")
before = current()
if mode.startswith("whole"):      # what a rank did before: the whole model (and, fine-tuning, --from whole)
    model = recipe.initial_model(run, fresh=True)
    if mode == "whole-from":
        from train.recipes import load_source_model
        other = load_source_model(src)
else:
    rows = _build_rank(recipe, run, 0, 2)
print(json.dumps({"grew": peak() - before, "model": 4 * Decoder(run.decoder_config()).num_params()}))
"""


def _peak_growth(mode: str, src: Path) -> tuple[int, int]:
    done = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, mode, str(src)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.splitlines()[-1])
    return got["grew"], got["model"]


def test_no_rank_builds_the_whole_model(tmp_path):
    """Peak resident memory of building rank 0's half of a 26M-parameter model (105 MB of fp32 weights, 32
    layers: its largest tensor 1 MB), each in a fresh process: from --from and from scratch it grows by
    well under the whole model; building it whole (what a rank did before) grows by at least the model,
    which this measurement sees (the test can fail)."""
    src = tmp_path / "src"
    _peak_growth("write", src)
    for mode in ("from", "scratch"):
        grew, model = _peak_growth(mode, src)
        assert grew < 0.8 * model, (mode, grew, model)       # half the model (0.5), one tensor, allocator slack
    grew, model = _peak_growth("whole-from", src)
    # at least the whole model (measured 1.3x-3.1x: --from's pages are memory-mapped, and how many of
    # them count as resident when the peak is read varies from run to run)
    assert grew > 1.0 * model, (grew, model)


@pytest.mark.parametrize("command", ["train", "train.finetune"])
def test_a_full_disk_under_fsdp_is_one_line_from_rank_0(command, source, small_fs):
    """No room for the sharded resume state every rank writes: both ranks fail in it, rank 0 alone says so."""
    out = small_fs.mount("64k") / "fsdp"
    argv = _argv(TINY) if command == "train" else ["--from", source, "--method", "all-taper", *FT]
    proc = _torchrun(command, ["--out", out, *argv, "--fsdp"])
    try:
        _, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    ours = [line for line in err.splitlines() if line.startswith("error:")]
    assert proc.returncode != 0 and ours == [f"error: {out / SHARDED_STATE}: No space left on device; nothing was "
                                             "written (free space or choose another --out)"], err[-3000:]
    assert "Traceback" not in err.split(ours[0])[0]                  # (torchrun's own report follows the line)
    assert list(out.parent.iterdir()) == []


def test_streamed_weights_that_do_not_fit_name_their_file(tmp_path, small_fs):
    """The consolidated weights on a full disk (in one process): the error names the file."""
    from models.decoder import Decoder
    from train.loop import Recipe
    model = Decoder(TrainConfig(**TINY).decoder_config())
    path = small_fs.mount("64k") / "model.safetensors"
    with pytest.raises(OSError) as caught:
        write_streamed_weights(path, model, Recipe())
    assert (caught.value.errno, caught.value.filename) == (errno.ENOSPC, str(path))


# --- resuming a sharded run: before calibration, and a folder that must not run code ------------------

def _held_sharded_run(out: Path, preset: str, monkeypatch, warmup_steps: int = 4, held: int = 2) -> dict:
    """A one-process --fsdp run (the sharded resume state, train_state.dcp) stopped after its first
    checkpoint, step `held`; by default before calibration at step 4: gamma_tilde has had no gradient, so
    no optimizer state."""
    cfg = {**TINY, "preset": preset, "steps": 6, "warmup_steps": warmup_steps, "taper_steps": 1, "eval_every": held,
           "fsdp": True}
    save = loop._save_run

    def save_then_stop(*a, **k):
        save(*a, **k)
        raise KeyboardInterrupt
    with monkeypatch.context() as m:
        m.setattr(loop, "_save_run", save_then_stop)
        with pytest.raises(KeyboardInterrupt):
            loop.train(TrainConfig(**cfg, out=str(out)))
    assert json.loads((out / loop.LOG_NAME).read_text())["step"] == held
    return cfg


@pytest.mark.parametrize("preset", ["internal-taper", "all-taper"])
def test_a_sharded_run_resumes_before_calibration_as_an_uninterrupted_one(tmp_path, monkeypatch, preset):
    """Resumed before calibration, every rank stopped at `Missing key ... weight_tilde.step` (a traceback):
    the folder has no optimizer state for gamma_tilde, a fresh optimizer's state dict has one."""
    cfg = _held_sharded_run(tmp_path / "held", preset, monkeypatch)
    resumed = cli("train", ["--out", tmp_path / "held", "--resume", "--quiet"])
    assert resumed.code == 0, resumed.err
    loop.train(TrainConfig(**cfg, out=str(tmp_path / "alone")))
    assert _max_diff(load_file(str(tmp_path / "held" / "model.safetensors")),
                     load_file(str(tmp_path / "alone" / "model.safetensors"))) <= WEIGHT_ATOL


class _Touch:
    """Unpickled, runs os.system('touch PATH')."""
    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return os.system, (f"touch {self.path}",)


@pytest.fixture(scope="module")
def held_sharded(tmp_path_factory):
    mp = pytest.MonkeyPatch()
    try:
        out = tmp_path_factory.mktemp("held") / "run"
        _held_sharded_run(out, "internal-taper", mp, warmup_steps=1, held=4)   # tapered: every parameter has state
    finally:
        mp.undo()
    return out


def _crafted_copy(held: Path, tmp_path: Path, how: str) -> tuple[Path, Path]:
    """A copy of the held run whose sharded state carries a payload that touches a file if it runs."""
    import io
    import pickle
    import shutil
    from train.sharded import read_sharded_metadata
    run, touched = tmp_path / "run", tmp_path / "ran"
    shutil.copytree(held, run)
    dcp_dir = run / SHARDED_STATE
    if how == "metadata":         # dcp's FileSystemReader.read_metadata: pickle.load
        (dcp_dir / ".metadata").write_bytes(pickle.dumps(_Touch(touched)))
    elif how == "bytes item":     # dcp's DefaultLoadPlanner.load_bytes: torch.load(weights_only=False)
        md = read_sharded_metadata(dcp_dir)
        index, info = next((i, v) for i, v in md.storage_data.items() if i.fqn.startswith("optimizer.param_groups"))
        shard = dcp_dir / info.relative_path
        buf = io.BytesIO()
        torch.save(_Touch(touched), buf)                        # as dcp writes its items
        payload = buf.getvalue()
        md.storage_data[index] = type(info)(info.relative_path, shard.stat().st_size, len(payload))
        with open(shard, "ab") as f:
            f.write(payload)
        (dcp_dir / ".metadata").write_bytes(pickle.dumps(md))
    elif how == "truncated":
        shard = next(dcp_dir.glob("*.distcp"))
        shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 3])
    elif how == "garbage":
        (dcp_dir / ".metadata").write_bytes(b"\x80\x04not a pickle")
    return run, touched


@pytest.mark.parametrize("how, said", [
    ("metadata", r"train_state.dcp/.metadata: expected the metadata of a sharded resume state .* found a pickle "
                 r"that calls posix.system; refused, because loading it could run code"),
    ("bytes item", r"train_state.dcp: expected the sharded resume state .* cannot load \(item optimizer.param_groups"
                   r".* refused by torch's weights-only reader: Trying to load unsupported GLOBAL posix.system"),
    ("truncated", r"train_state.dcp: expected the sharded resume state .* cannot load \(PytorchStreamReader"),
    ("garbage", r"train_state.dcp/.metadata: expected the metadata .* found a damaged pickle")])
def test_a_crafted_or_damaged_sharded_state_runs_nothing_and_is_one_line(held_sharded, tmp_path, how, said):
    """--resume reads train_state.dcp without running code: torch.distributed.checkpoint unpickles .metadata
    with pickle.load and its non-tensor items with weights_only=False, and a crafted file's payload ran."""
    import re
    from core.errors import first_line
    run, touched = _crafted_copy(held_sharded, tmp_path, how)
    before = sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*"))
    try:
        r = cli("train", ["--out", run, "--resume", "--quiet"])
    except BaseException as e:     # dcp's CheckpointException is one: it escaped the command as a traceback
        r = e
    assert not touched.exists(), "the payload ran"
    assert not isinstance(r, BaseException), f"a traceback: {first_line(r)}"
    err = [ln for ln in r.err.splitlines() if ln.strip()]
    assert r.code == 1 and len(err) == 1 and re.search(said, err[0]), r.err
    assert "Traceback" not in r.err and "start a new run in another --out" in err[0]
    assert sorted((p.relative_to(run), p.stat().st_mtime_ns) for p in run.rglob("*")) == before


def test_torchs_unexpected_pos_on_a_full_file_system_is_no_room(tmp_path, small_fs):
    """torch.save's zip writer sometimes meets a full disk as "unexpected pos" with no OSError behind it (seen
    once under --fsdp): where the file system has no room left that is ENOSPC, anywhere else a bug (None)."""
    import errno as errno_
    from train.distributed import _room_errno
    full = small_fs.mount("64k")
    with pytest.raises(OSError):
        with open(full / "filler", "wb") as f:
            while True:
                f.write(b"\0" * 4096)
    e = RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    assert _room_errno(e, full / "fsdp" / SHARDED_STATE) == errno_.ENOSPC
    assert _room_errno(e, tmp_path / "fsdp" / SHARDED_STATE) is None
    assert _room_errno(RuntimeError("something else"), full / "fsdp" / SHARDED_STATE) is None
