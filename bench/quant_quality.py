"""python -m bench.quant_quality --json OUT.json [--kinds baseline,...] [--dtypes int8,int4] [--stories N]
                                  [--block-size N] [--accuracy-level N] [--algo rtn|hqq] [--head int8|int4|fp32]
                                  [--int8-layers NAMES]

What weight-only int8 / int4 quantization (export/quantize.py) costs in quality on the trained
zoo models, and whether folding the scales BEFORE quantizing costs accuracy compared with
quantizing the unfolded graph (TaperNorm / norm-gamma Mul kept, only constant subgraphs
folded so that every weight is a constant the quantizer can see):

    model.onnx ──fold_constants──▶ unfolded fp32 ──quantize──▶ "quantized unfolded"
    model.onnx ──DEFAULT_PASSES──▶ fused fp32    ──quantize──▶ "fused, then quantized"

Per kind and dtype, against the fp32 graph (fused and unfolded fp32 agree to ~1e-5):
  - top-1 agreement over a greedy run of 128 tokens on real text (core.decode.greedy_top1_agreement)
  - top-1 agreement, teacher-forced, over every position of the held-out stories
  - held-out validation loss (mean next-token cross-entropy, nats) and its delta to fp32

Held-out text: the validation split of the generated corpus the zoo was trained on
(train.corpus: generated stories, seed 1234, every 20th story), the first --stories stories,
each cut to the model's capacity. Prints a Markdown table; writes the numbers to --json.
"""
from __future__ import annotations

from core.lifecycle import guard_startup
guard_startup(__name__)     # before the imports below: a Ctrl-C while they load exits 130 with one line

import sys
import time
from pathlib import Path

import numpy as np

ZOO = Path(__file__).resolve().parent.parent / "models" / "zoo"
KINDS = ("baseline", "internal-taper", "all-taper", "dyt")


def val_sequences(tokenizer, capacity: int, stories: int) -> list[list[int]]:
    from train.corpus import load_corpus, split_stories
    val = split_stories(load_corpus("generated"))["val"][:stories]
    return [ids[:capacity] for ids in (tokenizer.encode(s).ids for s in val) if len(ids) >= 2]


def val_metrics(sess, iface, seqs) -> tuple[float, list[np.ndarray]]:
    """(mean next-token cross-entropy over every position, argmax per sequence)."""
    from core.decode import graph_step, prefill_logits
    nll, n, argmax, step = 0.0, 0, [], graph_step(sess)
    for seq in seqs:
        logits = prefill_logits(step, iface, seq)[:-1].astype(np.float64)                 # [T-1, V]
        logp = logits - logits.max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        nll -= logp[np.arange(len(seq) - 1), seq[1:]].sum()
        n += len(seq) - 1
        argmax.append(logits.argmax(-1))
    return nll / n, argmax


GREEDY_TOKENS = 128            # length of the greedy run the top-1 agreement is taken over


def evaluate_kind(kind: str, dtypes: list[str], stories: int, log=print, **quant) -> dict:
    """`quant`: QuantConfig fields other than dtype (block_size, accuracy_level, algo)."""
    from export.emit import emit_graph
    from export.reference_check import REAL_TEXT
    from export.quantize import QuantConfig, quantize_weights
    from export.verify import ort_session, read_interface
    from graph_passes import DEFAULT_PASSES, run_passes
    from graph_passes.lazy import materialized
    from models.checkpoint import load_tokenizer
    from models.weights import open_weights
    t0 = time.perf_counter()
    emitted = emit_graph(open_weights(ZOO / kind))
    tok = load_tokenizer(ZOO / kind)
    proto = materialized(emitted.proto, emitted.lazy)        # a 1M model: its weights in memory
    graphs = {"fused": run_passes(proto, DEFAULT_PASSES)[0], "unfolded": run_passes(proto, ("fold_constants",))[0]}
    iface = read_interface(proto)
    prompt = fit_prompt([i for i in tok.encode(REAL_TEXT).ids if i < iface.vocab_size], iface, GREEDY_TOKENS)
    seqs = val_sequences(tok, iface.capacity, stories)
    ref = ort_session(graphs["fused"])
    ref_loss, ref_argmax = val_metrics(ref, iface, seqs)
    out = {"kind": kind, "val_sequences": len(seqs), "val_positions": int(sum(len(s) - 1 for s in seqs)),
           "fp32_val_loss": ref_loss, "greedy_prompt_tokens": len(prompt), "results": []}
    for dtype in dtypes:
        for order, src in (("fused, then quantized", graphs["fused"]), ("quantized unfolded", graphs["unfolded"])):
            q, summary = quantize_weights(src, QuantConfig(dtype, **quant))
            sess = ort_session(q)
            greedy, n = greedy_top1_agreement(ref, sess, iface, prompt, GREEDY_TOKENS)
            loss, argmax = val_metrics(sess, iface, seqs)
            teacher = float(np.mean(np.concatenate([a == b for a, b in zip(argmax, ref_argmax)])))
            out["results"].append({"dtype": dtype, "order": order, "top1_greedy": greedy, "greedy_tokens": n,
                                   "top1_val": teacher, "val_loss": loss, "val_loss_delta": loss - ref_loss,
                                   "weight_MB": summary.weight_bytes_after / 1e6, "head": summary.head,
                                   "int8_layers": list(quant.get("int8_layers", ())),
                                   "mul_nodes": sum(nd.op_type == "Mul" for nd in q.graph.node)})
    out["seconds"] = round(time.perf_counter() - t0, 1)
    log(f"  {kind}: {out['seconds']:.0f} s")
    return out


