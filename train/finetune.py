"""Fine-tune a trained model so that its norms go away: TaperLN (the TaperNorm paper's GPT-2
protocol) or FakeLN (Baroni et al. 2025), on the project's corpus.

    python -m train.finetune --from CKPT_OR_HF_DIR --method METHOD --out DIR [--steps N] [--lr LR] ...
    python -m train.finetune --out DIR --resume [--grad-accum K] [--device cpu|cuda]
    torchrun --standalone --nproc-per-node N -m train.finetune ... [--device cuda] [--dtype bf16] [--grad-accum K]
    torchrun --standalone --nproc-per-node N -m train.finetune ... --fsdp [--checkpoint-activations]   # sharded (FSDP2)

Methods (the model starts from --from, a checkpoint or a Hugging Face folder, with real norms):
  internal-taper  every block norm becomes a TaperNorm (TaperLN for a LayerNorm model: LN base and
                  an affine linear branch, c h gamma_tilde + beta_tilde); the final norm stays real.
                  c is calibrated by least squares at step --warmup-steps (default 0: the pretrained
                  model's own activations), the gate follows the cosine to exactly 0 over
                  --taper-steps (default 50%), training goes on at g = 0 (train/schedule.py).
  all-taper       the final norm tapers too, anchored by the fixed-target scale loss (train/scale_loss.py).
  fakeln          LayerNorms are replaced one at a time by fixed-std ones, std frozen from the data:
                  every --fakeln-every steps (default: the last one at 50%) the next norm, in the order
                  block MLP norms (ln_2), block attention norms (ln_1), final norm (Baroni et al.'s
                  order), measures the mean per-token std of its input on held-out batches and from
                  then on computes (x - mean x) * gamma / std + beta. Saved in the eps-trick form of
                  their published checkpoints: a LayerNorm with eps 1e12 and gamma * 1e6 / std.
  vanilla         no change: the same fine-tuning with the norms as they are (the comparison row).

DIR is a training run (python -m train's format: --resume continues it exactly), with the
fine-tuned checkpoint in it. Everything else (optimizer, learning-rate schedule, calibration,
scale loss, atomic saves) is train/loop.py's, and so is data parallel under torchrun: --batch-size
is the global batch, every rank takes its share, c and the FakeLN std come from all-reduced sums
(the same on every rank), only rank 0 writes DIR, and --resume works with any number of processes.
--data streams a corpus larger than memory through memory-mapped token shards, tokenized with
the model's tokenizer (see python -m train --help).
"""
from __future__ import annotations

from core.lifecycle import guard_startup
guard_startup(__name__)     # before the imports below: a Ctrl-C while they load exits 130 with one line

import argparse
import shlex
import sys
from pathlib import Path

from core.errors import ArgumentParser, UsageError, float_in, int_in, seed_int
from train.config import TrainConfig, add_execution_options, apply_resume_options
from train.errors import TrainError

METHODS = ("internal-taper", "all-taper", "fakeln", "vanilla")
DEFAULTS = dict(steps=600, lr=5e-4, batch_size=16, seq_len=128, eval_every=100)
TAPER_FRAC = 0.5             # taper steps (from step 0) and the fakeln removals: the first half of the run
# what --resume may be given beside --out: how the run is executed, not what it computes
RESUME_OPTIONS = {"out", "resume", "threads", "quiet", "grad_accum", "device", "checkpoint_activations"}


def source_tokenizer(path: str) -> Path:
    where = Path(path) / "tokenizer.json"
    if not where.is_file():
        raise TrainError(f"--from {path}: has no tokenizer.json; fine-tuning on the corpus needs the model's "
                         "tokenizer (copy it into the folder)")
    from tokenizers import Tokenizer
    from train.corpus import EOS
    try:
        tok = Tokenizer.from_file(str(where))
    except Exception as e:  # tokenizers raises a bare Exception on malformed files
        raise TrainError(f"{where}: not a readable tokenizer.json ({str(e).splitlines()[0][:200]})") from None
    if tok.token_to_id(EOS) is None:
        raise TrainError(f"{where}: has no {EOS} token; the corpus separates stories with it "
                         "(fine-tune a model whose tokenizer has it)")
    return where


