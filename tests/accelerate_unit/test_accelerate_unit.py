"""The drop-in promise one level down: the unit tests of Accelerate's repository
(``tests/test_*.py`` of the installed release's source distribution, downloaded once into
``~/.cache/slipstream``), their imports rewritten by ``slipstream migrate`` (never their
assertions), run against slipstream in one pytest process.

Every in-scope test (scope.py; README.md) must pass or skip (GPU-only tests skip on CPU),
except those listed in slipstream.compatibility.UNIT_TEST_DIFFERENCES, each with the reason
and a slipstream test that shows the intended behaviour (docs/compatibility.md says the
same). The per-test report is printed (``pytest -s``) and attached to a failure.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from slipstream.compatibility import UNIT_TEST_DIFFERENCES
from tests.accelerate_peer import (
    accelerate_package,
    accelerate_version,
    migrate,
    print_report,
    source_tests,
)
from tests.distributed import REPO, device_environment

from .plugin import REPORT_VARIABLE
from .scope import OUT_OF_SCOPE_FILES, OUT_OF_SCOPE_TESTS

if accelerate_package() is None:  # pragma: no cover - accelerate is a test dependency
    pytest.skip("accelerate is not installed", allow_module_level=True)
pytest.importorskip("parameterized", reason="Accelerate's tests need `parameterized`")

#: The files that run (every other test file of the release is in OUT_OF_SCOPE_FILES; a
#: new file in a later release fails test_every_file_is_placed until it is placed).
FILES = [
    "test_accelerator.py",
    "test_big_modeling.py",
    "test_data_loader.py",
    "test_dataclasses.py",
    "test_kwargs_handlers.py",
    "test_logging.py",
    "test_memory_utils.py",
    "test_modeling_utils.py",
    "test_offload.py",
    "test_optimizer.py",
    "test_scheduler.py",
    "test_state_checkpointing.py",
    "test_tracking.py",
    "test_utils.py",
]
#: Per test (pytest-timeout), and for the whole run.
TEST_TIMEOUT, RUN_TIMEOUT = 120, 900
#: Outcomes an in-scope test may have (GPU-only tests and those of absent trackers skip).
GOOD = {"passed", "skipped"}
_RANK = {"passed": 0, "skipped": 1, "out of scope": 1, "failed": 2}


def expected_failure(test_id: str) -> str | None:
    name = test_id.split("[", 1)[0]
    for pattern, why in UNIT_TEST_DIFFERENCES.items():
        if fnmatch.fnmatchcase(name, pattern):
            return why
    return None


@pytest.fixture(scope="module")
def source() -> Path:
    folder, why = source_tests(accelerate_version())
    if folder is None:
        pytest.skip(f"Accelerate's unit tests are not available: {why}")
    return folder


@pytest.fixture(scope="module")
def results(source: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    """Test id -> its record (outcome, why), from one pytest run over the migrated copy."""
    folder = tmp_path_factory.mktemp("accelerate_unit")
    for path in source.iterdir():
        if path.name in FILES or not path.name.startswith("test_"):
            target = folder / path.name
            (shutil.copytree if path.is_dir() else shutil.copy)(path, target)
    migrate(folder)
    report = folder / "report.jsonl"
    env = {
        **os.environ,
        **device_environment(),
        REPORT_VARIABLE: str(report),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        "OMP_NUM_THREADS": "1",
    }
    command = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
        "-p", "tests.accelerate_unit.plugin", "--rootdir", str(folder),
        "-o", f"timeout={TEST_TIMEOUT}", "-o", "addopts=", *FILES,
    ]  # fmt: skip
    done = subprocess.run(
        command, cwd=folder, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT
    )
    records: dict[str, dict[str, Any]] = {}
    for line in report.read_text().splitlines() if report.exists() else []:
        record = json.loads(line)
        seen = records.get(record["test"])
        if seen is None or _RANK[record["outcome"]] > _RANK[seen["outcome"]]:
            records[record["test"]] = record
    if done.returncode not in (0, 1) or not records:  # 1: some test failed
        records["<run>"] = {
            "test": "<run>",
            "outcome": "failed",
            "why": f"pytest exited {done.returncode}: {(done.stdout + done.stderr)[-3000:]}",
        }
    in_scope = [r for r in records.values() if r["outcome"] != "out of scope"]
    passed = sum(r["outcome"] == "passed" for r in in_scope)
    ran = sum(r["outcome"] != "skipped" for r in in_scope)
    print_report(
        f"Accelerate {accelerate_version()} unit tests under slipstream: {passed} of {ran} "
        "in-scope tests that ran pass",
        (
            ("", r["test"], _shown(r))
            for r in sorted(records.values(), key=lambda r: r["test"])
            if r["outcome"] != "out of scope"
        ),
    )
    return records


def _shown(record: dict[str, Any]) -> str:
    outcome = record["outcome"].upper()
    why = record.get("why")
    if record["outcome"] == "failed" and expected_failure(record["test"]):
        outcome = "FAILED (expected: docs/compatibility.md)"
    return f"{outcome} {why}" if why and record["outcome"] != "passed" else outcome


def test_the_readme_lists_what_is_out_of_scope() -> None:
    readme = (Path(__file__).parent / "README.md").read_text()
    unlisted = [k for k in [*OUT_OF_SCOPE_FILES, *OUT_OF_SCOPE_TESTS] if f"`{k}`" not in readme]
    assert not unlisted, f"tests/accelerate_unit/README.md does not list {unlisted}"


def test_every_file_is_placed(source: Path) -> None:
    """Each test file of the release either runs here or is left out with a reason."""
    names = {p.name for p in source.glob("test_*.py")}
    unplaced = names - set(FILES) - set(OUT_OF_SCOPE_FILES)
    assert not unplaced, f"place these in FILES or scope.OUT_OF_SCOPE_FILES: {sorted(unplaced)}"


@pytest.mark.timeout(RUN_TIMEOUT + 120)
@pytest.mark.parametrize("file", FILES)
def test_accelerate_unit_tests(file: str, results: dict[str, dict[str, Any]]) -> None:
    run = results.get("<run>")
    assert run is None, run and run["why"]
    mine = [r for t, r in results.items() if t.startswith(f"{file}::")]
    assert mine, f"{file}: no test ran (it did not import under slipstream?)"
    failures = [
        r
        for r in mine
        if r["outcome"] not in GOOD | {"out of scope"} and not expected_failure(r["test"])
    ]
    shown = "\n".join(f"{r['test']}: {r.get('why')} ({r.get('where', '')})" for r in failures)
    assert not failures, f"Accelerate's tests fail under slipstream:\n{shown}"
    now_passing = [
        r["test"] for r in mine if r["outcome"] == "passed" and expected_failure(r["test"])
    ]
    assert not now_passing, (
        f"{now_passing} pass now: remove them from UNIT_TEST_DIFFERENCES "
        "(slipstream/compatibility/unit_tests.py)"
    )
