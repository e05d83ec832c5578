"""The batch scheduler (runtime/scheduler.py) and the row steps it runs on: a step on some rows
leaves the others' caches untouched; every sequence gets runtime.generate's tokens whatever
else is in the batch; slots are freed at once; back-pressure, cancellation and failures."""
from __future__ import annotations

import numpy as np
import pytest

from runtime.generate import GenerationConfig, generate
from runtime.ort_session import OrtSession
from runtime.sampling import SamplingConfig
from runtime.scheduler import CANCELLED, ERROR, LENGTH, STOP, BatchScheduler, SchedulerClosed, ServerBusy
from runtime.session import CapacityError, DecoderSession, RuntimeUserError
from runtime.torch_session import TorchSession
from tests.runtime.greedy import compare_greedy

RNG = np.random.default_rng(0)
# lengths 3..12, max tokens 3..30, greedy and sampled, one stop token: every case at once
PROMPTS = [RNG.integers(0, 320, n).tolist() for n in (3, 7, 1, 5, 12, 2, 9, 4, 6, 10)]
SETTINGS = [(12, (0.0, 0, 1.0)), (20, (1.0, 40, 0.95)), (5, (0.0, 0, 1.0)), (30, (0.7, 0, 1.0)), (8, (0.0, 0, 1.0)),
            (16, (1.3, 5, 1.0)), (25, (0.0, 0, 1.0)), (3, (0.0, 0, 1.0)), (18, (1.0, 0, 0.5)), (10, (0.0, 0, 1.0))]


def _configs(stop: tuple[int, ...] = ()) -> list[GenerationConfig]:
    return [GenerationConfig(max_new_tokens=n, seed=i, sampling=SamplingConfig(*s), stop_tokens=stop, keep_logits=True)
            for i, (n, s) in enumerate(SETTINGS)]


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """torch's default (one thread per core) spins against the other tests' processes on a shared
    machine: 40x slower steps here; one thread is what these tiny models need."""
    import torch
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _session(kind, tiny) -> DecoderSession:
    ckpt, build = tiny
    return OrtSession(build, intra_op_threads=1) if kind == "ort" else TorchSession(ckpt)


def _caches(session) -> list[np.ndarray]:
    """Copies of every cache [B, H, S_max, D] of an active session."""
    if isinstance(session, OrtSession):
        return [session.cache_array(n).copy() for n in session.spec.cache_names()]
    if session.backend == "trt":
        return [session.caches[n].cpu().numpy() for n in session.spec.cache_names()]
    return [t.clone().numpy() for kv in session.cache for t in kv]


def _run(scheduler: BatchScheduler, seqs) -> None:
    for _ in range(10_000):
        if all(s.done.is_set() for s in seqs):
            return
        scheduler.step()
    raise AssertionError("sequences did not finish")


@pytest.mark.parametrize("kind", ["ort", "torch"])
def test_row_steps_read_and_write_only_their_rows(tiny, kind):
    """prefill_rows / decode_rows on some rows: the other rows' caches are unchanged bit for bit,
    and the logits are those of the same prompt run alone at batch 1."""
    with _session(kind, tiny) as s, _session(kind, tiny) as alone:
        s.reset(4)
        s.prefill(RNG.integers(0, 320, (4, 9)))                          # every row holds something
        before = _caches(s)
        ids = np.array([PROMPTS[1]])                                     # [1, 7]
        got = s.prefill_rows(2, ids).copy()
        after = _caches(s)
        for b, a in zip(before, after):
            np.testing.assert_array_equal(a[[0, 1, 3]], b[[0, 1, 3]])    # other rows untouched
            assert not np.array_equal(a[2, :, :7], b[2, :, :7])          # row 2 written
            np.testing.assert_array_equal(a[2, :, 7:], b[2, :, 7:])      # ... at positions [0, 7) only
        alone.reset(1)
        np.testing.assert_array_equal(got, alone.prefill(ids))           # the same computation as batch 1
        before = after
        logits = s.decode_rows(1, np.array([5, 6]), np.array([9, 7])).copy()   # rows 1, 2
        after = _caches(s)
        for b, a in zip(before, after):
            np.testing.assert_array_equal(a[[0, 3]], b[[0, 3]])
        want = alone.decode_step(np.array([6]), np.array([7]))[0]
        np.testing.assert_allclose(logits[1], want, rtol=0, atol=1e-5)   # fp32, batch 2 vs 1: rounding only
        with pytest.raises(ValueError, match=r"rows \[3, 5\)"):
            s.decode_rows(3, np.array([1, 2]), np.array([0, 0]))


