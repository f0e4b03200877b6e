"""Hang reports: one process of 2 or 4 sleeps, takes another branch or skips a collective;
one report names it and the line it is at, within the timeout and a few seconds, and the
job ends with exit code 86 leaving no process behind."""

from __future__ import annotations

import subprocess
import time
from datetime import timedelta
from pathlib import Path

import pytest

from slipstream.diagnostics.hang import HANG_EXIT_CODE, resolve_hang_timeout
from slipstream.diagnostics.hang_report import build_report
from tests.distributed import run_cli, run_python

JOB = Path(__file__).with_name("hang_job.py")
TIMEOUT = 4.0
#: The report must come within the timeout plus this (the watchdog looks every
#: timeout/10 seconds; collecting the accounts and writing takes a moment).
SLACK = 6.0


def culprit_line(mode: str) -> int:
    lines = JOB.read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if line.endswith(f"# culprit: {mode}"))


def assert_no_orphans(project: Path) -> None:
    pids = [int(p.read_text()) for p in project.glob("pid-*")]
    assert pids
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() for pid in pids):
        time.sleep(0.1)
    alive = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    assert alive == [], f"processes left running: {alive}"


def check_report(stderr: str, project: Path, mode: str, culprit: int, finished: float) -> str:
    assert stderr.count("slipstream: hang report:") == 1, stderr
    report = stderr[stderr.index("slipstream: hang report:") :]
    findings = report.split("behind or elsewhere:\n")[1].split("\n  the others:")[0]
    named = [line.strip() for line in findings.splitlines()]
    assert len(named) == 1 and named[0].startswith(f"rank {culprit} is "), report
    assert f"{JOB}:{culprit_line(mode)}" in named[0], report
    started = float((project / "culprit-started").read_text())
    assert finished - started < TIMEOUT + SLACK, f"reported {finished - started:.1f}s after"
    saved = list((project / "diagnostics").glob("hang-*.txt"))
    assert len(saved) == 1 and f"rank {culprit} is " in saved[0].read_text()
    assert list((project / "diagnostics").glob("hang-*.json"))
    assert_no_orphans(project)
    return report


@pytest.mark.slow
@pytest.mark.parametrize(
    "mode,world",
    [("sleep", 2), ("sleep", 4), ("branch", 2), ("branch", 4), ("skip", 2), ("skip", 4),
     ("ddp", 2)],
)  # fmt: skip
def test_the_report_names_the_process_and_its_line(tmp_path: Path, mode: str, world: int):
    try:
        result = run_cli(
            "launch", "-n", str(world), "--cpu", str(JOB), mode, str(TIMEOUT), str(tmp_path),
            timeout=120,
        )  # fmt: skip
    except subprocess.TimeoutExpired as error:  # what the job said, to see where it stuck
        pytest.fail(f"the job did not end in 120 s; it wrote:\n{error.output}\n{error.stderr}")
    finished = time.time()
    assert result.returncode == HANG_EXIT_CODE, result.stderr
    report = check_report(result.stderr, tmp_path, mode, world - 1, finished)
    kind = "is behind" if mode in ("sleep", "ddp") else "is elsewhere"
    assert kind in report
    assert "Traceback" not in result.stderr and "torch/distributed/elastic" not in result.stderr


@pytest.mark.slow
def test_a_collective_that_times_out_in_torch_is_reported_too(tmp_path: Path):
    # hang_timeout is long: torch's own 3-second group timeout notices first.
    result = run_cli(
        "launch", "-n", "2", "--cpu", str(JOB), "sleep", "60", str(tmp_path), "3", timeout=120
    )
    assert result.returncode == HANG_EXIT_CODE, result.stderr
    report = check_report(result.stderr, tmp_path, "sleep", 1, time.time())
    assert "timed out" in report.splitlines()[0]


