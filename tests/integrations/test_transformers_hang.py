"""Hang reports under transformers' Trainer on slipstream: a process that stops making
progress is named, with its line, in one report written to the Trainer's output folder,
and the job ends with the hang exit code, leaving no process behind."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from slipstream.diagnostics.hang import HANG_EXIT_CODE
from tests.distributed import run_cli

#: Starts its own processes for every test: left out of `pytest -m "not slow"`.
pytestmark = pytest.mark.slow

JOB = Path(__file__).with_name("transformers_hang_job.py")
TIMEOUT = 4.0


def test_a_stalled_trainer_process_is_named_in_one_hang_report(tmp_path: Path) -> None:
    result = run_cli(
        "launch", "-n", "2", "--cpu", str(JOB), str(tmp_path), str(TIMEOUT), timeout=180
    )
    finished = time.time()
    assert result.returncode == HANG_EXIT_CODE, result.stderr[-3000:]
    assert result.stderr.count("slipstream: hang report:") == 1, result.stderr[-3000:]
    report = result.stderr[result.stderr.index("slipstream: hang report:") :]
    culprit = next(
        number
        for number, line in enumerate(JOB.read_text().splitlines(), 1)
        if line.endswith("# culprit")
    )
    assert "rank 1 is behind" in report and f"{JOB}:{culprit}" in report, report
    # Within the timeout and a few seconds (the watchdog looks every timeout/10 seconds).
    started = float((tmp_path / "culprit-started").read_text())
    assert finished - started < TIMEOUT + 10, f"reported {finished - started:.1f} s after"
    # The report is kept where the Trainer writes (its output_dir is the project folder).
    saved = list((tmp_path / "trainer" / "diagnostics").glob("hang-*.txt"))
    assert len(saved) == 1 and "rank 1 is behind" in saved[0].read_text()
    pids = [int(path.read_text()) for path in tmp_path.glob("pid-*")]
    assert len(pids) == 2
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in pids):
        time.sleep(0.1)
    assert not [pid for pid in pids if Path(f"/proc/{pid}").exists()], "processes left running"
