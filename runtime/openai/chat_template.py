"""Chat messages -> the prompt text, rendered the way transformers' `tokenizer.apply_chat_template(messages,
tokenize=False, add_generation_prompt=True)` renders it, so a served chat request sees the prompt the
model was tuned on.

What transformers does (utils/chat_template_utils.py, _compile_jinja_template and render_jinja_template),
and so this module: jinja2's ImmutableSandboxedEnvironment (templates from the Hub are untrusted code)
with trim_blocks and lstrip_blocks, the loopcontrols extension and a {% generation %} block that renders
its body; globals raise_exception (a TemplateError), strftime_now, a tojson filter that does not escape
HTML (json.dumps, ensure_ascii False); variables messages, tools, documents, add_generation_prompt and
the tokenizer's special tokens (bos_token, eos_token, ...); message keys whose value is None dropped
(OpenAI clients send "content": null), a message's reasoning under reasoning_content and thinking.

The template and its tokens come from core.chat_template (carried into the repository as
generate/1/chat_template.json), or from `serve --chat-template FILE`.
"""
from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache

from runtime.session import RuntimeUserError

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class TemplateRenderError(RuntimeUserError):
    """The template refused the conversation (its raise_exception) or failed on it: a bad request."""


@lru_cache(maxsize=8)
def compile_template(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """{% generation %}...{% endgeneration %}: transformers marks assistant tokens with it; rendered as is."""
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

        def _render(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise RuntimeUserError(f"chat template: expected a Jinja template, found a syntax error at line {e.lineno} "
                               f"({e.message}); fix it, or pass another with --chat-template FILE") from None


def check_template(template: dict) -> None:
    """Compile it once at startup, so a broken template fails `serve`, not every request."""
    compile_template(template["chat_template"])


def _plain(message: dict) -> dict:
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def render_chat(template: dict, messages: list[dict], add_generation_prompt: bool = True,
                tools: list | None = None, **kwargs) -> str:
    """The prompt text for `messages` (dicts with role and content), as transformers renders it.

    template: {"chat_template": source, "bos_token": ..., ...} (core.chat_template's file); kwargs
    (the request's chat_template_kwargs, e.g. enable_thinking) override its tokens, as in transformers."""
    import jinja2
    compiled = compile_template(template["chat_template"])
    special = {k: v for k, v in template.items() if k != "chat_template"}
    try:
        return compiled.render(messages=[_plain(m) for m in messages], tools=tools, documents=None,
                               add_generation_prompt=add_generation_prompt, **{**special, **kwargs})
    except jinja2.exceptions.TemplateError as e:    # raise_exception, an undefined call, a sandbox refusal
        raise TemplateRenderError(f"chat template: {' '.join(str(e).split())}") from None
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        raise TemplateRenderError(f"chat template: it cannot render these messages ({type(e).__name__}: "
                                  f"{' '.join(str(e).split())})") from None
