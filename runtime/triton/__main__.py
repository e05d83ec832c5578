"""Triton model repository, server and client.

    python -m runtime.triton repo   --build BUILD --out REPO [--engine FILE] [--max-batch-size 8]
                                    [--instances 1] [--kind cpu|gpu] [--max-new-tokens 32]
                                    [--slots 8] [--max-queued 32] [--prefill-tokens 512] [--prefill-chunk 256]
                                    [--generate-backend auto|trt|ort-cuda|ort-cpu]
    python -m runtime.triton check  --repo REPO
    python -m runtime.triton serve  --repo REPO [--host 127.0.0.1] [--http-port 8000] [--grpc-port 8001]
                                    [--metrics-port 8002] [--openai-port 9000 [--openai-host 127.0.0.1]
                                    [--chat-template FILE]]
    python -m runtime.triton client --url HOST:PORT --prompt TEXT [--max-new-tokens N] [--protocol http|grpc]
                                    [--stream] [--stop TEXT ...] [--logprobs K]

repo writes the repository for an existing build (what export.build --triton-repo does);
check parses every config.pbtxt into ModelConfig and verifies the decoder configs
against their ONNX, loads each graph ONNX Runtime's CPU provider would run, and reads a
TensorRT plan's tag (not the plan: that needs TensorRT and its GPU); serve runs a real
Triton server (the tritonserver bundled with nvidia-pytriton, Python backend only) with
the generate model until Ctrl-C, and with --openai-port the OpenAI-compatible API over it
(runtime/openai: /v1/completions, /v1/chat/completions, /v1/models, /health; docs/triton.md);
client prints the generated text on stdout, as python
-m runtime.generate does (with --stream, piece by piece as the tokens arrive).
"""
from __future__ import annotations

from core.lifecycle import guard_startup
guard_startup(__name__)     # before the imports below: a Ctrl-C while they load exits 130 with one line

import itertools
import json
import signal
import sys
import threading

from core.errors import ArgumentParser, UsageError, float_in, int_in, nonnegative_int, positive_int, seed_int
from core.lifecycle import run_cli
from runtime.scheduler import PREFILL_CHUNK, PREFILL_TOKENS

port = int_in(1, 65535)


