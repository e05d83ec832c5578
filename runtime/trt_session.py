"""TensorRT backend: the engine from runtime.trt_engine, run with execute_async_v3.

Two execution contexts, one per optimization profile (decode: T = 1; prefill:
T = 1..max_prompt), both bound to the same cache buffers. Device memory is torch
CUDA tensors (torch is a core dependency); TensorRT sees raw addresses. Everything
runs on the session's one stream: the buffers are allocated (and the caches zeroed)
under `torch.cuda.stream(self.stream)` too, so the engine never reads a cache that
another stream is still clearing:

    caches     key_i / value_i [B, H, S_max, D], bound as input AND as present_* output
               (IKVCacheUpdateLayer writes in place: the two names share one address)
    decode     input_ids [B, 1], position [B], logits [B, 1, V]: device buffers whose
               addresses are set once per row range; a step copies B tokens and B
               positions in from pinned host memory, enqueues the engine, copies
               the [B, V] logits out, and synchronizes the one stream
    rows       a step on rows [start, start + b) (the batch scheduler's) binds the rows
               cache[start:start + b] (contiguous: the batch axis leads) and the same rows
               of the decode buffers; the other rows are neither read nor written

A given engine file (`engine=`, a Triton repository's model.plan) is run as it is, its
limits read from its prefill profile; otherwise the engine is built or reused beside the graph.

Needs the tensorrt extra and a CUDA device; both are checked on activate with a
one-line error.
"""
from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from core.contract import INPUT_IDS, LOGITS, POSITION
from runtime.model_files import ORT_ONLY_GRAPH, is_ort_only, resolve_onnx, spec_from_onnx_file
from runtime.session import CapacityError, DecoderSession, DeviceError, ModelFileError
from runtime.trt_engine import (DECODE_PROFILE, PREFILL_PROFILE, BuildOptions, EngineFromFile, EngineFromOnnx,
                                check_aliases, check_engine_io, io_mapping)


