"""Checkpoint formats, read one tensor at a time: safetensors files and shards, .bin state
dicts, save_state folders (replicated and sharded) and torch.distributed.checkpoint folders."""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from slipstream import (
    Accelerator,
    FullyShardedDataParallelPlugin,
    init_empty_weights,
    load_checkpoint_in_model,
)
from slipstream.big_modeling.sources import SafetensorsFile, open_checkpoint
from slipstream.checkpoint import CheckpointError
from tests.core.big_modeling.models import Plain, Stack
from tests.distributed import run_distributed


def _load_empty(checkpoint: Path | str, **kwargs) -> Stack:
    with init_empty_weights():
        model = Stack()
    load_checkpoint_in_model(model, checkpoint, **kwargs)
    return model


def _same(model: torch.nn.Module, reference: torch.nn.Module) -> bool:
    ours, theirs = model.state_dict(), reference.state_dict()
    return ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_sharded_folder_of_save_weights(stack, stack_checkpoint):
    assert len([n for n in os.listdir(stack_checkpoint) if n.endswith(".safetensors")]) > 2
    model = _load_empty(stack_checkpoint)
    assert _same(model, stack) and not any(p.is_meta for p in model.parameters())
    assert model.head.weight is model.embed.weight, "tied weights stay tied"
    index = stack_checkpoint / "model.safetensors.index.json"
    assert _same(_load_empty(index), stack), "the index file itself is a checkpoint too"


def test_single_files(tmp_path, stack):
    state = {k: v.clone() for k, v in stack.state_dict().items() if k != "head.weight"}
    save_file(state, tmp_path / "weights.safetensors")
    assert _same(_load_empty(tmp_path / "weights.safetensors"), stack)
    torch.save(stack.state_dict(), tmp_path / "pytorch_model.bin")
    assert _same(_load_empty(tmp_path / "pytorch_model.bin"), stack)
    assert _same(_load_empty(tmp_path), stack), "a folder with pytorch_model.bin"


def test_replicated_save_state_folder(tmp_path, stack):
    accelerator = Accelerator()
    prepared = accelerator.prepare(stack)
    accelerator.save_state(str(tmp_path / "state"))
    assert "model.safetensors" in os.listdir(tmp_path / "state")
    assert _same(_load_empty(tmp_path / "state"), prepared)


def _save_sharded(folder: str) -> dict[str, torch.Tensor]:
    plugin = FullyShardedDataParallelPlugin(
        transformer_cls_names_to_wrap=["Block"], state_dict_type="SHARDED_STATE_DICT"
    )
    accelerator = Accelerator(fsdp_plugin=plugin)
    torch.manual_seed(0)
    model = accelerator.prepare(Plain())
    accelerator.save_state(folder)
    return {k: v.clone() for k, v in accelerator.get_state_dict(model).items()}


def test_sharded_save_state_of_two_processes(tmp_path):
    folder = tmp_path / "sharded"
    full = run_distributed(_save_sharded, str(folder))[0]
    shards = os.listdir(folder / "pytorch_model_fsdp_0")
    assert len([s for s in shards if s.endswith(".distcp")]) == 2, "one file per process"
    with init_empty_weights():
        model = Plain()
    load_checkpoint_in_model(model, folder, device_map={"": "cpu"})
    assert all(torch.equal(model.state_dict()[k], v) for k, v in full.items())
    with init_empty_weights():
        model = Plain()
    load_checkpoint_in_model(model, folder / "pytorch_model_fsdp_0")  # the folder inside
    assert all(torch.equal(model.state_dict()[k], v) for k, v in full.items())


def test_distributed_checkpoint_without_prefix(tmp_path, stack):
    import torch.distributed.checkpoint as dcp

    with pytest.warns(UserWarning):  # "torch.distributed is disabled": one process, intended
        dcp.save(stack.state_dict(), checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert _same(_load_empty(tmp_path / "dcp"), stack)


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc (Linux)")
def test_tensors_are_views_of_the_mapped_file_whose_pages_are_handed_back(tmp_path):
    tensors = {f"t{i}": torch.full((2048, 4096), float(i)) for i in range(3)}  # 32 MiB each
    save_file(tensors, tmp_path / "three.safetensors")
    del tensors
    file = SafetensorsFile(str(tmp_path / "three.safetensors"))
    view = file.tensor("t1")
    mapped = file._mapping()
    anchor = ctypes.c_char.from_buffer(mapped)
    start = ctypes.addressof(anchor)
    assert start <= view.data_ptr() < start + len(mapped), "no copy: the file's own pages"
    del anchor
    before = _resident_bytes()
    assert view.sum().item() == 2048 * 4096
    touched = _resident_bytes()
    file.release("t1")
    released = _resident_bytes()
    assert touched - before > 24 * 2**20, "reading maps the pages in"
    assert touched - released > 24 * 2**20, "release hands them back"
    assert view[0, 0].item() == 1.0, "a view still reads correctly after the release"
    view.add_(1)  # copy-on-write: the file never changes
    other = file.tensor("t2")
    file.close()
    del file
    assert other[-1, -1].item() == 2.0, "views outlive the file object (no unmapped memory)"
    del view, other
    assert SafetensorsFile(str(tmp_path / "three.safetensors")).tensor("t1")[0, 0].item() == 1.0


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda p: p.mkdir(), "holds no checkpoint this can read.*found nothing"),
        (lambda p: None, "does not exist"),
        (lambda p: p.write_bytes(b"\x10" * 20), "not a safetensors file"),
    ],
)
def test_unreadable_checkpoints_are_named(tmp_path, setup, message):
    target = tmp_path / ("thing.safetensors" if "safetensors" in message else "thing")
    setup(target)
    with pytest.raises(CheckpointError, match=message):
        open_checkpoint(target)


def test_an_index_listing_a_missing_shard(stack_checkpoint):
    shard = sorted(n for n in os.listdir(stack_checkpoint) if n.endswith(".safetensors"))[1]
    os.remove(stack_checkpoint / shard)
    with pytest.raises(CheckpointError, match=f"lists {shard}, which is not in"):
        open_checkpoint(stack_checkpoint)


def test_an_index_naming_keys_a_shard_lacks(stack_checkpoint):
    index_path = stack_checkpoint / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"]["ghost.weight"] = index["weight_map"][first]
    index_path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"holds \['ghost.weight'\], but it does not"):
        open_checkpoint(stack_checkpoint)


def test_remote_checkpoints_are_refused():
    with pytest.raises(CheckpointError, match="copy the checkpoint to a local disk"):
        open_checkpoint("s3://bucket/model")
