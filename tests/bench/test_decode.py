"""bench.decode's round loop with fake runners (order, warm-up), the profile parser on a synthetic
ONNX Runtime trace, and the torch-side variants (numerics only; no timing is asserted)."""
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.decode import timed_rounds
from bench.runners import Timing, ort_norm_share
from bench.variants import VARIANTS, capacity_for, naive_rmsnorm, torch_variant, weight_bytes_torch
from models.fold import fold_norms
from tests.helpers import random_model


class FakeRunner:
    kind = "ours"

    def __init__(self, name, calls):
        self.name, self.calls = name, calls

    def generate(self, prompts, n):
        self.calls.append(self.name)
        k = len(self.calls)
        return Timing(ttft_s=0.001 * k, step_s=[0.01] * (n - 1), total_s=0.001 * k + 0.01 * (n - 1))


def test_timed_rounds_warm_up_then_rotating_order():
    calls = []
    runners = [FakeRunner(n, calls) for n in ("a", "b", "c")]
    cell, order = timed_rounds(runners, np.zeros((2, 4), np.int64), n=5, rounds=4)
    assert calls[:3] == ["a", "b", "c"]                          # untimed warm-up, once each
    assert order == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"], ["a", "b", "c"]]
    assert calls[3:] == [x for rnd in order for x in rnd]        # the order recorded is the order run
    for name in "abc":
        assert len(cell[name]["rounds"]) == 4                    # warm-up not recorded
        assert len(cell[name]["step_s"]) == 4 * 4                # n - 1 decode steps per round, pooled
        assert cell[name]["rounds"][0]["steps"] == 4
    assert cell["a"]["rounds"][0]["ttft_s"] == pytest.approx(0.004)   # 4th call overall


def _ev(cat, name, ts, dur, op=None):
    e = {"cat": cat, "name": name, "ts": ts, "dur": dur}
    if op:
        e["args"] = {"op_name": op}
    return e


def test_ort_norm_share_drops_prefill_and_splits_final_norm():
    events = [_ev("Session", "model_run", 0, 1000),                     # prefill: ignored
              _ev("Node", "n0_kernel_time", 10, 900, "RMSNormalization")]
    for k in range(2):                                                  # two decode steps of 100 us node time
        t = 2000 + 1000 * k
        events += [_ev("Session", "model_run", t, 200),
                   _ev("Node", "ln1_kernel_time", t + 1, 10, "RMSNormalization"),
                   _ev("Node", "mm_kernel_time", t + 20, 70, "MatMul"),
                   _ev("Node", "lnf_kernel_time", t + 100, 20, "RMSNormalization"),
                   _ev("Node", "lnf_fence_before", t + 99, 1, "RMSNormalization")]
    p = ort_norm_share(events, {"ln1": "block", "lnf": "final"})
    assert p["steps"] == 2
    assert p["f"] == pytest.approx(30 / 100)
    assert p["f_blocks"] == pytest.approx(10 / 100)
    assert p["f_run"] == pytest.approx(30 / 200)
    assert p["norm_us_by_op"] == {"RMSNormalization": 30}


def test_capacity_is_rounded_up():
    assert capacity_for(16, 128) == 160
    assert capacity_for(16, 32) == 64
    assert capacity_for(16, 16) == 32


def test_naive_rmsnorm_matches_and_variants_map():
    model = random_model(seed=1, norm="rmsnorm")
    ids = torch.randint(0, model.cfg.vocab_size, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(naive_rmsnorm(model)(ids), model(ids), atol=1e-5, rtol=1e-4)
    assert torch_variant(VARIANTS["rmsnorm-plain"], model) is not model
    assert torch_variant(VARIANTS["internal-taper-unfused"], model) is model


def test_weight_bytes_counts_tied_head_once_and_skips_position_table():
    model = random_model(seed=0, norm="rmsnorm")
    params = {id(p): p for p in model.parameters()}
    expect = sum(p.numel() * 4 for p in params.values()) - model.wpe.weight.numel() * 4
    assert weight_bytes_torch(model) == expect
    folded = fold_norms(model)                                         # head untied: embedding now a lookup
    n_norms = 2 * model.cfg.n_layer + 1                                # their gammas are folded away
    assert weight_bytes_torch(folded) == expect - n_norms * model.cfg.d_model * 4
    assert folded.lm_head.weight is not folded.wte.weight


def test_read_bandwidth_reports_every_kernel_and_the_best():
    from bench.decode import read_bandwidth
    bw = read_bandwidth(gib=0.01, repeats=2, threads=2)
    assert set(bw) == {"max_1thread", "max_2threads", "gemv_blas", "best"}
    assert bw["best"] == max(v for k, v in bw.items() if k != "best") > 0
    assert set(read_bandwidth(gib=0.01, repeats=1, threads=1)) == {"max_1thread", "gemv_blas", "best"}   # once


def test_genai_peer_is_skipped_with_a_reason_when_not_installed(monkeypatch):
    import importlib.util
    from bench import genai
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda m, *a: None if m == "onnxruntime_genai" else real(m, *a))
    assert genai.genai_status() == "onnxruntime-genai is not installed (pip install onnxruntime-genai)"


