"""What the lanes that run Accelerate's own tests against slipstream share: where the
installed accelerate lives, its source distribution's ``tests/`` (downloaded once into the
user's cache), the ``slipstream migrate`` run that rewrites copied files, and the printed
per-test report. Used by tests/accelerate_scripts (the test scripts inside the package) and
tests/accelerate_unit (the unit tests of Accelerate's repository).

None of Accelerate's code is kept in this repository: both lanes copy it into a temporary
folder at test time.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterable
from pathlib import Path

#: How long ``pip download`` may take (it builds the sdist's metadata: ~20 s on a quiet
#: machine).
DOWNLOAD_TIMEOUT = 300


def accelerate_package() -> Path | None:
    """The installed accelerate package's folder (``None`` when it is not installed)."""
    spec = importlib.util.find_spec("accelerate")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def accelerate_version() -> str:
    return importlib.metadata.version("accelerate")


def cache_folder() -> Path:
    """``$XDG_CACHE_HOME/slipstream`` (``~/.cache/slipstream``), where the XLA lane keeps its
    venv too: it outlives the clone, so CI on a machine that keeps its home reuses it."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "slipstream"


def source_tests(version: str) -> tuple[Path | None, str]:
    """The ``tests/`` folder of accelerate ``version``'s source distribution, downloaded with
    ``pip download --no-binary :all:`` the first time and kept in :func:`cache_folder`.

    Returns ``(folder, "")``, or ``(None, why)`` when it cannot be downloaded (no network,
    no such release).
    """
    target = cache_folder() / f"accelerate-{version}-sdist" / "tests"
    if target.is_dir() and any(target.glob("test_*.py")):
        return target, ""
    with tempfile.TemporaryDirectory(prefix="accelerate-sdist-") as scratch:
        command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps"]
        command += ["--no-binary", ":all:", f"accelerate=={version}", "-d", scratch]
        try:
            done = subprocess.run(
                command,
                capture_output=True,
                text=True,
                timeout=DOWNLOAD_TIMEOUT,
            )
        except subprocess.TimeoutExpired:
            return None, f"pip download of accelerate=={version} took over {DOWNLOAD_TIMEOUT} s"
        archives = sorted(Path(scratch).glob("accelerate-*.tar.gz"))
        if done.returncode != 0 or not archives:
            last = (done.stderr.strip().splitlines() or ["no output"])[-1]
            return None, f"pip could not download accelerate=={version}'s sdist: {last}"
        unpacked = Path(scratch) / "unpacked"
        with tarfile.open(archives[0]) as archive:
            members = [m for m in archive.getmembers() if "/tests/" in f"/{m.name}"]
            archive.extractall(unpacked, members=members, filter="data")
        found = next(unpacked.glob("*/tests"), None)
        if found is None:
            return None, f"accelerate=={version}'s sdist holds no tests/ folder"
        # Moved into place whole, so a run stopped midway leaves no half folder behind.
        target.parent.mkdir(parents=True, exist_ok=True)
        staged = Path(tempfile.mkdtemp(prefix="tests-", dir=target.parent))
        shutil.copytree(found, staged, dirs_exist_ok=True)
        if target.exists():
            shutil.rmtree(staged)
        else:
            staged.rename(target)
    return target, ""


def migrate(folder: Path) -> str:
    """Rewrite the Python files under ``folder`` with ``slipstream migrate``, as a user
    would; returns its report."""
    from tests.distributed import run_cli_here

    done = run_cli_here("migrate", str(folder))
    assert done.returncode in (0, 1), done.stderr
    return done.stdout


def print_report(title: str, rows: Iterable[tuple[str, str, str]]) -> None:
    """One line per ``(where, what, outcome)`` under ``title`` (shown by ``pytest -s``)."""
    print(f"\n{title}:")
    for where, what, outcome in rows:
        print(f"  {where:>8} {what}: {outcome}")
