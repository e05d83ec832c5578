"""The OpenAI server's way to the `generate` model: Triton's gRPC stream (tritonclient.grpc.aio), one
stream per request on one shared channel, so batching, cancellation and metrics stay Triton's.

    engine = TritonEngine("127.0.0.1:8001")
    async for piece in engine.generate(GenerateRequest("Once upon a time", max_tokens=16, stream=True)):
        ...   # Piece: text, ids, logprobs ...; the last one has finish_reason

Inputs and outputs are the generate model's LLM tensor contract (runtime/triton/llm_tensors.py: Triton's
OpenAI frontend's names, text_input -> text_output, ...). A request given up here (the HTTP client
disconnected, the task cancelled) cancels its gRPC call: Triton marks the request cancelled and the
model's scheduler frees its slot within one step.

Errors: Triton's stream carries the model's message without a status, so its kind is read from the
message (runtime/triton/python_model.py's conventions): "server busy: ..." -> 503 with that message,
"internal error: ..." -> 500, anything else the model or Triton refused -> 400.
"""
from __future__ import annotations

import asyncio
import itertools
import math
from dataclasses import dataclass, field

import numpy as np

from runtime.openai.protocol import OpenAIError
from runtime.openai import tensors as T


@dataclass
class GenerateRequest:
    prompt: str                             # the text (with prompt_ids: their decoded text, for echo)
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logprobs: bool = False                  # the chosen tokens' logprobs
    top_logprobs: int = 0                   # alternatives per token
    prompt_logprobs: bool = False           # the prompt tokens' logprobs (echo)
    ignore_eos: bool = False
    stream: bool = False
    prompt_ids: list[int] | None = None      # a token-id prompt: sent as input_ids instead of the text


@dataclass
class Piece:
    """One response of the model: the text and tokens it adds, their logprobs where asked; the last one has
    finish_reason and the token counts."""
    text: str = ""
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None
    top_ids: list[list[int]] | None = None            # [n, k]
    top_logprobs: list[list[float]] | None = None     # [n, k]
    finish_reason: str | None = None
    num_input_tokens: int | None = None
    num_output_tokens: int | None = None
    prompt_ids: list[int] | None = None
    prompt_logprobs: list[float | None] | None = None     # None for the first prompt token
    prompt_top_ids: list[list[int]] | None = None        # [p, k] with top_logprobs: the prompt's alternatives
    prompt_top_logprobs: list[list[float]] | None = None  # [p, k]; row 0 (the first prompt token) has none


def triton_error(message: str) -> OpenAIError:
    """The model's (or Triton's) refusal as the OpenAI error a client should see."""
    msg = " ".join(str(message).split())
    if "server busy" in msg:
        return OpenAIError(503, msg, type="server_error", code="server_busy")
    if msg.startswith("internal error") or "internal error:" in msg[:40]:
        return OpenAIError(500, msg, type="server_error")
    return OpenAIError(400, msg)


def build_inputs(grpc, req: GenerateRequest) -> list:
    """The request's input tensors (tritonclient.grpc InferInputs); options left None are not sent."""
    scalars = [(T.MAX_TOKENS, req.max_tokens), (T.TEMPERATURE, req.temperature), (T.TOP_P, req.top_p),
               (T.TOP_K, None if req.top_k is None else max(req.top_k, 0)), (T.SEED, req.seed),
               (T.FREQUENCY_PENALTY, req.frequency_penalty or None), (T.PRESENCE_PENALTY, req.presence_penalty or None),
               (T.STREAM, req.stream), (T.RETURN_NUM_INPUT_TOKENS, True), (T.RETURN_NUM_OUTPUT_TOKENS, True),
               (T.RETURN_LOG_PROBS, req.logprobs or None), (T.TOP_LOGPROBS, req.top_logprobs or None),
               (T.RETURN_PROMPT_LOG_PROBS, req.prompt_logprobs or None), (T.IGNORE_EOS, req.ignore_eos or None)]
    arrays = [(T.TEXT_INPUT, np.array([req.prompt.encode("utf-8")], dtype=np.object_)) if req.prompt_ids is None
              else (T.INPUT_IDS, np.array(req.prompt_ids, dtype=T.NUMPY[T.INPUT_IDS]))]
    arrays += [(name, np.array([value], dtype=T.NUMPY[name])) for name, value in scalars if value is not None]
    if req.stop:
        arrays.append((T.STOP_WORDS, np.array([s.encode("utf-8") for s in req.stop], dtype=np.object_)))
    out = []
    for name, a in arrays:
        a = a.reshape(T.shape_of(name, a.size))
        out.append(grpc.InferInput(name, list(a.shape), T.DTYPES[name]).set_data_from_numpy(a))
    return out


def _flat(result, name: str):
    a = result.as_numpy(name)
    return None if a is None else a


