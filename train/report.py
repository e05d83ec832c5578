"""Results of a set of training runs: the val-loss table, the logit-chasing figure, the zoo.

    python -m train.report --runs runs/tiny [--figure docs/figures/prelogit_rms.png] [--install-zoo models/zoo]

--runs holds one checkpoint directory per preset (baseline, internal-taper,
all-taper, all-taper-noanchor, dyt), each with its train_log.json. Prints a
Markdown table (final val loss, % vs baseline, final pre-logit RMS and max
|logit|), the pre-logit RMS growth of all-taper vs all-taper-noanchor, and
with --figure plots both RMS curves. --install-zoo copies the four shipped
checkpoints (not all-taper-noanchor) into the zoo, each atomically.
"""
from __future__ import annotations

from core.lifecycle import guard_startup
guard_startup(__name__)     # before the imports below: a Ctrl-C while they load exits 130 with one line

import argparse
import json
import shutil
import sys
from pathlib import Path

from core.outputs import CHECKPOINT, output_dir
from models.checkpoint import CONFIG, TOKENIZER, WEIGHTS, load_checkpoint
from train.loop import LOG_NAME

ORDER = ["baseline", "internal-taper", "all-taper", "all-taper-noanchor", "all-taper-aux0", "dyt"]
# all-taper-aux0 (optional): `--preset all-taper --aux-lambda 0`, the tapered final norm without the
# scale loss; identical to all-taper up to calibration, so it isolates what the loss does afterwards.
ZOO_PRESETS = ["baseline", "internal-taper", "all-taper", "dyt"]
TARGET = {"internal-taper": 2.0, "all-taper": 3.0}   # acceptance: % within baseline
PAPER = {"internal-taper": "0.7-1.5%", "all-taper": "0.8-1.8%"}


def read_logs(runs: Path) -> dict[str, dict]:
    logs = {}
    for name in ORDER:
        p = runs / name / LOG_NAME
        if p.is_file():
            from core.inputs import read_json_file
            logs[name] = read_json_file(p, "training log")
    return logs


def growth(log: dict, from_step: int = 0) -> dict:
    """Pre-logit RMS at `from_step` (the last eval at or before it), at the end, and their ratio."""
    evals = log["evals"]
    start = next((e for e in reversed(evals) if e["step"] <= from_step), None)
    end = evals[-1]
    if start is None or start is end:
        return None
    return {"from_step": start["step"], "to_step": end["step"], "rms_from": start["prelogit_rms"],
            "rms_to": end["prelogit_rms"], "ratio": end["prelogit_rms"] / start["prelogit_rms"],
            "increase": end["prelogit_rms"] - start["prelogit_rms"],
            "max_logit_from": start["max_abs_logit"], "max_logit_to": end["max_abs_logit"]}


def chasing(logs: dict[str, dict]) -> dict | None:
    """Growth of all-taper-noanchor vs all-taper over the same steps: whole run and after calibration."""
    return _compare(logs, "all-taper-noanchor")


def _compare(logs: dict[str, dict], other: str) -> dict | None:
    if "all-taper" not in logs or other not in logs:
        return None
    out = {}
    calib = (logs["all-taper"].get("calibration") or {}).get("step", 0)
    for label, step in (("whole run", 0), ("from calibration", calib)):
        a, n = growth(logs["all-taper"], step), growth(logs[other], step)
        if a is None or n is None or a["to_step"] != n["to_step"]:
            continue  # a run still going: no comparison over the same steps yet
        out[label] = {"all-taper": a, other: n, "growth_ratio": n["ratio"] / a["ratio"],
                      "increase_ratio": n["increase"] / a["increase"] if a["increase"] else float("inf")}
    return out or None


