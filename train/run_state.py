"""The resume state of a training run: what --resume needs beyond the checkpoint, stored as data only.

    train_state.safetensors   every tensor: model.<name>, optimizer.<param index>.<key> (AdamW's step
                              and moments), data_rng and torch_rng (the generators' states, uint8)
    train_state.json          the plain rest: format, step, each TaperNorm's c, the scale-loss state,
                              the optimizer's param groups, the log, "sharded"
    train_state.dcp/          --fsdp runs ("sharded": true): model and optimizer as torch.distributed.checkpoint
                              shards (train/sharded.py), which train_state.safetensors then leaves out

    write_run_state(directory, state)    state: the dict load_run_state returns
    load_run_state(run_dir) -> dict      {"step", "model", "taper_c", "optimizer", "data_rng", "torch_rng",
                                          "aux", "log"}; one TrainError line for anything unreadable

Run folders get copied and shared, so reading one must never run code: safetensors and JSON
cannot, a pickle can (torch.load(weights_only=False) of a crafted file runs its payload). The
pickled train_state.pt that earlier versions wrote is therefore refused by name, never opened.
"""
from __future__ import annotations

import json
from pathlib import Path

from safetensors.torch import load_file, save_file

from core.inputs import read_json_file
from core.outputs import writing
from train.errors import TrainError

RUN_STATE = "train_state.safetensors"
RUN_STATE_JSON = "train_state.json"
OLD_RUN_STATE = "train_state.pt"          # a pickle: written before format 1, never read
FORMAT = 1


def _storable(tensors: dict) -> dict:
    """CPU, contiguous, each in its own memory: safetensors refuses shared storage (a tied LM head)."""
    out, seen = {}, set()
    for name, t in tensors.items():
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        out[name] = t.clone() if ptr in seen else t
        seen.add(ptr)
    return out


def write_run_state(directory: Path, state: dict) -> None:
    """RUN_STATE and RUN_STATE_JSON into `directory` (a temporary one: the caller swaps it in whole)."""
    opt = state["optimizer"]
    tensors = {f"model.{k}": v for k, v in state["model"].items()}
    tensors.update({f"optimizer.{i}.{k}": v for i, per_param in opt["state"].items() for k, v in per_param.items()})
    tensors.update(data_rng=state["data_rng"], torch_rng=state["torch_rng"])
    with writing(Path(directory) / RUN_STATE):         # safetensors' errors name no file
        save_file(_storable(tensors), str(Path(directory) / RUN_STATE))
    plain = {"format": FORMAT, "step": state["step"], "taper_c": state["taper_c"], "aux": state["aux"],
             "optimizer_param_groups": opt["param_groups"], "log": state["log"],
             "sharded": bool(state.get("sharded", False))}
    with writing(Path(directory) / RUN_STATE_JSON):
        (Path(directory) / RUN_STATE_JSON).write_text(json.dumps(plain, indent=1) + "\n")


def has_run_state(run_dir: str | Path) -> bool:
    """Whether `run_dir` holds a resume state, in this format or the refused old one."""
    return any((Path(run_dir) / name).is_file() for name in (RUN_STATE, OLD_RUN_STATE))


def refuse_old_state(run_dir: str | Path) -> None:
    """TrainError when the run's state is only the pickled train_state.pt of earlier versions."""
    run_dir = Path(run_dir)
    if (run_dir / OLD_RUN_STATE).is_file() and not (run_dir / RUN_STATE).is_file():
        raise TrainError(f"{run_dir / OLD_RUN_STATE}: expected the resume state as {RUN_STATE} + {RUN_STATE_JSON}, "
                         "found the old pickle format, which can run code when loaded (a crafted file runs its "
                         "payload), so it is not read; start the run again into another --out (its command is "
                         "in train_log.json)")


def _check_plain(plain) -> None:
    """The types _train relies on; ValueError otherwise (a hand-edited or crafted file)."""
    def number(x):
        return isinstance(x, (int, float)) and not isinstance(x, bool)
    if not (isinstance(plain, dict) and plain.get("format") == FORMAT):
        raise ValueError(f"expected format {FORMAT}")
    aux, log = plain.get("aux"), plain.get("log")
    ok = (isinstance(plain.get("step"), int) and isinstance(plain.get("optimizer_param_groups"), list)
          and isinstance(plain.get("taper_c"), dict) and all(number(c) for c in plain["taper_c"].values())
          and isinstance(aux, dict) and isinstance(aux.get("on"), bool)
          and (aux.get("s_tgt") is None or number(aux["s_tgt"]))
          and isinstance(log, dict) and isinstance(log.get("run"), dict)
          and isinstance(log.get("evals"), list) and len(log["evals"]) > 0)
    if not ok:
        raise ValueError("fields missing or of the wrong type")


def load_run_state(run_dir: str | Path) -> dict:
    """The state write_run_state wrote; TrainError (one line) for an old, unreadable or incomplete one."""
    run_dir = Path(run_dir)
    refuse_old_state(run_dir)
    fix = "start a new run in another --out"
    try:
        tensors = load_file(str(run_dir / RUN_STATE))
    except Exception as e:  # missing, truncated, not safetensors
        raise TrainError(f"{run_dir / RUN_STATE}: expected the tensors of a run's resume state (safetensors), "
                         f"found an unreadable file ({type(e).__name__}); {fix}") from None
    plain = read_json_file(run_dir / RUN_STATE_JSON, "resume state")
    try:
        _check_plain(plain)
        model, optimizer = {}, {}
        for name, t in tensors.items():
            group, _, rest = name.partition(".")
            if group == "model":
                model[rest] = t
            elif group == "optimizer":
                index, _, key = rest.partition(".")
                optimizer.setdefault(int(index), {})[key] = t
        return {"step": plain["step"], "model": model, "taper_c": plain["taper_c"],
                "optimizer": {"state": optimizer, "param_groups": plain["optimizer_param_groups"]},
                "data_rng": tensors["data_rng"], "torch_rng": tensors["torch_rng"], "aux": plain["aux"],
                "log": plain["log"], "sharded": plain.get("sharded") is True}
    except (KeyError, ValueError) as e:
        raise TrainError(f"{run_dir / RUN_STATE_JSON}: expected the resume state of format {FORMAT} (with "
                         f"{RUN_STATE}), found an incomplete one ({e}); {fix}") from None


def restore_error(run_dir: str | Path, e: Exception) -> TrainError:
    """The one line for a state that reads but does not fit the run's model or optimizer."""
    detail = " ".join(str(e).split())[:300]
    return TrainError(f"{Path(run_dir) / RUN_STATE}: expected the resume state of the run's own model, found one "
                      f"that does not fit it ({detail}); start a new run in another --out")
