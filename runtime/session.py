"""The decode-step contract every backend implements, its errors, and the model's shapes.

A session runs one graph (ONNX Runtime, TensorRT) or module (PyTorch) that maps

    (input_ids [B, T], position [B], cache) -> logits [B, T, V]   (cache written in place)

where position[b] is the cache slot of sequence b's first new token and query t of
sequence b attends to cache slots j <= position[b] + t. The cache is owned by the
session, allocated once per batch size by `reset`, and never copied by a step.

Lifecycle (Polygraphy's runner interface):

    with OrtSession("build/dyt") as s:        # activate(): load, compile, read the spec
        s.reset(batch=4)                      # allocate (or reuse) the [B, H, S_max, D] caches
        logits = s.prefill(ids)               # ids [4, T] at position 0 -> [4, T, V]
        logits = s.decode_step(tok, pos)      # tok [4], pos [4]          -> [4, V]
                                              # deactivate() on exit: free the caches and session

Returned logits arrays may be reused: they stay valid until the next call on the
same session (copy them to keep them). All arrays are numpy on the host.

Each session times its own engine calls (Polygraphy's runner API): `last_inference_time()`
is the seconds of the last one, so a benchmark splits a step into engine and loop time
without patching the session. `step(feeds)` is the contract as a step function for the one
decode driver (core/decode.py), which then feeds tokens and positions only: the caches stay here.

Steps on part of the batch (what the batch scheduler, runtime/scheduler.py, runs on): a
backend with `row_steps` runs `prefill_rows(start, ids)` / `decode_rows(start, tok, pos)`
on rows [start, start + b) of the caches only; the other rows are neither read nor written.

        s.reset(batch=8)                          # 8 slots
        s.prefill_rows(3, ids)                    # ids [1, T] into row 3; rows 0-2, 4-7 untouched
        s.decode_rows(0, tok, pos)                # tok [5], pos [5]: rows 0-4 -> [5, V]
"""
from __future__ import annotations

import abc

import numpy as np

from core.contract import INPUT_IDS, LOGITS, POSITION, DecodeContract
from core.errors import UsageError, UserError
from core.inputs import check_memory

INSTALL_EXTRA = "pip install 'tapernorm-deploy[{extra}]'"


class RuntimeUserError(UserError):
    """A problem the user can fix; str(e) is one line: `<object>: <expected>, <found>; <fix>`."""


class RuntimeUsageError(RuntimeUserError, UsageError):
    """An option value no model makes right, or options that cannot go together: a wrong command line (exit 2)."""


class ModelFileError(RuntimeUserError):
    """The model, engine or tokenizer file is missing, unreadable or not the decode-step contract."""


class CapacityError(RuntimeUserError):
    """A request does not fit the fixed-capacity KV cache."""


class MissingExtraError(RuntimeUserError):
    """A backend needs an optional dependency (an extra of tapernorm-deploy) that is not installed."""

    def __init__(self, backend: str, extra: str, module: str, found: str | None = None):
        found = found or f"{module} is not importable"
        super().__init__(f"backend {backend!r} needs the {extra} extra ({found}); " + INSTALL_EXTRA.format(extra=extra))


class DeviceError(RuntimeUserError):
    """A backend needs a device (CUDA) this machine does not have."""


