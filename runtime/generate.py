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

from core.errors import guard_startup
guard_startup(__name__)     # before the imports below: a Ctrl-C while they load exits 130 with one line

import sys
import time
from dataclasses import dataclass, field

import numpy as np

from runtime.sampling import SamplingConfig, sample
from core.errors import ArgumentParser, float_in, nonnegative_int, positive_int, run_cli, seed_int
from runtime.session import CapacityError, DecoderSession, RuntimeUsageError, RuntimeUserError


@dataclass
class GenerationConfig:
    max_new_tokens: int = 32
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    seed: int = 0
    stop_tokens: tuple[int, ...] = ()
    keep_logits: bool = False      # keep a copy of each step's logits [B, V] (tests, debugging)


@dataclass
class GenerationResult:
    tokens: list[list[int]]        # new tokens per prompt, a stop token included, nothing after it
    prompt_lengths: list[int]
    ttft_s: float                  # prefill + first token selection
    step_s: list[float]            # each decode step (the session's step + sampling + the loop's bookkeeping)
    total_s: float
    engine_s: list[float] = field(default_factory=list)   # of each decode step, the session's engine call
    logits: list[np.ndarray] = field(default_factory=list)   # [B, V] per new token, with keep_logits

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


def check_capacity(capacity: int, prompt_lengths: list[int], max_new_tokens: int) -> None:
    """Prompt plus new tokens must fit the cache: len_b + max_new_tokens <= capacity."""
    if not prompt_lengths or min(prompt_lengths) < 1:
        raise CapacityError("prompt: expected at least one token, found an empty prompt; give some text")
    longest = max(prompt_lengths)
    if longest > capacity:
        raise CapacityError(f"prompt: expected at most {capacity} tokens (the cache capacity), found {longest}; "
                            "shorten the prompt or export with a larger max_seq_len")
    if max_new_tokens < 1:
        raise CapacityError(f"max-new-tokens: expected >= 1, found {max_new_tokens}; ask for at least one token")
    if longest + max_new_tokens > capacity:
        raise CapacityError(f"max-new-tokens: expected prompt + new tokens <= {capacity} (the cache capacity), "
                            f"found {longest} + {max_new_tokens}; use --max-new-tokens {capacity - longest} or less")