def _gpu_session(kind, build, tmp_path) -> DecoderSession:
    """An inactive ORT CUDA or TensorRT session of the build (TensorRT's engine built in a linked copy);
    skips with the reason where this machine cannot run it."""
    import importlib.util
    import os
    import shutil
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device (torch.cuda.is_available() is False)")
    if kind == "ort-cuda":
        import onnxruntime as ort
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            pytest.skip("onnxruntime-gpu (CUDAExecutionProvider) is not installed: pip install 'tapernorm-deploy[gpu]'")
        return OrtSession(build, device="cuda")
    if importlib.util.find_spec("tensorrt") is None:
        pytest.skip("tensorrt is not installed: pip install 'tapernorm-deploy[tensorrt]'")
    from runtime.trt_engine import BuildOptions
    from runtime.trt_session import TrtSession
    shutil.copytree(build, tmp_path / "build", copy_function=os.link)
    return TrtSession(tmp_path / "build", options=BuildOptions(max_batch=4))


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["ort-cuda", "trt"])
def test_gpu_row_steps_touch_only_their_rows(tiny, kind, tmp_path):
    """The row steps the scheduler runs on, on a GPU: the other rows' caches unchanged bit for bit,
    each row's logits those of ORT on the CPU at batch 1 (atol 1e-3: other kernels), and a whole-batch
    step after row steps still right (TensorRT rebinds its decode context)."""
    with _gpu_session(kind, tiny[1], tmp_path) as s, OrtSession(tiny[1], intra_op_threads=1) as cpu:
        s.reset(4), cpu.reset(1)
        s.prefill(RNG.integers(0, 320, (4, 9)))
        before = _caches(s)
        ids = np.array([PROMPTS[1]])                                     # [1, 7] into row 2
        np.testing.assert_allclose(s.prefill_rows(2, ids), cpu.prefill(ids), rtol=0, atol=1e-3)
        after = _caches(s)
        for b, a in zip(before, after):
            np.testing.assert_array_equal(a[[0, 1, 3]], b[[0, 1, 3]])
        logits = s.decode_rows(1, np.array([5, 6]), np.array([9, 7])).copy()     # rows 1, 2
        for b, a in zip(after, _caches(s)):
            np.testing.assert_array_equal(a[[0, 3]], b[[0, 3]])
        np.testing.assert_allclose(logits[1], cpu.decode_step(np.array([6]), np.array([7]))[0], rtol=0, atol=1e-3)
        full = s.decode_step(np.array([1, 2, 3, 4]), np.array([10, 10, 8, 10]))
        np.testing.assert_allclose(full[2], cpu.decode_step(np.array([3]), np.array([8]))[0], rtol=0, atol=1e-3)


