import subprocess, sys, time
from tests.triton.test_serving import serving, _metrics, _wait_pool_empty, LONG  # noqa
from tests.triton.conftest import REPO


def _kill_once(serving, self_kill):
    before = _metrics(serving)
    if self_kill:
        cb = "lambda piece: (print('piece', flush=True), __import__('os').kill(__import__('os').getpid(), 9))"
    else:
        cb = "lambda piece: (print('piece', flush=True), __import__('time').sleep(3600))"
    code = ("from runtime.triton.client import generate_remote\n"
            f"generate_remote({serving.grpc_url!r}, 'Once upon a time', {LONG}, protocol='grpc', ignore_eos=True, on_text={cb})\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "piece"
    proc.kill(); proc.wait()
    after = _wait_pool_empty(serving)
    return after["decode_steps"] - before["decode_steps"], after["finished.cancelled"] - before["finished.cancelled"]


def test_probe(serving):
    for self_kill in (False, True):
        print("self_kill", self_kill, [_kill_once(serving, self_kill) for _ in range(8)])