def greedy_top1_agreement(ref_sess, sess, iface, prompt: list[int], n: int = GREEDY_TOKENS) -> tuple[float, int]:
    """core.decode.greedy_top1_agreement of two ONNX Runtime sessions: the share of n greedy tokens of
    the reference after `prompt` whose argmax the other graph agrees with, teacher-forced, and n."""
    from core.decode import graph_step, greedy_top1_agreement as agreement
    return agreement(graph_step(ref_sess), graph_step(sess), iface, prompt, n)


def fit_prompt(tokens: list[int], iface, n: int = GREEDY_TOKENS) -> list[int]:
    """The real-text prompt, cut so that prompt + n greedy tokens fit the cache (at least 1 token)."""
    keep = max(1, min(len(tokens), iface.capacity - n))
    return list(tokens[:keep])


def markdown(rows: list[dict]) -> str:
    head = ["model", "dtype", "order", "top-1 greedy (128 tok)", "top-1 val (teacher-forced)", "val loss fp32",
            "val loss", "delta", "weights MB", "Mul nodes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for k in rows:
        for r in k["results"]:
            dtype = r["dtype"] + (f" (head {r['head']})" if r.get("head", r["dtype"]) != r["dtype"] else "")
            dtype += f", int8 {','.join(r['int8_layers'])}" if r.get("int8_layers") else ""
            lines.append(f"| {k['kind']} | {dtype} | {r['order']} | {r['top1_greedy']:.1%} | {r['top1_val']:.1%} "
                         f"| {k['fp32_val_loss']:.4f} | {r['val_loss']:.4f} | {r['val_loss_delta']:+.4f} "
                         f"| {r['weight_MB']:.2f} | {r['mul_nodes']} |")
    return "\n".join(lines)


def run(argv: list[str]) -> int:
    from core.errors import ArgumentParser, UsageError, int_in
    from core.outputs import write_json
    from export.quantize import ALGOS, BLOCK_SIZES, DEFAULT_ACCURACY_LEVEL, DEFAULT_BLOCK_SIZE, HEAD_DTYPES, QuantConfig
    p = ArgumentParser(prog="python -m bench.quant_quality", description=__doc__.split("\n\n")[1])
    p.add_argument("--json", type=Path, required=True, help="where the numbers go (a JSON report)")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma list of zoo models ({', '.join(KINDS)})")
    p.add_argument("--dtypes", default="int8,int4", help="comma list of int8, int4")
    p.add_argument("--stories", type=int_in(1, 300), default=64, help="held-out stories (default 64)")
    p.add_argument("--block-size", type=int, choices=BLOCK_SIZES, default=DEFAULT_BLOCK_SIZE,
                   help=f"MatMulNBits block size (default {DEFAULT_BLOCK_SIZE})")
    p.add_argument("--accuracy-level", type=int_in(0, 4), default=DEFAULT_ACCURACY_LEVEL,
                   help=f"MatMulNBits compute type, 4 = int8 activations, 0/1 = fp32 (default {DEFAULT_ACCURACY_LEVEL})")
    p.add_argument("--algo", choices=ALGOS, default="rtn", help="rtn (default) or hqq (int4 only)")
    p.add_argument("--head", choices=HEAD_DTYPES, default=None, help="the LM head's weight dtype (default: the dtype)")
    p.add_argument("--int8-layers", default="", help="int4: layers kept in int8, e.g. v_proj,down_proj")
    args = p.parse_args(argv)
    kinds = [k for k in args.kinds.split(",") if k]
    dtypes = [d for d in args.dtypes.split(",") if d]
    bad = [k for k in kinds if k not in KINDS] + [d for d in dtypes if d not in ("int8", "int4")]
    if bad or not kinds or not dtypes:
        raise UsageError(f"--kinds/--dtypes: unknown or empty ({', '.join(bad) or 'nothing given'}); "
                         f"expected kinds from {', '.join(KINDS)} and dtypes from int8, int4")
    command = "python -m bench.quant_quality " + " ".join(argv)
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    quant = {"block_size": args.block_size, "accuracy_level": args.accuracy_level, "algo": args.algo,
             "head": args.head, "int8_layers": tuple(n for n in args.int8_layers.split(",") if n)}
    for d in dtypes:
        QuantConfig(d, **quant).validate()      # one error line before minutes of work
    rows = [evaluate_kind(k, dtypes, args.stories, **quant) for k in kinds]
    import onnxruntime
    write_json(args.json, {"command": command, "started": started, "onnxruntime": onnxruntime.__version__, "quant": quant,
                           "models": rows})
    print(markdown(rows))
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


def main(argv=None) -> int:
    from core.lifecycle import run_cli
    return run_cli(run, argv)


if __name__ == "__main__":
    from core.lifecycle import exit_after
    exit_after(main)
