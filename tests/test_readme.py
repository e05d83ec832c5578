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


# --- the README is a landing page; every command line in it runs as written (issue 43) ---------------------

import os  # noqa: E402
import shlex  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402

DOCS = ROOT / "docs"


def readme_commands() -> list[str]:
    """Every `python -m ...` command line of the README: a line of a fenced block, or an inline code span,
    cut at `&&` / `;` so that `pip install -e . && python -m export.build --fuse` gives the second half."""
    text = (ROOT / "README.md").read_text()
    pieces = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.S):
        pieces += [line for line in block.splitlines() if not line.lstrip().startswith("#")]
    pieces += [" ".join(span.split())                      # an inline span may wrap across lines
               for span in re.findall(r"`([^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))]
    commands = []
    for piece in pieces:
        for part in re.split(r"&&|;", piece):
            part = part.split(" #", 1)[0].strip()
            if part.startswith("python -m "):
                commands.append(part)
    return list(dict.fromkeys(commands))


def _help(argv: list[str], cwd) -> str:
    """`python -m MODULE [SUBCOMMAND] --help`, run in `cwd` (a tmp_path: outside the source tree, so pytest finds
    no conftest there and nothing can be written into the tree)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               PYTHONDONTWRITEBYTECODE="1")
    r = subprocess.run([sys.executable, "-m", *argv, "--help"], cwd=cwd, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"python -m {' '.join(argv)} --help exited {r.returncode}: {r.stderr[-2000:]}"
    return r.stdout


def test_readme_has_command_lines():
    cmds = readme_commands()
    assert any(c.startswith("python -m export.build") for c in cmds), cmds
    assert any(c.startswith("python -m models.convert") for c in cmds), cmds


@pytest.mark.parametrize("line", readme_commands())
def test_readme_command_line_is_accepted(line, tmp_path):
    """Each README command's module exists, and its --help (of the subcommand the line names, if any) lists
    every option the line uses: the cheap check that the line still runs as written (no builds)."""
    words = shlex.split(line)[2:]
    module, rest = words[0], words[1:]
    assert re.fullmatch(r"[A-Za-z_][\w.]*", module), line
    help_text = _help([module], tmp_path)
    subcommands = re.search(r"\{([\w,-]+)\}", help_text.split("\n\n", 1)[0])
    argv = [module]
    if subcommands and rest and rest[0] in subcommands.group(1).split(","):
        argv.append(rest[0])
        help_text = _help(argv, tmp_path)
    for word in rest:
        word = word.lstrip("[").rstrip("]")                  # an optional part, [--max-seq-len N], is checked too
        if not word.startswith("-") or re.fullmatch(r"-\d[\d.]*", word):
            continue
        option = word.split("=", 1)[0]
        assert re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", help_text), \
            f"README line {line!r}: python -m {' '.join(argv)} --help has no {option}"


def test_readme_is_a_landing_page():
    """About 150-250 lines, no results tables (they live in docs/results.md and the pages it links)."""
    text = (ROOT / "README.md").read_text()
    assert 150 <= len(text.splitlines()) <= 250, len(text.splitlines())
    for moved in ("## Results", "## CLI reference", "### What a command may write and replace",
                  "Earlier measurements (the two routes"):
        assert moved not in text, moved


def test_readme_maps_every_docs_page():
    """The README's documentation map has one line per page of docs/."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Documentation", 1)[1].split("\n## ", 1)[0]
    for page in sorted(DOCS.glob("*.md")):
        rows = [line for line in section.splitlines() if f"](docs/{page.name})" in line]
        assert len(rows) == 1, f"docs/{page.name}: {len(rows)} lines in the README's documentation map"


def _slugs(path) -> set[str]:
    """GitHub's heading anchors of a Markdown file: lower case, punctuation but - and _ dropped, spaces to -,
    a repeated heading numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    for heading in re.findall(r"^#{1,6} (.+?)\s*$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        seen.setdefault(f"{slug}-{n}" if n else slug, 1)
    return set(seen)


@pytest.mark.parametrize("page", ["README.md"] + [f"docs/{p.name}" for p in sorted(DOCS.glob("*.md"))])
def test_relative_links_resolve(page):
    """Every relative link of the README and docs/*.md names a file that exists, and its #anchor a heading
    there: what moved out of the README is still reachable."""
    path = ROOT / page
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    broken = []
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        file, _, anchor = target.partition("#")
        dest = (path.parent / file).resolve() if file else path
        if not dest.exists():
            if not dest.is_relative_to(ROOT):        # ../shared/... lives beside the project, not in it
                continue
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _slugs(dest):
            broken.append(target)
    assert not broken, f"{page}: broken links {broken}"