def parse_piece(result) -> Piece:
    """A tritonclient InferResult of the generate model -> Piece."""
    p = Piece()
    text = _flat(result, T.TEXT_OUTPUT)
    if text is not None and text.size:
        v = text.reshape(-1)[0]
        p.text = v.decode("utf-8") if isinstance(v, bytes) else str(v)
    ids = _flat(result, T.OUTPUT_IDS)
    if ids is not None:
        p.ids = [int(t) for t in ids.reshape(-1)]
    reason = _flat(result, T.FINISH_REASON)
    if reason is not None and reason.size:
        v = reason.reshape(-1)[0]
        p.finish_reason = (v.decode() if isinstance(v, bytes) else str(v)) or None
    for name, attr in ((T.NUM_INPUT_TOKENS, "num_input_tokens"), (T.NUM_OUTPUT_TOKENS, "num_output_tokens")):
        v = _flat(result, name)
        if v is not None and v.size:
            setattr(p, attr, int(v.reshape(-1)[0]))
    lp = _flat(result, T.OUTPUT_LOG_PROBS)
    if lp is not None:
        p.logprobs = [float(x) for x in lp.reshape(-1)]
    top_ids, top_lp = _flat(result, T.TOP_LOG_PROBS_IDS), _flat(result, T.TOP_LOG_PROBS)
    if top_ids is not None and top_lp is not None:
        n = len(p.ids)
        top_ids, top_lp = top_ids.reshape(n, -1) if n else top_ids.reshape(0, 0), top_lp.reshape(n, -1) if n else top_lp.reshape(0, 0)
        p.top_ids = [[int(i) for i in row] for row in top_ids]
        p.top_logprobs = [[float(x) for x in row] for row in top_lp]
    pids, plp = _flat(result, T.PROMPT_IDS), _flat(result, T.PROMPT_LOG_PROBS)
    if pids is not None:
        p.prompt_ids = [int(t) for t in pids.reshape(-1)]
    if plp is not None:
        p.prompt_logprobs = [None if math.isnan(float(x)) else float(x) for x in plp.reshape(-1)]
    top_ids, top_lp = _flat(result, T.PROMPT_TOP_LOG_PROBS_IDS), _flat(result, T.PROMPT_TOP_LOG_PROBS)
    if top_ids is not None and top_lp is not None and p.prompt_ids:
        n = len(p.prompt_ids)
        p.prompt_top_ids = [[int(i) for i in row] for row in top_ids.reshape(n, -1)]
        p.prompt_top_logprobs = [[float(x) for x in row] for row in top_lp.reshape(n, -1)]
    return p


class TritonEngine:
    """One gRPC channel to the Triton server; `generate` opens one stream per request on it."""

    def __init__(self, url: str, model: str = "generate"):
        self.url, self.model = url, model
        self.client = None
        self._ids = itertools.count(1)

    def _grpc(self):
        import tritonclient.grpc as grpc
        return grpc

    async def open(self) -> None:
        import tritonclient.grpc.aio as aio
        if self.client is None:
            self.client = aio.InferenceServerClient(url=self.url)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()
            self.client = None

    async def ready(self) -> bool:
        """The server and the model are ready (what GET /health reports)."""
        await self.open()
        try:
            return bool(await self.client.is_server_ready()) and bool(await self.client.is_model_ready(self.model))
        except Exception:  # noqa: BLE001 - any failure to reach it is "not ready"
            return False

    async def generate(self, req: GenerateRequest):
        """The model's responses for `req` as Pieces; raises OpenAIError with the model's message."""
        from tritonclient.utils import InferenceServerException
        await self.open()
        grpc = self._grpc()
        inputs = build_inputs(grpc, req)
        finished = asyncio.Event()

        async def requests():
            yield {"model_name": self.model, "inputs": inputs, "request_id": str(next(self._ids))}
            await finished.wait()      # the stream stays open until the last response (or a cancel) is in

        stream = self.client.stream_infer(requests())
        done = False
        try:
            async for result, error in stream:
                if error is not None:
                    done = True
                    raise triton_error(error.message() if callable(getattr(error, "message", None)) else str(error))
                piece = parse_piece(result)
                params = result.get_response().parameters
                final = "triton_final_response" in params and params["triton_final_response"].bool_param
                if final or piece.finish_reason is not None:
                    done = True
                yield piece
                if done:
                    return
            raise OpenAIError(502, f"triton {self.url}: the stream ended before the last response", type="server_error")
        except InferenceServerException as e:
            raise triton_error(e.message() if callable(getattr(e, "message", None)) else str(e)) from None
        except Exception as e:
            import grpc as grpc_mod
            if isinstance(e, grpc_mod.aio.AioRpcError):
                if e.code() == grpc_mod.StatusCode.UNAVAILABLE:
                    raise OpenAIError(503, f"triton {self.url}: expected a server there, found none ({e.details()})",
                                      type="server_error") from None
                raise triton_error(e.details() or str(e.code())) from None
            raise
        finally:
            finished.set()
            if not done:
                stream.cancel()         # Triton cancels the request; the scheduler frees its slot
