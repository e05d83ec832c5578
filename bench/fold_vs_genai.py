"""python -m bench.fold_vs_genai run --shape qwen3-0.6b --work DIR --json OUT.json [--pairs 9]
                                    [--decode-tokens 64] [--prompt-tokens 16] [--threads 2] [--profile-steps 32]
python -m bench.fold_vs_genai taper FOLDER --out CKPT          (the All-Taper checkpoint of a folder)
python -m bench.fold_vs_genai profile GRAPH [--genai] [--steps N] [--threads N]      (a child of run)

The benchmark where the fold should win (issue 34): at a real shape, int4, batch 1, this CPU, an
All-Taper model (every norm a TaperNorm at g = 0, c calibrated) folded by export.build, against ONNX
Runtime GenAI's own model builder on the RMSNorm model of the same shape (the same tensors; the All-Taper
one has its W_o / W_down scaled down, finite_init).

    DIR/<shape>                        random-init Hugging Face folder (bench/shapes.py), RMSNorm
    DIR/genai-<shape>-int4             GenAI's builder on it (-p int4 -e cpu): its norms stay as ops
    DIR/<shape>-all-taper              the same tensors as an All-Taper checkpoint, W_o / W_down scaled down
                                       (finite_init), every norm a TaperNorm, c by least squares on its own
                                       activations (random tokens), each norm on what it sees with the norms
                                       before it already at g = 0 (train.calibration.calibrate_in_order),
                                       gamma~ = gamma, gate 0: the random model stays finite through its
                                       layers (checked on RANDOM_CHECKS batches of other tokens)
    DIR/build-<shape>-all-taper-int4   export.build --fuse --quantize int4 of it (no normalization op left)

Then, each graph in its own child process: ONNX Runtime's profiler over --profile-steps decode steps
gives the share of a step's node time spent in normalization ops (GenAI's graph: its
SimplifiedLayerNormalization / SkipSimplifiedLayerNormalization, the QK-norms' included: the most
the fold can take away on this CPU); then --pairs interleaved pairs (bench.stats.round_order: the
two alternate going first) of `python -m bench.scale decode` children, tokens/s over the decode
steps; the ratio ours / GenAI per pair, min / median / max. Target: median ratio >= 1 + 0.8 x share.
Each step reuses what an earlier run left in DIR (the same shape and seed) when its marker
(.tapernorm-output.json) says it is that step's output, made after its input; a folder there that is
not ours is refused before anything runs, whatever files it holds.
"""
from __future__ import annotations

from core.lifecycle import guard_startup
guard_startup(__name__)     # before the imports below: a Ctrl-C while they load exits 130 with one line

import json
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from core.errors import ArgumentParser, UserError, int_in
from core.lifecycle import run_cli

if TYPE_CHECKING:
    from core.outputs import OutputKind

CALIB_BATCH, CALIB_TOKENS = 4, 64          # one random-token batch [4, 64] for the least-squares c
RANDOM_CHECKS = 8                           # other random batches [2, 64] whose logits must stay finite
TARGET_SHARE = 0.8                          # the median ratio should capture 80 % of GenAI's norm share
GENAI_NORM_OPS = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "RMSNormalization",
                  "LayerNormalization", "SkipLayerNormalization")


# --- the All-Taper checkpoint ----------------------------------------------------------------------

def finite_init(model) -> None:
    """Scale each block's W_o by 1 / sqrt(2 L) (GPT-2's init of the residual projections) and W_down by 1 / (2 L),
    in place. A norm-free block's MLP grows with the square of its input (SiLU(gate) * up), so a random model's
    residual stream must stay near where each c is calibrated: at std 0.02 and calibrated in order, the
    All-Taper Qwen3-0.6B still overflowed on 1 random batch in 5; scaled so, on none of 12. Speed does not
    depend on the values (the benchmark's graphs have the shapes and bytes of the real model)."""
    import math
    import torch
    layers = model.cfg.n_layer
    with torch.no_grad():
        for block in model.blocks:
            block.attn.out_proj.weight.mul_(1 / math.sqrt(2 * layers))
            block.mlp.down_proj.weight.mul_(1 / (2 * layers))


