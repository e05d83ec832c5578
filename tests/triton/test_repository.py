"""The model repository: every config.pbtxt parses into tritonclient's ModelConfig, the decoder
configs match their ONNX I/O exactly, the implicit-state mapping reproduces generation,
and writing is atomic with one-line errors. No server here (see test_server.py)."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from runtime.triton.repository import DECODER_ONNX, DECODER_TRT
from tests.triton.conftest import CAPACITY, REPO


def _config(repo: Path, model: str):
    from runtime.triton.repository import parse_config
    return parse_config((repo / model / "config.pbtxt").read_text())


def test_every_config_parses_into_modelconfig(triton_repo):
    from tritonclient.grpc import model_config_pb2 as pb
    configs = {p.parent.name: _config(triton_repo, p.parent.name) for p in triton_repo.glob("*/config.pbtxt")}
    assert sorted(configs) == ["decoder_onnx", "decoder_trt", "generate"]
    assert all(isinstance(c, pb.ModelConfig) for c in configs.values())
    ort, trt, gen = configs["decoder_onnx"], configs["decoder_trt"], configs["generate"]
    assert (ort.platform, trt.platform, gen.backend) == ("onnxruntime_onnx", "tensorrt_plan", "python")
    assert (triton_repo / "decoder_onnx/1/model.onnx").is_file() and (triton_repo / "decoder_trt/1/model.plan").is_file()
    assert (triton_repo / "generate/1/model.py").is_file() and (triton_repo / "generate/1/tokenizer.json").is_file()
    for c in (ort, trt):
        assert c.max_batch_size == 8 and c.WhichOneof("scheduling_choice") == "sequence_batching"
        assert len(c.sequence_batching.state) == 4                      # 2 layers x (key, value)
        for s in c.sequence_batching.state:
            assert list(s.dims) == [4, CAPACITY, 8] and s.initial_state[0].zero_data    # [H, S_max, D], zeros
    assert [g.kind for g in ort.instance_group] == [pb.ModelInstanceGroup.KIND_CPU]
    assert [g.kind for g in trt.instance_group] == [pb.ModelInstanceGroup.KIND_GPU]
    kinds = {c.name: c.control[0].kind for c in ort.sequence_batching.control_input}
    assert kinds == {"START": pb.ModelSequenceBatching.Control.CONTROL_SEQUENCE_START,
                     "READY": pb.ModelSequenceBatching.Control.CONTROL_SEQUENCE_READY}
    from runtime.triton.llm_tensors import INPUT_NAMES, OUTPUT_NAMES
    assert gen.max_batch_size == 0 and tuple(i.name for i in gen.input) == INPUT_NAMES
    assert tuple(o.name for o in gen.output) == OUTPUT_NAMES
    assert [list(i.dims) for i in gen.input if i.name in ("text_input", "max_tokens", "seed")] == [[1, 1]] * 3
    # the prompt is text_input or input_ids (a token-id prompt): the model refuses both or neither
    assert [(i.optional, list(i.dims)) for i in gen.input if i.name in ("text_input", "stop_words", "input_ids")] == \
        [(True, [1, 1]), (True, [1, -1]), (True, [1, -1])]


def test_decoder_configs_match_their_onnx_exactly(triton_repo):
    from runtime.triton.repository import check_repository, onnx_io, verify_config
    ort_io = onnx_io(triton_repo / "decoder_onnx/1/model.onnx")
    trt_io = onnx_io(triton_repo / "decoder_trt/1/source.onnx")
    assert verify_config(_config(triton_repo, "decoder_onnx"), ort_io) == []
    assert verify_config(_config(triton_repo, "decoder_trt"), trt_io) == []
    # spelled out: config inputs + controls + states are the ONNX inputs, outputs + states the outputs
    ort = _config(triton_repo, "decoder_onnx")
    seq = ort.sequence_batching
    assert ({i.name for i in ort.input} | {c.name for c in seq.control_input} | {s.input_name for s in seq.state}
            == set(ort_io.inputs))
    assert {o.name for o in ort.output} | {s.output_name for s in seq.state} == set(ort_io.outputs)
    assert list(ort.output[0].dims) == [-1, 320] and list(ort.input[0].dims) == [-1]
    assert list(ort.input[1].dims) == [1] and list(ort.input[1].reshape.shape) == []   # position: [batch]
    assert set(check_repository(triton_repo)) == {"decoder_onnx", "decoder_trt", "generate"}


def test_verify_config_names_every_mismatch(triton_repo):
    from tritonclient.grpc import model_config_pb2 as pb
    from runtime.triton.repository import onnx_io, verify_config
    io = onnx_io(triton_repo / "decoder_onnx/1/model.onnx")
    good = _config(triton_repo, "decoder_onnx")
    bad = copy.deepcopy(good)
    bad.output[0].dims[1] = 321                                   # wrong vocab
    bad.input[0].data_type = pb.TYPE_INT32                         # wrong dtype
    del bad.sequence_batching.state[3]                             # value_1 no longer a state
    bad.sequence_batching.state[0].initial_state[0].zero_data = False
    errors = "\n".join(verify_config(bad, io))
    for needle in ("output logits", "input input_ids: config.pbtxt says TYPE_INT32", "input value_1: in the ONNX",
                   "output present_value_1: in the ONNX", "state key_0: expected a zero initial state"):
        assert needle in errors, errors
    # the TensorRT config (no controls) against the ORT graph (with controls) is a mismatch too
    assert any("START" in e for e in verify_config(_config(triton_repo, "decoder_trt"), io))


def test_repository_graph_computes_what_the_build_graph_does(triton_repo, triton_build):
    """START / READY are appended as inputs and never read: same logits, same present caches."""
    import onnxruntime as ort
    from runtime.model_files import resolve_onnx
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    a = ort.InferenceSession(str(resolve_onnx(triton_build)), so, providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(str(triton_repo / "decoder_onnx/1/model.onnx"), so, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(0, 320, (2, 5)), "position": np.array([0, 3], np.int64)}
    for i in range(2):
        for n in (f"key_{i}", f"value_{i}"):
            feeds[n] = rng.standard_normal((2, 4, CAPACITY, 8)).astype(np.float32)
    out_a = a.run(None, feeds)
    out_b = b.run(None, {**feeds, "START": np.ones((2, 1), bool), "READY": np.ones((2, 1), bool)})
    for x, y in zip(out_a, out_b):
        np.testing.assert_array_equal(x, y)


def test_implicit_state_mapping_reproduces_generate(triton_repo, triton_build):
    """What the sequence batcher does with decoder_onnx, done by hand: the state starts at
    zero on START, each request feeds the state as key_i / value_i and keeps present_*;
    the client sends position = tokens already sent. Greedy tokens equal runtime.generate."""
    import onnxruntime as ort
    from runtime.generate import GenerationConfig, generate
    from runtime.model_files import load_tokenizer
    from runtime.ort_session import OrtSession
    tok = load_tokenizer(triton_build)
    prompt = tok.encode("Once upon a time there was").ids
    with OrtSession(triton_build, intra_op_threads=1) as s:
        want = generate(s, [prompt], GenerationConfig(max_new_tokens=12)).tokens[0]
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    sess = ort.InferenceSession(str(triton_repo / "decoder_onnx/1/model.onnx"), so, providers=["CPUExecutionProvider"])
    state = {n: np.zeros((1, 4, CAPACITY, 8), np.float32) for i in range(2) for n in (f"key_{i}", f"value_{i}")}
    names = [o.name for o in sess.get_outputs()]
    ids, position, got = prompt, 0, []
    for step in range(12):
        out = dict(zip(names, sess.run(None, {"input_ids": np.array([ids], np.int64), "position": np.array([position]),
                                             "START": np.array([[step == 0]]), "READY": np.ones((1, 1), bool), **state})))
        state = {n: out[f"present_{n}"] for n in state}
        position += len(ids)
        ids = [int(out["logits"][0, -1].argmax())]
        got.append(ids[0])
    assert got == want


def test_no_engine_means_no_tensorrt_model(triton_build, tmp_path):
    from runtime.triton import write_triton_repository
    repo = write_triton_repository(triton_build, tmp_path / "repo")
    assert sorted(p.name for p in repo.iterdir() if p.is_dir()) == ["decoder_onnx", "generate"]


def test_errors_are_one_line_and_leave_the_old_repository(triton_build, tmp_path, capsys):
    from runtime.triton.__main__ import main
    from runtime.triton import write_triton_repository
    repo = write_triton_repository(triton_build, tmp_path / "repo")
    before = sorted(str(p.relative_to(repo)) for p in repo.rglob("*"))
    broken = tmp_path / "broken"
    broken.mkdir()
    graph = triton_build / "model.fused.onnx" if (triton_build / "model.fused.onnx").is_file() \
        else triton_build / "model.onnx"
    (broken / "model.fused.onnx").write_bytes(graph.read_bytes())
    if graph.with_name(graph.name + ".data").is_file():      # its weights, under the name the graph gives them
        shutil.copyfile(graph.with_name(graph.name + ".data"), broken / f"{graph.name}.data")
    # no tokenizer.json: refused before anything is written; the old repository is untouched
    assert main(["repo", "--build", str(broken), "--out", str(repo)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "tokenizer.json" in err
    assert sorted(str(p.relative_to(repo)) for p in repo.rglob("*")) == before
    assert main(["repo", "--build", str(tmp_path / "missing"), "--out", str(tmp_path / "new")]) == 1
    assert "expected a build directory" in capsys.readouterr().err and not (tmp_path / "new").exists()
    (broken / "tokenizer.json").write_text("{}")
    (broken / "model.fused.onnx").write_bytes(b"garbage")
    assert main(["repo", "--build", str(broken), "--out", str(tmp_path / "new")]) == 1
    assert "expected an ONNX model" in capsys.readouterr().err and not (tmp_path / "new").exists()
    assert not list(tmp_path.glob(".new.*")) and not list(tmp_path.glob(".repo.*"))   # no temp leftovers


def test_repo_cli_passes_the_schedulers_prefill_settings_to_generate(triton_build, tmp_path, capsys):
    """--prefill-tokens / --prefill-chunk reach generate's config.pbtxt as the parameters its model gives
    runtime.scheduler.BatchScheduler; the defaults are the scheduler's own."""
    from runtime.scheduler import PREFILL_CHUNK, PREFILL_TOKENS
    from runtime.triton.__main__ import main
    assert main(["repo", "--build", str(triton_build), "--out", str(tmp_path / "set"), "--prefill-tokens", "300",
                 "--prefill-chunk", "64"]) == 0
    assert main(["repo", "--build", str(triton_build), "--out", str(tmp_path / "default")]) == 0
    for repo, want in (("set", ("300", "64")), ("default", (str(PREFILL_TOKENS), str(PREFILL_CHUNK)))):
        params = _config(tmp_path / repo, "generate").parameters
        assert (params["prefill_tokens"].string_value, params["prefill_chunk"].string_value) == want
    capsys.readouterr()
    assert main(["repo", "--build", str(triton_build), "--out", str(tmp_path / "bad"), "--prefill-chunk", "0"]) == 2
    assert "--prefill-chunk: 0 is out of range" in capsys.readouterr().err


