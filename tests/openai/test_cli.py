"""serve's OpenAI options refused in one line before anything starts: a template without the API, the API on
a port already given, a template file that is missing or does not compile, a port already taken."""
from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.triton.conftest import REPO


@pytest.fixture(scope="module")
def repo(triton_build, tmp_path_factory):
    from runtime.triton import write_triton_repository
    return write_triton_repository(triton_build, tmp_path_factory.mktemp("cli") / "repo", intra_op_threads=1)


def _serve(repo, *args):
    return subprocess.run([sys.executable, "-m", "runtime.triton", "serve", "--repo", str(repo), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


def test_bad_openai_options_are_one_line(repo, tmp_path):
    pytest.importorskip("uvicorn")
    (tmp_path / "broken.jinja").write_text("{% for m in messages %}")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = str(taken.getsockname()[1])
        cases = [
            (["--chat-template", "t.jinja"], 2, "--chat-template: expected it with --openai-port"),
            (["--http-port", "9123", "--openai-port", "9123"], 2, "expected different ports"),
            (["--openai-port", "9124", "--chat-template", str(tmp_path / "none.jinja")], 1, "found nothing"),
            (["--openai-port", "9125", "--chat-template", str(tmp_path / "broken.jinja")], 1, "syntax error"),
            (["--openai-port", busy], 1, "found it taken"),
        ]
        for args, code, words in cases:
            proc = _serve(repo, *args)
            lines = proc.stderr.strip().splitlines()
            assert proc.returncode == code and len(lines) == 1 and lines[0].startswith("error: ") \
                and words in lines[0], (args, proc.stderr)
