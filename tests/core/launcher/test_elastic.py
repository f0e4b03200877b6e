"""Elastic sizes: ``slipstream launch --nnodes MIN:MAX`` with launchers on this machine
standing in for machines. One is killed (the job continues on fewer processes from its
latest checkpoint), another joins (the job grows), and the weights match runs that resumed
from the same checkpoints at those sizes. With DDP, and with FSDP2 whose sharded
checkpoints load resharded at each new size."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from slipstream.launcher.config import ConfigError, LaunchConfig, config_from_dict
from slipstream.launcher.elastic import elastic_settings, parse_nnodes
from slipstream.launcher.launch import LaunchRequest, torchrun_arguments
from slipstream.optim.elastic import elastic_accumulation_steps, resumed_micro_steps
from tests.distributed import REPO, device_environment, free_port, run_cli_here

#: Starts its own processes for every test: left out of `pytest -m "not slow"`.
pytestmark = pytest.mark.slow

SCRIPT = Path(__file__).with_name("elastic_train.py")
#: Fast rendezvous for the test: a lost launcher is dropped after 5 s without a heartbeat
#: (one a second; fewer seconds drop live ones on a busy machine),
#: and the rendezvous closes 1 s after its minimum is reached.
RDZV_CONF = "last_call_timeout=1,keep_alive_interval=1,keep_alive_max_attempt=5,join_timeout=60"
STEPS = 9


def _events(project: Path) -> list[dict[str, object]]:
    log = project / "log.jsonl"
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.strip()]


def _wait_for(
    project: Path, launchers: list[subprocess.Popen[str]], timeout: float, **match: object
) -> dict[str, object]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for event in _events(project):
            if all(event.get(k) == v for k, v in match.items()):
                return event
        for launcher in launchers:
            if launcher.poll() is not None and launcher.returncode != 0:
                said = Path(str(launcher.args)).read_text()[-3000:]
                raise AssertionError(f"a launcher failed ({launcher.returncode}): {said}")
        time.sleep(0.1)
    raise AssertionError(f"no event {match} within {timeout} s; log: {_events(project)}")


def _environment() -> dict[str, str]:
    variables = {k: v for k, v in os.environ.items() if not k.startswith("SLIPSTREAM_")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        variables.pop(key, None)
    return {**variables, **device_environment(), "OMP_NUM_THREADS": "1"}


#: The layouts the job runs with: DDP, and FSDP2 with sharded (DCP) checkpoints that load
#: resharded at the new size.
LAYOUTS = {
    "ddp": [],
    "fsdp2": ["--use_fsdp", "--fsdp_state_dict_type", "SHARDED_STATE_DICT"],
}


def _launcher(
    port: int, project: Path, budget: Path, host: bool, layout: list[str]
) -> subprocess.Popen[str]:
    """One "machine": a launcher of one process. Its output goes to a file (a pipe nobody
    reads would stall it once full)."""
    command = [
        sys.executable, "-m", "slipstream.cli", "launch", "--cpu", "--nnodes", "1:2",
        "--nproc_per_node", "1", "--machine_rank", "0" if host else "1", "--rdzv_endpoint",
        f"127.0.0.1:{port}", "--max_restarts", "3", "--rdzv_conf", RDZV_CONF,
        "--monitor_interval", "0.2", *layout, str(SCRIPT), str(project), str(budget),
    ]  # fmt: skip
    output = open(project.parent / f"launcher-{time.monotonic_ns()}.log", "w")  # noqa: SIM115
    launcher = subprocess.Popen(
        command, cwd=REPO, env=_environment(), stdout=output, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    )  # fmt: skip
    launcher.args = output.name  # where _wait_for finds what it said
    return launcher


def _resume_at(
    project: Path, source: Path, step: int, processes: int, until: int, layout: list[str]
) -> subprocess.Popen[str]:
    """A plain (not elastic) run on ``processes`` that resumes from ``source``'s checkpoint
    of ``step`` and trains until step ``until``."""
    checkpoints = project / "checkpoints"
    checkpoints.mkdir(parents=True)
    shutil.copytree(
        source / "checkpoints" / f"checkpoint_{step - 1}", checkpoints / f"checkpoint_{step - 1}"
    )
    (project / "budget").write_text(str(until))
    command = [
        sys.executable, "-m", "slipstream.cli", "launch", "--cpu", "-n", str(processes),
        *layout, str(SCRIPT), str(project), str(project / "budget"),
    ]  # fmt: skip
    env = {**_environment(), "ELASTIC_TEST_STEPS": str(until)}
    return subprocess.Popen(
        command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", LAYOUTS)
def test_a_lost_machine_shrinks_the_job_and_a_new_one_grows_it(tmp_path: Path, name: str):
    project, budget, port = tmp_path / "elastic", tmp_path / "budget", free_port()
    layout = LAYOUTS[name]
    project.mkdir()
    # No step until the job runs on both machines: the rendezvous settles 1 s
    # (last_call_timeout) after the first machine joins, and on a busy machine the other
    # launcher can miss that first round (it then asks to join, and the job grows to 2
    # before its first step). The joining machine starts first and waits for the host's
    # store (the endpoint), which makes that rare.
    budget.write_text("0")
    joining = _launcher(port, project, budget, host=False, layout=layout)
    time.sleep(2.0)
    launchers = [_launcher(port, project, budget, host=True, layout=layout), joining]
    started = time.monotonic()
    try:
        _wait_for(project, launchers, 90, event="start", step=0, world=2)
        budget.write_text("3")
        _wait_for(project, launchers, 90, event="step", step=3, world=2)
        lost = time.monotonic()
        os.kill(launchers[1].pid, signal.SIGKILL)  # a machine is lost; its worker follows
        shrunk = _wait_for(project, launchers[:1], 90, event="start", world=1, step=3)
        resized = time.monotonic() - lost
        assert shrunk["step"] == 3 and shrunk["accumulation"] == 2  # global batch kept
        budget.write_text("6")
        _wait_for(project, launchers[:1], 60, event="step", step=6, world=1)
        # A machine joins.
        launchers.append(_launcher(port, project, budget, host=False, layout=layout))
        grown = _wait_for(project, [launchers[0], launchers[2]], 90, event="start", world=2, step=6)
        assert grown["accumulation"] == 1
        budget.write_text(str(STEPS))
        for launcher in (launchers[0], launchers[2]):
            launcher.wait(timeout=90)
            assert launcher.returncode == 0, Path(str(launcher.args)).read_text()[-3000:]
        print(f"elastic job: lost machine -> resumed at 1 process in {resized:.1f} s; "
              f"total {time.monotonic() - started:.1f} s")  # fmt: skip
    finally:
        for launcher in launchers:
            if launcher.poll() is None:
                os.kill(launcher.pid, signal.SIGKILL)
                launcher.wait()
    events = _events(project)
    steps = [(e["step"], e["world"]) for e in events if e["event"] == "step"]
    assert steps == [(1, 2), (2, 2), (3, 2), (4, 1), (5, 1), (6, 1), (7, 2), (8, 2), (9, 2)]
    # What the user of the surviving machine read: each change once, in plain words (and no
    # raw UserWarning about the new process's random state).
    said = Path(str(launchers[0].args)).read_text()
    joined = Path(str(launchers[2].args)).read_text()  # its worker may be rank 0 at the end
    lines = [
        line
        for line in [*said.splitlines(), *joined.splitlines()]
        if line.startswith("slipstream launch: ")
    ]
    # The agent's lines come from the surviving launcher in order; each resume line from the
    # launcher of that round's rank 0.
    resumes = [line for line in lines if "resumed from" in line]
    changes = [line for line in lines if "resumed from" not in line]
    # (From the loss on: before it the job may have grown to 2 once, before any step.)
    lost_at = next((i for i, line in enumerate(changes) if " failed (" in line), 0)
    lines = changes[lost_at : lost_at + 4] + resumes
    expected = [
        # (The surviving machine's worker: rank 1 when the joining machine met first.)
        r"rank [01] failed \(.+\) at step 3; restart 1/3: the workers meet again; a lost machine "
        r"is dropped after 5 s without heartbeats \(keep_alive_interval 1 s x "
        r"keep_alive_max_attempt 5\), and the new size is settled 1 s \(last_call_timeout\) "
        r"after the fewest machines are there",
        r"the job now runs on 1 machine\(s\), 1 process\(es\) \(was 2, 2\), \d+ s after the workers stopped",
        r"a machine asks to join: the workers stop and meet again at the larger size \(no "
        r"restart is used up\)",
        r"the job now runs on 2 machine\(s\), 2 process\(es\) \(was 1, 1\), \d+ s after the workers stopped",
        r"resumed from .+checkpoint_2 at step 3: saved by 2 process\(es\), now 1; gradient "
        r"accumulation 2 \(was 1\) keeps the global batch",
        r"resumed from .+checkpoint_5 at step 6: saved by 1 process\(es\), now 2; gradient "
        r"accumulation 1 \(was 2\) keeps the global batch; process\(es\) 1 had no RNG state in "
        r"it and keep their own",
    ]
    assert len(lines) == len(expected), said[-4000:]
    for line, pattern in zip(lines, expected, strict=True):
        assert re.fullmatch("slipstream launch: " + pattern, line), (line, pattern)
    assert "UserWarning" not in said + joined, (said + joined)[-4000:]
    # References: plain runs that resumed from the same checkpoints. From step 3 on two
    # processes (accumulation 1): the same global batches as the one process (accumulation
    # 2) of the elastic job; from step 6 on two processes: the elastic job's end, bitwise.
    first = _resume_at(tmp_path / "ref3", project, 3, 2, 6, layout)
    second = _resume_at(tmp_path / "ref6", project, 6, 2, STEPS, layout)
    for reference in (first, second):
        _, err = reference.communicate(timeout=120)
        assert reference.returncode == 0, err[-3000:]
    shrunk_weights = torch.load(project / "weights_6.pt")
    for name, value in torch.load(tmp_path / "ref3" / "weights_6.pt").items():
        torch.testing.assert_close(shrunk_weights[name], value, rtol=1e-6, atol=1e-7)
    final = torch.load(project / f"weights_{STEPS}.pt")
    for name, value in torch.load(tmp_path / "ref6" / f"weights_{STEPS}.pt").items():
        assert torch.equal(final[name], value), name


ELASTIC = {
    "num_machines": 3, "min_machines": 1, "num_processes": 3, "main_process_ip": "127.0.0.1",
    "main_process_port": 29400, "distributed_type": "MULTI_CPU", "use_cpu": True,
    "gradient_accumulation_steps": 2,
}  # fmt: skip


def test_the_elastic_torchrun_command_and_worker_settings():
    config, _ = config_from_dict({**ELASTIC, "rdzv_conf": "last_call_timeout=5"})
    flags = torchrun_arguments(LaunchRequest(config, "t.py"))
    assert "--nnodes=1:3" in flags and "--nproc_per_node=1" in flags
    assert "--rdzv_conf=is_host=true,last_call_timeout=5" in flags
    assert "--standalone" not in flags and "--nnodes=3" not in flags
    other = torchrun_arguments(LaunchRequest(config.replace(machine_rank=2), "t.py"))
    assert "--rdzv_conf=is_host=false,last_call_timeout=5" in other
    assert config.worker_settings()["elastic"] == elastic_settings(config)
    assert elastic_settings(config) == {
        "batch": "global", "reference_world_size": 3, "min_machines": 1, "max_machines": 3,
    }  # fmt: skip
    assert LaunchConfig().worker_settings()["elastic"] is None
    assert parse_nnodes("2") == (2, 2) and parse_nnodes("1:4") == (1, 4)


def test_the_global_batch_is_kept_by_accumulation():
    assert elastic_accumulation_steps(2, world_size=2, reference_world_size=3) == 3
    assert elastic_accumulation_steps(1, world_size=4, reference_world_size=4) == 1
    with pytest.raises(ValueError, match="elastic_batch: per_process"):
        elastic_accumulation_steps(1, world_size=2, reference_world_size=3)
    # An epoch's micro-steps follow the samples: 4 on 2 processes are 8 on 1.
    assert resumed_micro_steps(4, 2, 1) == 8 and resumed_micro_steps(4, 1, 2) == 2
    assert resumed_micro_steps(3, 1, 2) == 3 and resumed_micro_steps(5, None, 2) == 5


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"gradient_accumulation_steps": 1}, "gradient_accumulation_steps to be a multiple of 2"),
        ({"gradient_accumulation_steps": 3}, "(e.g. 4)"),
        ({"rdzv_backend": "static"}, "needs rdzv_backend: c10d"),
        ({"distributed_type": "DEEPSPEED"}, "DeepSpeed's ZeRO checkpoints do not"),
        ({"elastic_batch": "both"}, "elastic_batch must be one of global, per_process"),
        ({"min_machines": 4}, "min_machines (4) must be between 1 and num_machines (3)"),
        (
            {"elastic_batch": "per_process", "num_machines": 4, "min_machines": 2,
             "num_processes": 4, "distributed_type": "FSDP",
             "parallelism_config": {"parallelism_config_tp_size": 2}},
            "runs on 2, 3, 4 processes, but the parallelism_config layout does not fit 3",
        ),
        (
            {"elastic_batch": "per_process", "num_processes": 6, "distributed_type": "FSDP",
             "parallelism_config": {"parallelism_config_tp_size": 2,
                                    "parallelism_config_dp_shard_size": 3}},
            "parallelism_config",
        ),
    ],
)  # fmt: skip
def test_sizes_that_cannot_work_at_every_size_are_refused(changes: dict, message: str):
    with pytest.raises(ConfigError, match=re.escape(message)):
        config_from_dict({**ELASTIC, **changes})


def test_layouts_and_batches_that_divide_at_every_size_are_accepted():
    config, _ = config_from_dict({**ELASTIC, "gradient_accumulation_steps": 4})
    assert config.min_machines == 1
    layout = {"parallelism_config_tp_size": 2, "parallelism_config_dp_shard_size": -1}
    config_from_dict(
        {**ELASTIC, "num_processes": 6, "distributed_type": "FSDP", "parallelism_config": layout,
         "elastic_batch": "per_process"}
    )  # fmt: skip


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--nnodes", "3:2"], "--nnodes 3:2: MIN (3) is larger than MAX (2)"),
        (["--nnodes", "1:x"], "--nnodes 1:x: give a number of machines"),
        (["--nnodes", "1:2", "--rdzv_endpoint", "nohost"], "--rdzv_endpoint nohost: give HOST"),
    ],
)
def test_bad_nnodes_flags_name_what_to_change(tmp_path: Path, flags: list[str], message: str):
    script = tmp_path / "t.py"
    script.write_text("raise SystemExit('should not run')\n")
    result = run_cli_here("launch", "--cpu", *flags, str(script))
    assert result.returncode == 2 and message in result.stderr, result.stderr
