"""bench.shapes' random folders (every real shape's tensor list against transformers; tiny folders that
transformers loads and models.convert converts) and bench.scale run end to end on a tiny Llama.
No timing is asserted: only that every measurement is there and positive."""
import json
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import scale
from bench.shapes import SHAPES, folder_config, folder_matches, tensor_specs, write_random_folder
from core.outputs import JSON_SIGNATURE_KEY, REPORT_JSON

ROOT = Path(__file__).resolve().parents[2]
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                  vocab_size=256, bos_token_id=0, eos_token_id=0)
# each family at a tiny width, keeping the rest of its real config (llama3 rope scaling, qwen2 biases, GPT-2 Conv1D)
TINY = {
    "llama": dict(SHAPES["llama-3.2-1b"], **TINY_LLAMA),
    "llama-untied": dict(SHAPES["llama-3-8b"], **TINY_LLAMA),
    "qwen2": dict(SHAPES["qwen2.5-0.5b"], **{k: v for k, v in TINY_LLAMA.items() if k != "head_dim"}),
    "gpt2": dict(SHAPES["gpt2-medium"], n_embd=64, n_head=4, vocab_size=256, n_positions=64, n_ctx=64,
                 bos_token_id=0, eos_token_id=0),
    # the 2026 families: QK-norms, sandwich / post norms, Gemma's stored w of 1 + w, Phi-3's fused projections
    "qwen3": dict(SHAPES["qwen3-8b"], **TINY_LLAMA),
    "gemma3": dict(SHAPES["gemma-3-1b"], **TINY_LLAMA, sliding_window=8, pad_token_id=0),
    "phi3": dict(SHAPES["phi-4-mini"], **{k: v for k, v in TINY_LLAMA.items() if k != "head_dim"}, pad_token_id=0,
                 rope_scaling={"type": "longrope", "short_factor": [1.0] * 6, "long_factor": [2.0] * 6}),
    "olmo2": dict(SHAPES["olmo-2-1b"], **TINY_LLAMA, pad_token_id=0),
    "smollm3": dict(SHAPES["smollm3-3b"], **TINY_LLAMA, pad_token_id=0),
}
# parameter counts of the published models (embedding counted once when tied)
PARAMS = {"llama-3.2-1b": 1_235_814_400, "llama-3.2-3b": 3_212_749_824, "llama-3-8b": 8_030_261_248,
          "qwen2.5-0.5b": 494_032_768, "gpt2-medium": 354_823_168, "gpt2-xl": 1_557_611_200,
          "qwen3-0.6b": 596_049_920, "qwen3-1.7b": 1_720_574_976, "qwen3-4b": 4_022_468_096,
          "qwen3-8b": 8_190_735_360, "gemma-3-1b": 999_885_952, "gemma-3-4b": 3_880_263_168,      # text weights
          "phi-4-mini": 3_836_021_760, "smollm3-3b": 3_075_098_624, "olmo-2-1b": 1_484_916_736}


def quiet(log_lines=None):
    return (lambda *a, **k: log_lines.append(" ".join(map(str, a)))) if log_lines is not None else (lambda *a, **k: None)


def hf_load(folder):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_every_real_shape_lists_the_tensors_transformers_builds(name):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    config = folder_config(SHAPES[name])
    with torch.device("meta"):     # no memory: shapes only
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        expected.pop("lm_head.weight")
    ours = {n: s for n, s, _ in tensor_specs(config)}
    assert ours == expected
    assert sum(math.prod(s) for s in ours.values()) == PARAMS[name]
    assert model.dtype == torch.bfloat16


