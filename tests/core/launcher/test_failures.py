"""A failed job's output: the first failing process's traceback once, labelled with its rank,
one line for each other process, and none of torchrun's agent lines unless asked for."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from slipstream.launcher.failures import (
    FAILURE_KEY,
    MAX_LINES_PER_RANK,
    exit_code_of,
    failure_summary,
)
from tests.distributed import run_cli

#: Starts its own processes for every test: left out of `pytest -m "not slow"`.
pytestmark = pytest.mark.slow

CRASH = textwrap.dedent(
    """
    import time
    from slipstream import Accelerator

    accelerator = Accelerator()
    if accelerator.process_index == 1:
        raise RuntimeError("boom on rank one")
    accelerator.wait_for_everyone()
    time.sleep(600)
    """
)
# Every process raises the same error (the layout does not fit the job): issue #32's case.
WRONG_LAYOUT = textwrap.dedent(
    """
    from slipstream import Accelerator, ParallelismConfig

    Accelerator(parallelism_config=ParallelismConfig(tp_size={tp}))
    """
)


def _failure(tmp_path: Path, rank: int, exitcode: int, error: dict | None) -> ProcessFailure:
    path = tmp_path / f"error{rank}.json"
    if error is not None:
        path.write_text(json.dumps(error))
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(path))


def _error(message: str, *, at: float, by_peer: bool = False) -> dict:
    trace = f'Traceback (most recent call last):\n  File "train.py", line 3\n{message}\n'
    return {
        "message": {
            "message": message,
            "extraInfo": {"py_callstack": trace, "timestamp": str(int(at))},
        },
        FAILURE_KEY: {"time": at, "caused_by_peer": by_peer},
    }


def test_the_first_own_error_is_the_root_cause_not_a_lost_peer(tmp_path: Path):
    failures = {
        0: _failure(tmp_path, 0, 1, _error("PeerProcessFailedError: lost", at=10.1, by_peer=True)),
        1: _failure(tmp_path, 1, 1, _error("ValueError: bad batch", at=10.5)),
        2: _failure(tmp_path, 2, -15, None),
        3: _failure(tmp_path, 3, 1, _error("ValueError: bad batch", at=10.7)),
    }
    text = failure_summary(failures, world_size=4)
    lines = text.splitlines()
    assert lines[0] == "slipstream launch: rank 1 of 4 failed (exit code 1):"
    assert text.count("ValueError: bad batch") == 1
    assert lines[-3:] == [
        "  rank 0: lost its peers (PeerProcessFailedError) (exit code 1)",
        "  rank 2: stopped by the launcher (SIGTERM)",
        "  rank 3: raised the same error (exit code 1)",
    ]
    assert exit_code_of(failures) == 1


def test_a_process_that_exits_without_a_traceback(tmp_path: Path):
    failures = {0: _failure(tmp_path, 0, -15, None), 1: _failure(tmp_path, 1, 3, None)}
    lines = failure_summary(failures, world_size=2).splitlines()
    assert lines[0].startswith("slipstream launch: rank 1 of 2 failed (exit code 3) without")
    assert lines[1:] == ["  rank 0: stopped by the launcher (SIGTERM)"]
    assert exit_code_of(failures) == 3


def test_many_processes_with_the_same_outcome_share_a_line(tmp_path: Path):
    world = MAX_LINES_PER_RANK + 8
    failures = {r: _failure(tmp_path, r, -15, None) for r in range(world)}
    failures[5] = _failure(tmp_path, 5, 1, _error("RuntimeError: x", at=1.0))
    lines = failure_summary(failures, world_size=world).splitlines()
    assert lines[-1] == f"  ranks 0-4, 6-{world - 1}: stopped by the launcher (SIGTERM)"
    assert len(lines) == 1 + 3 + 1


def _agent_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "torch/distributed/elastic" in line]


@pytest.mark.parametrize("world", [2, 4])
def test_a_crash_prints_one_traceback_and_one_line_per_other_rank(tmp_path: Path, world: int):
    script = tmp_path / "crash.py"
    script.write_text(CRASH)
    result = run_cli("launch", "-n", str(world), "--cpu", str(script), timeout=120)
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    # The whole output: header, the traceback (4 lines), one line per other process.
    assert lines == [
        f"slipstream launch: rank 1 of {world} failed (exit code 1):",
        "Traceback (most recent call last):",
        f'  File "{script}", line 7, in <module>',
        '    raise RuntimeError("boom on rank one")',
        "RuntimeError: boom on rank one",
        *[f"  rank {r}: stopped by the launcher (SIGTERM)" for r in range(world) if r != 1],
    ], result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("world,tp", [(2, 4), (4, 3)])
def test_the_same_config_error_on_every_rank_is_one_line(tmp_path: Path, world: int, tp: int):
    # The user's input (a layout that does not fit), like a bad flag: one line naming the
    # script's line, not a traceback through slipstream, and nothing per process.
    script = tmp_path / "layout.py"
    script.write_text(WRONG_LAYOUT.format(tp=tp))
    result = run_cli("launch", "-n", str(world), "--cpu", str(script), timeout=120)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("slipstream launch: ParallelismConfigError: tp_size="), lines
    assert f"but the job has {world} process(es)" in lines[0]
    assert lines[0].endswith(f"(at {script}:4) on every process"), lines


def test_the_agents_own_lines_show_when_asked_for(tmp_path: Path):
    script = tmp_path / "crash.py"
    script.write_text(CRASH)
    result = run_cli(
        "launch", "-n", "2", "--cpu", str(script), env={"LOGLEVEL": "INFO"}, timeout=120
    )
    assert result.returncode == 1
    assert _agent_lines(result.stderr), result.stderr
    assert result.stderr.count("RuntimeError: boom on rank one") == 1


# Rank 1 skips a reduce at step 2: rank 0 waits in it while rank 1's next backward starts
# DDP's all-reduce; gloo notices the sizes differ and aborts rank 0 (SIGABRT). (DDP's
# all-reduce over gloo: through shared memory it never meets the reduce, and the mismatch is
# a hang, which the hang report names: tests/core/diagnostics/test_hang.py.)
SKIPPED_COLLECTIVE = textwrap.dedent(
    """
    import torch
    from slipstream import Accelerator, DistributedDataParallelKwargs

    gloo = DistributedDataParallelKwargs(shared_memory_all_reduce=False)
    accelerator = Accelerator(kwargs_handlers=[gloo])
    model = torch.nn.Linear(4, 1)
    model, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for step in range(4):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        if not (step == 2 and accelerator.process_index == 1):
            accelerator.reduce(loss.detach(), "mean")
    """
)


def test_a_skipped_collective_names_each_process_last_collective(tmp_path: Path):
    script = tmp_path / "skip.py"
    script.write_text(SKIPPED_COLLECTIVE)
    result = run_cli("launch", "-n", "2", "--cpu", str(script), timeout=120)
    assert result.returncode != 0
    err = result.stderr
    assert "a crash in native code" in err, err
    site = f"{script}:15"
    assert f"rank 0: inside reduce #3 (float32[]) at {site}, after step 3" in err, err
    assert f"rank 1: last finished reduce #2 (float32[]) at {site}, after step 3" in err, err
    assert "rerun with `slipstream launch --debug`" in err
