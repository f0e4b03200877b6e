"""A pytest plugin for the run of Accelerate's unit tests (loaded there with ``-p``): it
deselects the tests tests/accelerate_unit/scope.py leaves out and writes one JSON line per
test to the file ``$SLIPSTREAM_UNIT_REPORT`` names, as each ends, so a crash keeps what ran.
"""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from tests.accelerate_unit.scope import out_of_scope

REPORT_VARIABLE = "SLIPSTREAM_UNIT_REPORT"


def _write(record: dict[str, Any]) -> None:
    with open(os.environ[REPORT_VARIABLE], "a") as handle:
        handle.write(json.dumps(record) + "\n")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    kept, left_out = [], []
    for item in items:
        why = out_of_scope(item.nodeid)
        if why is None:
            kept.append(item)
        else:
            left_out.append(item)
            _write({"test": item.nodeid, "outcome": "out of scope", "why": why})
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = kept


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """One record per test: its call's outcome, or its setup's when that failed or skipped,
    or a teardown failure after a passing call."""
    if report.when == "call" or (report.when == "setup" and not report.passed):
        outcome = report.outcome
    elif report.when == "teardown" and report.failed:
        outcome = "failed"
    else:
        return
    record: dict[str, Any] = {"test": report.nodeid, "outcome": outcome, "when": report.when}
    if report.skipped and isinstance(report.longrepr, tuple):
        record["why"] = str(report.longrepr[2]).removeprefix("Skipped: ")
    elif report.failed:
        crash = getattr(report.longrepr, "reprcrash", None)
        record["why"] = (crash.message if crash is not None else str(report.longrepr))[:400]
        record["where"] = f"{crash.path}:{crash.lineno}" if crash is not None else ""
    _write(record)
