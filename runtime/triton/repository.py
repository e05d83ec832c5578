"""A Triton model repository from a build directory (export.build), written atomically.

    REPO/
      decoder_onnx/config.pbtxt     platform onnxruntime_onnx: one decode step, KV cache as
      decoder_onnx/1/model.onnx     sequence_batching implicit state; the build's fused graph (a
                                    --quantize build's quantized one: what ONNX Runtime runs of it)
                                    plus two unused control inputs START, READY (bool [batch, 1])
      decoder_trt/config.pbtxt      platform tensorrt_plan (only where an engine was built):
      decoder_trt/1/model.plan      the same contract; no controls (the engine has no such inputs);
                                    both optimization profiles (decode, prefill) in instance_group
      generate/config.pbtxt         backend python, decoupled: text_input -> text_output (Triton's LLM
      generate/1/model.py           tensors, llm_tensors.py), streamed or whole, by runtime/scheduler.py over a decode session of the
                                    backend its parameters name (GENERATE_BACKENDS; decoder_trt's
                                    engine for trt)
      generate/1/model.fused.onnx   (model.int4/int8.onnx in a --quantize build; model.onnx where the
                                    build has no fused graph); TensorRT's engine comes from the fused one
      generate/1/tokenizer.json
      generate/1/chat_template.json (where the build has one: the model's chat template, core/chat_template.py)
      generate/1/generation.json    (where the build has one: the model's stop tokens, core/generation.py)

The decoder configs map the ONNX decode-step contract onto Triton (max_batch_size > 0,
so Triton owns the batch axis and every dims below leaves it out):

    input_ids  int64 [batch, seq]        input  dims [-1]
    position   int64 [batch]             input  dims [1], reshape { shape: [] }
                                         (the client sends the number of tokens it has
                                         already sent in this sequence: 0 with START)
    key_i      float [batch, H, S, D]    state  input_name key_i  output_name present_key_i
    value_i    float [batch, H, S, D]    state  dims [H, S, D], zero initial state
    START      bool  [batch, 1]          control CONTROL_SEQUENCE_START (resets the state)
    READY      bool  [batch, 1]          control CONTROL_SEQUENCE_READY
    logits     float [batch, seq, V]     output dims [-1, V]

`verify_config` checks a config against the I/O of the ONNX it serves, name by name.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from core.build_files import TOKENIZER
from core.generation import MODEL_FILES
from core.contract import (CACHE_PREFIX, INPUT_IDS, LOGITS, POSITION, ContractError, cache_names,
                           external_files, load_onnx, onnx_io as _proto_io, present_name, read_contract)
from core.errors import NO_ROOM
from core.outputs import TRITON_REPOSITORY, output_dir
from runtime.model_files import ORT_ONLY_GRAPH, is_ort_only, resolve_onnx
from runtime.scheduler import PREFILL_CHUNK, PREFILL_TOKENS
from runtime.session import MissingExtraError, ModelFileError, RuntimeUserError
from runtime.trt_engine import (DECODE_PROFILE, PREFILL_PROFILE, engine_info_path, plan_problem,
                                read_engine_info)

DECODER_ONNX, DECODER_TRT, GENERATE = "decoder_onnx", "decoder_trt", "generate"
CONTROLS = {"START": "CONTROL_SEQUENCE_START", "READY": "CONTROL_SEQUENCE_READY"}
# ONNX TensorProto element type -> Triton data type
ONNX_TO_TRITON = {1: "TYPE_FP32", 10: "TYPE_FP16", 16: "TYPE_BF16", 3: "TYPE_INT8", 6: "TYPE_INT32", 7: "TYPE_INT64",
                  9: "TYPE_BOOL"}
KINDS = {"cpu": "KIND_CPU", "gpu": "KIND_GPU"}
IDLE_US = 60_000_000          # a sequence with no request for 60 s releases its state slot
DEFAULT_MAX_NEW_TOKENS = 32   # runtime.generate's default
DEFAULT_SLOTS = 8             # generate: sequences decoded together (the scheduler's cache slot pool)
DEFAULT_MAX_QUEUED = 32       # generate: requests waiting for a slot before "server busy"
# what generate decodes with: name -> (runtime.backends name, device); "auto" picks one (choose_generate_backend)
GENERATE_BACKENDS = {"trt": ("trt", "cuda"), "ort-cuda": ("ort", "cuda"), "ort-cpu": ("ort", "cpu")}
AUTO = "auto"
ENGINE_PLAN = f"{DECODER_TRT}/1/model.plan"     # the engine generate's trt backend runs (relative to the repository)


class RepositoryError(RuntimeUserError):
    """The build cannot be turned into a repository, or a config disagrees with its model."""


# --- the ONNX side ------------------------------------------------------------------------

@dataclass(frozen=True)
class OnnxTensor:
    name: str
    elem_type: int
    dims: tuple[int, ...]       # -1 for a dynamic axis


@dataclass
class OnnxIO:
    inputs: dict[str, OnnxTensor] = field(default_factory=dict)
    outputs: dict[str, OnnxTensor] = field(default_factory=dict)

    def n_layer(self) -> int:
        return sum(1 for n in self.inputs if n.startswith(CACHE_PREFIX))


def _graph_of(path: str | Path):
    """The graph without its weights (external ones stay in their file); a broken file is one RepositoryError."""
    try:
        return load_onnx(path, load_weights=False)
    except ContractError as e:
        raise RepositoryError(str(e)) from None


def onnx_io(path: str | Path) -> OnnxIO:
    """Graph inputs and outputs (weights not loaded)."""
    return _io_of(_graph_of(path))


def _io_of(proto) -> OnnxIO:
    def tensors(values):
        return {n: OnnxTensor(n, t, tuple(d if isinstance(d, int) and d > 0 else -1 for d in dims))
                for n, (dims, t) in values.items()}
    ins, outs = _proto_io(proto)
    # an input with a default (an initializer too: the contract's logits_from) is no Triton input: ONNX Runtime
    # lists it among the overridable initializers, not the inputs, and its backend runs the default
    defaults = {t.name for t in proto.graph.initializer}
    return OnnxIO(tensors({n: v for n, v in ins.items() if n not in defaults}), tensors(outs))


def _check_contract(where: Path, io: OnnxIO) -> None:
    """The decode-step contract (core.contract) plus what Triton needs: known types, a dynamic batch axis."""
    def as_io(tensors):
        return {n: (list(t.dims), t.elem_type) for n, t in tensors.items()}
    try:
        read_contract(where, as_io(io.inputs), as_io(io.outputs))
    except ContractError as e:
        raise RepositoryError(str(e)) from None
    for t in list(io.inputs.values()) + list(io.outputs.values()):
        if t.elem_type not in ONNX_TO_TRITON:
            raise RepositoryError(f"{where}: tensor {t.name} has ONNX element type {t.elem_type}; expected one of "
                                  f"{sorted(ONNX_TO_TRITON)} (fp32/fp16/bf16/int8/int32/int64/bool)")
        if not t.dims or t.dims[0] != -1:
            raise RepositoryError(f"{where}: tensor {t.name} has dims {list(t.dims)}; expected a dynamic batch axis first")


def add_control_inputs(src: Path, dst: Path) -> OnnxIO:
    """Copy the graph with START and READY (bool [batch, 1]) appended as graph inputs.

    The ONNX Runtime backend requires every configured sequence control to be a model
    input of dims [1] after the batch axis. The graph never reads them: the implicit
    state is reset to its zero initial state by Triton on START, and a request only
    reaches the model for a ready sequence.
    """
    from onnx import TensorProto, helper
    proto = _graph_of(src)         # external weights: cloned below, not read
    batch = proto.graph.input[0].type.tensor_type.shape.dim[0]
    inputs = {i.name for i in proto.graph.input}
    for name in (c for c in CONTROLS if c not in inputs):
        proto.graph.input.append(helper.make_tensor_value_info(name, TensorProto.BOOL, [batch.dim_param or None, 1]))
    from core.onnx_writer import save_onnx
    save_onnx(proto, dst)
    _link_external_data(proto, src, dst)
    return _io_of(proto)


# --- config.pbtxt text --------------------------------------------------------------------

def _dims(d) -> str:
    return "[ " + ", ".join(str(x) for x in d) + " ]" if len(d) else "[ ]"


def _tensor(name: str, data_type: str, dims, reshape=None, optional: bool = False) -> str:
    s = f'  {{\n    name: "{name}"\n    data_type: {data_type}\n    dims: {_dims(dims)}\n'
    if reshape is not None:
        s += f"    reshape: {{ shape: {_dims(reshape)} }}\n"
    if optional:
        s += "    optional: true\n"
    return s + "  }"


def decoder_config(name: str, platform: str, io: OnnxIO, max_batch_size: int, instances: int, kind: str,
                   same_buffer: bool = False, profiles: tuple[int, ...] = ()) -> str:
    """config.pbtxt of one decode step with the KV cache as implicit state (see the module docstring).

    profiles: the TensorRT optimization profiles the instances may use. Triton takes only
    the first one when instance_group names none (model_config.proto, ModelInstanceGroup
    .profile), and our engine's profile 0 is decode (T = 1): prefill needs profile 1.
    """
    ids, pos, logits = io.inputs[INPUT_IDS], io.inputs[POSITION], io.outputs[LOGITS]
    controls = [c for c in CONTROLS if c in io.inputs]
    group = f"count: {instances} kind: {KINDS[kind]}"
    if profiles:
        group += " profile: [ " + ", ".join(f'"{p}"' for p in profiles) + " ]"
    lines = [f'name: "{name}"', f'platform: "{platform}"', f"max_batch_size: {max_batch_size}",
             "input [",
             ",\n".join([_tensor(INPUT_IDS, ONNX_TO_TRITON[ids.elem_type], ids.dims[1:]),
                         _tensor(POSITION, ONNX_TO_TRITON[pos.elem_type], [1], reshape=pos.dims[1:])]),
             "]", "output [", _tensor(LOGITS, ONNX_TO_TRITON[logits.elem_type], logits.dims[1:]), "]",
             "instance_group [", f"  {{ {group} }}", "]",
             "sequence_batching {",
             f"  max_sequence_idle_microseconds: {IDLE_US}",
             # oldest: batch steps of up to max_batch_size sequences; only same-shape requests batch
             f"  oldest {{ max_candidate_sequences: {max_batch_size} max_queue_delay_microseconds: 0 }}"]
    if controls:
        items = [f'    {{\n      name: "{c}"\n      control [ {{ kind: {CONTROLS[c]} bool_false_true: [ false, true ] }} ]\n    }}'
                 for c in controls]
        lines += ["  control_input [", ",\n".join(items), "  ]"]
    items = []
    for cache in cache_names(io.n_layer()):
        t = io.inputs[cache]
        dt, dims = ONNX_TO_TRITON[t.elem_type], _dims(t.dims[1:])
        item = ["    {", f'      input_name: "{cache}"', f'      output_name: "{present_name(cache)}"',
                f"      data_type: {dt}", f"      dims: {dims}"]
        if same_buffer:   # one state buffer in Triton; see docs/runtime.md for what the backend still copies
            item.append("      use_same_buffer_for_input_output: true")
        item += [f'      initial_state {{ name: "zeros" data_type: {dt} dims: {dims} zero_data: true }}', "    }"]
        items.append("\n".join(item))
    lines += ["  state [", ",\n".join(items), "  ]", "}"]
    return "\n".join(lines) + "\n"


def generate_config(name: str, instances: int, max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
                    intra_op_threads: int = 0, slots: int = DEFAULT_SLOTS, max_queued: int = DEFAULT_MAX_QUEUED,
                    backend: str = "ort-cpu", prefill_tokens: int = PREFILL_TOKENS,
                    prefill_chunk: int = PREFILL_CHUNK) -> str:
    """config.pbtxt of the Python-backend generation model: one request = one prompt, decoupled, with the
    tensors of Triton's LLM conventions (runtime/triton/llm_tensors.py: text_input, max_tokens, ... ->
    text_output, output_ids, ...; responses streamed by the model's batch scheduler; slots and max_queued size its pool, prefill_tokens and
    prefill_chunk are its prefill budget per step and longest piece of one prompt (runtime/scheduler.py); backend,
    one of GENERATE_BACKENDS, is what it decodes with: KIND_GPU instances unless ort-cpu."""
    from runtime.triton.llm_tensors import INPUTS, OUTPUTS     # Triton's LLM conventions (see that module)
    inputs = ",\n".join(_tensor(n, f"TYPE_{dt}", list(dims), optional=opt) for n, dt, dims, opt in INPUTS)
    outputs = ",\n".join(_tensor(n, f"TYPE_{dt}", list(dims)) for n, dt, dims in OUTPUTS)
    params = {"max_new_tokens": str(max_new_tokens), "intra_op_threads": str(intra_op_threads),
              "slots": str(slots), "max_queued": str(max_queued), "prefill_tokens": str(prefill_tokens),
              "prefill_chunk": str(prefill_chunk), "decode_backend": backend,
              **({"engine": ENGINE_PLAN} if backend == "trt" else {})}
    kind = KINDS["cpu" if backend == "ort-cpu" else "gpu"]        # where its decode session runs
    lines = [f'name: "{name}"', 'backend: "python"', "max_batch_size: 0",
             "model_transaction_policy { decoupled: true }", "input [", inputs, "]",
             "output [", outputs, "]",
             "instance_group [", f"  {{ count: {instances} kind: {kind} }}", "]"]
    lines += [f'parameters {{ key: "{k}" value {{ string_value: "{v}" }} }}' for k, v in params.items()]
    return "\n".join(lines) + "\n"


GENERATE_MODEL_PY = '''"""Triton Python-backend model (decoupled): text_input -> text_output, streamed or whole, by
tapernorm-deploy's batch scheduler over its runtime (the backend config.pbtxt names).

