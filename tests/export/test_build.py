"""python -m export.build: end to end, and one subprocess test per user error in the acceptance list."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.helpers import random_model, write_checkpoint

ROOT = Path(__file__).resolve().parents[2]


def _build(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "export.build", *map(str, args)], capture_output=True, text=True,
                          cwd=cwd or ROOT)


def _one_error_line(r):
    assert r.returncode != 0, r.stdout + r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert "Traceback" not in r.stderr
    return lines[0]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {
        "taper": write_checkpoint(root / "internal-taper", random_model(norm="taper", taper_scope="internal", gate=0.0)),
        "gate": write_checkpoint(root / "mid-taper", random_model(norm="taper", taper_scope="internal", gate=0.25)),
        "fakeln": write_checkpoint(root / "fakeln", random_model(norm="layernorm", eps=1e12)),
    }


@pytest.mark.parametrize("target, fuse", [("auto", True), ("portable", True), ("auto", False)])
def test_build_end_to_end(ckpts, tmp_path, target, fuse):
    """One graph a build: model.fused.onnx (--fuse) or model.onnx. The default (auto) fused build is the ONNX
    Runtime CPU graph here (no TensorRT installed); both targets say so. Verified against torch (every stage
    in the progress lines and the report)."""
    out = tmp_path / "out"
    r = _build(*(["--fuse"] if fuse else []), "--checkpoint", ckpts["taper"], "--out", out, "--target", target)
    assert r.returncode == 0, r.stdout + r.stderr
    stages = [line.split("]")[0] + "]" for line in r.stdout.splitlines() if line.startswith("[")]
    assert stages == [f"[{i}/5]" for i in range(1, 6)], r.stdout
    assert r.stdout.startswith("[1/5] open") and "[2/5] graph" in r.stdout and "[3/5] write" in r.stdout
    assert "[4/5] torch reference" in r.stdout and "[5/5] verify" in r.stdout
    graph, kind = ("model.fused.onnx", "fused") if fuse else ("model.onnx", "unfused")
    files = {p.name for p in out.iterdir()}
    assert files == {graph, graph + ".data", "config.json", "tokenizer.json", "report.json", ".tapernorm-output.json"}
    assert all(p.stat().st_mode & 0o777 == 0o644 for p in out.iterdir()) and out.stat().st_mode & 0o777 == 0o755
    report = json.loads((out / "report.json").read_text())
    assert report["graph"] == graph and report["fuse"] == fuse
    assert set(report["files"]) == files - {".tapernorm-output.json"}
    assert report["norm_ops"] == {"emitted": 1, kind: 1}                # ln_f's RMSNorm (TaperNorm at g = 0: a Mul)
    assert 0 < report["weight_bytes"] <= (out / (graph + ".data")).stat().st_size + 64 * 1024
    assert report["memory_estimate"]["peak_bytes"] > 0
    taper = [f["layer"] for f in report["folded"] if f["pass"] == "taper_scale"]
    assert taper == (["blocks.0.ln_1", "blocks.0.ln_2", "blocks.1.ln_1", "blocks.1.ln_2"] if fuse else [])
    if fuse and target == "auto":  # the taper Muls and the attention's scale Muls all gone into GroupQueryAttention
        assert report["target"] == "ort-cpu" and report["attention"] == "gqa"
        assert report["op_counts"]["fused"]["GroupQueryAttention"] == 2 and "Mul" not in report["op_counts"]["fused"]
        assert "  target   ort-cpu (auto: the fastest graph on this CPU): model.fused.onnx for ONNX Runtime on the CPU" \
            in r.stdout and "--target portable" in r.stdout
    else:
        assert report["target"] == "portable" and report["attention"] == "plain"
        assert report["op_counts"]["emitted"]["Mul"] - report["op_counts"][kind]["Mul"] == (4 if fuse else 0)
        because = " (auto: no --fuse (the rewrite runs after the fold))" if target == "auto" else ""
        assert f"  target   portable{because}: {graph} for TensorRT and any ONNX runtime" in r.stdout
    assert set(report["max_abs_diff"]) == {"graph_vs_torch"}
    worst = max(v for per in report["max_abs_diff"]["graph_vs_torch"].values() for v in per.values())
    assert 0 < worst <= report["atol"] == 1e-4
    assert any("real tokens" in k for k in report["max_abs_diff"]["graph_vs_torch"])
    assert set(report["timings_s"]) == {"open", "graph", "write", "reference", "verify", "total"}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]   # no temp dir left


def test_gate_above_zero_one_line_and_nothing_written(ckpts, tmp_path):
    out = tmp_path / "sub" / "out"
    r = _build("--fuse", "--checkpoint", ckpts["gate"], "--out", out)
    line = _one_error_line(r)
    assert line == ("error: blocks.0.ln_1, blocks.0.ln_2, blocks.1.ln_1, blocks.1.ln_2: TaperNorm gate 0.25; "
                    "--fuse needs gate 0 (finish the taper, or build without --fuse)")
    assert not (tmp_path / "sub").exists()
    assert r.stdout == ""


def test_missing_and_corrupt_checkpoint(ckpts, tmp_path):
    line = _one_error_line(_build("--checkpoint", tmp_path / "nope", "--out", tmp_path / "o"))
    assert "expected a checkpoint directory, found nothing" in line
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in ("config.json", "tokenizer.json"):
        (bad / f).write_bytes((ckpts["taper"] / f).read_bytes())
    (bad / "model.safetensors").write_bytes(b"\x00garbage")
    line = _one_error_line(_build("--checkpoint", bad, "--out", tmp_path / "o"))
    assert "model.safetensors" in line and "not a readable safetensors file" in line
    assert not (tmp_path / "o").exists()


def test_output_path_not_writable(ckpts, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    line = _one_error_line(_build("--checkpoint", ckpts["taper"], "--out", blocker / "out"))
    assert "is a file" in line and "--out" in line


def test_out_that_would_destroy_other_files_is_refused(ckpts, tmp_path):
    other = tmp_path / "notes"
    other.mkdir()
    (other / "keep.txt").write_text("precious")
    line = _one_error_line(_build("--checkpoint", ckpts["taper"], "--out", other))
    assert "did not write" in line and (other / "keep.txt").read_text() == "precious"
    line = _one_error_line(_build("--checkpoint", ckpts["taper"], "--out", ckpts["taper"].parent))
    assert "holds the command's own input" in line


def test_disabled_norm_in_fp16_is_refused(ckpts, tmp_path):
    line = _one_error_line(_build("--dtype", "fp16", "--checkpoint", ckpts["fakeln"], "--out", tmp_path / "o"))
    assert "eps 1e+12" in line and "fp16" in line and "--dtype fp32" in line
    assert not (tmp_path / "o").exists()


def test_interrupted_build_leaves_nothing(ckpts, tmp_path, monkeypatch):
    import export.build as build_mod
    from core.outputs import BUILD, write_marker
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.onnx").write_text("previous build")
    write_marker(out, BUILD)                                                 # an earlier build of ours

    def interrupted_write(proto, lazy, path, *args, **kwargs):
        Path(path).write_bytes(b"half a model")     # a partial file in the temp dir, then Ctrl-C
        raise KeyboardInterrupt
    monkeypatch.setattr("export.pipeline.write_graph", interrupted_write)
    assert build_mod.main(["--checkpoint", str(ckpts["taper"]), "--out", str(out)]) == 130
    assert sorted(p.name for p in out.iterdir()) == [".tapernorm-output.json", "model.onnx"]   # untouched
    assert (out / "model.onnx").read_text() == "previous build"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]                   # no temp dir left


def test_there_is_one_route():
    """--route (in-memory | streamed | auto) is gone: every build takes export/pipeline.py's one route."""
    from tests.cli.conftest import cli
    r = cli("export.build", ["--route", "streamed", "--fuse"])
    assert r.code == 2 and "--route" in r.err and "unrecognized arguments" in r.err


