"""The documentation site builds with warnings as errors: a broken link, a missing page or a
docstring the API reference cannot read fails the suite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed import REPO


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
    assert (tmp_path / "site" / "api" / "index.html").exists()


def test_every_guide_is_in_the_navigation():
    config = (REPO / "mkdocs.yml").read_text()
    pages = sorted(p.name for p in (REPO / "docs").glob("*.md"))
    assert [p for p in pages if p not in config] == []
