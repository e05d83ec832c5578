"""The OpenAI API's request bodies (pydantic, strict) and its error object.

Requests are checked here, before anything reaches Triton: an unknown field, a value out of range or a
setting this server does not have (n > 1, tools, suffix, logit_bias, response_format other than text)
is one 400 error object naming it, the way OpenAI's API answers:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "n", "code": null}}

Unknown fields are refused, not ignored (OpenAI's own API does the same: "Unrecognized request argument
supplied"), except the few vLLM-style extras clients send to OpenAI-compatible servers (top_k,
ignore_eos, add_generation_prompt, chat_template_kwargs, min_p 0, repetition_penalty 1, ...).
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

UINT64_MAX = 2**64 - 1
MAX_LOGPROBS = 20          # top alternatives per token (vLLM's default cap; OpenAI's chat allows 20)


class OpenAIError(Exception):
    """An error answer: HTTP status and OpenAI's error object."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param)


def validation_error(e: ValidationError) -> OpenAIError:
    """pydantic's first complaint as one OpenAI 400 (the field named as a dotted path)."""
    err = e.errors(include_url=False)[0]
    where = ".".join(str(p) for p in err["loc"]) or None
    if err["type"] == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {where}", where)
    msg = err["msg"].removeprefix("Value error, ")
    return bad_request(f"{where}: {msg}" if where else msg, where)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


class _Sampling(_Strict):
    model: str
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(None, ge=0, le=2**31 - 1)
    temperature: float | None = Field(None, ge=0.0, le=100.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=2**31 - 1)      # vLLM's extra: -1 or 0 is off
    seed: int | None = Field(None, ge=0, le=UINT64_MAX)
    n: int | None = None
    stop: str | list[str] | None = None
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    ignore_eos: bool = False
    user: str | None = None
    # accepted only at the value that changes nothing (clients send them with their defaults)
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None

    @field_validator("n")
    @classmethod
    def _one(cls, v):
        if v is not None and v != 1:
            raise ValueError(f"expected 1 (this server returns one choice per prompt), found {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in stops):
            raise ValueError("expected non-empty strings, found an empty one")
        return v

    @model_validator(mode="after")
    def _neutral(self):
        for name, neutral in (("min_p", 0.0), ("repetition_penalty", 1.0), ("min_tokens", 0)):
            value = getattr(self, name)
            if value is not None and value != neutral:
                raise ValueError(f"{name}: expected {neutral} or absent (not supported by this server), found {value}")
        if self.logit_bias:
            raise ValueError("logit_bias: expected none (not supported by this server), found a bias")
        return self

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    # text, texts (one choice each), token ids, or lists of token ids (one choice each): what lm-eval's
    # local-completions sends by default (tokenized_requests=True: [[ids]])
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _text(cls, v):
        if isinstance(v, list) and not v:
            raise ValueError("expected at least one prompt, found an empty list")
        if not isinstance(v, list) or all(isinstance(p, str) for p in v):
            return v
        ids = lambda p: isinstance(p, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
        if not (ids(v) or all(ids(p) for p in v)):
            raise ValueError("expected text, a list of texts, a list of token ids or a list of such lists, found a "
                             "mix; send one kind")
        for p in (v if all(isinstance(p, list) for p in v) else [v]):
            if not p:
                raise ValueError("expected at least one token id in a token-id prompt, found an empty list")
            if min(p) < 0:
                raise ValueError(f"expected token ids >= 0, found {min(p)}; encode the prompt with the model's tokenizer")
        return v

    @model_validator(mode="after")
    def _completion(self):
        if self.best_of not in (None, 1):
            raise ValueError(f"best_of: expected 1, found {self.best_of}")
        if self.suffix:
            raise ValueError("suffix: expected none (not supported by this server), found text")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens: expected at least 1 (0 only with echo), found 0")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One prompt per choice: a text or a list of token ids."""
        if isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int)):
            return [self.prompt]
        return list(self.prompt)


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")      # name, reasoning_content, ...: the template may read them
    role: str
    content: str | list[ContentPart] | None = None

    def plain(self) -> dict[str, Any]:
        """The message as the template sees it: text parts joined into one string."""
        out = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            if any(p.type != "text" or p.text is None for p in self.content):
                kinds = sorted({p.type for p in self.content if p.type != "text"})
                raise bad_request(f"messages: content parts {kinds}: expected text only (the model reads text)",
                                  "messages")
            out["content"] = "".join(p.text for p in self.content)
        return out


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=2**31 - 1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none"] | None = None

    @model_validator(mode="after")
    def _chat(self):
        if self.max_tokens == 0:
            raise ValueError("max_tokens: expected at least 1, found 0")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs: expected logprobs true with it, found logprobs false")
        if self.response_format and self.response_format.get("type") != "text":
            raise ValueError(f"response_format: expected type text (structured output is not supported), found "
                             f"{self.response_format.get('type')!r}")
        if self.tools:
            raise ValueError("tools: expected none (tool calls are not supported by this server), found tools")
        return self

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
