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
    assert "Removed shared tensor" in caplog.text and "'head'" in caplog.text
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


# -- Accelerate's FSDP helpers, as test_merge_weights.py (Accelerate's own script) calls them --
class TinyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear1 = torch.nn.Linear(16, 16)
        self.activation = torch.nn.ReLU()
        self.linear2 = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear2(self.activation(self.linear1(x)))


def _full(state_dict: dict) -> dict:
    # FSDP2's model.state_dict() holds DTensors; full_tensor() gathers (a collective).
    return {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in state_dict.items()}


def _accelerate_merge_script(folder: str) -> dict:
    from torch.distributed.fsdp import ShardingStrategy, StateDictType

    from slipstream import Accelerator, FullyShardedDataParallelPlugin
    from slipstream.cli.merge_weights import merge_command, merge_command_parser
    from slipstream.utils import patch_environment
    from slipstream.utils.saving import save_fsdp_model

    plugin = FullyShardedDataParallelPlugin(
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        state_dict_type=StateDictType.SHARDED_STATE_DICT,
    )
    torch.manual_seed(0)
    model = TinyModel()
    with patch_environment(fsdp_auto_wrap_policy="SIZE_BASED_WRAP"):
        plugin.set_auto_wrap_policy(model)
    accelerator = Accelerator(fsdp_plugin=plugin)
    model = accelerator.prepare(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(accelerator.process_index)
    for _ in range(3):
        x = torch.randn(8, 16, generator=generator)
        accelerator.backward(torch.nn.functional.mse_loss(model(x), x))
        optimizer.step()
        optimizer.zero_grad()
    out = Path(folder)
    save_fsdp_model(plugin, accelerator, model, out)
    accelerator.wait_for_everyone()
    trained = _full(model.state_dict())
    merge_fsdp_weights(out / "pytorch_model_fsdp_0", out, safe_serialization=True)
    from safetensors.torch import load_file

    merged = {"safetensors": load_file(out / "model.safetensors")}
    parser = merge_command_parser()
    merge_command(parser.parse_args([str(out / "pytorch_model_fsdp_0"), str(out)]))
    merged["command"] = load_file(out / "model.safetensors")
    args = parser.parse_args(
        [str(out / "pytorch_model_fsdp_0"), str(out), "--unsafe_serialization"]
    )
    merge_command(args)
    merged["bin"] = load(out / "pytorch_model.bin")
    return {
        "same": {
            kind: weights.keys() == trained.keys()
            and all(torch.equal(weights[k], trained[k]) for k in trained)
            for kind, weights in merged.items()
        },
        "files": sorted(os.listdir(out)),
        "reshard": plugin.reshard_after_forward,
    }


def test_accelerate_merge_weights_script_on_two_processes(tmp_path: Path):
    results = run_distributed(_accelerate_merge_script, str(tmp_path))
    for result in results:
        assert result["same"] == {"safetensors": True, "command": True, "bin": True}
        assert result["files"] == ["model.safetensors", "pytorch_model.bin", "pytorch_model_fsdp_0"]
        assert result["reshard"] is True


def _fsdp_model_round_trip(folder: str, state_dict_type: str) -> bool:
    from slipstream import Accelerator, FullyShardedDataParallelPlugin
    from slipstream.utils.saving import load_fsdp_model, save_fsdp_model

    plugin = FullyShardedDataParallelPlugin(state_dict_type=state_dict_type)
    accelerator = Accelerator(fsdp_plugin=plugin)
    torch.manual_seed(0)
    saved = accelerator.prepare(TinyModel())
    save_fsdp_model(plugin, accelerator, saved, folder, model_index=1)
    torch.manual_seed(1)
    fresh = accelerator.prepare(TinyModel())
    load_fsdp_model(plugin, accelerator, fresh, folder, model_index=1)
    before, after = _full(saved.state_dict()), _full(fresh.state_dict())
    return all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize(
    "state_dict_type,written",
    [
        ("SHARDED_STATE_DICT", "pytorch_model_fsdp_1"),
        ("FULL_STATE_DICT", "pytorch_model_fsdp_1.bin"),
    ],
)
def test_save_and_load_fsdp_model(tmp_path: Path, state_dict_type: str, written: str):
    assert run_distributed(_fsdp_model_round_trip, str(tmp_path), state_dict_type) == [True] * 2
    assert os.listdir(tmp_path) == [written]


def _merge_missing(folder: str) -> str:
    from slipstream.checkpoint import CheckpointError

    try:
        merge_fsdp_weights(folder, folder + "-out")
    except CheckpointError as error:
        return str(error)
    return "merged"


def test_a_merge_failing_on_the_main_process_raises_on_every_process(tmp_path: Path):
    messages = run_distributed(_merge_missing, str(tmp_path / "missing"))
    for message in messages:
        assert (
            message
            == f"process 0: ConfigError: {tmp_path}/missing does not exist: pass the folder save_state wrote"
        )


def test_fsdp_optimizer_helpers_save_through_the_strategy_and_refuse_what_they_cannot(tmp_path):
    from slipstream import Accelerator, FullyShardedDataParallelPlugin
    from slipstream.utils import load_fsdp_optimizer, save_fsdp_optimizer

    accelerator = Accelerator()
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    plugin = accelerator.state.fsdp_plugin  # None: the strategy's own (full) layout
    save_fsdp_optimizer(plugin, accelerator, optimizer, model, str(tmp_path))
    assert (tmp_path / "optimizer.bin").exists()
    saved = optimizer.state_dict()["state"][0]["exp_avg"].clone()
    model(torch.ones(1, 2)).sum().backward()
    optimizer.step()
    load_fsdp_optimizer(plugin, accelerator, optimizer, model, str(tmp_path))
    assert torch.equal(optimizer.state_dict()["state"][0]["exp_avg"], saved)
    sharded = FullyShardedDataParallelPlugin(state_dict_type="SHARDED_STATE_DICT")
    with pytest.raises(ValueError, match="use_dcp=True"):
        save_fsdp_optimizer(sharded, accelerator, optimizer, model, str(tmp_path), use_dcp=False)
    with pytest.raises(ValueError, match=r"pass accelerator\.state\.fsdp_plugin"):
        save_fsdp_optimizer(sharded, accelerator, optimizer, model, str(tmp_path))
