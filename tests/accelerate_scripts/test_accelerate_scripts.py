"""The drop-in promise, measured with code no one here wrote: the distributed test scripts
that ship inside the installed accelerate package, their imports rewritten by
``slipstream migrate`` (never their assertions), each run on 2 CPU processes under slipstream.

Every test function a script's entry point calls must pass on every process, except the
calls listed in EXPECTED_FAILURES, each with the reason (docs/compatibility.md says the same
and names the slipstream test that shows the intended behaviour). The report of every call
is printed (``pytest -s``) and attached to a failure.
"""

from __future__ import annotations

import ast
import json
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from slipstream.compatibility import CPU_ADAPTATIONS, SCRIPT_DIFFERENCES
from tests.accelerate_peer import accelerate_package, migrate, print_report
from tests.distributed import run_python

from .driver import called_functions

#: Starts its own processes for every test: left out of `pytest -m "not slow"`.
pytestmark = pytest.mark.slow

_package = accelerate_package()
if _package is None:  # pragma: no cover - accelerate is a test dependency
    pytest.skip("accelerate is not installed", allow_module_level=True)
SCRIPTS = _package / "test_utils" / "scripts"
DRIVER = Path(__file__).with_name("driver.py")

#: Script -> how it runs: launched on 2 processes (with main()'s GPU-only calls as extras),
#: or started as one process that launches its own (``notebook``).
RUNS = {
    "test_script.py": "launch",
    "test_sync.py": "launch+extras",
    "test_ops.py": "launch",
    "test_distributed_data_loop.py": "launch",
    "external_deps/test_metrics.py": "launch+extras",
    "test_notebook.py": "notebook",
    "test_cli.py": "launch",
    "test_merge_weights.py": "launch",
    "test_ddp_comm_hook.py": "launch",
}

#: The script imports these at the top for test_mrpc only, which needs the network (GLUE
#: data and a model download) and runs on GPUs only: empty stand-ins let the rest run.
STAND_INS = {
    "datasets": (
        "import types\n"
        "_quiet = lambda: None\n"
        "utils = types.SimpleNamespace(logging=types.SimpleNamespace(\n"
        "    set_verbosity_warning=_quiet, set_verbosity_error=_quiet))\n"
        "load_dataset = None\n"
    ),
    "evaluate": "load = None\n",
}
NEEDS_STAND_INS = {"external_deps/test_metrics.py"}

#: (script, function or one call of it) -> why it fails under slipstream too; the same
#: table renders docs/compatibility.md, with the slipstream test for each.
EXPECTED_FAILURES = SCRIPT_DIFFERENCES


def _expected(script: str, record: dict[str, Any]) -> bool:
    keys = {(script, record["call"]), (script, record["function"])}
    return bool(keys & set(EXPECTED_FAILURES))


def _functions(script: str) -> list[str]:
    names = called_functions(ast.parse((SCRIPTS / script).read_text()))
    return ["<entry point>", *names]


@pytest.fixture(scope="module")
def migrated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The scripts copied, migrated by ``slipstream migrate`` and adapted for the CPU."""
    folder = tmp_path_factory.mktemp("accelerate_scripts")
    for script in RUNS:
        target = folder / script
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(SCRIPTS / script, target)
    report = migrate(folder)
    for script, changes in CPU_ADAPTATIONS.items():
        path = folder / script
        text = path.read_text()
        for before, after, _why in changes:
            assert before in text, f"{script}: the adapted lines changed upstream"
            text = text.replace(before, after)
        path.write_text(text)
    stand_ins = folder / "_stand_ins"
    stand_ins.mkdir()
    for name, body in STAND_INS.items():
        (stand_ins / f"{name}.py").write_text(body)
    return {"folder": folder, "report": report, "stand_ins": stand_ins}


_results: dict[str, dict[str, list[dict[str, Any]]]] = {}


def _run(script: str, migrated: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Per function name, every call's record from every process (run once per script)."""
    if script in _results:
        return _results[script]
    folder: Path = migrated["folder"]
    reports = folder / f"report_{script.replace('/', '_')}"
    reports.mkdir()
    how = RUNS[script]
    target = folder / script
    if how == "notebook":
        command = [sys.executable, str(DRIVER), str(target), str(reports)]
    else:
        command = [
            sys.executable, "-m", "slipstream.cli", "launch", "--num_processes", "2", "--cpu",
            str(DRIVER), str(target), str(reports), *(["--extras"] if "extras" in how else []),
        ]  # fmt: skip
    env = {
        "ACCELERATE_NUM_PROCESSES": "2",  # test_notebook's process count
        "OMP_NUM_THREADS": "1",
    }
    if script in NEEDS_STAND_INS:
        env["PYTHONPATH"] = str(migrated["stand_ins"])
    done = run_python(*command[1:], env=env, cwd=folder, timeout=600)
    by_function: dict[str, list[dict[str, Any]]] = {}
    ranks = sorted(reports.glob("rank*.jsonl"))
    for report in ranks:
        for line in report.read_text().splitlines():
            record = json.loads(line)
            record["rank"] = report.stem
            by_function.setdefault(record["function"], []).append(record)
    if not ranks or done.returncode != 0:
        by_function.setdefault("<entry point>", []).append(
            {
                "function": "<entry point>",
                "call": "<process>",
                "passed": False,
                "error": f"exit code {done.returncode}: {done.stderr[-2000:]}",
                "rank": "launcher",
            }
        )
    _results[script] = by_function
    print_report(
        script,
        (
            (r["rank"], r["call"], "PASS" if r["passed"] else f"FAIL {r.get('error', '')}")
            for records in by_function.values()
            for r in records
        ),
    )
    return by_function


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("script", "function"),
    [(script, function) for script in RUNS for function in _functions(script)],
)
def test_accelerate_script_function(script: str, function: str, migrated: dict[str, Any]):
    results = _run(script, migrated)
    broken = [r for r in results.get("<import>", []) if not r["passed"]]
    assert not broken, f"{script} does not import under slipstream: {broken[0]['error']}"
    records = results.get(function)
    if records is None:
        ending = [r for r in results.get("<entry point>", []) if not r["passed"]]
        assert not ending, f"{function} was not reached: {ending[0]['error']}"
        pytest.skip(
            f"{script}'s entry point did not call {function} on CPU processes (it does on "
            "GPUs or TPUs, or with an optional library such as datasets installed)"
        )
    failures = [r for r in records if not r["passed"] and not _expected(script, r)]
    shown = "\n".join(
        f"{r['rank']} {r['call']}: {r.get('error')} ({r.get('where', '')})" for r in failures
    )
    assert not failures, f"{script} {function} failed under slipstream:\n{shown}"
    now_passing = {r["call"] for r in records if r["passed"] and _expected(script, r)}
    assert not now_passing, (
        f"{sorted(now_passing)} pass now: remove them from EXPECTED_FAILURES and "
        "docs/compatibility.md"
    )
