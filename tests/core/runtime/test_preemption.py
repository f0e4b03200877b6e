"""Preemption: workers never outlive their launcher, signals stop jobs cleanly, a
preempted job saves and resumes bitwise, and sharded checkpoints resume on another
number of processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from slipstream import Accelerator, FullyShardedDataParallelPlugin
from slipstream.runtime.preemption import REQUEUE_EXIT_CODE, signal_numbers
from tests.distributed import REPO, run_cli, run_distributed

JOB = str(REPO / "tests" / "core" / "runtime" / "preemption_job.py")


def _launch(*arguments: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    variables = {k: v for k, v in os.environ.items() if not k.startswith("SLIPSTREAM_")}
    variables.update(env or {})
    return subprocess.Popen(
        [sys.executable, "-m", "slipstream.cli", "launch", "-n", "2", "--cpu", *arguments],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=variables,
        cwd=REPO,
    )


def _wait_for(paths: list[Path], seconds: float = 90) -> None:
    deadline = time.monotonic() + seconds
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"{paths} did not appear"
        time.sleep(0.2)


def _alive(pid: int) -> bool:
    """Running, not a zombie (a zombie holds nothing and waits for its parent to reap it)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    return "\nState:\tZ" not in status


def test_signal_names_are_read_and_checked():
    assert signal_numbers("SIGTERM,usr1") == [signal.SIGTERM, signal.SIGUSR1]
    with pytest.raises(ValueError, match="'SIGKILL' is not a signal a process can handle"):
        signal_numbers("SIGKILL")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_workers_end_within_5_seconds_of_a_killed_launcher(tmp_path: Path):
    launcher = _launch(JOB, "--project_dir", str(tmp_path), "--park")
    pids = [tmp_path / "worker_0.pid", tmp_path / "worker_1.pid"]
    assert _orphans_after_killing(launcher, pids) == [], "a worker outlived its launcher by 5 s"


def _orphans_after_killing(parent: subprocess.Popen[str], pids: list[Path]) -> list[int]:
    """Kill ``parent`` with SIGKILL once its workers wrote ``pids``; the workers still
    running 5 seconds later."""
    try:
        _wait_for(pids)
        workers = [int(p.read_text()) for p in pids]
        assert all(_alive(w) for w in workers)
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.monotonic() + 5
        while any(_alive(w) for w in workers) and time.monotonic() < deadline:
            time.sleep(0.1)
        return [w for w in workers if _alive(w)]
    finally:
        parent.kill()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_notebook_launcher_workers_end_with_their_notebook(tmp_path: Path):
    code = (
        "from slipstream import notebook_launcher\n"
        "from tests.core.runtime.parking import park\n"
        f"notebook_launcher(park, ({str(tmp_path)!r},), num_processes=2, use_cpu=True)\n"
    )
    notebook = subprocess.Popen([sys.executable, "-c", code], cwd=REPO, text=True)
    pids = [tmp_path / "worker_0.pid", tmp_path / "worker_1.pid"]
    assert _orphans_after_killing(notebook, pids) == []


@pytest.mark.slow
def test_sigterm_to_the_launcher_stops_every_worker_quietly(tmp_path: Path):
    launcher = _launch(
        "--termination_grace_period", "5", JOB, "--project_dir", str(tmp_path), "--park",
        "--no_preemption",
    )  # fmt: skip
    pids = [tmp_path / "worker_0.pid", tmp_path / "worker_1.pid"]
    try:
        _wait_for(pids)
        workers = [int(p.read_text()) for p in pids]
        launcher.send_signal(signal.SIGTERM)
        _, stderr = launcher.communicate(timeout=30)
        assert launcher.returncode == 128 + signal.SIGTERM == 143
        assert "stopped by SIGTERM" in stderr and "Traceback" not in stderr
        assert not any(_alive(w) for w in workers)
    finally:
        launcher.kill()


