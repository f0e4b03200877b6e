"""The same save_state/load_state calls on local paths, file://, memory:// and s3:// (moto)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from slipstream import Accelerator
from slipstream.checkpoint import Storage, StorageError
from tests.distributed import run_distributed


def _round_trip(url: str) -> dict:
    acc = Accelerator()
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = acc.prepare(model, optimizer)
    acc.backward(model(torch.ones(1, 3)).sum())
    optimizer.step()
    saved = acc.unwrap_model(model).weight.detach().clone()
    location = acc.save_state(url)
    with torch.no_grad():
        acc.unwrap_model(model).weight.zero_()
    optimizer.state.clear()
    acc.load_state(url)
    return {
        "location": location,
        "restored": torch.equal(acc.unwrap_model(model).weight, saved),
        "momentum": bool(optimizer.state),
    }


@pytest.mark.parametrize("scheme", ["path", "file", "memory"])
def test_round_trip_on_local_and_memory_storage(tmp_path, scheme):
    url = {
        "path": str(tmp_path / "ckpt"),
        "file": f"file://{tmp_path}/ckpt",
        "memory": f"memory://{tmp_path.name}/ckpt",
    }[scheme]
    result = _round_trip(url)
    assert result["restored"] and result["momentum"]


def test_round_trip_on_s3(s3_bucket):
    result = _round_trip(f"{s3_bucket}/runs/ckpt")
    assert result["restored"] and result["location"] == f"{s3_bucket}/runs/ckpt"
    storage = Storage.for_url(f"{s3_bucket}/runs/ckpt")
    assert "checkpoint.json" in storage.listdir(storage.root)


def test_two_processes_share_an_s3_checkpoint(s3_bucket, s3_environment):
    results = run_distributed(_round_trip, f"{s3_bucket}/shared", env=s3_environment)
    assert all(r["restored"] for r in results)
    listing = Storage.for_url(f"{s3_bucket}/shared").listdir(f"{s3_bucket[5:]}/shared")
    assert {"random_states_0.pkl", "random_states_1.pkl", "model.safetensors"} <= set(listing)


def test_overwriting_an_s3_checkpoint_replaces_it(s3_bucket):
    url = f"{s3_bucket}/again"
    _round_trip(url)
    assert _round_trip(url)["restored"]


def test_unknown_protocol_is_a_clear_error():
    with pytest.raises(StorageError, match="cannot open 'nosuchfs://x'"):
        Storage.for_url("nosuchfs://x")