def table(logs: dict[str, dict]) -> str:
    base = logs.get("baseline")
    b = base["evals"][-1]["val_loss"] if base else None
    rows = ["| model | params | steps | final gate | final val loss | vs baseline | target | paper | pre-logit RMS | max abs logit |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    for name in ORDER:
        if name not in logs:
            continue
        log = logs[name]
        e = log["evals"][-1]
        rel = "" if b is None or name == "baseline" else f"{100 * (e['val_loss'] - b) / b:+.2f}%"
        tgt = f"within {TARGET[name]:g}%" if name in TARGET else ""
        gate = "" if e["gate"] is None else f"{e['gate']:g}"
        rows.append(f"| {name} | {log['params']:,} | {e['step']} | {gate} | {e['val_loss']:.4f} | {rel} | {tgt} | "
                    f"{PAPER.get(name, '')} | {e['prelogit_rms']:.3f} | {e['max_abs_logit']:.1f} |")
    return "\n".join(rows)


def plot(logs: dict[str, dict], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    styles = {"all-taper": ("tab:blue", "all-taper (scale loss)"), "all-taper-noanchor": ("tab:red", "all-taper-noanchor"),
              "all-taper-aux0": ("tab:orange", "all-taper, lambda = 0"),
              "internal-taper": ("tab:green", "internal-taper"), "baseline": ("black", "baseline (RMSNorm)")}
    for name, (color, label) in styles.items():
        if name not in logs:
            continue
        ev = logs[name]["evals"]
        steps = [e["step"] for e in ev]
        ls = "-" if name.startswith("all-taper") else ":"
        ax1.plot(steps, [e["prelogit_rms"] for e in ev], ls, color=color, label=label, marker="o", ms=3)
        ax2.plot(steps, [e["max_abs_logit"] for e in ev], ls, color=color, label=label, marker="o", ms=3)
    sched = (logs.get("all-taper") or {}).get("schedule")
    for ax in (ax1, ax2):
        if sched:
            ax.axvspan(sched["calibration_step"], sched["gate_zero_from"], color="0.9", zorder=0)
            ax.axvline(sched["calibration_step"], color="0.6", lw=0.8)
        ax.set_xlabel("step  (shaded: cosine taper of the gate, 1 -> 0)")
        ax.grid(alpha=0.3)
    ax1.set_yscale("log")
    ax1.set_ylabel("pre-logit RMS (val, mean over tokens)")
    ax2.set_ylabel("max |logit| (val)")
    ax1.legend(fontsize=8)
    ax1.set_title("Pre-logit scale: scale loss vs no anchor")
    ax2.set_title("Logit magnitude")
    fig.tight_layout()
    from core.outputs import FIGURE, output_file, png_signature_metadata
    with output_file(path, FIGURE) as tmp:
        fig.savefig(tmp, dpi=110, format="png", metadata=png_signature_metadata())
    plt.close(fig)


def install_zoo(runs: Path, zoo: Path, presets=ZOO_PRESETS) -> list[str]:
    """Copy the shipped checkpoints into `zoo`, each validated by loading and written atomically
    (the checkpoint files and the log; not the resume state)."""
    from core.errors import UserError
    done = []
    for name in presets:
        src = runs / name
        if not src.is_dir():
            continue
        model = load_checkpoint(src)
        if model.cfg.norm == "taper" and model.gate.value != 0.0:
            raise UserError(f"{src}: gate {model.gate.value}; the zoo ships finished tapers only (train to the end)")
        with output_dir(zoo / name, CHECKPOINT, inputs=[src]) as tmp:
            for f in (CONFIG, WEIGHTS, TOKENIZER, LOG_NAME):
                if (src / f).is_file() or f != LOG_NAME:
                    shutil.copyfile(src / f, tmp / f)
        done.append(name)
    return done


def run(argv: list[str]) -> int:
    from core.errors import ArgumentParser, UserError
    from core.outputs import FIGURE, REPORT_JSON, check_output_file, write_json
    p = ArgumentParser(prog="python -m train.report", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", required=True)
    p.add_argument("--figure", help="write the pre-logit RMS figure (PNG) here")
    p.add_argument("--json", help="write table numbers and growth to this JSON file")
    p.add_argument("--install-zoo")
    p.add_argument("--presets", default=",".join(ZOO_PRESETS), help="which runs --install-zoo copies (comma-separated)")
    a = p.parse_args(argv)
    runs = Path(a.runs)
    for path, kind in ((a.figure, FIGURE), (a.json, REPORT_JSON)):
        if path:
            check_output_file(path, kind, inputs=[runs])
    logs = read_logs(runs)
    if not logs:
        raise UserError(f"{runs}: no <preset>/{LOG_NAME} found; expected the --out directories of python -m train")
    print(table(logs))
    ch = chasing(logs)
    aux0 = _compare(logs, "all-taper-aux0")
    for other, comp in (("all-taper-noanchor", ch), ("all-taper-aux0", aux0)):
        for label, g in (comp or {}).items():
            a_, n_ = g["all-taper"], g[other]
            print(f"pre-logit RMS growth, {label} (step {a_['from_step']} -> {a_['to_step']}): "
                  f"all-taper {a_['rms_from']:.3f} -> {a_['rms_to']:.3f} (x{a_['ratio']:.2f}), "
                  f"{other} {n_['rms_from']:.3f} -> {n_['rms_to']:.3f} (x{n_['ratio']:.2f}); "
                  f"{other} grows {g['growth_ratio']:.2f}x more as a factor, its increase is {g['increase_ratio']:.1f}x "
                  f"all-taper's (+{n_['increase']:.2f} vs +{a_['increase']:.2f}); "
                  f"max |logit| {a_['max_logit_to']:.1f} vs {n_['max_logit_to']:.1f}")
    if a.figure:
        plot(logs, Path(a.figure))
        print(f"wrote {a.figure}")
    if a.json:
        write_json(a.json, {"final": {k: v["evals"][-1] for k, v in logs.items()}, "chasing": ch, "aux0": aux0},
                   inputs=[runs])
    if a.install_zoo:
        done = install_zoo(runs, Path(a.install_zoo), [n for n in a.presets.split(",") if n])
        print(f"installed {', '.join(done)} into {a.install_zoo}")
    return 0


def main(argv=None) -> int:
    from core.lifecycle import run_cli
    return run_cli(run, argv)


if __name__ == "__main__":
    from core.lifecycle import exit_after
    exit_after(main)
