"""A chat model stops at the end of its turn: a tiny random Qwen3-like Hugging Face folder whose tokenizer's
eos is <|im_end|> and whose generation_config.json names eos_token_id [<|im_end|>, <|endoftext|>] is
converted, built and served; runtime.generate's greedy tokens, the Triton generate model's and the OpenAI
API's end where transformers' generate ends on the same folder, at <|im_end|>, with finish_reason "stop"
(core/generation.py carries the ids as generation.json)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.triton.conftest import REPO, require

MAX_NEW = 12


def _run(*args):
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=REPO, timeout=600)


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    """(HF folder, checkpoint, prompt ids, transformers' greedy new tokens, <|im_end|> id, <|endoftext|> id).

    The random model is made to end its turn: its greedy run (no stop token) picks some token x at step
    j; the untied head's rows of x and <|im_end|> are swapped, so that greedy picks <|im_end|> there
    instead (the steps before are unchanged: neither token was their argmax, the inputs are untouched)."""
    pytest.importorskip("jinja2", reason="chat templates render with jinja2 (pip install -e '.[dev,triton]')")
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    from core.chat_template import read_hf_chat_template
    from runtime.openai.chat_template import render_chat
    from tests.hf_models import hf_model, save_hf
    from tests.openai.test_chat_template import tokenizer_folder
    root = tmp_path_factory.mktemp("stop")
    tokenizer_folder(root / "tok", "qwen3")
    tok = Tokenizer.from_file(str(root / "tok" / "tokenizer.json"))
    im_end, eot = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    text = render_chat(read_hf_chat_template(root / "tok"), [{"role": "user", "content": "Tell me a story."}])
    prompt = tok.encode(text).ids
    hf = hf_model("qwen3", tie_word_embeddings=False)
    hf.generation_config.eos_token_id = None
    with torch.no_grad():
        free = hf.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=eot)
    free = free[0, len(prompt):].tolist()
    j = next(j for j in range(2, MAX_NEW - 2) if free[j] not in free[:j] + [im_end, eot]
             and im_end not in free[:j] and eot not in free[:j])
    with torch.no_grad():
        head = hf.lm_head.weight
        head[[free[j], im_end]] = head[[im_end, free[j]]].clone()
    hf.generation_config.eos_token_id = [im_end, eot]
    hf.generation_config.pad_token_id = eot
    folder = save_hf(hf, root / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((root / "tok" / name).read_bytes())
    with torch.no_grad():       # transformers' own reading of the folder's generation config
        from transformers import AutoModelForCausalLM
        again = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
        want = again.generate(torch.tensor([prompt]), max_new_tokens=MAX_NEW, do_sample=False)
    want = want[0, len(prompt):].tolist()
    assert want == free[:j] + [im_end], (free, want)          # it ends its turn, early
    proc = _run("models.convert", str(folder), "--out", str(root / "ckpt"))
    assert proc.returncode == 0, proc.stderr
    return folder, root / "ckpt", text, prompt, want, im_end, eot


def test_convert_carries_the_stop_tokens(chat_model):
    from core.generation import GENERATION, read_stop_tokens
    folder, ckpt, _, _, _, im_end, eot = chat_model
    assert read_stop_tokens(folder) == [im_end, eot]
    assert json.loads((ckpt / GENERATION).read_text()) == {"eos_token_ids": [im_end, eot]}


def test_runtime_generate_stops_where_transformers_stops(chat_model, capsys):
    """python -m runtime.generate's default stop tokens are the model's: the greedy tokens (--logprobs 0
    lists their ids) are transformers', ending at <|im_end|>; --ignore-eos runs to --max-new-tokens."""
    from runtime.generate import main
    _, ckpt, text, _, want, _, _ = chat_model

    def ids(*extra):
        assert main(["--model", str(ckpt), "--backend", "torch", "--prompt", text, "--max-new-tokens", str(MAX_NEW),
                     "--logprobs", "0", *extra]) == 0
        lines = [line.split() for line in capsys.readouterr().err.splitlines() if line.startswith("logprobs ")]
        return [int(line[2]) for line in lines]
    assert ids() == want
    assert len(ids("--ignore-eos")) == MAX_NEW


def test_served_chat_stops_at_the_end_of_the_turn(chat_model):
    """export.build -> runtime.triton repo -> serve --openai-port: Triton's generate endpoint and the OpenAI
    API (completions and chat) end at <|im_end|> with finish_reason "stop", the tokens transformers' are;
    ignore_eos runs to max_tokens ("length")."""
    require("pytriton", "the OpenAI serving tests")
    from tests.openai.conftest import require_api
    require_api()
    import openai
    from core.generation import GENERATION
    from runtime.triton import write_triton_repository
    from runtime.triton.server import free_port
    _, ckpt, text, prompt, want, im_end, _ = chat_model
    root = ckpt.parent
    proc = _run("export.build", "--checkpoint", str(ckpt), "--out", str(root / "build"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    repo = write_triton_repository(root / "build", root / "repo", intra_op_threads=1, generate_backend="ort-cpu")
    assert json.loads((repo / "generate" / "1" / GENERATION).read_text())["eos_token_ids"][0] == im_end
    ports = {k: free_port() for k in ("http", "grpc", "metrics", "openai")}
    server = subprocess.Popen([sys.executable, "-m", "runtime.triton", "serve", "--repo", str(repo),
                               "--http-port", str(ports["http"]), "--grpc-port", str(ports["grpc"]),
                               "--metrics-port", str(ports["metrics"]), "--openai-port", str(ports["openai"])],
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=(log := open(root / "serve.log", "w")))
    base = f"http://127.0.0.1:{ports['openai']}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert server.poll() is None, (root / "serve.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, (root / "serve.log").read_text()[-3000:]
            time.sleep(0.3)
        body = json.dumps({"text_input": text, "max_tokens": MAX_NEW}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{ports['http']}/v2/models/generate/generate", body,
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            triton = json.loads(r.read())
        assert list(triton["output_ids"]) == want and triton["finish_reason"] == "stop"
        c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)
        r = c.completions.create(model="generate", prompt=text, max_tokens=MAX_NEW, logprobs=0)
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == len(want)
        assert r.choices[0].text == triton["text_output"]
        chat = c.chat.completions.create(model="generate", max_tokens=MAX_NEW,
                                         messages=[{"role": "user", "content": "Tell me a story."}])
        assert chat.choices[0].finish_reason == "stop" and chat.usage.completion_tokens == len(want)
        assert chat.choices[0].message.content == r.choices[0].text
        long = c.completions.create(model="generate", prompt=text, max_tokens=MAX_NEW, extra_body={"ignore_eos": True})
        assert long.choices[0].finish_reason == "length" and long.usage.completion_tokens == MAX_NEW
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(60)
        log.close()


def test_read_stop_tokens_forms(tmp_path):
    """eos_token_id as an int or a list (generation_config.json, else a Hugging Face config.json; never our
    checkpoint's config.json), the tokenizer's eos added once; a bad value is one line naming the file."""
    from core.chat_template import ChatTemplateError
    from core.generation import read_stop_tokens, write_model_files
    from tests.helpers import tiny_tokenizer_json
    tiny_tokenizer_json(tmp_path / "tokenizer.json")
    assert read_stop_tokens(tmp_path) is None
    (tmp_path / "config.json").write_text(json.dumps({"format": 3, "model_type": "x", "eos_token_id": 5}))
    assert read_stop_tokens(tmp_path) is None                      # a checkpoint's config names none
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 7}))
    assert read_stop_tokens(tmp_path) == [7]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 0]}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    assert read_stop_tokens(tmp_path) == [9, 0]                    # <|endoftext|> is id 0, not repeated
    (tmp_path / "out").mkdir()
    assert write_model_files(tmp_path, tmp_path / "out") == ["generation.json"]     # (no chat template)
    assert json.loads((tmp_path / "out" / "generation.json").read_text()) == {"eos_token_ids": [9, 0]}
    assert read_stop_tokens(tmp_path / "out") == [9, 0]
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": "2"}))
    with pytest.raises(ChatTemplateError, match=r"generation_config.json: eos_token_id: expected a token id"):
        read_stop_tokens(tmp_path)
