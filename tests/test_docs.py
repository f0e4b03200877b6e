"""The documentation site builds with warnings as errors: a broken link, a missing page or a
docstring the API reference cannot read fails the suite."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.distributed import REPO


@pytest.mark.slow
def test_the_site_builds_strictly(tmp_path: Path):
    pytest.importorskip("mkdocs")
    # `python -m mkdocs`, not the console script: the script's folder would come first on
    # sys.path and the API reference would find the `slipstream` command, not the package.
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(tmp_path / "site")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    reference = (tmp_path / "site" / "api" / "index.html").read_text()
    # mkdocstrings drops a listed member it cannot find (e.g. one inherited from a mixin)
    # without a warning: every member api.md lists must be on the page.
    source = (REPO / "docs" / "api.md").read_text()
    listed = re.findall(r"^\s+- (\w+)$", source.split("## Accelerator", 1)[1], re.MULTILINE)
    missing = [m for m in listed if f'id="slipstream.accelerator.Accelerator.{m}"' not in reference]
    assert listed and missing == []


def test_every_guide_is_in_the_navigation():
    config = (REPO / "mkdocs.yml").read_text()
    pages = sorted(p.name for p in (REPO / "docs").glob("*.md"))
    assert [p for p in pages if p not in config] == []


# -- what the guides say about commands, flags and files, checked against the code ------------
# README.md and the first-hour guides; each claim below is one a newcomer would type.
GUIDES = ("README.md", "docs/getting-started.md", "docs/cli.md", "docs/examples.md")
EXAMPLES = sorted((REPO / "examples").glob("*.py"))


def _subcommands() -> dict[str, Any]:
    from slipstream.cli import build_parser
    from slipstream.cli.suggest import nested_parsers

    return nested_parsers(build_parser())


def _flags(parser: Any) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def _commands(text: str) -> list[str]:
    """The `slipstream ...`, `python examples/...` and `torchrun ...` commands of the fenced
    blocks (or an example's indented header) in ``text``, continuation lines joined."""
    text = re.sub(r"\\+\n", " ", text)  # a continued line; a docstring doubles the backslash
    found = []
    for line in text.splitlines():
        for part in line.split("&&"):
            part = part.split("#", 1)[0].strip()
            if part.startswith(("slipstream ", "python examples/", "torchrun ")):
                found.append(part)
    return found


def _fenced(path: Path) -> str:
    return "\n".join(re.findall(r"```\w*\n(.*?)```", path.read_text(), re.S))


def _header(path: Path) -> str:
    return path.read_text().split('"""')[1]


def _script_options(path: Path) -> set[str]:
    return set(re.findall(r"add_argument\(\s*\"(--[\w-]+)\"", path.read_text()))


def test_the_command_tables_name_every_command_and_nothing_else():
    commands = set(_subcommands())
    table = (REPO / "docs" / "cli.md").read_text()
    documented = set(re.findall(r"^\| `slipstream ([\w-]+)", table, re.MULTILINE))
    assert documented == commands
    readme = (REPO / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| **Command line**"))
    assert set(re.findall(r"`([\w-]+)`", row.replace("`slipstream config`", "`config`"))) == (
        commands
    )


@pytest.mark.parametrize(
    "where", [*GUIDES, *(f"examples/{p.name}" for p in EXAMPLES)], ids=lambda w: w
)
def test_every_documented_command_runs_past_the_argument_parser(where: str):
    """Each command of a guide's code blocks or an example's header: the subcommand and its
    flags exist, the example it runs exists, and the example takes the flags given to it."""
    import shlex

    from slipstream.cli import build_parser

    path = REPO / where
    text = _header(path) if where.startswith("examples/") else _fenced(path)
    commands = _commands(text)
    assert commands or where in ("docs/cli.md", "docs/examples.md"), "a header says how to run"
    for command in commands:
        words = shlex.split(command)
        if words[0] == "slipstream":
            args, unknown = build_parser().parse_known_args(words[1:])
            assert unknown == [], command
            script, script_args = (
                (args.training_script, args.training_script_args)
                if args.command == "launch"
                else (None, [])
            )
        elif words[0] == "python":
            script, script_args = words[1], words[2:]
        else:  # torchrun [its flags] script [args]
            index = next(i for i, w in enumerate(words) if w.endswith(".py"))
            script, script_args = words[index], words[index + 1 :]
        if script is None or not script.startswith("examples/"):
            continue
        assert (REPO / script).is_file(), command
        options = {a.split("=", 1)[0] for a in script_args if a.startswith("--")}
        assert options <= _script_options(REPO / script), command


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_option_an_example_lists_is_one_it_takes(path: Path):
    header = _header(path)
    listed = header.split("Options:", 1)[1] if "Options:" in header else ""
    assert set(re.findall(r"(--[a-z][\w-]*)", listed)) <= _script_options(path)


def test_the_examples_page_lists_every_example():
    page = (REPO / "docs" / "examples.md").read_text()
    assert set(re.findall(r"^\| `examples/(\w+\.py)`", page, re.MULTILINE)) == {
        p.name for p in EXAMPLES
    }


def test_the_launch_options_in_getting_started_exist():
    launch = _flags(_subcommands()["launch"])
    section = (REPO / "docs" / "getting-started.md").read_text().split("## Launching", 1)[1]
    table = [line for line in section.splitlines() if line.startswith("| `")]
    named = {
        flag for line in table for flag in re.findall(r"(--?[a-z][\w*-]*)", line.split("|")[1])
    }
    assert len(named) > 20
    for flag in named:
        if flag.endswith("*"):  # a family: --fsdp_*
            assert any(f.startswith(flag[:-1]) for f in launch), flag
        else:
            assert flag in launch, flag


def test_getting_started_and_the_readme_give_the_same_quick_start():
    def quick_start(path: Path) -> str:
        return path.read_text().split("## Quick start", 1)[1].split("\n## ", 1)[0]

    assert quick_start(REPO / "README.md") == quick_start(REPO / "docs" / "getting-started.md")


def test_help_texts_are_plain_text():
    """argparse prints descriptions as written: no reStructuredText markup from docstrings."""
    for name, parser in _subcommands().items():
        assert "``" not in parser.format_help(), name
        for action, nested in (_subcommands_of(parser)).items():
            assert "``" not in nested.format_help(), f"{name} {action}"


def _subcommands_of(parser: Any) -> dict[str, Any]:
    from slipstream.cli.suggest import nested_parsers

    return nested_parsers(parser)
