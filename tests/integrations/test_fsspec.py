"""The fsspec adapter: single-file checkpoints and weights on local, memory:// and s3://."""

from __future__ import annotations

import os

import pytest
import torch

from slipstream.integrations.fsspec import FsspecCheckpointIO, load_weights, save_weights


@pytest.fixture(params=["local", "memory", "s3"])
def base_url(request, tmp_path):
    if request.param == "local":
        return str(tmp_path)
    if request.param == "memory":
        return f"memory://{tmp_path.name}"
    return request.getfixturevalue("s3_bucket")


def test_checkpoint_round_trip_and_remove(base_url):
    io = FsspecCheckpointIO()
    checkpoint = {"state_dict": {"w": torch.arange(4.0)}, "epoch": 3, "name": "run"}
    path = f"{base_url}/ckpts/last.ckpt"
    io.save_checkpoint(checkpoint, path)
    loaded = io.load_checkpoint(path)
    assert torch.equal(loaded["state_dict"]["w"], checkpoint["state_dict"]["w"])
    assert loaded["epoch"] == 3 and loaded["name"] == "run"
    io.remove_checkpoint(path)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        io.load_checkpoint(path)


def test_sharded_weights_on_any_url(base_url):
    state = {f"layer{i}": torch.full((64,), float(i)) for i in range(3)}
    names = save_weights(state, f"{base_url}/weights", max_shard_size=300, dtype=torch.bfloat16)
    assert names[-1] == "model.safetensors.index.json"
    loaded = load_weights(f"{base_url}/weights")
    assert all(loaded[k].dtype == torch.bfloat16 and loaded[k][0] == i for i, k in enumerate(state))


def test_local_save_leaves_no_temporary_files(tmp_path):
    FsspecCheckpointIO().save_checkpoint({"a": 1}, str(tmp_path / "x.ckpt"))
    assert os.listdir(tmp_path) == ["x.ckpt"]


class Custom:
    """Not in torch's weights_only allow-list."""


def test_unsafe_objects_need_an_explicit_opt_out(tmp_path):
    path = str(tmp_path / "odd.ckpt")
    torch.save({"obj": Custom()}, path)
    with pytest.raises(ValueError, match="weights_only=False"):
        FsspecCheckpointIO().load_checkpoint(path)
    assert isinstance(FsspecCheckpointIO().load_checkpoint(path, weights_only=False)["obj"], Custom)