@pytest.mark.slow
def test_without_the_launcher_rank_0_prints_the_report(tmp_path: Path):
    result = run_python(
        "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        str(JOB), "sleep", str(TIMEOUT), str(tmp_path), timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert result.stderr.count("slipstream: hang report:") == 1, result.stderr
    assert "rank 1 is behind" in result.stderr
    assert_no_orphans(tmp_path)


@pytest.mark.slow
def test_a_single_process_is_watched_when_asked(tmp_path: Path):
    script = tmp_path / "alone.py"
    script.write_text(
        "import time, torch\nfrom slipstream import Accelerator\n"
        f"accelerator = Accelerator(hang_timeout=1.0, project_dir={str(tmp_path)!r})\n"
        "model = torch.nn.Linear(2, 2)\n"
        "model, opt = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1))\n"
        "accelerator.backward(model(torch.ones(1, 2)).sum())\nopt.step()\n"
        "time.sleep(60)  # stuck here\n"
    )
    start = time.monotonic()
    result = run_python(str(script), timeout=60)
    assert result.returncode == HANG_EXIT_CODE, result.stderr
    assert time.monotonic() - start < 30
    assert "rank 0" in result.stderr and f"{script}:8" in result.stderr


def _dump(rank: int, entries: list[dict], stack_line: int, status: dict | None = None) -> dict:
    stack = [{"file": "/job/train.py", "line": stack_line, "function": "<module>", "code": "x"}]
    return {
        "rank": rank,
        "pid": 100 + rank,
        "host": "h",
        "step": 3,
        "stack": stack,
        "collectives": [],
        "torch_collectives": {
            "entries": entries,
            "status": status or {"0": {"enqueued": max(e["seq"] for e in entries)}},
            "groups": {"0": {"ranks": [], "default": True}},
        },
    }


def _entry(seq: int, op: str, site: int, pending: bool = False, size: int = 4) -> dict:
    return {
        "group": "0", "group_desc": "default_pg", "seq": seq, "op": op, "sizes": [[size]],
        "dtypes": ["Float"], "pending": pending, "site": f"/job/train.py:{site}",
    }  # fmt: skip


def _history(n: int) -> list[dict]:
    """n steps of (backward all_reduce at line 10, metric all_reduce at line 12)."""
    out = []
    for i in range(n):
        out += [_entry(2 * i + 1, "all_reduce", 10, size=72), _entry(2 * i + 2, "all_reduce", 12)]
    return out


def test_two_processes_in_different_collectives_the_one_breaking_its_pattern_is_named():
    usual = [*_history(3), _entry(7, "all_reduce", 10, size=72), _entry(8, "all_reduce", 12, True)]
    odd = [*_history(3), _entry(7, "all_reduce", 10, size=72), _entry(8, "barrier", 20, True)]
    text, named = build_report(
        {0: _dump(0, usual, 12), 1: _dump(1, odd, 20)}, 2, {"rank": 0, "reason": "r"}
    )
    assert named == [1], text
    assert "rank 1 is elsewhere: it waits in barrier #8" in text


def test_undecidable_sides_are_both_named():
    first = [*_history(1), _entry(3, "all_gather", 30, True)]
    second = [*_history(1), _entry(3, "barrier", 40, True)]
    text, named = build_report(
        {0: _dump(0, first, 30), 1: _dump(1, second, 40)}, 2, {"rank": 0, "reason": "r"}
    )
    assert named == [0, 1] and text.count("disagrees with the others") == 2, text


def test_a_process_behind_in_the_shared_memory_all_reduce_is_named():
    # DDP's gradients through shared memory: torch's recorder has only the metric reduces;
    # each reducer says how many exchanges it entered and whether it waits in one.
    def dump(rank: int, exchanges: int, waiting: bool, line: int) -> dict:
        metric = [_entry(i, "all_reduce", 12) for i in range(1, 4)]
        shared = {"seq": exchanges, "op": "all_reduce (shared memory)", "group": "shared memory",
                  "group_desc": "DDP's gradients", "data": "float32[72]", "pending": waiting}  # fmt: skip
        return {**_dump(rank, metric, line), "shared_memory_collectives": [shared]}

    dumps = {r: dump(r, 4, True, 10) for r in (0, 1, 3)}
    dumps[2] = dump(2, 3, False, 11)
    text, named = build_report(dumps, 4, {"rank": 0, "reason": "r"})
    assert named == [2], text
    assert "rank 2 is behind: it has not reached all_reduce (shared memory) #4" in text
    assert "/job/train.py:11" in text


def test_a_silent_process_is_named_with_its_pid():
    waiting = [*_history(2), _entry(5, "all_reduce", 10, True, size=72)]
    dumps = {r: _dump(r, waiting, 10) for r in (0, 1, 3)}
    text, named = build_report(dumps, 4, {"rank": 0, "reason": "r"}, pids={2: "node7:4242"})
    assert named == [2]
    assert "rank 2 did not answer" in text and "py-spy dump --pid 4242` on node7" in text


def test_slipstream_own_log_when_torch_records_nothing():
    def own(rank: int, records: list[dict], line: int) -> dict:
        stack = [{"file": "/job/t.py", "line": line, "function": "f", "code": ""}]
        return {"rank": rank, "stack": stack, "collectives": records, "torch_collectives": None}

    def record(seq: int, op: str, pending: bool) -> dict:
        return {"seq": seq, "op": op, "group": None, "data": "float32[1]", "site": "t.py:5",
                "pending": pending}  # fmt: skip

    done = [record(1, "gather", False), record(2, "gather", False)]
    dumps = {0: own(0, [*done, record(3, "gather", True)], 5), 1: own(1, done, 9)}
    text, named = build_report(dumps, 2, {"rank": 0, "reason": "r"})
    assert named == [1] and "rank 1 is behind" in text and "/job/t.py:9" in text
    assert "slipstream's own record" in text


def test_hang_timeout_precedence():
    group = timedelta(minutes=30)
    assert resolve_hang_timeout(5, {"hang_timeout": 7}, group) == 5
    assert resolve_hang_timeout(None, {"hang_timeout": 7}, group) == 7
    assert resolve_hang_timeout(timedelta(seconds=9), {}, group) == 9
    assert resolve_hang_timeout(0, {}, group) is None
    assert resolve_hang_timeout(None, {}, group) == 1740  # a minute under torch's timeout
    assert resolve_hang_timeout(None, {}, timedelta(seconds=10)) == 9
    assert resolve_hang_timeout(None, {}, group, processes=1) is None
    with pytest.raises(ValueError):
        resolve_hang_timeout(-1, {}, group)


LATE_ACCELERATOR = """
import os, time
from slipstream import Accelerator
from slipstream.utils import PartialState
PartialState()  # both processes join the group; rank 0's process hosts its store
if os.environ["RANK"] == "1":
    time.sleep(2.0)  # rank 0 has built its Accelerator and left meanwhile
started = time.monotonic()
Accelerator()
print(f"built in {time.monotonic() - started:.2f} s")
if os.environ["RANK"] == "0":  # leaves at once, without the exit barrier
    import torch.distributed
    torch.distributed.destroy_process_group()
"""


def test_a_peer_that_already_left_does_not_hold_up_the_accelerator():
    # The watchdog connects to the job's store from its own thread: before, Accelerator()
    # waited in that connection for the store's timeout (30 minutes).
    import os
    import subprocess
    import sys

    from tests.distributed import device_environment, free_port

    port = str(free_port())
    ranks = []
    for rank in ("0", "1"):
        env = {
            **os.environ, **device_environment(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port,
            "RANK": rank, "WORLD_SIZE": "2", "LOCAL_RANK": rank, "LOCAL_WORLD_SIZE": "2",
        }  # fmt: skip
        command = [sys.executable, "-c", LATE_ACCELERATOR]
        pipe = subprocess.PIPE
        ranks.append(subprocess.Popen(command, env=env, text=True, stdout=pipe, stderr=pipe))
    try:
        said = [process.communicate(timeout=60) for process in ranks]
    finally:
        for process in ranks:
            process.kill()
    assert [process.returncode for process in ranks] == [0, 0], said
    assert "built in" in said[1][0], said


def test_the_watchdog_times_steps_itself_and_a_repeated_step_number_still_counts(monkeypatch):
    """Marking an optimizer step reads no clock: the watchdog's next look notices that a
    step was marked and times it. A step whose number repeats (a skipped fp16 step, a new
    training run counting from 0 again) is progress too."""
    from slipstream.diagnostics import hang
    from slipstream.runtime.flight import CollectiveLog, Progress

    progress = Progress()
    monkeypatch.setattr(hang, "PROGRESS", progress)
    monkeypatch.setattr(hang, "COLLECTIVES", CollectiveLog())
    watchdog = hang.HangWatchdog(state=None, timeout=0.2)  # type: ignore[arg-type]
    time.sleep(0.3)
    assert watchdog.stalled() is None  # not armed before the first step
    progress.mark_step(1)
    assert watchdog.stalled() is None  # this look notices the step and times it
    time.sleep(0.3)
    reason = watchdog.stalled()
    assert reason is not None and reason.startswith("no progress for"), reason
    assert reason.endswith("after step 1"), reason
    progress.mark_step(1)  # skipped: the same step number
    assert watchdog.stalled() is None
    time.sleep(0.3)
    assert watchdog.stalled() is not None
