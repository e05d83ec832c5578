"""python -m bench.report DIR: results.json -> summary, results.md and PNG plots (again).

    summarize(results)      per (size, backend, batch) cell and runner: tokens/s min/median/max,
                            TTFT, TPOT p50/p90/p99, ratio to rmsnorm-strong per round, achieved
                            weight bandwidth vs the measured read bandwidth, norm share f and
                            the limit 1/(1-f), ratios over the peers; then the acceptance figures
                            against bench.targets.TARGETS
    write_reports(res, DIR) results.json (with the summary), results.md, tokens_per_s.png,
                            ratio_vs_strong.png
"""
from __future__ import annotations

from core.lifecycle import guard_startup
guard_startup(__name__)     # before the imports below: a Ctrl-C while they load exits 130 with one line

import json
import math
from pathlib import Path

from bench import stats
from bench.targets import TARGETS
from bench.variants import BASELINE, REMOVES, quantized_name, split_name
from core.errors import ArgumentParser, UserError
from core.lifecycle import run_cli
from core.outputs import BENCH_RESULTS, claim_dir, png_signature_metadata, replace_file_in, replaced_file_in

FUSED = "internal-taper-fused"
SHORT = {"rmsnorm-strong": "strong", "rmsnorm-plain": "plain", "internal-taper-unfused": "int-taper unfused",
         "internal-taper-fused": "int-taper fused", "all-taper-fused": "all-taper fused", "dyt": "dyt",
         "hf-generate": "HF generate", "ort-plain": "ORT plain loop"}
PEER_NAMES = ("hf-generate", "ort-plain", "genai-fp32", "genai-int4")


def short(name: str) -> str:
    """Table label of a runner: 'int-taper fused int4', 'GenAI int4'."""
    if name.startswith("genai-ours-"):       # bench.genai.build_ours_genai
        return "GenAI loop on our all-taper fused " + name[len("genai-ours-"):]
    if name.startswith("genai-"):
        return "GenAI " + name[len("genai-"):]
    base, dtype = split_name(name)
    return SHORT.get(base, base) + ("" if dtype == "fp32" else f" {dtype}")


# --- summary ------------------------------------------------------------------------------------------

def same_thread_bandwidth(bw: dict, threads: int) -> float:
    """The read bandwidth measured with the thread count the runtimes used (np.max kernels)."""
    keys = {f"max_{threads}threads"} | ({"max_1thread"} if threads == 1 else set())
    return max((v for k, v in bw.items() if k.removeprefix("end_") in keys), default=float("nan"))


def _runner_metrics(raw: dict, batch: int, new_tokens: int, weight_bytes: int, bw: float, bw_same: float) -> dict:
    rounds = raw["rounds"]
    tps = [stats.tokens_per_s(batch, new_tokens, r["total_s"]) for r in rounds]
    sps = [r["steps"] / r["decode_s"] if r["decode_s"] > 0 else float("nan") for r in rounds]
    steps_per_s = stats.median(sps)
    achieved = stats.bytes_per_s(weight_bytes, steps_per_s)
    loops = [(r["decode_s"] - r["run_s"]) / r["steps"] for r in rounds if r.get("run_s") is not None and r["steps"]]
    m = {"tokens_per_s": stats.Spread.of(tps).as_dict(), "tokens_per_s_rounds": tps,
         "loop_us_per_token": stats.Spread.of([x * 1e6 for x in loops]).as_dict() if loops else None,
         "ttft_ms": stats.Spread.of([r["ttft_s"] * 1e3 for r in rounds]).as_dict(),
         "tpot_ms": {k: v * 1e3 for k, v in stats.tpot_percentiles(raw["step_s"]).items()},
         "steps_per_s": steps_per_s, "weight_bytes": weight_bytes,
         "achieved_Bps": achieved, "bandwidth_share": achieved / bw if bw > 0 else float("nan"),
         "bandwidth_share_same_threads": achieved / bw_same if bw_same > 0 else float("nan")}
    if prof := raw.get("profile"):
        m["profile"] = prof
        if "f" in prof:
            m["limit_own"] = stats.limit_speedup(prof["f"])
    return m


