"""The order two pytest workers take the suite's files in: longest first.

With ``-n 2`` each file is one unit of work (``--dist loadfile``), handed to whichever worker
is free. Handed out longest first, the run ends on short files, so neither worker idles
while the other finishes a long one. (xdist's own order is by number of tests, which starts
with the 1,858 quick sampler cases and may end on a several-minute file.) A file's cost is
the seconds it took in a recorded run, kept in ``tests/file_seconds.json``; a file missing
there goes first. ``--record-file-seconds`` rewrites the table from the run it ends::

    python -m pytest -n 2 --record-file-seconds
"""

from __future__ import annotations

import json
import os
from collections import defaultdict
from pathlib import Path

import pytest

TABLE = Path(__file__).with_name("file_seconds.json")
_seconds_by_file: defaultdict[str, float] = defaultdict(float)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--record-file-seconds",
        action="store_true",
        help=f"write each test file's seconds in this run to {TABLE.name} (the order in "
        "which pytest-xdist workers take the files: longest first)",
    )


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    if "PYTEST_XDIST_WORKER" not in os.environ:
        return  # one process runs the files in their usual order
    seconds = json.loads(TABLE.read_text()) if TABLE.exists() else {}
    # Stable: a file's tests keep their order, and every worker sorts alike (xdist requires
    # the same collection on each).
    items.sort(key=lambda item: -seconds.get(file_of(item.nodeid), float("inf")))


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "PYTEST_XDIST_WORKER" not in os.environ:  # the controller: it sees every report
        _seconds_by_file[file_of(report.nodeid)] += report.duration


def pytest_sessionfinish(session: pytest.Session) -> None:
    if "PYTEST_XDIST_WORKER" in os.environ:
        return
    if not session.config.getoption("record_file_seconds") or not _seconds_by_file:
        return
    table = {name: round(seconds, 1) for name, seconds in sorted(_seconds_by_file.items())}
    TABLE.write_text(json.dumps(table, indent=0) + "\n")