@pytest.mark.parametrize("kind", ["ort", "torch"])
def test_every_sequence_gets_its_solo_tokens_whatever_else_is_in_the_batch(tiny, kind):
    """10 prompts of mixed lengths, max tokens and sampling settings through 4 slots, newcomers
    joining at different steps: each equals runtime.generate of that prompt alone (greedy up to
    a tie, tests/runtime/greedy.py; seeded sampling: the same draws)."""
    configs = _configs()
    with _session(kind, tiny) as s:
        want = [generate(s, [p], c) for p, c in zip(PROMPTS, configs)]
    with _session(kind, tiny) as s:
        scheduler = BatchScheduler(s, slots=4, max_queued=10)
        seqs = []
        for i, (p, c) in enumerate(zip(PROMPTS, configs)):
            seqs.append(scheduler.submit(p, c))
            if i % 3 == 0:
                scheduler.step()                                     # some join a running batch
        _run(scheduler, seqs)
        stats = scheduler.stats()
    assert stats.peak_running == 4 and stats.peak_waiting > 1 and scheduler.pool() == (0, 0)
    for seq, w, c in zip(seqs, want, configs):
        assert seq.finish == LENGTH and len(seq.tokens) == c.max_new_tokens
        if c.sampling.greedy:
            compared = compare_greedy(w.tokens[0], [row[0] for row in w.logits], seq.tokens, seq.logits)
            assert compared == c.max_new_tokens, f"only {compared} tokens compared (tie)"
        else:
            assert seq.tokens == w.tokens[0]


def test_a_finished_sequence_frees_its_slot_in_the_same_step(tiny):
    """Stop token and max tokens end a sequence at once; the next step's newcomer takes its slot,
    and each token reaches the listener in the step that produced it."""
    events, calls = [], [0]
    with _session("ort", tiny) as s:
        free = generate(s, [PROMPTS[1]], GenerationConfig(max_new_tokens=12)).tokens[0]
        scheduler = BatchScheduler(s, slots=2, max_queued=4)          # owns the session's caches from here
        stop = free[3]
        listen = lambda seq, token: events.append((seq.prompt[0], token, calls[0]))  # noqa: E731
        a = scheduler.submit(PROMPTS[1], GenerationConfig(max_new_tokens=12, stop_tokens=(stop,)), listener=listen)
        b = scheduler.submit(PROMPTS[0], GenerationConfig(max_new_tokens=30), listener=listen)
        c = scheduler.submit(PROMPTS[2], GenerationConfig(max_new_tokens=5), listener=listen)
        step = lambda: (calls.__setitem__(0, calls[0] + 1), scheduler.step())  # noqa: E731
        step()
        assert (a.slot, b.slot, c.slot) == (0, 1, None) and scheduler.pool() == (2, 1)
        while not a.done.is_set():
            step()
        assert a.finish == STOP and a.tokens == free[:free.index(stop) + 1] and scheduler.pool() == (1, 1)
        step()
        assert c.slot == 0 and scheduler.pool() == (2, 0)            # the freed slot, at the next step
        _run(scheduler, [b, c])
        assert (b.finish, c.finish) == (LENGTH, LENGTH) and scheduler.pool() == (0, 0)
    # delivered as produced: step 1 prefills (token 0) and decodes (token 1), each later step one token
    calls_of_a = [n for first, token, n in events if first == PROMPTS[1][0]]
    assert calls_of_a == [1] + list(range(1, len(a.tokens))) and len(a.tokens) >= 3


def test_cancelled_sequences_free_their_slot_at_the_next_step(tiny, monkeypatch):
    monkeypatch.setattr("runtime.scheduler.CANCEL_POLL_S", 0.0)      # poll cancelled_by at every step
    with _session("ort", tiny) as s:
        scheduler = BatchScheduler(s, slots=2, max_queued=4)
        running = scheduler.submit(PROMPTS[0], GenerationConfig(max_new_tokens=30))
        polled = {"gone": False}
        by_client = scheduler.submit(PROMPTS[1], GenerationConfig(max_new_tokens=30), cancelled_by=lambda: polled["gone"])
        waiting = scheduler.submit(PROMPTS[2], GenerationConfig(max_new_tokens=30))
        queued_then_cancelled = scheduler.submit(PROMPTS[3], GenerationConfig(max_new_tokens=30))
        scheduler.step()
        scheduler.step()
        assert scheduler.pool() == (2, 2)
        running.cancel()
        queued_then_cancelled.cancel()
        polled["gone"] = True                      # e.g. Triton's request.is_cancelled()
        scheduler.step()
        assert running.finish == by_client.finish == queued_then_cancelled.finish == CANCELLED
        assert "disconnected" in by_client.error and len(running.tokens) == 3      # prefill + 2 decode steps
        assert waiting.slot == 0 and scheduler.pool() == (1, 0)
        _run(scheduler, [waiting])
        assert scheduler.pool() == (0, 0) and scheduler.stats().finished == {STOP: 0, LENGTH: 1, CANCELLED: 3, ERROR: 0}


