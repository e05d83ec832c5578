"""Token generation over any DecoderSession, in named steps over the session's preallocated cache.

    prefill          prompts of different lengths, RIGHT-padded to T = max length, all at
                     position 0; the next-token logits of prompt b are at index len_b - 1
    decode_n_tokens  the loop: each step writes tokens [B] at position[b] = len_b + step -> logits
                     [B, V]; sample, stop tokens, per-step timing
    generate         capacity check, reset, prefill, decode_n_tokens

Why right padding works without an attention-mask input: the graph lets query t of
sequence b see cache slots j <= position[b] + t. During prefill prompt b's real
tokens (t < len_b) never see the padded slots j >= len_b; the padding written there
is overwritten by decode step k (slot len_b + k) before any query can see it.

    python -m runtime.generate --model build/dyt --prompt "Once upon a time" --max-new-tokens 64
    python -m runtime.generate --model models/zoo/dyt --backend torch --batch-file prompts.txt

prints the generated text on stdout (one line per prompt, newlines escaped as \\n in
batch mode) and TTFT, TPOT (p50/p90) and tokens/s on stderr.
"""
from __future__ import annotations

from core.lifecycle import guard_startup
guard_startup(__name__)     # before the imports below: a Ctrl-C while they load exits 130 with one line

import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from runtime.sampling import SamplingConfig, log_softmax, penalize, sample, top_logprobs
from runtime.text_stream import TextStream
from core.errors import ArgumentParser, float_in, int_in, nonnegative_int, positive_int, seed_int
from core.lifecycle import run_cli
from runtime.session import CapacityError, DecoderSession, RuntimeUsageError, RuntimeUserError


@dataclass
class GenerationConfig:
    max_new_tokens: int = 32
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int = 0
    stop_tokens: tuple[int, ...] = ()
    keep_logits: bool = False      # keep a copy of each step's logits [B, V] (tests, debugging)
    logprobs: int | None = None    # per new token: its logprob and the k = logprobs most likely (None: off)
    prompt_logprobs: bool = False  # the prompt tokens' logprobs (NaN for the first, which has none); with
                                   # logprobs k > 0 also their top-k alternatives (prompt_top_logprobs)


@dataclass
class GenerationResult:
    tokens: list[list[int]]        # new tokens per prompt, a stop token included, nothing after it
    prompt_lengths: list[int]
    ttft_s: float                  # prefill + first token selection
    step_s: list[float]            # each decode step (the session's step + sampling + the loop's bookkeeping)
    total_s: float
    engine_s: list[float] = field(default_factory=list)   # of each decode step, the session's engine call
    logits: list[np.ndarray] = field(default_factory=list)   # [B, V] per new token, with keep_logits
    # with config.logprobs: per prompt, per new token (logprob, top ids, their logprobs) of the raw logits
    logprobs: list[list[tuple[float, list[int], list[float]]]] = field(default_factory=list)
    prompt_logprobs: list[list[float]] = field(default_factory=list)   # with config.prompt_logprobs
    # with config.prompt_logprobs and config.logprobs k > 0: per prompt (ids [T][k], logprobs [T][k]), prompt_top_logprobs
    prompt_top_logprobs: list[tuple[list[list[int]], list[list[float]]]] = field(default_factory=list)

    @property
    def new_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)

    def tpot_s(self, q: float = 50) -> float:
        return float(np.percentile(self.step_s, q)) if self.step_s else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.total_s if self.total_s > 0 else float("nan")

    def metrics_line(self) -> str:
        b = len(self.tokens)
        return (f"batch {b}, prompt {max(self.prompt_lengths)} tokens (max), {self.new_tokens} new tokens: "
                f"TTFT {self.ttft_s * 1e3:.2f} ms, TPOT p50 {self.tpot_s(50) * 1e3:.3f} ms "
                f"p90 {self.tpot_s(90) * 1e3:.3f} ms, {self.tokens_per_s:.1f} tokens/s")


