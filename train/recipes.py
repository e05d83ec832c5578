"""The fine-tuning recipes of train.finetune (train/loop.py's Recipe): where the run starts and,
for FakeLN, which norm gets its std frozen when, and how the run's checkpoints are saved.

    FineTune(method, source)   internal-taper | all-taper | fakeln | vanilla
    FrozenStdLayerNorm         a LayerNorm whose std can be frozen (FakeLN)
    eps_trick_model(model)     the plain Decoder a FakeLN run saves: frozen norms as
                               LayerNorm(eps 1e12, gamma * 1e6 / std), Baroni et al.'s published form
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from models.decoder import Decoder, DecoderConfig
from models.norms import LayerNorm
from train.distributed import SINGLE, Parallel
from train.loop import Data, Recipe

FAKELN_EPS = 1e12            # Baroni et al.'s published checkpoints: eps 1e12, gamma * sqrt(eps) / std
CALIB_BATCH = 16             # windows per forward when measuring a norm's std (memory only; the sum is the same)


class FrozenStdLayerNorm(nn.Module):
    """A LayerNorm whose std can be frozen: std 0 is a live LayerNorm, std > 0 the fixed map
    (x - mean x) * gamma / std + beta (FakeLN). gamma and beta keep training either way."""

    def __init__(self, norm: LayerNorm):
        super().__init__()
        self.eps = norm.eps
        self.weight = nn.Parameter(norm.weight.detach().clone())
        self.bias = nn.Parameter(norm.bias.detach().clone())
        self.register_buffer("std", torch.zeros(()))   # saved with the run state: --resume restores it

    def forward(self, x):
        if float(self.std) == 0.0:
            return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        return (x - x.mean(dim=-1, keepdim=True)) * (self.weight / self.std) + self.bias


def load_source_model(path: str) -> Decoder:
    """The model --from names: our checkpoint, or a Hugging Face folder converted in memory."""
    from models.checkpoint import load_checkpoint
    from models.convert import convert, is_hf_folder
    return convert(path).model if is_hf_folder(path) else load_checkpoint(path)


def load_source(model: Decoder, source: Decoder) -> Decoder:
    """Copy the source's weights; TaperNorm's gamma_tilde / beta_tilde are missing (calibration sets them)."""
    missing, unexpected = model.load_state_dict(source.state_dict(), strict=False)
    missing = [m for m in missing if not m.endswith(("weight_tilde", "bias_tilde"))
               and not (model.cfg.tie_embeddings and m == "lm_head.weight")]
    assert not missing and not unexpected, (missing, unexpected)   # the configs differ only in norm kind
    if model.cfg.tie_embeddings:
        model.lm_head.weight = model.wte.weight
    return model


class FineTune(Recipe):
    """One fine-tuning method; see train/finetune.py for what each does."""

    program = "python -m train.finetune"

    def __init__(self, method: str, source_path: str, every: int | None = None):
        self.method, self.source_path, self.every = method, source_path, every

    def describe(self) -> dict:
        return {"finetune": self.method, "from": self.source_path, "fakeln_every": self.every}

    def initial_model(self, run, fresh: bool) -> Decoder:
        model = Decoder(run.decoder_config())
        if fresh:
            load_source(model, load_source_model(self.source_path))
        if self.method == "fakeln":
            for name in self.order(model):
                parent, _, leaf = name.rpartition(".")
                owner = model.get_submodule(parent) if parent else model
                setattr(owner, leaf, FrozenStdLayerNorm(getattr(owner, leaf)))
        return model

    def source_weights(self, run):
        """--from, read tensor by tensor (row range by row range) when --fsdp fills each rank's shards."""
        from models.weights import open_weights
        return open_weights(self.source_path)

    @staticmethod
    def order(model) -> list[str]:
        """Baroni et al.'s removal order: MLP norms, attention norms, the final norm."""
        n = model.cfg.n_layer
        return [f"blocks.{i}.ln_2" for i in range(n)] + [f"blocks.{i}.ln_1" for i in range(n)] + ["ln_f"]

    def before_step(self, step: int, model: Decoder, data: Data, log: dict, par: Parallel = SINGLE) -> None:
        if self.method != "fakeln" or step == 0 or step % self.every:
            return
        k = step // self.every - 1
        order = self.order(model)
        if k >= len(order):
            return
        name = order[k]
        std = measure_std(model, model.get_submodule(name), data, par)   # the same on every rank
        model.get_submodule(name).std.fill_(std)
        log.setdefault("fakeln", []).append({"step": step, "layer": name, "std": std})

    def saved_model(self, model):
        if self.method != "fakeln":
            return model
        return eps_trick_model(model)

    def saved_config(self, model):
        return eps_trick_config(model) if self.method == "fakeln" else model.cfg

    def stores(self, name: str) -> bool:
        return not (self.method == "fakeln" and name.endswith(".std"))

    def saved_tensor(self, model, name: str, full: torch.Tensor) -> torch.Tensor:
        return eps_trick_tensor(model, name, full) if self.method == "fakeln" else full


