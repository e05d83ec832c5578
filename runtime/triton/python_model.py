"""The `generate` model of the repository: a Triton Python-backend model over runtime.generate.

One request is one prompt: inputs prompt (BYTES [1]) and, optional, max_new_tokens,
temperature, top_k, top_p, seed, ignore_eos ([1] each); outputs text (BYTES [1]) and
tokens (INT64 [n]: the new tokens, a stop token included, as runtime.generate returns them).
Defaults are runtime.generate's: greedy, seed 0, stop at <|endoftext|> when the tokenizer
has it, max_new_tokens from the config's parameters (32).

The model runs one OrtSession (the project's ORT runtime, cache bound in place) per
instance and generates each request alone (batch 1), so a result equals the local
`python -m runtime.generate` output for the same prompt and settings whatever else the
server is doing; more throughput is Triton's job (instance_group count, more servers).
A request the model cannot serve (empty or too long for the cache, bad sampling
setting) gets one Triton error line; the other requests are unaffected.

`generate_one` is the backend-free core (tests call it directly).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from runtime.generate import GenerationConfig, check_capacity, generate
from runtime.sampling import SamplingConfig
from runtime.session import RuntimeUserError

EOS = "<|endoftext|>"


@dataclass(frozen=True)
class Request:
    prompt: str
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = False


def stop_tokens(tokenizer, ignore_eos: bool) -> tuple[int, ...]:
    """runtime.generate's default: <|endoftext|> when the tokenizer has it."""
    if ignore_eos:
        return ()
    eos = tokenizer.token_to_id(EOS)
    return () if eos is None else (eos,)


def generate_one(session, tokenizer, req: Request) -> tuple[str, list[int]]:
    """(text, new tokens) for one prompt, exactly as python -m runtime.generate computes and prints them."""
    sampling = SamplingConfig(req.temperature, req.top_k, req.top_p)
    try:
        sampling.validate()
    except ValueError as e:
        raise RuntimeUserError(f"sampling: {e}; fix the request") from None
    ids = tokenizer.encode(req.prompt).ids
    check_capacity(session.spec.capacity, [len(ids)], req.max_new_tokens)
    config = GenerationConfig(max_new_tokens=req.max_new_tokens, sampling=sampling, seed=req.seed,
                              stop_tokens=stop_tokens(tokenizer, req.ignore_eos))
    result = generate(session, [ids], config)
    new = result.tokens[0]
    stop = set(config.stop_tokens)
    return tokenizer.decode([t for t in new if t not in stop]), new


class TritonPythonModel:
    """Triton Python-backend entry points: initialize, execute, finalize."""

    def initialize(self, args: dict) -> None:
        import triton_python_backend_utils as pb_utils
        from runtime.model_files import load_tokenizer
        from runtime.ort_session import OrtSession
        self.pb = pb_utils
        config = json.loads(args["model_config"])
        params = {k: v["string_value"] for k, v in config.get("parameters", {}).items()}
        self.default_max_new_tokens = int(params.get("max_new_tokens", 32))
        model_dir = Path(args["model_repository"]) / args["model_version"]
        self.session = OrtSession(model_dir, device="cpu", intra_op_threads=int(params.get("intra_op_threads", 0)))
        self.session.activate()
        self.tokenizer = load_tokenizer(model_dir)

    def _scalar(self, request, name: str, default):
        t = self.pb.get_input_tensor_by_name(request, name)
        if t is None:
            return default
        a = t.as_numpy()
        if a.size != 1:
            raise RuntimeUserError(f"input {name}: expected one value (shape [1]), found shape {list(a.shape)}")
        return a.reshape(-1)[0]

    def _request(self, request) -> Request:
        raw = self._scalar(request, "prompt", None)
        if raw is None:
            raise RuntimeUserError("input prompt: expected a BYTES tensor of shape [1], found none")
        try:
            prompt = raw.decode("utf-8") if isinstance(raw, bytes) else str(raw)
        except UnicodeDecodeError:
            raise RuntimeUserError("input prompt: expected UTF-8 text, found undecodable bytes") from None
        return Request(prompt=prompt,
                       max_new_tokens=int(self._scalar(request, "max_new_tokens", self.default_max_new_tokens)),
                       temperature=float(self._scalar(request, "temperature", 0.0)),
                       top_k=int(self._scalar(request, "top_k", 0)),
                       top_p=float(self._scalar(request, "top_p", 1.0)),
                       seed=int(self._scalar(request, "seed", 0)),
                       ignore_eos=bool(self._scalar(request, "ignore_eos", False)))

    def execute(self, requests):
        pb = self.pb
        responses = []
        for request in requests:
            try:
                text, tokens = generate_one(self.session, self.tokenizer, self._request(request))
                responses.append(pb.InferenceResponse(output_tensors=[
                    pb.Tensor("text", np.array([text.encode("utf-8")], dtype=np.object_)),
                    pb.Tensor("tokens", np.array(tokens, dtype=np.int64))]))
            except Exception as e:  # one bad request must not take the model down
                msg = str(e) if isinstance(e, RuntimeUserError) else f"internal error: {type(e).__name__}: {e}"
                code = getattr(pb.TritonError, "INVALID_ARG", None) if isinstance(e, RuntimeUserError) else None
                err = pb.TritonError(msg, code) if code is not None else pb.TritonError(msg)
                responses.append(pb.InferenceResponse(error=err))
        return responses

    def finalize(self) -> None:
        self.session.deactivate()
