"""FSDP2 on 2 CPU processes over gloo, against single-process references."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from slipstream import Accelerator, FullyShardedDataParallelPlugin, set_seed
from slipstream.checkpoint import load_weights
from tests.distributed import run_cli, run_distributed

SAMPLES = 32


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.inner(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 16)
        self.blocks = nn.Sequential(Block(16), Block(16))
        self.head = nn.Linear(16, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(SAMPLES, 6, generator=generator),
        torch.randn(SAMPLES, 1, generator=generator),
        torch.arange(SAMPLES),
    )


def _plugin(**kwargs) -> FullyShardedDataParallelPlugin:
    return FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Block"], **kwargs)


def _fsdp_parity(optimizer_after: bool, accumulation: int, checkpointing: bool) -> dict:
    acc = Accelerator(
        fsdp_plugin=_plugin(activation_checkpointing=checkpointing),
        gradient_accumulation_steps=accumulation,
    )
    set_seed(0)
    model = Net()
    reference = copy.deepcopy(model)
    loader = DataLoader(_data(), batch_size=2, shuffle=True)
    if optimizer_after:
        model = acc.prepare(model)
        optimizer = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-2))
    else:
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        model, optimizer = acc.prepare(model, optimizer)
    loader = acc.prepare(loader)
    cycles, current, norms = [], [], []
    for x, y, index in loader:
        with acc.accumulate(model):
            acc.backward(F.mse_loss(model(x), y))
            if acc.sync_gradients:
                norms.append(acc.clip_grad_norm_(model.parameters(), 1e9).item())
            optimizer.step()
            optimizer.zero_grad()
        current.append(acc.gather(index))
        if acc.sync_gradients:
            cycles.append(torch.cat(current))
            current = []
    data = _data()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    ref_norms = []
    for indices in cycles:
        ref_opt.zero_grad()
        F.mse_loss(reference(data.tensors[0][indices]), data.tensors[1][indices]).backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9).item())
        ref_opt.step()
    full = acc.get_state_dict(model)
    expected = reference.state_dict()
    return {
        "type": acc.distributed_type.value,
        "max_diff": max((full[k] - expected[k]).abs().max().item() for k in expected)
        if full
        else None,
        "norm_diff": max(abs(a - b) / b for a, b in zip(norms, ref_norms, strict=True)),
        "steps": len(cycles),
        "sharded": type(model.embed.weight).__name__,
        "local_rows": model.embed.weight.to_local().shape[0],
    }


@pytest.mark.parametrize(
    "optimizer_after,accumulation,checkpointing",
    [(False, 1, False), (True, 1, False), (False, 2, True)],
    ids=["optimizer-before-sharding", "optimizer-after-sharding", "accumulation+checkpointing"],
)
def test_fsdp_matches_a_single_process_big_batch(optimizer_after, accumulation, checkpointing):
    r0, r1 = run_distributed(_fsdp_parity, optimizer_after, accumulation, checkpointing)
    assert r0["type"] == "FSDP" and r0["sharded"] == "DTensor" and r0["local_rows"] == 8
    assert r0["steps"] == SAMPLES // (2 * 2 * accumulation)
    assert r0["max_diff"] < 1e-5, "weights equal the big-batch reference (averaged, not summed)"
    assert r1["max_diff"] is None, "the full state dict lives on the main process only"
    assert r0["norm_diff"] < 1e-5 and r1["norm_diff"] < 1e-5, "clip norm is the global norm"


def _train_and_save(folder: str, state_dict_type: str, steps: int) -> dict:
    acc = Accelerator(fsdp_plugin=_plugin(state_dict_type=state_dict_type))
    set_seed(0)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = acc.prepare(model, optimizer)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(acc.process_index))
    for _ in range(steps):
        acc.backward(model(x).pow(2).mean())
        optimizer.step()
        optimizer.zero_grad()
    acc.save_state(folder)
    acc.save_model(model, folder + "-weights")
    full = acc.get_state_dict(model)
    return {"full": {k: v.clone() for k, v in full.items()}, "listing": sorted(os.listdir(folder))}


def _load_and_continue(folder: str, state_dict_type: str) -> dict:
    acc = Accelerator(fsdp_plugin=_plugin(state_dict_type=state_dict_type))
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = acc.prepare(model, optimizer)
    acc.load_state(folder)
    restored = acc.get_state_dict(model)
    steps = [state["step"] for state in optimizer.state.values()]
    return {"full": {k: v.clone() for k, v in restored.items()}, "steps": steps}


@pytest.mark.parametrize("state_dict_type", ["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_save_and_load_round_trip(tmp_path, state_dict_type):
    folder = str(tmp_path / "ckpt")
    saved = run_distributed(_train_and_save, folder, state_dict_type, 3)[0]
    if state_dict_type == "SHARDED_STATE_DICT":
        assert "pytorch_model_fsdp_0" in saved["listing"] and "optimizer_0" in saved["listing"]
        assert "model.safetensors" not in saved["listing"]
        assert len(os.listdir(os.path.join(folder, "pytorch_model_fsdp_0"))) == 3  # one per rank
    else:
        assert {"model.safetensors", "optimizer.bin"} <= set(saved["listing"])
    loaded = run_distributed(_load_and_continue, folder, state_dict_type)[0]
    assert loaded["full"].keys() == saved["full"].keys()
    assert all(torch.equal(loaded["full"][k], saved["full"][k]) for k in saved["full"])
    assert loaded["steps"] and all(int(s) == 3 for s in loaded["steps"]), "optimizer state too"
    consolidated = load_weights(folder + "-weights")
    assert all(torch.equal(consolidated[k], saved["full"][k]) for k in saved["full"])


@pytest.mark.slow
def test_sharded_checkpoint_reshards_from_two_processes_to_one(tmp_path):
    folder = str(tmp_path / "ckpt")
    saved = run_distributed(_train_and_save, folder, "SHARDED_STATE_DICT", 2)[0]
    alone = _load_and_continue(folder, "SHARDED_STATE_DICT")
    assert all(torch.equal(alone["full"][k], saved["full"][k]) for k in saved["full"])
    merged = tmp_path / "merged"
    result = run_cli("merge-weights", folder, str(merged), "--dtype", "bf16")
    assert result.returncode == 0, result.stderr
    weights = load_weights(str(merged))
    assert weights.keys() == saved["full"].keys()
    assert all(torch.equal(weights[k], saved["full"][k].to(torch.bfloat16)) for k in weights)


@pytest.mark.slow
def test_merge_weights_errors_on_a_folder_without_shards(tmp_path):
    (tmp_path / "x.txt").write_text("")
    result = run_cli("merge-weights", str(tmp_path), str(tmp_path / "out"))
    assert result.returncode == 2 and "holds no sharded weights" in result.stderr


def _mixed_precision_and_offload() -> dict:
    acc = Accelerator(
        mixed_precision="bf16", fsdp_plugin=_plugin(cpu_offload=True, reshard_after_forward=False)
    )
    model = acc.prepare(Net())
    optimizer = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    out = model(torch.randn(4, 6))
    acc.backward(out.pow(2).mean())
    optimizer.step()
    full = acc.get_state_dict(model)
    return {
        "out": out.dtype,
        "stored": model.embed.weight.dtype,
        "saved": {v.dtype for v in full.values()},
    }


def test_bf16_policy_and_cpu_offload():
    r0, _ = run_distributed(_mixed_precision_and_offload)
    assert r0["out"] == torch.float32, "outputs come back in fp32"
    assert r0["stored"] == torch.float32 and r0["saved"] == {torch.float32}, "fp32 master weights"


def _bad_wrapping(case: str) -> str:
    try:
        if case == "class":
            Accelerator(
                fsdp_plugin=FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Blok"])
            ).prepare(Net())
        elif case == "empty":
            Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin()).prepare(nn.ReLU())
        else:
            Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(min_num_params=300)).prepare(
                Net()
            )
            return "size-based ok"
    except ValueError as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    "case,message",
    [
        (
            "class",
            "names ['Blok'] that match no module of Net; its module classes are: Block, Linear, Net, Sequential",
        ),
        ("empty", "FSDP shards parameters, but ReLU has none"),
        ("size", "size-based ok"),
    ],
)
def test_wrapping_errors_name_what_exists(case, message):
    assert message in run_distributed(_bad_wrapping, case)[0]


def test_plugin_reads_accelerate_fsdp_config():
    plugin = FullyShardedDataParallelPlugin.from_config(
        {
            "fsdp_version": 2,
            "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
            "fsdp_transformer_layer_cls_to_wrap": "Block,Other",
            "fsdp_offload_params": "false",
            "fsdp_state_dict_type": "SHARDED_STATE_DICT",
            "fsdp_reshard_after_forward": True,
            "fsdp_cpu_ram_efficient_loading": True,
            "fsdp_use_orig_params": True,
        }
    )
    assert plugin.transformer_cls_names_to_wrap == ["Block", "Other"] and plugin.sharded_state_dict
    with pytest.raises(ValueError, match=r"unknown key 'fsdp_ofload_params'.*fsdp_offload_params"):
        FullyShardedDataParallelPlugin.from_config({"fsdp_ofload_params": True})
    with pytest.raises(ValueError, match="fsdp_version 1 is not supported"):
        FullyShardedDataParallelPlugin(fsdp_version=1)


def test_torch_without_fsdp2_is_a_clear_error(monkeypatch):
    import torch.distributed.fsdp

    monkeypatch.delattr(torch.distributed.fsdp, "fully_shard")
    with pytest.raises(RuntimeError, match=r"install torch>=2\.6"):
        Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())


# -- Accelerate's FSDP1-era options, as Accelerate 1.15 maps them for FSDP2 --------------------
@pytest.mark.filterwarnings("ignore:sharding_strategy=HYBRID_SHARD")
@pytest.mark.parametrize(
    "given,reshard",
    [("FULL_SHARD", True), ("shard_grad_op", False), (4, True), ("5", False)],
)
def test_sharding_strategy_maps_to_reshard_after_forward(given, reshard):
    plugin = FullyShardedDataParallelPlugin(sharding_strategy=given)
    assert plugin.reshard_after_forward is reshard
    assert FullyShardedDataParallelPlugin().reshard_after_forward is True


def test_torch_enums_are_accepted_and_compare_equal():
    from torch.distributed.fsdp import ShardingStrategy, StateDictType

    plugin = FullyShardedDataParallelPlugin(
        sharding_strategy=ShardingStrategy.SHARD_GRAD_OP,
        state_dict_type=StateDictType.SHARDED_STATE_DICT,
    )
    assert plugin.sharding_strategy == "SHARD_GRAD_OP" and plugin.reshard_after_forward is False
    assert plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT
    assert plugin.state_dict_type == "SHARDED_STATE_DICT" and plugin.sharded_state_dict
    assert plugin.state_dict_type != StateDictType.FULL_STATE_DICT
    assert FullyShardedDataParallelPlugin(state_dict_type="3").sharded_state_dict
    with pytest.raises(ValueError, match="FSDP2 does not support LOCAL_STATE_DICT"):
        FullyShardedDataParallelPlugin(state_dict_type=StateDictType.LOCAL_STATE_DICT)


def test_sharding_strategy_errors_and_warnings():
    with pytest.warns(UserWarning, match=r"NO_SHARD is FSDP1's.*use DDP"):
        FullyShardedDataParallelPlugin(sharding_strategy="NO_SHARD")
    with pytest.warns(UserWarning, match=r"HYBRID_SHARD is FSDP1's.*dp_replicate_size"):
        FullyShardedDataParallelPlugin(sharding_strategy="HYBRID_SHARD")
    with pytest.raises(ValueError, match="sharding_strategy must be one of FULL_SHARD"):
        FullyShardedDataParallelPlugin(sharding_strategy="HALF_SHARD")
    with pytest.raises(ValueError, match="means reshard_after_forward=True, but"):
        FullyShardedDataParallelPlugin(sharding_strategy="FULL_SHARD", reshard_after_forward=False)


def test_accelerate_fsdp1_config_keys_map_too():
    plugin = FullyShardedDataParallelPlugin.from_config(
        {"fsdp_sharding_strategy": "SHARD_GRAD_OP", "fsdp_state_dict_type": "FULL_STATE_DICT"}
    )
    assert plugin.reshard_after_forward is False
    # Newer `accelerate config` files write the FSDP1 strategy under this key.
    plugin = FullyShardedDataParallelPlugin.from_config(
        {"fsdp_reshard_after_forward": "FULL_SHARD"}
    )
    assert plugin.reshard_after_forward is True
    assert not FullyShardedDataParallelPlugin.from_config(
        {"fsdp_reshard_after_forward": "false"}
    ).reshard_after_forward


class Decoder(Net):
    _no_split_modules = ["Block"]


def test_set_auto_wrap_policy_reads_no_split_modules():
    plugin = FullyShardedDataParallelPlugin(auto_wrap_policy="TRANSFORMER_BASED_WRAP")
    plugin.set_auto_wrap_policy(Decoder())
    assert plugin.transformer_cls_names_to_wrap == ["Block"]
    with pytest.raises(ValueError, match="Net names none in _no_split_modules"):
        FullyShardedDataParallelPlugin(
            auto_wrap_policy="transformer_based_wrap"
        ).set_auto_wrap_policy(Net())
    with pytest.raises(
        ValueError, match=r"could not find the transformer layer class\(es\) \['Blok'\]"
    ):
        FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Blok"]).set_auto_wrap_policy(
            Net()
        )
    untouched = FullyShardedDataParallelPlugin()
    untouched.set_auto_wrap_policy(Net())
    assert untouched.auto_wrap_policy == "no_wrap"


def _wraps_no_split_modules() -> list[str]:
    plugin = FullyShardedDataParallelPlugin(auto_wrap_policy="transformer_based_wrap")
    model = Accelerator(fsdp_plugin=plugin).prepare(Decoder())
    return sorted(type(m).__name__ for m in model.modules() if type(m).__name__.startswith("FSDP"))


def test_prepare_shards_the_no_split_modules_without_class_names():
    assert run_distributed(_wraps_no_split_modules)[0] == ["FSDPBlock", "FSDPBlock", "FSDPDecoder"]
