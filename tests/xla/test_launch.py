"""``slipstream launch --tpu`` on XLA:CPU, and what several XLA:CPU processes do."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = """
import torch
from slipstream import Accelerator

accelerator = Accelerator()
model, optimizer = accelerator.prepare(torch.nn.Linear(2, 1), torch.optim.SGD([torch.zeros(1)], 0.1))
accelerator.print("RESULT", accelerator.distributed_type.value, accelerator.device.type,
                  accelerator.num_processes, accelerator.mixed_precision)
"""


def _launch(
    tmp_path: Path, *flags: str, pjrt: str | None = "CPU"
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PJRT_DEVICE"}
    if pjrt is not None:
        env["PJRT_DEVICE"] = pjrt
    command = [sys.executable, "-m", "slipstream.cli", "launch", *flags, str(script)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)


def test_launch_tpu_runs_the_script_on_the_xla_device(tmp_path: Path) -> None:
    # No PJRT_DEVICE: --tpu alone asks for XLA (torch_xla picks the CPU client here).
    result = _launch(tmp_path, "--tpu", "--mixed_precision", "bf16", pjrt=None)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "RESULT XLA xla 1 bf16" in result.stdout


def test_launch_refuses_tpu_with_cpu_and_tpu_pods(tmp_path: Path) -> None:
    both = _launch(tmp_path, "--tpu", "--cpu")
    assert both.returncode != 0
    assert "distributed_type: XLA (--tpu)" in both.stderr + both.stdout
    pod = _launch(tmp_path, "--tpu", "--tpu_cluster")
    assert pod.returncode != 0
    assert "does not start TPU pods" in pod.stderr + pod.stdout


def test_two_xla_cpu_processes_form_no_world(tmp_path: Path) -> None:
    """Evidence, kept as a test: with torch_xla 2.9, PJRT's CPU client forms no world of
    several processes (each torchrun worker is rank 0 of 1), so slipstream stops with a
    clear error. This test fails once PJRT forms the world: then test 2 processes against 1.
    """
    result = _launch(tmp_path, "--tpu", "--num_processes", "2")
    assert result.returncode != 0
    assert "sees a world of 1" in result.stderr + result.stdout


@pytest.mark.skip(
    reason="xmp.spawn on XLA:CPU (torch_xla 2.9, PJRT_DEVICE=CPU CPU_NUM_DEVICES=2) runs one "
    "process with 2 devices; its first xm.all_reduce waits for a second thread "
    "('Expected 2 threads to join the rendezvous, but only 1 of them arrived') and XLA "
    "aborts the process after 10 s: PJRT's CPU client runs several devices only thread per "
    "device, which slipstream's process-per-device model does not use"
)
def test_xmp_spawn_on_xla_cpu() -> None:  # pragma: no cover - documented above
    raise AssertionError
