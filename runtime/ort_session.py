"""ONNX Runtime backend: the KV cache bound once with IO binding and updated in place.

Each cache is one OrtValue bound as both key_i (input) and present_key_i (output).
The graph writes it with TensorScatter, which ONNX Runtime runs in place exactly
when input and output are the same OrtValue (otherwise it logs "in-place
optimization not activated, copying past_cache to present_cache" and copies the
whole cache every step). A decode step then only writes the B tokens and B
positions into preallocated buffers and calls run_with_iobinding: no cache copy,
no allocation that grows with the sequence.

    CPU:  input_ids [B, 1], position [B] and logits [B, 1, V] are numpy arrays that
          their OrtValues wrap without a copy; the returned logits are a view.
    CUDA: the same buffers live on the device; tokens and positions are copied in
          with update_inplace, the logits [B, V] copied out.

Steps on rows [start, stop) of the batch (CPU and CUDA): an IO binding of the rows
cache[start:stop] (contiguous: the batch axis is the leading one) and the same rows of the
decode buffers, bound by the address of row `start`, made once per row range; the other
rows are not touched.
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from core.contract import (INPUT_IDS, LOGITS, LOGITS_FROM, POSITION, ContractError, check_external_data_file,
                           contract_of, present_name)
from runtime.model_files import ORT_ONLY_MARK, resolve_onnx, spec_from_ort_session
from runtime.session import DecoderSession, DeviceError, MissingExtraError, ModelFileError, RuntimeUserError

# provider name per --device; the CUDA and TensorRT providers come with onnxruntime-gpu
PROVIDERS = {"cpu": ["CPUExecutionProvider"],
             "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
             "tensorrt": ["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]}
ORT_WARNING = 2  # session log severity: 0 verbose, 1 info, 2 warning (shows the in-place warning), 3 error


def check_provider(session_providers: list[str], device: str, where) -> None:
    """Raise DeviceError unless the session really runs on the provider --device asked for.

    ONNX Runtime lists CUDAExecutionProvider as available whenever onnxruntime-gpu is
    installed, but when its CUDA / cuDNN libraries fail to load, InferenceSession only
    logs the error and runs on the next provider in the list, the CPU
    (microsoft/onnxruntime#23059, #17801): `session.get_providers()` is the only
    truth, and its first entry must be the one asked for.
    """
    wanted = PROVIDERS[device][0]
    found = session_providers[0] if session_providers else "none"
    if found != wanted:
        raise DeviceError(f"{where}: --device {device} expected the session to run on {wanted}, found {found} "
                          f"(providers {session_providers}: ONNX Runtime could not create {wanted}, see its log above); "
                          "install the CUDA / cuDNN (and for --device tensorrt, TensorRT) versions onnxruntime-gpu "
                          "needs, or use --device cpu")


class OrtSession(DecoderSession):
    backend = "ort"

    def __init__(self, model: str | Path, device: str = "cpu", intra_op_threads: int = 0,
                 log_severity: int = ORT_WARNING, profile_prefix: str | Path | None = None):
        super().__init__()
        if device not in PROVIDERS:
            raise ValueError(f"device {device!r}; expected one of {', '.join(PROVIDERS)}")
        self.path = resolve_onnx(model, quantized_first=True)
        self.device = device
        self.intra_op_threads = intra_op_threads
        self.log_severity = log_severity
        self.profile_prefix = profile_prefix   # ORT profiling on: its trace at profile_events()
        self.session = None
        self.caches: dict[str, object] = {}   # key_i / value_i -> OrtValue [B, H, S_max, D]
        self._gqa = False

    # --- lifecycle ---------------------------------------------------------------

    def _activate(self) -> None:
        import onnxruntime as ort
        providers = PROVIDERS[self.device]
        if providers[0] not in ort.get_available_providers():
            raise MissingExtraError(f"ort --device {self.device}", "gpu", "onnxruntime-gpu",
                                    f"onnxruntime {ort.__version__} has no {providers[0]}")
        so = ort.SessionOptions()
        # loading: warnings off (level 2 -> 3), since ONNX Runtime warns that an input with a default (the
        # contract's logits_from) "will not be treated as constant", which is its purpose; running: the level
        # asked for (the run options' logger prints the in-place cache warning, tests/runtime/test_ort_session.py)
        so.log_severity_level = 3 if self.log_severity == ORT_WARNING else self.log_severity
        so.intra_op_num_threads = self.intra_op_threads
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if self.profile_prefix is not None:
            so.enable_profiling = True
            so.profile_file_prefix = str(self.profile_prefix)
        try:
            check_external_data_file(self.path)
        except ContractError as e:
            raise ModelFileError(str(e)) from None
        try:
            self.session = ort.InferenceSession(str(self.path), so, providers=providers)
        except Exception as e:  # InvalidProtobuf, Fail, NotImplemented...: all mean an unusable file
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            if self.device == "cpu" and "NOT_IMPLEMENTED" in first and _is_bf16(self.path):
                raise ModelFileError(f"{self.path}: a bf16 graph, and ONNX Runtime's CPU kernels do not compute bf16; "
                                     "run it with TensorRT or --device cuda, or build --dtype fp16 / fp32 for the "
                                     "CPU") from None
            raise ModelFileError(f"{self.path}: expected a loadable ONNX model, found an error ({first}); "
                                 "re-run python -m export.build") from None
        try:
            check_provider(self.session.get_providers(), self.device, self.path)
        except DeviceError:
            self.session = None
            raise
        self.spec = spec_from_ort_session(self.session, self.path)
        self._ort = ort
        out_types = {o.name: o.type for o in self.session.get_outputs()}
        self._logits_dtype = np.dtype(np.float16 if out_types[LOGITS] == "tensor(float16)" else np.float32)
        # one RunOptions for every run: with run_options=None, ORT 1.32's run_with_iobinding
        # retains ~124 bytes of Python memory per call (found by tests/runtime/test_ort_session.py).
        # Its Python wrapper also looks up the run option "gpu_graph_id" on every call, and a
        # missing entry costs a C++ exception thrown and caught, ~60-100 us a step (a third of a
        # 1M-parameter decode step); -1 is the documented "no graph capture", what we run anyway.
        self._run_options = ort.RunOptions()
        self._run_options.log_severity_level = self.log_severity
        self._run_options.add_run_config_entry("gpu_graph_id", "-1")
        self._ort_device = "cpu" if self.device == "cpu" else "cuda"
        # a GroupQueryAttention graph (export.build --target ort-cpu) continues a cached prompt at batch 1 only
        meta = self.session.get_modelmeta().custom_metadata_map
        self._gqa = meta.get(ORT_ONLY_MARK[0]) == ORT_ONLY_MARK[1]

    def profile_events(self) -> list[dict]:
        """End ONNX Runtime's profiling (the session was made with profile_prefix) and return its trace: the
        events of the JSON file it wrote (Chrome trace format: each node's run with its "dur" in us)."""
        if self.profile_prefix is None:
            raise ValueError(f"{self.path}: profiling is off; create the OrtSession with profile_prefix")
        return json.loads(Path(self.session.end_profiling()).read_text())

    def _deactivate(self) -> None:
        self.binding = None
        self.caches = {}
        self._row_bindings = {}
        self.session = None

    def _allocate(self, batch: int) -> None:
        dev, spec = self._ort_device, self.spec
        self.binding = self.session.io_binding()
        self.caches = {}
        self._row_bindings = {}                    # (start, stop, decode) -> IOBinding of those rows
        zeros = np.zeros(spec.cache_shape(batch), spec.np_dtype)                              # [B, H, S_max, D]
        for name in spec.cache_names():
            # CPU: wraps a zeroed array of its own (its OrtValue keeps it alive); CUDA: device memory, zeroed
            value = self._bound(zeros.copy() if dev == "cpu" else zeros)
            if dev != "cpu":
                value.update_inplace(zeros)
            self.caches[name] = value
            self.binding.bind_ortvalue_input(name, value)
            self.binding.bind_ortvalue_output(present_name(name), value)      # same OrtValue: in place
        # decode-step buffers, bound once
        self._ids = np.zeros((batch, 1), np.int64)                                             # [B, 1]
        self._pos = np.zeros(batch, np.int64)                                                  # [B]
        self._logits = np.zeros((batch, 1, spec.vocab_size), self._logits_dtype)               # [B, 1, V]
        self._logits_row = self._logits[:, 0]            # [B, V] view, returned by every CPU decode step
        self._ids_ov, self._pos_ov, self._logits_ov = map(self._bound, (self._ids, self._pos, self._logits))
        self._logits_from_0 = self._ort.OrtValue.ortvalue_from_numpy(np.zeros(1, np.int64), dev, 0)   # kept: bound
        self._buffers = {**{n: (v, spec.np_dtype) for n, v in self.caches.items()},     # what row bindings address
                         INPUT_IDS: (self._ids_ov, np.int64), POSITION: (self._pos_ov, np.int64),
                         LOGITS: (self._logits_ov, self._logits_dtype)}
        self._decode_bound = False

    def _bound(self, a: np.ndarray):
        """CPU: an OrtValue wrapping the array, no copy; CUDA: device memory of its shape and type."""
        if self._ort_device == "cpu":
            return self._ort.OrtValue.ortvalue_from_numpy(a)
        return self._ort.OrtValue.ortvalue_from_shape_and_type(a.shape, a.dtype, self._ort_device, 0)

    # --- steps -------------------------------------------------------------------

    def _check_prompt(self, b: int, t: int, position: np.ndarray) -> None:
        if self._gqa and t > 1 and b > 1 and bool(np.any(position)):
            raise RuntimeUserError(f"{self.path}: a {t}-token step on {b} sequences must start at slot 0 in a "
                                   "GroupQueryAttention graph (ONNX Runtime continues a cached prompt at batch 1 "
                                   "only); step the sequences one at a time, or use the --attention fused build")

    def _run(self, binding) -> None:
        """The engine call, timed for last_inference_time (two clock reads, ~0.1 us)."""
        t0 = time.perf_counter()
        self.session.run_with_iobinding(binding, self._run_options)
        self._last_inference_s = time.perf_counter() - t0

    def _run_prefill(self, input_ids: np.ndarray, position: np.ndarray, logits_from: int = 0) -> np.ndarray:
        logits = self._prefill_with(self.binding, input_ids, position, logits_from)
        self._decode_bound = False
        return logits

    def _prefill_with(self, binding, input_ids: np.ndarray, position: np.ndarray, logits_from: int = 0) -> np.ndarray:
        """input_ids [b, T] and position [b] bound to `binding` (its caches already bound); one run -> logits
        [b, T - logits_from, V] (a graph that takes logits_from gets it bound every time: a binding keeps its inputs)."""
        b, t = input_ids.shape
        ort, dev = self._ort, self._ort_device
        logits = np.empty((b, t - logits_from, self.spec.vocab_size), self._logits_dtype)     # [b, T - from, V]
        binding.bind_ortvalue_input(INPUT_IDS, ort.OrtValue.ortvalue_from_numpy(input_ids, dev, 0))
        binding.bind_ortvalue_input(POSITION, ort.OrtValue.ortvalue_from_numpy(position, dev, 0))
        if self.spec.takes_logits_from:
            binding.bind_ortvalue_input(LOGITS_FROM, ort.OrtValue.ortvalue_from_numpy(
                np.array([logits_from], np.int64), dev, 0))
        out = self._bound(logits)
        binding.bind_ortvalue_output(LOGITS, out)
        self._run(binding)
        return logits if dev == "cpu" else out.numpy()

    def _run_decode(self, tokens: np.ndarray, position: np.ndarray) -> np.ndarray:
        if not self._decode_bound:         # the decode buffers, bound until a prefill rebinds the inputs
            self.binding.bind_ortvalue_input(INPUT_IDS, self._ids_ov)
            self.binding.bind_ortvalue_input(POSITION, self._pos_ov)
            self.binding.bind_ortvalue_output(LOGITS, self._logits_ov)
            if self.spec.takes_logits_from:  # a prefill left its own bound: a 1-token step's logits are from 0
                self.binding.bind_ortvalue_input(LOGITS_FROM, self._logits_from_0)
            self._decode_bound = True
        return self._decode_with(self.binding, 0, len(tokens), tokens, position)

    def _decode_with(self, binding, start: int, stop: int, tokens: np.ndarray, position: np.ndarray) -> np.ndarray:
        """tokens and positions into rows [start, stop) of the decode buffers, one run of `binding`
        (bound to those rows) -> their logits [b, V]."""
        self._ids[start:stop, 0] = tokens
        self._pos[start:stop] = position
        if self._ort_device == "cpu":         # the bound OrtValues wrap these arrays
            self._run(binding)
            return self._logits_row[start:stop]
        self._ids_ov.update_inplace(self._ids)
        self._pos_ov.update_inplace(self._pos)
        self._run(binding)
        return self._logits_ov.numpy()[start:stop, 0]

    # --- steps on part of the batch ---------------------------------------------------

    row_steps = True

    def _rows_binding(self, start: int, stop: int, decode: bool):
        """An IO binding of rows [start, stop) of the caches (input and present_* output: in place) and,
        for decode, of the decode buffers; each bound by the address of its row `start` (CPU or CUDA)."""
        key = (start, stop, decode)
        if key not in self._row_bindings:
            binding = self.session.io_binding()
            roles = {n: (("input", n), ("output", present_name(n))) for n in self.spec.cache_names()}
            if decode:
                roles.update({INPUT_IDS: (("input", INPUT_IDS),), POSITION: (("input", POSITION),),
                              LOGITS: (("output", LOGITS),)})
            for name, binds in roles.items():
                value, dtype = self._buffers[name]
                shape = [stop - start, *value.shape()[1:]]                                     # [b, ...]
                address = value.data_ptr() + start * int(np.prod(shape[1:])) * np.dtype(dtype).itemsize
                for direction, as_name in binds:
                    getattr(binding, f"bind_{direction}")(as_name, self._ort_device, 0, dtype, shape, address)
            self._row_bindings[key] = binding
        return self._row_bindings[key]

    def _run_prefill_rows(self, start: int, input_ids: np.ndarray, position: np.ndarray,
                          logits_from: int = 0) -> np.ndarray:
        return self._prefill_with(self._rows_binding(start, start + len(input_ids), decode=False), input_ids, position,
                                  logits_from)

    def _run_decode_rows(self, start: int, tokens: np.ndarray, position: np.ndarray) -> np.ndarray:
        stop = start + len(tokens)
        return self._decode_with(self._rows_binding(start, stop, decode=True), start, stop, tokens, position)

    # --- inspection (tests, docs) ---------------------------------------------------

    def cache_ptrs(self) -> dict[str, int]:
        """Device address of each bound cache; unchanged across steps when updated in place."""
        return {n: v.data_ptr() for n, v in self.caches.items()}

    def cache_array(self, name: str) -> np.ndarray:
        """The cache's contents (a view of the bound buffer on CPU, a copy on CUDA)."""
        return self.caches[name].numpy()


def _is_bf16(path) -> bool:
    """Whether the graph's caches and logits are bf16 (core.contract reads the graph, not its weights)."""
    try:
        return contract_of(path).dtype == "bf16"
    except ContractError:
        return False
