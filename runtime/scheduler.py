"""In-flight batching over one DecoderSession: a fixed pool of cache slots, newcomers joining
the running batch at the next step, every token delivered as it is produced.

    session = OrtSession("build/dyt").activate()
    scheduler = BatchScheduler(session, slots=8, max_queued=32)    # session.reset(8): the pool
    scheduler.start()                                               # the step loop, in its own thread
    seq = scheduler.submit(prompt_ids, GenerationConfig(max_new_tokens=64, seed=1))
    for token in seq.stream(timeout_s=60): ...                      # as produced
    scheduler.close()

The pool. Slot i is row i of every cache [slots, H, S_max, D] of the session, allocated once.
A sequence owns one slot from its prefill until it finishes (stop token, max_new_tokens,
cancellation, error); the slot is free again in the same step.

One step (`step()`; the loop thread runs it while there is work):
  1. drop cancelled sequences, waiting or running (a prompt half prefilled included): their
     slots are free at once;
  2. prefill, while the step's budget (`prefill_tokens` padded tokens) lasts, one piece at
     least. A piece is at most `prefill_chunk` tokens of one prompt: a longer prompt is
     prefilled over several steps, one chunk per step, `session.prefill_rows(slot, ids [1, c],
     position [tokens done])`, so the running sequences get a token between its chunks;
     its first token comes after its last chunk. First the next chunk of each prompt being
     prefilled (alone: ONNX Runtime's GroupQueryAttention continues a prompt at batch 1 only),
     then newcomers: the first waiting sequences (first come, first served) that fit the
     rest of the budget go into the lowest free slots, longest first piece in the lowest,
     and rows of similar lengths in contiguous slots are ONE call (`prefill_groups`: the cut
     of least padding plus per-call cost), `prefill_rows(slot, ids [n, T_max])`, right-padded
     as runtime.generate pads a batch: a call has a fixed cost (PREFILL_CALL_TOKENS, the weights
     read once more), and past a few tokens a prefill is compute-bound, each token, padded or
     not, costing about the same at 1 row or 16. The calls run smallest first (the least TTFT in total). Each
     row's first token is sampled from the logits at its own last prompt token and
     delivered (TTFT); the call asks the graph for the logits from the earliest such token on
     (`logits_from`: a graph that takes it skips the LM head for the positions before). The budget counts rows x T_max of each call;
  3. one decode step over rows [0, hi), hi = highest slot past its prefill + 1:
     `session.decode_rows(0, tokens [hi], position [hi])`; a free row below hi is fed
     token 0 at position 0 (its contents are garbage anyway), a row in the middle of its
     chunks token 0 at its next chunk's position (which that chunk overwrites); each running
     sequence's token is sampled with its own settings and its own generator and delivered.

Why prefill cannot corrupt other slots: a step on rows [a, b) binds views of exactly those
rows of the caches (runtime/session.py), so another slot is neither read nor written. The
rows of a freed slot keep their old contents; a newcomer's prefill overwrites positions
[0, len) and each decode step writes position p before any query can see it (query t
attends to slots j <= position + t), as right padding does in runtime.generate: the padding
of a shorter row writes positions past its piece, which its next chunk or decode step
overwrites before any query reads them.

Same tokens as `python -m runtime.generate` for one prompt alone, whatever else is in the
batch: sequence b's prompt tokens and then its token k are written at the positions generate
writes them (len_b + k), and sampling draws from np.random.default_rng(seed) once per token,
in the order generate draws for a batch of one. The prefill and decode logits are computed
in a batch of several rows (and a long prompt in chunks) instead of one call at batch 1;
rows do not interact, and where float rounding differs with the batch size only a near-tie
can pick another token (tests/runtime/greedy.py).

Back-pressure: the scheduler holds at most `slots + max_queued` sequences (running plus
waiting); `submit` beyond that raises ServerBusy at once. A request that cannot fit the
cache raises CapacityError at submit (runtime.generate's check_capacity).
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import queue
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import numpy as np

from runtime.generate import GenerationConfig, check_capacity
from runtime.sampling import log_softmax, penalize, sample, top_logprobs
from runtime.session import DecoderSession, RuntimeUserError

STOP, LENGTH, CANCELLED, ERROR = "stop", "length", "cancelled", "error"   # why a sequence finished
PREFILL_TOKENS = 512          # padded prompt tokens prefilled per step (one piece at least): bounds the stall
                              # a burst of newcomers puts on the running sequences' next token
PREFILL_CHUNK = 256           # the most tokens of one prompt prefilled in a step: a longer one takes several
PREFILL_CALL_TOKENS = 2       # one more prefill call costs about as much as this many more prompt tokens: on the
                              # 1B int4 build (ORT CPU, 2 threads, AVX2, a quiet machine) prefill_rows of rows x T
                              # from [1, 3] to [16, 13] took 13.1 ms a token plus ~28 ms a call (and ~2 ms a row):
                              # padding a short prompt to a longer one's length costs more than a call of its own
CANCEL_POLL_S = 0.02          # a sequence's cancelled_by() is asked at most this often: an IPC call in Triton (~60-90 us)


class ServerBusy(RuntimeUserError):
    """Every slot is running and the queue is full."""


class SchedulerClosed(RuntimeUserError):
    """The scheduler was closed (the server is shutting down)."""


@dataclass(eq=False)
class Sequence:
    """One request in the scheduler. Read its fields after `done` is set (or from a listener)."""
    prompt: list[int]
    config: GenerationConfig
    listener: Callable[["Sequence", int | None], None] | None = None   # (seq, new token or None at a
                                                                       # finish without one); from the loop thread
    cancelled_by: Callable[[], bool] | None = None                     # polled: True cancels the sequence
    stop_when: Callable[[int], bool] | None = None                     # given each new token: True ends the
                                                                       # sequence there (STOP: a stop string)
    tokens: list[int] = field(default_factory=list)                    # new tokens, a stop token included
    logits: list[np.ndarray] = field(default_factory=list)             # [V] per new token, with config.keep_logits
    finish: str | None = None                                          # STOP | LENGTH | CANCELLED | ERROR
    error: str | None = None                                           # for ERROR and CANCELLED: why
    slot: int | None = None
    position: int = 0                                                  # where the next decode writes its token
    # with config.logprobs: per new token (logprob, top ids, their logprobs) of the step's raw logits; else None
    logprobs: list[tuple[float, list[int], list[float]]] | None = None
    prompt_logprobs: list[float] = field(default_factory=list)        # with config.prompt_logprobs
    # with config.prompt_logprobs and config.logprobs k > 0: (ids [T][k], logprobs [T][k]) (prompt_top_logprobs)
    prompt_top_logprobs: tuple[list[list[int]], list[list[float]]] | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.rng = np.random.default_rng(self.config.seed)           # as runtime.generate: one generator, seeded
        self.stop = frozenset(self.config.stop_tokens)
        if self.config.logprobs is not None:
            self.logprobs = []
        self._events: queue.SimpleQueue | None = queue.SimpleQueue() if self.listener is None else None
        self._cancel = threading.Event()
        self._polled_s = 0.0

    def cancel(self, why: str = "cancelled by the client") -> None:
        """Ask the scheduler to drop this sequence; its slot is freed at the next step."""
        self.error = self.error or why
        self._cancel.set()

    def stream(self, timeout_s: float | None = None) -> Iterator[int]:
        """The new tokens as they are produced (without a listener only); ends when the sequence finishes."""
        if self._events is None:
            raise RuntimeError("Sequence.stream: this sequence has a listener; its tokens go there")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                token = self._events.get(timeout=left)
            except queue.Empty:
                raise TimeoutError(f"no token within {timeout_s} s") from None
            if token is None:
                return
            yield token

    def _emit(self, token: int | None) -> None:
        if self.listener is not None:
            self.listener(self, token)
        else:
            if token is not None:
                self._events.put(token)
            if self.finish is not None:
                self._events.put(None)

    def _wants_cancel(self, now: float) -> bool:
        if self._cancel.is_set():
            return True
        if self.cancelled_by is not None and now - self._polled_s >= CANCEL_POLL_S:
            self._polled_s = now
            if self.cancelled_by():
                self.cancel("the client cancelled or disconnected")
                return True
        return False


@dataclass
class SchedulerStats:
    """Counters since start (read them from any thread; a snapshot is `stats()`)."""
    refused_busy: int = 0
    finished: dict = field(default_factory=lambda: {STOP: 0, LENGTH: 0, CANCELLED: 0, ERROR: 0})
    steps: int = 0               # decode steps
    rows_run: int = 0            # rows the decode steps computed (hi per step)
    rows_running: int = 0        # of which held a running sequence
    prefill_s: float = 0.0
    decode_s: float = 0.0        # decode_rows calls
    peak_running: int = 0
    peak_waiting: int = 0


class BatchScheduler:
    """See the module docstring. `session` must be active and implement steps on rows (row_steps)."""

    def __init__(self, session: DecoderSession, slots: int = 8, max_queued: int = 32,
                 prefill_tokens: int = PREFILL_TOKENS, prefill_chunk: int = PREFILL_CHUNK):
        if not session.is_active:
            raise RuntimeError("BatchScheduler: activate the session first")
        if not session.row_steps:
            raise RuntimeUserError(f"backend {session.backend!r}: the batch scheduler needs steps on part of the "
                                   "batch (row_steps), which this backend does not implement; use ort, trt or torch")
        if slots < 1 or max_queued < 0 or prefill_tokens < 1 or prefill_chunk < 1:
            raise ValueError(f"slots {slots}, max_queued {max_queued}, prefill_tokens {prefill_tokens}, prefill_chunk "
                             f"{prefill_chunk}: expected slots >= 1, max_queued >= 0, prefill_tokens >= 1, "
                             "prefill_chunk >= 1")
        self.session = session
        self.slots = slots
        self.max_queued = max_queued
        self.prefill_tokens = prefill_tokens
        self.prefill_chunk = min(prefill_chunk, prefill_tokens)      # a piece never exceeds a step's budget
        session.reset(slots)
        self._running: list[Sequence | None] = [None] * slots          # slot -> sequence
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._lock = threading.Condition()
        self._n_running = 0          # under _lock: what submit() counts against the limit
        self._closed = False
        self._thread: threading.Thread | None = None
        self._stats = SchedulerStats()

    # --- any thread -------------------------------------------------------------------------

    def submit(self, prompt: list[int], config: GenerationConfig,
               listener: Callable[[Sequence, int | None], None] | None = None,
               cancelled_by: Callable[[], bool] | None = None,
               stop_when: Callable[[int], bool] | None = None) -> Sequence:
        """Queue one prompt (token ids); it joins the running batch at a coming step. stop_when, if
        given, sees each new token before the scheduler decides whether it ends the sequence.

        Raises RuntimeUserError for bad settings, CapacityError when prompt + max_new_tokens
        does not fit the cache, ServerBusy when slots + max_queued sequences are held.
        """
        try:
            config.sampling.validate()
        except ValueError as e:
            raise RuntimeUserError(f"sampling: {e}; fix the request") from None
        check_capacity(self.session.spec.capacity, [len(prompt)], config.max_new_tokens)
        seq = Sequence(list(prompt), config, listener=listener, cancelled_by=cancelled_by, stop_when=stop_when)
        with self._lock:
            if self._closed:
                raise SchedulerClosed("generate: expected a running scheduler, found it closed (server shutting "
                                      "down); retry on another server")
            held = self._n_running + len(self._waiting)
            if held >= self.slots + self.max_queued:
                self._stats.refused_busy += 1
                raise ServerBusy(f"server busy: expected room for one more request, found {self._n_running} "
                                 f"running and {len(self._waiting)} queued (the most this scheduler holds: "
                                 f"{self.slots} running + {self.max_queued} queued); retry later, or add model "
                                 "instances or servers")
            self._waiting.append(seq)
            self._stats.peak_waiting = max(self._stats.peak_waiting, len(self._waiting))
            self._lock.notify()
        return seq

    def pool(self) -> tuple[int, int]:
        """(running, waiting) now."""
        with self._lock:
            return self._n_running, len(self._waiting)

    def stats(self) -> SchedulerStats:
        with self._lock:
            return replace(self._stats, finished=dict(self._stats.finished))

    def start(self) -> "BatchScheduler":
        """Run the step loop in a daemon thread until close()."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="batch-scheduler", daemon=True)
            self._thread.start()
        return self

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the loop; sequences still waiting or running finish as CANCELLED."""
        with self._lock:
            self._closed = True
            self._lock.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None
        for seq in [s for s in self._running if s is not None] + list(self._waiting):
            seq.cancel("the server is shutting down")
            self._finish(seq, CANCELLED)
        with self._lock:
            self._waiting.clear()

    # --- the loop thread (or a test calling step()) ------------------------------------------

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._closed and not self._waiting and self._n_running == 0:
                    self._lock.wait()
                if self._closed:
                    return
            self.step()

    def step(self) -> None:
        """Drop cancelled sequences, prefill (chunks of long prompts, newcomers), run one decode step."""
        self._drop_cancelled()
        self._prefill_step()
        self._decode()

    def _drop_cancelled(self) -> None:
        now = time.monotonic()
        for seq in [s for s in self._running if s is not None]:
            if seq._wants_cancel(now):
                self._finish(seq, CANCELLED)
        with self._lock:
            gone = [s for s in self._waiting if s._wants_cancel(now)]
            for seq in gone:
                self._waiting.remove(seq)
        for seq in gone:
            self._finish(seq, CANCELLED)

    def _prefill_step(self) -> None:
        """This step's prefill calls within the budget (one piece at least): the next chunk of each
        prompt already being prefilled, alone (lowest slot first), then newcomers, batched."""
        budget, done = self.prefill_tokens, False
        for seq in [s for s in self._running if s is not None and s.position < len(s.prompt)]:
            piece = min(self.prefill_chunk, len(seq.prompt) - seq.position)
            if done and piece > budget:
                return
            budget -= piece
            done = True
            self._prefill_call([seq])
        for call in self._admit(budget, must=not done):
            self._prefill_call(call)

    def _admit(self, budget: int, must: bool) -> list[list[Sequence]]:
        """Move the first waiting sequences (first come, first served) into free slots, as many as the
        padded tokens of their first pieces fit the budget (one at least when `must`); returns their
        prefill calls (prefill_groups)."""
        free = [i for i, s in enumerate(self._running) if s is None]
        with self._lock:
            candidates = list(itertools.islice(self._waiting, len(free)))
        pieces = [min(self.prefill_chunk, len(seq.prompt)) for seq in candidates]
        n = len(candidates)
        while n:
            calls = prefill_groups(pieces[:n], free[:n])
            if sum(len(rows) * max(pieces[i] for i, _ in rows) for rows in calls) <= budget or (n == 1 and must):
                break
            n -= 1
        if not n:
            return []
        with self._lock:
            for seq, slot in [(candidates[i], slot) for rows in calls for i, slot in rows]:
                self._waiting.popleft()
                seq.slot = slot
                self._running[slot] = seq
            self._n_running += n
            self._stats.peak_running = max(self._stats.peak_running, self._n_running)
        calls.sort(key=lambda rows: len(rows) * pieces[rows[0][0]])                   # smallest first: less TTFT
        return [[candidates[i] for i, _ in rows] for rows in calls]

    def _prefill_call(self, seqs: list[Sequence]) -> None:
        """One prefill_rows call over the contiguous slots of `seqs`: each row's next piece (at most
        prefill_chunk tokens from its position), right-padded to the longest; a row whose prompt is
        then complete gets its first token from the logits at its own last prompt token."""
        pieces = [min(self.prefill_chunk, len(seq.prompt) - seq.position) for seq in seqs]
        ids = np.zeros((len(seqs), max(pieces)), np.int64)                                    # [B, T_max]
        for b, (seq, n) in enumerate(zip(seqs, pieces)):
            ids[b, :n] = seq.prompt[seq.position:seq.position + n]
        # the logits asked of the graph: from the first position a row needs on (its last prompt token, or every
        # token for prompt logprobs); a row that only continues its prompt needs none
        ends = [n - 1 for seq, n in zip(seqs, pieces) if seq.position + n == len(seq.prompt)]
        every = any(seq.config.prompt_logprobs for seq in seqs)
        logits_from = 0 if every else min(ends, default=max(pieces) - 1)
        t0 = time.perf_counter()
        try:
            tail = self.session.prefill_rows(seqs[0].slot, ids, np.array([s.position for s in seqs], np.int64),
                                             logits_from)                     # [B, T_max - logits_from, V]
            for b, (seq, n) in enumerate(zip(seqs, pieces)):
                if seq.config.prompt_logprobs:
                    add_prompt_logprobs(seq, tail[b, :n])
        except Exception as e:  # a backend failure ends the sequences of this call only
            for seq in seqs:
                seq.error = f"internal error in prefill: {type(e).__name__}: {e}"
                self._finish(seq, ERROR)
            return
        first = []
        for b, (seq, n) in enumerate(zip(seqs, pieces)):
            seq.position += n
            if seq.position < len(seq.prompt):
                continue                                               # more chunks at the coming steps
            logits = tail[b:b + 1, n - 1 - logits_from]                                        # [1, V]
            if seq.config.keep_logits:
                seq.logits.append(logits[0].copy())
            token = int(sample(logits, seq.config.sampling, seq.rng)[0])  # no new tokens yet: nothing to penalize
            first.append((seq, token, logits[0]))
        self._stats.prefill_s += time.perf_counter() - t0
        for seq, token, logits in first:
            self._deliver(seq, token, logits)

    def _decode(self) -> None:
        rows = [i for i, s in enumerate(self._running) if s is not None and s.tokens]          # past their prefill
        if not rows:
            return
        hi = rows[-1] + 1
        tokens = np.zeros(hi, np.int64)                                                        # [hi]
        position = np.zeros(hi, np.int64)                                                      # [hi]
        for i, seq in enumerate(self._running[:hi]):
            if seq is not None:       # a prompt in the middle of its chunks: written where its next chunk starts
                tokens[i] = seq.tokens[-1] if seq.tokens else 0
                position[i] = seq.position
        t0 = time.perf_counter()
        try:
            logits = self.session.decode_rows(0, tokens, position)                            # [hi, V]
        except Exception as e:  # the step failed for every running sequence; the scheduler goes on
            for i in rows:
                self._running[i].error = f"internal error in decode: {type(e).__name__}: {e}"
                self._finish(self._running[i], ERROR)
            return
        self._stats.decode_s += time.perf_counter() - t0
        plain = [i for i in rows if self._running[i].config.sampling.greedy
                 and not self._running[i].config.sampling.penalized]                          # a bare argmax
        picked = dict(zip(plain, logits[plain].argmax(axis=-1).tolist())) if plain else {}
        for i in rows:
            seq = self._running[i]
            seq.position += 1
            if seq.config.keep_logits:
                seq.logits.append(logits[i].copy())
            if i in picked:
                token = picked[i]
            else:
                sampling = seq.config.sampling
                scores = penalize(logits[i:i + 1], sampling, [seq.tokens]) if sampling.penalized else logits[i:i + 1]
                token = int(scores[0].argmax()) if sampling.greedy else int(sample(scores, sampling, seq.rng)[0])
            self._deliver(seq, token, logits[i])
        self._stats.steps += 1
        self._stats.rows_run += hi
        self._stats.rows_running += len(rows)

    def _deliver(self, seq: Sequence, token: int, logits: np.ndarray) -> None:
        """Append a token (and its logprobs from the step's raw logits [V], when asked), decide whether
        it ends the sequence, then hand it to the client."""
        try:
            if seq.logprobs is not None:
                seq.logprobs.append(top_logprobs(logits, token, seq.config.logprobs))
            seq.tokens.append(token)
            if token in seq.stop or (seq.stop_when is not None and seq.stop_when(token)):
                seq.finish = STOP
            elif len(seq.tokens) >= seq.config.max_new_tokens:
                seq.finish = LENGTH
        except Exception as e:  # the request's own hook failed: this sequence ends, the others go on
            seq.error = f"internal error after a token: {type(e).__name__}: {e}"
            self._finish(seq, ERROR)
            return
        try:
            seq._emit(token)
        except Exception as e:  # the client's sink failed (e.g. it disconnected): drop the sequence
            seq.finish = None
            seq.cancel(f"delivering a token failed: {type(e).__name__}: {e}")
            self._finish(seq, CANCELLED)
            return
        if seq.finish is not None:
            self._release(seq)

    def _finish(self, seq: Sequence, why: str) -> None:
        """End a sequence without a new token (cancelled, error, shutdown) and free its slot."""
        if seq.done.is_set():
            return
        seq.finish = why
        with contextlib.suppress(Exception):    # the client is gone; nothing more to tell it
            seq._emit(None)
        self._release(seq)

    def _release(self, seq: Sequence) -> None:
        with self._lock:
            if seq.slot is not None and self._running[seq.slot] is seq:
                self._running[seq.slot] = None
                self._n_running -= 1
            self._stats.finished[seq.finish] += 1
        seq.done.set()


def prefill_groups(pieces: list[int], free: list[int]) -> list[list[tuple[int, int]]]:
    """Newcomers' first pieces (token counts, first come first) in the free slots `free` (ascending, one
    each) as prefill calls: lists of (index into pieces, slot), in slot order. The longest piece goes to
    the lowest slot, and the rows, so sorted, are cut into the calls of least estimated cost, the sum
    over calls of PREFILL_CALL_TOKENS + rows x longest piece: a short row joins longer ones while the
    padding it computes costs less than a call of its own. A call never spans a slot that is not free."""
    order = sorted(range(len(pieces)), key=lambda i: -pieces[i])                         # stable: ties first come
    slots = free[:len(order)]
    best = [0.0] + [float("inf")] * len(order)      # best[j]: the least cost of the first j rows (sorted)
    start = [0] * (len(order) + 1)                  # start[j]: where the last call of that cut begins
    for j in range(1, len(order) + 1):
        for i in range(j - 1, -1, -1):              # the last call: rows [i, j), longest first
            if i < j - 1 and slots[i + 1] != slots[i] + 1:
                break
            cost = best[i] + PREFILL_CALL_TOKENS + (j - i) * pieces[order[i]]
            if cost < best[j]:
                best[j], start[j] = cost, i
    calls, j = [], len(order)
    while j:
        calls.append([(order[k], slots[k]) for k in range(start[j], j)])
        j = start[j]
    return calls[::-1]


def add_prompt_logprobs(seq: Sequence, logits: np.ndarray) -> None:
    """Extend seq's prompt logprobs (and top alternatives with config.logprobs > 0) with a piece's logits
    [n, V] for prompt tokens [position, position + n): row t predicts prompt token position + t + 1, as
    runtime.generate's prompt_token_logprobs / prompt_top_logprobs over the whole prompt at once."""
    p, k = seq.position, seq.config.logprobs
    if p == 0:
        seq.prompt_logprobs = [float("nan")]                                  # nothing predicts the first token
        if k:
            seq.prompt_top_logprobs = ([[-1] * k], [[float("nan")] * k])
    rows = logits[:len(seq.prompt) - 1 - p]                    # the last prompt token's row predicts a new token
    nxt = seq.prompt[p + 1:p + 1 + len(rows)]
    seq.prompt_logprobs += log_softmax(rows)[np.arange(len(rows)), nxt].tolist()
    if k:
        for row in rows:
            _, top, top_lp = top_logprobs(row, 0, k)
            seq.prompt_top_logprobs[0].append(top)
            seq.prompt_top_logprobs[1].append(top_lp)
