"""PartialState: the process state without an Accelerator, on one and on two processes."""

from __future__ import annotations

import time

from slipstream import Accelerator, DistributedType, PartialState, gather_object
from tests.distributed import run_distributed


def test_one_process():
    state = PartialState()
    assert (state.num_processes, state.process_index, state.is_main_process) == (1, 0, True)
    assert state.distributed_type == DistributedType.NO and state.device.type == "cpu"
    assert state.default_device == state.device and state.initialized
    with state.split_between_processes([1, 2, 3]) as mine:
        assert mine == [1, 2, 3]
    assert PartialState().state is state.state, "one shared process state"
    assert Accelerator().state is state.state, "an Accelerator joins it too"
    assert "num_processes=1" in repr(state)


def _two_processes() -> dict:
    state = PartialState()
    order = []
    with state.main_process_first():
        if state.is_main_process:
            time.sleep(0.3)  # without the ordering the other process would be first
        order.append((state.process_index, time.monotonic()))
    prompts = [f"prompt {i}" for i in range(5)]
    with state.split_between_processes(prompts) as mine:
        answers = [p.upper() for p in mine]
    with state.split_between_processes(prompts, apply_padding=True) as padded:
        lengths = len(padded)
    everything = gather_object(answers)
    stamps = gather_object(order)

    @state.on_main_process
    def main_only() -> str:
        return "main"

    state.wait_for_everyone()
    return {
        "type": state.distributed_type.value,
        "mine": mine,
        "everything": everything,
        "padded": lengths,
        "stamps": stamps,
        "main_only": main_only(),
        "same_as_accelerator": Accelerator().state is state.state,
    }


def test_two_processes_split_gather_and_take_turns():
    first, second = run_distributed(_two_processes)
    assert first["type"] == "MULTI_CPU"
    assert first["mine"] == ["prompt 0", "prompt 1", "prompt 2"]
    assert second["mine"] == ["prompt 3", "prompt 4"]
    assert first["everything"] == [f"PROMPT {i}" for i in range(5)], "in prompt order"
    assert first["padded"] == second["padded"] == 3
    (main, main_time), (_, other_time) = first["stamps"]
    assert main == 0 and main_time <= other_time, "the main process went first"
    assert (first["main_only"], second["main_only"]) == ("main", None)
    assert first["same_as_accelerator"] and second["same_as_accelerator"]


def _debug_switch() -> dict:
    import torch

    from slipstream import DistributedOperationException, pad_across_processes, reduce

    state = PartialState()
    state.debug = True  # Accelerate's switch for the collective checks
    shape = (1, 5) if state.process_index == 0 else (1, 1, 6)
    errors = []
    for operation in (
        lambda: pad_across_processes(torch.zeros(shape)),
        lambda: reduce(torch.zeros(shape)),
    ):
        try:
            operation()
        except DistributedOperationException as error:
            errors.append(type(error).__name__)
    state.debug = False
    return {"errors": errors, "checks_off": not Accelerator().state.debug}


def test_partial_state_debug_turns_on_collective_checks():
    for seen in run_distributed(_debug_switch):
        assert seen["errors"] == ["CollectiveMismatchError"] * 2
        assert seen["checks_off"]
