"""Property test: random options for every command never give a traceback, never exit with
anything but 0, 1, 2 or 130, and never change a user's file.

Each example draws a command and a random subset of its options, with values from random
text (surrogates and control characters included), numbers (huge, negative, nan, inf) and
paths: the user's sentinel files, valid inputs (a checkpoint, a build, a training run) and
fresh scratch paths. Each example runs in a child forked from a zygote that imported every
command once (tests/cli/zygote.py); a command still running after ALARM_S gets a real SIGINT,
a Ctrl-C at a random moment, which must exit 130 and leave no temporary behind. After every
example the sentinel tree is compared byte for byte. FUZZ_EXAMPLES (default 150: ~1 min on
2 cores) sets the number of examples per run; each run draws new ones.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tests.cli.conftest import COMMANDS, copy_tree
from tests.helpers import snapshot

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "150"))
ALARM_S = 3.0
GRACE_S = 20.0          # after the SIGINT: a command must have stopped by then
ROOT = Path(__file__).resolve().parents[2]

INT, FLOAT, TEXT, PATH, OUT, FLAG = "int", "float", "text", "path", "out", "flag"


def choice(*values):
    return ("choice", values)


# command -> (positional kinds, {option: kind}); every option of every entry point
OPTIONS = {
    "models.checkpoint": ([PATH], {}),
    "models.convert": ([PATH], {"--out": OUT, "--max-seq-len": INT}),
    "export.build": ([], {"--checkpoint": PATH, "--out": OUT, "--fuse": FLAG, "--dtype": choice("fp32", "fp16"),
                          "--triton-repo": OUT, "--quantize": choice("int8", "int4", "int2"), "--block-size": INT,
                          "--accuracy-level": INT, "--algo": choice("rtn", "hqq", "x"),
                          "--head": choice("int8", "fp32", "x"), "--attention": choice("plain", "fused", "x"),
                          "--int8-layers": choice("v_proj,down_proj", "nope", "")}),
    "export.verify": ([PATH, PATH], {"--atol": FLOAT, "--tokenizer": PATH, "--text": TEXT, "--reference": PATH}),
    "graph_passes": ([PATH], {"-o": OUT, "--passes": choice("fold_constants,taper_scale", "nope", "trt_lint"),
                              "--strict": FLAG, "--verbose": FLAG, "--list": FLAG}),
    "runtime.generate": ([], {"--model": PATH, "--prompt": TEXT, "--batch-file": PATH, "--max-new-tokens": INT,
                              "--backend": choice("ort", "torch", "trt"), "--device": choice("cpu", "cuda", "x"),
                              "--temperature": FLOAT, "--top-k": INT, "--top-p": FLOAT, "--seed": INT,
                              "--stop": TEXT, "--ignore-eos": FLAG}),
    "runtime.step_timing": ([], {"--model": PATH, "--backend": choice("ort", "torch"), "--batch": INT,
                                 "--prompt-len": INT, "--steps": INT, "--rounds": INT}),
    "runtime.triton repo": (["repo"], {"--build": PATH, "--out": OUT, "--engine": PATH, "--max-batch-size": INT,
                                       "--instances": INT, "--kind": choice("cpu", "gpu", "tpu"),
                                       "--max-new-tokens": INT, "--intra-op-threads": INT, "--slots": INT,
                                       "--max-queued": INT}),
    "runtime.triton check": (["check"], {"--repo": PATH}),
    "runtime.triton serve": (["serve"], {"--repo": "userpath", "--http-port": INT, "--grpc-port": INT,
                                         "--startup-timeout": FLOAT, "--log-verbose": INT, "--metrics-port": INT}),
    "runtime.triton client": (["client"], {"--url": "url", "--prompt": TEXT, "--max-new-tokens": INT,
                                           "--protocol": choice("http", "grpc"), "--temperature": FLOAT,
                                           "--top-k": INT, "--top-p": FLOAT, "--seed": INT, "--timeout": FLOAT,
                                           "--stream": FLAG}),
    "bench.decode": ([], {"--out": OUT, "--quick": FLAG, "--sizes": choice("1M", "9T", ""), "--batches": TEXT,
                          "--prompt": INT, "--new-tokens": INT, "--rounds": INT, "--threads": INT, "--jobs": INT,
                          "--cache": OUT, "--peers": choice("none", "x", "genai"), "--build-only": FLAG,
                          "--dtypes": choice("fp32", "int4", "int2"), "--attention": choice("plain", "fused", "x"),
                          "--capacity": INT}),
    "bench.report": ([PATH], {"--out": OUT}),
    "bench.serve": ([], {"--url": "url", "--api": choice("triton", "openai", "x"), "--endpoint": choice("completions", "chat"),
                         "--force-length": choice("ignore_eos", "min_tokens", "x"), "--concurrency": TEXT, "--requests": INT, "--prompts": PATH,
                         "--max-new-tokens": INT, "--rounds": INT, "--warmup": INT, "--model": TEXT,
                         "--metrics-url": "url", "--timeout": FLOAT, "--out": OUT}),
    "bench.slots": ([], {"--model": PATH, "--slots": INT, "--prompt": INT, "--threads": INT, "--rounds": INT,
                         "--json": OUT}),
    "bench.gpu_decode": ([], {"--sizes": choice("1M", "9T", ""), "--dtypes": choice("fp32,bf16", "fp64"),
                              "--batches": TEXT, "--prompt": INT, "--steps": INT, "--warmup": INT, "--rounds": INT,
                              "--seed": INT, "--json": OUT}),
    "bench.quant_quality": ([], {"--json": OUT, "--kinds": choice("baseline", "gpt9", ""),
                                 "--dtypes": choice("int8", "int2"), "--stories": INT,
                                 "--block-size": INT, "--accuracy-level": INT, "--algo": choice("rtn", "hqq", "x"),
                                 "--head": choice("int8", "fp32", "x"), "--int8-layers": choice("v_proj", "")}),
    "bench.ort_kernels": ([], {"--threads": INT, "--rounds": INT, "--d-model": INT, "--vocab": INT, "--capacity": INT,
                               "--json": OUT}),
    "train": ([], {"--preset": choice("baseline", "dyt", "x"), "--out": OUT, "--resume": FLAG, "--steps": INT,
                   "--lr": FLOAT, "--corpus": PATH, "--tokenizer": PATH, "--d-model": INT, "--n-layer": INT,
                   "--n-head": INT, "--seq-len": INT, "--batch-size": INT, "--eval-every": INT, "--seed": INT,
                   "--threads": INT, "--quiet": FLAG, "--data": PATH, "--shards": OUT, "--grad-accum": INT,
                   "--dtype": choice("fp32", "bf16"), "--device": choice("cpu", "cuda")}),
    "train.screen_dyt": ([], {"--steps": INT, "--json": OUT, "--keep": OUT, "--corpus": PATH, "--d-model": INT,
                              "--batch-size": INT, "--seq-len": INT, "--quiet": FLAG}),
    "train.report": ([], {"--runs": PATH, "--figure": OUT, "--json": OUT, "--install-zoo": OUT, "--presets": TEXT}),
    "train.tokenizer": ([], {"--out": OUT, "--vocab-size": INT, "--stories": INT}),
    "train.shards": ([PATH], {"--out": OUT, "--tokenizer": PATH, "--shard-tokens": INT, "--quiet": FLAG}),
    "train.finetune": ([], {"--from": PATH, "--method": choice("internal-taper", "all-taper", "fakeln", "vanilla", "x"),
                            "--out": OUT, "--resume": FLAG, "--steps": INT, "--lr": FLOAT, "--batch-size": INT,
                            "--seq-len": INT, "--eval-every": INT, "--eval-batches": INT, "--calib-batches": INT,
                            "--warmup-steps": INT, "--taper-steps": INT, "--aux-lambda": FLOAT, "--fakeln-every": INT,
                            "--corpus": PATH, "--corpus-stories": INT, "--seed": INT, "--threads": INT,
                            "--quiet": FLAG, "--data": PATH, "--shards": OUT, "--grad-accum": INT,
                            "--device": choice("cpu", "cuda"), "--dtype": choice("fp32", "bf16")}),
}


def _sentinels(root):
    """The user's files: every kind of thing a careless path could point at."""
    (root / "project" / "src").mkdir(parents=True)
    (root / "project" / "src" / "main.py").write_text("print('mine')\n")
    (root / "project" / "model.onnx").write_bytes(b"")
    (root / "project" / "report.json").write_text("{}")
    (root / "hf").mkdir()
    (root / "hf" / "config.json").write_text('{"model_type": "gpt2"}')
    (root / "hf" / "pytorch_model.bin").write_bytes(os.urandom(64))
    (root / ".out.old").mkdir()
    (root / ".out.old" / "keep").write_text("the user's")
    (root / "notes.txt").write_text("a plain file\n")
    (root / "blob.bin").write_bytes(bytes(range(256)))
    (root / "user.onnx").write_bytes(b"\x08\x07")
    (root / "user.json").write_text('{"a": 1}')
    return root


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_ckpt, tiny_build, tiny_unfused_build, tiny_run):
    root = tmp_path_factory.mktemp("fuzz")
    user = _sentinels(root / "user")
    ours = root / "ours"                     # our own outputs, copied: commands may replace those
    ours.mkdir()
    paths = {
        "user": [user, user / "project", user / "hf", user / ".out.old", user / "notes.txt", user / "blob.bin",
                 user / "user.onnx", user / "user.json", user / "missing", user / "project" / "model.onnx"],
        "ours": [copy_tree(tiny_ckpt, ours / "ckpt"), copy_tree(tiny_build, ours / "build"),
                 copy_tree(tiny_run, ours / "run"), ours / "build" / "model.fused.onnx",
                 copy_tree(tiny_unfused_build, ours / "unfused") / "model.onnx"],
        "scratch": [root / "scratch" / n for n in ("out", "o.onnx", "r.json", "f.png", "a" * 300)],
    }
    (root / "scratch").mkdir()
    return root, user, paths