The code lives in runtime/triton/python_model.py: the server's Python must import
tapernorm-deploy. The backend stub runs the first python3 on the server's PATH (its venv
included) in isolated mode, which ignores PYTHONPATH; the entries of PYTHONPATH are
therefore added here, so a source checkout on PYTHONPATH works too.
"""
import os
import sys

for _p in reversed(os.environ.get("PYTHONPATH", "").split(os.pathsep)):
    if _p and _p not in sys.path:
        sys.path.insert(0, _p)

from runtime.triton.python_model import TritonPythonModel  # noqa: E402,F401
'''


# --- checking a config --------------------------------------------------------------------

def have_tritonclient() -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec("tritonclient.grpc.model_config_pb2") is not None
    except ModuleNotFoundError:  # tritonclient itself is absent
        return False


def parse_config(text: str, where="config.pbtxt"):
    """ModelConfig protobuf from config.pbtxt text (needs tritonclient); raises RepositoryError."""
    try:
        from google.protobuf import text_format
        from tritonclient.grpc import model_config_pb2
    except ImportError:
        raise MissingExtraError("runtime.triton check", "triton", "tritonclient.grpc") from None
    try:
        return text_format.Parse(text, model_config_pb2.ModelConfig())
    except text_format.ParseError as e:
        raise RepositoryError(f"{where}: expected a ModelConfig in protobuf text format, found an error "
                              f"({' '.join(str(e).split())}); fix it or write the repository again") from None


def verify_config(config, io: OnnxIO) -> list[str]:
    """Every way a decoder ModelConfig disagrees with the ONNX it serves ([] when they match exactly).

    Inputs + control inputs + state inputs must be exactly the ONNX inputs, outputs +
    state outputs exactly the ONNX outputs; data types equal; dims (or reshape) equal the
    ONNX dims without the batch axis, -1 where the ONNX axis is dynamic.
    """
    from tritonclient.grpc import model_config_pb2 as pb
    dtype = lambda v: pb.DataType.Name(v)  # noqa: E731
    errors: list[str] = []
    if config.max_batch_size < 1:
        errors.append(f"max_batch_size is {config.max_batch_size}; expected >= 1 (the ONNX has a batch axis)")
    seq = config.sequence_batching
    expected_in = {t.name: (dtype(t.data_type), tuple(t.reshape.shape) if t.HasField("reshape") else tuple(t.dims))
                   for t in config.input}
    for c in seq.control_input:
        if len(c.control) != 1:
            errors.append(f"control input {c.name}: expected one control, found {len(c.control)}")
            continue
        ctl = c.control[0]
        dt = dtype(ctl.data_type) if ctl.data_type else (
            "TYPE_BOOL" if ctl.bool_false_true else "TYPE_INT32" if ctl.int32_false_true else "TYPE_FP32")
        expected_in[c.name] = (dt, (1,))
    expected_out = {t.name: (dtype(t.data_type), tuple(t.dims)) for t in config.output}
    for s in seq.state:
        expected_in[s.input_name] = (dtype(s.data_type), tuple(s.dims))
        expected_out[s.output_name] = (dtype(s.data_type), tuple(s.dims))
        inits = list(s.initial_state)            # repeated in the schema; we write one
        if not (len(inits) == 1 and inits[0].zero_data and tuple(inits[0].dims) == tuple(s.dims)
                and inits[0].data_type == s.data_type):
            errors.append(f"state {s.input_name}: expected a zero initial state of the state's type and dims")
    for side, want, have in (("input", expected_in, io.inputs), ("output", expected_out, io.outputs)):
        errors += [f"{side} {name}: in config.pbtxt, not in the ONNX" for name in sorted(set(want) - set(have))]
        errors += [f"{side} {name}: in the ONNX, not in config.pbtxt" for name in sorted(set(have) - set(want))]
        for name in sorted(set(want) & set(have)):
            dt, dims = want[name]
            t = have[name]
            if ONNX_TO_TRITON.get(t.elem_type) != dt:
                errors.append(f"{side} {name}: config.pbtxt says {dt}, the ONNX has {ONNX_TO_TRITON.get(t.elem_type, t.elem_type)}")
            if t.dims[:1] != (-1,) or tuple(t.dims[1:]) != dims:
                errors.append(f"{side} {name}: config.pbtxt dims {list(dims)} (batch axis implied), "
                              f"the ONNX has {list(t.dims)}")
    return errors


def check_repository(repo: str | Path, load: bool = True) -> dict[str, object]:
    """Parse every config.pbtxt into ModelConfig and verify each decoder config against its ONNX, and load
    what the server would load where this machine can (_load_errors: ONNX Runtime CPU graphs; a plan's tag).
    load=False (write_repository's own check): the configs only, no graph read (a real model's weights are
    put into the repository without being read: loading them twice would cost minutes and their size in memory).

    Returns model name -> ModelConfig; raises RepositoryError listing every disagreement.
    A tensorrt_plan config is checked against <model>/1/source.onnx (the graph the engine
    was built from, copied there for this purpose).
    """
    from core.inputs import read_text_file
    repo = Path(repo)
    if not repo.is_dir():
        raise RepositoryError(f"{repo}: expected a Triton model repository directory, found "
                              f"{'a file' if repo.exists() else 'nothing'}; write one with python -m runtime.triton repo")
    configs, errors = {}, []
    for cfg_path in sorted(repo.glob("*/config.pbtxt")):
        config = parse_config(read_text_file(cfg_path, "config", max_bytes=1 << 20), cfg_path)
        if config.name != cfg_path.parent.name:
            errors.append(f"{cfg_path}: name {config.name!r} differs from its folder {cfg_path.parent.name!r}")
        configs[config.name] = config
        onnx_file = {"onnxruntime_onnx": "model.onnx", "tensorrt_plan": "source.onnx"}.get(config.platform)
        if onnx_file:
            errors += [f"{cfg_path}: {e}" for e in verify_config(config, onnx_io(cfg_path.parent / "1" / onnx_file))]
        if load:
            errors += [f"{cfg_path.parent}: {e}" for e in _load_errors(cfg_path.parent, config)]
    if not configs:
        raise RepositoryError(f"{repo}: expected a Triton model repository (<model>/config.pbtxt), found none; "
                              "write one with python -m runtime.triton repo")
    if errors:
        raise RepositoryError(f"{repo}: expected configs that match their models and models the server can load, "
                              "found: " + "; ".join(errors) + "; write the repository again with python -m "
                              "runtime.triton repo")
    return configs


def _cpu_graph(model_dir: Path, config) -> Path | None:
    """The graph of a model that ONNX Runtime's CPU provider will run: decoder_onnx's on KIND_CPU
    instances, generate's when it decodes with ort-cpu; None otherwise."""
    if config.platform == "onnxruntime_onnx":
        on_cpu = all(g.kind == g.KIND_CPU for g in config.instance_group)
        return model_dir / "1" / "model.onnx" if on_cpu else None
    backend = config.parameters["decode_backend"].string_value if "decode_backend" in config.parameters else None
    if config.backend == "python" and backend == "ort-cpu":
        try:
            return resolve_onnx(model_dir / "1", quantized_first=True)
        except ModelFileError:
            return None
    return None


def _load_errors(model_dir: Path, config) -> list[str]:
    """What the server would meet loading the model: its graph in ONNX Runtime's CPU provider (loaded, optimizations
    off) where it runs on the CPU; a TensorRT plan's tag (TensorRT itself is not needed, nor used, to read it)."""
    if config.platform == "tensorrt_plan":
        wrong = plan_problem(model_dir / "1" / "model.plan")
        return [] if wrong is None else [f"model.plan: expected a serialized TensorRT engine, found {wrong}"]
    graph = _cpu_graph(model_dir, config)
    if graph is None:
        return []
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    try:
        ort.InferenceSession(str(graph), options, providers=["CPUExecutionProvider"])
    except Exception as e:      # whatever ONNX Runtime refuses: its first line, without the error code's prefix
        first = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), type(e).__name__)
        return [f"{graph.name}: ONNX Runtime's CPU provider cannot load it ({first.split(' : ')[-1][:200]})"]
    return []


