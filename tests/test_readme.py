"""The README keeps exactly two set-up commands, and .ci/run runs the test one verbatim."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def setup_commands():
    text = (ROOT / "README.md").read_text()
    section = text.split("## Set up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```(?:bash|sh)\n(.*?)\n```", section, re.S)


def test_readme_has_exactly_two_setup_commands():
    cmds = setup_commands()
    assert len(cmds) == 2, cmds
    assert "export.build" in cmds[0] and "pytest" in cmds[1]


def test_ci_runs_the_readme_test_command():
    ci_lines = [line for line in (ROOT / ".ci/run").read_text().splitlines()
                if line.strip() and not line.lstrip().startswith(("#", "set ", "cd "))]
    assert ci_lines == [setup_commands()[1]]