def test_full_pool_and_queue_refuse_with_server_busy_and_limits_are_checked(tiny):
    with _session("ort", tiny) as s:
        scheduler = BatchScheduler(s, slots=2, max_queued=1)
        held = [scheduler.submit(PROMPTS[i], GenerationConfig(max_new_tokens=8)) for i in range(3)]
        with pytest.raises(ServerBusy) as e:
            scheduler.submit(PROMPTS[3], GenerationConfig(max_new_tokens=8))
        msg = str(e.value)
        assert msg.startswith("server busy: expected room for one more request, found 0 running and 3 queued "
                              "(the most this scheduler holds: 2 running + 1 queued)") and "\n" not in msg
        with pytest.raises(CapacityError, match="the cache capacity"):
            scheduler.submit(list(range(49)), GenerationConfig(max_new_tokens=1))        # capacity 48
        with pytest.raises(CapacityError, match="max-new-tokens"):
            scheduler.submit(PROMPTS[0], GenerationConfig(max_new_tokens=46))
        with pytest.raises(RuntimeUserError, match="top_p is 1.5"):
            scheduler.submit(PROMPTS[0], GenerationConfig(sampling=SamplingConfig(1.0, 0, 1.5)))
        _run(scheduler, held)
        scheduler.submit(PROMPTS[3], GenerationConfig(max_new_tokens=8))               # room again
        assert scheduler.stats().refused_busy == 1


def test_failures_end_only_the_sequences_they_touch(tiny):
    """A listener that raises (a client gone) cancels its sequence; a backend error in a decode
    step ends the sequences of that step with ERROR; the scheduler serves the next ones."""
    with _session("ort", tiny) as s:
        want = generate(s, [PROMPTS[0]], GenerationConfig(max_new_tokens=6)).tokens[0]
        scheduler = BatchScheduler(s, slots=2, max_queued=4)

        def broken(seq, token):
            if len(seq.tokens) == 2:
                raise ConnectionError("client went away")
        gone = scheduler.submit(PROMPTS[1], GenerationConfig(max_new_tokens=20), listener=broken)
        ok = scheduler.submit(PROMPTS[0], GenerationConfig(max_new_tokens=6))
        _run(scheduler, [gone, ok])
        assert gone.finish == CANCELLED and "client went away" in gone.error and ok.tokens == want
        real = s.decode_rows
        s.decode_rows = lambda *a: (_ for _ in ()).throw(RuntimeError("backend fell over"))
        failed = scheduler.submit(PROMPTS[0], GenerationConfig(max_new_tokens=6))
        _run(scheduler, [failed])
        assert failed.finish == ERROR and "backend fell over" in failed.error and failed.tokens == want[:1]
        s.decode_rows = real
        again = scheduler.submit(PROMPTS[0], GenerationConfig(max_new_tokens=6))
        _run(scheduler, [again])
        assert again.tokens == want and scheduler.pool() == (0, 0)


def test_loop_thread_streams_and_close_ends_the_rest(tiny):
    with _session("ort", tiny) as s:
        want = [generate(s, [p], c).tokens[0] for p, c in zip(PROMPTS, _configs())]
        scheduler = BatchScheduler(s, slots=3, max_queued=20).start()
        seqs = [scheduler.submit(p, c) for p, c in zip(PROMPTS, _configs())]
        assert [list(seq.stream(timeout_s=60)) for seq in seqs] == want
        scheduler.close()
        with pytest.raises(SchedulerClosed):
            scheduler.submit(PROMPTS[0], GenerationConfig())
    with _session("ort", tiny) as s:
        scheduler = BatchScheduler(s, slots=1, max_queued=2)      # no loop: nothing runs
        left = [scheduler.submit(PROMPTS[i], GenerationConfig(max_new_tokens=8)) for i in range(2)]
        scheduler.step()
        scheduler.close()
        assert [q.finish for q in left] == [CANCELLED, CANCELLED] and "shutting down" in left[1].error
        assert list(left[0].stream(timeout_s=1)) == left[0].tokens and len(left[0].tokens) == 2