@torch.no_grad()
def measure_std(model: Decoder, norm: FrozenStdLayerNorm, data: Data, par: Parallel = SINGLE) -> float:
    """Mean over held-out tokens of the norm input's std, sqrt(var(x) + eps) (what the live norm divides by):
    Baroni et al.'s sigma_avg, measured on the calibration split with the model as it is at that step.
    Under torchrun each rank measures its share of the windows and the sums are all-reduced, so every
    rank freezes the same std (that of one process, to float64 rounding)."""
    total, count = 0.0, 0

    def hook(module, args):
        nonlocal total, count
        x = args[0].double()
        total += float(torch.sqrt(x.var(dim=-1, unbiased=False) + module.eps).sum())
        count += x.shape[0] * x.shape[1]
    handle = norm.register_forward_pre_hook(hook)
    was = model.training
    model.eval()
    try:
        for w in par.batches(data.calib, CALIB_BATCH):
            model(w[:, :-1])
    finally:
        handle.remove()
        model.train(was)
    total, count = par.sum([total, count])
    return total / count


def frozen_norms(model) -> dict[str, FrozenStdLayerNorm]:
    """The FakeLN norms whose std is frozen (std > 0), by module name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, FrozenStdLayerNorm) and float(m.std) > 0}


def eps_trick_config(model) -> DecoderConfig:
    """The config of eps_trick_model(model): frozen norms get eps 1e12."""
    cfg = copy.deepcopy(model.cfg)
    frozen = frozen_norms(model)
    if frozen.keys() == set(cfg.norm_names()):   # every norm fixed: one eps, as Baroni et al.'s folders have it
        cfg.eps, cfg.layer_eps = FAKELN_EPS, {}
    else:
        cfg.layer_eps = {**cfg.layer_eps, **{n: FAKELN_EPS for n in frozen}}
    return cfg


@torch.no_grad()
def eps_trick_tensor(model, name: str, full: torch.Tensor) -> torch.Tensor:
    """The stored value of state-dict entry `name` (full: its whole tensor): a frozen norm's gamma
    becomes gamma * 1e6 / std, everything else is stored as it is."""
    owner, _, leaf = name.rpartition(".")
    norm = frozen_norms(model).get(owner)
    if norm is None or leaf != "weight":
        return full
    return full * (math.sqrt(FAKELN_EPS) / norm.std.to(full.device, full.dtype))


@torch.no_grad()
def eps_trick_model(model: Decoder) -> Decoder:
    """A plain Decoder: frozen norms as LayerNorm(eps 1e12, gamma * 1e6 / std), live ones as they are."""
    out = Decoder(eps_trick_config(model))
    state = {k: eps_trick_tensor(model, k, v) for k, v in model.state_dict().items() if not k.endswith(".std")}
    out.load_state_dict(state, strict=False)
    if out.cfg.tie_embeddings:
        out.lm_head.weight = out.wte.weight
    return out.eval()