def _parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m runtime.triton", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("repo", help="write a model repository for a build directory")
    r.add_argument("--build", required=True, help="build directory from python -m export.build")
    r.add_argument("--out", required=True,
                   help="repository directory to write (atomically; replaces only a repository this command wrote)")
    r.add_argument("--engine", help="TensorRT engine built from the build's fused graph; default: the newest <graph stem>.<key>.engine in BUILD")
    r.add_argument("--max-batch-size", type=int_in(1, 4096), default=8, help="decoder models: sequences per step (default 8)")
    r.add_argument("--instances", type=int_in(1, 256), default=1, help="instance_group count of every model (default 1)")
    r.add_argument("--kind", choices=("cpu", "gpu"), default="cpu",
                   help="instance kind of decoder_onnx (default cpu); gpu: --generate-backend auto picks ort-cuda "
                        "where there is no engine")
    r.add_argument("--generate-backend", choices=("auto", "trt", "ort-cuda", "ort-cpu"), default="auto",
                   help="what the generate model decodes with; auto (default): trt where the repository has an "
                        "engine, else ort-cuda with --kind gpu, else ort-cpu (always ort-cpu for a --target ort-cpu build)")
    r.add_argument("--max-new-tokens", type=positive_int, default=32, help="generate model: default when a request omits it")
    r.add_argument("--intra-op-threads", type=int_in(0, 256), default=0, help="generate model: ORT threads (0: ORT's default)")
    r.add_argument("--slots", type=int_in(1, 1024), default=8,
                   help="generate model: sequences decoded together per instance (the KV-cache slot pool; default 8)")
    r.add_argument("--max-queued", type=int_in(0, 100000), default=32,
                   help="generate model: requests waiting for a slot before 'server busy' (default 32)")
    r.add_argument("--prefill-tokens", type=int_in(1, 1 << 20), default=PREFILL_TOKENS,
                   help="generate model: prompt tokens prefilled per step, padding included, between two decode "
                        f"steps (one piece at least; default {PREFILL_TOKENS})")
    r.add_argument("--prefill-chunk", type=int_in(1, 1 << 20), default=PREFILL_CHUNK,
                   help="generate model: the most tokens of one prompt prefilled in a step; a longer prompt is "
                        f"prefilled in chunks over several steps (default {PREFILL_CHUNK})")
    c = sub.add_parser("check", help="parse and verify every config.pbtxt of a repository")
    c.add_argument("--repo", required=True)
    s = sub.add_parser("serve", help="run a Triton server over a repository (Ctrl-C stops it)")
    s.add_argument("--repo", required=True)
    s.add_argument("--host", default="127.0.0.1", help="address HTTP and gRPC bind to (default 127.0.0.1)")
    s.add_argument("--http-port", type=port, default=8000)
    s.add_argument("--grpc-port", type=port, default=8001)
    s.add_argument("--startup-timeout", type=float_in(1.0, 3600.0), default=120.0,
                   help="seconds to wait for the server to be ready")
    s.add_argument("--metrics-port", type=port, default=None,
                   help="serve Prometheus metrics (the generate pool's running/waiting gauges) on this port")
    s.add_argument("--log-verbose", type=int_in(0, 10), default=0)
    s.add_argument("--openai-port", type=port, default=None,
                   help="also serve the OpenAI-compatible API (/v1/completions, /v1/chat/completions) on this port")
    s.add_argument("--openai-host", default="127.0.0.1", help="address the OpenAI API binds to (default 127.0.0.1)")
    s.add_argument("--chat-template", default=None,
                   help="chat template for /v1/chat/completions (a .jinja file, a tokenizer_config.json or a "
                        "model folder); default: the model's own, generate/1/chat_template.json")
    k = sub.add_parser("client", help="generate text with a running server")
    k.add_argument("--url", required=True, help="HOST:PORT (the HTTP port for http, the gRPC port for grpc)")
    k.add_argument("--prompt", required=True)
    k.add_argument("--max-new-tokens", type=positive_int, default=None, help="default: the model's (32)")
    k.add_argument("--protocol", choices=("http", "grpc"), default="http")
    k.add_argument("--model", default="generate")
    k.add_argument("--temperature", type=float_in(0.0), default=None, help="0 (default) is greedy")
    k.add_argument("--top-k", type=nonnegative_int, default=None)
    k.add_argument("--top-p", type=float_in(0.0, 1.0), default=None)
    k.add_argument("--seed", type=seed_int, default=None)
    k.add_argument("--timeout", type=float_in(0.1, 3600.0), default=120.0, help="seconds to wait for the answer")
    k.add_argument("--ignore-eos", action="store_true", help="no stop token: always generate --max-new-tokens")
    k.add_argument("--stop", action="append", default=None, metavar="TEXT",
                   help="stop string: the text ends just before it (repeatable)")
    k.add_argument("--frequency-penalty", type=float_in(-2.0, 2.0), default=None, help="OpenAI's, in [-2, 2]")
    k.add_argument("--presence-penalty", type=float_in(-2.0, 2.0), default=None, help="OpenAI's, in [-2, 2]")
    k.add_argument("--logprobs", type=int_in(0, 20), default=None, metavar="K",
                   help="print each new token's logprob and the K most likely tokens on stderr")
    k.add_argument("--tokens", action="store_true", help="also print the token ids on stderr")
    k.add_argument("--stream", action="store_true", help="print the text as the tokens arrive (gRPC streaming, or "
                                                          "HTTP server-sent events)")
    return p


def _check_ports(args) -> None:
    """Two listeners on one port: Triton would start, print its whole usage text and exit; say it first."""
    given = [(o, v) for o, v in (("--http-port", args.http_port), ("--grpc-port", args.grpc_port),
                                 ("--metrics-port", args.metrics_port),
                                 ("--openai-port", getattr(args, "openai_port", None))) if v is not None]
    for (a, port), (b, other) in itertools.combinations(given, 2):
        if port == other:
            raise UsageError(f"{a} and {b}: expected different ports, found both {port}; give {b} another port")