def test_a_backend_without_row_steps_is_refused_with_one_line(tiny):
    class Whole(OrtSession):
        row_steps = False
    with Whole(tiny[1]) as s:
        with pytest.raises(RuntimeUserError, match="needs steps on part of the batch") as e:
            BatchScheduler(s, slots=2)
        assert "\n" not in str(e.value)


def test_bench_slots_measures_every_design(tiny, capsys):
    """python -m bench.slots (the prefill-design costs of docs/triton.md) runs and reports each variant."""
    from bench.slots import main
    assert main(["--model", str(tiny[1]), "--slots", "4", "--prompt", "8", "--threads", "1", "--rounds", "3"]) == 0
    out = capsys.readouterr().out
    for row in ("prefill in its own row", "prefill over the whole pool [4, 8]", "separate batch-1 session",
                "decode step, 1 row", "decode step, 4 rows", "adds"):
        assert row in out, out


def test_penalties_logprobs_and_stop_when_equal_runtime_generates(tiny):
    """Sequences with penalties (greedy and sampled), logprobs, prompt logprobs and a stop_when hook,
    batched by the scheduler, each get runtime.generate's tokens, logprobs and end; stop_when ends a
    sequence as STOP."""
    cfgs = [GenerationConfig(max_new_tokens=n, seed=i, logprobs=2, prompt_logprobs=True,
                             sampling=SamplingConfig(*s, frequency_penalty=1.0, presence_penalty=0.5))
            for i, (n, s) in enumerate(SETTINGS[:6])]
    with OrtSession(tiny[1], intra_op_threads=1) as s:
        want = [generate(s, [p], c) for p, c in zip(PROMPTS, cfgs)]
        ends = {0: want[0].tokens[0][3], 4: want[4].tokens[0][5]}
        want = {b: generate(s, [p], c, [lambda t, b=b: b in ends and t == ends[b]]) for b, (p, c) in
                enumerate(zip(PROMPTS, cfgs))}
    session = OrtSession(tiny[1], intra_op_threads=1).activate()
    try:
        scheduler = BatchScheduler(session, slots=3, max_queued=8)
        seqs = [scheduler.submit(p, c, stop_when=lambda t, b=b: b in ends and t == ends[b])
                for b, (p, c) in enumerate(zip(PROMPTS, cfgs))]
        _run(scheduler, seqs)
    finally:
        session.deactivate()
    for b, seq in enumerate(seqs):
        w = want[b]
        assert seq.tokens == w.tokens[0], b
        assert seq.finish == (STOP if b in ends else LENGTH), b
        assert [ids for _, ids, _ in seq.logprobs] == [ids for _, ids, _ in w.logprobs[0]]
        np.testing.assert_allclose([lp for lp, _, _ in seq.logprobs], [lp for lp, _, _ in w.logprobs[0]], atol=1e-4)
        np.testing.assert_allclose(seq.prompt_logprobs[1:], w.prompt_logprobs[0][1:], atol=1e-4)
        assert seq.prompt_top_logprobs[0][1:] == w.prompt_top_logprobs[0][0][1:]      # the prompt's top-2 ids
        np.testing.assert_allclose(seq.prompt_top_logprobs[1][1:], w.prompt_top_logprobs[0][1][1:], atol=1e-4)
    assert seqs[0].tokens[-1] == ends[0] and len(seqs[0].tokens) <= 4


# --- batched and chunked prefill ------------------------------------------------------------------