def _value(kind, paths):
    """Mostly plausible values (so that examples get past argument parsing), sometimes hostile ones."""
    if isinstance(kind, tuple):
        return st.one_of(st.sampled_from(kind[1]), st.sampled_from(kind[1]), st.text(max_size=8))
    if kind == INT:
        return st.one_of(st.integers(0, 8), st.integers(0, 8), st.integers(-3, 70),
                         st.sampled_from([2**31, 2**40, -2**63, 10**30])).map(str)
    if kind == FLOAT:
        return st.one_of(st.floats(0, 2, width=32).map(repr), st.floats(0, 2, width=32).map(repr),
                         st.floats(allow_nan=True, allow_infinity=True, width=32).map(repr),
                         st.sampled_from(["nan", "inf", "-inf", "1e308", "-1", "abc"]))
    if kind == TEXT:
        return st.one_of(st.sampled_from(["once upon a time", "Lily", "1", "1,8"]),
                         st.text(max_size=30), st.sampled_from(["\udcff", "id:abc", "id:-1", "\x00", ""]))
    if kind == "url":
        return st.one_of(st.sampled_from(["127.0.0.1:9", "127.0.0.1:1", "127.0.0.1:0", "127.0.0.1", "::::"]),
                         st.text(alphabet="0123456789:", max_size=8))
    if kind == "userpath":                   # serve: never a real repository (no server starts in the fuzz)
        return st.sampled_from(paths["user"]).map(str)
    pool = paths["user"] + paths["ours"] * 2 + (paths["scratch"] * 2 if kind == OUT else [])
    # random text as a path stays relative, so it lands in the zygote's cwd (the scratch folder), never
    # at an absolute path; an earlier fuzz run from the repository root committed three such outputs
    relative = st.text(max_size=10).map(lambda t: t.lstrip("/"))
    return st.one_of(st.sampled_from(pool).map(str), st.sampled_from(pool).map(str), relative)


