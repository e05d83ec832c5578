"""Chat templates: found in a Hugging Face folder as transformers finds them, carried by models.convert,
export.build and runtime.triton repo, and rendered as transformers' apply_chat_template(tokenize=False)
renders them (tests/openai/templates.py: Qwen3-, Gemma- and Llama-3-shaped templates)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("jinja2", reason="chat templates render with jinja2 (pip install -e '.[dev,triton]')")

from core.chat_template import CHAT_TEMPLATE, ChatTemplateError, load_chat_template, read_hf_chat_template
from runtime.openai.chat_template import TemplateRenderError, render_chat
from tests.openai.templates import TEMPLATES

CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}],
    [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?\n"},
     {"role": "user", "content": "Tell me a story."}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure.", "reasoning_content": "\nthink\n"},
     {"role": "user", "content": "Again", "name": None}],
]


def tokenizer_folder(path, name: str, form: str = "config"):
    """A tiny tokenizer folder: tokenizer.json with the template's special tokens, tokenizer_config.json
    (its chat_template when form is "config"; AddedToken dicts for the tokens when form is "jinja") and
    chat_template.jinja when form is "jinja"."""
    from tests.helpers import tiny_tokenizer_json
    from tokenizers import AddedToken, Tokenizer
    template, tokens, specials = TEMPLATES[name]
    tok_path = tiny_tokenizer_json(path / "tokenizer.json")
    tok = Tokenizer.from_file(str(tok_path))
    tok.add_special_tokens([AddedToken(s, special=True) for s in specials])
    tok.save(str(tok_path))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 512}
    for key, value in tokens.items():
        if value is not None:
            config[key] = {"content": value, "special": True, "__type": "AddedToken"} if form == "jinja" else value
    if form == "jinja":
        (path / "chat_template.jinja").write_text(template)
    else:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("form", ["config", "jinja"])
@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_render_equals_transformers(tmp_path, name, form):
    transformers = pytest.importorskip("transformers")
    folder = tokenizer_folder(tmp_path / name, name, form)
    hf = transformers.AutoTokenizer.from_pretrained(str(folder))
    template = read_hf_chat_template(folder)
    assert template is not None
    for messages in CONVERSATIONS:
        if name == "gemma" and messages[-1]["role"] != "user":
            continue
        for add in (True, False):
            want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
            assert render_chat(template, messages, add_generation_prompt=add) == want, (name, messages, add)
    if name == "qwen3":
        messages = CONVERSATIONS[0]
        want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
        assert render_chat(template, messages, enable_thinking=False) == want


def test_template_refusal_is_a_render_error(tmp_path):
    template = read_hf_chat_template(tokenizer_folder(tmp_path / "g", "gemma"))
    with pytest.raises(TemplateRenderError, match="roles must alternate"):
        render_chat(template, [{"role": "assistant", "content": "x"}])


def test_sandbox_refuses_escapes():
    template = {"chat_template": "{{ messages.__class__.__mro__ }}"}
    with pytest.raises(TemplateRenderError):
        render_chat(template, [{"role": "user", "content": "x"}])


def test_folder_without_template(tmp_path):
    from tests.helpers import tiny_tokenizer_json
    tiny_tokenizer_json(tmp_path / "tokenizer.json")
    assert read_hf_chat_template(tmp_path) is None
    with pytest.raises(ChatTemplateError, match="found none"):
        load_chat_template(tmp_path)


def test_load_override_file(tmp_path):
    (tmp_path / "t.jinja").write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert render_chat(load_chat_template(tmp_path / "t.jinja"), [{"role": "user", "content": "a"}]) == "[a]"
    with pytest.raises(ChatTemplateError, match="found nothing"):
        load_chat_template(tmp_path / "missing.jinja")


def test_convert_build_and_repo_carry_the_template(tmp_path):
    """HF folder (chat_template.jinja) -> models.convert -> export.build -> runtime.triton repo: the same
    template and tokens reach generate/1/chat_template.json."""
    pytest.importorskip("transformers")

    from tests.hf_models import hf_model, save_hf
    hf = save_hf(hf_model("llama"), tmp_path / "hf")
    tokenizer_folder(hf, "llama3", form="jinja")
    want = read_hf_chat_template(hf)
    assert want["bos_token"] == "<|begin_of_text|>" and "date_string" in want["chat_template"]
    root = __import__("pathlib").Path(__file__).resolve().parents[2]
    run = lambda *a: subprocess.run([sys.executable, "-m", *a], capture_output=True, text=True, cwd=root, timeout=600)
    proc = run("models.convert", str(hf), "--out", str(tmp_path / "ckpt"))
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "ckpt" / CHAT_TEMPLATE).read_text()) == want
    proc = run("export.build", "--checkpoint", str(tmp_path / "ckpt"), "--out", str(tmp_path / "build"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "build" / CHAT_TEMPLATE).read_text()) == want
    from runtime.triton.repository import write_repository
    repo = write_repository(tmp_path / "build", tmp_path / "repo", generate_backend="ort-cpu", validate=False)
    assert json.loads((repo / "generate" / "1" / CHAT_TEMPLATE).read_text()) == want


def test_bos_not_doubled_where_the_tokenizer_adds_it(tmp_path):
    """A Llama-3-like tokenizer.json adds <|begin_of_text|> itself (its post-processor) and the template renders
    bos_token too: the prompt the model encodes gives transformers' apply_chat_template(tokenize=True) tokens,
    one BOS; a tokenizer that adds none keeps the template's."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, processors
    from runtime.openai.app import Tokens
    folder = tokenizer_folder(tmp_path / "llama", "llama3")
    messages = CONVERSATIONS[1]
    template = read_hf_chat_template(folder)
    rendered = render_chat(template, messages)
    plain = Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert Tokens(plain).without_doubled_bos(rendered, template["bos_token"]) == rendered
    bos = plain.token_to_id("<|begin_of_text|>")
    plain.post_processor = processors.TemplateProcessing(single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B",
                                                         special_tokens=[("<|begin_of_text|>", bos)])
    plain.save(str(folder / "tokenizer.json"))
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    prompt = Tokens(tok).without_doubled_bos(rendered, template["bos_token"])
    want = transformers.AutoTokenizer.from_pretrained(str(folder)).apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert tok.encode(prompt).ids == list(want) and list(want).count(bos) == 1