def test_genai_llama_has_our_weight_bytes():
    """Three d x h Llama MLP matrices hold about the bytes of our two d x 4d ones (within 3 %)."""
    from bench.genai import llama_mlp_hidden
    for d in (128, 384, 768):
        assert abs(3 * d * llama_mlp_hidden(d) - 8 * d * d) / (8 * d * d) < 0.03
        assert llama_mlp_hidden(d) % 8 == 0


def test_genai_loop_on_our_folded_graph(tmp_path):
    """bench.decode --peers genai's "GenAI loop on our folded graph": a GenAI folder over our 1M
    all-taper fused graph (int4, GroupQueryAttention), run by GenAIRunner for exactly n tokens,
    and greedy GenAI picks the tokens our runtime picks on that same graph."""
    pytest.importorskip("onnxruntime_genai", reason="onnxruntime-genai is not installed (pip install '.[genai]')")
    from bench.genai import GenAIRunner, build_ours_genai
    from bench.report import short
    from runtime.generate import GenerationConfig, generate
    from runtime.ort_session import OrtSession
    info = build_ours_genai("1M", 64, "int4", tmp_path, log=lambda *a: None)
    assert info["name"] == "genai-ours-int4" and short(info["name"]) == "GenAI loop on our all-taper fused int4"
    runner = GenAIRunner(info, threads=1)
    runner.activate()
    prompt = np.arange(3, 11)[None]
    timing = runner.generate(prompt, 12)
    assert len(timing.step_s) == 11
    theirs = [int(t) for t in _genai_tokens(runner, prompt[0], 12)]
    runner.close()
    graph = next(tmp_path.glob("1M-cap64-gqaatt-all-taper-fused.int4-*.onnx"))
    with OrtSession(graph) as session:
        ours = generate(session, [list(prompt[0])], GenerationConfig(max_new_tokens=12)).tokens[0]
    assert theirs == ours


def _genai_tokens(runner, prompt, n):
    og = runner.og
    params = og.GeneratorParams(runner.model)
    params.set_search_options(max_length=len(prompt) + n, min_length=len(prompt) + n, do_sample=False)
    gen = og.Generator(runner.model, params)
    gen.append_tokens(np.asarray(prompt, np.int32))
    while not gen.is_done():
        gen.generate_next_token()
    return list(gen.get_sequence(0))[len(prompt):]


def test_quantized_runner_names():
    from bench.variants import quantized_name, split_name
    assert quantized_name("rmsnorm-strong", "int4") == "rmsnorm-strong.int4"
    assert quantized_name("rmsnorm-strong", "fp32") == "rmsnorm-strong"
    assert split_name("internal-taper-fused.int8") == ("internal-taper-fused", "int8")
    assert split_name("dyt") == ("dyt", "fp32")