class DecoderSession(abc.ABC):
    """One decode-step contract over a backend; see the module docstring.

    Subclasses implement `_activate`, `_deactivate`, `_allocate(batch)`, `_run_prefill` and `_run_decode`
    (by default the steps on rows [0, B)); the checks that need no backend live here.
    """

    backend: str = "?"
    _last_inference_s: float | None = None     # set by the backend around its engine call

    def __init__(self) -> None:
        self.spec: DecodeContract | None = None
        self.batch: int = 0
        self.is_active = False

    # --- lifecycle ---------------------------------------------------------------

    def activate(self) -> "DecoderSession":
        if not self.is_active:
            self._activate()
            self.is_active = True
        return self

    def deactivate(self) -> None:
        if self.is_active:
            self._deactivate()
            self.batch = 0
            self.is_active = False

    def __enter__(self) -> "DecoderSession":
        return self.activate()

    def __exit__(self, *exc) -> None:
        self.deactivate()

    def reset(self, batch: int) -> None:
        """Prepare the caches for `batch` sequences. Buffers are reallocated only when the
        batch size changes; old contents need no clearing (a slot is always written
        before any query can see it)."""
        if not self.is_active:
            raise RuntimeError(f"{type(self).__name__}.reset: call activate() (or use `with`) first")
        if batch < 1:
            raise ValueError(f"batch is {batch}; expected >= 1")
        if batch != self.batch:
            check_memory(self.spec.cache_bytes(batch), f"{self.backend} session: the KV caches for batch {batch} "
                         f"(capacity {self.spec.capacity})", "use a smaller batch or a model of smaller capacity")
            self._allocate(batch)
            self.batch = batch

    # --- steps -------------------------------------------------------------------

    def last_inference_time(self) -> float | None:
        """Seconds of this session's last engine call (None before the first). The call is the
        backend's: ONNX Runtime's run_with_iobinding; TensorRT's inputs in, execute, logits out
        and the stream synchronized; PyTorch's forward (or graph replay) through the logits copy."""
        return self._last_inference_s

    def step(self, feeds: dict) -> dict:
        """The contract as a step function for core.decode.DecodeDriver(owns_caches=True):
        {input_ids [B, T], position [B]} -> {logits [B, T, V]}; the caches are written in place here."""
        ids, pos = feeds[INPUT_IDS], feeds[POSITION]
        if ids.shape[1] == 1:          # the decode path: buffers bound once, nothing allocated
            return {LOGITS: self.decode_step(ids[:, 0], pos)[:, None]}
        return {LOGITS: self.prefill(ids, pos)}

    def prefill(self, input_ids: np.ndarray, position: np.ndarray | None = None, logits_from: int = 0) -> np.ndarray:
        """input_ids int64 [B, T] written at position (default 0) -> logits [B, T - logits_from, V] of the positions
        [logits_from, T) (may be reused); see prefill_rows for logits_from."""
        input_ids, position = self._prefill_args(input_ids, position, logits_from)
        b, t = input_ids.shape
        self._check(b, t, position)
        self._check_prompt(b, t, position)
        return self._prefill_from(0, input_ids, position, logits_from)

    def decode_step(self, tokens: np.ndarray, position: np.ndarray) -> np.ndarray:
        """tokens int64 [B] written at position [B] -> next-token logits [B, V] (may be reused)."""
        self._check(len(tokens), 1, position)
        return self._run_decode(tokens, position)

    def check_decode_run(self, batch: int, position: np.ndarray, steps: int) -> None:
        """Check a whole run of `steps` one-token decode steps at once: step k writes slot
        position[b] + k. A loop that calls this may then use decode_step_unchecked."""
        self._check(batch, steps, position)

    def decode_step_unchecked(self, tokens: np.ndarray, position: np.ndarray) -> np.ndarray:
        """decode_step without its batch / capacity checks, for a loop that ran check_decode_run
        over all its steps (runtime.generate.decode_n_tokens): a few microseconds less per token."""
        return self._run_decode(tokens, position)

    # --- steps on part of the batch ---------------------------------------------------

    row_steps: bool = False     # True where the backend implements _run_prefill_rows / _run_decode_rows

    def prefill_rows(self, start: int, input_ids: np.ndarray, position: np.ndarray | None = None,
                     logits_from: int = 0) -> np.ndarray:
        """prefill on rows [start, start + B) of the caches only: input_ids int64 [B, T] -> logits
        [B, T - logits_from, V] of the positions [logits_from, T). A graph that takes the contract's optional
        logits_from input (export.build's ONNX Runtime CPU graphs) computes only those; any other backend
        computes every position's and returns a view of the tail: the same values either way."""
        input_ids, position = self._prefill_args(input_ids, position, logits_from)
        b, t = input_ids.shape
        self._check(b, t, position, start)
        self._check_prompt(b, t, position)
        return self._prefill_from(start, input_ids, position, logits_from)

    def _prefill_args(self, input_ids, position, logits_from: int) -> tuple[np.ndarray, np.ndarray]:
        input_ids = np.ascontiguousarray(input_ids, dtype=np.int64)
        b, t = input_ids.shape
        if not 0 <= logits_from < t:
            raise ValueError(f"{self.backend} session: logits_from {logits_from} for a {t}-token step; expected "
                             f"0 <= logits_from < {t}")
        position = np.zeros(b, np.int64) if position is None else np.ascontiguousarray(position, dtype=np.int64)
        return input_ids, position

    def _prefill_from(self, start: int, input_ids: np.ndarray, position: np.ndarray, logits_from: int) -> np.ndarray:
        cut = logits_from if self.spec.takes_logits_from else 0       # the positions the graph leaves out itself
        args = (input_ids, position, cut) if cut else (input_ids, position)     # (backends without it: 2 args)
        if start == 0 and len(input_ids) == self.batch:
            logits = self._run_prefill(*args)
        else:
            logits = self._run_prefill_rows(start, *args)
        return logits[:, logits_from - cut:]

    def decode_rows(self, start: int, tokens: np.ndarray, position: np.ndarray) -> np.ndarray:
        """decode_step on rows [start, start + B) of the caches only: tokens [B], position [B] -> logits [B, V]."""
        tokens = np.ascontiguousarray(tokens, dtype=np.int64)
        position = np.ascontiguousarray(position, dtype=np.int64)
        self._check(len(tokens), 1, position, start)
        if start == 0 and len(tokens) == self.batch:
            return self._run_decode(tokens, position)
        return self._run_decode_rows(start, tokens, position)

    def _run_prefill_rows(self, start: int, input_ids: np.ndarray, position: np.ndarray) -> np.ndarray:
        raise NotImplementedError(f"{self.backend} session: no steps on part of the batch (row_steps is False)")

    def _run_decode_rows(self, start: int, tokens: np.ndarray, position: np.ndarray) -> np.ndarray:
        raise NotImplementedError(f"{self.backend} session: no steps on part of the batch (row_steps is False)")

    def _check(self, b: int, t: int, position: np.ndarray, start: int | None = None) -> None:
        if start is not None:
            if start < 0 or b < 1 or start + b > self.batch:
                raise ValueError(f"{self.backend} session: rows [{start}, {start + b}) given, the cache holds "
                                 f"rows [0, {self.batch}); call reset() with a larger batch first")
        elif b != self.batch:
            raise ValueError(f"{self.backend} session: batch {b} given, the cache holds {self.batch}; call reset({b}) first")
        if len(position) != b:
            raise ValueError(f"{self.backend} session: {len(position)} positions for {b} sequences; give one each")
        last = int(position.max()) + t
        if int(position.min()) < 0 or last > self.spec.capacity:
            raise CapacityError(f"{self.backend} session: positions + {t} tokens must lie in [0, {self.spec.capacity}] "
                                f"(the cache capacity), found up to {last}; start a new sequence with reset()")

    def _check_prompt(self, b: int, t: int, position: np.ndarray) -> None:
        """A backend's own rule for a multi-token step of b sequences (none here). Apart from _check,
        which also checks a whole run of one-token decode steps (check_decode_run) by its length."""

    # --- backend hooks -----------------------------------------------------------

    @abc.abstractmethod
    def _activate(self) -> None: ...

    @abc.abstractmethod
    def _deactivate(self) -> None: ...

    @abc.abstractmethod
    def _allocate(self, batch: int) -> None: ...

    def _run_prefill(self, input_ids: np.ndarray, position: np.ndarray) -> np.ndarray:
        return self._run_prefill_rows(0, input_ids, position)        # the whole batch: rows [0, B)

    def _run_decode(self, tokens: np.ndarray, position: np.ndarray) -> np.ndarray:
        return self._run_decode_rows(0, tokens, position)