def _any_session(kind, tiny, tiny_gqa) -> DecoderSession:
    return OrtSession(tiny_gqa[1], intra_op_threads=1) if kind == "ort-gqa" else _session(kind, tiny)


def _count_prefills(session) -> list[tuple[int, tuple[int, int], list[int]]]:
    """Wrap session.prefill_rows so that each call is recorded as (start, ids shape, positions)."""
    calls, real = [], session.prefill_rows

    def counted(start, ids, position=None, logits_from=0):
        calls.append((start, ids.shape, None if position is None else np.asarray(position).tolist()))
        return real(start, ids, position, logits_from)
    session.prefill_rows = counted
    return calls


def _assert_solo(seq, want, config) -> None:
    """seq's tokens, logprobs and prompt logprobs are those of runtime.generate's run of its prompt alone."""
    if config.sampling.greedy:
        compared = compare_greedy(want.tokens[0], [row[0] for row in want.logits], seq.tokens, seq.logits)
        assert compared == config.max_new_tokens, f"only {compared} tokens compared (tie)"
    else:
        assert seq.tokens == want.tokens[0]
    if config.logprobs is not None:
        np.testing.assert_allclose([lp for lp, _, _ in seq.logprobs], [lp for lp, _, _ in want.logprobs[0]], atol=1e-4)
    if config.prompt_logprobs:
        assert len(seq.prompt_logprobs) == len(seq.prompt) and np.isnan(seq.prompt_logprobs[0])
        np.testing.assert_allclose(seq.prompt_logprobs[1:], want.prompt_logprobs[0][1:], atol=1e-4)
        assert seq.prompt_top_logprobs[0] == want.prompt_top_logprobs[0][0]
        np.testing.assert_allclose(seq.prompt_top_logprobs[1][1:], want.prompt_top_logprobs[0][1][1:], atol=1e-4)


@pytest.mark.parametrize("kind", ["ort", "ort-gqa", "torch"])
def test_newcomers_of_one_step_are_prefilled_in_one_call_and_equal_their_solo_runs(tiny, tiny_gqa, kind, monkeypatch):
    """Four newcomers of different lengths (greedy and sampled, logprobs and prompt logprobs) admitted in
    one step: ONE prefill_rows call over slots 0-3, right-padded to the longest, longest in slot 0; each
    sequence equals runtime.generate of its prompt alone, prompt logprobs included."""
    import runtime.scheduler
    monkeypatch.setattr(runtime.scheduler, "PREFILL_CALL_TOKENS", 10)     # a call dear enough to pad 5 rows to 9
    prompts = [PROMPTS[i] for i in (1, 3, 8, 6)]                          # lengths 7, 5, 6, 9
    configs = [GenerationConfig(max_new_tokens=12, seed=i, sampling=SamplingConfig(*SETTINGS[i][1]), keep_logits=True,
                                logprobs=2, prompt_logprobs=True) for i in range(4)]
    with _any_session(kind, tiny, tiny_gqa) as s:
        want = [generate(s, [p], c) for p, c in zip(prompts, configs)]
    with _any_session(kind, tiny, tiny_gqa) as s:
        calls = _count_prefills(s)
        scheduler = BatchScheduler(s, slots=4, max_queued=4)
        seqs = [scheduler.submit(p, c) for p, c in zip(prompts, configs)]
        scheduler.step()
        assert calls == [(0, (4, 9), [0, 0, 0, 0])]
        assert [seq.slot for seq in seqs] == [1, 3, 2, 0] and all(len(seq.tokens) == 2 for seq in seqs)
        _run(scheduler, seqs)
        assert len(calls) == 1 and scheduler.stats().prefill_s > 0
    for seq, w, c in zip(seqs, want, configs):
        _assert_solo(seq, w, c)


