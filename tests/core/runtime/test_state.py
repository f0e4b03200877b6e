"""ProcessState: joining one process group, device choice and the collective timeout."""

from __future__ import annotations

import time
from datetime import timedelta

import torch

from slipstream import Accelerator, InitProcessGroupKwargs, ProcessState
from slipstream.runtime.errors import CollectiveTimeoutError
from slipstream.runtime.state import DistributedType, default_backend, select_device
from tests.distributed import run_distributed


def test_single_process_state_without_launcher():
    state = ProcessState.from_environment(environ={})
    assert (state.num_processes, state.process_index, state.backend) == (1, 0, None)
    assert state.is_main_process and state.is_last_process and state.is_local_main_process
    assert state.distributed_type is DistributedType.NO
    state.wait_for_everyone()  # no-op, no process group


def test_device_and_backend_choice():
    assert select_device(0, 2, cpu=True) == torch.device("cpu")
    assert default_backend(torch.device("cpu")) == "gloo"
    assert default_backend(torch.device("cuda", 0)) == "nccl"


def _group_facts() -> dict:
    import torch.distributed as dist

    acc = Accelerator()
    return {
        "initialized": dist.is_initialized(),
        "backend": dist.get_backend(),
        "world": dist.get_world_size(),
        "state": (acc.state.process_index, acc.state.num_processes, acc.state.backend),
        "same_state": Accelerator().state is acc.state,
    }


def test_world_size_two_on_cpu_forms_one_gloo_group():
    r0, r1 = run_distributed(_group_facts)
    assert r0["initialized"] and r0["backend"] == "gloo" and r0["world"] == 2
    assert r0["state"] == (0, 2, "gloo") and r1["state"] == (1, 2, "gloo")
    assert r0["same_state"], "a second Accelerator joins the existing state"


def _barrier_with_short_timeout() -> dict:
    # hang_timeout=0: the watchdog would end the job (exit 86, tests/core/diagnostics) before
    # the late process returns; this test is about the error the waiting process gets.
    acc = Accelerator(
        hang_timeout=0, kwargs_handlers=[InitProcessGroupKwargs(timeout=timedelta(seconds=2))]
    )
    if acc.process_index == 1:
        time.sleep(6)  # never reaches the barrier in time
        return {}
    start = time.monotonic()
    try:
        acc.wait_for_everyone()
    except CollectiveTimeoutError as error:
        return {"error": str(error), "elapsed": time.monotonic() - start}
    return {"error": None}


def test_collectives_time_out_instead_of_hanging():
    r0, _ = run_distributed(_barrier_with_short_timeout, timeout=60)
    assert r0["error"] is not None and r0["elapsed"] < 5.5
    assert "collective 'wait_for_everyone' on process 0 timed out" in r0["error"]
    assert "--debug" in r0["error"]