def pad_right(prompts: list[list[int]], pad_id: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """input_ids int64 [B, T_max] right-padded with pad_id, and lengths int64 [B]."""
    lengths = np.array([len(p) for p in prompts], np.int64)
    ids = np.full((len(prompts), int(lengths.max())), pad_id, np.int64)                      # [B, T]
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = p
    return ids, lengths


def prefill(session: DecoderSession, prompts: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """Run all prompts at position 0; next-token logits [B, V] and prompt lengths [B]."""
    ids, lengths = pad_right(prompts)
    logits = session.prefill(ids, np.zeros(len(prompts), np.int64))                          # [B, T, V]
    return logits[np.arange(len(prompts)), lengths - 1], lengths


# Not core.decode's driver: its decode step is checked, wrapped in a feeds dict and sliced each call, and greedy
# only; this loop checks the whole run once (decode_step_unchecked), samples, stops, and times every engine call.
def decode_n_tokens(session: DecoderSession, first: np.ndarray, lengths: np.ndarray, n: int,
                    config: GenerationConfig, rng: np.random.Generator, result: GenerationResult) -> None:
    """Feed `first` and n - 1 more tokens; appends to result.tokens / step_s / logits.

    The loop's own work per token (what bench.decode reports as "loop us/token") is kept
    to a few cheap operations: the positions of every step are computed and checked once
    up front, greedy is a bare argmax, stop tokens are looked up in a Python set only when
    there are some, each step's tokens go to a list that becomes result.tokens at the end,
    and one clock read per step gives step_s (the whole step, loop included); engine_s is the
    session's own timing of its engine call (last_inference_time).
    """
    steps = n - 1
    batch = len(first)
    stop = frozenset(config.stop_tokens)
    done = [t in stop for t in first.tolist()]                       # per sequence: a stop token was emitted
    if steps < 1 or all(done):
        return
    positions = lengths.astype(np.int64)[None, :] + np.arange(steps, dtype=np.int64)[:, None]   # [steps, B]
    session.check_decode_run(batch, positions[0], steps)
    greedy, keep = config.sampling.greedy, config.keep_logits
    step_s, engine_s, emitted, kept = result.step_s, result.engine_s, [], result.logits   # emitted: tokens [B] as a list
    tokens = first
    t_prev = time.perf_counter()
    for step in range(steps):
        logits = session.decode_step_unchecked(tokens, positions[step])                    # [B, V]
        engine_s.append(session.last_inference_time())
        tokens = logits.argmax(axis=-1) if greedy else sample(logits, config.sampling, rng)   # [B] int64
        listed = tokens.tolist()
        emitted.append(listed)
        if keep:
            kept.append(logits.copy())
        now = time.perf_counter()
        step_s.append(now - t_prev)
        t_prev = now
        if stop and not stop.isdisjoint(listed):
            done = [d or t in stop for d, t in zip(done, listed)]
            if all(done):
                break
    # each step's tokens appended to each sequence, up to and including its first stop token
    # (result.tokens[b] already holds the first new token, which may itself be a stop token)
    for b, seq in enumerate(result.tokens):
        if seq and seq[-1] in stop:
            continue
        for listed in emitted:
            seq.append(listed[b])
            if listed[b] in stop:
                break


def generate(session: DecoderSession, prompts: list[list[int]], config: GenerationConfig) -> GenerationResult:
    """New tokens for each prompt; the session must be active. Seeded: reproducible."""
    config.sampling.validate()
    lengths = [len(p) for p in prompts]
    check_capacity(session.spec.capacity, lengths, config.max_new_tokens)
    rng = np.random.default_rng(config.seed)
    session.reset(len(prompts))
    t0 = time.perf_counter()
    logits, lens = prefill(session, prompts)
    first = sample(logits, config.sampling, rng)
    ttft = time.perf_counter() - t0
    result = GenerationResult(tokens=[[int(t)] for t in first], prompt_lengths=lengths, ttft_s=ttft, step_s=[], total_s=0.0)
    if config.keep_logits:
        result.logits.append(logits.copy())
    decode_n_tokens(session, first, lens, config.max_new_tokens, config, rng, result)
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
    p.add_argument("--stop", action="append", default=None,
                   help="stop token (text of one token, or id:N); repeatable; default: <|endoftext|> if the tokenizer has it")
    p.add_argument("--ignore-eos", action="store_true", help="no stop tokens: always generate --max-new-tokens")
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


def default_stop_tokens(tok, ignore_eos: bool) -> tuple[int, ...]:
    """The default stop tokens (also the Triton generate model's): <|endoftext|> when the tokenizer has it."""
    eos = None if ignore_eos else tok.token_to_id(EOS)
    return () if eos is None else (eos,)


def parse_stop_tokens(tok, stops: list[str] | None, ignore_eos: bool, vocab_size: int) -> tuple[int, ...]:
    """--stop values (token text or id:N) as ids; default: default_stop_tokens."""
    if ignore_eos or stops is None:
        return default_stop_tokens(tok, ignore_eos)
    ids = []
    for s in stops:
        if s.startswith("id:"):
            try:
                i = int(s[3:])
            except ValueError:
                raise RuntimeUsageError(f"--stop {s!r}: expected id:N with N an integer token id, found {s[3:]!r}; "
                                        "e.g. --stop id:0") from None
            if not 0 <= i < vocab_size:
                raise RuntimeUserError(f"--stop {s!r}: expected a token id in [0, {vocab_size}), found {i}; pick another")
        else:
            i = tok.token_to_id(s)
            if i is None:
                raise RuntimeUserError(f"--stop {s!r}: expected one token of the tokenizer (or id:N), found none; pick another")
        ids.append(i)
    return tuple(ids)


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
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
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
        config = GenerationConfig(max_new_tokens=args.max_new_tokens, seed=args.seed, sampling=sampling,
                                  stop_tokens=parse_stop_tokens(tok, args.stop, args.ignore_eos, spec.vocab_size))
        check_capacity(spec.capacity, [len(p) for p in prompts], args.max_new_tokens)
        longest = max(len(p) for p in prompts)
        check_memory(len(prompts) * longest * spec.vocab_size * 4, f"prefill logits of {len(prompts)} prompts",
                     "use fewer or shorter prompts")
        result = generate(session, prompts, config)
    stop = set(config.stop_tokens)
    for new in result.tokens:
        text = tok.decode([t for t in new if t not in stop])
        print(text.replace("\\", "\\\\").replace("\n", "\\n") if len(texts) > 1 else text)
    graph = getattr(session, "path", None)          # which graph of a build ran (a --quantize build: int4)
    ran = f" {graph.name}" if graph is not None and graph.suffix == ".onnx" else ""
    print(f"{args.backend}{ran}: {result.metrics_line()}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    from core.errors import exit_after
    exit_after(main)
