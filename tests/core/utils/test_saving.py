"""save/load from one process, state dicts cleaned for safetensors, merging a sharded FSDP
checkpoint into one file."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch

from slipstream.utils.saving import (
    clean_state_dict_for_safetensors,
    id_tensor_storage,
    load,
    merge_fsdp_weights,
    save,
)
from tests.distributed import run_distributed


def test_id_tensor_storage_is_shared_by_views_and_ties():
    weight = torch.ones(4, 4)
    assert id_tensor_storage(weight) == id_tensor_storage(weight[1:])
    assert id_tensor_storage(weight) != id_tensor_storage(weight.clone())


def test_cleaning_keeps_one_name_per_storage_and_makes_tensors_contiguous(caplog):
    shared = torch.arange(6.0).reshape(2, 3)
    state = {"embed": shared, "head": shared, "t": shared.t(), "step": 3}
    cleaned = clean_state_dict_for_safetensors(state)
    assert list(cleaned) == ["embed", "step"]
    assert "removed tensors that share memory" in caplog.text and "'head'" in caplog.text
    assert clean_state_dict_for_safetensors({"t": torch.ones(2, 3).t()})["t"].is_contiguous()


def test_save_and_load_in_both_formats(tmp_path: Path):
    shared = torch.arange(4.0)
    save({"a": shared, "b": shared}, tmp_path / "w.safetensors", safe_serialization=True)
    from safetensors.torch import load_file

    assert list(load_file(tmp_path / "w.safetensors")) == ["a"]
    save({"x": torch.ones(2), "meta": {"epoch": 1}}, tmp_path / "w.bin")
    loaded = load(tmp_path / "w.bin")
    assert loaded["meta"] == {"epoch": 1} and torch.equal(loaded["x"], torch.ones(2))


def test_load_refuses_code_but_reads_numpy_arrays(tmp_path: Path):
    np = pytest.importorskip("numpy")
    torch.save({"state": np.arange(3, dtype=np.uint32)}, tmp_path / "rng.pkl")
    assert load(tmp_path / "rng.pkl")["state"].tolist() == [0, 1, 2]
    torch.save({"cls": Path("x")}, tmp_path / "code.pkl")
    with pytest.raises(
        pickle.UnpicklingError, match=r"[Ww]eights only load failed|Unsupported global"
    ):
        load(tmp_path / "code.pkl")
    assert load(tmp_path / "code.pkl", weights_only=False)["cls"] == Path("x")


def _save_from_every_process(folder: str) -> None:
    rank = int(os.environ["RANK"])
    save(torch.tensor(rank), os.path.join(folder, f"main_{rank}.bin"))
    save(torch.tensor(rank), os.path.join(folder, f"node_{rank}.bin"), save_on_each_node=True)


def test_only_the_main_process_writes(tmp_path: Path):
    run_distributed(_save_from_every_process, str(tmp_path))
    # One machine: rank 0 is both the main process and the machine's main process.
    assert sorted(os.listdir(tmp_path)) == ["main_0.bin", "node_0.bin"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_merge_fsdp_weights(tmp_path: Path):
    import torch.distributed.checkpoint as dcp

    state = {"layer.weight": torch.randn(3, 2), "layer.bias": torch.randn(3)}
    folder = tmp_path / "checkpoint" / "pytorch_model_fsdp_0"
    dcp.save({"model": state}, checkpoint_id=str(folder))
    merge_fsdp_weights(str(tmp_path / "checkpoint"), str(tmp_path / "out"))
    from safetensors.torch import load_file

    merged = load_file(tmp_path / "out" / "model.safetensors")
    assert merged.keys() == state.keys()
    assert all(torch.equal(merged[k], v) for k, v in state.items())
    merge_fsdp_weights(
        str(folder), str(tmp_path / "bin"), safe_serialization=False, remove_checkpoint_dir=True
    )
    assert torch.equal(
        load(tmp_path / "bin" / "pytorch_model.bin")["layer.bias"], state["layer.bias"]
    )
    assert not folder.exists()
