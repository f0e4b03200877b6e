"""Workers forked from the launcher look like fresh interpreters to the script."""

from __future__ import annotations

import dataclasses
import json
import os
import textwrap
from pathlib import Path

import pytest

from slipstream.launcher.config import LaunchConfig
from slipstream.launcher.forked import fork_wanted
from slipstream.options.errors import ConfigError
from slipstream.runtime.env import patch_environment
from tests.distributed import run_cli

PROBE = textwrap.dedent(
    """
    import atexit, json, multiprocessing, os, signal, sys
    import numpy, torch
    from slipstream import Accelerator

    torch_seed = torch.initial_seed()  # before the Accelerator chooses one

    accelerator = Accelerator()
    rank = accelerator.process_index
    atexit.register(lambda: open(os.path.join(sys.argv[1], f"exit{rank}"), "w").close())
    handler = lambda signum: getattr(signal.getsignal(signum), "__name__", "default")
    report = {
        "fresh_interpreter": b"slipstream.launcher.worker" in open("/proc/self/cmdline", "rb").read(),
        "main": __name__,
        "process": multiprocessing.current_process().name,
        "has_parent": multiprocessing.parent_process() is not None,
        "argv": sys.argv[1:],
        "path0": sys.path[0],
        "threads": torch.get_num_threads(),
        "unbuffered": sys.stdout.write_through and sys.stderr.write_through,
        "signals": {name: handler(getattr(signal, name)) for name in ("SIGINT", "SIGTERM", "SIGHUP", "SIGUSR1")},
        "torch_seed": torch_seed,
        "numpy_draw": float(numpy.random.rand()),
        "world": accelerator.num_processes,
    }
    with open(os.path.join(sys.argv[1], f"rank{rank}.json"), "w") as handle:
        json.dump(report, handle)
    sys.stdout.write(f"rank {rank} reported\\n")  # one write: lines never interleave
    """
)


def _launch(tmp_path: Path, start: str, target: list[str]) -> list[dict]:
    # No OMP_NUM_THREADS: the launcher's torch takes every core, its workers a share.
    out = tmp_path / start
    out.mkdir()
    result = run_cli(
        "launch", "--cpu", "-n", "2", "--worker_start", start, *target, str(out), "x",
        cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(result.stdout.split("\n")) == ["", "rank 0 reported", "rank 1 reported"]
    assert sorted(p.name for p in out.glob("exit*")) == ["exit0", "exit1"]  # atexit ran
    reports = [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]
    assert [report.pop("argv") for report in reports] == [[str(out), "x"]] * 2
    return reports


@pytest.mark.slow
def test_forked_workers_see_what_fresh_interpreters_see(tmp_path: Path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    (tmp_path / "probe.py").write_text(PROBE)
    forked = _launch(tmp_path, "fork", ["--module", "probe"])  # python -m: sys.path[0] is cwd
    fresh = _launch(tmp_path, "exec", [str(tmp_path / "probe.py")])
    assert [r.pop("fresh_interpreter") for r in forked] == [False, False]  # really forked
    assert [r.pop("fresh_interpreter") for r in fresh] == [True, True]
    # torch's and NumPy's global randomness: each process its own, forked or not.
    for reports in (forked, fresh):
        for key in ("torch_seed", "numpy_draw"):
            assert reports[0].pop(key) != reports[1].pop(key), key
    assert forked == fresh
    assert forked[0]["path0"] == str(tmp_path)
    assert forked[0]["threads"] == max(1, (os.cpu_count() or 1) // 2)
    assert forked[0]["signals"] == {
        "SIGINT": "default_int_handler",
        "SIGTERM": "default",
        "SIGHUP": "default",
        "SIGUSR1": "default",
    }


def test_cpu_jobs_fork_and_gpu_jobs_exec_unless_told():
    with patch_environment(cuda_visible_devices="0,1"):
        assert fork_wanted(LaunchConfig(use_cpu=True))
        assert not fork_wanted(LaunchConfig(use_cpu=False))  # a GPU job starts fresh
        assert fork_wanted(LaunchConfig(worker_start="fork"))
        assert not fork_wanted(LaunchConfig(use_cpu=True, worker_start="exec"))
        assert not fork_wanted(LaunchConfig(use_cpu=True), no_python=True)
        tolerant = LaunchConfig(use_cpu=True, fault_tolerance_config={"replica_groups": 2})
        assert fork_wanted(tolerant)  # a restarted replica group is forked too
        assert not fork_wanted(dataclasses.replace(tolerant, worker_start="exec"))
    with patch_environment(cuda_visible_devices=""):
        assert fork_wanted(LaunchConfig(use_cpu=False))  # no GPU visible: a CPU job


def test_an_unknown_worker_start_is_refused():
    with pytest.raises(ConfigError, match="worker_start must be one of auto, fork, exec"):
        LaunchConfig().replace(worker_start="spawn")
