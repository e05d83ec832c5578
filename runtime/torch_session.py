"""PyTorch backend: the reference decoder from a checkpoint, on the same contract.

    eager        model(ids, position, cache) with cache = cfg.cache_layout().allocate(B),
                 written in place by models.kv_cache.write_cache_
    compile=True torch.compile of the forward (dynamic shapes off for decode: T = 1 and B fixed)
    CUDA         the decode step is captured once per batch size as a CUDA graph over
                 static input_ids [B, 1], position [B], the caches and logits [B, 1, V],
                 then replayed (cuda_graphs=False turns this off)

Warm-up and capture run the step on whatever the static buffers hold; that writes
one cache slot which is overwritten before any query can see it (a slot is always
written before a query at or past it runs).
"""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

from core.contract import DecodeContract
from models.decoder import TORCH_DTYPES
from runtime.session import DecoderSession, DeviceError, ModelFileError


class TorchSession(DecoderSession):
    backend = "torch"

    def __init__(self, model: str | Path | torch.nn.Module, device: str = "cpu", compile: bool = False,
                 cuda_graphs: bool | None = None, dtype: str = "fp32"):
        super().__init__()
        self.source = model
        self.device = torch.device(device)
        self.compile = compile
        self.cuda_graphs = (self.device.type == "cuda") if cuda_graphs is None else cuda_graphs
        self.dtype, self.dtype_name = TORCH_DTYPES[dtype], dtype
        self.model = None

    def _activate(self) -> None:
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise DeviceError("backend 'torch' --device cuda: expected a CUDA device, found none "
                              "(torch.cuda.is_available() is False); use --device cpu")
        if isinstance(self.source, torch.nn.Module):
            model = self.source
        else:
            from models.checkpoint import CheckpointError, load_checkpoint
            try:
                model = load_checkpoint(self.source)
            except CheckpointError as e:
                raise ModelFileError(str(e)) from None
        self.model = model.eval().to(self.device, self.dtype)
        # the contract is what a caller receives: numpy has no bf16, so a bf16 model's logits come back as fp32
        # (the host copy below); its caches stay bf16 on the device and are never handed out
        self.spec = DecodeContract.from_config(self.model.cfg, "fp32" if self.dtype_name == "bf16" else self.dtype_name)
        self._forward = torch.compile(self.model, dynamic=False) if self.compile else self.model

    def _deactivate(self) -> None:
        self.cache = None
        self._graph = None
        self.model = None
        self._forward = None

    @torch.inference_mode()
    def _allocate(self, batch: int) -> None:
        self.cache = self.model.cfg.cache_layout().allocate(batch, self.dtype, self.device)  # n_layer x ([B, H, S_max, D] x 2)
        self._ids = torch.zeros((batch, 1), dtype=torch.long, device=self.device)              # [B, 1]
        self._pos = torch.zeros(batch, dtype=torch.long, device=self.device)                   # [B]
        self._host_logits = torch.empty((batch, self.spec.vocab_size), dtype=torch.float32)    # [B, V]
        if self.device.type == "cuda":
            self._host_logits = self._host_logits.pin_memory()
        self._graph = None
        if self.cuda_graphs:
            self._capture()

    def _capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # warm-up: cuBLAS handles, compiled kernels
                self._forward(self._ids, self._pos, self.cache)
        torch.cuda.current_stream().wait_stream(stream)
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph):
            self._static_logits, _ = self._forward(self._ids, self._pos, self.cache)          # [B, 1, V]

    # steps on rows [start, stop) of the batch (the whole batch: start 0): the model on views of those
    # cache rows, eager (prefill shapes vary)
    row_steps = True

    @torch.inference_mode()
    def _run_prefill_rows(self, start: int, input_ids: np.ndarray, position: np.ndarray) -> np.ndarray:
        stop = start + len(input_ids)
        rows = [(k[start:stop], v[start:stop]) for k, v in self.cache]                       # views, written in place
        ids, pos = torch.from_numpy(input_ids).to(self.device), torch.from_numpy(position).to(self.device)
        t0 = time.perf_counter()
        logits, _ = self.model(ids, pos, rows)
        out = logits.float().cpu().numpy()                     # the copy out waits for the device
        self._last_inference_s = time.perf_counter() - t0
        return out

    @torch.inference_mode()
    def _run_decode_rows(self, start: int, tokens: np.ndarray, position: np.ndarray) -> np.ndarray:
        return self._run_prefill_rows(start, tokens[:, None], position)[:, 0]

    @torch.inference_mode()
    def _run_decode(self, tokens: np.ndarray, position: np.ndarray) -> np.ndarray:
        self._ids[:, 0].copy_(torch.from_numpy(np.asarray(tokens, np.int64)), non_blocking=False)
        self._pos.copy_(torch.from_numpy(np.asarray(position, np.int64)), non_blocking=False)
        t0 = time.perf_counter()
        if self._graph is not None:
            self._graph.replay()
            logits = self._static_logits
        else:
            logits, _ = self._forward(self._ids, self._pos, self.cache)
        self._host_logits.copy_(logits[:, 0])
        if self.device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        self._last_inference_s = time.perf_counter() - t0
        return self._host_logits.numpy()