def test_every_option_a_build_message_names_is_one_export_build_has():
    """The build's refusals and hints name their fix as an option (a cheaper --quantize, --dtype fp32, --target
    portable, ...): each such option exists (the streamed route once named `--stream`, which never did)."""
    import re
    from tests.cli.conftest import cli
    sources = ["export/pipeline.py", "export/options.py", "export/graph_stages.py", "export/memory.py",
               "export/reference_check.py", "export/transformers_check.py", "export/quantize.py", "export/genai.py",
               "export/target.py", "export/emit.py", "export/bfloat16.py"]
    named = {o for f in sources for o in re.findall(r"--[a-z][a-z0-9-]*", (ROOT / f).read_text())}
    assert {"--quantize", "--dtype", "--fuse", "--attention", "--target"} <= named
    helped = cli("export.build", ["--help"]).out
    assert [o for o in sorted(named) if not re.search(rf"{o}\b", helped)] == [], helped


# --- --max-seq-len: the cache capacity, as models.convert sets it ------------------------------------

@pytest.mark.parametrize("pos, n", [("learned", 16), ("rope", 48)])
def test_max_seq_len_sets_the_capacity(tmp_path, pos, n):
    """--max-seq-len N: the graph's cache holds N positions (its contract), and the report and the build's
    config.json say N; a learned table is cut to its first N rows (verified against torch at N), rotary
    positions extend past the saved 32 (with a note)."""
    from core.contract import contract_of
    ckpt = write_checkpoint(tmp_path / f"ckpt-{pos}", random_model(norm="rmsnorm", pos_embedding=pos, max_seq_len=32))
    out = tmp_path / "out"
    r = _build("--checkpoint", ckpt, "--out", out, "--target", "portable", "--max-seq-len", n)
    assert r.returncode == 0, r.stdout + r.stderr
    assert contract_of(out / "model.onnx").capacity == n
    assert json.loads((out / "report.json").read_text())["model"]["capacity"] == n
    assert json.loads((out / "config.json").read_text())["max_seq_len"] == n
    assert ("past the 32" in r.stdout) == (pos == "rope")


