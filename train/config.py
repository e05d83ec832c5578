"""What one training run is: TrainConfig, resolved against the preset and size (train.errors: its errors).

Kept free of torch so that `python -m train` rejects bad input in a fraction of a
second (models.decoder, and with it torch, is imported only for the full
architecture check, after the cheap checks have passed).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from train.errors import TrainError, TrainUsageError
from train.presets import PRESETS, SIZES, TAPER_FRAC, WARMUP_FRAC
from train.tokenizer import DEFAULT_TOKENIZER

DEVICES = ("cpu", "cuda")
DTYPES = ("fp32", "bf16")


@dataclass
class TrainConfig:
    preset: str
    size: str = "tiny"
    out: str = "runs/model"
    steps: int | None = None            # None: the size's default
    warmup_steps: int | None = None     # None: WARMUP_FRAC * steps (taper presets)
    taper_steps: int | None = None      # None: TAPER_FRAC * steps
    batch_size: int | None = None
    seq_len: int | None = None
    lr: float | None = None
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    lr_warmup: int = 50
    eval_every: int | None = None
    eval_batches: int = 8
    calib_batches: int = 4
    aux_lambda: float | None = None     # None: 0.1 for all-taper, 0 otherwise
    s_tgt: str = "calib"                # "calib" or a positive number (as text)
    seed: int = 0
    corpus: str = "generated"
    corpus_stories: int = 6000
    corpus_limit: int | None = None
    tokenizer: str = str(DEFAULT_TOKENIZER)   # a tokenizer.json, or "train" to fit one on the corpus
    model: dict = field(default_factory=dict)  # DecoderConfig overrides (d_model, n_layer, n_head, ...)
    embed_std: float | None = None      # re-initialise wte/wpe with this std (None: the decoder's 0.02)
    threads: int = 0                    # 0: torch's default
    progress: bool = True
    data: str | None = None             # --data: a corpus tokenized once into memory-mapped shards (train.shards)
    shards: str | None = None           # where --data's shards live (None: train.shards.default_shard_dir)
    grad_accum: int = 1                 # micro-batches per optimizer step on each rank
    dtype: str = "fp32"                 # "fp32", or "bf16" autocast (CUDA)
    device: str = "cpu"                 # "cpu" or "cuda" (under torchrun: the local rank's GPU)
    fsdp: bool = False                  # sharded data parallel (train/sharded.py); the run's resume state is sharded
    checkpoint_activations: bool = False   # recompute each block's activations in backward

    def resolve(self) -> "TrainConfig":
        """Fill the size's defaults and check everything; raises TrainError with one line."""
        if self.preset not in PRESETS:
            raise TrainUsageError(f"preset {self.preset!r}: expected one of {', '.join(PRESETS)}; pick one of those")
        if self.size not in SIZES:
            raise TrainUsageError(f"size {self.size!r}: expected one of {', '.join(SIZES)}; pick one of those")
        size = SIZES[self.size]
        for name in ("steps", "batch_size", "seq_len", "lr", "eval_every"):
            if getattr(self, name) is None:
                setattr(self, name, size[name])
        for name in ("steps", "batch_size", "seq_len", "eval_every", "eval_batches", "calib_batches", "grad_accum"):
            v = getattr(self, name)
            if not isinstance(v, int) or v <= 0:
                raise TrainUsageError(f"--{name.replace('_', '-')} {v}: expected a positive integer; pass a value > 0")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise TrainUsageError(f"--lr {self.lr}: expected a positive finite number; pass e.g. --lr 2e-3")
        taper = self.preset_model()["norm"] == "taper"
        if self.taper_steps is not None and self.taper_steps <= 0:
            raise TrainUsageError(f"--taper-steps {self.taper_steps}: expected a positive number of steps (the cosine needs at least one); pass a value > 0")
        if self.warmup_steps is not None and self.warmup_steps < 0:
            raise TrainUsageError(f"--warmup-steps {self.warmup_steps}: expected >= 0; pass 0 or more")
        if taper:
            if self.warmup_steps is None:
                self.warmup_steps = round(WARMUP_FRAC * self.steps)
            if self.taper_steps is None:
                self.taper_steps = max(1, round(TAPER_FRAC * self.steps))
        if self.embed_std is None:
            self.embed_std = PRESETS[self.preset].get("embed_std")
        if self.embed_std is not None and not (math.isfinite(self.embed_std) and self.embed_std > 0):
            raise TrainUsageError(f"--embed-std {self.embed_std}: expected a positive number; pass e.g. 0.02")
        if self.aux_lambda is None:
            self.aux_lambda = 0.1 if PRESETS[self.preset]["aux"] else 0.0
        if not (isinstance(self.aux_lambda, (int, float)) and math.isfinite(self.aux_lambda) and self.aux_lambda >= 0):
            raise TrainUsageError(f"--aux-lambda {self.aux_lambda}: expected a number >= 0; pass 0 to switch the scale loss off")
        if self.aux_lambda > 0 and not taper:
            raise TrainUsageError(f"--aux-lambda {self.aux_lambda}: the scale loss applies to taper models, preset {self.preset!r} is {self.preset_model()['norm']}; drop --aux-lambda")
        if self.s_tgt != "calib":
            try:
                s = float(self.s_tgt)
            except ValueError:
                s = float("nan")
            if not (math.isfinite(s) and s > 0):
                raise TrainUsageError(f"--s-tgt {self.s_tgt!r}: expected 'calib' or a positive number; pass e.g. --s-tgt 1.0")
        d_model = self.model.get("d_model") or SIZES[self.size]["model"]["d_model"]
        n_head = self.model.get("n_head") or SIZES[self.size]["model"]["n_head"]
        if isinstance(d_model, int) and isinstance(n_head, int) and n_head > 0 and d_model % n_head:
            raise TrainUsageError(f"model config: n_head = {n_head}; expected a divisor of d_model ({d_model}); "
                                  f"change --d-model / --n-layer / --n-head")
        cfg = self.decoder_config()
        if cfg.pos_embedding == "rope" and cfg.head_size is None and isinstance(d_model, int) and \
                isinstance(n_head, int) and n_head > 0 and (d_model // n_head) % 2:
            # validate() would name DecoderConfig's head_size (None: it follows d_model / n_head), no option
            width = d_model // n_head
            raise TrainUsageError(f"--d-model {d_model} / --n-head {n_head}: expected an even head width for rope "
                                  f"(--arch llama, qwen3, gemma3 rotate pairs of dims), found {width}; "
                                  f"change --d-model or --n-head (e.g. --d-model {n_head * (width + 1)})")
        self._check_parallel_settings()
        self._check_data()
        if self.corpus != "generated" and not self.corpus.startswith("hf:") and not Path(self.corpus).is_file():
            raise TrainError(f"corpus file {self.corpus}: not found; pass an existing .txt or .jsonl file, or --corpus generated")
        try:
            self.decoder_config().validate()
        except ValueError as e:
            raise TrainUsageError(f"model config: {e}; change --d-model / --n-layer / --n-head") from None
        if self.seq_len > self.decoder_config().max_seq_len:
            raise TrainUsageError(f"--seq-len {self.seq_len}: expected <= max_seq_len {self.decoder_config().max_seq_len}; shorten it or raise --max-seq-len")
        return self

    def _check_parallel_settings(self) -> None:
        if self.device not in DEVICES:
            raise TrainUsageError(f"--device {self.device!r}: expected one of {', '.join(DEVICES)}; pick one of those")
        if self.dtype not in DTYPES:
            raise TrainUsageError(f"--dtype {self.dtype!r}: expected one of {', '.join(DTYPES)}; pick one of those")
        if self.dtype == "bf16" and self.device != "cuda":
            raise TrainUsageError(f"--dtype bf16: bf16 autocast is for CUDA, this run is on --device {self.device}; "
                                  "pass --device cuda, or drop --dtype (fp32) on the CPU")
        self.check_world(1)

    def check_world(self, world_size: int) -> None:
        """Every rank takes an equal share of each global batch: batch = world x grad_accum x micro-batch."""
        ways = world_size * self.grad_accum
        if self.batch_size % ways:
            fix = (f"pass a --grad-accum that divides {self.batch_size // world_size}, the batch of each process"
                   if self.batch_size % world_size == 0 else
                   f"start a number of processes that divides {self.batch_size}")
            raise TrainUsageError(f"--batch-size {self.batch_size}: expected a multiple of {world_size} process(es) x "
                                  f"--grad-accum {self.grad_accum} = {ways} (every rank takes an equal share of each "
                                  f"global batch); {fix} (or another --batch-size for a new run)")

    def _check_data(self) -> None:
        if self.data is None:
            if self.shards is not None:
                raise TrainUsageError(f"--shards {self.shards}: only applies with --data; add --data SOURCE or drop --shards")
            return
        if self.corpus != "generated":
            raise TrainUsageError(f"--data {self.data} and --corpus {self.corpus}: expected one source of text; drop one")
        if self.tokenizer == "train":
            raise TrainUsageError(f"--data {self.data} with --tokenizer train: shards are tokenized once with a fixed "
                                  "tokenizer; pass a tokenizer.json (default: the bundled one)")
        if not Path(self.data).exists():
            raise TrainError(f"--data {self.data}: not found; pass a .txt / .jsonl / .parquet file, a folder of them, "
                             "a datasets save_to_disk folder, or a token shard directory")
        if Path(self.out).resolve() in self.shard_dir().resolve().parents:
            raise TrainUsageError(f"--shards {self.shards}: inside --out {self.out}, which is replaced at every "
                                  "checkpoint; put the shards elsewhere")

    def shard_dir(self) -> Path:
        """Where --data's token shards are (or will be) kept."""
        from train.shards import default_shard_dir, is_shard_dir     # numpy: not for the cheap checks
        if self.shards:
            return Path(self.shards)
        return Path(self.data) if is_shard_dir(self.data) else default_shard_dir(self.data, self.out)

    def preset_model(self) -> dict:
        return PRESETS[self.preset]["model"]

    def decoder_config(self):
        from models.decoder import DecoderConfig
        d = dict(SIZES[self.size]["model"])
        d.update(self.preset_model())
        d.update({k: v for k, v in self.model.items() if v is not None})
        return DecoderConfig(**d)

    def gate_schedule(self):
        from train.schedule import GateSchedule
        if self.preset_model()["norm"] != "taper":
            return None
        return GateSchedule(self.warmup_steps, self.taper_steps)

def apply_resume_options(run, a) -> None:
    """What a --resume may change of the held run's settings (RESUME_OPTIONS of train and train.finetune):
    where it runs and reports, not what it computes."""
    run.out, run.threads, run.progress = a.out, a.threads, not a.quiet
    if a.grad_accum is not None:
        run.grad_accum = a.grad_accum
    if a.device is not None:
        run.device = a.device
    if a.checkpoint_activations:
        run.checkpoint_activations = True


def add_execution_options(p, module: str) -> None:
    """The data-parallel options `train` and `train.finetune` share (one place for their help)."""
    from core.errors import int_in
    d = p.add_argument_group(f"execution (data parallel: launch with torchrun --nproc-per-node N -m {module} ...)")
    d.add_argument("--grad-accum", type=int_in(1, 65536), help="micro-batches per step on each rank (default 1); "
                   "--batch-size must be a multiple of processes x grad-accum")
    d.add_argument("--device", choices=DEVICES, help="cpu (default; gloo between ranks) or cuda (one GPU per rank, nccl)")
    d.add_argument("--dtype", choices=DTYPES, default="fp32", help="fp32 (default) or bf16 autocast (CUDA only; "
                   "with --fsdp: bf16 compute, fp32 master weights and reductions)")
    d.add_argument("--fsdp", action="store_true", help="sharded data parallel (FSDP2): each rank holds 1/N of the "
                   "weights, gradients and optimizer state; a run setting (--resume keeps it)")
    d.add_argument("--checkpoint-activations", action="store_true",
                   help="recompute each block's activations in backward (less memory, ~1/3 more compute)")