def summarize(results: dict) -> dict:
    s = results["settings"]
    bw = results["read_bandwidth_Bps"]["best"]
    bw_same = same_thread_bandwidth(results["read_bandwidth_Bps"], s["threads"])
    cells = []
    for c in results["cells"]:
        if "error" in c:
            cells.append({"size": c["size"], "backend": c["backend"], "error": c["error"]})
            continue
        for batch_s, data in c["batches"].items():
            batch = int(batch_s)
            runners = {}
            for name, raw in data["runners"].items():
                info = c["runners"][name]
                runners[name] = _runner_metrics(raw, batch, s["new_tokens"], info["weight_bytes"], bw, bw_same)
                runners[name].update(kind=info["kind"], source=info.get("source"),
                                     rss_load_MB=info["rss_load_bytes"] / 2**20)
            cell = {"size": c["size"], "backend": c["backend"], "batch": batch, "threads": s["threads"],
                    "peak_rss_MB": c["peak_rss_bytes"] / 2**20, "order": data["order"], "runners": runners}
            base = runners.get(BASELINE)
            if base:
                cell["noise_band"] = stats.Spread(**base["tokens_per_s"]).rel_width
                prof = base.get("profile") or {}
                cell["limits"] = {"blocks": stats.limit_speedup(prof["f_blocks"]) if "f_blocks" in prof else float("nan"),
                                  "all": stats.limit_speedup(prof["f"]) if "f" in prof else float("nan")}
                for name, m in runners.items():
                    r = stats.ratio_summary(m["tokens_per_s_rounds"], base["tokens_per_s_rounds"])
                    m["ratio_vs_strong"] = r.as_dict()
                    if name in REMOVES:
                        lim = cell["limits"][REMOVES[name]]
                        m["limit_vs_strong"] = lim
                        m["share_of_limit"] = stats.share_of_limit(r.median, lim)
                        m["ratio_over_limit"] = r.median / lim if lim == lim else float("nan")
                        m["slower_beyond_noise"] = stats.slower_beyond_noise(r, cell["noise_band"])
            for peer in [n for n, m in runners.items() if m["kind"] == "peer"]:
                for name, m in runners.items():
                    if m["kind"] == "ours":
                        m.setdefault("ratio_over_peer", {})[peer] = stats.ratio_summary(
                            m["tokens_per_s_rounds"], runners[peer]["tokens_per_s_rounds"]).as_dict()
            cells.append(cell)
    return {"cells": cells, "acceptance": acceptance(cells, results)}


def _cells(cells, **match):
    return [c for c in cells if "error" not in c and all(c.get(k) == v for k, v in match.items())]


def acceptance(cells: list[dict], results: dict) -> list[dict]:
    """The acceptance figures, judged against bench.targets.TARGETS: each {criterion, figures,
    met (True/False/None = not run)}."""
    out = [hf_acceptance(cells, key) for key in ("ort_over_hf_small", "ort_over_hf_124m")]
    out += [bandwidth_acceptance(cells, results), limit_acceptance(cells), torch_acceptance(cells)]
    return out + genai_acceptance(cells)


def _verdict(criterion: str, judged: list[tuple[str, bool | None]]) -> dict:
    """judged: (figure, ok) pairs; ok None for a figure shown but not judged."""
    oks = [ok for _, ok in judged if ok is not None]
    return {"criterion": criterion, "figures": [f for f, _ in judged], "met": all(oks) if oks else None}


def hf_acceptance(cells: list[dict], key: str) -> dict:
    """ort runtime (the rmsnorm-strong graph) over HF generate at the target's sizes."""
    t = TARGETS[key]
    judged = [(f"{c['size']} b{c['batch']} {SHORT[name]}: {r['median']:.2f}x [{r['min']:.2f}-{r['max']:.2f}]",
               r["median"] >= t.threshold if name == BASELINE else None)
              for c in cells if c.get("backend") == "ort" and c["size"] in t.sizes for name in (BASELINE, FUSED)
              if (r := c["runners"].get(name, {}).get("ratio_over_peer", {}).get("hf-generate"))]
    return _verdict(f"ort runtime (rmsnorm-strong graph) >= {t.threshold}x HF generate at {t.label}", judged)


