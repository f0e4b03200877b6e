"""The Accelerator's descriptive properties (Accelerate's names) under each strategy."""

from __future__ import annotations

from typing import Any

import pytest
from torch import nn

from slipstream import (
    Accelerator,
    DataLoaderConfiguration,
    DeepSpeedPlugin,
    FullyShardedDataParallelPlugin,
    ParallelismConfig,
)
from tests.distributed import run_distributed


def test_single_process_facts() -> None:
    config = DataLoaderConfiguration(non_blocking=True, dispatch_batches=True)
    accelerator = Accelerator(cpu=True, dataloader_config=config, mixed_precision="bf16")
    assert accelerator.mixed_precision == "bf16"
    assert accelerator.deepspeed_plugin is None and accelerator.fsdp_plugin is None
    assert not accelerator.is_fsdp2 and not accelerator.is_composable_parallelism_enabled
    assert not accelerator.multi_device
    assert accelerator.dispatch_batches is True and accelerator.non_blocking is True
    assert accelerator.use_seedable_sampler and not accelerator.use_stateful_dataloader
    assert accelerator.should_save_model
    assert accelerator.fp8_backend == "NO"
    assert accelerator.parallelism_config is None


def test_verify_device_map() -> None:
    accelerator = Accelerator(cpu=True)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert not accelerator.verify_device_map(model)
    model.__dict__["hf_device_map"] = {"0": "cpu", "1": "disk"}
    assert accelerator.verify_device_map(model)


def _facts(kind: str) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if kind == "fsdp":
        options["fsdp_plugin"] = FullyShardedDataParallelPlugin()
    elif kind == "deepspeed":
        options["deepspeed_plugin"] = DeepSpeedPlugin(zero_stage=2)
    elif kind == "tp":
        options["parallelism_config"] = ParallelismConfig(tp_size=2)
    accelerator = Accelerator(**options)
    return {
        "multi_device": accelerator.multi_device,
        "is_fsdp2": accelerator.is_fsdp2,
        "composable": accelerator.is_composable_parallelism_enabled,
        "deepspeed": type(accelerator.deepspeed_plugin).__name__,
        "fsdp": type(accelerator.fsdp_plugin).__name__,
        "parallelism": accelerator.parallelism_config is not None,
    }


@pytest.mark.parametrize(
    ("kind", "expected"),
    [
        ("ddp", (True, False, False, "NoneType", "NoneType", False)),
        ("fsdp", (False, True, True, "NoneType", "FullyShardedDataParallelPlugin", False)),
        ("deepspeed", (False, False, False, "DeepSpeedPlugin", "NoneType", False)),
        # two processes in one tensor-parallel group: nothing left to shard with FSDP2
        ("tp", (True, False, True, "NoneType", "NoneType", True)),
    ],
)
def test_facts_under_each_strategy(kind: str, expected: tuple[Any, ...]) -> None:
    facts = run_distributed(_facts, kind)[0]
    assert tuple(facts.values()) == expected