@pytest.mark.parametrize("family", sorted(TINY))
def test_tiny_folder_loads_in_transformers_and_converts(family, tmp_path):
    folder = write_random_folder(TINY[family], tmp_path / family, seed=3, layers=2, log=quiet())
    model, info = hf_load(folder)
    assert {k: v for k, v in info.items() if v} == {}          # no missing, unexpected or mismatched keys
    assert model.dtype == torch.bfloat16 and model.config.num_hidden_layers == 2
    from models.convert import stores_gain_minus_one
    unit = 0 if stores_gain_minus_one(TINY[family]["model_type"]) else 1      # Gemma stores w of its 1 + w gain
    for name, p in model.named_parameters():
        if name.endswith("bias"):
            assert torch.all(p == 0), name
        elif p.dim() == 1:
            assert torch.all(p == unit), name
        else:
            assert 0.015 < p.float().std().item() < 0.025, name
    from models.convert import main as convert_main
    assert convert_main([str(folder), "--out", str(tmp_path / "ckpt")]) == 0
    assert (tmp_path / "ckpt" / "config.json").is_file()
    assert folder_matches(folder, TINY[family], seed=3, layers=2)
    assert not folder_matches(folder, TINY[family], seed=3, layers=3)
    assert not folder_matches(folder, TINY[family], seed=4, layers=2)