def bandwidth_acceptance(cells: list[dict], results: dict) -> dict:
    t = TARGETS["bandwidth_share"]
    bwb = results["read_bandwidth_Bps"]["best"]
    judged = [(f"b{c['batch']} {SHORT[name]}: {m['achieved_Bps'] / 1e9:.2f} GB/s = "
               f"{100 * m['bandwidth_share']:.0f}% of {bwb / 1e9:.2f} GB/s (best kernel); "
               f"{_pct(m.get('bandwidth_share_same_threads', float('nan')))} of the read bandwidth "
               f"at the same thread count ({results['settings']['threads']})",
               m["bandwidth_share"] >= t.threshold if c["batch"] == 1 and name == BASELINE else None)
              for size in t.sizes for c in _cells(cells, size=size, backend="ort") for name in (BASELINE, FUSED)
              if (m := c["runners"].get(name))]
    return _verdict(f"{t.label} fp32 (ort, batch 1, rmsnorm-strong): achieved weight bandwidth >= "
                    f"{100 * t.threshold:.0f}% of measured read bandwidth (the best kernel, any thread count)", judged)


def limit_acceptance(cells: list[dict]) -> dict:
    """Fused internal-taper vs its profiled limit, never slower beyond noise."""
    t = TARGETS["fused_share_of_limit"]
    judged = []
    for c in cells:
        m = c.get("runners", {}).get(FUSED)
        if not m or "share_of_limit" not in m:
            continue
        r = m["ratio_vs_strong"]
        judged.append((f"{c['size']} {c['backend']} b{c['batch']}: {r['median']:.3f}x [{r['min']:.3f}-{r['max']:.3f}] "
                       f"vs limit {m['limit_vs_strong']:.3f}x = {_pct(m['ratio_over_limit'])} of the limit "
                       f"({_pct(m['share_of_limit'])} of the possible gain), noise band {100 * c['noise_band']:.1f}%"
                       f"{'; SLOWER beyond noise' if m['slower_beyond_noise'] else ''}",
                       m["ratio_over_limit"] >= t.threshold and not m["slower_beyond_noise"]))
    return _verdict(f"internal-taper fused reaches >= {100 * t.threshold:.0f}% of its profiled limit over "
                    f"rmsnorm-strong (ratio >= {t.threshold} x limit) and is never slower beyond the noise band",
                    judged)


def torch_acceptance(cells: list[dict]) -> dict:
    t = TARGETS["torch_fused_over_strong"]
    judged = []
    for c in [c for size in t.sizes for c in _cells(cells, size=size, backend="torch")]:
        m = c["runners"].get(FUSED)
        if m:
            r, plain = m["ratio_vs_strong"], c["runners"].get("rmsnorm-plain")
            judged.append((f"b{c['batch']}: {r['median']:.3f}x [{r['min']:.3f}-{r['max']:.3f}] over rmsnorm-strong"
                           + (f"; {m['tokens_per_s']['median'] / plain['tokens_per_s']['median']:.3f}x over "
                              "rmsnorm-plain (medians)" if plain else ""), r["median"] >= t.threshold))
    return _verdict(f"torch eager internal-taper fused >= {t.threshold}x rmsnorm-strong at {t.label}", judged)


def _ratio_line(c, name, peer) -> tuple[str, float] | None:
    m = c["runners"].get(name, {})
    r = m.get("ratio_over_peer", {}).get(peer)
    if not r:
        return None
    loop = m.get("loop_us_per_token")
    extra = f", loop {loop['median']:.1f} us/token" if loop else ""
    return (f"{c['size']} b{c['batch']} {c['threads']}t {short(name)} / {short(peer)}: {r['median']:.2f}x "
            f"[{r['min']:.2f}-{r['max']:.2f}]{extra}", r["median"])


def genai_acceptance(cells: list[dict]) -> list[dict]:
    """The GenAI targets (TARGETS' GENAI_ISSUE rows), judged on internal-taper fused (the folded
    deployment), batch 1: int4 and fp32 over GenAI of the same dtype; fp32 over the plain ORT
    loop and GenAI fp32 at the small sizes."""
    t = TARGETS["ours_over_genai"]
    out = [_over_peers(cells, t, [(quantized_name(n, dtype), f"genai-{dtype}") for n in (FUSED, BASELINE)],
                       f"ours {dtype} >= {t.threshold}x GenAI {dtype} tok/s at {t.label}, batch 1 "
                       f"(judged on int-taper fused)") for dtype in ("int4", "fp32")]
    t = TARGETS["ours_over_plain_small"]
    pairs = [(name, peer) for peer in ("ort-plain", "genai-fp32") for name in (FUSED, BASELINE)]
    return out + [_over_peers(cells, t, pairs, f"ours fp32 >= {t.threshold}x the plain ORT loop and >= {t.threshold}x "
                                               f"GenAI fp32 at {t.label}, batch 1 (judged on int-taper fused)")]


