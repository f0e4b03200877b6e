"""Every benchmark runs in its quick mode (no timing is asserted here)."""

from __future__ import annotations

import importlib
import importlib.util
import runpy
import sys
import time

import pytest

from tests.benchmarks.warm_launch import launch_on_warm_workers
from tests.distributed import REPO, run_python

# run.py runs all of them (workers.py, models.py and process_memory.py are their shared
# helpers); each script is smoke-tested on its own here. gpu_check.py (with its checks
# module) is no benchmark but the GPU readiness check: test_gpu_check.py runs it.
NOT_BENCHMARKS = {
    "run.py",
    "workers.py",
    "models.py",
    "process_memory.py",
    "gpu_check.py",
    "gpu_check_cases.py",
}
SCRIPTS = sorted(p.name for p in (REPO / "benchmarks").glob("*.py") if p.name not in NOT_BENCHMARKS)


# Scripts whose ranks start through workers.run_workers run their smoke test in this process,
# their ranks on the suite's warm workers (tests/benchmarks/warm_launch.py); the others start
# processes of their own by design (start-up, fault tolerance, the GPU check's workers).
ON_WARM_WORKERS = {
    name for name in SCRIPTS if "run_workers(" in (REPO / "benchmarks" / name).read_text()
} | {name for name in SCRIPTS if "run_cases(" in (REPO / "benchmarks" / name).read_text()}


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_benchmark_runs_quickly(script, monkeypatch, capsys):
    path = REPO / "benchmarks" / script
    if script in ON_WARM_WORKERS:
        monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
        workers = importlib.import_module("workers")
        monkeypatch.setattr(workers, "_launch", launch_on_warm_workers)
        monkeypatch.setattr(sys, "argv", [str(path), "--quick"])
        try:
            runpy.run_path(str(path), run_name="__main__")
        except SystemExit as stop:
            assert stop.code in (None, 0), stop.code
        stdout = capsys.readouterr().out
    else:
        result = run_python(str(path), "--quick", timeout=300)
        assert result.returncode == 0, result.stderr
        stdout = result.stdout
    assert "ratio" in stdout
    # The overhead scripts check that every variant trained to the hand-written loop's weights.
    assert "weights DIFFERENT" not in stdout, stdout


REPORTING_SCRIPT = """
import json, os, sys
rank = int(os.environ["RANK"])
if sys.argv[1] == "fail" and rank == 1:
    raise SystemExit("rank 1 gives up")
if rank == 0:
    import time; time.sleep(0 if sys.argv[1] == "ok" else 30)
    print("BENCH " + json.dumps({"world": os.environ["WORLD_SIZE"], "extra": os.environ["EXTRA"],
                                 "threads": os.environ["OMP_NUM_THREADS"]}))
"""


def test_run_workers_starts_the_ranks_and_stops_them_when_one_fails(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    workers = importlib.import_module("workers")
    script = tmp_path / "reporting.py"
    script.write_text(REPORTING_SCRIPT)
    reports = workers.run_workers(str(script), ["ok"], processes=2, env={"EXTRA": "1"})
    assert reports == [{"world": "2", "extra": "1", "threads": "1"}]
    started = time.monotonic()
    with pytest.raises(SystemExit, match="rank 1 gives up"):
        workers.run_workers(str(script), ["fail"], processes=2, env={"EXTRA": "1"})
    assert time.monotonic() - started < 20, "rank 0 (sleeping) was stopped, not waited for"


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
    assert run.target_for("pp_overhead.py", "pp2 1f1b tiny " + line) == 1.02
    stage = "mlp {} vs single per-process tensors (parameters+gradients+optimizer state): ratio"
    assert run.target_for("pp_memory.py", stage.format("pp2") + " 0.500x") == 0.60
    assert run.target_for("pp_memory.py", stage.format("pp4") + " 0.250x") == 0.35
    assert run.target_for("tp_memory.py", stage.format("pp2")) is None
    resident = "mlp pp2 vs single per-process peak resident memory above the process: ratio 0.51x"
    assert run.target_for("pp_memory.py", resident) is None
    # The idle fraction is compared with theory, with no target.
    assert run.target_for("pp_bubble.py", "pp2 m=4 1f1b idle 0.25 ... ratio 1.10x") is None


def _run_module():
    spec = importlib.util.spec_from_file_location("benchmarks_run", REPO / "benchmarks" / "run.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _one_f_one_b(rank: int, stages: int, microbatches: int) -> list[tuple[str, int, int]]:
    """1F1B's order of actions on ``rank`` (one stage each): warm-up forwards, then one
    backward and one forward in turn, then the remaining backwards."""
    warmup = min(microbatches, stages - rank)
    order = [("F", rank, i) for i in range(warmup)]
    for i in range(microbatches):
        order.append(("B", rank, i))
        if warmup + i < microbatches:
            order.append(("F", rank, warmup + i))
    return order


@pytest.mark.parametrize("stages", [2, 3, 4])
@pytest.mark.parametrize("microbatches", [4, 8])
def test_bubble_simulation_matches_the_closed_form(monkeypatch, stages, microbatches):
    # pp_bubble.py's "theory" replays the recorded orders with unit costs; for GPipe and
    # 1F1B that must be (p-1)/(m+p-1) whatever a backward costs relative to a forward.
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location("pp_bubble", REPO / "benchmarks" / "pp_bubble.py")
    assert spec is not None and spec.loader is not None
    bubble = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bubble)
    gpipe = [
        [("F", r, i) for i in range(microbatches)] + [("B", r, i) for i in range(microbatches)]
        for r in range(stages)
    ]
    one_f_one_b = [_one_f_one_b(r, stages, microbatches) for r in range(stages)]
    expected = bubble.closed_form("1f1b", stages, microbatches, 1)
    assert expected == (stages - 1) / (microbatches + stages - 1)
    for orders in (gpipe, one_f_one_b):
        for backward in (1.0, 2.0, 3.0):
            costs = {"F": 1.0, "B": backward}
            idle = bubble.simulate(orders, lambda kind, stage, chunk, c=costs: c[kind], stages)
            assert idle == pytest.approx(expected)
