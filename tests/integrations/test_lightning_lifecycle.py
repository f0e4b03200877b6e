"""Processes the Lightning Trainer starts end when the Trainer's process is killed."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.core.runtime.test_preemption import _orphans_after_killing
from tests.distributed import REPO

#: Starts its own processes for every test: left out of `pytest -m "not slow"`.
pytestmark = pytest.mark.slow

pytest.importorskip("lightning")

SCRIPT = str(REPO / "tests" / "integrations" / "lightning_scripts" / "park.py")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("start_method", ["popen", "spawn"])
def test_trainer_processes_end_with_the_trainer(tmp_path: Path, start_method: str):
    command = [sys.executable, SCRIPT, str(tmp_path), start_method]
    trainer = subprocess.Popen(command, cwd=REPO, text=True)
    pids = [tmp_path / "worker_0.pid", tmp_path / "worker_1.pid"]
    assert _orphans_after_killing(trainer, pids) == []