def _over_peers(cells: list[dict], t, pairs: list[tuple[str, str]], criterion: str) -> dict:
    """Ours over peers in the ort batch-1 cells at the target's sizes: a figure per (runner, peer)
    pair measured, judged on internal-taper fused (of any dtype)."""
    return _verdict(criterion, [(got[0], got[1] >= t.threshold if split_name(name)[0] == FUSED else None)
                                for c in _cells(cells, backend="ort", batch=1) if c["size"] in t.sizes
                                for name, peer in pairs if (got := _ratio_line(c, name, peer))])


def _pct(x: float) -> str:
    return "n/a" if not x == x else f"{100 * x:.0f}%"


# --- markdown -------------------------------------------------------------------------------------------

def _f(x, nd=2):
    if x is None or (isinstance(x, float) and (math.isnan(x) or math.isinf(x))):
        return "-"
    return f"{x:.{nd}f}"


def _spread(d, nd=2):
    return f"{_f(d['median'], nd)} [{_f(d['min'], nd)}–{_f(d['max'], nd)}]"


def headline_table(summary: dict, results: dict) -> str:
    names = [n for n in results["settings"]["variants"] if n != BASELINE]
    head = (["size", "backend", "batch", "strong tok/s"] + [SHORT[n] + " ×" for n in names]
            + ["limit (blocks / all)", "ours/HF", "ours/ORT plain"])
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in [c for c in _cells(summary["cells"]) if BASELINE in c["runners"]]:
        b = c["runners"][BASELINE]
        peers = b.get("ratio_over_peer", {})
        row = [c["size"], c["backend"], str(c["batch"]), _f(b["tokens_per_s"]["median"], 0)]
        row += [_spread(c["runners"][n]["ratio_vs_strong"]) if n in c["runners"] else "-" for n in names]
        row.append(f"{_f(c['limits']['blocks'], 3)} / {_f(c['limits']['all'], 3)}")
        row += [_f(peers[p]["median"]) + "×" if p in peers else "-" for p in ("hf-generate", "ort-plain")]
        rows.append("| " + " | ".join(row) + " |")
    return "\n".join(rows)


def detail_tables(summary: dict, results: dict) -> str:
    bw = results["read_bandwidth_Bps"]["best"]
    parts = []
    for c in summary["cells"]:
        if "error" in c:
            parts.append(f"### {c['size']} / {c['backend']}\n\nnot measured: {c['error']}\n")
            continue
        parts.append(f"### {c['size']} / {c['backend']} / batch {c['batch']}\n\n"
                     f"peak RSS of the process {c['peak_rss_MB']:.0f} MB; noise band (rmsnorm-strong tokens/s, "
                     f"(max-min)/median) {100 * c.get('noise_band', float('nan')):.1f}%\n")
        head = ["runner", "tok/s median [min–max]", "× strong median [min–max]", "TTFT ms", "TPOT p50/p90/p99 ms",
                f"weights GB/s (% of {bw / 1e9:.1f} / of same-threads {same_thread_bandwidth(results['read_bandwidth_Bps'], results['settings']['threads']) / 1e9:.1f})", "norm share f", "limit 1/(1-f)", "gain vs limit", "RSS +MB"]
        rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for name, m in c["runners"].items():
            p = m.get("profile") or {}
            t = m["tpot_ms"]
            rows.append("| " + " | ".join([
                short(name), _spread(m["tokens_per_s"], 1),
                _spread(m["ratio_vs_strong"], 3) if "ratio_vs_strong" in m else "-",
                _f(m["ttft_ms"]["median"], 2), f"{_f(t['p50'], 3)} / {_f(t['p90'], 3)} / {_f(t['p99'], 3)}",
                f"{_f(m['achieved_Bps'] / 1e9, 2)} ({_f(100 * m['bandwidth_share'], 0)}% / "
                f"{_f(100 * m.get('bandwidth_share_same_threads', float('nan')), 0)}%)",
                _f(p.get("f"), 3), _f(m.get("limit_own"), 3),
                _pct(m["share_of_limit"]) + f" of {_f(m['limit_vs_strong'], 3)}" if "share_of_limit" in m else "-",
                _f(m["rss_load_MB"], 0)]) + " |")
        parts.append("\n".join(rows) + "\n")
    return "\n".join(parts)