def test_export_build_triton_repo_flag_writes_the_same_repository(triton_build, tmp_path):
    """python -m export.build --fuse --triton-repo DIR (the fixture passes it where supported)."""
    from tests.triton.conftest import export_build_has_triton_repo
    if not export_build_has_triton_repo():
        pytest.skip("export.build has no --triton-repo flag yet (see docs/triton.md)")
    from runtime.triton import write_triton_repository
    from runtime.triton.repository import check_repository
    built = triton_build.parent / "build_repo"
    assert set(check_repository(built)) == {"decoder_onnx", "generate"}
    mine = write_triton_repository(triton_build, tmp_path / "repo")
    for model in ("decoder_onnx", "generate"):
        assert (built / model / "config.pbtxt").read_text() == (mine / model / "config.pbtxt").read_text()


def test_serve_without_a_repository_is_one_line_error(tmp_path, capsys):
    from runtime.triton.__main__ import main
    assert main(["serve", "--repo", str(tmp_path / "nothing")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and "generate/config.pbtxt" in err


class _SequenceBatcher:
    """What Triton's sequence batcher does with decoder_onnx's config, in-process: checks each
    request against the config (dtype, dims after the batch axis), keeps one implicit state
    per sequence id (zeros on START), runs the repository's ONNX, frees the slot on END."""

    def __init__(self, repo: Path):
        import onnxruntime as ort
        from tritonclient.grpc import model_config_pb2 as pb
        self.config = _config(repo, "decoder_onnx")
        self.inputs = {i.name: (pb.DataType.Name(i.data_type)[5:], list(i.dims)) for i in self.config.input}
        so = ort.SessionOptions()
        so.intra_op_num_threads = 1
        self.session = ort.InferenceSession(str(repo / "decoder_onnx/1/model.onnx"), so, providers=["CPUExecutionProvider"])
        self.names = [o.name for o in self.session.get_outputs()]
        self.states: dict[int, dict] = {}

    def infer(self, model, inputs, outputs=None, sequence_id=0, sequence_start=False, sequence_end=False):
        assert model == "decoder_onnx" and sequence_id
        feeds = {}
        for t in inputs:
            dt, dims = self.inputs[t.name]
            assert t.datatype == dt and len(t.shape) == len(dims) + 1 and t.shape[0] == 1, (t.name, t.shape, dims)
            assert all(d == -1 or d == s for d, s in zip(dims, t.shape[1:])), (t.name, t.shape, dims)
            feeds[t.name] = t.array
        feeds["position"] = feeds["position"].reshape(1)                 # reshape { shape: [] }: [1, 1] -> [1]
        if sequence_start:
            self.states[sequence_id] = {s.input_name: np.zeros([1, *s.dims], np.float32)
                                        for s in self.config.sequence_batching.state}
        state = self.states[sequence_id]
        out = dict(zip(self.names, self.session.run(None, {**feeds, **state, "START": np.array([[sequence_start]]),
                                                              "READY": np.ones((1, 1), bool)})))
        for s in self.config.sequence_batching.state:
            state[s.input_name] = out[s.output_name]
        if sequence_end:
            del self.states[sequence_id]
        return type("Result", (), {"as_numpy": lambda self, name: out[name]})()


class _FakeModule:
    class InferInput:
        def __init__(self, name, shape, datatype):
            self.name, self.shape, self.datatype = name, list(shape), datatype

        def set_data_from_numpy(self, array):
            assert list(array.shape) == self.shape
            self.array = array

    class InferRequestedOutput:
        def __init__(self, name):
            self.name = name


def test_decoder_client_protocol_reproduces_generate(triton_repo, triton_build):
    """runtime.triton.client.decode_with_state against an in-process sequence batcher over
    decoder_onnx: two interleaved sequences each get runtime.generate's greedy tokens."""
    from runtime.generate import GenerationConfig, generate
    from runtime.model_files import load_tokenizer
    from runtime.ort_session import OrtSession
    from runtime.triton.client import decode_with_state
    tok = load_tokenizer(triton_build)
    prompts = [tok.encode(p).ids for p in ("Once upon a time", "Lily saw a big dog and she")]
    with OrtSession(triton_build, intra_op_threads=1) as s:
        want = [generate(s, [p], GenerationConfig(max_new_tokens=10)).tokens[0] for p in prompts]
    server = _SequenceBatcher(triton_repo)
    got = [decode_with_state(server, _FakeModule, p, 10, sequence_id=i + 1) for i, p in enumerate(prompts)]
    assert got == want and server.states == {}          # every sequence ended, its slot freed
    eos = want[0][3]
    early = decode_with_state(server, _FakeModule, prompts[0], 10, sequence_id=7, stop_tokens=(eos,))
    assert early == want[0][:want[0].index(eos) + 1] and server.states == {}


def test_engine_found_beside_the_graph_it_was_built_from(triton_build, tmp_path):
    """runtime.trt_engine names engines <graph stem>.<key>.engine; only one of the served graph is taken."""
    import shutil
    from runtime.model_files import resolve_onnx
    from runtime.triton import write_triton_repository
    build = tmp_path / "build"
    shutil.copytree(triton_build, build)
    graph = resolve_onnx(build)
    (build / f"{graph.stem}.0123abcd.engine").write_bytes(b"ftrt engine of the served graph")
    other = "model" if graph.name != "model.onnx" else "model.fused"
    (build / f"{other}.ffff0000.engine").write_bytes(b"ftrt engine of another graph")
    repo = write_triton_repository(build, tmp_path / "repo")
    assert (repo / "decoder_trt/1/model.plan").read_bytes() == b"ftrt engine of the served graph"


def test_a_quantized_build_is_cloned_not_read(triton_build, tmp_path, monkeypatch):
    """A --quantize build holds only model.int4.onnx (no fused graph beside it) with its weights in
    model.int4.onnx.data: the repository finds that graph, puts a file of its own with the .data file's
    bytes beside each graph that names it (a clone or an in-kernel copy, never a hard link: onnx's loader
    refuses a data file with two links), never loads the weights in Python, and its decoder graph
    computes what the build's does."""
    import onnx
    import onnxruntime as ort
    from export.options import BuildOptions
    from export.pipeline import build as export_build
    from export.quantize import QuantConfig
    from runtime.triton import write_triton_repository
    ckpt = triton_build.parent / "ckpt"
    build = tmp_path / "int4"
    export_build(ckpt, build, BuildOptions(True, quantize=QuantConfig("int4")), log=lambda *a: None)
    assert sorted(p.name for p in build.glob("model*")) == ["model.int4.onnx", "model.int4.onnx.data"]
    loads = []
    real_load = onnx.load
    monkeypatch.setattr(onnx, "load", lambda f, *a, **k: loads.append(k.get("load_external_data", True))
                        or real_load(f, *a, **k))
    repo = write_triton_repository(build, tmp_path / "repo", intra_op_threads=1, validate=False)
    assert loads and not any(loads)                                    # graphs read, weights never
    data = build / "model.int4.onnx.data"
    assert data.stat().st_nlink == 1
    for graph in (repo / "decoder_onnx/1/model.onnx", repo / "generate/1/model.int4.onnx"):
        copy = graph.parent / "model.int4.onnx.data"
        assert copy.stat().st_ino != data.stat().st_ino and copy.stat().st_nlink == 1
        assert copy.read_bytes() == data.read_bytes()
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    a = ort.InferenceSession(str(build / "model.int4.onnx"), so, providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(str(repo / "decoder_onnx/1/model.onnx"), so, providers=["CPUExecutionProvider"])
    feeds = {"input_ids": np.array([[5, 7, 9]]), "position": np.array([0], np.int64)}
    feeds.update({n: np.zeros((1, 4, CAPACITY, 8), np.float32) for i in range(2) for n in (f"key_{i}", f"value_{i}")})
    for x, y in zip(a.run(None, feeds), b.run(None, {**feeds, "START": np.ones((1, 1), bool),
                                                     "READY": np.ones((1, 1), bool)})):
        np.testing.assert_array_equal(x, y)


def test_a_quantized_build_serves_its_quantized_graph_in_onnx_runtime(triton_build, tmp_path):
    """A folder holding model.fused.onnx and model.int4.onnx (a fused build with the int4 graph put beside it; a
    --quantize build itself holds the int4 graph alone: test_a_quantized_build_is_cloned_not_read): the ONNX
    Runtime models (decoder_onnx, generate's ort backends) get the int4 graph, the one the user built to run,
    as runtime.generate does; an engine would come from the fused graph (resolve_onnx's TensorRT order)."""
    import onnx
    from core.onnx_writer import save_onnx
    from export.quantize import QuantConfig, quantize_weights
    from runtime.model_files import resolve_onnx
    from runtime.triton import write_triton_repository
    build = tmp_path / "build"
    shutil.copytree(triton_build, build, ignore=shutil.ignore_patterns("*.engine*"))
    int4, _ = quantize_weights(onnx.load(str(build / "model.fused.onnx")), QuantConfig("int4"))
    save_onnx(int4, build / "model.int4.onnx")
    assert resolve_onnx(build).name == "model.fused.onnx"
    repo = write_triton_repository(build, tmp_path / "repo", intra_op_threads=1)       # configs checked too
    assert json.loads((repo / "repository.json").read_text())["onnx"] == "model.int4.onnx"
    assert [p.name for p in (repo / "generate/1").glob("*.onnx")] == ["model.int4.onnx"]
    step = onnx.load(str(repo / "decoder_onnx/1/model.onnx"), load_external_data=False)
    assert any(n.op_type == "MatMulNBits" for n in step.graph.node)


STALL_AFTER_REPO = """
import os, time
import runtime.triton.repository as r
write = r.write_repository
def stalled(*a, **k):                       # the repository complete, the command not yet ended
    out = write(*a, **k)
    open(os.environ["REPO_WRITTEN"], "w").close()
    time.sleep(60)
    return out
r.write_repository = stalled
"""


def test_ctrl_c_after_the_triton_repo_is_written_names_it(tmp_path):
    """export.build --triton-repo interrupted once the repository was written (Ctrl-C: the whole process
    group): one line, naming the build and the repository as complete; it said 'complete: BUILD; nothing
    else was written' (and the child a second line of its own)."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from tests.triton.conftest import require
    require("tritonclient.grpc", "the Triton repository tests")
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(STALL_AFTER_REPO)
    written = tmp_path / "written"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path / "site"), str(REPO)]), REPO_WRITTEN=str(written))
    from tests.helpers import default_sigint, random_model, write_checkpoint
    ckpt = write_checkpoint(tmp_path / "ckpt", random_model(seed=0, n_layer=1, max_seq_len=32))
    build, repo = tmp_path / "b", tmp_path / "r"
    proc = subprocess.Popen([sys.executable, "-m", "export.build", "--fuse", "--target", "portable", "--checkpoint",
                             str(ckpt), "--out", str(build), "--triton-repo", str(repo)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=default_sigint)    # (a background job ignores SIGINT)
    try:
        deadline = time.time() + 240
        while not written.exists():
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)          # as a terminal's Ctrl-C: the command and its child
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-3000:]
    assert err.splitlines() == [f"error: interrupted; complete: {build}, {repo}; nothing else was written"], err
    from runtime.triton.repository import check_repository
    assert set(check_repository(repo)) == {"decoder_onnx", "generate"}


@pytest.fixture(scope="module")
def bf16_build(tmp_path_factory):
    """export.build --fuse --dtype bf16 of a tiny checkpoint."""
    from tests.cli.conftest import cli
    from tests.helpers import random_model, write_checkpoint
    root = tmp_path_factory.mktemp("bf16")
    ckpt = write_checkpoint(root / "ckpt", random_model(seed=0, n_layer=1, max_seq_len=32))
    built = cli("export.build", ["--fuse", "--checkpoint", ckpt, "--out", root / "build", "--dtype", "bf16"])
    assert built.code == 0, built.err[-3000:]
    return root / "build"


def test_a_bf16_build_is_refused_where_onnx_runtimes_cpu_would_run_it(bf16_build, tmp_path, capsys):
    """It has no bf16 kernels: `repo` wrote decoder_onnx on KIND_CPU and generate on ort-cpu, which the server
    cannot load, and `check` said ok. Now `repo` refuses in one line, and `check` loads what ONNX Runtime's
    CPU provider would load (a repository written before, or edited, fails there)."""
    from runtime.triton.__main__ import main
    assert main(["repo", "--build", str(bf16_build), "--out", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--kind gpu" in err[0], err
    assert "model.fused.onnx: expected a graph ONNX Runtime's CPU provider can run (decoder_onnx on --kind cpu and " \
        "generate on ort-cpu), found a bf16 graph" in err[0], err
    assert not (tmp_path / "r").exists()
    assert main(["repo", "--build", str(bf16_build), "--out", str(tmp_path / "r"), "--kind", "gpu"]) == 0
    assert "generate decodes with ort-cuda" in capsys.readouterr().out
    cfg = tmp_path / "r" / DECODER_ONNX / "config.pbtxt"
    cfg.write_text(cfg.read_text().replace("KIND_GPU", "KIND_CPU"))      # what repo wrote before
    assert main(["check", "--repo", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "decoder_onnx: model.onnx: ONNX Runtime's CPU provider cannot load it (Could not find an implementation " \
        "for" in err[0], err


def test_a_file_that_is_no_tensorrt_plan_is_refused_as_an_engine(triton_build, tmp_path, capsys):
    """--engine took a JSON file as a TensorRT engine and `check` said ok. A plan starts with TensorRT's tag
    (b'ftrt'); that is what can be checked here without TensorRT, and the lines say so."""
    from runtime.triton.__main__ import main
    (tmp_path / "e.json").write_text('{"not": "an engine"}\n')
    assert main(["repo", "--build", str(triton_build), "--out", str(tmp_path / "r"), "--engine",
                 str(tmp_path / "e.json")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: {tmp_path / 'e.json'}: expected a serialized TensorRT engine, found JSON text (it starts "
                   "b'{\"not\": ', not TensorRT's plan tag b'ftrt'); pass the engine the trt backend built (python -m "
                   "runtime.generate --backend trt), or leave --engine out"], err
    assert not (tmp_path / "r").exists()
    (tmp_path / "e.engine").write_bytes(b"ftrt stand-in")
    assert main(["repo", "--build", str(triton_build), "--out", str(tmp_path / "r"), "--engine",
                 str(tmp_path / "e.engine"), "--generate-backend", "ort-cpu"]) == 0
    capsys.readouterr()
    assert main(["check", "--repo", str(tmp_path / "r")]) == 0
    assert "model.plan: its TensorRT tag only" in capsys.readouterr().out
    (tmp_path / "r" / DECODER_TRT / "1" / "model.plan").write_text('{"not": "an engine"}\n')   # swapped afterwards
    assert main(["check", "--repo", str(tmp_path / "r")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "decoder_trt: model.plan: expected a serialized TensorRT engine, found JSON text" in err[0]


def test_a_repository_leaves_its_build_and_its_graphs_loadable(tmp_path):
    """export.build --triton-repo (and runtime.triton repo on the build) hard-linked the build's <graph>.data
    into the repository: onnx's external-data loader then refused the build's graph and the repository's
    alike ("multiple hard links, indicating a potential hardlink attack"), so export.verify of the build
    failed. Now both are loadable with their weights, and export.verify finds them equal."""
    import subprocess
    import sys
    import onnx
    from tests.helpers import random_model, write_checkpoint
    ckpt = write_checkpoint(tmp_path / "ckpt", random_model(seed=3, n_layer=2, max_seq_len=32))
    build, repo = tmp_path / "build", tmp_path / "repo"

    def run(*args):
        proc = subprocess.run([sys.executable, "-m", *map(str, args)], capture_output=True, text=True, cwd=REPO)
        assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
        return proc
    run("export.build", "--fuse", "--checkpoint", ckpt, "--out", build, "--triton-repo", repo)
    run("runtime.triton", "repo", "--build", build, "--out", tmp_path / "repo2")      # a second repository of it
    data = sorted(build.glob("*.onnx.data"))
    assert data and all(d.stat().st_nlink == 1 for d in data)
    graphs = [build / d.name[:-len(".data")] for d in data]
    for r in (repo, tmp_path / "repo2"):
        graphs += sorted(r.glob("*/1/*.onnx"))
    assert len(graphs) >= 5
    for graph in graphs:
        onnx.load(str(graph), load_external_data=True)
    served = repo / "generate" / "1" / graphs[0].name
    assert "EQUAL" in run("export.verify", graphs[0], served).stdout
