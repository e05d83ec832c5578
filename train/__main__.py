"""python -m train --preset P --size S --out DIR [--steps N] [--d-model D --n-layer L --n-head H] [--seed K]
python -m train --out DIR --resume [--threads N] [--grad-accum K] [--device cpu|cuda]
torchrun --standalone --nproc-per-node N -m train ... [--device cuda] [--dtype bf16] [--grad-accum K]
torchrun --standalone --nproc-per-node N -m train ... --fsdp [--checkpoint-activations]   # sharded (FSDP2)

Trains a pre-norm decoder with the TaperNorm schedule and saves a checkpoint
directory (config.json with the gate and each layer's c, model.safetensors,
tokenizer.json, train_log.json, and train_state.safetensors + train_state.json for
--resume) into DIR, atomically, at every evaluation after step 0. DIR must be new
or empty, or hold a run of python -m train that --resume continues (with its own
settings; it ends with the same weights as an uninterrupted run of the same seed).

Presets:
  baseline            RMSNorm everywhere
  internal-taper      block norms taper to g = 0; the final RMSNorm stays (the scale anchor)
  all-taper           every norm tapers, the final one too; the scale loss anchors the pre-logit scale
  all-taper-noanchor  block norms taper, no final norm, no scale loss (shows logit chasing)
  dyt                 DyT (gamma * tanh(alpha x) + beta) in place of every norm
Sizes: tiny (~1.1M params, 1200 steps, ~7 min on one core), small (~8.5M).

Schedule (taper presets): W warmup steps at g = 1; before step W every
TaperNorm's c is calibrated by least squares on held-out batches and gamma_tilde
starts from gamma; the global gate follows a cosine from 1 to exactly 0 over T
taper steps; training continues at g = 0. Defaults: W = 35%, T = 35% of --steps.

Scale loss (all-taper, from calibration on):
    L_aux = lambda * mean_tokens (log r(h) - log s_tgt)^2,  r(h) = sqrt(mean_d h^2 + 1e-12)
on the pre-logit hidden state h; zero gradient at r(h) = s_tgt. --s-tgt calib
(default) fixes s_tgt to the mean pre-logit r measured at calibration.

Data parallel: under torchrun every process is one rank of a DistributedDataParallel run
(gloo on the CPU, nccl with --device cuda). --batch-size is the global batch: each rank
takes batch / N windows of every step, in --grad-accum micro-batches; gradients are
averaged over ranks, calibration sums all-reduced, and only rank 0 writes DIR. --resume
works with any number of processes (the global batch stays the same).

--data SOURCE (a .txt / .jsonl / .parquet file, a folder of them, a datasets save_to_disk
folder, or a token shard directory): tokenized once into memory-mapped token shards
(--shards DIR, default SOURCE_NAME.tokens beside DIR; python -m train.shards builds them
ahead), reused by
later runs; the same split and token streams as --corpus gives for the same text.
"""
from __future__ import annotations

from core.lifecycle import guard_startup
guard_startup(__name__)     # before the imports below: a Ctrl-C while they load exits 130 with one line

import argparse
import shlex
import sys

from core.errors import ArgumentParser, UsageError, float_in, int_in, positive_int, seed_int
from train.config import TrainConfig, add_execution_options, apply_resume_options
from train.errors import TrainError
from train.presets import ARCHS, PRESETS, SIZES, architecture

