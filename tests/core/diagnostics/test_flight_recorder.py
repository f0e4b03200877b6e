"""torch's Flight Recorder, as the hang report reads it: on gloo here, on NCCL where there
are GPUs (skipped without two)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from slipstream.diagnostics.flight_recorder import read_flight_recorder
from slipstream.diagnostics.stacks import thread_stack, user_frame
from slipstream.runtime.flight import COLLECTIVES, describe_data
from tests.distributed import run_distributed


def _record(backend: str) -> dict:
    import torch.distributed as dist

    from slipstream import Accelerator

    accelerator = Accelerator(cpu=backend == "gloo")
    tensor = torch.ones(3, 4, device=accelerator.device)
    accelerator.reduce(tensor)  # the line the record names
    dist.all_reduce(tensor)
    time.sleep(0.2)  # gloo marks a finished collective retired a moment after it returns
    recorded = read_flight_recorder()
    assert recorded is not None
    return {"recorded": recorded, "own": COLLECTIVES.to_list()}


def _reduce_line() -> int:
    lines = Path(__file__).read_text().splitlines()
    return next(
        i for i, line in enumerate(lines, 1) if line.endswith("# the line the record names")
    )


def _check(result: dict) -> None:
    entries = result["recorded"]["entries"]
    assert [e["op"] for e in entries[-2:]] == ["all_reduce", "all_reduce"]
    assert [e["sizes"] for e in entries[-2:]] == [[[3, 4]], [[3, 4]]]
    seqs = [e["seq"] for e in entries if e["group"] == entries[-1]["group"]]
    assert seqs == sorted(seqs) and not any(e["pending"] for e in entries)
    assert entries[-2]["site"].endswith(f"test_flight_recorder.py:{_reduce_line()}")
    assert result["recorded"]["status"][entries[-1]["group"]]["enqueued"] == seqs[-1]
    own = result["own"][-1]
    assert own["op"] == "reduce" and own["data"] == "float32[3, 4]" and not own["pending"]
    assert own["site"].endswith(f"test_flight_recorder.py:{_reduce_line()}")


def test_gloo_collectives_are_recorded():
    for result in run_distributed(_record, "gloo"):
        _check(result)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL needs a CUDA GPU")
def test_nccl_collectives_are_recorded():  # pragma: no cover - GPU machines
    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL needs a GPU per process: 2 GPUs")
    for result in run_distributed(_record, "nccl", env={"CUDA_VISIBLE_DEVICES": "0,1"}):
        _check(result)


def test_the_user_frame_is_the_scripts():
    frames = thread_stack(limit=200)
    assert user_frame(frames)["file"] == __file__
    assert describe_data(torch.zeros(2, dtype=torch.int64)) == "int64[2]"
    assert describe_data({"a": 1}) == "dict(1)"