def test_sharded_folder_holds_the_same_tensors(tmp_path):
    from safetensors.torch import load_file
    log = []
    one = write_random_folder(TINY["llama-untied"], tmp_path / "one", layers=2, log=quiet())
    many = write_random_folder(TINY["llama-untied"], tmp_path / "many", layers=2, shard_bytes=40_000, log=quiet(log))
    index = json.loads((many / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sum(ln.strip().startswith("shard ") for ln in log) == len(files)
    whole = load_file(one / "model.safetensors")
    assert set(index["weight_map"]) == set(whole)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in whole.values())
    for f in files:
        for name, t in load_file(many / f).items():
            assert index["weight_map"][name] == f and torch.equal(t, whole[name]), name
    _, info = hf_load(many)
    assert {k: v for k, v in info.items() if v} == {}


def test_child_peak_is_not_floored_by_this_process():
    ballast = torch.ones(300 << 20, dtype=torch.uint8)          # this process: >= 300 MB resident
    row = scale.measured([sys.executable, "-c", "pass"])
    assert row["rc"] == 0 and row["error"] is None
    assert 0 < row["peak_rss_bytes"] < 150e6, row                 # an idle interpreter, not our 300 MB
    failed = scale.measured([sys.executable, "-c", "import sys; print('a'); sys.exit('error: x: bad; fix it')"])
    assert failed["rc"] == 1 and failed["error"] == "error: x: bad; fix it"
    del ballast


def test_a_child_past_the_memory_cap_is_stopped_and_said():
    """A process tree that grows past --memory-cap is killed by the bench (not the OOM killer); the row says so."""
    grow = "import time; x = bytearray(400 << 20); x[::4096] = b'1' * len(x[::4096]); time.sleep(30)"
    row = scale.measured([sys.executable, "-c", grow], cap_bytes=200 << 20)
    assert row["capped"] and row["rc"] != 0 and row["wall_s"] < 20
    assert row["error"].startswith("stopped by the bench at") and "OOM" in row["error"]
    assert not scale.measured([sys.executable, "-c", "pass"], cap_bytes=200 << 20)["capped"]


@pytest.mark.parametrize("text, complaint", [("fp32", "no ="), ("a=--fuse;a=--fuse", "'a'"), ("", "found none"),
                                             ("x=--fuse --out y", "--out is set by bench.scale"),
                                             (f"{scale.GENAI}=--fuse", "not genai-int4"),
                                             ('a=--fuse --dtype "fp16', "No closing quotation.*close the quote")])
def test_bad_options_are_one_usage_line(text, complaint):
    from core.errors import UsageError
    with pytest.raises(UsageError, match=complaint):
        scale.parse_options(text)


@pytest.mark.parametrize("change, complaint", [
    ({"hidden_size": -64}, "hidden_size: expected an integer in .1, 2147483647., found -64"),
    ({"hidden_size": 10**11}, "found 100000000000"), ({"vocab_size": "256"}, "vocab_size: .* found '256'"),
    ({"intermediate_size": None}, "found None"), ({"num_hidden_layers": 2.5}, "found 2.5"),
    ({"num_attention_heads": True}, "found True"), ({"vocab_size": ...}, "vocab_size: .* found no such key"),
    ({"hidden_size": 10**9}, r"a .* shard \(from tensor .*\): needs .* available; use smaller sizes")])
def test_make_refuses_sizes_that_cannot_make_tensors_in_one_line(tmp_path, capsys, change, complaint):
    config = {k: v for k, v in {**TINY["llama"], "num_hidden_layers": 2, **change}.items() if v is not ...}
    (tmp_path / "s.json").write_text(json.dumps(config))
    rc = scale.main(["make", str(tmp_path / "s.json"), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and err[0].startswith("error: "), err
    assert re.search(complaint, err[0]), err[0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json"]


def test_parse_options():
    assert scale.parse_options("int4-gqa=--fuse --quantize int4 --attention gqa; fp32=--fuse") == {
        "int4-gqa": ["--fuse", "--quantize", "int4", "--attention", "gqa"], "fp32": ["--fuse"]}


def test_unknown_shape_is_one_error_line(tmp_path, capsys):
    rc = scale.main(["run", "--shapes", "llama-9b", "--work", str(tmp_path / "w"), "--options", "a=--fuse",
                     "--json", str(tmp_path / "o.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and err[0].startswith("error: shape 'llama-9b': expected one of llama-3.2-1b")
    assert not (tmp_path / "w").exists()


def test_run_on_a_tiny_llama(tmp_path):
    """The whole run: folder made, one build measured, its graph decoded, the report written and signed."""
    shape = tmp_path / "tiny-llama.json"
    shape.write_text(json.dumps(dict(TINY["llama"], num_hidden_layers=2)))
    out = tmp_path / "scale.json"
    cmd = [sys.executable, "-m", "bench.scale", "run", "--shapes", str(shape), "--work", str(tmp_path / "work"),
           "--options", "fuse=--fuse;bf16=--fuse --dtype bf16", "--rounds", "1", "--decode-tokens", "8", "--threads", "1",
           "--peers", "genai", "--json", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report[JSON_SIGNATURE_KEY] == REPORT_JSON.name
    (s,) = report["shapes"]
    assert s["name"] == "tiny-llama" and s["params"] > 0 and s["folder_bytes"] > 0
    (run,) = s["options"]["fuse"]["runs"]
    assert run["rc"] == 0 and run["wall_s"] > 0 and run["peak_rss_bytes"] > 0 and run["output_bytes"] > 0
    assert run["graph"] == "model.fused.onnx"
    assert run["decode"]["rc"] == 0 and run["decode"]["tokens_per_s"] > 0 and run["decode"]["steps"] == 8
    assert run["decode"]["peak_rss_bytes"] > 0
    assert s["options"]["fuse"]["summary"]["decode_tokens_per_s"]["median"] > 0
    assert "| fuse | 1 / 1 |" in r.stdout
    (bf16,) = s["options"]["bf16"]["runs"]          # built and measured; not decoded on this CPU, and said why
    assert bf16["rc"] == 0 and bf16["output_bytes"] < run["output_bytes"] and "bf16" in bf16["decode"]["skipped"]
    assert scale.main(["plot", str(out), "--out", str(tmp_path / "scale.png")]) == 0       # the figure of it
    assert (tmp_path / "scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    genai = s["peers"]["genai"]
    assert genai == "skipped: onnxruntime-genai not installed" or s["options"][scale.GENAI]["runs"][0]["rc"] == 0
    # a second run reuses the folder and reports a failing build by its error line
    cmd[cmd.index("fuse=--fuse;bf16=--fuse --dtype bf16")] = "bad=--quantize int4"
    cmd[cmd.index("genai")] = ""            # (the peer's build was shown above)
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "tiny-llama: reusing" in r.stdout and "| bad | 0 / 1 | - |" in r.stdout
    (run,) = json.loads(out.read_text())["shapes"][0]["options"]["bad"]["runs"]
    assert run["rc"] == 2 and run["error"].startswith("error: --quantize int4: expected --fuse") and "decode" not in run


def _built_by(rc: int):
    """scale.measured for GenAI's builder: writes a genai_config.json where -o points, exits rc."""
    def fake(cmd, cap_bytes=0):
        (Path(cmd[cmd.index("-o") + 1]) / "genai_config.json").write_text("{}")
        return {"rc": rc, "wall_s": 1.0, "peak_rss_bytes": 1, "stdout": "", "error": None if rc == 0 else "x",
                "capped": False}
    return fake


def test_the_genai_peer_replaces_only_a_folder_of_ours(tmp_path, monkeypatch):
    """WORK/genai-<shape>-int4 holding a genai_config.json but no marker is the user's: refused in one
    line with every file kept (it was deleted, exit 0). A build of ours there is replaced; a failed
    build keeps it and leaves no temporary."""
    from core.errors import UserError
    from core.outputs import BENCH_CACHE, marker_kind
    out, inp = tmp_path / "genai-s-int4", tmp_path / "in"
    out.mkdir()
    (out / "genai_config.json").write_text('{"mine": 1}')
    (out / "notes.txt").write_text("mine")
    monkeypatch.setattr(scale, "measured", _built_by(0))
    with pytest.raises(UserError, match="genai-s-int4: exists and holds files tapernorm-deploy did not write"):
        scale.genai_build(inp, out, tmp_path / "cache")
    assert (out / "notes.txt").read_text() == "mine" and (out / "genai_config.json").read_text() == '{"mine": 1}'
    (out / "notes.txt").unlink()
    (out / "genai_config.json").unlink()
    assert scale.genai_build(inp, out, tmp_path / "cache")["rc"] == 0 and marker_kind(out) == BENCH_CACHE.name
    monkeypatch.setattr(scale, "measured", _built_by(1))
    before = (out / ".tapernorm-output.json").read_text()
    assert scale.genai_build(inp, out, tmp_path / "cache")["rc"] == 1
    assert (out / ".tapernorm-output.json").read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["genai-s-int4"]


@pytest.mark.parametrize("folder", ["genai-s-int4", "build-s-a", "s"])
def test_run_refuses_a_folder_it_would_write_before_any_work(tmp_path, capsys, folder):
    (tmp_path / "s.json").write_text(json.dumps(dict(TINY["llama"], num_hidden_layers=2)))
    (tmp_path / "w" / folder).mkdir(parents=True)
    (tmp_path / "w" / folder / "genai_config.json").write_text("{}")
    rc = scale.main(["run", "--shapes", str(tmp_path / "s.json"), "--work", str(tmp_path / "w"), "--options",
                     "a=--fuse", "--peers", "genai", "--json", str(tmp_path / "o.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 1 and f"w/{folder}: exists and holds files" in err[0] and "--work" in err[0], err
    assert [p.name for p in (tmp_path / "w").iterdir()] == [folder] and not (tmp_path / "o.json").exists()


def test_a_failed_genai_build_is_not_measured_by_the_earlier_one(tmp_path, monkeypatch):
    """A round whose GenAI build fails reports the failure: the earlier build in its place is not decoded
    as if it were this round's."""
    import argparse
    out = tmp_path / "genai-s-int4"
    monkeypatch.setattr(scale, "measured", _built_by(0))
    scale.genai_build(tmp_path / "in", out, tmp_path / "cache")
    calls = []
    monkeypatch.setattr(scale, "measured", lambda cmd, cap_bytes=0: calls.append(cmd) or _built_by(1)(cmd))
    args = argparse.Namespace(work=tmp_path, cap_bytes=0, decode_tokens=2, prompt_tokens=2, threads=1)
    row = scale.measure_option(scale.GENAI, [], tmp_path / "s", out, args, tmp_path / "in")
    assert row["rc"] == 1 and "decode" not in row and "graph" not in row and len(calls) == 1


KILLED_BENCH = """import sys
from bench import scale
scale.measured([sys.executable, "-c", "import os, sys, time; "
                "open(sys.argv[1], 'w').write(f'{os.getpid()} {os.getppid()}'); time.sleep(120)", sys.argv[1]])
"""


def _alive(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="PR_SET_PDEATHSIG and /proc: Linux")
def test_a_child_build_does_not_outlive_a_killed_bench(tmp_path):
    """SIGKILL to bench.scale (which cannot catch it) stops the build it was measuring: the child is told
    by the kernel that its parent died (it ran on before), and the measuring wrapper leaves no file in
    the temporary folder (its usage file was left there)."""
    import os
    import signal
    import time
    pid_file = tmp_path / "child.pid"
    (tmp_path / "tmp").mkdir()
    bench = subprocess.Popen([sys.executable, "-c", KILLED_BENCH, str(pid_file)], cwd=ROOT,
                             env=dict(os.environ, TMPDIR=str(tmp_path / "tmp")))
    try:
        deadline = time.time() + 60
        while not pid_file.is_file() or not pid_file.read_text():
            assert bench.poll() is None and time.time() < deadline
            time.sleep(0.05)
        child, wrapper = map(int, pid_file.read_text().split())
        os.kill(bench.pid, signal.SIGKILL)
        bench.wait(10)
        deadline = time.time() + 20
        while _alive(child) or _alive(wrapper):
            assert time.time() < deadline, "the child build outlived the bench"
            time.sleep(0.05)
        assert list((tmp_path / "tmp").iterdir()) == []
    finally:
        if bench.poll() is None:
            bench.kill()
        for pid in map(int, pid_file.read_text().split() if pid_file.is_file() else []):
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_depth_mode_on_a_tiny_llama(tmp_path):
    """--depths / --prefills: per option, decode tokens/s after a real prefill of each depth and prefill
    tokens/s of each prompt length, over interleaved rounds (min / median / max), in the report, the table
    and the plot; the capacity set by the option (export.build --max-seq-len); fp32 and fp16 caches side by
    side. A depth past the graph's capacity is that row's error, not a crash."""
    shape = tmp_path / "tiny-llama.json"
    shape.write_text(json.dumps(dict(TINY["llama"], num_hidden_layers=2)))
    out = tmp_path / "scale.json"
    cmd = [sys.executable, "-m", "bench.scale", "run", "--shapes", str(shape), "--work", str(tmp_path / "work"),
           "--options", "fp32=--fuse --max-seq-len 96;fp16=--fuse --max-seq-len 96 --kv-cache fp16;short=--fuse "
           "--max-seq-len 48", "--rounds", "2", "--decode-tokens", "4", "--threads", "1",
           "--depths", "0,16,64", "--prefills", "8,32", "--json", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    report = json.loads(out.read_text())
    assert report["depths"] == [0, 16, 64] and report["prefills"] == [8, 32]
    (s,) = report["shapes"]
    for name in ("fp32", "fp16"):
        runs, summary = s["options"][name]["runs"], s["options"][name]["summary"]
        assert [r["round"] for r in runs] == [1, 2] and all(r["decode"]["rc"] == 0 for r in runs)
        depths = runs[0]["decode"]["depths"]
        assert set(depths) == {"0", "16", "64"} and all(d["tokens_per_s"] > 0 and d["steps"] == 4 for d in depths.values())
        assert set(runs[0]["decode"]["prefills"]) == {"8", "32"}
        assert set(summary["depth_decode_tokens_per_s"]) == {"0", "16", "64"}
        spread = summary["prefill_tokens_per_s"]["32"]
        assert 0 < spread["min"] <= spread["median"] <= spread["max"]
    assert "decode tok/s at depth 64" in r.stdout and "prefill tok/s at prompt length 32" in r.stdout
    (short, _) = s["options"]["short"]["runs"]               # capacity 48 cannot hold depth 64 + 5
    assert short["rc"] == 0 and short["decode"]["rc"] != 0 and "capacity" in short["decode"]["error"]
    assert scale.main(["plot", str(out), "--out", str(tmp_path / "scale.png")]) == 0
    assert (tmp_path / "scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("flag, value", [("--depths", "abc"), ("--depths", "-1"), ("--prefills", "0"),
                                         ("--prefills", "")])
def test_bad_depths_are_one_usage_line(tmp_path, capsys, flag, value):
    rc = scale.main(["run", "--shapes", "qwen3-0.6b", "--work", str(tmp_path / "w"), "--options", "a=--fuse",
                     flag, value, "--json", str(tmp_path / "s.json")])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and f"argument {flag}: " in err[0], err
    assert "expected a comma list of token counts" in err[0], err
    assert not (tmp_path / "w").exists()


def test_drift_of_an_fp16_cache_against_the_fp32_cache(tmp_path, capsys):
    """bench.scale drift: two builds of one model (--kv-cache fp32 and fp16): the logits drift over the prompt
    and the reference's greedy steps within KV_CACHE_DRIFT, the same greedy text; a graph too small for the
    tokens asked is one line naming the capacity to build."""
    from graph_passes.ort_attention import KV_CACHE_DRIFT
    from tests.helpers import random_model, write_checkpoint
    ckpt = write_checkpoint(tmp_path / "ckpt", random_model(seed=3, norm="rmsnorm", pos_embedding="rope", n_kv_head=2,
                                                            mlp="swiglu", d_model=64, n_head=4, max_seq_len=64))
    graphs = []
    for cache in ("fp32", "fp16"):
        out = tmp_path / cache
        r = subprocess.run([sys.executable, "-m", "export.build", "--fuse", "--checkpoint", str(ckpt), "--out", str(out),
                            "--max-seq-len", "160", "--kv-cache", cache], cwd=ROOT, capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        graphs.append(str(out / "model.fused.onnx"))
    assert scale.main(["drift", *graphs, "--prompt-tokens", "100", "--new-tokens", "60", "--threads", "1"]) == 0
    row = json.loads(capsys.readouterr().out.strip())
    assert row["caches"] == ["fp32", "fp16"] and row["greedy_agreement"] == 1.0 and row["first_difference"] is None
    assert 0 < row["prefill_logits_drift"] <= KV_CACHE_DRIFT["fp16"]
    assert 0 < row["step_logits_drift"] <= KV_CACHE_DRIFT["fp16"]
    assert scale.main(["drift", *graphs, "--prompt-tokens", "150", "--new-tokens", "60"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {graphs[0]}: expected a cache of at least 210 slots (--prompt-tokens + --new-tokens), "
                   "found 160; build with --max-seq-len 210 or ask for fewer tokens"], err


FAKE_LLAMA_BENCH = '''import json, sys
a = sys.argv[1:]
val = lambda f, d: a[a.index(f) + 1] if f in a else d
open(sys.argv[0] + ".calls", "a").write(" ".join(a) + "\\n")
n, p = int(val("-n", "128")), [int(x) for x in val("-p", "512").split(",")]
for fa in [1 if x == "on" else 0 for x in val("-fa", "off").split(",")]:
    for d in [int(x) for x in val("-d", "0").split(",")] if n else ():
        print(json.dumps({"flash_attn": fa, "n_prompt": 0, "n_gen": n, "n_depth": d, "avg_ts": 1000.0 / (1 + d) + fa}))
    for q in p if not n else ():
        print(json.dumps({"flash_attn": fa, "n_prompt": q, "n_gen": 0, "n_depth": 0, "avg_ts": 2000.0 - fa}))
'''


def fake_llama_bench(tmp_path) -> Path:
    """llama-bench's command line and JSONL lines, from a script: decode tokens/s 1000 / (1 + depth) (+1 with flash
    attention on), prefill 2000 (-1 with it on); its calls are logged beside it."""
    path = tmp_path / "llama-bench"
    path.write_text(f"#!{sys.executable}\n" + FAKE_LLAMA_BENCH)
    path.chmod(0o755)
    return path


def test_llamacpp_peer_and_reused_builds_on_a_tiny_llama(tmp_path):
    """--peers llamacpp: llama-bench runs in its turn of each round, flash attention on and off, its two rows in the
    report, the table and the plot, and ours divided by the faster one per round; --reuse-builds decodes the build
    the first run wrote with the same arguments (no build figures), and builds again when they differ."""
    shape = tmp_path / "tiny-llama.json"
    shape.write_text(json.dumps(dict(TINY["llama"], num_hidden_layers=2)))
    gguf, bench = tmp_path / "model-q4_0.gguf", fake_llama_bench(tmp_path)
    gguf.write_bytes(b"GGUF" + bytes(60))
    out, work = tmp_path / "scale.json", tmp_path / "work"
    cmd = [sys.executable, "-m", "bench.scale", "run", "--shapes", str(shape), "--work", str(work),
           "--options", "fp32=--fuse --max-seq-len 64", "--rounds", "2", "--decode-tokens", "4", "--threads", "1",
           "--depths", "0,16", "--prefills", "8", "--peers", "llamacpp", "--gguf", str(gguf),
           "--llama-bench", str(bench), "--json", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    calls = Path(str(bench) + ".calls").read_text().splitlines()
    assert len(calls) == 4 and all("-fa on,off" in c and "-t 1" in c and str(gguf) in c for c in calls), calls
    assert "-p 0 -n 4 -d 0,16" in calls[0] and "-p 8 -n 0" in calls[1]
    (s,) = json.loads(out.read_text())["shapes"]
    on, off = (s["options"][n] for n in ("llamacpp-fa-on", "llamacpp-fa-off"))
    assert [r["round"] for r in on["runs"]] == [1, 2] and on["runs"][0]["output_bytes"] == 64
    assert on["runs"][0]["decode"]["depths"]["16"]["tokens_per_s"] == pytest.approx(1000 / 17 + 1)
    assert off["runs"][1]["decode"]["prefills"]["8"]["tokens_per_s"] == 2000
    assert on["summary"]["wall_s"] is None and on["summary"]["decode_tokens_per_s"]["median"] == 1001
    ours = s["options"]["fp32"]["runs"]
    for key, point, peer in (("depths", "16", 1000 / 17 + 1), ("prefills", "8", 2000)):
        ratios = [run["decode"][key][point]["tokens_per_s"] / peer for run in ours]
        assert s["ratios_to_llamacpp"]["fp32"][key][point]["median"] == pytest.approx(sum(ratios) / 2)
    assert "llamacpp-fa-on" in r.stdout and "| option / llama.cpp's faster setting" in r.stdout
    assert scale.main(["plot", str(out), "--out", str(tmp_path / "scale.png")]) == 0
    # the second run decodes the first run's build; a changed option builds again
    assert ours[0]["wall_s"] > 0 and "reused" not in ours[0]
    cmd[cmd.index("--rounds") + 1] = "1"
    for extra, reused in (([], True), (["--options", "fp32=--fuse --max-seq-len 80"], False)):
        r = subprocess.run(cmd + ["--reuse-builds"] + extra, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        (run,) = json.loads(out.read_text())["shapes"][0]["options"]["fp32"]["runs"]
        assert run.get("reused", False) is reused and run["decode"]["rc"] == 0, run
        assert (run["wall_s"] is None) is reused and ("build reused" in r.stdout) is reused


@pytest.mark.parametrize("extra, code, complaint", [
    (["--gguf", "GGUF"], 2, "--gguf: expected --peers llamacpp too"),
    (["--peers", "llamacpp"], 2, "expected llama.cpp's GGUF of the shape's folder, found no --gguf"),
    (["--peers", "llamacpp", "--gguf", "NOFILE"], 1, "expected llama.cpp's GGUF of the shape's folder, found no file"),
    (["--peers", "llamacpp", "--gguf", "GGUF", "--llama-bench", "no-such-llama-bench"], 1,
     "no-such-llama-bench: expected llama.cpp's llama-bench"),
    (["--peers", "llamacpp", "--gguf", "GGUF", "--shapes", "qwen3-0.6b,llama-3.2-1b"], 2, "expected one shape")])
def test_llamacpp_peer_refusals_are_one_line_before_any_work(tmp_path, capsys, extra, code, complaint):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    argv = ["run", "--shapes", "qwen3-0.6b", "--work", str(tmp_path / "w"), "--options", "a=--fuse",
            "--json", str(tmp_path / "s.json")] + [{"GGUF": str(gguf), "NOFILE": str(tmp_path / "no.gguf")}.get(a, a)
                                                    for a in extra]
    rc = scale.main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == code and len(err) == 1 and complaint in err[0], err
    assert not (tmp_path / "w").exists()


def test_plot_colours_follow_the_title_key_in_every_panel():
    """The figure's title says orange is GenAI's builder and green llama.cpp (dashed: flash attention off): the
    curves keep that key as the bars do, and no option of ours takes either colour."""
    from bench.scale import GENAI, LLAMACPP_ROWS, _style
    assert _style(f"qwen3-0.6b\n{GENAI}", 0) == {"color": "tab:orange"}
    assert _style(f"qwen3-0.6b\n{LLAMACPP_ROWS[1]}", 0) == {"color": "tab:green", "linestyle": "-"}
    assert _style(f"qwen3-0.6b\n{LLAMACPP_ROWS[0]}", 0) == {"color": "tab:green", "linestyle": "--"}
    ours = {_style("qwen3-0.6b\nint8", k)["color"] for k in range(8)}
    assert len(ours) == 8 and not ours & {"tab:orange", "tab:green"}