# what --resume may be given beside --out: how the run is executed, not what it computes
RESUME_OPTIONS = {"out", "resume", "threads", "quiet", "grad_accum", "device", "checkpoint_activations"}


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", help=f"one of: {', '.join(PRESETS)} (required unless --resume)")
    p.add_argument("--size", default="tiny", help=f"one of: {', '.join(SIZES)} (default tiny)")
    p.add_argument("--out", required=True, help="training run directory (new or empty; or the run to --resume)")
    p.add_argument("--resume", action="store_true", help="continue the run --out holds from its last checkpoint")
    p.add_argument("--steps", type=int_in(None, 10_000_000), help="optimizer steps (default: the size's, tiny 1200)")
    p.add_argument("--warmup-steps", type=int_in(None, 10_000_000), help="steps at g = 1 before calibration (default 35%% of --steps)")
    p.add_argument("--taper-steps", type=int_in(None, 10_000_000), help="cosine steps from g = 1 to 0 (default 35%% of --steps)")
    p.add_argument("--batch-size", type=int_in(None, 65536))
    p.add_argument("--seq-len", type=int_in(None, 65536), help="training context (default tiny 128)")
    p.add_argument("--lr", type=float, help="peak learning rate (default tiny 2e-3)")
    p.add_argument("--eval-every", type=int_in(None, 10_000_000))
    p.add_argument("--eval-batches", type=int_in(None, 100_000), default=8)
    p.add_argument("--calib-batches", type=int_in(None, 100_000), default=4, help="held-out batches for the least-squares c")
    p.add_argument("--aux-lambda", type=float, help="weight of the scale loss (default 0.1 for all-taper, else 0)")
    p.add_argument("--s-tgt", default="calib", help="target pre-logit scale: 'calib' or a positive number")
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--corpus", default="generated",
                   help="'generated' (the shipped generator), a .txt/.jsonl file, or hf:roneneldan/TinyStories")
    p.add_argument("--corpus-stories", type=int_in(1, 10_000_000), default=6000, help="stories to generate for --corpus generated")
    p.add_argument("--corpus-limit", type=positive_int, help="use at most this many stories of a file or dataset")
    p.add_argument("--tokenizer", default=None, help="tokenizer.json (default train/data/tokenizer.json) or 'train'")
    p.add_argument("--data", help="a corpus larger than memory: a .txt/.jsonl/.parquet file, a folder of them, a "
                                  "datasets save_to_disk folder, or a token shard directory (tokenized once)")
    p.add_argument("--shards", help="where --data's token shards are kept (default: DATA_NAME.tokens beside --out)")
    add_execution_options(p, "train")
    g = p.add_argument_group("architecture (overrides the size)")
    g.add_argument("--arch", choices=ARCHS, default="gpt2",
                   help="the block's layout besides its norms (train/presets.py): gpt2 (default), llama, qwen3 "
                        "(QK-norms), gemma3 (sandwich norms, QK-norms, sliding-window layers)")
    g.add_argument("--d-model", type=int_in(None, 65536))
    g.add_argument("--n-layer", type=int_in(None, 1024))
    g.add_argument("--n-head", type=int_in(None, 4096))
    g.add_argument("--vocab-size", type=int_in(None, 10_000_000))
    g.add_argument("--max-seq-len", type=int_in(None, 1_000_000), help="position table / KV-cache capacity (default 256)")
    g.add_argument("--mlp", help="gelu | swiglu")
    g.add_argument("--mlp-ratio", type=int_in(None, 64), help="MLP hidden width / d_model (default 4)")
    g.add_argument("--dyt-alpha-init", type=float_in(), help="initial alpha of every DyT layer")
    g.add_argument("--embed-std", type=float_in(), help="init std of the token and position embeddings (default 0.02)")
    p.add_argument("--threads", type=int_in(0, 256), default=0, help="torch threads (0: torch's default)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _config(a) -> TrainConfig:
    if a.preset is None:
        raise UsageError("python -m train: --preset is required for a new run (or pass --resume); see --help")
    shape = SIZES.get(a.size, SIZES["tiny"])["model"]
    width = {k: getattr(a, k) or shape[k] for k in ("d_model", "n_layer", "n_head")}
    explicit = dict(d_model=a.d_model, n_layer=a.n_layer, n_head=a.n_head, vocab_size=a.vocab_size,
                    max_seq_len=a.max_seq_len, mlp=a.mlp, mlp_ratio=a.mlp_ratio, dyt_alpha_init=a.dyt_alpha_init)
    model = {**architecture(a.arch, **width), **{k: v for k, v in explicit.items() if v is not None}}
    kw = dict(preset=a.preset, size=a.size, out=a.out, steps=a.steps, warmup_steps=a.warmup_steps,
              taper_steps=a.taper_steps, batch_size=a.batch_size, seq_len=a.seq_len, lr=a.lr, eval_every=a.eval_every,
              eval_batches=a.eval_batches, calib_batches=a.calib_batches, aux_lambda=a.aux_lambda, s_tgt=a.s_tgt,
              seed=a.seed, corpus=a.corpus, corpus_stories=a.corpus_stories, corpus_limit=a.corpus_limit,
              model=model,
              embed_std=a.embed_std, threads=a.threads, progress=not a.quiet, data=a.data, shards=a.shards,
              grad_accum=a.grad_accum or 1, device=a.device or "cpu", dtype=a.dtype, fsdp=a.fsdp,
              checkpoint_activations=a.checkpoint_activations)
    if a.tokenizer is not None:
        kw["tokenizer"] = a.tokenizer
    return TrainConfig(**kw)


def _resume_config(p: argparse.ArgumentParser, a) -> TrainConfig:
    """The held run's own settings; only --threads and --quiet may change."""
    from train.loop import held_recipe, resume_config
    given = sorted(k for k, v in vars(a).items() if k not in RESUME_OPTIONS and v != p.get_default(k))
    if given:
        raise UsageError(f"python -m train --resume: continues the run with its own settings; drop "
                         f"{', '.join('--' + k.replace('_', '-') for k in given)}")
    run = resume_config(a.out)
    if held_recipe(a.out) is not None:    # its model, steps and saves are the recipe's: plain training would differ
        raise TrainError(f"--out {a.out}: holds a run of python -m train.finetune, not of python -m train; "
                         f"resume it with python -m train.finetune --out {shlex.quote(a.out)} --resume")
    apply_resume_options(run, a)
    return run


def run(argv: list[str]) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    run_cfg = _resume_config(p, a) if a.resume else _config(a)
    run_cfg.resolve()                 # cheap checks first, before torch is imported
    from train.interrupts import raise_if_interrupted, speaks_for_job
    from train.loop import check_out, train
    raise_if_interrupted()            # a Ctrl-C that the import of torch dropped
    check_out(run_cfg, a.resume)      # refuse a wrong --out before the corpus is built
    try:
        log = train(run_cfg, command="python -m train " + shlex.join(argv), resume=a.resume)
    except KeyboardInterrupt:
        from train.loop import held_message
        if speaks_for_job():          # rank 0 reports for the job
            print(f"error: training interrupted; {held_message(run_cfg.out)}", file=sys.stderr)
        return 130
    from train.distributed import launched_world
    if launched_world()[0] != 0:      # rank 0 reports for the job
        return 0
    last = log["evals"][-1]
    gate = "" if last["gate"] is None else f", gate {last['gate']}"
    print(f"{run_cfg.out}: {run_cfg.preset}/{run_cfg.size}, {log['params']:,} params, {last['step']} steps, "
          f"val loss {last['val_loss']:.4f}, pre-logit rms {last['prelogit_rms']:.3f}{gate}, {log['wall_s']:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    from train.interrupts import run_train_cli
    return run_train_cli(run, argv)


if __name__ == "__main__":
    from core.lifecycle import exit_after
    exit_after(main)