def finetune_config(method: str, source, a) -> TrainConfig:
    """The training run: the source's architecture with the method's norms, the method's preset."""
    cfg = source.cfg
    if cfg.norm not in ("layernorm", "rmsnorm") or cfg.layer_eps or cfg.eps >= 1e6:
        kind = "LN-free (disabled norms)" if cfg.eps >= 1e6 or cfg.layer_eps else repr(cfg.norm)
        raise TrainError(f"--from {a.source}: a {kind} model; fine-tuning starts from a model with real "
                         "LayerNorms or RMSNorms (e.g. one trained with python -m train --preset layernorm)")
    if method == "fakeln" and cfg.norm != "layernorm":
        raise TrainError(f"--from {a.source}: norm {cfg.norm!r}; --method fakeln replaces LayerNorms "
                         "(a GPT-2-architecture model); use a taper method for RMSNorm models")
    model = cfg.to_dict()
    if method in ("internal-taper", "all-taper"):
        base = "ln" if cfg.norm == "layernorm" else "rms"
        model.update(norm="taper", taper_scope=method.split("-")[0], taper_base=base, taper_affine=base == "ln")
        preset = method
    else:
        preset = "layernorm" if cfg.norm == "layernorm" else "baseline"
    steps = a.steps or DEFAULTS["steps"]
    taper = method in ("internal-taper", "all-taper")
    return TrainConfig(
        preset=preset, size="tiny", out=a.out, steps=steps, lr=a.lr or DEFAULTS["lr"],
        batch_size=a.batch_size or DEFAULTS["batch_size"], seq_len=a.seq_len or DEFAULTS["seq_len"],
        eval_every=a.eval_every or DEFAULTS["eval_every"], eval_batches=a.eval_batches, calib_batches=a.calib_batches,
        warmup_steps=(a.warmup_steps if a.warmup_steps is not None else 0) if taper else None,
        taper_steps=(a.taper_steps or max(1, round(TAPER_FRAC * steps))) if taper else None,
        aux_lambda=a.aux_lambda, seed=a.seed, corpus=a.corpus, corpus_stories=a.corpus_stories,
        tokenizer=str(source_tokenizer(a.source)), model=model, threads=a.threads, progress=not a.quiet,
        data=a.data, shards=a.shards, grad_accum=a.grad_accum or 1, device=a.device or "cpu", dtype=a.dtype,
        fsdp=a.fsdp, checkpoint_activations=a.checkpoint_activations)


