"""benchmarks/gpu_check.py: the quick mode runs every check here (the CUDA-only ones SKIP
with their reason; the processes the test helpers start see no GPU), and the harness turns a
failing, hanging or crashing check into a FAIL line and a non-zero exit."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.distributed import REPO, run_python

GPU_CHECK = REPO / "benchmarks" / "gpu_check.py"
LINE = re.compile(r"^(PASS|FAIL|SKIP)\s+(\w+)\s+([\d.]+)s /\s*(\d+)s  (.*)$")
SUMMARY = re.compile(r"^SUMMARY: (\d+) passed, (\d+) failed, (\d+) skipped in [\d.]+ s")
# What only a GPU can show: without CUDA these SKIP and say why.
CUDA_ONLY = {"fp8_training", "estimate_memory", "multi_process", "suite_on_gpu"}
DEEPSPEED = {"zero1", "zero2", "zero3"}


def _load(name: str, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _lines(stdout: str) -> dict[str, tuple[str, float, float, str]]:
    found = {}
    for line in stdout.splitlines():
        match = LINE.match(line)
        if match:
            status, name, seconds, budget, detail = match.groups()
            found[name] = (status, float(seconds), float(budget), detail)
    return found


def _summary(stdout: str) -> tuple[int, int, int]:
    matches = [SUMMARY.match(line) for line in stdout.splitlines()]
    found = [m for m in matches if m]
    assert len(found) == 1, stdout
    passed, failed, skipped = found[0].groups()
    return int(passed), int(failed), int(skipped)


@pytest.mark.slow
def test_quick_mode_passes_every_check_or_skips_it_with_the_reason(tmp_path, monkeypatch):
    names = [check.name for check in _load("gpu_check", monkeypatch).CHECKS]
    report = tmp_path / "report.json"
    result = run_python(str(GPU_CHECK), "--quick", "--report", str(report), timeout=300)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-3000:]
    lines = _lines(result.stdout)
    assert list(lines) == names, "one line per check, in order"
    has_deepspeed = importlib.util.find_spec("deepspeed") is not None
    for name, (status, seconds, budget, detail) in lines.items():
        if name in CUDA_ONLY:
            assert status == "SKIP" and "CUDA" in detail, (name, detail)
        elif name in DEEPSPEED and not has_deepspeed:
            assert status == "SKIP" and "DeepSpeed is not installed" in detail
        else:
            assert status == "PASS", (name, detail)
            # The checks that run on any device say which one they ran on.
            assert "cpu" in detail or name in ("environment", "fp8_error", "cli_test"), detail
        assert seconds <= budget, f"{name} took {seconds} s of its {budget} s"
    # Without CUDA the multi-process workers are rehearsed over gloo, each scenario compared.
    rehearsal = lines["multi_process"][3]
    assert "rehearsed on 2 CPU processes over gloo" in rehearsal
    assert all(f"{s} max|dw|" in rehearsal for s in ("ddp", "fsdp2", "tp2")), rehearsal
    statuses = [status for status, *_ in lines.values()]
    assert _summary(result.stdout) == (statuses.count("PASS"), 0, statuses.count("SKIP"))

    data = json.loads(report.read_text())
    assert data["mode"] == "quick"
    assert [c["name"] for c in data["checks"]] == names
    assert [c["status"] for c in data["checks"]] == statuses
    assert data["summary"] == {"passed": statuses.count("PASS"), "failed": 0,
                               "skipped": statuses.count("SKIP")}  # fmt: skip
    assert data["machine"]["gpus"] == [] and data["machine"]["torch"]
    assert set(data["budgets_s"]) == set(names)
    table = report.with_suffix(".md").read_text()
    assert all(f"| {name} | " in table for name in names)


def test_a_failing_check_gives_a_fail_line_and_a_non_zero_exit(tmp_path):
    report = tmp_path / "report.json"
    result = run_python(
        str(GPU_CHECK), "--quick", "--only", "environment", "fp8_error",
        "--inject", "fp8_error=fail", "--report", str(report), timeout=120,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    lines = _lines(result.stdout)
    assert lines["environment"][0] == "PASS"
    assert lines["fp8_error"][0] == "FAIL" and "failure injected" in lines["fp8_error"][3]
    assert _summary(result.stdout) == (1, 1, 0)
    failed = json.loads(report.read_text())["checks"][1]
    assert failed["status"] == "FAIL" and "AssertionError" in failed["traceback"]


def test_a_hanging_or_crashing_check_costs_only_itself(tmp_path):
    # A hang is stopped at the check's budget and a crash ends only its worker: the checks
    # after them still run, each in a fresh worker process.
    report = tmp_path / "report.json"
    result = run_python(
        str(GPU_CHECK), "--quick", "--only", "environment", "device_placement", "fp8_error",
        "--inject", "environment=hang", "--budget", "environment=3",
        "--inject", "device_placement=crash", "--report", str(report), timeout=180,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    lines = _lines(result.stdout)
    hang, crash, after = lines["environment"], lines["device_placement"], lines["fp8_error"]
    assert hang[0] == "FAIL" and "exceeded its budget of 3 s" in hang[3], hang
    assert 3 <= hang[1] < 30
    assert crash[0] == "FAIL" and "exit code 7" in crash[3], crash
    assert after[0] == "PASS", after
    assert _summary(result.stdout) == (1, 2, 0)


def test_out_of_time_checks_are_skipped_not_started(tmp_path):
    result = run_python(
        str(GPU_CHECK), "--quick", "--only", "environment", "--deadline", "5",
        "--report", str(tmp_path / "r.json"), timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    status, _, _, detail = _lines(result.stdout)["environment"]
    assert status == "SKIP" and "out of time" in detail


def test_listing_and_unknown_names_need_no_worker():
    listed = run_python(str(GPU_CHECK), "--list", timeout=60)
    assert listed.returncode == 0 and "zero3" in listed.stdout and "budgets in all" in listed.stdout
    wrong = run_python(str(GPU_CHECK), "--only", "zero4", timeout=60)
    assert wrong.returncode == 2 and "unknown check(s) zero4" in wrong.stderr
    assert "zero3" in wrong.stderr, "the error lists the checks"


def test_every_check_has_a_function_a_budget_and_a_group(monkeypatch):
    gpu_check = _load("gpu_check", monkeypatch)
    cases = _load("gpu_check_cases", monkeypatch)
    names = [check.name for check in gpu_check.CHECKS]
    functions = {n[len("check_") :] for n in vars(cases) if n.startswith("check_")}
    assert len(set(names)) == len(names) and set(names) == functions
    assert all(check.budget > 0 and check.group and check.proves for check in gpu_check.CHECKS)
    # One full run on one GPU must fit the device tool's 10-minute command: the run's own
    # deadline stops it before that whatever the budgets add up to.
    assert gpu_check.DEFAULT_DEADLINE + gpu_check.KILL_GRACE < 600


def test_the_suite_selection_on_a_gpu_names_existing_tests(monkeypatch):
    cases = _load("gpu_check_cases", monkeypatch)
    for selection in cases.SUITE_TESTS:
        path, _, test = selection.partition("::")
        assert (REPO / path).is_file(), selection
        if test:
            assert f"def {test}(" in Path(REPO / path).read_text(), selection


def test_the_markdown_table_has_a_row_per_check(monkeypatch):
    gpu_check = _load("gpu_check", monkeypatch)
    report = {
        "mode": "full",
        "started": "2026-12-01 00:00:00 UTC",
        "seconds": 300.0,
        "machine": {"torch": "2.11.0", "cuda": "13.0", "gpus": [
            {"name": "NVIDIA H200", "capability": "9.0", "memory_gib": 139.8}]},
        "summary": {"passed": 1, "failed": 0, "skipped": 1},
        "checks": [
            {"name": "fsdp2", "status": "PASS", "seconds": 2.0, "budget_s": 120, "detail": "a|b"},
            {"name": "fp8_training", "status": "SKIP", "seconds": 0.1, "budget_s": 90,
             "detail": "no torchao"},
        ],
    }  # fmt: skip
    text = gpu_check.markdown(report)
    assert "NVIDIA H200 (cc 9.0, 140 GiB); torch 2.11.0, CUDA 13.0" in text
    assert "| fsdp2 | PASS | 2.0 s (budget 120 s) | a/b |" in text
    assert "| fp8_training | SKIP |" in text


class _H200:
    name, major, minor, total_memory = "NVIDIA H200", 9, 0, 150_000_000_000


def test_what_a_one_gpu_machine_is_told(monkeypatch, tmp_path):
    # torch as on the lent machine (one H200), without touching a GPU: the decisions that
    # only happen there (the description, NCCL needing a GPU per rank, fp8's missing torchao).
    import torch

    cases = _load("gpu_check_cases", monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: _H200())
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 27, 3))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    machine = cases.machine_info()
    assert machine["gpus"] == [{"name": "NVIDIA H200", "capability": "9.0",
                                "memory_gib": pytest.approx(139.7, abs=0.1)}]  # fmt: skip
    assert "1 GPU(s): NVIDIA H200 (cc 9.0), CUDA 13.0, NCCL 2.27.3" in cases.describe(machine)
    context = cases.Context(quick=True, scratch=tmp_path)
    assert context.device == torch.device("cuda", 0) and context.gpus == 1
    with pytest.raises(cases.Skip, match="needs 2 GPUs: NCCL needs one GPU per rank"):
        cases.check_multi_process(context)
    if importlib.util.find_spec("torchao") is None:
        with pytest.raises(cases.Skip, match=r"torchao.*not a declared extra"):
            cases.check_fp8_training(context)