@pytest.mark.parametrize("value, expected", [
    ("0", "--max-seq-len: 0 is out of range; expected an integer in [1, 1048576]"),
    ("-4", "--max-seq-len: -4 is out of range"), ("abc", "--max-seq-len: "),
    ("64", "error: --max-seq-len 64: expected at most 32 ("),
])
def test_max_seq_len_refusals(ckpts, tmp_path, value, expected):
    """A bad N is one line naming the option, nothing written: not a positive integer, or past the rows of a
    learned position table."""
    out = tmp_path / "out"
    line = _one_error_line(_build("--fuse", "--checkpoint", ckpts["taper"], "--out", out, "--max-seq-len", value))
    assert line.startswith("error: ") and expected in line, line
    if value == "64":
        assert "learned positions" in line and line.endswith("pass --max-seq-len 32 or less")
    assert not out.exists()


def test_max_seq_len_past_max_position_embeddings_refused(tmp_path):
    """A Hugging Face folder's capacity is at most its max_position_embeddings (64 here): models.convert caps
    silently, export.build --max-seq-len says so in one line."""
    from tests.hf_models import hf_model, save_hf
    hf = save_hf(hf_model("llama"), tmp_path / "hf")
    out = tmp_path / "out"
    line = _one_error_line(_build("--fuse", "--checkpoint", hf, "--out", out, "--max-seq-len", 100))
    assert line == (f"error: --max-seq-len 100: expected at most 64 (max_position_embeddings in {hf / 'config.json'}), "
                    "found 100; pass --max-seq-len 64 or less"), line
    assert not out.exists()


# --- --kv-cache: the caches' dtype ---------------------------------------------------------------------

def _greedy_in_place(graph, cache: str) -> np.ndarray:
    """30 greedy tokens after a fixed prompt from an OrtSession over `graph`, which must keep its caches in
    place in the `cache` dtype."""
    from core.contract import np_dtype
    from core.decode import DecodeDriver, greedy_tokens
    from runtime.ort_session import OrtSession
    with OrtSession(graph) as s:
        s.reset(1)
        tokens = greedy_tokens(DecodeDriver(s.step, s.spec, 1, owns_caches=True), np.arange(3, 20)[None], 30)
        assert s.cache_array("key_0").dtype == np_dtype(cache)
    return tokens


