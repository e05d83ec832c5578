"""Data-parallel training: torchrun --nproc-per-node 2 (gloo, CPU) against one process, --grad-accum,
and a rank killed mid-run (one line, the last checkpoint intact, --resume with one process)."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from models.checkpoint import load_checkpoint
from train.config import TrainConfig
from train.errors import TrainError
from train.loop import resume_config, train

ROOT = Path(__file__).resolve().parents[2]
# Ranks see half the global batch each: a matmul over 2 rows plus a matmul over 2 rows, averaged,
# rounds differently from one matmul over 4 rows (fp32, ~1e-7 relative per step); a few steps of
# AdamW keep the weights within this of each other.
WEIGHT_ATOL = 1e-6
# Over 20 steps the rounding differences grow: k_proj's bias has a true gradient of exactly 0 (a shift
# of every key score of a query leaves its softmax unchanged), so its gradient is rounding noise, which
# AdamW divides by its own running size; measured 1.1e-6 after 20 steps (2 of them on 2 ranks).
RESUMED_ATOL = 1e-5
# c comes from float64 sums of fp32 activations; the ranks' activations are those of one process
C_ATOL = 1e-6

TINY = dict(preset="all-taper", size="tiny", steps=6, warmup_steps=2, taper_steps=2, eval_every=3, batch_size=4,
            seq_len=16, eval_batches=1, calib_batches=1, corpus_stories=100, progress=False, threads=1,
            model=dict(d_model=16, n_layer=2, n_head=2, max_seq_len=32))


def _argv(cfg: dict) -> list[str]:
    flags = {"preset": cfg["preset"], "steps": cfg["steps"], "warmup-steps": cfg["warmup_steps"],
             "taper-steps": cfg["taper_steps"], "eval-every": cfg["eval_every"], "batch-size": cfg["batch_size"],
             "seq-len": cfg["seq_len"], "eval-batches": cfg["eval_batches"], "calib-batches": cfg["calib_batches"],
             "corpus-stories": cfg["corpus_stories"], "threads": 1, **{k.replace("_", "-"): v for k, v in cfg["model"].items()}}
    return [x for k, v in flags.items() for x in (f"--{k}", str(v))] + ["--quiet"]


def _torchrun(out: Path, cfg: dict, **popen):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONFAULTHANDLER="1")   # a rank that aborts shows where
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "train",
           "--out", str(out), *_argv(cfg)]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def _weights(out: Path) -> dict:
    return load_file(str(out / "model.safetensors"))


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_two_ranks_and_grad_accum_match_one_process(tmp_path):
    proc = _torchrun(tmp_path / "ddp", TINY)
    one = train(TrainConfig(**TINY, out=str(tmp_path / "one")))
    accum = train(TrainConfig(**TINY, out=str(tmp_path / "accum"), grad_accum=2))
    out, err = proc.communicate(timeout=240)
    assert proc.returncode == 0, err[-3000:]
    assert out.count("all-taper/tiny") == 1                         # rank 0 reports; rank 1 stays quiet
    ddp = json.loads((tmp_path / "ddp" / "train_log.json").read_text())
    w_one = _weights(tmp_path / "one")
    assert _max_diff(_weights(tmp_path / "ddp"), w_one) <= WEIGHT_ATOL
    assert _max_diff(_weights(tmp_path / "accum"), w_one) <= WEIGHT_ATOL
    for log in (ddp, accum):
        assert log["calibration"]["c"].keys() == one["calibration"]["c"].keys()
        for name, c in one["calibration"]["c"].items():
            assert abs(log["calibration"]["c"][name] - c) <= C_ATOL, name
        assert log["calibration"]["s_tgt"] == pytest.approx(one["calibration"]["s_tgt"], abs=C_ATOL)
        assert [e["gate"] for e in log["evals"]] == [e["gate"] for e in one["evals"]]
        assert [e["val_loss"] for e in log["evals"]] == pytest.approx([e["val_loss"] for e in one["evals"]], abs=1e-5)
    setup = {"from_step": 0, "world_size": 2, "per_rank_batch": 2, "micro_batch": 2, "grad_accum": 1, "global_batch": 4,
             "backend": "gloo", "device": "cpu", "dtype": "fp32", "fsdp": False, "checkpoint_activations": False}
    assert [{k: p[k] for k in setup} for p in ddp["parallel"]] == [setup]
    assert ddp["parallel"][0]["memory_estimate"]["optimizer"] > 0          # the estimate printed before step 0
    assert accum["parallel"][0]["micro_batch"] == 2 and accum["parallel"][0]["world_size"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["accum", "ddp", "one"]   # no work directory left


def _descendants(pid: int) -> list[int]:
    kids = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            pass
    return kids + [d for k in kids for d in _descendants(k)]


def _rank(pid: int) -> int | None:
    try:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    return next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)


def _kill_rank_1_after_step(proc, out: Path, step: int, result: dict) -> None:
    deadline = time.time() + 180
    while not (out / "train_log.json").is_file() or json.loads((out / "train_log.json").read_text())["step"] < step:
        if proc.poll() is not None or time.time() > deadline:
            result["error"] = f"no checkpoint of step {step}"
            return
        time.sleep(0.02)
    rank1 = [p for p in _descendants(proc.pid) if _rank(p) == 1]
    result["killed"] = rank1
    if len(rank1) == 1:
        os.kill(rank1[0], signal.SIGKILL)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds rank 1's process through /proc (Linux)")
def test_killing_rank_1_stops_the_job_with_one_line_and_one_process_resumes(tmp_path):
    import threading
    cfg = {**TINY, "steps": 20, "warmup_steps": 1, "taper_steps": 3, "eval_every": 1}
    out = tmp_path / "ddp"
    proc = _torchrun(out, cfg)
    killer = {}
    watch = threading.Thread(target=_kill_rank_1_after_step, args=(proc, out, 2, killer))
    watch.start()
    try:
        alone = train(TrainConfig(**cfg, out=str(tmp_path / "alone")))     # the reference, meanwhile
        watch.join(timeout=200)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "error" not in killer and len(killer["killed"]) == 1, (killer, err[-3000:])
    assert proc.returncode != 0
    ours = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(ours) == 1, err[-3000:]                                # torchrun's own report follows it
    held = json.loads((out / "train_log.json").read_text())["step"]
    assert 2 <= held < 20 and f"holds the checkpoint of step {held}" in ours[0] and "--resume" in ours[0]
    assert ours[0].startswith(("error: rank 0 of 2: lost contact with another rank", "error: training interrupted"))
    assert load_checkpoint(out).gate.value == json.loads((out / "config.json").read_text())["gate"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["alone", "ddp"]   # the last checkpoint, nothing else

    resumed = train(resume_config(out), resume=True)                  # one process continues the two-rank run
    assert resumed["resumed_at"] == [held] and resumed["evals"][-1]["step"] == 20
    assert [(s["from_step"], s["world_size"], s["per_rank_batch"]) for s in resumed["parallel"]] == [(0, 2, 2), (held, 1, 4)]
    assert [e["step"] for e in resumed["evals"]] == [e["step"] for e in alone["evals"]]
    assert _max_diff(_weights(out), _weights(tmp_path / "alone")) <= RESUMED_ATOL


def test_a_global_batch_that_does_not_split_is_one_line(tmp_path, monkeypatch):
    with pytest.raises(TrainError, match=r"--batch-size 4: expected a multiple of 1 process\(es\) x --grad-accum 3 = 3"):
        train(TrainConfig(**TINY, out=str(tmp_path / "r"), grad_accum=3))
    monkeypatch.setenv("WORLD_SIZE", "3")                            # as torchrun --nproc-per-node 3 would
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(TrainError, match=r"expected a multiple of 3 process\(es\) x --grad-accum 1 = 3"):
        train(TrainConfig(**TINY, out=str(tmp_path / "r")))
    assert not (tmp_path / "r").exists()


def test_bf16_is_refused_on_the_cpu(tmp_path):
    with pytest.raises(TrainError, match="--dtype bf16: bf16 autocast is for CUDA"):
        TrainConfig(**TINY, out=str(tmp_path / "r"), dtype="bf16").resolve()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message where no CUDA device exists")
def test_cuda_without_a_device_is_one_line(tmp_path):
    with pytest.raises(TrainError, match="--device cuda: no CUDA device is visible"):
        train(TrainConfig(**TINY, out=str(tmp_path / "r"), device="cuda"))
    assert not (tmp_path / "r").exists()


def test_a_full_disk_mid_run_is_one_line_from_rank_0_and_keeps_the_last_checkpoint(tmp_path, small_fs):
    """Room for one checkpoint and not for two (an output is replaced only once its successor is whole): the
    checkpoint of step 2 fails, rank 0 names the one of step 1 that --out still holds, rank 1 stays quiet."""
    cfg = {**TINY, "steps": 3, "warmup_steps": 1, "taper_steps": 1, "eval_every": 1}
    one = tmp_path / "one"
    train(TrainConfig(**{**cfg, "steps": 1}, out=str(one)))                  # how much one checkpoint takes
    size = sum(p.stat().st_size for p in one.iterdir())
    fs = small_fs.mount(str(size * 3 // 2))
    out = fs / "ddp"
    proc = _torchrun(out, cfg)
    _, err = proc.communicate(timeout=240)
    assert proc.returncode != 0
    ours = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(ours) == 1 and "Traceback" not in err.split(ours[0])[0], err[-3000:]   # torchrun's own report follows
    assert ours[0].startswith(f"error: {out}/") and ("No space left on device at the checkpoint of step 2; "
                                                     f"{out} holds the last complete checkpoint, of step 1") in ours[0]
    assert json.loads((out / "train_log.json").read_text())["step"] == 1
    load_checkpoint(out)
    assert sorted(p.name for p in fs.iterdir()) == ["ddp"]                    # no temporary left


def _launch(launcher: str, out: Path, cfg: dict) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", launcher, "--standalone", "--nproc-per-node", "2", "-m", "train", "--out", str(out),
           *_argv(cfg)]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_a_user_error_under_torchrun_is_one_line_from_rank_0(tmp_path):
    """Every rank meets the same refusal (--out holds the user's files): rank 0 says it, the others exit
    1 as quietly (each printed it). train.launch, torchrun with the project's contract, then prints
    nothing more and exits 1: stock torchrun adds its ChildFailedError traceback."""
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    procs = {name: _launch(name, tmp_path / "mine", TINY) for name in ("torch.distributed.run", "train.launch")}
    results = {name: (p.communicate(timeout=120), p.returncode) for name, p in procs.items()}
    for name, ((_, err), rc) in results.items():
        ours = [line for line in err.splitlines() if line.startswith("error:")]
        assert rc == 1 and len(ours) == 1 and "exists and holds files tapernorm-deploy did not write" in ours[0], err
    (_, err), _ = results["train.launch"]
    assert err.strip().splitlines() == [ours[0]]                    # no traceback, no launcher warnings
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]


def test_ctrl_c_to_the_launcher_is_one_line_and_exit_130(tmp_path):
    """train.launch stopped by SIGINT (the terminal's Ctrl-C reaches the launcher alone: the ranks run in
    sessions of their own) forwards it to the ranks: rank 0's one line says what the run directory holds,
    and the exit status is 130 (torchrun's own: a SignalException traceback and 1)."""
    out = tmp_path / "run"
    proc = _launch("train.launch", out, {**TINY, "steps": 100_000, "eval_every": 1})
    try:
        deadline = time.time() + 120
        while not (out / "train_log.json").is_file():
            assert proc.poll() is None and time.time() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err[-3000:]
    assert len(err.strip().splitlines()) == 1 and err.startswith("error: training interrupted; ") and \
        "holds the checkpoint of step" in err, err[-3000:]
    assert load_checkpoint(out).cfg.n_layer == 2


def test_the_launcher_reports_a_rank_killed_by_a_signal():
    from train.launch import exit_code_of
    assert [exit_code_of(c) for c in (0, 1, 2, 130, -9, -15)] == [0, 1, 2, 130, 137, 143]
