"""The OpenAI-compatible HTTP API (an ASGI app on Starlette, served by uvicorn) over the running Triton
server's `generate` model: a thin client of its gRPC stream (runtime/openai/engine.py), so batching,
cancellation and metrics stay Triton's.

    GET  /health                 200 {"status": "ok"} when Triton and the model are ready, else 503
    GET  /v1/models              the served model (its id is the Triton model's name: "generate")
    POST /v1/completions         prompt (text or token ids, or a list of either: one choice each), echo, logprobs (0-20)
    POST /v1/chat/completions    messages through the model's chat template (runtime/openai/chat_template.py),
                                 logprobs / top_logprobs

Both POSTs take max_tokens (chat: max_completion_tokens too), stop (a string or a list; matched on the
decoded text by the model, the stop text not returned), temperature, top_p, top_k, seed, n = 1,
frequency/presence_penalty, ignore_eos, and stream (server-sent events in OpenAI's chunk shape,
stream_options.include_usage, `data: [DONE]`); whole answers carry usage.

Errors are OpenAI's error object (runtime/openai/protocol.py) with its status: 400 for a bad request
(checked here, or refused by the model with its message), 404 for an unknown model, 503 when the model's
scheduler is full (its own "server busy: ..." message), 500 for a server fault; one line in the log,
never a traceback. A client that disconnects, before or during its answer, cancels its Triton request.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid

from pydantic import ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from runtime.openai.chat_template import TemplateRenderError, render_chat
from runtime.openai.engine import GenerateRequest, Piece, TritonEngine
from runtime.openai.protocol import (ChatCompletionRequest, CompletionRequest, OpenAIError, bad_request,
                                     validation_error)

log = logging.getLogger("runtime.openai")
OWNED_BY = "tapernorm-deploy"


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


def error_response(e: OpenAIError) -> JSONResponse:
    log.warning("%d %s", e.status, e.message)
    return JSONResponse(e.body(), status_code=e.status)


async def _until_disconnect(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, awaitable):
    """The awaitable's result; ClientGone (and the awaitable cancelled: its Triton requests with it) if the
    client disconnects first."""
    task = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_until_disconnect(request.receive))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientGone


class EventStream(Response):
    """Server-sent events from an async iterator of `data:` payloads (dicts, or the string [DONE]). The
    iterator runs beside a watch on the connection: a disconnect cancels it (and so its Triton request)
    at once, not at the next write."""

    media_type = "text/event-stream"

    def __init__(self, events):
        super().__init__(content=None, status_code=200, headers={"Cache-Control": "no-cache"})
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]   # chunked: no length
        self.events = events

    async def __call__(self, scope, receive, send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})

        async def event(data) -> None:
            data = data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)
            await send({"type": "http.response.body", "body": f"data: {data}\n\n".encode(), "more_body": True})

        async def pump():
            try:
                async for item in self.events:
                    await event(item)
            except OpenAIError as e:
                log.warning("%d %s (mid-stream)", e.status, e.message)
                await event(e.body())
            except OSError:             # the client is gone
                return
            except Exception as e:  # noqa: BLE001 - a fault mid-stream: one error event and one log line
                log.error("internal error mid-stream: %s: %s", type(e).__name__, e)
                await event(OpenAIError(500, f"internal error: {type(e).__name__}: {e}", type="server_error").body())
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        producer = asyncio.ensure_future(pump())
        watcher = asyncio.ensure_future(_until_disconnect(receive))
        try:
            await asyncio.wait({producer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (producer, watcher):
                t.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError, Exception):
                await producer
            with contextlib.suppress(Exception):
                await self.events.aclose()


class Tokens:
    """Token ids -> the text OpenAI's logprobs show for each (the tokenizer's decode of that one token)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[int, str] = {}
        self._adds_bos: bool | None = None

    def without_doubled_bos(self, prompt: str, bos: str | None) -> str:
        """The rendered chat prompt without its leading BOS text where the tokenizer adds that BOS itself (a
        Llama-3 tokenizer.json's post-processor): the model encodes the prompt with the tokenizer's special
        tokens, transformers' apply_chat_template(tokenize=True) without them, so the tokens stay transformers'
        (one BOS, not two)."""
        if not bos or not prompt.startswith(bos) or self.tokenizer is None:
            return prompt
        if self._adds_bos is None:
            bos_id = self.tokenizer.token_to_id(bos)
            ids = self.tokenizer.encode("a").ids
            self._adds_bos = bos_id is not None and bool(ids) and ids[0] == bos_id
        return prompt[len(bos):] if self._adds_bos else prompt

    def decode(self, ids: list[int]) -> str:
        """A token-id prompt's text (what echo returns): the tokenizer's decode, special tokens kept."""
        if self.tokenizer is None:
            return "".join(self.text(t) for t in ids)
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def text(self, token: int) -> str:
        if token not in self._cache:
            self._cache[token] = self.tokenizer.decode([token], skip_special_tokens=False) \
                if self.tokenizer is not None else f"<{token}>"
        return self._cache[token]