def test_prefill_groups_cut_the_least_costly_calls_and_split_at_a_taken_slot():
    """prefill_groups against every cut of the rows (sorted longest first) into calls of contiguous
    slots: its calls cost the least, cost = sum of PREFILL_CALL_TOKENS + rows x longest piece."""
    import itertools
    from runtime.scheduler import PREFILL_CALL_TOKENS, prefill_groups
    cost = lambda calls, pieces: sum(PREFILL_CALL_TOKENS + len(c) * max(pieces[i] for i, _ in c) for c in calls)  # noqa: E731
    assert PREFILL_CALL_TOKENS > 1        # below: padding a 5 to 6 (1 token) is cheaper than a call of its own
    assert prefill_groups([5, 6, 6], [0, 1, 2]) == [[(1, 0), (2, 1), (0, 2)]]      # longest in the lowest slot
    assert prefill_groups([5, 6, 6], [0, 1, 3]) == [[(1, 0), (2, 1)], [(0, 3)]]    # slot 2 taken: two calls
    big, small = 4 * PREFILL_CALL_TOKENS, 1
    assert prefill_groups([big, small], [0, 1]) == [[(0, 0)], [(1, 1)]]             # padding 1 to big: dearer
    rng = np.random.default_rng(5)
    for _ in range(40):
        n = int(rng.integers(1, 8))
        pieces = rng.integers(1, 4 * PREFILL_CALL_TOKENS, n).tolist()
        free = sorted(rng.choice(12, n, replace=False).tolist())
        got = prefill_groups(pieces, free)
        rows = [r for call in got for r in call]
        assert sorted(i for i, _ in rows) == list(range(n)) and [slot for _, slot in rows] == free
        assert [pieces[i] for i, _ in rows] == sorted(pieces, reverse=True)
        for call in got:
            assert [slot for _, slot in call] == list(range(call[0][1], call[0][1] + len(call)))
        best = min(cost([rows[a:b] for a, b in zip((0,) + cut, cut + (n,))], pieces)
                   for k in range(n) for cut in itertools.combinations(range(1, n), k)
                   if all(rows[j][1] + 1 == rows[j + 1][1] or j + 1 in cut for j in range(n - 1)))
        assert cost(got, pieces) == best, (pieces, free, got)


@pytest.mark.parametrize("kind", ["ort", "ort-gqa", "torch"])
def test_a_long_prompt_is_prefilled_in_chunks_while_a_running_sequence_gets_its_tokens(tiny, tiny_gqa, kind):
    """prefill_chunk 4: a 12-token prompt takes 3 prefill_rows calls at positions 0, 4, 8, one per step;
    the running sequence gets one token in each of those steps; the long prompt's first token comes
    after its last chunk; both equal their solo runs (prompt logprobs over the chunks included)."""
    long, short = PROMPTS[4], PROMPTS[0]                                   # 12 and 3 tokens
    configs = [GenerationConfig(max_new_tokens=n, keep_logits=True, logprobs=3, prompt_logprobs=True) for n in (10, 20)]
    with _any_session(kind, tiny, tiny_gqa) as s:
        want = [generate(s, [p], c) for p, c in zip((long, short), configs)]
    with _any_session(kind, tiny, tiny_gqa) as s:
        calls = _count_prefills(s)
        scheduler = BatchScheduler(s, slots=2, max_queued=2, prefill_chunk=4)
        running = scheduler.submit(short, configs[1])
        scheduler.step()
        assert calls == [(0, (1, 3), [0])] and len(running.tokens) == 2
        chunked = scheduler.submit(long, configs[0])
        for n in range(1, 4):
            scheduler.step()
            assert calls[-1] == (1, (1, 4), [4 * (n - 1)]) and len(running.tokens) == 2 + n
            assert len(chunked.tokens) == (2 if n == 3 else 0)             # first token + a decode step's
        assert len(calls) == 4
        _run(scheduler, [running, chunked])
    _assert_solo(chunked, want[0], configs[0])
    _assert_solo(running, want[1], configs[1])