def dtype_tables(summary: dict, results: dict) -> str:
    """Per ort cell: every runner's tok/s, TTFT, TPOT p50/p99, the loop's own cost per token
    (decode-step time outside the engine call), bytes a token reads and that at the measured
    rate vs the read bandwidth, and ours over GenAI of the same dtype / over the plain loop."""
    bw = results["read_bandwidth_Bps"]["best"]
    parts = []
    for c in _cells(summary["cells"], backend="ort"):
        head = ["runner", "tok/s median [min–max]", "TTFT ms", "TPOT p50 / p99 ms", "loop us/token median [min–max]",
                "MB/token", f"GB/s (% of {bw / 1e9:.1f})", "/ GenAI same dtype", "/ ORT plain"]
        rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for name, m in c["runners"].items():
            peers = m.get("ratio_over_peer", {})
            same = peers.get(f"genai-{split_name(name)[1]}")
            loop = m.get("loop_us_per_token")
            rows.append("| " + " | ".join([
                short(name), _spread(m["tokens_per_s"], 1), _f(m["ttft_ms"]["median"], 2),
                f"{_f(m['tpot_ms']['p50'], 3)} / {_f(m['tpot_ms']['p99'], 3)}",
                _spread(loop, 1) if loop else "-", _f(m["weight_bytes"] / 1e6, 1),
                f"{_f(m['achieved_Bps'] / 1e9, 2)} ({_f(100 * m['bandwidth_share'], 0)}%)",
                _spread(same) + "×" if same and m["kind"] == "ours" else "-",
                _spread(peers["ort-plain"]) + "×" if "ort-plain" in peers and m["kind"] == "ours" else "-"]) + " |")
        parts.append(f"### {c['size']} / ort / batch {c['batch']} / {c['threads']} thread(s)\n\n"
                     f"peak RSS of the process {c['peak_rss_MB']:.0f} MB\n\n" + "\n".join(rows) + "\n")
    return "\n".join(parts) if parts else "(no ort cell)"


def markdown(results: dict, summary: dict) -> str:
    s, mach, bw = results["settings"], results["machine"], results["read_bandwidth_Bps"]
    v = results["versions"]
    sources: dict[str, set] = {}
    for size, ms in results["models"].items():
        sources.setdefault(size, set()).update(m["source"].split(" ")[0] for m in ms.values())
    for c in results["cells"]:
        for r in c.get("runners", {}).values():
            if r.get("source"):
                sources.setdefault(c["size"], set()).add(r["source"].split(" ")[0])
    sources = {k: sorted(v) for k, v in sources.items()}
    done = [f"{c['size']} {c['backend']}" for c in results["cells"] if "error" not in c]
    missing = [x for x in results.get("cells_planned", []) if x not in done]
    lines = [
        f"# Decode benchmark, {results['started']}",
        "",
        f"- command: `{results['command']}` ({results['wall_s']:.0f} s wall, of which builds {results['build_s']:.0f} s)",
        f"- machine: {mach['cpu']}, {mach['cores']} cores usable, {mach['memory_gib']} GiB; GPU: {mach['gpu'] or 'none'}; "
        f"load average at start {', '.join(f'{x:.1f}' for x in mach['loadavg_start'])}, at end "
        f"{', '.join(f'{x:.1f}' for x in mach.get('loadavg_end', []))} (1/5/15 min)",
        "- versions: " + ", ".join(f"{k} {val}" for k, val in v.items() if val),
        "- measured read bandwidth (best of 5 over 1 GiB, at the start and `end_` at the end of the run): "
        + ", ".join(f"{k} {val / 1e9:.2f} GB/s" for k, val in bw.items() if k != "best")
        + f"; achieved weight bandwidth is compared with the largest, {bw['best'] / 1e9:.2f} GB/s",
        f"- settings: fp32, prompt {s['prompt']}, {s['new_tokens']} new tokens, batches {s['batches']}, "
        f"{s['rounds']} interleaved rounds (order rotated each round, untimed warm-up), {s['threads']} threads, "
        f"KV capacity {s['capacity']}; backends {', '.join(s['backends'])}"
        + ("" if s.get("verify", True) else "; graphs NOT verified (--no-verify: export's checks skipped)")
        + ("; not run: " + "; ".join(f"{b} ({why})" for b, why in s["skipped_backends"].items()) if s["skipped_backends"] else ""),
        "- weights: " + "; ".join(f"{size}: {', '.join(src)}" for size, src in sources.items()),
        (f"- **incomplete run**: not measured: {', '.join(missing)}\n" if missing else "")
        + "- peers: HF = transformers GPT2LMHeadModel.generate(use_cache=True), equal-shape GPT-2 config, random weights, "
        "same threads; ORT plain = onnxruntime session.run over the rmsnorm-strong graph with numpy feeds each step",
        "",
        "## Summary (ratios to rmsnorm-strong: median [min–max] over rounds)",
        "",
        headline_table(summary, results),
        "",
        "limit: 1/(1-f) with f the profiled share of rmsnorm-strong's decode-step node time in its block norms "
        "(what internal-taper removes) / in all norms (all-taper). ours/HF and ours/ORT plain: rmsnorm-strong "
        "on our runtime over the peer, per-round ratio, median.",
        "",
        "## Acceptance figures",
        "",
    ]
    for a in summary["acceptance"]:
        verdict = {True: "MET", False: "NOT MET", None: "NOT RUN"}[a["met"]]
        lines.append(f"- **{verdict}** — {a['criterion']}")
        lines += [f"  - {f}" for f in a["figures"]]
    lines += ["", "## Speed per dtype, with GenAI and the loop's own cost", "", dtype_tables(summary, results)]
    lines += ["", "## Plots", "", "![tokens/s](tokens_per_s.png)", "", "![ratio](ratio_vs_strong.png)", "",
              "## Per cell", "", detail_tables(summary, results)]
    return "\n".join(lines) + "\n"


