"""A pytest plugin for the run of Accelerate's unit tests (loaded there with ``-p``): it
deselects the tests tests/accelerate_unit/scope.py leaves out and writes one JSON line per
test to the file ``$SLIPSTREAM_UNIT_REPORT`` names, as each ends, so a crash keeps what ran.
"""

from __future__ import annotations

import gc
import json
import os
from typing import Any

import pytest

from tests.accelerate_unit.scope import out_of_scope

REPORT_VARIABLE = "SLIPSTREAM_UNIT_REPORT"
#: Its tests retry a fake out-of-memory error some 20 times each, collecting garbage on
#: every retry as Accelerate and slipstream do: they run first (below).
RETRYING_FILE = "test_memory_utils.py"


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
    # The retrying tests first, while the heap outside the frozen part is small: after the
    # other files' tests, each of their collections took ~0.8 s (their order is free: every
    # test builds its own state).
    items[:] = sorted(kept, key=lambda item: item.nodeid.split("::")[0] != RETRYING_FILE)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Freeze what collection left on the heap (torch, transformers, Accelerate and the
    test modules, about a million objects), which every full garbage collection would
    otherwise scan again (~0.5 s of CPU each; the out-of-memory retries alone ran ~60)."""
    gc.collect()
    gc.freeze()


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