# --- writing ------------------------------------------------------------------------------

def find_engine(onnx_path: Path) -> Path | None:
    """The newest TensorRT engine runtime.trt_engine built from `onnx_path` (<stem>.<key>.engine beside it)."""
    import re
    pattern = re.compile(re.escape(onnx_path.stem) + r"\.[0-9a-f]+\.engine")
    engines = sorted((p for p in onnx_path.parent.glob("*.engine") if pattern.fullmatch(p.name)),
                     key=lambda p: p.stat().st_mtime)
    return engines[-1] if engines else None


def _link_or_copy(src: Path, dst: Path) -> None:
    """A graph file, the tokenizer or an engine (never a graph's external data: _clone_or_copy) at `dst`:
    a hard link on the same file system (no second copy of an engine), else a copy."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


_FICLONE = 0x40049409       # linux/fs.h: _IOW(0x94, 9, int)


def _clone_or_copy(src: Path, dst: Path) -> None:
    """`src`'s bytes as a new file `dst` of its own: a reflink clone where the file system shares blocks
    (btrfs, XFS: instant, no space taken), else an in-kernel copy (copy_file_range: no pass through this
    process's memory; server-side on NFS), else a plain copy.

    Never a hard link, nor a symbolic link: onnx's external-data loader refuses a data file with more
    than one link ("multiple hard links, indicating a potential hardlink attack") and one that is a
    symbolic link, so a linked `<graph>.data` made both the build and the repository unreadable to
    onnx.load(load_external_data=True): export.verify, graph_passes (issue 42)."""
    with open(src, "rb") as fin, open(dst, "xb") as fout:      # "x": a new file, never one already there
        try:
            import fcntl
            fcntl.ioctl(fout.fileno(), _FICLONE, fin.fileno())
            return
        except (ImportError, OSError):
            pass
        size, done = os.fstat(fin.fileno()).st_size, 0
        try:
            while done < size:
                n = os.copy_file_range(fin.fileno(), fout.fileno(), size - done)
                if n == 0:
                    break
                done += n
        except (AttributeError, OSError) as e:
            if getattr(e, "errno", None) in NO_ROOM:
                raise
        if done == size and size == os.fstat(fout.fileno()).st_size:
            return
        fin.seek(0)                 # unsupported here (another file system's pair, an old kernel): copy it
        fout.seek(0)
        fout.truncate()
        shutil.copyfileobj(fin, fout, 16 << 20)


def _link_external_data(proto, src: Path, dst: Path) -> None:
    """The external-data files `src`'s graph names, put beside `dst` under the same names, each a file of
    its own (_clone_or_copy; a build keeps its weights in `<graph>.data`, never read into this process)."""
    for location in external_files(proto):
        if not (dst.parent / location).exists():
            _clone_or_copy(src.parent / location, dst.parent / location)


def _link_graph(src: Path, dst: Path) -> None:
    """A graph file and its external data, linked (or copied) to `dst`."""
    _link_or_copy(src, dst)
    _link_external_data(_graph_of(src), src, dst)


def choose_generate_backend(requested: str, engine: Path | None, kind: str, ort_only: bool = False) -> str:
    """What the generate model decodes with (a key of GENERATE_BACKENDS). auto: trt where the
    repository has an engine, else ort-cuda where it is written for GPU instances (--kind gpu), else
    ort-cpu; an ORT-only graph (ORT_ONLY_GRAPH) always ort-cpu. A choice that cannot run is refused in one line."""
    if requested != AUTO and requested not in GENERATE_BACKENDS:
        raise RepositoryError(f"--generate-backend {requested!r}: expected one of {AUTO}, {', '.join(GENERATE_BACKENDS)}")
    if ort_only and requested not in (AUTO, "ort-cpu"):
        raise RepositoryError(f"--generate-backend {requested}: expected a portable graph, found {ORT_ONLY_GRAPH}; use "
                              "ort-cpu, or rebuild with --target portable")
    if requested == "trt" and engine is None:
        raise RepositoryError("--generate-backend trt: expected a TensorRT engine of the build, found none; build one "
                              "(python -m runtime.generate --backend trt --model BUILD) or pass --engine FILE")
    if requested != AUTO:
        return requested
    return "ort-cpu" if ort_only else "trt" if engine else "ort-cuda" if kind == "gpu" else "ort-cpu"


def _engine_of(onnx_path: Path, engine: str | Path | None, ort_only: bool,
               max_batch_size: int) -> tuple[Path | None, dict | None]:
    """The engine decoder_trt serves (--engine, else the newest one built beside the graph; none for an
    ORT-only graph, which TensorRT cannot parse) and its build record; checked against max_batch_size."""
    if ort_only:
        if engine is not None:
            raise RepositoryError(f"--engine {engine}: expected a graph TensorRT can run, found {onnx_path}, "
                                  f"{ORT_ONLY_GRAPH}; leave --engine out, or rebuild with --target portable")
        return None, None
    if engine is None:
        engine = find_engine(onnx_path)
    elif not Path(engine).is_file():
        raise RepositoryError(f"{engine}: expected a serialized TensorRT engine file, found nothing; "
                              "build one with the trt backend or leave --engine out")
    if engine is None:
        return None, None
    wrong = plan_problem(Path(engine))
    if wrong is not None:
        raise RepositoryError(f"{engine}: expected a serialized TensorRT engine, found {wrong}; pass the engine "
                              "the trt backend built (python -m runtime.generate --backend trt), or leave --engine out")
    engine_build = read_engine_info(Path(engine))
    built_batch = _built_batch(engine_build)
    if built_batch is not None and built_batch < max_batch_size:
        raise RepositoryError(f"{engine}: expected an engine of max_batch >= --max-batch-size {max_batch_size}, found "
                              f"one built for {built_batch}; pass --max-batch-size {built_batch} or rebuild the engine")
    return Path(engine), engine_build


def _built_batch(engine_build: dict | None) -> int | None:
    """The max_batch an engine was built for, from its build record (None where the record does not say)."""
    built = ((engine_build or {}).get("options") or {}).get("max_batch")
    return built if isinstance(built, int) else None


BF16 = 16        # ONNX TensorProto.BFLOAT16


def _check_ort_cpu(ort_path: Path, io: OnnxIO, kind: str, backend: str) -> None:
    """Refuse a bf16 graph where ONNX Runtime's CPU provider would run it (decoder_onnx on --kind cpu, generate on
    ort-cpu): it has no bf16 kernels, and the server would fail to load the model the repository names."""
    if not any(t.elem_type == BF16 for t in [*io.inputs.values(), *io.outputs.values()]):
        return
    where = [w for w, on in (("decoder_onnx on --kind cpu", kind == "cpu"),
                             ("generate on ort-cpu", backend == "ort-cpu")) if on]
    if where:
        raise RepositoryError(f"{ort_path}: expected a graph ONNX Runtime's CPU provider can run "
                              f"({' and '.join(where)}), found a bf16 graph, which it has no kernels for; pass --kind "
                              "gpu (and an --engine, or --generate-backend ort-cuda), or rebuild with --dtype fp16 or "
                              "fp32")


def _check_options(kind: str, max_batch_size: int, instances: int, slots: int, max_queued: int,
                   prefill_tokens: int, prefill_chunk: int) -> None:
    if kind not in KINDS:
        raise RepositoryError(f"--kind {kind!r}: expected one of {', '.join(KINDS)}")
    if max_batch_size < 1 or instances < 1:
        raise RepositoryError(f"max_batch_size {max_batch_size}, instances {instances}: expected both >= 1")
    if slots < 1 or max_queued < 0:
        raise RepositoryError(f"slots {slots}, max_queued {max_queued}: expected slots >= 1 and max_queued >= 0")
    if prefill_tokens < 1 or prefill_chunk < 1:
        raise RepositoryError(f"prefill_tokens {prefill_tokens}, prefill_chunk {prefill_chunk}: expected both >= 1")


def _write_decoder_trt(tmp: Path, engine: Path, engine_build: dict | None, onnx_path: Path, io: OnnxIO,
                       max_batch_size: int, instances: int) -> None:
    d = tmp / DECODER_TRT / "1"
    d.mkdir(parents=True)
    _link_or_copy(engine, d / "model.plan")
    if engine_build is not None:      # its build record beside it (what TrtSession reads for generate's trt backend)
        engine_info_path(d / "model.plan").write_text(json.dumps(engine_build, indent=2) + "\n")
    _link_graph(onnx_path, d / "source.onnx")       # what the engine was built from; for checks
    (tmp / DECODER_TRT / "config.pbtxt").write_text(
        decoder_config(DECODER_TRT, "tensorrt_plan", io, max_batch_size, instances, "gpu", same_buffer=True,
                       profiles=(DECODE_PROFILE, PREFILL_PROFILE)))


def write_repository(build: str | Path, repo: str | Path, *, engine: str | Path | None = None,
                     max_batch_size: int = 8, instances: int = 1, kind: str = "cpu",
                     max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS, intra_op_threads: int = 0,
                     slots: int = DEFAULT_SLOTS, max_queued: int = DEFAULT_MAX_QUEUED,
                     prefill_tokens: int = PREFILL_TOKENS, prefill_chunk: int = PREFILL_CHUNK,
                     generate_backend: str = AUTO, validate: bool = True) -> Path:
    """Write the model repository for a build directory (see the module docstring); returns `repo`.

    engine: a serialized TensorRT engine built from the build's fused graph; default: the
    newest model.fused.<key>.engine (runtime.trt_engine's name) in the build directory,
    if any (no decoder_trt model otherwise, nor for an ORT-only graph: ORT_ONLY_GRAPH).
    Its max_batch must be >= max_batch_size.
    kind: instance kind of decoder_onnx (cpu | gpu); decoder_trt is always KIND_GPU.
    slots, max_queued: the generate model's slot pool (sequences decoded together, per
    instance) and how many requests may wait for a slot before "server busy".
    prefill_tokens, prefill_chunk: the scheduler's prefill budget per step (padded prompt tokens)
    and the most tokens of one prompt prefilled in a step (a longer prompt: chunks over several).
    generate_backend: what generate decodes with, auto | trt | ort-cuda | ort-cpu
    (choose_generate_backend; recorded in its config.pbtxt and in repository.json).
    validate: parse every config into ModelConfig and check it against the ONNX (skipped
    where tritonclient, from the triton extra, is not installed).
    """
    # 71 lines with the docstring: the repository's steps in the order a reader checks them (choices
    # refused first, then each model's folder inside one atomic output directory); its parts are the
    # helpers above it
    build, repo = Path(build), Path(repo)
    if not build.is_dir():
        raise RepositoryError(f"{build}: expected a build directory from python -m export.build, found "
                              f"{'a file' if build.exists() else 'nothing'}; build one first")
    try:
        onnx_path = resolve_onnx(build)     # fused, unfused, or a --quantize build's quantized graph: TensorRT's
        ort_path = resolve_onnx(build, quantized_first=True)    # ONNX Runtime's: a --quantize build's quantized graph
    except ModelFileError as e:
        raise RepositoryError(str(e)) from None
    if not (build / TOKENIZER).is_file():
        raise RepositoryError(f"{build / TOKENIZER}: expected the model's tokenizer, found no file; "
                              "copy the checkpoint's tokenizer.json there")
    _check_options(kind, max_batch_size, instances, slots, max_queued, prefill_tokens, prefill_chunk)
    ort_only = is_ort_only(onnx_path)
    engine, engine_build = _engine_of(onnx_path, engine, ort_only, max_batch_size)
    backend = choose_generate_backend(generate_backend, engine, kind, ort_only)
    built_batch = _built_batch(engine_build)
    if backend == "trt" and built_batch is not None and slots > built_batch:   # generate's pool is the engine's batch
        raise RepositoryError(f"--slots {slots}: expected at most {built_batch} (the engine's max_batch; generate "
                              f"decodes with trt); pass --slots {built_batch} or rebuild the engine with a larger max_batch")
    io = onnx_io(onnx_path)
    _check_contract(onnx_path, io)
    ort_io = io if ort_path == onnx_path else onnx_io(ort_path)
    if ort_path != onnx_path:
        _check_contract(ort_path, ort_io)
    _check_ort_cpu(ort_path, ort_io, kind, backend)

    with output_dir(repo, TRITON_REPOSITORY, inputs=[build] + ([engine] if engine else [])) as tmp:
        d = tmp / DECODER_ONNX / "1"
        d.mkdir(parents=True)
        ort_io = add_control_inputs(ort_path, d / "model.onnx")
        (tmp / DECODER_ONNX / "config.pbtxt").write_text(
            decoder_config(DECODER_ONNX, "onnxruntime_onnx", ort_io, max_batch_size, instances, kind))
        if engine is not None:
            _write_decoder_trt(tmp, engine, engine_build, onnx_path, io, max_batch_size, instances)
        d = tmp / GENERATE / "1"
        d.mkdir(parents=True)
        _link_graph(ort_path, d / ort_path.name)          # generate's ort backends; trt reads decoder_trt's
        _link_or_copy(build / TOKENIZER, d / TOKENIZER)
        for name in MODEL_FILES:     # chat_template.json (runtime.openai renders chat with it), generation.json
            if (build / name).is_file():                # (the stop tokens: runtime.generate.default_stop_tokens)
                _link_or_copy(build / name, d / name)
        (d / "model.py").write_text(GENERATE_MODEL_PY)
        (tmp / GENERATE / "config.pbtxt").write_text(
            generate_config(GENERATE, instances, max_new_tokens, intra_op_threads, slots, max_queued, backend,
                            prefill_tokens, prefill_chunk))
        (tmp / "repository.json").write_text(json.dumps(
            {"build": str(build.resolve()), "onnx": ort_path.name, "engine": str(engine) if engine else None,
             # the TensorRT version, GPU and flags that built model.plan: it loads only in that TensorRT
             # version unless built version-compatible (then start tritonserver with
             # --backend-config=tensorrt,version-compatible=true)
             "engine_build": engine_build, "ort_only_graph": ort_only, "generate_backend": backend,
             "models": [m for m in (DECODER_ONNX, DECODER_TRT if engine else None, GENERATE) if m]}, indent=2) + "\n")
        if validate and have_tritonclient():
            check_repository(tmp, load=False)
    return repo
