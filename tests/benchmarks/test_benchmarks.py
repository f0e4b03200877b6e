"""Every benchmark runs in its quick mode (no timing is asserted here)."""

from __future__ import annotations

import importlib.util

import pytest

from tests.distributed import REPO, run_python

# run.py runs all of them (workers.py is their shared launcher); each script is smoke-tested
# on its own here.
SCRIPTS = sorted(
    p.name for p in (REPO / "benchmarks").glob("*.py") if p.name not in {"run.py", "workers.py"}
)


@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_runs_quickly(script):
    result = run_python(str(REPO / "benchmarks" / script), "--quick", timeout=300)
    assert result.returncode == 0, result.stderr
    assert "ratio" in result.stdout
    # The overhead scripts check that every variant trained to the hand-written loop's weights.
    assert "weights DIFFERENT" not in result.stdout, result.stdout


def test_run_lists_every_script():
    assert set(_run_module().SCRIPTS) == set(SCRIPTS)


def test_targets_apply_to_their_own_script_only():
    run = _run_module()
    line = "tiny   slipstream step    0.932 ms vs torch    0.914 ms  ratio 1.014x"
    assert run.target_for("ddp_overhead.py", line) == 1.01
    assert run.target_for("tp_overhead.py", "tp2 tiny " + line) == 1.02
    memory = "mlp {} vs ddp per-process tensors (parameters+gradients+optimizer state): ratio 0.25x"
    assert run.target_for("tp_memory.py", memory.format("tp2")) == 0.60
    assert run.target_for("tp_memory.py", memory.format("tp2xdp2")) == 0.35
    assert run.target_for("tp_memory.py", memory.format("tp2").replace("ddp", "fsdp")) is None


def _run_module():
    spec = importlib.util.spec_from_file_location("benchmarks_run", REPO / "benchmarks" / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