def test_quantized_bench_graphs_are_verified_and_cache_entries_of_other_code_rebuilt(tmp_path):
    """bench builds through export.pipeline's stages (build_graph): its fp32 graph is verified against
    torch, its int8 graph as export.build verifies one (against the torch model holding its own
    dequantized weights, with that tolerance, and the int8 top-1 floor against the float model; the
    figures are kept in the cache entry); the cache serves a graph again only to the
    code that built it: an entry with another build fingerprint (a changed pass, an older release)
    or none is rebuilt, once."""
    import json
    from bench.variants import build_fingerprint, build_onnx
    from export.quantize import MIN_TOP1
    from export.verify import ATOL, DEQUANTIZED, SCALE_TOL
    lines = []
    info = build_onnx("1M", ["rmsnorm-strong"], 32, tmp_path, log=lines.append, dtypes=("fp32", "int8"))
    v = info["rmsnorm-strong.int8"].verified
    assert v["tolerance"] == {"dtype": "int8", "atol": ATOL[DEQUANTIZED], "scale_tol": SCALE_TOL[DEQUANTIZED],
                              "min_top1": MIN_TOP1["int8"], "min_top1_enforced": True}     # zoo weights: trained
    assert set(v["logits_max_abs_diff"]) == {"graph_vs_torch"}
    assert 0 < v["logits_max_abs_diff"]["graph_vs_torch"] and v["drift"]["top1_agreement"] >= MIN_TOP1["int8"]
    fp32 = info["rmsnorm-strong"].verified
    assert set(fp32["logits_max_abs_diff"]) == {"graph_vs_torch"}
    assert all(d <= ATOL["fp32"] for d in fp32["max_abs_diff"].values())
    assert any(f"verified (int8 vs its dequantized weights, atol {ATOL[DEQUANTIZED]:g} + {SCALE_TOL[DEQUANTIZED]:g} x "
               "max|ref|)" in line and "top-1" in line for line in lines), lines
    assert {i.built_by for i in info.values()} == {build_fingerprint()}
    metas = sorted(tmp_path.glob("*rmsnorm-strong*.json"))
    stamps = {m: m.stat().st_mtime_ns for m in metas}
    lines.clear()
    build_onnx("1M", ["rmsnorm-strong"], 32, tmp_path, log=lines.append, dtypes=("fp32", "int8"))
    assert not lines and {m: m.stat().st_mtime_ns for m in metas} == stamps          # same code: reused as is
    int8_meta = metas[1]                       # rebuilding it takes ~1 s
    for stamp, said in ((None, "unrecorded"), ("0123older", "0123older")):   # from before the key; by older code
        old = json.loads(int8_meta.read_text())
        old.pop("built_by")
        if stamp:
            old["built_by"] = stamp
        int8_meta.write_text(json.dumps(old))
        again = build_onnx("1M", ["rmsnorm-strong"], 32, tmp_path, log=lines.append, dtypes=("fp32", "int8"))
        assert len(lines) == 2 and "rebuilding rmsnorm-strong.int8" in lines[0] and said in lines[0], lines
        assert build_fingerprint() in lines[0] and again["rmsnorm-strong.int8"].built_by == build_fingerprint()
        assert again["rmsnorm-strong.int8"].verified["logits_max_abs_diff"] == pytest.approx(v["logits_max_abs_diff"])
        lines.clear()
    assert not list(tmp_path.glob(".*tmp*"))                                          # no temporary left behind
    import onnx
    for graph in tmp_path.glob("*.onnx"):             # each graph's weights in the file named for it, beside it
        proto = onnx.load(str(graph), load_external_data=False)
        assert {e.value for t in proto.graph.initializer for e in t.external_data if e.key == "location"} == \
            {f"{graph.name}.data"} and (tmp_path / f"{graph.name}.data").is_file()


def test_the_build_fingerprint_hashes_the_graph_code():
    """The cache key changes with the code that writes graphs (here: one package fewer hashed)."""
    from bench import variants
    a = variants.build_fingerprint()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(variants, "GRAPH_CODE", ("models", "export"))
        variants.build_fingerprint.cache_clear()
        b = variants.build_fingerprint()
    variants.build_fingerprint.cache_clear()
    assert a != b and len(a) == len(b) == 16 and variants.build_fingerprint() == a


def _entry(**changes) -> dict:
    from bench.variants import GraphInfo, build_fingerprint
    info = GraphInfo("g.onnx", "random:seed0", 10, 20, 3, {}, {"MatMul": 3}, 0.1, 0.2, build_fingerprint(),
                     verified={"tolerance": {"dtype": "fp32"}})
    return {**info.to_json(), **changes}


def test_an_unreadable_cache_entry_is_rebuilt_with_one_line(tmp_path):
    import json
    from bench.variants import GraphInfo, _cached
    (tmp_path / "g.onnx").write_bytes(b"")
    meta = tmp_path / "g.json"
    for text, said in (("{half-writ", "unreadable (JSONDecodeError)"), ("[1]", "unrecorded"),
                       (json.dumps({"built_by": _entry()["built_by"]}), "lacks fields")):
        meta.write_text(text)
        lines = []
        assert _cached(meta, "1M g", lines.append) is None
        assert len(lines) == 1 and said in lines[0] and "rebuilding 1M g" in lines[0]
    meta.write_text(json.dumps(_entry()))
    assert _cached(meta, "1M g", print) == GraphInfo.from_json(_entry())