def all_taper_checkpoint(folder: Path, out: Path, seed: int = 0, log=print) -> dict:
    """The folder's model with every norm a TaperNorm at g = 0, c calibrated, saved at `out`; what it did.
    The TaperNorms take the converted model's tensors (assign: one copy of the weights alive)."""
    import copy
    import torch
    from models.checkpoint import save_checkpoint
    from models.convert import convert
    from models.decoder import Decoder
    from train.calibration import calibrate_in_order
    t0 = time.perf_counter()
    source = convert(folder).model
    cfg = copy.deepcopy(source.cfg)
    cfg.norm, cfg.taper_scope, cfg.taper_base = "taper", "all", "rms"
    with torch.device("meta"):
        model = Decoder(cfg)
    missing, unexpected = model.load_state_dict(source.state_dict(), strict=False, assign=True)
    assert not unexpected and all(m.endswith("weight_tilde") or m == "lm_head.weight" for m in missing), missing
    for layer in model.taper_layers().values():      # calibration copies gamma into gamma~
        layer.weight_tilde = torch.nn.Parameter(torch.empty_like(layer.weight))
    if cfg.tie_embeddings:
        model.lm_head.weight = model.wte.weight
    for rotary in model.rotaries().values():
        rotary.reset_parameters()
    del source
    model.eval()
    finite_init(model)
    g = torch.Generator().manual_seed(seed)
    c = calibrate_in_order(model, torch.randint(0, cfg.vocab_size, (CALIB_BATCH, CALIB_TOKENS), generator=g))
    worst = 0.0
    with torch.no_grad():
        for _ in range(RANDOM_CHECKS):
            logits = model(torch.randint(0, cfg.vocab_size, (2, CALIB_TOKENS), generator=g))
            if not torch.isfinite(logits).all():
                raise UserError(f"{folder}: expected the All-Taper model to stay finite at g = 0, found non-finite "
                                "logits on random tokens; the shape needs a smaller finite_init")
            worst = max(worst, float(logits.abs().max()))
    save_checkpoint(model, out, None, inputs=[folder])      # never into (or over) the folder it reads
    log(f"  {out}: all-taper, {len(c)} norms calibrated (c {min(c.values()):.3g} .. {max(c.values()):.3g}), "
        f"finite on {RANDOM_CHECKS} random batches (max |logit| {worst:.3g}), {time.perf_counter() - t0:.0f} s")
    return {"norms": len(c), "c_min": min(c.values()), "c_max": max(c.values()), "max_abs_logit": worst}


# --- the profile child -----------------------------------------------------------------------------

def profile_graph(graph: str, steps: int, threads: int, genai: bool) -> dict:
    """ONNX Runtime's profile of `steps` greedy decode steps after a 16-token prompt: the norm share."""
    import numpy as np
    from bench.runners import ort_norm_share
    with tempfile.TemporaryDirectory() as tmp:
        prompt = np.random.default_rng(0).integers(0, 1000, 16)
        if genai:
            events = _genai_profile(Path(graph), Path(tmp), prompt, steps, threads)
        else:
            from runtime.generate import GenerationConfig, generate
            from runtime.ort_session import OrtSession
            s = OrtSession(graph, intra_op_threads=threads, profile_prefix=Path(tmp) / "ort").activate()
            try:
                generate(s, [prompt.tolist()], GenerationConfig(max_new_tokens=steps + 1))
                events = s.profile_events()
            finally:
                s.deactivate()
    return ort_norm_share(events, {})


