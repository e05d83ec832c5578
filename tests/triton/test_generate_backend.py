"""What the generate model decodes with (issue 25): auto picks trt where the repository has an
engine, else ort-cuda for GPU instances, else ort-cpu (always ort-cpu for a GroupQueryAttention
graph, export.build --target ort-cpu, which gets no decoder_trt); impossible choices are refused in one line; the choice lands in
generate's config.pbtxt and repository.json; generate's session on ort-cpu serves the batch
scheduler with runtime.generate's tokens, and a backend that cannot load here fails in one line.
The GPU paths (trt, ort-cuda) are marked gpu and skip here with a reason."""
from __future__ import annotations

import json
import os
import re
import shutil

import pytest

from runtime.triton.repository import RepositoryError, choose_generate_backend
from tests.triton.conftest import CAPACITY


def _params(repo) -> dict[str, str]:
    """generate's config.pbtxt parameters (read as text: no tritonclient needed)."""
    text = (repo / "generate/config.pbtxt").read_text()
    return dict(re.findall(r'parameters \{ key: "(\w+)" value \{ string_value: "([^"]*)" \} \}', text))


def _generate_kind(repo) -> str:
    return re.search(r"instance_group \[\s*\{ count: \d+ kind: (\w+)", (repo / "generate/config.pbtxt").read_text())[1]


def _manifest(repo) -> dict:
    return json.loads((repo / "repository.json").read_text())


def _engine(where, max_batch: int | None = None):
    """A stand-in engine file in runtime.trt_engine's naming, with a build record when max_batch is given."""
    from runtime.trt_engine import engine_info_path
    engine = where / "model.fused.0123abcd.engine"
    engine.write_bytes(b"ftrt stand-in engine (TensorRT's plan tag): never deserialized on the CPU")
    if max_batch is not None:
        engine_info_path(engine).write_text(json.dumps({"tensorrt": "11.4.0.106", "options": {"max_batch": max_batch}}))
    return engine


@pytest.mark.parametrize("engine, kind, ort_only, want", [
    (True, "cpu", False, "trt"), (True, "gpu", False, "trt"), (False, "gpu", False, "ort-cuda"),
    (False, "cpu", False, "ort-cpu"), (True, "gpu", True, "ort-cpu"), (False, "gpu", True, "ort-cpu")])
def test_auto_picks_the_engine_then_gpu_instances_then_the_cpu(engine, kind, ort_only, want, tmp_path):
    assert choose_generate_backend("auto", tmp_path / "e.engine" if engine else None, kind, ort_only) == want


@pytest.mark.parametrize("requested, engine, ort_only, message", [
    ("trt", False, False, "--generate-backend trt: expected a TensorRT engine of the build, found none; build one"),
    ("trt", True, True, "expected a portable graph, found ONNX Runtime's GroupQueryAttention (export.build --target ort-cpu"),
    ("ort-cuda", False, True, "use ort-cpu, or rebuild with --target portable"),
    ("tensorrt", False, False, "expected one of auto, trt, ort-cuda, ort-cpu")])
def test_impossible_choices_are_refused_in_one_line(requested, engine, ort_only, message, tmp_path):
    with pytest.raises(RepositoryError, match=re.escape(message)) as e:
        choose_generate_backend(requested, tmp_path / "e.engine" if engine else None, "gpu", ort_only)
    assert "\n" not in str(e.value)
    assert choose_generate_backend("ort-cpu", tmp_path / "e.engine", "gpu", ort_only) == "ort-cpu"   # always possible


def test_an_engine_means_trt_in_config_and_manifest(triton_build, tmp_path):
    from runtime.triton import write_triton_repository
    from runtime.triton.repository import ENGINE_PLAN
    from runtime.trt_engine import read_engine_info
    repo = write_triton_repository(triton_build, tmp_path / "repo", engine=_engine(tmp_path, max_batch=8))
    assert _params(repo)["decode_backend"] == "trt" and _params(repo)["engine"] == ENGINE_PLAN
    assert (repo / ENGINE_PLAN).is_file() and _generate_kind(repo) == "KIND_GPU"
    assert read_engine_info(repo / ENGINE_PLAN)["options"] == {"max_batch": 8}     # its record beside it
    assert _manifest(repo)["generate_backend"] == "trt" and _manifest(repo)["ort_only_graph"] is False
    with pytest.raises(RepositoryError, match=r"--slots 16: expected at most 8 \(the engine's max_batch"):
        write_triton_repository(triton_build, tmp_path / "r2", engine=_engine(tmp_path, max_batch=8), slots=16)


