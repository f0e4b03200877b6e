"""Fault injection on 2 CPU processes: skipped collectives, triggers, elastic restarts."""

from __future__ import annotations

import json
import textwrap
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from slipstream import Accelerator, InitProcessGroupKwargs
from slipstream.runtime.errors import CollectiveTimeoutError
from tests.distributed import run_cli, run_distributed


def _one_rank_skips_a_gather() -> str:
    # hang_timeout=0: the watchdog would end the job (exit 86, tests/core/diagnostics) before
    # the late process returns; this test is about the error the waiting process gets.
    acc = Accelerator(
        hang_timeout=0, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=2))]
    )
    if acc.process_index == 1:
        time.sleep(5)  # skips the gather below
        return ""
    try:
        acc.gather(torch.ones(2))
    except CollectiveTimeoutError as error:
        return str(error)
    return "no error"


def test_a_skipped_collective_times_out_with_a_message_naming_it():
    message = run_distributed(_one_rank_skips_a_gather, timeout=60)[0]
    assert message.startswith("collective 'gather' on process 0 timed out")
    assert "SLIPSTREAM_DEBUG=1" in message


def _triggers() -> list[bool]:
    acc = Accelerator()
    seen = []
    for step in range(4):
        if step == 2 and acc.process_index == 1:
            acc.set_trigger()
        seen.append(acc.check_trigger())
    return seen


def test_a_trigger_set_on_one_rank_is_seen_by_all_once():
    assert run_distributed(_triggers) == [[False, False, True, False]] * 2


RESTARTING = textwrap.dedent(
    """
    import json, os, sys
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    from slipstream import Accelerator, ProjectConfiguration, set_seed

    project, crash_marker, result = sys.argv[1], sys.argv[2], sys.argv[3]
    acc = Accelerator(project_config=ProjectConfiguration(
        project_dir=project, automatic_checkpoint_naming=True, total_limit=2))
    set_seed(0)
    generator = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(48, 5, generator=generator), torch.randn(48, 1, generator=generator))
    model = nn.Sequential(nn.Linear(5, 12), nn.ReLU(), nn.Dropout(0.2), nn.Linear(12, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loader = DataLoader(data, batch_size=4, shuffle=True)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    if os.path.isdir(os.path.join(project, "checkpoints")):
        acc.load_state()  # a restart: continue from the newest complete checkpoint
    while acc.step < 15:
        for x, y in loader:
            acc.backward(F.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            if acc.step % 4 == 0:
                acc.save_state()
            if acc.step == 10 and crash_marker != "none" and not os.path.exists(crash_marker):
                if acc.process_index == 1:
                    open(crash_marker, "w").close()
                    os.kill(os.getpid(), 9)  # killed between two checkpoints
            if acc.step == 15:
                break
    if acc.is_main_process:
        weights = [p.detach().flatten().tolist() for p in acc.unwrap_model(model).parameters()]
        json.dump(weights, open(result, "w"))
    """
)


@pytest.mark.slow
def test_a_crash_with_max_restarts_resumes_to_identical_weights(tmp_path: Path):
    script = tmp_path / "train.py"
    script.write_text(RESTARTING)
    straight = run_cli(
        "launch",
        "-n",
        "2",
        "--cpu",
        str(script),
        str(tmp_path / "a"),
        "none",
        str(tmp_path / "a.json"),
    )
    assert straight.returncode == 0, straight.stderr
    marker = tmp_path / "crashed-once"
    restarted = run_cli(
        "launch", "-n", "2", "--cpu", "--max_restarts", "1", "--monitor_interval", "0.2",
        str(script), str(tmp_path / "b"), str(marker), str(tmp_path / "b.json"),
    )  # fmt: skip
    assert restarted.returncode == 0, restarted.stderr
    assert marker.exists(), "the run really crashed once"
    assert json.loads((tmp_path / "a.json").read_text()) == json.loads(
        (tmp_path / "b.json").read_text()
    )
    without_restarts = run_cli(
        "launch", "-n", "2", "--cpu", str(script), str(tmp_path / "c"), str(tmp_path / "m2"),
        str(tmp_path / "c.json"),
    )  # fmt: skip
    assert without_restarts.returncode == 1, "without restarts the crash ends the job"
    assert "rank 1 of 2 failed (killed by SIGKILL" in without_restarts.stderr