class TrtSession(DecoderSession):
    backend = "trt"

    def __init__(self, model: str | Path, device: str = "cuda", options: BuildOptions = BuildOptions(),
                 rebuild: bool = False, engine: str | Path | None = None):
        """engine: run this serialized engine (built from `model`'s graph, e.g. a Triton repository's
        model.plan) instead of building or reusing one beside the graph; options come from its record."""
        super().__init__()
        self.path = resolve_onnx(model)
        if is_ort_only(self.path):         # said before TensorRT loads anything
            raise ModelFileError(f"{self.path}: expected a portable graph for TensorRT, found {ORT_ONLY_GRAPH}; "
                                 "use --backend ort, or rebuild with --target portable")
        self.device = device
        self.engine_file = EngineFromFile(engine) if engine is not None else None
        self.options = self.engine_file.options() if self.engine_file else options
        self.rebuild = rebuild
        self.loader: EngineFromOnnx | EngineFromFile | None = None

    def _activate(self) -> None:
        from runtime.backends import BACKENDS, require
        require(BACKENDS["trt"])
        import tensorrt as trt
        import torch
        if self.device != "cuda" or not torch.cuda.is_available():
            raise DeviceError("backend 'trt': expected a CUDA device, found "
                              + ("--device " + self.device if self.device != "cuda" else "none (torch.cuda.is_available() is False)")
                              + "; run on a machine with an NVIDIA GPU or use --backend ort")
        self._torch = torch
        self.spec = spec_from_onnx_file(self.path)
        self.options = self.options.resolved(self.spec)
        self.loader = self.engine_file or EngineFromOnnx(self.path, self.spec, self.options, self.rebuild)
        data = self.loader()
        self._logger = trt.Logger(trt.Logger.WARNING)
        self._runtime = trt.Runtime(self._logger)
        if self.options.version_compatible:   # the plan carries its own lean runtime: host code must be allowed
            self._runtime.engine_host_code_allowed = True
        self.engine = self._runtime.deserialize_cuda_engine(data)
        if self.engine is None:
            raise ModelFileError(f"{self.loader.path}: expected an engine this TensorRT can load, found one it rejects; "
                                 "delete it to rebuild")
        names = {n: "input" if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT else "output"
                 for n in map(self.engine.get_tensor_name, range(self.engine.num_io_tensors))}
        check_engine_io(names, self.spec, self.loader.path)
        check_aliases(self.engine, self.spec, self.loader.path)
        if self.engine_file:       # the limits it was built with, from its prefill profile's max shape
            max_batch, max_prompt = self.engine.get_tensor_profile_shape(INPUT_IDS, PREFILL_PROFILE)[2]
            self.options = replace(self.options, max_batch=int(max_batch), max_prompt=int(max_prompt))
        to_torch = {trt.DataType.FLOAT: torch.float32, trt.DataType.HALF: torch.float16,
                    trt.DataType.INT64: torch.int64, trt.DataType.INT32: torch.int32}
        if hasattr(trt.DataType, "BF16"):
            to_torch[trt.DataType.BF16] = torch.bfloat16
        self.dtypes = {n: to_torch[self.engine.get_tensor_dtype(n)] for n in names}
        self.stream = torch.cuda.Stream()
        self.contexts = []
        for profile in (DECODE_PROFILE, PREFILL_PROFILE):
            ctx = self.engine.create_execution_context()
            ctx.set_optimization_profile_async(profile, self.stream.cuda_stream)
            self.contexts.append(ctx)
        self.stream.synchronize()

    def _deactivate(self) -> None:
        self.caches = {}
        self.contexts = []
        self.engine = None
        self._runtime = None

    def _bind(self, ctx, input_ids, position, logits, start: int = 0) -> None:
        """Shapes and addresses of every engine tensor, the caches' rows [start, start + B) (views: the
        batch axis leads, so they are contiguous); present_* share the cache's address."""
        stop = start + input_ids.shape[0]
        caches = {n: c[start:stop] for n, c in self.caches.items()}                   # [b, H, S_max, D]
        shapes = {INPUT_IDS: input_ids.shape, POSITION: position.shape, **{n: c.shape for n, c in caches.items()}}
        for name, shape in shapes.items():
            if not ctx.set_input_shape(name, tuple(shape)):
                raise CapacityError(f"{name}: expected a shape inside the engine's optimization profile, found "
                                    f"{list(shape)}; rebuild with larger BuildOptions (max_batch, max_prompt)")
        addresses = {INPUT_IDS: input_ids.data_ptr(), POSITION: position.data_ptr(), LOGITS: logits.data_ptr(),
                     **{n: c.data_ptr() for n, c in caches.items()},
                     **{out: caches[src].data_ptr() for out, src in io_mapping(self.spec).aliases.items()}}
        for name, ptr in addresses.items():
            if not ctx.set_tensor_address(name, ptr):
                raise RuntimeError(f"{self.loader.path}: set_tensor_address({name!r}) failed (see the TensorRT log)")

    def _allocate(self, batch: int) -> None:
        torch = self._torch
        if batch > self.options.max_batch:
            raise CapacityError(f"batch: expected at most {self.options.max_batch} (the engine's max_batch), "
                                f"found {batch}; rebuild with a larger BuildOptions.max_batch")
        dev = "cuda"
        self.caches = {}                         # free the previous batch size's caches first (lower peak)
        with torch.cuda.stream(self.stream):     # zeroed on the stream the engine runs on, in order
            self.caches = {n: torch.zeros(self.spec.cache_shape(batch), dtype=self.dtypes[n], device=dev)  # [B, H, S_max, D]
                           for n in self.spec.cache_names()}
            self._ids = torch.zeros((batch, 1), dtype=self.dtypes[INPUT_IDS], device=dev)               # [B, 1]
            self._pos = torch.zeros(batch, dtype=self.dtypes[POSITION], device=dev)                     # [B]
            self._logits = torch.empty((batch, 1, self.spec.vocab_size), dtype=self.dtypes[LOGITS], device=dev)
        self._ids_host = torch.zeros((batch, 1), dtype=self._ids.dtype).pin_memory()
        self._pos_host = torch.zeros(batch, dtype=self._pos.dtype).pin_memory()
        self._logits_host = torch.empty((batch, self.spec.vocab_size), dtype=self._logits.dtype).pin_memory()
        self._ids_np, self._pos_np = self._ids_host.numpy(), self._pos_host.numpy()
        self._logits_np = self._logits_host.numpy()
        self._decode_rows = None                 # the row range the decode context is bound to
        self.stream.synchronize()

    def _execute(self, ctx) -> None:
        if not ctx.execute_async_v3(self.stream.cuda_stream):
            raise RuntimeError(f"{self.loader.path}: execute_async_v3 failed (see the TensorRT log)")

    # --- steps on rows [start, start + b) of the batch (the whole batch: start 0, b = B) ----------

    row_steps = True

    def _run_prefill_rows(self, start: int, input_ids: np.ndarray, position: np.ndarray) -> np.ndarray:
        torch = self._torch
        b, t = input_ids.shape
        if t > self.options.max_prompt:
            raise CapacityError(f"prompt: expected at most {self.options.max_prompt} tokens (the engine's prefill profile), "
                                f"found {t}; rebuild with a larger BuildOptions.max_prompt")
        t0 = time.perf_counter()
        with torch.cuda.stream(self.stream):
            ids = torch.from_numpy(input_ids).to("cuda", self.dtypes[INPUT_IDS], non_blocking=True)
            pos = torch.from_numpy(position).to("cuda", self.dtypes[POSITION], non_blocking=True)
            logits = torch.empty((b, t, self.spec.vocab_size), dtype=self.dtypes[LOGITS], device="cuda")
            ctx = self.contexts[PREFILL_PROFILE]
            self._bind(ctx, ids, pos, logits, start)
            self._execute(ctx)
            host = logits.to("cpu", non_blocking=False)
        self.stream.synchronize()
        self._last_inference_s = time.perf_counter() - t0     # execute is asynchronous: timed to the sync
        return host.numpy()

    def _run_decode_rows(self, start: int, tokens: np.ndarray, position: np.ndarray) -> np.ndarray:
        torch = self._torch
        stop = start + len(tokens)
        ctx = self.contexts[DECODE_PROFILE]
        if self._decode_rows != (start, stop):    # rebound only when the range changes (the scheduler's rarely does)
            self._bind(ctx, self._ids[start:stop], self._pos[start:stop], self._logits[start:stop], start)
            self._decode_rows = (start, stop)
        self._ids_np[start:stop, 0] = tokens
        self._pos_np[start:stop] = position
        t0 = time.perf_counter()
        with torch.cuda.stream(self.stream):
            self._ids[start:stop].copy_(self._ids_host[start:stop], non_blocking=True)
            self._pos[start:stop].copy_(self._pos_host[start:stop], non_blocking=True)
            self._execute(ctx)
            self._logits_host[start:stop].copy_(self._logits[start:stop, 0], non_blocking=True)
        self.stream.synchronize()
        self._last_inference_s = time.perf_counter() - t0     # execute is asynchronous: timed to the sync
        return self._logits_np[start:stop]

    def cache_ptrs(self) -> dict[str, int]:
        return {n: c.data_ptr() for n, c in self.caches.items()}