def test_gpu_instances_mean_ort_cuda_and_the_default_is_the_cpu(triton_build, tmp_path):
    from runtime.triton import write_triton_repository
    gpu = write_triton_repository(triton_build, tmp_path / "gpu", kind="gpu")
    assert _params(gpu)["decode_backend"] == "ort-cuda" and "engine" not in _params(gpu)
    assert _generate_kind(gpu) == "KIND_GPU" and _manifest(gpu)["generate_backend"] == "ort-cuda"
    cpu = write_triton_repository(triton_build, tmp_path / "cpu")
    assert _params(cpu)["decode_backend"] == "ort-cpu" and _generate_kind(cpu) == "KIND_CPU"
    forced = write_triton_repository(triton_build, tmp_path / "forced", engine=_engine(tmp_path),
                                     generate_backend="ort-cpu")
    assert _params(forced)["decode_backend"] == "ort-cpu" and (forced / "decoder_trt").is_dir()


@pytest.fixture
def gqa_build(triton_build, tmp_path):
    """The build, linked, its graph carrying the mark graph_passes/ort_attention.py leaves in a
    GroupQueryAttention graph (what the repository reads; the ops do not matter here), an engine beside it."""
    from core.contract import load_onnx
    from core.onnx_writer import save_onnx
    from runtime.model_files import ORT_ONLY_MARK, resolve_onnx
    build = tmp_path / "gqa_build"
    shutil.copytree(triton_build, build, copy_function=os.link)
    graph = resolve_onnx(build)
    proto = load_onnx(graph, load_weights=False)     # the graph alone: its weights stay in the linked .data file
    proto.metadata_props.add(key=ORT_ONLY_MARK[0], value=ORT_ONLY_MARK[1])
    graph.unlink()                                   # a link to the shared build's file: replaced, not written through
    save_onnx(proto, graph)
    _engine(build)
    return build


def test_a_gqa_build_gets_no_tensorrt_model_and_decodes_on_the_cpu(gqa_build, tmp_path, capsys):
    from runtime.triton import write_triton_repository
    from runtime.triton.__main__ import main
    repo = write_triton_repository(gqa_build, tmp_path / "repo", kind="gpu")     # the engine beside it is ignored
    assert sorted(p.name for p in repo.iterdir() if p.is_dir()) == ["decoder_onnx", "generate"]
    assert _params(repo)["decode_backend"] == "ort-cpu" and _manifest(repo)["ort_only_graph"] is True
    assert _manifest(repo)["generate_backend"] == "ort-cpu"
    with pytest.raises(RepositoryError, match="GroupQueryAttention .*; leave --engine out"):
        write_triton_repository(gqa_build, tmp_path / "r2", engine=_engine(tmp_path))
    for backend in ("trt", "ort-cuda"):
        assert main(["repo", "--build", str(gqa_build), "--out", str(tmp_path / "r3"), "--generate-backend", backend]) == 1
        err = capsys.readouterr().err
        assert err.startswith(f"error: --generate-backend {backend}: ") and err.count("\n") == 1 and "--target portable" in err
    assert not (tmp_path / "r2").exists() and not (tmp_path / "r3").exists()


