"""tests/distributed.py: the processes the helpers start choose the CPU unless a test names
GPUs. On a machine with one GPU, two ranks that both see it would both take cuda:0 and NCCL
would refuse them; here the parent pretends to see a GPU and the children must not."""

from __future__ import annotations

import json
import os
from pathlib import Path

from tests.distributed import GPU_VARIABLE, device_environment, run_cli, run_distributed, run_python


def _what_this_rank_sees() -> dict:
    import torch

    from slipstream import Accelerator

    acc = Accelerator()
    return {
        "visible": os.environ.get(GPU_VARIABLE),
        "cuda": torch.cuda.is_available(),
        "device": str(acc.device),
        "backend": acc.state.backend,
    }


def _visible() -> str | None:
    return os.environ.get(GPU_VARIABLE)


def test_device_environment_hides_gpus_unless_the_test_names_them():
    assert device_environment() == {GPU_VARIABLE: ""}
    assert device_environment({"OMP_NUM_THREADS": "1"}) == {GPU_VARIABLE: ""}
    assert device_environment({GPU_VARIABLE: "0,1"}) == {}


def test_run_distributed_ranks_choose_the_cpu(monkeypatch):
    monkeypatch.setenv(GPU_VARIABLE, "0")  # as on a machine with one GPU
    expected = {"visible": "", "cuda": False, "device": "cpu", "backend": "gloo"}
    assert run_distributed(_what_this_rank_sees) == [expected, expected]
    # A test that asks for GPUs gets them (one per rank; only the variable is read here).
    assert run_distributed(_visible, env={GPU_VARIABLE: "0,1"}) == ["0,1", "0,1"]


def test_run_python_and_what_it_launches_choose_the_cpu(monkeypatch, tmp_path: Path):
    monkeypatch.setenv(GPU_VARIABLE, "0")
    code = f"import os; print(repr(os.environ.get({GPU_VARIABLE!r})))"
    assert run_python("-c", code).stdout.strip() == "''"
    assert run_python("-c", code, env={GPU_VARIABLE: "1"}).stdout.strip() == "'1'"
    # `slipstream launch -n 2` without --cpu, what a user's script gets under the suite.
    script = tmp_path / "where.py"
    script.write_text(
        "import json, os, sys\nimport torch\nfrom slipstream import Accelerator\n"
        "acc = Accelerator()\n"
        "out = {'visible': os.environ.get('CUDA_VISIBLE_DEVICES'), 'device': str(acc.device),\n"
        "       'type': acc.distributed_type.value}\n"
        "open(os.path.join(sys.argv[1], f'rank{acc.process_index}.json'), 'w').write("
        "json.dumps(out))\n"
    )
    result = run_cli("launch", "-n", "2", str(script), str(tmp_path))
    assert result.returncode == 0, result.stderr
    found = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert found == [{"visible": "", "device": "cpu", "type": "MULTI_CPU"}] * 2


def _parent_and_setting() -> tuple[int, str | None]:
    return os.getppid(), os.environ.get("FSSPEC_TEST_SETTING")


def test_a_changed_session_environment_gets_new_warm_workers_not_fresh_processes(monkeypatch):
    """A session fixture that sets a variable read at start-up (the S3 server's
    FSSPEC_S3_ENDPOINT_URL) must not turn every later test into fresh processes: the ranks are
    still forked from warm workers (not this process's children), which see the variable."""
    before = run_distributed(_parent_and_setting)
    monkeypatch.setenv("FSSPEC_TEST_SETTING", "on")
    after = run_distributed(_parent_and_setting)
    assert all(parent != os.getpid() for parent, _ in before + after)
    assert [setting for _, setting in before] == [None, None]
    assert [setting for _, setting in after] == ["on", "on"]
    # A call's own start-up variable still gets fresh processes (children of this process).
    fresh = run_distributed(_parent_and_setting, env={"FSSPEC_TEST_SETTING": "call"})
    assert fresh == [(os.getpid(), "call")] * 2