def _genai_profile(folder: Path, tmp: Path, prompt, steps: int, threads: int) -> list[dict]:
    """GenAI's own loop with ONNX Runtime profiling on (genai_config's session_options.enable_profiling, a
    file prefix); the trace is written when the model is released. The folder's config is left as it was."""
    import gc
    import shutil
    import numpy as np
    import onnxruntime_genai as og
    view = tmp / "genai"
    view.mkdir()
    for f in folder.iterdir():                       # a view of the folder with its own genai_config.json
        (view / f.name).symlink_to(f.resolve())
    cfg = json.loads((folder / "genai_config.json").read_text())
    options = cfg["model"]["decoder"]["session_options"]
    options.update(enable_profiling=str(tmp / "genai_profile"), intra_op_num_threads=threads)
    (view / "genai_config.json").unlink()
    (view / "genai_config.json").write_text(json.dumps(cfg))
    from bench.genai import genai_window
    model = og.Model(str(view))
    params = og.GeneratorParams(model)
    n = len(prompt) + steps + 1
    params.set_search_options(max_length=max(n, genai_window(cfg)), min_length=n, do_sample=False)
    gen = og.Generator(model, params)
    gen.append_tokens(np.asarray(prompt, np.int32))
    for _ in range(steps + 1):
        gen.generate_next_token()
    del gen, params, model
    gc.collect()
    traces = sorted(tmp.glob("genai_profile*.json"))
    if not traces:
        raise RuntimeError(f"{folder}: GenAI wrote no ONNX Runtime profile (enable_profiling)")
    events = json.loads(traces[-1].read_text())
    shutil.rmtree(view)
    return events


# --- run -------------------------------------------------------------------------------------------

def _child(cmd: list[str], what: str) -> dict:
    """Run a child command to its end (bench.scale.measured); its row. A child's refusal (its one
    `error: ...` line: a folder it may not replace, a full disk) is this command's one line, naming the
    step; an interrupted child is this command's interrupt; only a child's bug is raised as one."""
    from bench.scale import measured
    from core.errors import EXIT_INTERRUPTED, REPORT_BUG
    row = measured(cmd)
    if row["rc"] == 0:
        return row
    error = row["error"] or f"exit code {row['rc']}, no output"
    if row["rc"] in (EXIT_INTERRUPTED, -2):
        raise KeyboardInterrupt
    if error.startswith("error: ") and REPORT_BUG not in error:
        raise UserError(f"{what}: {error[len('error: '):]}")
    raise RuntimeError(f"{what} failed: {error}")


def work_folders(work: Path, shape: str) -> dict[str, tuple[Path, OutputKind]]:
    """The folders a run writes under --work for one shape: step -> (path, the kind it carries)."""
    from core.outputs import BENCH_CACHE, BUILD, CHECKPOINT, SCALE_FOLDER
    return {"folder": (work / shape, SCALE_FOLDER), "genai_input": (work / f"genai-input-{shape}", SCALE_FOLDER),
            "genai": (work / f"genai-{shape}-int4", BENCH_CACHE), "taper": (work / f"{shape}-all-taper", CHECKPOINT),
            "ours": (work / f"build-{shape}-all-taper-int4", BUILD)}


def check_work(work: Path, shapes: list[str]) -> None:
    """Every folder the run writes, checked before it writes the first (one line, not a failed step later):
    a folder there that is not ours (no marker of its kind) is refused, whatever files it holds."""
    from bench.shapes import resolve_shape
    from core.outputs import check_output_dir
    for spec in shapes:
        for path, kind in work_folders(work, resolve_shape(spec)[0]).values():
            check_output_dir(path, kind, option="--work")