def _now() -> int:
    return int(time.time())


class OpenAIServer:
    """The app's state: the Triton engine, the served model's name, its tokenizer (for logprobs) and its
    chat template (None: chat requests are refused with a 400 saying so)."""

    def __init__(self, engine: TritonEngine, model: str = "generate", tokenizer=None, chat_template: dict | None = None):
        self.engine, self.model = engine, model
        self.tokens = Tokens(tokenizer)
        self.chat_template = chat_template
        self.created = _now()

    # --- routes ---------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        if await self.engine.ready():
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "unavailable", "detail": f"triton model {self.model!r} is not ready"},
                            status_code=503)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name != self.model:
            return error_response(self._unknown(name))
        return JSONResponse(self._model_card())

    def _model_card(self) -> dict:
        return {"id": self.model, "object": "model", "created": self.created, "owned_by": OWNED_BY}

    def _unknown(self, name: str) -> OpenAIError:
        return OpenAIError(404, f"The model `{name}` does not exist; this server serves {self.model!r}",
                           param="model", code="model_not_found")

    async def _parse(self, request: Request, kind):
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as e:
            raise bad_request(f"expected a JSON body, found an unreadable one ({e})") from None
        if not isinstance(body, dict):
            raise bad_request(f"expected a JSON object, found {type(body).__name__}")
        try:
            req = kind.model_validate(body)
        except ValidationError as e:
            raise validation_error(e) from None
        if req.model != self.model:
            raise self._unknown(req.model)
        return req

    async def completions(self, request: Request) -> Response:
        return await self._serve(request, CompletionRequest, self._completion_plan)

    async def chat_completions(self, request: Request) -> Response:
        return await self._serve(request, ChatCompletionRequest, self._chat_plan)

    async def _serve(self, request: Request, kind, plan) -> Response:
        try:
            req = await self._parse(request, kind)
            shape = plan(req)
            if req.stream:
                events = self._stream(shape, req)
                first = await _unless_disconnected(request, events.__anext__())   # errors before any output: a status
                return EventStream(_prepend(first, events))
            return JSONResponse(await _unless_disconnected(request, self._whole(shape, req)))
        except OpenAIError as e:
            return error_response(e)
        except ClientGone:
            log.info("client disconnected; its request was cancelled")
            return Response(status_code=499)
        except Exception as e:  # noqa: BLE001 - a fault here is one 500 and one log line, never a traceback
            return error_response(OpenAIError(500, f"internal error: {type(e).__name__}: {' '.join(str(e).split())}",
                                              type="server_error"))

    # --- what each endpoint asks of the model and how it answers --------------------------------

    def _sampling(self, req, prompt: str | list[int], max_tokens: int | None, **extra) -> GenerateRequest:
        ids = None
        if not isinstance(prompt, str):     # token ids: sent as input_ids (the model checks them), echoed as their text
            ids, prompt = list(prompt), self.tokens.decode(prompt)
        return GenerateRequest(prompt, prompt_ids=ids, max_tokens=max_tokens, temperature=req.temperature, top_p=req.top_p,
                               top_k=req.top_k, seed=req.seed, stop=req.stop_list(),
                               frequency_penalty=req.frequency_penalty, presence_penalty=req.presence_penalty,
                               ignore_eos=req.ignore_eos, stream=req.stream, **extra)

    def _completion_plan(self, req: CompletionRequest) -> "Shape":
        k = req.logprobs
        zero = req.max_tokens == 0          # echo only: the prompt's logprobs, nothing generated
        gens = [self._sampling(req, p, 1 if zero else req.max_tokens, logprobs=k is not None, top_logprobs=k or 0,
                               prompt_logprobs=bool(req.echo and k is not None)) for p in req.prompts()]
        return Shape("text_completion", "cmpl", gens, chat=False, echo=req.echo, zero=zero, logprobs=k)

    def _chat_plan(self, req: ChatCompletionRequest) -> "Shape":
        if self.chat_template is None:
            raise bad_request(f"model {self.model!r} has no chat template (its Hugging Face folder had none): "
                              "use /v1/completions, or start the server with --chat-template FILE", "messages")
        messages = [m.plain() for m in req.messages]
        try:
            prompt = render_chat(self.chat_template, messages, add_generation_prompt=req.add_generation_prompt,
                                 **(req.chat_template_kwargs or {}))
        except TemplateRenderError as e:
            raise bad_request(str(e), "messages") from None
        prompt = self.tokens.without_doubled_bos(prompt, self.chat_template.get("bos_token"))
        gen = self._sampling(req, prompt, req.token_limit(), logprobs=req.logprobs, top_logprobs=req.top_logprobs or 0)
        return Shape("chat.completion", "chatcmpl", [gen], chat=True, logprobs=req.top_logprobs if req.logprobs else None)

    async def _whole(self, shape: "Shape", req) -> dict:
        tasks = [asyncio.ensure_future(_collect(self.engine.generate(g))) for g in shape.gens]
        try:
            results = await asyncio.gather(*tasks)
        finally:        # one prompt's error (or the client gone) cancels the others' Triton requests
            for t in tasks:
                t.cancel()
        choices, prompt_tokens, completion_tokens = [], 0, 0
        for i, (gen, piece) in enumerate(zip(shape.gens, results)):
            if shape.zero:
                piece = Piece(finish_reason="length", num_input_tokens=piece.num_input_tokens, num_output_tokens=0,
                              prompt_ids=piece.prompt_ids, prompt_logprobs=piece.prompt_logprobs,
                              prompt_top_ids=piece.prompt_top_ids, prompt_top_logprobs=piece.prompt_top_logprobs)
            prompt_tokens += _prompt_count(piece)
            completion_tokens += piece.num_output_tokens if piece.num_output_tokens is not None else len(piece.ids)
            choices.append(self._choice(shape, i, gen, piece, whole=True))
        return {"id": shape.id, "object": shape.object, "created": shape.created, "model": self.model,
                "choices": choices, "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                              "total_tokens": prompt_tokens + completion_tokens}}

    def _choice(self, shape: "Shape", index: int, gen: GenerateRequest, piece: Piece, whole: bool,
                first: bool = False) -> dict:
        text = piece.text
        if shape.chat:
            logprobs = self._chat_logprobs(piece) if shape.logprobs is not None else None
            body = {"role": "assistant", "content": text} if whole else \
                ({"role": "assistant", "content": text} if first else ({"content": text} if text else {}))
            return {"index": index, ("message" if whole else "delta"): body, "logprobs": logprobs,
                    "finish_reason": piece.finish_reason}
        logprobs = None
        if shape.logprobs is not None:
            logprobs = self._completion_logprobs(piece, gen.prompt if shape.echo and (whole or first) else None)
        if shape.echo and (whole or first):
            text = gen.prompt + text
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": piece.finish_reason}

    def _chat_logprobs(self, piece: Piece) -> dict:
        content = []
        for j, (token, lp) in enumerate(zip(piece.ids, piece.logprobs or [])):
            s = self.tokens.text(token)
            top = []
            if piece.top_ids:
                top = [{"token": (t := self.tokens.text(i)), "logprob": x, "bytes": list(t.encode())}
                       for i, x in zip(piece.top_ids[j], piece.top_logprobs[j])]
            content.append({"token": s, "logprob": lp, "bytes": list(s.encode()), "top_logprobs": top})
        return {"content": content, "refusal": None}

    def _completion_logprobs(self, piece: Piece, prompt: str | None) -> dict:
        """OpenAI's legacy logprobs object; with echo (prompt given) the prompt's tokens first."""
        tokens, token_logprobs, top, offsets = [], [], [], []
        offset = 0
        if prompt is not None and piece.prompt_ids is not None:
            for j, token in enumerate(piece.prompt_ids):
                s = self.tokens.text(token)
                lp = piece.prompt_logprobs[j] if piece.prompt_logprobs and j < len(piece.prompt_logprobs) else None
                alternatives = None
                if lp is not None:      # the k most likely tokens there (the model's prefill), then the token itself
                    alternatives = {}
                    if piece.prompt_top_ids and j < len(piece.prompt_top_ids):
                        alternatives = {self.tokens.text(i): x for i, x in
                                        zip(piece.prompt_top_ids[j], piece.prompt_top_logprobs[j]) if i >= 0}
                    alternatives.setdefault(s, lp)
                tokens.append(s)
                token_logprobs.append(lp)
                top.append(alternatives)
                offsets.append(offset)
                offset += len(s)
        elif prompt is not None:
            offset = len(prompt)
        for j, (token, lp) in enumerate(zip(piece.ids, piece.logprobs or [])):
            s = self.tokens.text(token)
            alternatives = {}
            if piece.top_ids:
                alternatives = {self.tokens.text(i): x for i, x in zip(piece.top_ids[j], piece.top_logprobs[j])}
            alternatives.setdefault(s, lp)
            tokens.append(s)
            token_logprobs.append(lp)
            top.append(alternatives)
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}

    async def _stream(self, shape: "Shape", req):
        """The chunks of a streamed answer (all prompts' choices interleaved as they come), then usage when
        asked, then [DONE]. An error after the first chunk is sent as one error event."""
        queue: asyncio.Queue = asyncio.Queue()
        usage = {"prompt_tokens": 0, "completion_tokens": 0}

        async def run(i: int, gen: GenerateRequest):
            try:
                first = True
                async for piece in self.engine.generate(gen):
                    if shape.zero:
                        piece = Piece(finish_reason="length", num_input_tokens=piece.num_input_tokens,
                                      num_output_tokens=0, prompt_ids=piece.prompt_ids,
                                      prompt_logprobs=piece.prompt_logprobs, prompt_top_ids=piece.prompt_top_ids,
                                      prompt_top_logprobs=piece.prompt_top_logprobs)
                    if piece.finish_reason is not None:
                        usage["prompt_tokens"] += _prompt_count(piece)
                        usage["completion_tokens"] += piece.num_output_tokens or 0
                    await queue.put(("piece", i, gen, piece, first))
                    first = False
                    if piece.finish_reason is not None:
                        break
            except OpenAIError as e:
                await queue.put(("error", e))
            finally:
                await queue.put(("end", i))

        tasks = [asyncio.ensure_future(run(i, g)) for i, g in enumerate(shape.gens)]
        try:
            running, include, sent = len(tasks), req.include_usage(), False
            while running:
                item = await queue.get()
                if item[0] == "end":
                    running -= 1
                    continue
                if item[0] == "error":
                    if not sent:            # nothing sent yet: the answer is this error, with its status
                        raise item[1]
                    log.warning("%d %s (mid-stream)", item[1].status, item[1].message)
                    yield item[1].body()    # as vLLM does: one error event, then [DONE]
                    yield "[DONE]"
                    return
                sent = True
                _, i, gen, piece, first = item
                chunk = {"id": shape.id, "object": shape.object + ("" if not shape.chat else ".chunk"),
                         "created": shape.created, "model": self.model,
                         "choices": [self._choice(shape, i, gen, piece, whole=False, first=first)]}
                if include:
                    chunk["usage"] = None
                yield chunk
            if include:
                total = usage["prompt_tokens"] + usage["completion_tokens"]
                yield {"id": shape.id, "object": shape.object + ("" if not shape.chat else ".chunk"),
                       "created": shape.created, "model": self.model, "choices": [],
                       "usage": {**usage, "total_tokens": total}}
            yield "[DONE]"
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