def test_cli_option_and_its_refusal(triton_build, tmp_path, capsys):
    from runtime.triton.__main__ import main
    assert main(["repo", "--build", str(triton_build), "--out", str(tmp_path / "repo"), "--kind", "gpu"]) == 0
    assert "generate decodes with ort-cuda" in capsys.readouterr().out
    assert main(["repo", "--build", str(triton_build), "--out", str(tmp_path / "new"), "--generate-backend", "trt"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--generate-backend trt: expected a TensorRT engine" in err and "--engine FILE" in err
    assert not (tmp_path / "new").exists()


def test_trt_session_takes_a_given_engine_and_its_record(tmp_path, triton_build):
    """TrtSession(engine=FILE) needs no tensorrt until activate: it reads the record's options."""
    from runtime.model_files import resolve_onnx
    from runtime.trt_session import TrtSession
    s = TrtSession(resolve_onnx(triton_build), engine=_engine(tmp_path, max_batch=4))
    assert s.options.max_batch == 4 and s.engine_file.path.name.endswith(".engine")
    assert TrtSession(resolve_onnx(triton_build), engine=tmp_path / "none.plan").options.max_batch == 8   # no record


# --- the generate model's decode session -----------------------------------------------------

def _scheduled(session, prompts, cfg, slots: int, max_queued: int):
    """Every prompt through the batch scheduler over `session` (deactivated after): the sequences and the
    scheduler's stats."""
    from runtime.scheduler import BatchScheduler
    try:
        scheduler = BatchScheduler(session, slots=slots, max_queued=max_queued)
        seqs = [scheduler.submit(p, cfg) for p in prompts]
        while not all(s.done.is_set() for s in seqs):
            scheduler.step()
        return seqs, scheduler.stats()
    finally:
        session.deactivate()


def test_generate_on_the_cpu_batches_with_solo_tokens(triton_build, tmp_path):
    """generate's session (ort-cpu, from its config) under the batch scheduler: 6 prompts through
    3 slots, each equal to runtime.generate alone (greedy, up to a tie)."""
    from runtime.generate import GenerationConfig, generate
    from runtime.ort_session import OrtSession
    from runtime.triton import write_triton_repository
    from runtime.triton.python_model import open_decode_session
    from tests.runtime.greedy import compare_greedy
    repo = write_triton_repository(triton_build, tmp_path / "repo", intra_op_threads=1)
    prompts = [[5, 17, 42], [7, 99, 3, 250, 11], [200], [31, 41, 59, 26], [8, 8], [1, 2, 3, 4, 5, 6]]
    cfg = GenerationConfig(max_new_tokens=10, keep_logits=True)
    with OrtSession(triton_build, intra_op_threads=1) as alone:
        want = [generate(alone, [p], cfg) for p in prompts]
    session, line = open_decode_session(repo / "generate/1", _params(repo))
    assert line.startswith("generate: decoding with ort-cpu (ONNX Runtime CPUExecutionProvider")
    seqs, stats = _scheduled(session, prompts, cfg, slots=3, max_queued=6)
    assert stats.peak_running == 3
    for seq, w in zip(seqs, want):
        assert compare_greedy(w.tokens[0], [row[0] for row in w.logits], seq.tokens, seq.logits) > 0


def test_a_repository_from_before_the_option_decodes_on_the_cpu(triton_build, tmp_path):
    from runtime.triton import write_triton_repository
    from runtime.triton.python_model import open_decode_session
    repo = write_triton_repository(triton_build, tmp_path / "repo", intra_op_threads=1)
    params = {k: v for k, v in _params(repo).items() if k != "decode_backend"}
    session, line = open_decode_session(repo / "generate/1", params)
    session.deactivate()
    assert "decoding with ort-cpu" in line


def _can_load(backend: str) -> bool:
    import importlib.util
    if backend == "trt":
        return importlib.util.find_spec("tensorrt") is not None
    import onnxruntime as ort
    return "CUDAExecutionProvider" in ort.get_available_providers()


@pytest.mark.parametrize("backend", ["trt", "ort-cuda"])
def test_a_backend_that_cannot_load_fails_in_one_line(backend, triton_build, tmp_path):
    """No silent fallback to the CPU: initialize fails naming the backend, why, and the fix."""
    if _can_load(backend):
        pytest.skip(f"{backend} can load here: the GPU test covers it")
    from runtime.session import RuntimeUserError
    from runtime.triton import write_triton_repository
    from runtime.triton.python_model import open_decode_session
    repo = write_triton_repository(triton_build, tmp_path / "repo", engine=_engine(tmp_path), kind="gpu",
                                   generate_backend=backend)
    with pytest.raises(RuntimeUserError) as e:
        open_decode_session(repo / "generate/1", _params(repo))
    message = str(e.value)
    assert message.startswith(f"generate: decode backend {backend} cannot load here (") and "\n" not in message
    assert message.endswith("--generate-backend ort-cpu") and "pip install" in message


# --- on a GPU --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpu_build(tmp_path_factory):
    """A build of a tiny random model (export_onnx: no tritonclient or graphsurgeon needed), in its own folder:
    a TensorRT engine is built beside its graph. Skipped before the build where there is no GPU."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)")
    from tests.helpers import random_model, write_checkpoint
    from tests.runtime.conftest import make_build
    root = tmp_path_factory.mktemp("gpu_generate")
    ckpt = write_checkpoint(root / "ckpt", random_model(seed=4, max_seq_len=CAPACITY))
    return make_build(ckpt, root / "build", use_export_build=False)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["trt", "ort-cuda"])
def test_generate_on_the_gpu_batches_with_the_cpus_tokens(backend, gpu_build, tmp_path):
    """The repository's GPU choice (trt: auto with an engine built beside the graph; ort-cuda: auto with
    --kind gpu) under the batch scheduler: every sequence equals ORT CPU's runtime.generate alone."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)")
    if not _can_load(backend):
        pytest.skip("tensorrt is not importable (pip install 'tapernorm-deploy[tensorrt]')" if backend == "trt" else
                    "onnxruntime-gpu (CUDAExecutionProvider) is not installed: pip install 'tapernorm-deploy[gpu]'")
    from runtime.generate import GenerationConfig, generate
    from runtime.ort_session import OrtSession
    from runtime.triton import write_triton_repository
    from runtime.triton.python_model import open_decode_session
    from runtime.trt_engine import BuildOptions
    from runtime.trt_session import TrtSession
    from tests.runtime.greedy import compare_greedy
    build = tmp_path / "build"                        # linked: an engine built here stays in this test
    shutil.copytree(gpu_build, build, copy_function=os.link)
    if backend == "trt":
        with TrtSession(build, options=BuildOptions(max_batch=4)):          # builds the engine beside the graph
            pass
    repo = write_triton_repository(build, tmp_path / "repo", kind="gpu", max_batch_size=4)
    assert _params(repo)["decode_backend"] == backend
    prompts = [[5, 17, 42], [7, 99, 3, 250, 11], [200], [31, 41, 59, 26], [8, 8], [1, 2, 3, 4, 5, 6]]
    cfg = GenerationConfig(max_new_tokens=12, keep_logits=True)
    with OrtSession(gpu_build) as alone:
        want = [generate(alone, [p], cfg) for p in prompts]
    session, line = open_decode_session(repo / "generate/1", _params(repo))
    assert f"decoding with {backend}" in line
    seqs, _ = _scheduled(session, prompts, cfg, slots=4, max_queued=6)
    for seq, w in zip(seqs, want):
        assert seq.error is None, seq.error
        assert compare_greedy(w.tokens[0], [row[0] for row in w.logits], seq.tokens, seq.logits) > 0


@pytest.fixture(scope="module")
def sliding_build(tmp_path_factory):
    """A Gemma-3-architecture build (sandwich and QK-norms, sliding-window layers of 4 keys, a local rope base):
    export.build's default graph, GroupQueryAttention with each sliding layer's local window."""
    import subprocess
    import sys
    from tests.helpers import random_model, write_checkpoint
    from tests.triton.conftest import REPO, require
    require("tritonclient.grpc", "the Triton repository tests")
    root = tmp_path_factory.mktemp("sliding")
    model = random_model(seed=4, norm="rmsnorm", pos_embedding="rope", mlp="swiglu", d_model=32, n_head=2,
                         n_layer=2, max_seq_len=64, norm_layout="sandwich", qk_norm="head", sliding_window=4,
                         sliding_layers=[0], local_rope_theta=100.0)
    ckpt = write_checkpoint(root / "ckpt", model)
    proc = subprocess.run([sys.executable, "-m", "export.build", "--fuse", "--checkpoint", str(ckpt), "--out",
                           str(root / "build")], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return root / "build"


def test_a_sliding_window_model_batches_in_the_scheduler_with_solo_tokens(sliding_build, tmp_path):
    """The families' sliding-window layers in the generate model: rows at different positions, past the window
    (4) and its prompt, each equal to runtime.generate alone. The cache holds every slot (the window is a mask of
    the attention, GroupQueryAttention's local_window_size), so a row's slots need nothing of the scheduler."""
    import onnx
    from runtime.generate import GenerationConfig, generate
    from runtime.ort_session import OrtSession
    from runtime.triton import write_triton_repository
    from runtime.triton.python_model import open_decode_session
    from tests.runtime.greedy import compare_greedy
    graph = onnx.load(str(sliding_build / "model.fused.onnx"), load_external_data=False)
    windows = [a.i for n in graph.graph.node if n.op_type == "GroupQueryAttention" for a in n.attribute
               if a.name == "local_window_size"]
    assert windows == [4]
    repo = write_triton_repository(sliding_build, tmp_path / "repo", intra_op_threads=1)
    prompts = [[5, 17, 42], [7, 99, 3, 250, 11, 4, 9], [200], [31, 41, 59, 26, 5, 3]]
    cfg = GenerationConfig(max_new_tokens=12, keep_logits=True)
    with OrtSession(sliding_build, intra_op_threads=1) as alone:
        want = [generate(alone, [p], cfg) for p in prompts]
    session, _ = open_decode_session(repo / "generate/1", _params(repo))
    seqs, _ = _scheduled(session, prompts, cfg, slots=3, max_queued=4)
    for seq, w in zip(seqs, want):
        assert compare_greedy(w.tokens[0], [row[0] for row in w.logits], seq.tokens, seq.logits) >= 8