def bench_shape(shape: str, work: Path, args, log=print) -> dict:
    from bench import stats
    from bench.scale import genai_build, genai_input
    from bench.shapes import folder_matches, resolve_shape, write_random_folder
    from core.outputs import BENCH_CACHE, BUILD, CHECKPOINT, is_earlier_output
    py = sys.executable
    spec, shape = shape, resolve_shape(shape)[0]          # a SHAPES name or a config .json path
    places = work_folders(work, shape)
    folder = places["folder"][0]
    if folder_matches(folder, spec):
        log(f"{shape}: reusing {folder}")
    else:
        write_random_folder(spec, folder, log=log)
    out = {"shape": shape, "folder": str(folder), "steps": {}}
    # an earlier step's output is reused only when its marker says it is one, of the kind that step writes,
    # made after what it was made from (is_earlier_output); never for the file names a folder holds
    genai = places["genai"][0]
    if not is_earlier_output(genai, BENCH_CACHE, made_after=folder):
        log(f"{shape}: GenAI's model builder -p int4 -e cpu")
        inp = genai_input(folder, places["genai_input"][0])
        row = genai_build(inp, genai, work / "genai-cache")
        if row["rc"] != 0:          # GenAI's own tool: its last line, and how to see the rest
            raise UserError(f"{genai}: expected GenAI's model builder to build {shape}, found it failed ({row['error']}); "
                            f"run python -m bench.genai_builder -i {inp} -o DIR -p int4 -e cpu for its whole output")
        out["steps"]["genai_build"] = {k: row[k] for k in ("wall_s", "peak_rss_bytes")}
    ckpt = places["taper"][0]
    if not is_earlier_output(ckpt, CHECKPOINT, made_after=folder):
        log(f"{shape}: the All-Taper checkpoint")
        row = _child([py, "-m", "bench.fold_vs_genai", "taper", str(folder), "--out", str(ckpt)], "the taper checkpoint")
        out["steps"]["taper"] = {"line": row["stdout"].strip().splitlines()[-1], "wall_s": row["wall_s"],
                                 "peak_rss_bytes": row["peak_rss_bytes"]}
    ours = places["ours"][0]
    if not (is_earlier_output(ours, BUILD, made_after=ckpt) and (ours / "model.int4.onnx").is_file()):
        log(f"{shape}: export.build --fuse --quantize int4 of the All-Taper checkpoint")
        row = _child([py, "-m", "export.build", "--fuse", "--quantize", "int4", "--checkpoint", str(ckpt),
                      "--out", str(ours)], "our build")
        out["steps"]["ours_build"] = {k: row[k] for k in ("wall_s", "peak_rss_bytes")}
    graphs = {"ours": (str(ours / "model.int4.onnx"), []), "genai": (str(genai), ["--genai"])}
    out["profile"] = {}
    for name, (graph, flag) in graphs.items():
        row = _child([py, "-m", "bench.fold_vs_genai", "profile", graph, *flag, "--steps", str(args.profile_steps),
                      "--threads", str(args.threads)], f"the profile of {name}")
        out["profile"][name] = json.loads(row["stdout"].strip().splitlines()[-1])
        p = out["profile"][name]
        log(f"  profile {name}: norm share {100 * p['f']:.2f} % of node time ({p['norm_us_per_step']:.0f} of "
            f"{p['node_us_per_step']:.0f} us a step)")
    pairs = []
    for r in range(args.pairs):
        speeds = {}
        for name in stats.round_order(list(graphs), r):
            graph, flag = graphs[name]
            row = _child([py, "-m", "bench.scale", "decode", graph, *flag, "--decode-tokens", str(args.decode_tokens),
                          "--prompt-tokens", str(args.prompt_tokens), "--threads", str(args.threads)], f"decode {name}")
            speeds[name] = json.loads(row["stdout"].strip().splitlines()[-1])["tokens_per_s"]
        pairs.append({"first": stats.round_order(list(graphs), r)[0], **speeds, "ratio": speeds["ours"] / speeds["genai"]})
        log(f"  pair {r + 1}/{args.pairs}: ours {speeds['ours']:.1f} tok/s, GenAI {speeds['genai']:.1f} tok/s, "
            f"ratio {pairs[-1]['ratio']:.3f}")
    share = out["profile"]["genai"]["f"]
    ratio = stats.Spread.of(p["ratio"] for p in pairs)
    out.update(pairs=pairs, ratio=ratio.as_dict(), ours_tokens_per_s=stats.Spread.of(p["ours"] for p in pairs).as_dict(),
               genai_tokens_per_s=stats.Spread.of(p["genai"] for p in pairs).as_dict(), genai_norm_share=share,
               target_ratio=1 + TARGET_SHARE * share, met=ratio.median >= 1 + TARGET_SHARE * share,
               settings={k: getattr(args, k) for k in ("pairs", "decode_tokens", "prompt_tokens", "threads",
                                                       "profile_steps")})
    return out


