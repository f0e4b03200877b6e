"""The README's Quick start and CI stay in step."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from tests.distributed import REPO


def quick_start_commands() -> list[str]:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", section, re.S)]


def test_quick_start_has_exactly_two_commands():
    commands = quick_start_commands()
    assert len(commands) == 2 and all("\n" not in c for c in commands)
    assert "slipstream launch --num_processes 2 --cpu examples/train.py" in commands[0]
    assert all("pip install torch==2.13.0" in c for c in commands)


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert quick_start_commands()[1] in ci


def test_every_source_package_is_listed_for_the_wheel():
    tomllib = pytest.importorskip("tomllib")

    listed = set(
        tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = {
        "slipstream." + ".".join(p.parent.relative_to(REPO / "core").parts)
        for p in (REPO / "core").rglob("__init__.py")
    }
    found = {name.rstrip(".") for name in found}
    found |= {
        "slipstream.integrations"
        + "".join("." + part for part in p.parent.relative_to(REPO / "integrations").parts)
        for p in (REPO / "integrations").rglob("__init__.py")
    }
    assert found <= listed, f"add to pyproject.toml packages: {sorted(found - listed)}"


def test_the_project_options_need_no_optional_pytest_plugin():
    """The XLA lane's venv has no pytest-xdist: pyproject's addopts must parse without it."""
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:xdist",
            "-p",
            "no:cacheprovider",
            "--collect-only",
            "-q",
            "tests/test_repository.py",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
