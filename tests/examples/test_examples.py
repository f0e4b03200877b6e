"""Every example runs, in its quick mode, the way its header says to run it."""

from __future__ import annotations

from pathlib import Path

import torch

from tests.distributed import REPO, run_cli, run_python

TRAIN = str(REPO / "examples" / "train.py")


def test_train_example_on_two_cpu_processes(tmp_path: Path):
    weights = tmp_path / "weights.pt"
    result = run_cli(
        "launch", "--num_processes", "2", "--cpu", TRAIN, "--quick", "--save", str(weights)
    )
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if "eval accuracy" in line]
    assert len(lines) == 1, "only the main process prints"
    assert "on 1001 samples (2 processes, cpu)" in lines[0]
    state = torch.load(weights, weights_only=True)
    assert set(state) == {"0.weight", "0.bias", "3.weight", "3.bias"}


def test_train_example_on_one_process():
    result = run_python(TRAIN, "--quick")
    assert result.returncode == 0, result.stderr
    assert "on 1001 samples (1 processes, cpu)" in result.stdout


def test_evaluate_metrics_example_is_exact_on_two_processes():
    example = str(REPO / "examples" / "evaluate_metrics.py")
    one = run_python(example)
    two = run_cli("launch", "--num_processes", "2", "--cpu", example)
    assert one.returncode == 0 and two.returncode == 0, one.stderr + two.stderr
    line_one = next(line for line in one.stdout.splitlines() if "accuracy" in line)
    line_two = next(line for line in two.stdout.splitlines() if "accuracy" in line)
    assert line_one.replace("(1 processes)", "") == line_two.replace("(2 processes)", "")