@pytest.mark.slow
def test_a_signal_to_one_process_saves_requeues_and_resumes_bitwise(tmp_path: Path):
    straight = run_cli("launch", "-n", "2", "--cpu", JOB, "--project_dir", str(tmp_path / "a"))
    assert straight.returncode == 0, straight.stderr
    # A fake scontrol records what it is asked; the job says it runs under SLURM.
    bin_dir, record = tmp_path / "bin", tmp_path / "scontrol.txt"
    bin_dir.mkdir()
    fake = bin_dir / "scontrol"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {record}\n')
    fake.chmod(0o755)
    env = {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_ID": "4242"}
    project = str(tmp_path / "b")
    preempted = run_cli(
        "launch", "-n", "2", "--cpu", JOB, "--project_dir", project, "--signal_rank", "1",
        env=env,
    )  # fmt: skip
    assert preempted.returncode == REQUEUE_EXIT_CODE, preempted.stderr
    assert "checkpoint saved to" in preempted.stderr and "the job was preempted" in preempted.stderr
    assert (Path(project) / "checkpoints" / "checkpoint_0" / "checkpoint.json").exists()
    assert record.read_text().split() == ["requeue", "4242"]
    resumed = run_cli("launch", "-n", "2", "--cpu", JOB, "--project_dir", project)
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout and "at step 5" in resumed.stdout
    final = [line for line in straight.stdout.splitlines() if "checksum" in line]
    assert final and final == [line for line in resumed.stdout.splitlines() if "checksum" in line]


@pytest.mark.slow
def test_sigusr1_to_the_launcher_reaches_the_workers(tmp_path: Path):
    ready = tmp_path / "ready"
    launcher = _launch(
        JOB, "--project_dir", str(tmp_path), "--steps", "1000", "--step_sleep", "0.05",
        "--ready_file", str(ready),
    )  # fmt: skip
    try:
        _wait_for([ready])
        launcher.send_signal(signal.SIGUSR1)  # SLURM's --signal=USR1@...
        _, stderr = launcher.communicate(timeout=60)
        assert launcher.returncode == REQUEUE_EXIT_CODE, stderr
        assert "preempted (SIGUSR1)" in stderr
        assert list((tmp_path / "checkpoints").iterdir())
    finally:
        launcher.kill()


# -- sharded checkpoints resume on another number of processes --------------------------------

SAMPLES = 32


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1))


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(SAMPLES, 4, generator=generator)
    return TensorDataset(
        inputs, torch.randn(SAMPLES, 1, generator=generator), torch.arange(SAMPLES)
    )


def _epoch(
    split: bool, load: str | None, save: str | None, stop_after: int | None
) -> dict[str, Any]:
    acc = Accelerator(
        fsdp_plugin=FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT"),
        split_batches=split,
    )
    model = _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(_data(), batch_size=8 if split else 2, shuffle=True)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    if load is not None:
        acc.load_state(load)
    batches = []
    for x, y, index in loader:
        acc.backward(F.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        batches.append(acc.gather(index).tolist())
        if acc.step == stop_after:
            assert save is not None
            acc.save_state(save)
            break
    return {"batches": batches, "full": acc.get_state_dict(model)}


def _first_part(folder: str) -> dict[str, Any]:
    return {
        "plain": _epoch(False, None, folder + "/plain", 2),
        "split": _epoch(True, None, folder + "/split", 1),
    }


def _second_part(folder: str, then_save: str | None) -> dict[str, Any]:
    result = {
        "plain": _epoch(False, folder + "/plain", None, None),
        "split": _epoch(True, folder + "/split", None, None),
    }
    if then_save is not None:
        result["next"] = _epoch(True, None, then_save + "/split", 2)
    return result


def _uninterrupted(batches: list[list[int]]) -> dict[str, torch.Tensor]:
    data, model = _data(), _net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for indices in batches:
        x, y, _ = (t[torch.tensor(indices)] for t in data.tensors)
        F.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def _check_epoch(first: dict[str, Any], second: dict[str, Any], split: bool) -> None:
    batches = first["batches"] + second["batches"]
    seen = sorted(i for batch in batches for i in batch)
    assert seen == list(range(SAMPLES)), "every sample of the epoch exactly once"
    if split:  # the same global batches: the same training as without the interruption
        expected = _uninterrupted(batches)
        full = second["full"]
        assert max((full[k] - expected[k]).abs().max().item() for k in expected) <= 1e-5
        model = _net()
        model.load_state_dict(full)
        reference = _net()
        reference.load_state_dict(expected)
        x, y, _ = _data().tensors
        assert abs(F.mse_loss(model(x), y).item() - F.mse_loss(reference(x), y).item()) <= 1e-5


@pytest.mark.slow
def test_fsdp_checkpoints_resume_from_4_on_2_and_from_2_on_4_processes(tmp_path: Path):
    four, two = str(tmp_path / "from4"), str(tmp_path / "from2")
    first = run_distributed(_first_part, four, world_size=4, timeout=300)[0]
    second = run_distributed(_second_part, four, two, world_size=2, timeout=300)[0]
    _check_epoch(first["plain"], second["plain"], split=False)
    _check_epoch(first["split"], second["split"], split=True)
    third = run_distributed(_epoch, True, two + "/split", None, None, world_size=4, timeout=300)
    _check_epoch(second["next"], third[0], split=True)


def test_saving_on_preemption_needs_a_project_folder():
    with pytest.raises(ValueError, match="save_on_preemption needs project_dir"):
        Accelerator(save_on_preemption=True)