def test_a_run_that_verifies_rebuilds_an_unverified_entry(tmp_path):
    """--no-verify's graphs are not served to a run that verifies (it would time a graph nobody checked)."""
    import json
    from bench.variants import _cached
    (tmp_path / "g.onnx").write_bytes(b"")
    meta = tmp_path / "g.json"
    meta.write_text(json.dumps(_entry(verified=None)))
    lines = []
    assert _cached(meta, "1M g", lines.append, verified=False).verified is None      # --no-verify: served
    assert not lines and _cached(meta, "1M g", lines.append, verified=True) is None
    assert len(lines) == 1 and "built with --no-verify" in lines[0]


def test_variants_are_data():
    """A variant is a row of options (a model transform, fold or not), not a code path."""
    from bench.variants import TRANSFORMS, Variant
    assert all(isinstance(v, Variant) and (v.transform is None or v.transform in TRANSFORMS) for v in VARIANTS.values())
    assert VARIANTS["internal-taper-unfused"].model_key == VARIANTS["internal-taper-fused"].model_key
    assert VARIANTS["rmsnorm-plain"].model_key != VARIANTS["rmsnorm-strong"].model_key


def test_settings_say_when_verification_is_off_and_worker_specs_cross_as_json():
    import json
    from bench.decode import Run, WorkerSpec, _parser, cell_spec, settings_from, Builds
    from bench.variants import GraphInfo
    args = _parser().parse_args(["--quick", "--no-verify", "--peers", "none", "--backends", "ort", "--out", "x"])
    s = settings_from(args)
    assert s.verify is False and s.to_json()["verify"] is False and s.sizes == ["1M", "8M"] and s.capacity == 64
    assert settings_from(_parser().parse_args(["--quick", "--out", "x"])).to_json()["verify"] is True
    run = Run(s, "python -m bench.decode --quick --no-verify", Path("x"))
    info = GraphInfo("g.onnx", "random:seed0", 10, 20, 3, {"n1": "block"}, {"MatMul": 3}, 0.1, 0.2, "abc")
    run.builds = Builds({"1M": {"rmsnorm-strong": info}, "8M": {}}, {"1M": {}, "8M": {}})
    spec = cell_spec(run, "1M", "ort")
    assert WorkerSpec.from_json(json.loads(json.dumps(spec.to_json()))) == spec
    assert run.results(complete=False)["models"]["1M"]["rmsnorm-strong"]["verified"] is None


def test_default_attention_is_export_builds_default_graph(monkeypatch):
    """No --attention: the graph export.build writes by default here (GroupQueryAttention with no TensorRT
    installed), the portable one when the trt backend is timed; --attention still decides."""
    import importlib.util
    from bench.decode import _parser, default_attention, settings_from
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "tensorrt" else real(name, *a))
    assert default_attention(["ort", "torch"], ["1M", "124M"]) == "gqa"
    assert default_attention(["ort", "trt"], ["1M"]) == "plain"
    args = ["--quick", "--peers", "none", "--backends", "ort", "--out", "x"]
    assert settings_from(_parser().parse_args(args)).attention == "gqa"
    assert settings_from(_parser().parse_args(args + ["--attention", "plain"])).attention == "plain"


def test_the_default_cache_is_marked_so_a_later_run_reuses_it_with_cache(tmp_path):
    """OUT/cache (the default) is ours: marked at once, so `--cache OUT/cache` of a later run is accepted
    (it was refused as a folder we did not write)."""
    from bench.decode import _parser, claim_outputs
    from core.outputs import BENCH_CACHE, marker_kind
    out, cache = claim_outputs(_parser().parse_args(["--out", str(tmp_path / "a")]))
    assert cache == out / "cache" and marker_kind(cache) == BENCH_CACHE.name
    (cache / "x.onnx").write_bytes(b"graph")
    out2, cache2 = claim_outputs(_parser().parse_args(["--out", str(tmp_path / "b"), "--cache", str(cache)]))
    assert cache2 == cache and (cache2 / "x.onnx").read_bytes() == b"graph"