def table(results: list[dict]) -> str:
    head = ["shape", "GenAI norm share", "ours norm share", "ours tok/s", "GenAI tok/s", "ratio ours / GenAI",
            "target (1 + 0.8 share)", "met"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def spread(s, d):
        return " / ".join(f"{s[k]:.{d}f}" for k in ("min", "median", "max"))
    for r in results:
        lines.append(f"| {r['shape']} | {100 * r['genai_norm_share']:.2f} % | {100 * r['profile']['ours']['f']:.2f} % | "
                     f"{spread(r['ours_tokens_per_s'], 1)} | {spread(r['genai_tokens_per_s'], 1)} | "
                     f"{spread(r['ratio'], 3)} | {r['target_ratio']:.3f} | {'yes' if r['met'] else 'no'} |")
    return "\n".join(lines)


def _shape_list(value: str) -> str:
    """argparse type of --shape: a comma list with at least one shape (an empty one ran nothing and
    wrote an empty table with exit 0)."""
    if not [s for s in value.split(",") if s.strip()]:
        from core.errors import UsageError
        raise UsageError(f"--shape {value!r}: expected one or more bench/shapes.py names or config .json paths, "
                         "comma-separated, found none; pass e.g. --shape qwen3-0.6b")
    return value


def _work_folder(value: str) -> Path:
    """argparse type of --work: a folder or a path one can be made at; a file there (or above it) is
    one line naming --work (not mkdir's `File exists`)."""
    work = Path(value)
    for p in (work, *work.parents):
        if p.exists() or p.is_symlink():
            if not p.is_dir():
                where = "" if p == work else f" ({p} is a file)"
                raise UserError(f"{work}: expected a folder for the run's builds, found "
                                f"{'a file' if p == work else 'a path under a file'}{where}; choose another --work")
            break
    return work


def run(argv: list[str]) -> int:
    from core.outputs import REPORT_JSON, check_output_file, write_json
    p = ArgumentParser(prog="python -m bench.fold_vs_genai", description=__doc__.split("\n\n")[1])
    sub = p.add_subparsers(dest="cmd", required=True)
    rn = sub.add_parser("run", help="build, profile and time both graphs of each shape")
    rn.add_argument("--shape", type=_shape_list, required=True,
                    help="bench/shapes.py names, comma-separated (e.g. qwen3-0.6b)")
    rn.add_argument("--work", type=_work_folder, required=True,
                    help="where the folders and builds are kept (and reused)")
    rn.add_argument("--json", type=Path, required=True, help="the report to write")
    rn.add_argument("--pairs", type=int_in(1, 1000), default=9)
    rn.add_argument("--decode-tokens", type=int_in(1, 100_000), default=64)
    rn.add_argument("--prompt-tokens", type=int_in(1, 100_000), default=16)
    rn.add_argument("--threads", type=int_in(1, 256), default=2)
    rn.add_argument("--profile-steps", type=int_in(1, 100_000), default=32)
    tp = sub.add_parser("taper", help="the All-Taper checkpoint of a Hugging Face folder")
    tp.add_argument("folder", type=Path)
    tp.add_argument("--out", type=Path, required=True)
    pf = sub.add_parser("profile", help="(a child of run) the norm share of one graph's decode step, one JSON line")
    pf.add_argument("graph")
    pf.add_argument("--genai", action="store_true", help="GRAPH is a GenAI folder, run by GenAI's own loop")
    pf.add_argument("--steps", type=int_in(1, 100_000), default=32)
    pf.add_argument("--threads", type=int_in(1, 256), default=2)
    a = p.parse_args(argv)
    if a.cmd == "taper":
        from core.outputs import CHECKPOINT, check_output_dir
        check_output_dir(a.out, CHECKPOINT, inputs=[a.folder])      # before minutes of calibration
        all_taper_checkpoint(a.folder, a.out)
        return 0
    if a.cmd == "profile":
        print(json.dumps(profile_graph(a.graph, a.steps, a.threads, a.genai)))
        return 0
    check_output_file(a.json, REPORT_JSON)
    shapes = [s.strip() for s in a.shape.split(",") if s.strip()]
    check_work(a.work, shapes)
    a.work.mkdir(parents=True, exist_ok=True)
    results = []
    for shape in shapes:
        results.append(bench_shape(shape, a.work, a))
        write_json(a.json, {"results": results, "table": table(results)})   # a finished shape is kept
    print(table(results))
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    from core.lifecycle import exit_after
    exit_after(main)
