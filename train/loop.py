"""The training loop: warmup at g = 1, calibration, cosine taper to g = 0, training on at g = 0.

    run = TrainConfig(preset="internal-taper", size="tiny", out="runs/it")
    summary = train(run)                       # a new run into a new (or empty) --out
    summary = train(run, resume=True)          # continue the run --out holds

`out` holds the run (core.outputs kind "training-run"): every `eval_every` steps and
at the end the loop evaluates on the held-out split, appends the numbers to the JSON
log and replaces `out` atomically with the checkpoint (config.json with the current
gate and each layer's c, model.safetensors, tokenizer.json, train_log.json) plus
the resume state (train/run_state.py: safetensors + JSON, never a pickle): model and optimizer
state, the data sampler's and torch's RNG, calibration and scale-loss state, the log. Killing the process leaves
the last complete checkpoint. Nothing is written before the first evaluation after
step 0, so `out` never goes back to an earlier step than it holds; a new run into a
directory that holds a run is refused (resume it, or choose another --out).

Data parallel (torchrun; train.distributed): every rank builds the same model and draws
the same global batch of `batch_size` windows per step; rank r reads its own share
(windows r * B / N .. (r + 1) * B / N, in `grad_accum` micro-batches), DDP averages the
gradients, and evaluation, calibration and s_tgt sums are all-reduced, so the gate, c and
the scale loss are identical on every rank and equal (to rounding) to one process with the
same global batch. Only rank 0 writes `out`; the resume state holds nothing per-rank, so a run
resumes with any number of processes. The log's "parallel" list records, from each start
or resume on, the world size, per-rank batch, micro-batch, backend, device and dtype.

Sharded (--fsdp; train/sharded.py): the same loop with every block, the embedding / head and the root
fully_shard-ed instead of DDP; each rank holds 1/N of the weights, gradients and AdamW state, every rank
writes its shards of the resume state (train_state.dcp) into rank 0's temporary run folder, and the
consolidated model.safetensors is streamed into it tensor by tensor. Before step 0 rank 0 prints the
estimate of one rank's memory (train/memory.py); a run that cannot fit stops there with one line.

A Recipe (train/finetune.py) changes where a run starts and what happens around
the schedule: the model it starts from, an action before each step (e.g. fixing a
norm's std), and the model a checkpoint saves; the default trains from scratch.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import shlex
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer

from core.errors import NoRoomError
from core.outputs import TRAINING_RUN, check_output_dir, marker_kind, naming_output, output_dir, temporary_dir, writing
from models.checkpoint import CONFIG, TOKENIZER, WEIGHTS, checkpoint_config, save_checkpoint
from models.decoder import Decoder
from train.calibration import branch_mismatch, calibrate
from train.config import TrainConfig
from train.corpus import EOS, load_corpus, split_stories
from train.distributed import (SINGLE, Parallel, RankError, data_parallel, ignore_launcher_stop, launched_world,
                               peer_lost, peer_lost_reason, writing_together)
from train.errors import TrainError
from train.scale_loss import scale_loss, token_rms
from train.interrupts import raise_if_interrupted
from train.run_state import (RUN_STATE, RUN_STATE_JSON, has_run_state, load_run_state, refuse_old_state,
                             restore_error, write_run_state)
from train.schedule import lr_at
from train.sharded import (SHARDED_STATE, all_finite, checkpoint_blocks, load_sharded_state, save_sharded_state,
                           sharded_initial_model, sharded_state_bytes, write_streamed_weights)
from train.shards import TokenStream, shards_for
from train.tokenizer import encode_stories, load_tokenizer, train_tokenizer

LOG_NAME = "train_log.json"


# --- data ----------------------------------------------------------------------------

@dataclass
class Data:
    train: TokenStream            # the training token stream (in memory, or memory-mapped shards)
    val: torch.Tensor             # [n_val, seq_len + 1] fixed windows
    calib: torch.Tensor           # [n_calib, seq_len + 1] fixed windows
    tokenizer_json: Path | None   # copied into every checkpoint (rank 0; None on other ranks)
    stats: dict


def _windows(stream: TokenStream, seq_len: int, n: int, what: str) -> torch.Tensor:
    w = seq_len + 1
    avail = len(stream) // w
    if avail == 0:
        raise TrainError(f"corpus {what} split: {len(stream)} tokens; expected at least {w} (one window of --seq-len + 1); use a larger corpus or a shorter --seq-len")
    return torch.from_numpy(stream.read(0, min(n, avail) * w)).view(-1, w)


def prepare_data(run: TrainConfig, workdir: Path | None, par: Parallel = SINGLE) -> Data:
    """The token streams of `run`: --data's memory-mapped shards, or the corpus tokenized in memory.

    Every rank builds the same Data; work that must happen once (fitting a tokenizer,
    tokenizing --data into shards) runs on rank 0 and is shared with the others."""
    streams, stats, tok_path = _shard_streams(run, par) if run.data else _memory_streams(run, workdir, par)
    if len(streams["train"]) <= run.seq_len + 1:
        raise TrainError(f"corpus {run.data or run.corpus}: train split has {len(streams['train'])} tokens; expected more "
                         f"than --seq-len + 1 = {run.seq_len + 1}; use a larger corpus")
    n_eval = run.eval_batches * run.batch_size
    n_cal = run.calib_batches * run.batch_size
    return Data(streams["train"], _windows(streams["val"], run.seq_len, n_eval, "val"),
                _windows(streams["calib"], run.seq_len, n_cal, "calibration"), tok_path, stats)


def _memory_streams(run: TrainConfig, workdir: Path | None, par: Parallel):
    stories = load_corpus(run.corpus, n_stories=run.corpus_stories, limit=run.corpus_limit)
    raise_if_interrupted()
    split = split_stories(stories)
    vocab = run.decoder_config().vocab_size
    if run.tokenizer == "train":
        tok_text = train_tokenizer(split["train"], vocab).to_str() if par.is_main else None
        tok = Tokenizer.from_str(par.broadcast(tok_text))     # one tokenizer, fitted once, on every rank
        tok_path = None
        with writing_together(par, workdir):
            if workdir is not None:
                tok_path = workdir / "tokenizer.json"
                tok.save(str(tok_path))
    else:
        tok_path = Path(run.tokenizer)
        if not tok_path.is_file():
            raise TrainError(f"tokenizer {tok_path}: not found; pass an existing tokenizer.json, or --tokenizer train")
        tok = load_tokenizer(tok_path)
    if tok.token_to_id(EOS) is None:
        raise TrainError(f"tokenizer {tok_path}: has no {EOS} token; expected one (it ends every story); "
                         "pass a tokenizer that has it, or --tokenizer train")
    if tok.get_vocab_size() > vocab:
        raise TrainError(f"tokenizer {tok_path or 'train'}: vocab {tok.get_vocab_size()} exceeds the model's vocab_size {vocab}; raise --vocab-size")
    ids = {k: np.asarray(encode_stories(tok, v), dtype=np.int64) for k, v in split.items()}
    stats = {"stories": {k: len(v) for k, v in split.items()}, "tokens": {k: len(v) for k, v in ids.items()},
             "tokenizer_vocab": tok.get_vocab_size()}
    return {k: TokenStream([v]) for k, v in ids.items()}, stats, tok_path


def _shard_streams(run: TrainConfig, par: Parallel):
    tok_path = Path(run.tokenizer)
    if not tok_path.is_file():
        raise TrainError(f"tokenizer {tok_path}: not found; pass an existing tokenizer.json")
    if par.is_main:                       # tokenizes --data once (when its shards do not exist yet)
        shards = shards_for(run.data, run.shard_dir(), tok_path, progress=run.progress)
    par.barrier()
    if not par.is_main:
        shards = shards_for(run.data, run.shard_dir(), tok_path, progress=False)
    vocab = run.decoder_config().vocab_size
    if shards.meta["vocab_size"] > vocab:
        raise TrainError(f"{shards.directory}: tokenized with a vocab of {shards.meta['vocab_size']}, the model's "
                         f"vocab_size is {vocab}; raise --vocab-size")
    return shards.streams, shards.stats(), tok_path if par.is_main else None


def window_batches(windows: torch.Tensor, batch_size: int, device: torch.device | None = None):
    for i in range(0, len(windows), batch_size):
        yield windows[i:i + batch_size].to(device) if device is not None else windows[i:i + batch_size]


def _draw_starts(stream: TokenStream, batch_size: int, seq_len: int, gen: torch.Generator) -> list[int]:
    """Start offsets of one global batch of windows; every rank draws the same ones."""
    return torch.randint(0, len(stream) - seq_len - 1, (batch_size,), generator=gen).tolist()


def _sample(stream: TokenStream, batch_size: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    return stream.windows(_draw_starts(stream, batch_size, seq_len, gen), seq_len + 1)  # [B, T + 1]


# --- evaluation -----------------------------------------------------------------------

@torch.no_grad()
def evaluate(model: Decoder, windows: torch.Tensor, batch_size: int, par: Parallel = SINGLE,
             autocast=contextlib.nullcontext) -> dict:
    """Val loss, mean pre-logit RMS (per-token r of the head's input) and max |logit|.

    Each rank evaluates its share of `windows`; the sums are all-reduced."""
    was = model.training
    model.eval()
    loss_sum, n_tok, rms_sum, max_logit = 0.0, 0, 0.0, 0.0
    for w in par.batches(windows, batch_size):
        with autocast():
            logits, h = model(w[:, :-1], return_hidden=True)
        if len(w) == 0:           # a sharded rank's extra forward (train.distributed.Parallel.batches)
            continue
        loss_sum += float(F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), w[:, 1:].reshape(-1),
                                          reduction="sum"))
        n_tok += w[:, 1:].numel()
        rms_sum += float(token_rms(h.float()).sum())
        max_logit = max(max_logit, float(logits.abs().max()))
    model.train(was)
    loss_sum, n_tok, rms_sum = par.sum([loss_sum, n_tok, rms_sum])
    max_logit = par.max(max_logit)
    return {"val_loss": loss_sum / n_tok, "prelogit_rms": rms_sum / n_tok, "max_abs_logit": max_logit}


@torch.no_grad()
def mean_prelogit_rms(model: Decoder, windows: torch.Tensor, batch_size: int, par: Parallel = SINGLE) -> float:
    return evaluate(model, windows, batch_size, par)["prelogit_rms"]


# --- the loop ---------------------------------------------------------------------------

def _optimizer(model: Decoder, lr: float, wd: float) -> torch.optim.Optimizer:
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]  # norm gains, biases, DyT alpha
    return torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95))


def check_out(run: TrainConfig, resume: bool) -> int:
    """Refuse an --out this run may not write; returns the step the held run reached (0 for a new run)."""
    out = Path(run.out)
    inputs = [p for p in (run.tokenizer, run.corpus) if p not in ("train", "generated") and not str(p).startswith("hf:")]
    if run.data is not None:       # --out never is, or holds, the data or its shards
        inputs += [run.data, run.shard_dir()]
    check_output_dir(out, TRAINING_RUN, inputs=inputs)
    held = None
    if marker_kind(out) == TRAINING_RUN.name:
        held = read_state_step(out)
        held = "unknown" if held is None or not has_run_state(out) else held
    if resume:
        refuse_old_state(out)
        if held in (None, "unknown"):
            raise TrainError(f"--out {out}: holds no training run to resume (no {RUN_STATE}); start a new run without --resume")
        return int(held)
    if held is not None:
        raise TrainError(f"--out {out}: holds a training run at step {held}; continue it with --resume, "
                         "or choose a new --out (a new run never replaces a later step)")
    return 0


def read_state_step(out: Path) -> int | None:
    try:
        return int(json.loads((Path(out) / LOG_NAME).read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


class Recipe:
    """Where a run starts and what it does besides the gate schedule; this default trains from scratch."""

    program = "python -m train"       # the command that resumes a run of this recipe (named in messages)

    def describe(self) -> dict | None:
        """Recorded in the log as "recipe" (and read back on --resume by whoever made the recipe)."""
        return None

    def initial_model(self, run: TrainConfig, fresh: bool) -> Decoder:
        """The model before step 0 (fresh) or, on resume, a model of the same structure to load the state into."""
        model = Decoder(run.decoder_config())
        with torch.no_grad():
            for name, draw in self.init_draws(run):
                draw(model.get_parameter(name))
        return model

    def init_draws(self, run: TrainConfig) -> list[tuple[str, Callable[[torch.Tensor], None]]]:
        """The random draws initial_model makes after the Decoder's own init, in order: (parameter, in-place
        draw). Listed apart so that a sharded build (train/sharded.py) replays them one tensor at a time."""
        if run.embed_std is None:
            return []
        draw = functools.partial(torch.nn.init.normal_, mean=0.0, std=run.embed_std)
        # the learned position table only where the model has one: a rope model (--arch qwen3 / gemma3 / llama)
        # has no wpe (it raised "Decoder has no attribute 'wpe'" for --preset dyt, whose embed_std draws here)
        tables = ("wte.weight", "wpe.weight") if run.decoder_config().pos_embedding == "learned" else ("wte.weight",)
        return [(name, draw) for name in tables]

    def source_weights(self, run: TrainConfig):
        """Where a fresh run's weights are read from when --fsdp fills each rank's shards: a
        models.weights.WeightSource, or None (drawn as initial_model draws them)."""
        return None

    def before_step(self, step: int, model: Decoder, data: Data, log: dict, par: Parallel = SINGLE) -> None:
        """Runs before the update of `step` (after a resume too: act on exact steps only), on every
        rank: whatever it measures must be all-reduced through `par` so the ranks stay identical."""

    def saved_model(self, model: Decoder) -> Decoder:
        """What a checkpoint of the run holds (the training model itself by default)."""
        return model

    # the same, tensor by tensor, for a sharded model whose weights are streamed (train/sharded.py)
    def saved_config(self, model: Decoder):
        """The DecoderConfig of saved_model(model)."""
        return model.cfg

    def stores(self, name: str) -> bool:
        """Whether the state-dict entry `name` is stored in the checkpoint."""
        return True

    def saved_tensor(self, model: Decoder, name: str, full: torch.Tensor) -> torch.Tensor:
        """The stored value of entry `name` given its full (gathered) tensor."""
        return full


def _write_json(obj: dict, path: Path) -> None:
    with writing(path):
        path.write_text(json.dumps(obj, indent=1) + "\n")


def train(run: TrainConfig, command: str | None = None, resume: bool = False, recipe: Recipe | None = None) -> dict:
    """Train `run` (resolved here); returns the log dict (also saved as train_log.json in run.out).

    resume: continue the run `run.out` holds from its last checkpoint (the caller passes the
    run's own TrainConfig, e.g. from resume_config, and the same recipe), with any number of
    processes. Under torchrun every rank calls this; the process group lives for the call, and
    only rank 0 writes run.out.
    """
    run.resolve()
    out = Path(run.out)
    check_out(run, resume)
    rank, world, local = launched_world()
    run.check_world(world)
    estimate = check_rank_memory(run, world, local)
    if run.threads:
        torch.set_num_threads(run.threads)
    t0 = time.time()
    with data_parallel(run.device) as par:
        work = None
        if par.is_main:
            out.parent.mkdir(parents=True, exist_ok=True)
            work = temporary_dir(out, "work", TRAINING_RUN)     # marked: a SIGKILLed run's is removed later
        try:
            with naming_output(out):      # a full disk before the first checkpoint (the work folder's tokenizer)
                return _train(run, out, work, t0, command, load_run_state(out) if resume else None, par,
                              recipe or Recipe(), estimate)
        except Exception as e:
            if par.distributed and peer_lost(e):
                raise_if_interrupted()  # the peer left on the same Ctrl-C torchrun forwarded to this rank: say that
                ignore_launcher_stop()
                raise RankError(f"{par.describe()}: lost contact with another rank ({peer_lost_reason(e)}); "
                                 f"{held_message(out, (recipe or Recipe()).program)}") from None
            raise
        finally:
            if work is not None:
                shutil.rmtree(work, ignore_errors=True)


def held_message(out: str | Path, program: str = Recipe.program) -> str:
    """What --out holds after a stop, and how to continue it (program: the run's command)."""
    step = read_state_step(out)
    if not step:
        return "nothing was written"
    return (f"{out} holds the checkpoint of step {step} (continue with: {program} --out "
            f"{shlex.quote(str(out))} --resume, or torchrun with any number of processes)")


def resume_config(out: str | Path) -> TrainConfig:
    """The TrainConfig of the run `out` holds (from its log), to continue it."""
    log_path = Path(out) / LOG_NAME
    try:
        stored = json.loads(log_path.read_text())["run"]
    except (OSError, ValueError, KeyError, TypeError):
        raise TrainError(f"--out {out}: holds no training run to resume ({LOG_NAME} missing or unreadable); "
                         "start a new run without --resume") from None
    return TrainConfig(**stored)


def held_recipe(out: str | Path) -> dict | None:
    """The recipe the run `out` holds was made with (its log's "recipe"; None: python -m train's own)."""
    try:
        recipe = json.loads((Path(out) / LOG_NAME).read_text()).get("recipe")
    except (OSError, ValueError, AttributeError):
        return None
    return recipe if isinstance(recipe, dict) else None


def memory_line(run: TrainConfig, world: int, est) -> str:
    mode = "sharded (--fsdp)" if run.fsdp else "replicated (DDP)"
    micro = run.batch_size // world // run.grad_accum
    return f"memory per rank (estimated, {mode}, {world} rank(s), micro-batch {micro} x {run.seq_len}): {est.describe()}"


def check_rank_memory(run: TrainConfig, world: int, local_rank: int):
    """The estimate of one rank's memory (train/memory.py; memory_line() says it, printed by rank 0 once
    the run's inputs are checked, so that a bad input still gets one error line); TrainError (one line) when it
    exceeds what the rank's device has: the free memory of its GPU, or on the CPU the available memory
    shared by the ranks of this machine."""
    from core.inputs import MEMORY_SHARE, available_memory, human_bytes
    from train.memory import estimate_rank_memory
    micro = run.batch_size // world // run.grad_accum
    est = estimate_rank_memory(run.decoder_config(), micro, run.seq_len, world, run.fsdp, run.dtype,
                               run.checkpoint_activations)
    ranks_here = 1 if run.device == "cuda" else int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if run.device == "cuda" and torch.cuda.is_available() and local_rank < torch.cuda.device_count():
        have, where = torch.cuda.mem_get_info(local_rank)[0], f"GPU {local_rank} has"
    else:
        have, where = available_memory(), f"this machine has (for {ranks_here} rank(s))"
    mode = "sharded (--fsdp)" if run.fsdp else "replicated (DDP)"
    if have is not None and est.peak * ranks_here > MEMORY_SHARE * have:
        fix = "use --fsdp, more processes, " if not run.fsdp else "use more processes, "
        raise TrainError(f"training {run.preset}: needs about {human_bytes(est.peak)} per rank ({mode}: "
                         f"{est.describe()}), {where} {human_bytes(have)} available; {fix}"
                         f"--checkpoint-activations, a larger --grad-accum or a smaller model")
    return est


def _autocast(run: TrainConfig, par: Parallel = SINGLE):
    """bf16 autocast on CUDA for --dtype bf16 (weights, gradients and AdamW stay fp32); fp32 otherwise.
    A sharded model computes in bf16 through FSDP's MixedPrecisionPolicy instead (train/sharded.py)."""
    if run.dtype == "bf16" and not par.sharded:
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext


def _calibrate(model: Decoder, windows: torch.Tensor, batch_size: int, run: TrainConfig, aux: dict,
               par: Parallel) -> dict:
    """Calibrate every c (and fix s_tgt) from this rank's share of the calibration windows,
    the sums all-reduced; returns the log record."""
    reduce = par.sum if par.distributed else None

    def batches():
        return par.batches(windows, batch_size)
    before = branch_mismatch(model, batches(), reduce)
    c = calibrate(model, batches(), reduce)
    after = branch_mismatch(model, batches(), reduce)
    if run.aux_lambda > 0:
        if aux["s_tgt"] is None:  # "calib": the pre-logit scale the real final norm gave
            model.set_gate(1.0)
            aux["s_tgt"] = mean_prelogit_rms(model, windows, batch_size, par)
        aux["on"] = True
    return {"c": c, "mismatch_before": before, "mismatch_after": after, "s_tgt": aux["s_tgt"]}


def _accumulate_gradients(ddp, stream: TokenStream, starts: list[int], micro: int, run: TrainConfig, aux: dict,
                          par: Parallel, autocast, where: str) -> float:
    """Forward and backward this rank's windows `starts` in micro-batches; the gradients hold the
    mean over the global batch once DDP has averaged the ranks. Returns this rank's mean CE."""
    ce_mean = 0.0
    for i in range(run.grad_accum):
        batch = stream.windows(starts[i * micro:(i + 1) * micro], run.seq_len + 1).to(par.device)  # [b, T + 1]
        last = i == run.grad_accum - 1
        # DDP all-reduces once, on the last micro-batch; FSDP reduce-scatters every one, so that only the
        # rank's shard of the gradients is kept between micro-batches (the point of sharding)
        with contextlib.nullcontext() if last or not par.distributed or par.sharded else ddp.no_sync():
            with autocast():
                logits, h = ddp(batch[:, :-1], return_hidden=True)
                ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
                loss = ce + scale_loss(h, aux["s_tgt"], run.aux_lambda) if aux["on"] else ce
            if not torch.isfinite(loss):
                raise TrainError(f"training {run.preset}: loss is {float(loss)} {where}; lower --lr or check the schedule")
            # each micro-batch's mean counts 1 / grad_accum of the step (exact for a power of two), and
            # DDP's mean over equal shares then gives the global batch's mean gradient
            (loss / run.grad_accum if run.grad_accum > 1 else loss).backward()
        ce_mean += ce.item() / run.grad_accum
    return ce_mean


def _place(model: Decoder, run: TrainConfig, par: Parallel):
    """The model on the rank's device (one sharded by sharded_initial_model is there already), moved whole;
    returns (model, the module to run forward / backward through: DDP's wrapper, or the model)."""
    if par.sharded:
        return model, model
    if run.checkpoint_activations:
        checkpoint_blocks(model)
    model.to(par.device)
    return model, par.wrap(model, find_unused=run.gate_schedule() is not None)


def _restore_model(model: Decoder, state: dict, gen: torch.Generator, out: Path) -> None:
    """The held run's weights (unless they are sharded: loaded with the optimizer), c and RNG states."""
    try:
        if not state["sharded"]:
            model.load_state_dict(state["model"])
        for name, c in state["taper_c"].items():
            model.taper_layers()[name].c = c
        gen.set_state(state["data_rng"])
        torch.set_rng_state(state["torch_rng"])
    except (RuntimeError, KeyError, ValueError, TypeError) as e:
        raise restore_error(out, e) from None


def _restore_optimizer(model, opt, state: dict, run: TrainConfig, out: Path) -> None:
    if state["sharded"] != run.fsdp:
        raise TrainError(f"{out / RUN_STATE_JSON}: the resume state is {'' if state['sharded'] else 'not '}sharded, "
                         f"the run's settings say --fsdp {run.fsdp}; start a new run in another --out")
    try:
        if state["sharded"]:
            load_sharded_state(out / SHARDED_STATE, model, opt)
        else:
            opt.load_state_dict(state["optimizer"])
    except (RuntimeError, KeyError, ValueError, TypeError, OSError) as e:
        raise restore_error(out, e) from None


def _save_run(model, opt, run: TrainConfig, out: Path, recipe: Recipe, data: Data, resume: dict,
              par: Parallel) -> None:
    """Replace `out` with the checkpoint and resume state (resume: write_run_state's plain part). Replicated
    weights: rank 0 writes everything. --fsdp: every rank writes its shards of the model and optimizer
    into rank 0's temporary folder, the consolidated model.safetensors is streamed tensor by tensor, and
    rank 0 commits the folder once every rank is done. A full disk: core.errors.NoRoomError on rank 0
    (naming the file of `out`), a quiet exit on the others (train.distributed.writing_together)."""
    log = resume["log"]
    if not run.fsdp:
        with writing_together(par, out):
            if par.is_main:               # the ranks hold the same weights: one writes
                def run_files(tmp: Path) -> None:
                    _write_json(log, tmp / LOG_NAME)
                    write_run_state(tmp, {**resume, "model": model.state_dict(), "optimizer": opt.state_dict()})
                save_checkpoint(recipe.saved_model(model), out, data.tokenizer_json, kind=TRAINING_RUN,
                                write_more=run_files)
        return
    with output_dir(out, TRAINING_RUN) if par.is_main else contextlib.nullcontext() as tmp:
        tmp = Path(par.broadcast(str(tmp) if par.is_main else None))
        with writing_together(par, out / SHARDED_STATE):   # every rank's shards are written before rank 0 commits
            save_sharded_state(tmp / SHARDED_STATE, model, opt)
            write_streamed_weights(tmp / WEIGHTS if par.is_main else None, model, recipe)
            if par.is_main:
                tokenizer = data.tokenizer_json
                config = {**checkpoint_config(model, tokenizer is not None), **recipe.saved_config(model).to_dict()}
                _write_json(config, tmp / CONFIG)
                if tokenizer is not None:
                    with writing(tmp / TOKENIZER):
                        shutil.copyfile(tokenizer, tmp / TOKENIZER)
                _write_json(log, tmp / LOG_NAME)
                write_run_state(tmp, {**resume, "model": {}, "optimizer": {"state": {}, "param_groups": []},
                                      "sharded": True})


def _new_log(run: TrainConfig, command: str | None, model: Decoder, data: Data, sched, recipe: Recipe) -> dict:
    """The run's log.json as it starts (also the resume state's log: a plain dict, written as JSON)."""
    return {"preset": run.preset, "size": run.size, "command": command, "run": asdict(run),
            "model_config": model.cfg.to_dict(), "params": model.num_params(), "data": data.stats,
            "schedule": None if sched is None else {"warmup_steps": sched.warmup_steps, "taper_steps": sched.taper_steps,
                                                     "calibration_step": sched.calibration_step,
                                                     "gate_zero_from": sched.end},
            "aux": {"lambda": run.aux_lambda, "s_tgt": run.s_tgt,
                    "form": "lambda * mean_tokens (log rms(h) - log s_tgt)^2"},
            "calibration": None, "evals": [], "step": 0, "resumed_at": [], "parallel": [],
            "recipe": recipe.describe()}


@dataclass
class _Run:
    """One training run's live pieces, for the step loop and checkpoint(). `log` and `aux` stay
    plain dicts: they are the resume state's format (run_state.json), read back by --resume."""
    run: TrainConfig
    out: Path
    t0: float
    par: Parallel
    recipe: Recipe
    data: Data
    model: Decoder
    opt: torch.optim.Optimizer
    sched: object            # the gate schedule, or None for a run without TaperNorm
    gen: torch.Generator     # the data order
    log: dict
    aux: dict                # the scale loss: on, s_tgt (set by calibration when --s-tgt calib)
    micro: int               # windows per micro-batch on this rank
    autocast: object

    def checkpoint(self, step: int, train_loss: float | None, write: bool = True) -> dict:
        """Evaluate at `step` (gate set by the schedule), log it, and with `write` replace OUT."""
        run, sched, model, par = self.run, self.sched, self.model, self.par
        gate = sched.gate_at(step) if sched else None
        if sched:
            model.set_gate(gate)
        ev = evaluate(model, self.data.val, self.micro, par, self.autocast)
        ev = {"step": step, "train_loss": train_loss, **ev, "gate": gate,
              "lr": lr_at(step, run.steps, run.lr, run.lr_warmup), "phase": sched.phase(step) if sched else "train",
              "elapsed_s": round(time.time() - self.t0, 1)}
        self.log["evals"].append(ev)
        self.log["wall_s"] = round(time.time() - self.t0, 1)
        if write:
            if not all_finite(model, par):
                raise TrainError(f"training {run.preset}: weights are NaN or Inf at step {step}; nothing written "
                                 f"for this step (lower --lr)")
            self.log["step"] = step
            self.log["parallel"][-1]["measured"] = measured_memory(self.opt, par)
            try:
                _save_run(model, self.opt, run, self.out, self.recipe, self.data,
                          {"step": step, "taper_c": model.taper_c(), "data_rng": self.gen.get_state(),
                           "torch_rng": torch.get_rng_state(), "aux": self.aux, "log": self.log}, par)
            except NoRoomError as e:
                held = read_state_step(self.out)
                if not held:          # the writer's own line: nothing was written
                    raise
                raise TrainError(f"{e.path}: {e.reason} at the checkpoint of step {step}; {self.out} holds the last "
                                 f"complete checkpoint, of step {held} ({e.remedy}, then continue with: "
                                 f"{self.recipe.program} --out {shlex.quote(str(self.out))} --resume)") from None
        return ev


def _start_run(run: TrainConfig, out: Path, work: Path | None, t0: float, command: str | None, state: dict | None,
               par: Parallel, recipe: Recipe, estimate=None):
    """The data, the model (placed, or restored from `state` where the held run stopped) and its
    optimizer; returns (the run, the module to run forward / backward through, the first step)."""
    par = dataclasses.replace(par, sharded=run.fsdp and par.distributed)
    data = prepare_data(run, work, par)
    raise_if_interrupted()
    if estimate is not None and par.is_main:
        print(memory_line(run, par.world_size, estimate), flush=True)      # information: stdout
    torch.manual_seed(run.seed)
    if par.sharded:        # never whole on any rank: built on meta, then each rank's shards (train/sharded.py)
        model = sharded_initial_model(recipe, run, par.device, fresh=state is None)
    else:
        model = recipe.initial_model(run, fresh=state is None)
    model.train()
    sched = run.gate_schedule()
    gen = torch.Generator().manual_seed(run.seed)  # same data order for every preset, and on every rank
    log = _new_log(run, command, model, data, sched, recipe)
    aux = {"on": False, "s_tgt": float(run.s_tgt) if run.aux_lambda > 0 and run.s_tgt != "calib" else None}
    start = 0
    if state is not None:          # continue exactly where the held run stopped
        _restore_model(model, state, gen, out)
        aux, log, start = dict(state["aux"]), state["log"], state["step"]
        log["resumed_at"] = log.get("resumed_at", []) + [start]
        log["command"] = command or log["command"]
        log["run"].update(grad_accum=run.grad_accum, device=run.device,   # what a resume may change
                          checkpoint_activations=run.checkpoint_activations)
    model, ddp = _place(model, run, par)
    opt = _optimizer(model, run.lr, run.weight_decay)
    if state is not None:
        _restore_optimizer(model, opt, state, run, out)
    # every optimizer step takes one global batch of run.batch_size windows: rank r reads the
    # r-th share, in grad_accum micro-batches; DDP averages the ranks' gradients
    per_rank = run.batch_size // par.world_size
    micro = per_rank // run.grad_accum
    log.setdefault("parallel", []).append(
        {"from_step": start, "world_size": par.world_size, "per_rank_batch": per_rank, "micro_batch": micro,
         "grad_accum": run.grad_accum, "global_batch": run.batch_size, "backend": par.backend,
         "device": par.device.type, "dtype": run.dtype, "fsdp": par.sharded,
         "checkpoint_activations": run.checkpoint_activations,
         "memory_estimate": None if estimate is None else dataclasses.asdict(estimate)})
    r = _Run(run, out, t0, par, recipe, data, model, opt, sched, gen, log, aux, micro, _autocast(run, par))
    return r, ddp, start


def _train(run: TrainConfig, out: Path, work: Path | None, t0: float, command: str | None, state: dict | None,
           par: Parallel, recipe: Recipe, estimate=None) -> dict:
    r, ddp, start = _start_run(run, out, work, t0, command, state, par, recipe, estimate)
    run, par, model, sched = r.run, r.par, r.model, r.sched
    per_rank = run.batch_size // par.world_size
    ev = r.log["evals"][-1] if state is not None else r.checkpoint(0, None, write=False)   # step 0: logged, not written
    bar = _progress(run, start) if par.is_main else None
    loss_acc, n_acc = 0.0, 0
    try:
        for step in range(start, run.steps):
            raise_if_interrupted()
            r.recipe.before_step(step, model, r.data, r.log, par)
            if sched and step == sched.calibration_step:
                r.log["calibration"] = {"step": step, **_calibrate(model, r.data.calib, r.micro, run, r.aux, par)}
            g = sched.gate_at(step) if sched else None
            if sched:
                model.set_gate(g)
            lr = lr_at(step, run.steps, run.lr, run.lr_warmup)
            for group in r.opt.param_groups:
                group["lr"] = lr
            starts = _draw_starts(r.data.train, run.batch_size, run.seq_len, r.gen)
            starts = starts[par.rank * per_rank:(par.rank + 1) * per_rank]
            r.opt.zero_grad(set_to_none=True)
            ce_mean = _accumulate_gradients(ddp, r.data.train, starts, r.micro, run, r.aux, par, r.autocast,
                                            where=f"at step {step} (gate {g})")
            torch.nn.utils.clip_grad_norm_(model.parameters(), run.grad_clip)
            r.opt.step()
            loss_acc, n_acc = loss_acc + ce_mean, n_acc + 1
            done = step + 1
            if done % run.eval_every == 0 or done == run.steps:
                ev = r.checkpoint(done, par.sum([loss_acc])[0] / (n_acc * par.world_size))
                loss_acc, n_acc = 0.0, 0
            if bar is not None:
                bar.update(1)
                gate = '-' if g is None else f'{g:.3f}'
                bar.set_postfix_str(f"loss {ce_mean:.3f} val {ev['val_loss']:.3f} gate {gate} rms {ev['prelogit_rms']:.2f}",
                                    refresh=False)
    finally:            # an error or a Ctrl-C prints its line below the bar, not at its end
        if bar is not None:
            bar.close()
    return r.log


def measured_memory(opt: torch.optim.Optimizer, par: Parallel) -> dict:
    """Peak resident memory (the largest over ranks) and rank 0's optimizer state, in bytes."""
    import resource
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return {"peak_rss_bytes_max_rank": int(par.max(rss)), "optimizer_state_bytes_rank0": sharded_state_bytes(opt)}


def _progress(run: TrainConfig, start: int = 0):
    if not run.progress:
        return None
    from tqdm import tqdm
    return tqdm(total=run.steps, initial=start, desc=f"{run.preset}/{run.size}", mininterval=2.0, file=sys.stderr,
                dynamic_ncols=True)