# --- plots ------------------------------------------------------------------------------------------------

def _series(cells: list, panel: tuple, sizes: list, name: str, key: str, j: int, width: float) -> tuple:
    """Runner `name`'s `key` summary ({median, min, max}) per size in one (backend, batch) panel, where
    measured, as the j-th series of bars `width` wide: (x positions, medians, median - min, max - median),
    what errorbar / bar take."""
    xs, ys, lo, hi = [], [], [], []
    for i, size in enumerate(sizes):
        m = next((c["runners"].get(name) for c in cells if (c["backend"], c["batch"], c["size"]) == (*panel, size)),
                 None)
        if m and key in m:
            s = m[key]
            xs.append(i - 0.4 + width * (j + 0.5))
            ys.append(s["median"])
            lo.append(s["median"] - s["min"])
            hi.append(s["max"] - s["median"])
    return xs, ys, lo, hi


def plots(results: dict, summary: dict, out: Path) -> list[Path]:
    # one function for the two figures (69 lines): they share the panel grid, the sizes and `finish`,
    # closures over this run's layout; apart, each would take the same seven arguments
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cells = [c for c in summary["cells"] if "error" not in c]
    panels = sorted({(c["backend"], c["batch"]) for c in cells})
    sizes = [s for s in results["settings"]["sizes"] if any(c["size"] == s for c in cells)]
    if not panels or not sizes:
        return []
    runners = list(dict.fromkeys(n for c in cells for n in c["runners"]))
    stamp = f"{results['started']}, {results['machine']['cpu']}, {results['settings']['threads']} threads, fp32"
    written = []

    ncols = min(2, len(panels))
    nrows = -(-len(panels) // ncols)

    def grid():
        fig, axes = plt.subplots(nrows, ncols, figsize=(6.5 * ncols, 4.2 * nrows), squeeze=False)
        flat = list(axes.flat)
        for ax in flat[len(panels):]:
            ax.axis("off")
        return fig, flat[:len(panels)]

    def finish(fig, axes, ylabel: str, legend_at: str, title: str, name: str) -> None:
        """Each panel's axes named, the figure titled and written; its path added to `written`."""
        for ax, (backend, batch) in zip(axes, panels):
            ax.set_xticks(range(len(sizes)), sizes)
            ax.set_title(f"{backend}, batch {batch}")
            ax.set_ylabel(ylabel)
        _legend(axes, legend_at)
        fig.suptitle(f"{title} — {stamp}", fontsize=9)
        fig.tight_layout()
        written.append(_save_figure(fig, out, name))
        plt.close(fig)

    fig, axes = grid()
    width = 0.8 / len(runners)
    for ax, panel in zip(axes, panels):
        for j, name in enumerate(runners):
            xs, ys, lo, hi = _series(cells, panel, sizes, name, "tokens_per_s", j, width)
            if xs:
                ax.bar(xs, ys, width, yerr=[lo, hi], label=short(name), capsize=2,
                       hatch="//" if name in PEER_NAMES or name.startswith("genai-") else None)
        ax.set_yscale("log")
    finish(fig, axes, "output tokens/s (median, min–max)", "upper right", "Decode tokens/s by variant and size",
           "tokens_per_s.png")

    fig, axes = grid()
    variants = [n for n in results["settings"]["variants"] if n != BASELINE]
    width = 0.8 / max(1, len(variants))
    for ax, panel in zip(axes, panels):
        ax.axhline(1.0, color="k", lw=0.8)
        for j, name in enumerate(variants):
            xs, ys, lo, hi = _series(cells, panel, sizes, name, "ratio_vs_strong", j, width)
            if xs:
                ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o", label=SHORT[name], capsize=3)
        for i, size in enumerate(sizes):
            c = next((c for c in cells if (c["backend"], c["batch"], c["size"]) == (*panel, size)), None)
            if c and "limits" in c:
                for key, style in (("blocks", "--"), ("all", ":")):
                    lim = c["limits"][key]
                    if lim == lim:
                        ax.hlines(lim, i - 0.45, i + 0.45, colors="r", linestyles=style,
                                  label=f"limit 1/(1-f), {key} norms" if i == 0 else None)
    finish(fig, axes, "tokens/s ÷ rmsnorm-strong (per round)", "best",
           "Speedup over rmsnorm-strong with the profiled limit", "ratio_vs_strong.png")
    return written


def _save_figure(fig, out: Path, name: str) -> Path:
    """A signed PNG, replaced atomically inside the results directory (ours: it carries the marker)."""
    with replaced_file_in(out, name) as tmp:
        fig.savefig(tmp, dpi=110, format="png", metadata=png_signature_metadata())
    return out / name


def _legend(axes, loc) -> None:
    """One legend (on the last panel) with every label any panel drew."""
    seen = {}
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(label, h)
    axes[-1].legend(list(seen.values()), list(seen), fontsize=7, loc=loc)


def _clean(x):
    """JSON-safe: nan/inf -> None."""
    if isinstance(x, float):
        return None if (math.isnan(x) or math.isinf(x)) else x
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_reports(results: dict, out: Path) -> dict:
    """results.json, results.md and the plots, each replaced atomically inside `out` (a results directory)."""
    out = Path(out)
    summary = summarize(results)
    results = dict(results, summary=_clean(summary))
    replace_file_in(out, "results.json", json.dumps(results, indent=1) + "\n")
    replace_file_in(out, "results.md", markdown(results, summary))
    plots(results, summary, out)
    return summary


def run(argv: list[str]) -> int:
    from core.inputs import read_json_file
    ap = ArgumentParser(prog="python -m bench.report",
                        description="tables and plots from a results.json of python -m bench.decode")
    ap.add_argument("dir", type=Path, help="a results directory of python -m bench.decode")
    ap.add_argument("--out", type=Path, default=None,
                    help="write the reports into this results directory instead of DIR")
    args = ap.parse_args(argv)
    results = read_json_file(args.dir / "results.json", "bench results")
    if not isinstance(results, dict) or "settings" not in results or "cells" not in results:
        raise UserError(f"{args.dir / 'results.json'}: expected the results.json bench.decode writes, found other "
                        "JSON; run python -m bench.decode --out DIR first")
    out = claim_dir(args.out or args.dir, BENCH_RESULTS)
    summary = write_reports(results, out)
    for a in summary["acceptance"]:
        print({True: "MET    ", False: "NOT MET", None: "NOT RUN"}[a["met"]], a["criterion"])
    print(f"wrote {out / 'results.md'}, {out / 'tokens_per_s.png'}, {out / 'ratio_vs_strong.png'}")
    return 0


def main(argv=None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    from core.lifecycle import exit_after
    exit_after(main)