@st.composite
def invocations(draw, paths):
    name = draw(st.sampled_from(sorted(OPTIONS)))
    positionals, options = OPTIONS[name]
    argv = []
    for kind in positionals:
        argv.append(kind if kind in ("repo", "check", "serve", "client") else draw(_value(kind, paths)))
    for flag, kind in options.items():
        if draw(st.integers(0, 3)) != 0:       # each option in one example of four
            continue
        argv += [flag] if kind == FLAG else [flag, draw(_value(kind, paths))]
    return name.split(" ")[0], argv


class Zygote:
    def __init__(self, cwd: Path):
        # cwd: a scratch folder, so that default outputs (build/<name>) land there, not in the project
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.cli.zygote", json.dumps(COMMANDS), str(ALARM_S),
                                      str(GRACE_S)], cwd=cwd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env)
        assert json.loads(self.proc.stdout.readline()) == {"ready": True}

    def run(self, command: str, argv: list[str]) -> dict:
        self.proc.stdin.write(json.dumps({"command": command, "argv": argv}) + "\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def zygote(world):
    z = Zygote(world[0] / "scratch")
    yield z
    z.close()


def _temporaries(root):
    return [p for p in root.rglob(".*") if ".tmp-" in p.name or ".work-" in p.name or ".old-" in p.name]


@pytest.mark.parametrize("part", range(3))
def test_fuzz_every_command(world, zygote, part):
    root, user, paths = world
    before = snapshot(user)

    @settings(max_examples=max(1, EXAMPLES // 3), deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(invocations(paths))
    def check(inv):
        command, argv = inv
        r = zygote.run(command, argv)
        event(f"exit {r['code']}")
        where = (command, argv, r["code"], r["err"][-3000:])
        assert r["code"] is not None, ("did not stop within GRACE_S of a SIGINT", *where)
        assert "Traceback" not in r["err"], where
        assert r["code"] in (0, 1, 2, 130), where
        if r["code"] in (1, 2):
            assert r["err"].startswith("error: ") or "NOT EQUAL" in r["out"], where
        fresh = user / "missing"            # a new path in the user's folder: an output may be written there
        if fresh.exists():
            assert str(fresh) in argv, ("wrote a path it was not given", *where)
            shutil.rmtree(fresh) if fresh.is_dir() else fresh.unlink()
        assert snapshot(user) == before, where
        assert _temporaries(root) == [], where
    check()