def test_cancelling_a_prompt_between_its_chunks_frees_its_slot(tiny):
    with _session("ort", tiny) as s:
        calls = _count_prefills(s)
        scheduler = BatchScheduler(s, slots=1, max_queued=2, prefill_chunk=4)
        chunked = scheduler.submit(PROMPTS[4], GenerationConfig(max_new_tokens=5))
        after = scheduler.submit(PROMPTS[0], GenerationConfig(max_new_tokens=5))
        scheduler.step()
        assert chunked.slot == 0 and scheduler.pool() == (1, 1) and not chunked.tokens
        chunked.cancel()
        scheduler.step()
        assert chunked.finish == CANCELLED and chunked.tokens == [] and after.slot == 0
        assert calls == [(0, (1, 4), [0]), (0, (1, 3), [0])]              # no more chunks of the cancelled one
        _run(scheduler, [after])
        assert after.finish == LENGTH and scheduler.stats().finished[CANCELLED] == 1


def test_a_failed_batched_prefill_ends_only_the_sequences_of_that_call(tiny):
    """A backend error in a 2-row prefill call ends those two with ERROR; the running sequence goes on,
    and the next newcomers are served."""
    with _session("ort", tiny) as s:
        want = generate(s, [PROMPTS[0]], GenerationConfig(max_new_tokens=8)).tokens[0]
        scheduler = BatchScheduler(s, slots=3, max_queued=4)
        running = scheduler.submit(PROMPTS[0], GenerationConfig(max_new_tokens=8))
        scheduler.step()
        real = s.prefill_rows
        s.prefill_rows = lambda *a: (_ for _ in ()).throw(RuntimeError("backend fell over"))
        failed = [scheduler.submit(PROMPTS[i], GenerationConfig(max_new_tokens=8)) for i in (1, 3)]
        scheduler.step()
        assert [f.finish for f in failed] == [ERROR, ERROR] and all("backend fell over" in f.error for f in failed)
        assert running.finish is None and len(running.tokens) == 3 and scheduler.pool() == (1, 0)
        s.prefill_rows = real
        again = scheduler.submit(PROMPTS[1], GenerationConfig(max_new_tokens=8))
        _run(scheduler, [running, again])
        assert running.tokens == want and again.finish == LENGTH and scheduler.pool() == (0, 0)


@pytest.mark.parametrize("prompt_logprobs", [False, True])
def test_a_prefill_call_asks_for_the_logits_from_its_earliest_last_prompt_token(tiny, tiny_gqa, prompt_logprobs,
                                                                                 monkeypatch):
    """Newcomers of lengths 7, 5, 6, 9 in one call: the graph is asked for the logits from position 4 on (the
    5-token prompt's last), or from 0 when one of them wants its prompt's logprobs; each sequence's greedy
    tokens equal runtime.generate's of its prompt alone (ONNX Runtime's CPU graph: the head cut for real)."""
    import runtime.scheduler
    monkeypatch.setattr(runtime.scheduler, "PREFILL_CALL_TOKENS", 10)     # a call dear enough to pad 5 rows to 9
    prompts = [PROMPTS[i] for i in (1, 3, 8, 6)]                          # lengths 7, 5, 6, 9
    configs = [GenerationConfig(max_new_tokens=6, keep_logits=True, logprobs=2, prompt_logprobs=prompt_logprobs and i == 2)
               for i in range(4)]
    with _any_session("ort-gqa", tiny, tiny_gqa) as s:
        want = [generate(s, [p], c) for p, c in zip(prompts, configs)]
    with _any_session("ort-gqa", tiny, tiny_gqa) as s:
        asked, real = [], s.prefill_rows

        def recorded(start, ids, position=None, logits_from=0):
            asked.append(logits_from)
            return real(start, ids, position, logits_from)
        s.prefill_rows = recorded
        scheduler = BatchScheduler(s, slots=4, max_queued=4)
        seqs = [scheduler.submit(p, c) for p, c in zip(prompts, configs)]
        _run(scheduler, seqs)
    assert asked == [0 if prompt_logprobs else 4]
    for seq, w, c in zip(seqs, want, configs):
        _assert_solo(seq, w, c)