def test_kv_cache_fp16_build(tmp_path):
    """--kv-cache fp16 on the ONNX Runtime CPU graph: the graph's caches are fp16 (its contract, so every
    session allocates them so), its logits fp32; verified against torch at fp16's tolerance; the report and
    the summary say so. An OrtSession over it keeps fp16 caches in place and greedy-generates what the
    build's fp32-cache graph does."""
    from core.contract import contract_of
    ckpt = write_checkpoint(tmp_path / "ckpt", random_model(seed=3, norm="rmsnorm", pos_embedding="rope", n_kv_head=2,
                                                            mlp="swiglu", d_model=64, n_head=4, max_seq_len=64))
    outs = {}
    for cache in ("fp32", "fp16"):
        outs[cache] = tmp_path / cache
        r = _build("--fuse", "--checkpoint", ckpt, "--out", outs[cache], "--kv-cache", cache)
        assert r.returncode == 0, r.stdout + r.stderr
        report = json.loads((outs[cache] / "report.json").read_text())
        assert report["kv_cache"] == cache and report["target"] == "ort-cpu"
        assert contract_of(outs[cache] / "model.fused.onnx").dtype == cache
        assert (", fp16 KV cache" in r.stdout) == (cache == "fp16")
    assert report["atol"] == 1e-2 and report["scale_tol"] == 4e-3         # fp16's tolerance (export/verify.py)
    tokens = {cache: _greedy_in_place(out / "model.fused.onnx", cache) for cache, out in outs.items()}
    np.testing.assert_array_equal(tokens["fp16"], tokens["fp32"])


def test_kv_cache_int8_build(tmp_path):
    """--kv-cache int8 on the ONNX Runtime CPU graph: verified against torch with its fp32 cache (fp32's
    tolerance), then its caches made int8 with scales calibrated on that graph and the logits checked against
    it (report "kv_cache_check": within KV_CACHE_DRIFT["int8"]); the contract's caches are int8, so an
    OrtSession keeps int8 caches in place and its greedy text mostly agrees with the fp32 cache's."""
    from core.contract import contract_of
    from graph_passes.ort_attention import KV_CACHE_DRIFT
    ckpt = write_checkpoint(tmp_path / "ckpt", random_model(seed=3, norm="rmsnorm", pos_embedding="rope", n_kv_head=2,
                                                            mlp="swiglu", d_model=64, n_head=4, max_seq_len=96))
    outs = {c: tmp_path / c for c in ("fp32", "int8")}
    for cache, out in outs.items():
        r = _build("--fuse", "--checkpoint", ckpt, "--out", out, "--kv-cache", cache)
        assert r.returncode == 0, r.stdout + r.stderr
    report = json.loads((outs["int8"] / "report.json").read_text())
    assert report["kv_cache"] == "int8" and report["atol"] == 1e-4          # verified with its fp32 cache first
    check = report["kv_cache_check"]
    assert 0 < check["drift"] <= KV_CACHE_DRIFT["int8"] == check["bound"] and check["steps"] == 32
    assert check["text"] == "CHECK_TEXT (63 tokens)" and check["calibration_tokens"] == 31    # cut to leave room
    assert ", int8 KV cache" in r.stdout and "kv_cache int8 KV cache vs fp32 cache max |d logits|" in r.stdout
    assert "[6/6] int8 KV cache: scales calibrated on model.fused.onnx" in r.stdout
    assert contract_of(outs["int8"] / "model.fused.onnx").dtype == "int8"
    tokens = {cache: _greedy_in_place(out / "model.fused.onnx", cache) for cache, out in outs.items()}
    assert (tokens["int8"] == tokens["fp32"]).mean() >= 0.9


