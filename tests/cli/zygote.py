"""A fork server for the CLI fuzz test: one interpreter imports every command once, then forks
a child per example, so each example costs a fork instead of an interpreter start, and a crash
or a half-finished torch export in one example cannot leak into the next.

Protocol (one JSON object per line): the test writes {"command": ..., "argv": [...]} to stdin;
the zygote answers {"code": int | null, "out": str, "err": str, "interrupted": bool}. A child
still running after `alarm_s` gets a real SIGINT (a user's Ctrl-C); one still running
`grace_s` later is killed and answered with code null, which the test reports as a failure.

Nothing runs torch, ONNX Runtime or a thread pool before the fork (imports only), so the
children start clean.
"""
from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import tempfile
import time


def _child(main, argv, out_path, err_path):
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)                # never the zygote's request pipe
    out_fd = os.open(out_path, os.O_WRONLY | os.O_TRUNC)
    err_fd = os.open(err_path, os.O_WRONLY | os.O_TRUNC)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    from core.lifecycle import command_code
    try:
        code = command_code(lambda: main(argv))    # as `python -m` runs it (exit_after)
    except BaseException:           # what escapes run_cli is itself a finding: print it, exit 99
        import traceback
        traceback.print_exc()
        code = 99
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code if isinstance(code, int) else 98)


def serve(commands: dict[str, str], alarm_s: float, grace_s: float) -> None:
    mains = {name: importlib.import_module(mod).main for name, mod in commands.items()}
    work = tempfile.mkdtemp(prefix="zygote-")
    out_path, err_path = os.path.join(work, "out"), os.path.join(work, "err")
    for path in (out_path, err_path):
        open(path, "w").close()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _child(mains[req["command"]], req["argv"], out_path, err_path)
        start, interrupted, code = time.monotonic(), False, None
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                code = os.waitstatus_to_exitcode(status)
                break
            elapsed = time.monotonic() - start
            if not interrupted and elapsed > alarm_s:
                os.kill(pid, signal.SIGINT)
                interrupted = True
            elif interrupted and elapsed > alarm_s + grace_s:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                break
            time.sleep(0.005)
        with open(out_path, errors="replace") as f:
            out = f.read()
        with open(err_path, errors="replace") as f:
            err = f.read()
        print(json.dumps({"code": code, "out": out[-4000:], "err": err[-4000:], "interrupted": interrupted}), flush=True)


if __name__ == "__main__":
    serve(json.loads(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3]))
