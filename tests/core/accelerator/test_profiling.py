"""accelerator.profile: a real torch.profiler run, one Chrome trace per process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from slipstream import Accelerator
from slipstream.options.kwargs import ProfileKwargs
from tests.distributed import run_distributed


def test_profile_records_operators_and_shapes() -> None:
    accelerator = Accelerator(cpu=True)
    handler = ProfileKwargs(activities=["cpu"], record_shapes=True, profile_memory=True)
    with accelerator.profile(handler) as profiler:
        torch.randn(8, 16) @ torch.randn(16, 4)
    names = {event.key for event in profiler.key_averages()}
    assert "aten::mm" in names
    shapes = {str(e.input_shapes) for e in profiler.key_averages(group_by_input_shape=True)}
    assert any("[8, 16]" in shape for shape in shapes)


def test_profile_schedule_and_handler_from_kwargs_handlers() -> None:
    handler = ProfileKwargs(
        activities=["cpu"], schedule_option={"wait": 1, "warmup": 1, "active": 2}
    )
    accelerator = Accelerator(cpu=True, kwargs_handlers=[handler])
    steps = []
    with accelerator.profile() as profiler:
        for step in range(4):
            torch.ones(4) + step
            steps.append(profiler.step_num)
            profiler.step()
    assert steps == [0, 1, 2, 3]


def test_unknown_activity_is_named() -> None:
    with pytest.raises(ValueError, match=r"unknown profiler activities.*'gpu'"):
        ProfileKwargs(activities=["gpu"]).build()


def _profile_to(folder: str) -> list[str]:
    accelerator = Accelerator()
    with accelerator.profile(ProfileKwargs(activities=["cpu"], output_trace_dir=folder)):
        torch.randn(4, 4) @ torch.randn(4, 4)
    return sorted(p.name for p in Path(folder).iterdir())


def test_every_process_writes_its_trace(tmp_path: Path) -> None:
    listings = run_distributed(_profile_to, str(tmp_path / "traces"))
    assert listings[0] == listings[1] == ["profile_0.json", "profile_1.json"]
    trace = json.loads((tmp_path / "traces" / "profile_1.json").read_text())
    assert any(event.get("name") == "aten::mm" for event in trace["traceEvents"])