@pytest.mark.parametrize("args, expected", [
    (("--fuse", "--target", "portable"), "error: --kv-cache fp16: expected the ONNX Runtime CPU graph (--target "
                                         "ort-cpu: GroupQueryAttention), found plain attention (--target portable); "
                                         "add --fuse --target ort-cpu, or drop --kv-cache"),
    ((), "error: --kv-cache fp16: expected the ONNX Runtime CPU graph"),                   # no --fuse: portable
    (("--fuse", "--genai"), "error: --kv-cache fp16: expected a build without --genai"),
    (("--fuse", "--kv-cache", "int4"), "argument --kv-cache: invalid choice"),
    (("--fuse", "--target", "portable", "--kv-cache", "int8"), "error: --kv-cache int8: expected the ONNX Runtime "
                                                               "CPU graph (--target ort-cpu: GroupQueryAttention)"),
    (("--fuse", "--genai", "--kv-cache", "int8"), "error: --kv-cache int8: expected a build without --genai"),
])
def test_kv_cache_refusals(ckpts, tmp_path, args, expected):
    out = tmp_path / "out"
    line = _one_error_line(_build("--checkpoint", ckpts["taper"], "--out", out, "--kv-cache", "fp16", *args))
    assert line.startswith(expected) or expected in line, line
    assert not out.exists()


def test_kv_cache_auto_builds_int8_at_a_long_capacity_and_keeps_fp32_when_it_drifts(tmp_path, monkeypatch):
    """The default --kv-cache auto: at a capacity of 4096 the ONNX Runtime CPU graph gets the int8 cache, checked as
    --kv-cache int8 checks it, and the report and the summary say why; at 256, fp32. An auto int8 cache that drifts
    past its bound puts the fp32 graph back (the same bytes) and says so, where --kv-cache int8 fails."""
    import export.kv_int8 as kv_int8
    from core.contract import contract_of
    from graph_passes import ort_attention
    spec = dict(seed=3, norm="rmsnorm", pos_embedding="rope", n_kv_head=2, mlp="swiglu", d_model=64, n_head=4)
    for capacity, cache in ((4096, "int8"), (256, "fp32")):
        ckpt = write_checkpoint(tmp_path / f"ckpt{capacity}", random_model(**spec, max_seq_len=capacity))
        out = tmp_path / f"out{capacity}"
        r = _build("--fuse", "--checkpoint", ckpt, "--out", out)
        assert r.returncode == 0, r.stdout + r.stderr
        report = json.loads((out / "report.json").read_text())
        assert report["kv_cache"] == cache and contract_of(out / "model.fused.onnx").dtype == cache
        assert report["kv_cache_why"].startswith(f"auto: {cache} (capacity {capacity} ")
        assert f"  kv_cache auto: {cache} (capacity {capacity}" in r.stdout
        assert (report["kv_cache_check"] != {}) == (cache == "int8")
    graph = out / "model.fused.onnx"                     # the fp32-cache graph of capacity 256
    before = graph.read_bytes()
    monkeypatch.setitem(ort_attention.KV_CACHE_DRIFT, "int8", 0.0)
    result = kv_int8.int8_cache(graph, None, keep_fp32=True)
    assert result.kept_fp32 and result.drift > 0 and graph.read_bytes() == before
    assert result.line().endswith("past the bound, so the fp32 cache was kept")
    with pytest.raises(kv_int8.BuildError, match="expected the int8 cache to keep the logits within 0%"):
        kv_int8.int8_cache(graph, None)
    assert contract_of(graph).dtype == "int8"            # (a failed build's temporary folder holds it; never ours)
    from export.options import BuildOptions
    from export.pipeline import build             # the build, told auto chose int8, keeps its fp32 graph
    options = BuildOptions(True, attention="gqa", kv_cache="int8", kv_cache_why="auto: int8 (capacity 256, a test)")
    report = build(tmp_path / "ckpt256", tmp_path / "kept", options, log=lambda *a: None)
    assert report.kv_cache == "fp32" and report.kv_cache_check.kept_fp32
    assert report.kv_cache_why.startswith("auto: fp32 (the int8 cache tried first drifted ")
    assert contract_of(tmp_path / "kept" / "model.fused.onnx").dtype == "fp32"
    assert any(n.startswith("--kv-cache auto: int8 KV cache vs fp32 cache") for n in report.notes)