class Shape:
    """What one API request became: its Triton requests and how its answer is shaped."""

    def __init__(self, object: str, prefix: str, gens: list[GenerateRequest], chat: bool, echo: bool = False,
                 zero: bool = False, logprobs: int | None = None):
        self.object, self.gens, self.chat, self.echo, self.zero, self.logprobs = object, gens, chat, echo, zero, logprobs
        self.id = f"{prefix}-{uuid.uuid4().hex[:24]}"
        self.created = _now()


def _prompt_count(piece: Piece) -> int:
    if piece.num_input_tokens is not None:
        return piece.num_input_tokens
    return len(piece.prompt_ids) if piece.prompt_ids is not None else 0


async def _collect(pieces) -> Piece:
    """The pieces of one request merged into one (texts, ids and logprobs concatenated; the last one's counts)."""
    out = Piece(logprobs=None)
    async for p in pieces:
        out.text += p.text
        out.ids += p.ids
        if p.logprobs is not None:
            out.logprobs = (out.logprobs or []) + p.logprobs
        if p.top_ids is not None:
            out.top_ids = (out.top_ids or []) + p.top_ids
            out.top_logprobs = (out.top_logprobs or []) + p.top_logprobs
        for name in ("finish_reason", "num_input_tokens", "num_output_tokens", "prompt_ids", "prompt_logprobs",
                     "prompt_top_ids", "prompt_top_logprobs"):
            if getattr(p, name) is not None:
                setattr(out, name, getattr(p, name))
    return out


async def _prepend(first, rest):
    yield first
    async for item in rest:
        yield item


def create_app(engine: TritonEngine, model: str = "generate", tokenizer=None, chat_template: dict | None = None) -> Starlette:
    """The ASGI app; the engine's channel opens on startup and closes on shutdown."""
    server = OpenAIServer(engine, model, tokenizer, chat_template)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await engine.open()
        try:
            yield
        finally:
            await engine.close()

    async def not_found(request: Request, exc) -> Response:
        status = getattr(exc, "status_code", 404)
        return error_response(OpenAIError(status, f"{request.method} {request.url.path}: "
                                          f"{'no such route' if status == 404 else 'method not allowed'}"))

    async def internal(request: Request, exc: Exception) -> Response:
        log.error("internal error on %s: %s: %s", request.url.path, type(exc).__name__, exc)
        return JSONResponse(OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error").body(),
                            status_code=500)

    routes = [Route("/health", server.health), Route("/v1/models", server.models),
              Route("/v1/models/{model:path}", server.model),
              Route("/v1/completions", server.completions, methods=["POST"]),
              Route("/v1/chat/completions", server.chat_completions, methods=["POST"])]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={404: not_found, 405: not_found, Exception: internal})
    app.state.server = server
    return app