def fakeln_every(steps: int, n_norms: int, given: int | None) -> int:
    """Steps between two removals: the last of n_norms at about TAPER_FRAC of the run."""
    every = given or max(1, int(TAPER_FRAC * steps) // n_norms)
    if every * n_norms >= steps:
        raise TrainError(f"--fakeln-every {every}: {n_norms} norms removed every {every} steps need more than "
                         f"--steps {steps}; raise --steps or lower --fakeln-every")
    return every


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m train.finetune", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--from", dest="source", help="checkpoint or Hugging Face folder to start from (a model with real norms)")
    p.add_argument("--method", choices=METHODS, help="how the norms go away (see above)")
    p.add_argument("--out", required=True, help="training run directory (new or empty; or the run to --resume)")
    p.add_argument("--resume", action="store_true", help="continue the run --out holds from its last checkpoint")
    p.add_argument("--steps", type=int_in(1, 10_000_000), help=f"optimizer steps (default {DEFAULTS['steps']})")
    p.add_argument("--lr", type=float_in(0.0), help=f"peak learning rate (default {DEFAULTS['lr']:g})")
    p.add_argument("--batch-size", type=int_in(1, 65536))
    p.add_argument("--seq-len", type=int_in(1, 65536))
    p.add_argument("--eval-every", type=int_in(1, 10_000_000))
    p.add_argument("--eval-batches", type=int_in(1, 100_000), default=8)
    p.add_argument("--calib-batches", type=int_in(1, 100_000), default=4,
                   help="held-out batches for the least-squares c and the fakeln std")
    p.add_argument("--warmup-steps", type=int_in(0, 10_000_000), help="taper: steps at g = 1 before calibration (default 0)")
    p.add_argument("--taper-steps", type=int_in(1, 10_000_000), help="taper: cosine steps from g = 1 to 0 (default 50%%)")
    p.add_argument("--aux-lambda", type=float_in(0.0), help="all-taper: scale-loss weight (default 0.1)")
    p.add_argument("--fakeln-every", type=int_in(1, 10_000_000), help="fakeln: steps between removals (default: last at 50%%)")
    p.add_argument("--corpus", default="generated", help="'generated' (the shipped generator) or a .txt/.jsonl file")
    p.add_argument("--corpus-stories", type=int_in(1, 10_000_000), default=6000)
    p.add_argument("--data", help="a corpus larger than memory: a .txt/.jsonl/.parquet file, a folder of them, a "
                                  "datasets save_to_disk folder, or a token shard directory (tokenized once)")
    p.add_argument("--shards", help="where --data's token shards are kept (default: DATA_NAME.tokens beside --out)")
    p.add_argument("--seed", type=seed_int, default=0)
    add_execution_options(p, "train.finetune")
    p.add_argument("--threads", type=int_in(0, 256), default=0, help="torch threads (0: torch's default)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _resumed_settings(a, p):
    """--resume: the held run's settings (and recipe), with what a resume may change."""
    given = sorted(k for k, v in vars(a).items() if k not in RESUME_OPTIONS and v != p.get_default(k))
    if given:
        raise UsageError(f"python -m train.finetune --resume: continues the run with its own settings; drop "
                         f"{', '.join('--' + k.replace('_', '-').replace('source', 'from') for k in given)}")
    from train.loop import held_recipe, resume_config
    run_cfg = resume_config(a.out)
    recipe_info = held_recipe(a.out) or {}
    if "finetune" not in recipe_info:
        raise TrainError(f"--out {a.out}: holds a run of python -m train, not of train.finetune; "
                         f"resume it with python -m train --out {a.out} --resume")
    apply_resume_options(run_cfg, a)
    return run_cfg, recipe_info["finetune"], recipe_info["from"], recipe_info["fakeln_every"]


def _new_settings(a):
    """A new run: the options checked, the settings from the source's config (no weights read)."""
    from core.outputs import TRAINING_RUN, check_output_dir
    if a.source is None or a.method is None:
        raise UsageError("python -m train.finetune: --from and --method are required for a new run "
                         "(or pass --resume); see --help")
    method = a.method
    if method != "fakeln" and a.fakeln_every is not None:
        raise UsageError(f"--fakeln-every: applies to --method fakeln, not {method}; drop it")
    taper_only = [o for o, v in (("--warmup-steps", a.warmup_steps), ("--taper-steps", a.taper_steps)) if v is not None]
    if method not in ("internal-taper", "all-taper") and taper_only:
        raise UsageError(f"{', '.join(taper_only)}: apply to the taper methods, not {method}; drop them")
    check_output_dir(a.out, TRAINING_RUN, inputs=[a.source])
    from models.weights import open_weights
    model = open_weights(a.source)      # the config and the tensors' names: no weights read here
    run_cfg = finetune_config(method, model, a)
    every = fakeln_every(run_cfg.steps, len(model.cfg.norm_names()), a.fakeln_every) if method == "fakeln" else None
    return run_cfg, method, a.source, every


def run(argv: list[str]) -> int:
    p = build_parser()
    a = p.parse_args(argv)
    run_cfg, method, source, every = _resumed_settings(a, p) if a.resume else _new_settings(a)
    run_cfg.resolve()
    from train.interrupts import raise_if_interrupted, speaks_for_job
    from train.loop import check_out, train
    raise_if_interrupted()            # a Ctrl-C that the import of torch dropped
    check_out(run_cfg, a.resume)
    from train.recipes import FineTune
    recipe = FineTune(method, source, every)
    try:
        log = train(run_cfg, command="python -m train.finetune " + shlex.join(argv), resume=a.resume, recipe=recipe)
    except KeyboardInterrupt:
        from train.loop import held_message
        if speaks_for_job():          # rank 0 reports for the job
            print(f"error: training interrupted; {held_message(run_cfg.out, recipe.program)}", file=sys.stderr)
        return 130
    from train.distributed import launched_world
    if launched_world()[0] != 0:      # rank 0 reports for the job
        return 0
    last, first = log["evals"][-1], log["evals"][0]
    gate = "" if last["gate"] is None else f", gate {last['gate']}"
    print(f"{run_cfg.out}: {method} from {source}, {last['step']} steps, val loss {first['val_loss']:.4f} -> "
          f"{last['val_loss']:.4f}{gate}, {log['wall_s']:.0f} s")
    return 0


def main(argv: list[str] | None = None) -> int:
    from train.interrupts import run_train_cli
    return run_train_cli(run, argv)


if __name__ == "__main__":
    from core.lifecycle import exit_after
    exit_after(main)