def check_capacity(capacity: int, prompt_lengths: list[int], max_new_tokens: int,
                   option: str = "--max-new-tokens") -> None:
    """Prompt plus new tokens must fit the cache: len_b + max_new_tokens <= capacity. option: what the
    caller's user calls max_new_tokens (the Triton generate model: input max_tokens)."""
    if not prompt_lengths or min(prompt_lengths) < 1:
        raise CapacityError("prompt: expected at least one token, found an empty prompt; give some text")
    longest = max(prompt_lengths)
    if longest > capacity:
        raise CapacityError(f"prompt: expected at most {capacity} tokens (the cache capacity), found {longest}; "
                            "shorten the prompt or export with a larger max_seq_len")
    if max_new_tokens < 1:
        raise CapacityError(f"{option.lstrip('-')}: expected >= 1, found {max_new_tokens}; ask for at least one token")
    if longest + max_new_tokens > capacity:
        raise CapacityError(f"{option.lstrip('-')}: expected prompt + new tokens <= {capacity} (the cache capacity), "
                            f"found {longest} + {max_new_tokens}; use {option} {capacity - longest} or less")


def pad_right(prompts: list[list[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """input_ids int64 [B, T_max] right-padded with pad_id, and lengths int64 [B]."""
    lengths = np.array([len(p) for p in prompts], np.int64)
    ids = np.full((len(prompts), int(lengths.max())), pad_id, np.int64)                      # [B, T]
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = p
    return ids, lengths


def prefill(session: DecoderSession, prompts: list[list[int]], prompt_logprobs: list[list[float]] | None = None,
            prompt_top: list | None = None, k: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Run all prompts at position 0; next-token logits [B, V] and prompt lengths [B]. With a list
    prompt_logprobs, each prompt's token logprobs are appended to it (see prompt_token_logprobs); with a
    list prompt_top and k > 0, each prompt's top-k alternatives (see prompt_top_logprobs)."""
    ids, lengths = pad_right(prompts)
    every = prompt_logprobs is not None or (prompt_top is not None and k > 0)
    logits_from = 0 if every else int(lengths.min()) - 1    # the logits needed: from the shortest prompt's last on
    logits = session.prefill(ids, np.zeros(len(prompts), np.int64), logits_from)          # [B, T - logits_from, V]
    if prompt_logprobs is not None:
        prompt_logprobs.extend(prompt_token_logprobs(logits[b, :len(p)], p) for b, p in enumerate(prompts))
    if prompt_top is not None and k > 0:
        prompt_top.extend(prompt_top_logprobs(logits[b, :len(p)], k) for b, p in enumerate(prompts))
    return logits[np.arange(len(prompts)), lengths - 1 - logits_from], lengths


def prompt_token_logprobs(logits: np.ndarray, prompt: list[int]) -> list[float]:
    """Logprob of each prompt token given the ones before it, from the prefill's logits [T, V];
    NaN for the first token (nothing predicts it)."""
    lp = log_softmax(logits[:-1])                                                              # [T - 1, V]
    return [float("nan")] + lp[np.arange(len(prompt) - 1), prompt[1:]].tolist()


def prompt_top_logprobs(logits: np.ndarray, k: int) -> tuple[list[list[int]], list[list[float]]]:
    """The k most likely tokens at each prompt position, best first, and their logprobs, from the prefill's
    logits [T, V] (what a client's is_greedy check compares each prompt token with); row 0, the first
    token's (nothing predicts it), is k ids -1 and NaN logprobs. Each row is runtime.sampling.top_logprobs'."""
    ids, lps = [[-1] * k], [[float("nan")] * k]
    for row in logits[:-1]:
        _, top, top_lp = top_logprobs(row, 0, k)
        ids.append(top)
        lps.append(top_lp)
    return ids, lps


# Not core.decode's driver: its decode step is checked, wrapped in a feeds dict and sliced each call, and greedy
# only; this loop checks the whole run once (decode_step_unchecked), samples, stops, and times every engine call.
def decode_n_tokens(session: DecoderSession, first: np.ndarray, lengths: np.ndarray, n: int,
                    config: GenerationConfig, rng: np.random.Generator, result: GenerationResult,
                    stop_when: list[Callable[[int], bool]] | None = None) -> None:
    """Feed `first` and n - 1 more tokens; appends to result.tokens / step_s / logits / logprobs.

    The loop's own work per token (what bench.decode reports as "loop us/token") is kept
    to a few cheap operations: the positions of every step are computed and checked once
    up front, greedy is a bare argmax, stop tokens are looked up in a Python set only when
    there are some, each step's tokens go to a list that becomes result.tokens at the end,
    and one clock read per step gives step_s (the whole step, loop included); engine_s is the
    session's own timing of its engine call (last_inference_time). Only a run that asks for
    them pays for penalties, logprobs (a log-softmax per row) or stop_when (per sequence, called
    with each of its new tokens: True ends it there, e.g. a stop string completed).
    """
    steps = n - 1
    batch = len(first)
    stop = frozenset(config.stop_tokens)
    listed0 = first.tolist()
    done = [t in stop or (stop_when is not None and stop_when[b](t)) for b, t in enumerate(listed0)]
    ends = [0 if d else None for d in done]          # per sequence: how many decode steps are its tokens
    history = [[t] for t in listed0] if config.sampling.penalized else None     # new tokens so far (penalties)
    extras = stop_when is not None or config.logprobs is not None or history is not None
    emitted: list[list[int]] = []                   # each step's tokens [B] as a list
    if steps >= 1 and not all(done):
        positions = lengths.astype(np.int64)[None, :] + np.arange(steps, dtype=np.int64)[:, None]   # [steps, B]
        session.check_decode_run(batch, positions[0], steps)
        greedy, keep = config.sampling.greedy, config.keep_logits
        step_s, engine_s, kept = result.step_s, result.engine_s, result.logits
        tokens = first
        t_prev = time.perf_counter()
        for step in range(steps):
            logits = session.decode_step_unchecked(tokens, positions[step])                # [B, V]
            engine_s.append(session.last_inference_time())
            scores = logits if history is None else penalize(logits, config.sampling, history)
            tokens = scores.argmax(axis=-1) if greedy else sample(scores, config.sampling, rng)   # [B] int64
            listed = tokens.tolist()
            emitted.append(listed)
            if keep:
                kept.append(logits.copy())
            now = time.perf_counter()
            step_s.append(now - t_prev)
            t_prev = now
            if extras:
                for b, t in enumerate(listed):
                    if done[b]:
                        continue
                    if history is not None:
                        history[b].append(t)
                    if config.logprobs is not None:
                        result.logprobs[b].append(top_logprobs(logits[b], t, config.logprobs))
                    if t in stop or (stop_when is not None and stop_when[b](t)):
                        done[b], ends[b] = True, step + 1
                if all(done):
                    break
            elif stop and not stop.isdisjoint(listed):
                for b, t in enumerate(listed):
                    if not done[b] and t in stop:
                        done[b], ends[b] = True, step + 1
                if all(done):
                    break
    # each step's tokens appended to each sequence, up to and including the one that ended it
    # (result.tokens[b] already holds the first new token, which may itself have ended it)
    for b, seq in enumerate(result.tokens):
        seq.extend(listed[b] for listed in emitted[:ends[b] if ends[b] is not None else len(emitted)])


def generate(session: DecoderSession, prompts: list[list[int]], config: GenerationConfig,
             stop_when: list[Callable[[int], bool]] | None = None) -> GenerationResult:
    """New tokens for each prompt; the session must be active. Seeded: reproducible.
    stop_when: per prompt, called with each new token; True ends that sequence (decode_n_tokens)."""
    config.sampling.validate()
    lengths = [len(p) for p in prompts]
    check_capacity(session.spec.capacity, lengths, config.max_new_tokens)
    rng = np.random.default_rng(config.seed)
    session.reset(len(prompts))
    t0 = time.perf_counter()
    prompt_lps: list[list[float]] | None = [] if config.prompt_logprobs else None
    prompt_top: list | None = [] if config.prompt_logprobs and config.logprobs else None
    logits, lens = prefill(session, prompts, prompt_lps, prompt_top, config.logprobs or 0)
    first = sample(logits, config.sampling, rng)       # no new tokens yet: nothing to penalize
    ttft = time.perf_counter() - t0
    result = GenerationResult(tokens=[[int(t)] for t in first], prompt_lengths=lengths, ttft_s=ttft, step_s=[], total_s=0.0)
    if config.keep_logits:
        result.logits.append(logits.copy())
    if config.logprobs is not None:
        result.logprobs = [[top_logprobs(logits[b], int(t), config.logprobs)] for b, t in enumerate(first)]
    result.prompt_logprobs = prompt_lps or []
    result.prompt_top_logprobs = prompt_top or []
    decode_n_tokens(session, first, lens, config.max_new_tokens, config, rng, result, stop_when)
    result.total_s = time.perf_counter() - t0
    return result


# --- CLI ----------------------------------------------------------------------------------

EOS = "<|endoftext|>"
MAX_PROMPTS = 256                  # --batch-file: prompts per batch (one batch holds every cache at once)
MAX_BATCH_FILE_BYTES = 1 << 20     # --batch-file: 1 MiB of text


def _parser():
    from runtime.backends import BACKENDS
    p = ArgumentParser(prog="python -m runtime.generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="build directory or .onnx file (ort, trt); checkpoint directory (torch)")
    p.add_argument("--prompt", help="prompt text")
    p.add_argument("--batch-file", help=f"UTF-8 text file with one prompt per line, run as one batch "
                                        f"(at most {MAX_PROMPTS} prompts, {MAX_BATCH_FILE_BYTES >> 20} MiB)")
    p.add_argument("--max-new-tokens", type=positive_int, default=32)
    p.add_argument("--backend", choices=sorted(BACKENDS), default="ort")
    p.add_argument("--device", help="ort: cpu | cuda | tensorrt; torch: cpu | cuda[:N]; trt: cuda[:N] (default: the backend's)")
    p.add_argument("--temperature", type=float_in(0.0), default=0.0, help="0 (default) is greedy")
    p.add_argument("--top-k", type=nonnegative_int, default=0)
    p.add_argument("--top-p", type=float_in(0.0, 1.0), default=1.0, help="in (0, 1]")
    p.add_argument("--seed", type=seed_int, default=0)
    p.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop string: the text ends just before it (repeatable); id:N is the stop token N instead. "
                        "the model's stop tokens stop too (generation.json: a chat model's end of turn; else "
                        "<|endoftext|> if the tokenizer has it) unless --ignore-eos")
    p.add_argument("--ignore-eos", action="store_true", help="no stop tokens: always generate --max-new-tokens")
    p.add_argument("--frequency-penalty", type=float_in(-2.0, 2.0), default=0.0, help="OpenAI's, in [-2, 2]")
    p.add_argument("--presence-penalty", type=float_in(-2.0, 2.0), default=0.0, help="OpenAI's, in [-2, 2]")
    p.add_argument("--logprobs", type=int_in(0, 20), default=None, metavar="K",
                   help="print each new token's logprob and the K most likely tokens on stderr")
    p.add_argument("--compile", action="store_true", help="torch: torch.compile the forward")
    return p


def _load_tokenizer(backend: str, model: str, vocab_size: int):
    if backend == "torch":
        from pathlib import Path
        from models.checkpoint import check_tokenizer_fits, load_tokenizer
        tok = load_tokenizer(model)
        check_tokenizer_fits(Path(model), vocab_size, tok)
        return tok
    from runtime.model_files import load_tokenizer
    return load_tokenizer(model, vocab_size)


def model_folder(model) -> Path:
    """The folder of a model path: a build or checkpoint directory, or the one holding an .onnx file."""
    path = Path(model)
    return path if path.is_dir() else path.parent


def default_stop_tokens(tok, ignore_eos: bool, folder=None, vocab_size: int | None = None) -> tuple[int, ...]:
    """The default stop tokens (also the Triton generate model's, hence the OpenAI API's): the model's own,
    generation.json in `folder` (carried from its Hugging Face folder: a chat model's end of turn, e.g.
    Qwen3's <|im_end|>; core/generation.py), else <|endoftext|> when the tokenizer has it; none with ignore_eos."""
    if ignore_eos:
        return ()
    from core.generation import GENERATION, read_stop_tokens
    ids = read_stop_tokens(folder) if folder is not None and (Path(folder) / GENERATION).is_file() else None
    if ids is not None:
        if vocab_size is not None and max(ids) >= vocab_size:
            raise RuntimeUserError(f"{Path(folder) / GENERATION}: expected token ids below the model's vocabulary "
                                   f"({vocab_size}), found {max(ids)}; use the model's own file")
        return tuple(ids)
    eos = tok.token_to_id(EOS)
    return () if eos is None else (eos,)


def parse_stops(tok, stops: list[str] | None, ignore_eos: bool, vocab_size: int,
                folder=None) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """--stop values: (stop token ids, stop strings). id:N is a stop token; any other value a stop string
    (matched on the decoded text: runtime/text_stream.py). The default stop tokens (default_stop_tokens of
    the model's folder) stay unless --ignore-eos, as an OpenAI server's stop strings add to the end-of-text token."""
    ids, strings = list(default_stop_tokens(tok, ignore_eos, folder, vocab_size)), []
    for s in stops or ():
        if not s.startswith("id:"):
            strings.append(s)
            continue
        try:
            i = int(s[3:])
        except ValueError:
            raise RuntimeUsageError(f"--stop {s!r}: expected id:N with N an integer token id, found {s[3:]!r}; "
                                    "e.g. --stop id:0") from None
        if not 0 <= i < vocab_size:
            raise RuntimeUserError(f"--stop {s!r}: expected a token id in [0, {vocab_size}), found {i}; pick another")
        ids.append(i)
    return tuple(ids), tuple(strings)


def logprobs_lines(rows, tok=None) -> list[str]:
    """One line per new token: its index, id (and text with a tokenizer), logprob, then the top
    alternatives best first. rows: (token, logprob, [(id, logprob), ...]) per token."""
    def name(t: int) -> str:
        return f"{t}" if tok is None else f"{t} {tok.decode([t])!r}"
    lines = []
    for i, (t, lp, top) in enumerate(rows):
        alts = ", ".join(f"{name(a)} {b:.4f}" for a, b in top)
        lines.append(f"logprobs {i}: {name(t)} {lp:.4f}" + (f" | top: {alts}" if alts else ""))
    return lines


def read_prompts(args) -> list[str]:
    from core.inputs import check_text, read_text_file
    if (args.prompt is None) == (args.batch_file is None):
        raise RuntimeUsageError("prompt: expected exactly one of --prompt TEXT or --batch-file F, found "
                                + ("both" if args.prompt is not None else "neither") + "; pass one")
    if args.batch_file is None:
        return [check_text(args.prompt, "--prompt")]
    text = read_text_file(args.batch_file, "--batch-file", MAX_BATCH_FILE_BYTES)
    texts = [line for line in text.split("\n") if line.strip()]
    if not texts:
        raise RuntimeUserError(f"--batch-file {args.batch_file}: expected one prompt per line, found no prompts; add some")
    if len(texts) > MAX_PROMPTS:
        raise RuntimeUserError(f"--batch-file {args.batch_file}: expected at most {MAX_PROMPTS} prompts (one batch), "
                               f"found {len(texts)}; split the file")
    return texts


def run(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from core.inputs import check_memory
    from runtime.backends import open_session
    texts = read_prompts(args)
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p, args.frequency_penalty, args.presence_penalty)
    try:
        sampling.validate()
    except ValueError as e:
        raise RuntimeUsageError(f"sampling: {e}; fix the option") from None
    options = {"compile": True} if args.compile and args.backend == "torch" else {}
    session = open_session(args.backend, args.model, device=args.device, **options)
    with session:                      # activate first: a bad model file is reported before anything else
        spec = session.spec
        tok = _load_tokenizer(args.backend, args.model, spec.vocab_size)
        prompts = [tok.encode(t).ids for t in texts]
        stop_tokens, stop_strings = parse_stops(tok, args.stop, args.ignore_eos, spec.vocab_size,
                                                 model_folder(args.model))
        config = GenerationConfig(max_new_tokens=args.max_new_tokens, seed=args.seed, sampling=sampling,
                                  stop_tokens=stop_tokens, logprobs=args.logprobs)
        # the text of each prompt, ended by the stop strings (the generate model's matcher)
        streams = [TextStream(tok, stop_tokens, stop_strings) for _ in prompts]
        stop_when = [lambda t, s=s: (s.push(t), s.stopped)[1] for s in streams] if stop_strings else None
        check_capacity(spec.capacity, [len(p) for p in prompts], args.max_new_tokens)
        longest = max(len(p) for p in prompts)
        check_memory(len(prompts) * longest * spec.vocab_size * 4, f"prefill logits of {len(prompts)} prompts",
                     "use fewer or shorter prompts")
        result = generate(session, prompts, config, stop_when)
    stop = set(config.stop_tokens)
    for b, (new, stream) in enumerate(zip(result.tokens, streams)):
        stream.flush()
        text = stream.text() if stop_when is not None else tok.decode([t for t in new if t not in stop])
        print(text.replace("\\", "\\\\").replace("\n", "\\n") if len(texts) > 1 else text)
        if config.logprobs is not None:
            rows = [(t, lp, list(zip(ids, lps))) for t, (lp, ids, lps) in zip(new, result.logprobs[b])]
            for line in logprobs_lines(rows, tok):
                print(line if len(texts) == 1 else f"prompt {b} {line}", file=sys.stderr)
    graph = getattr(session, "path", None)          # which graph of a build ran (a --quantize build: int4)
    ran = f" {graph.name}" if graph is not None and graph.suffix == ".onnx" else ""
    print(f"{args.backend}{ran}: {result.metrics_line()}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    from core.lifecycle import exit_after
    exit_after(main)
