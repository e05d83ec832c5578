"""core.lifecycle.run_cli and core.errors: the one CLI runner and its exit codes; range-checked argparse types."""
import pytest

from core.errors import ArgumentParser, UserError, float_in, int_in, positive_int
from core.lifecycle import run_cli


def _run(capsys, body, argv=()):
    code = run_cli(body, list(argv))
    return code, capsys.readouterr()


def test_user_error_is_one_line_exit_1(capsys):
    def body(argv):
        raise UserError("thing: expected a, found b; do c", details=["one", "two"])
    code, out = _run(capsys, body)
    assert code == 1
    assert out.err.splitlines() == ["error: thing: expected a, found b; do c", "  - one", "  - two"]


def test_usage_error_is_one_line_exit_2(capsys):
    def body(argv):
        p = ArgumentParser(prog="python -m x")
        p.add_argument("--n", type=positive_int, required=True)
        p.parse_args(argv)
        return 0
    for argv, needle in ((["--n", "0"], "out of range"), (["--n", "x"], "not an integer"), ([], "required"),
                         (["--n", "1", "--bogus"], "unrecognized")):
        code, out = _run(capsys, body, argv)
        assert code == 2 and len(out.err.splitlines()) == 1 and out.err.startswith("error: python -m x:"), out.err
        assert needle in out.err and "usage:" not in out.err


def test_interrupt_is_130_and_says_nothing_was_written(capsys):
    def body(argv):
        raise KeyboardInterrupt
    code, out = _run(capsys, body)
    assert code == 130 and out.err.strip() == "error: interrupted; nothing was written"


class _DropsAnInterrupt:
    """What a Ctrl-C during an import looks like: its KeyboardInterrupt raised in a finalizer (importlib's
    module-lock weakref callback), where CPython prints "Exception ignored" and carries on."""
    def __del__(self):
        raise KeyboardInterrupt


@pytest.mark.parametrize("writes", [False, True])
def test_an_interrupt_that_cpython_dropped_still_stops_the_command(capsys, tmp_path, writes):
    import sys
    from core.outputs import BUILD, output_dir
    hook = sys.unraisablehook
    ran_on = []

    def body(argv):
        _DropsAnInterrupt()             # dropped at once (refcount 0): the command runs on
        ran_on.append(True)
        if writes:
            with output_dir(tmp_path / "b", BUILD) as tmp:
                (tmp / "x").write_text("x")
        return 0
    code, out = _run(capsys, body)
    assert ran_on and code == 130, out.err
    assert out.err.strip() == "error: interrupted; nothing was written" and "Traceback" not in out.err
    assert list(tmp_path.iterdir()) == []           # the swap never came: no output, no temporary
    assert sys.unraisablehook is hook               # restored after the command
    assert run_cli(lambda argv: 0, []) == 0         # and forgotten: the next command is not interrupted


def test_a_bug_prints_the_traceback_and_asks_for_a_report(capsys):
    def body(argv):
        return {}["missing"]
    code, out = _run(capsys, body)
    assert code == 1 and "Traceback" in out.err and "please report it" in out.err


def test_oserror_is_one_line(capsys):
    def body(argv):
        raise OSError(28, "No space left on device", "/x/y")
    code, out = _run(capsys, body)
    assert code == 1 and out.err.strip() == ("error: /x/y: No space left on device; nothing was written "
                                             "(free space or choose another output path)")


@pytest.mark.parametrize("text, ok", [("5", True), ("-1", False), ("2147483648", False), ("1e3", False)])
def test_int_in_never_wraps(text, ok):
    import argparse
    parse = int_in(0)
    if ok:
        assert parse(text) == int(text)
    else:
        with pytest.raises(argparse.ArgumentTypeError):
            parse(text)


def test_float_in_refuses_nan_inf_and_out_of_range():
    import argparse
    parse = float_in(0.0, 1.0)
    assert parse("0.5") == 0.5
    for bad in ("nan", "inf", "-0.1", "1.5", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)



def test_exit_code_130_survives_an_interrupt_that_c_code_saw(tmp_path):
    """CPython turns a `python -m` exit of 130 into death by SIGINT (-2) when a KeyboardInterrupt
    once passed through code that a C extension ran with PyRun_String (torch does), even though
    it was caught; exit_after must undo that (seen in CI on an interrupted `python -m train`)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    from tests.helpers import default_sigint
    (tmp_path / "interrupted_cmd.py").write_text(
        "import ctypes\n"
        "from core.lifecycle import exit_after\n"
        "ctypes.pythonapi.PyRun_SimpleString(b'raise KeyboardInterrupt')\n"   # caught in C, flag set
        "exit_after(lambda: 130)\n")
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(root)]))
    done = subprocess.run([sys.executable, "-m", "interrupted_cmd"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60, preexec_fn=default_sigint)
    assert done.returncode == 130, (done.returncode, done.stderr)


def test_a_ctrl_c_after_run_cli_answered_is_one_line_and_130(tmp_path):
    """The Ctrl-C that lands between run_cli's return and the exit (seen in CI: a top-level
    KeyboardInterrupt traceback, exit -2) is answered by exit_after like any other."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.helpers import default_sigint
    (tmp_path / "late_interrupt_cmd.py").write_text(
        "from core.lifecycle import exit_after, run_cli\n"
        "def main():\n"
        "    run_cli(lambda argv: 0, [])\n"
        "    raise KeyboardInterrupt          # where the signal lands: after run_cli, before the exit\n"
        "exit_after(main)\n")
    root = Path(__file__).resolve().parents[2]
    env = dict(__import__("os").environ, PYTHONPATH=f"{tmp_path}:{root}")
    done = subprocess.run([sys.executable, "-m", "late_interrupt_cmd"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60, preexec_fn=default_sigint)
    assert (done.returncode, done.stderr) == (130, "error: interrupted; nothing was written\n")


def test_no_option_is_matched_by_a_prefix(capsys):
    """`--check DIR` is not `--checkpoint DIR` (argparse's allow_abbrev), in a sub-command's parser too: a
    wrapper that screens a child's options by name (bench.scale --options) sees what the child reads."""
    def body(argv):
        p = ArgumentParser(prog="python -m x")
        p.add_argument("--checkpoint")
        sub = p.add_subparsers(dest="cmd")
        sub.add_parser("run").add_argument("--out")
        p.parse_args(argv)
        return 0
    for argv, needle in ((["--check=d"], "--check"), (["run", "--ou", "d"], "--ou")):
        code, out = _run(capsys, body, argv)
        assert code == 2 and len(out.err.splitlines()) == 1 and needle in out.err, out.err
    assert _run(capsys, body, ["--checkpoint", "d", "run", "--out", "o"])[0] == 0


def test_a_process_that_does_not_speak_for_its_job_keeps_its_exit_codes_quietly(capsys):
    """run_cli(speaks=False), a rank other than 0 under torchrun: the errors every rank meets alike are
    rank 0's to print; one of this process alone (own_process) is printed; the exit codes are unchanged."""
    class Own(UserError):
        own_process = True

    def raising(e):
        def body(argv):
            raise e
        return body
    for e, code, printed in ((UserError("a: b; c"), 1, ""), (KeyboardInterrupt(), 130, ""),
                             (Own("rank 1 of 2: lost contact; x"), 1, "error: rank 1 of 2: lost contact; x\n")):
        assert run_cli(raising(e), [], speaks=False) == code
        assert capsys.readouterr().err == printed