def _serve(args) -> int:
    _check_ports(args)
    from runtime.triton.server import TritonServer
    server = TritonServer(args.repo, host=args.host, http_port=args.http_port, grpc_port=args.grpc_port,
                          metrics_port=args.metrics_port, log_verbose=args.log_verbose, echo_log=True)
    api = None
    if args.openai_port is not None:      # its files and template are checked before Triton starts
        from runtime.openai.server import OpenAIServerThread
        api = OpenAIServerThread(args.repo, server.grpc_url, args.openai_port, host=args.openai_host,
                                 chat_template=args.chat_template)
    elif args.chat_template is not None:
        raise UsageError("--chat-template: expected it with --openai-port (the OpenAI API renders chat templates), "
                         "found it alone; add --openai-port PORT")
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        server.start(timeout_s=args.startup_timeout)
        metrics = f", metrics http://{server.metrics_url}/metrics" if server.metrics_port else ""
        if api is not None:
            api.start()
        openai = f", OpenAI API {api.url}/v1" if api is not None else ""
        print(f"serving {args.repo}: http {server.http_url}, grpc {server.grpc_url}{metrics}{openai} (Ctrl-C stops)",
              file=sys.stderr, flush=True)
        while not stop.is_set():
            if server.proc.poll() is not None:
                print(f"error: tritonserver exited with code {server.proc.returncode}", file=sys.stderr)
                return 1
            if api is not None and not api.alive():
                print("error: the OpenAI API stopped (see the log above)", file=sys.stderr)
                return 1
            stop.wait(0.5)
        return 0
    finally:
        if api is not None:
            api.stop()
        server.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "repo":
        from runtime.triton.repository import have_tritonclient, write_repository
        # every other option of repo is a keyword of write_repository, spelt the same
        options = {k: v for k, v in vars(args).items() if k not in ("command", "build", "out")}
        repo = write_repository(args.build, args.out, **options)
        models = sorted(p.parent.name for p in repo.glob("*/config.pbtxt"))
        backend = json.loads((repo / "repository.json").read_text())["generate_backend"]
        checked = "" if have_tritonclient() else " (configs not checked: install the triton extra and run check)"
        print(f"{repo}: Triton model repository with {', '.join(models)}; generate decodes with {backend}{checked}")
        return 0
    if args.command == "check":
        from runtime.triton.repository import check_repository
        configs = check_repository(args.repo)
        trt = ("; model.plan: its TensorRT tag only (deserializing it needs TensorRT and its GPU)"
               if any(c.platform == "tensorrt_plan" for c in configs.values()) else "")
        print(f"{args.repo}: ok: " + ", ".join(f"{n} ({c.platform or c.backend})" for n, c in configs.items()) + trt)
        return 0
    if args.command == "serve":
        return _serve(args)
    from core.inputs import check_text
    from runtime.triton.client import generate_remote
    check_text(args.prompt, "--prompt")
    options = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "seed": args.seed,
               "frequency_penalty": args.frequency_penalty, "presence_penalty": args.presence_penalty,
               "ignore_eos": True if args.ignore_eos else None, "stop": args.stop, "logprobs": args.logprobs}
    on_text = (lambda piece: print(piece, end="", flush=True)) if args.stream else None
    info: dict = {}
    text, tokens = generate_remote(args.url, args.prompt, args.max_new_tokens, protocol=args.protocol,
                                   model=args.model, timeout_s=args.timeout, on_text=on_text, info=info, **options)
    print("" if args.stream else text)
    if args.tokens:
        print(" ".join(map(str, tokens)), file=sys.stderr)
    if args.logprobs is not None:
        from runtime.generate import logprobs_lines
        for line in logprobs_lines(info.get("logprobs", []), None):
            print(line, file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    return run_cli(run, argv)


if __name__ == "__main__":
    from core.lifecycle import exit_after
    exit_after(main)
