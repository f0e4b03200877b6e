"""Accelerate's file-name constants name the files slipstream writes."""

from __future__ import annotations

import os

import torch

from slipstream import Accelerator
from slipstream.utils.constants import (
    OPTIMIZER_NAME,
    RNG_STATE_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    SAFE_WEIGHTS_PATTERN_NAME,
    SCALER_NAME,
    SCHEDULER_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
    WEIGHTS_PATTERN_NAME,
)


def test_save_state_writes_the_named_files(tmp_path):
    accelerator = Accelerator(cpu=True, mixed_precision="fp16")  # fp16: a loss scaler
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
    model, optimizer, scheduler = accelerator.prepare(model, optimizer, scheduler)
    folder = accelerator.save_state(str(tmp_path / "state"))
    files = set(os.listdir(folder))
    expected = {SAFE_WEIGHTS_NAME, f"{OPTIMIZER_NAME}.bin", f"{SCHEDULER_NAME}.bin", SCALER_NAME}
    assert expected | {f"{RNG_STATE_NAME}_0.pkl"} <= files


def test_save_model_writes_the_named_files(tmp_path):
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64))
    accelerator.save_model(model, str(tmp_path / "one"))
    assert os.listdir(tmp_path / "one") == [SAFE_WEIGHTS_NAME]
    accelerator.save_model(model, str(tmp_path / "shards"), max_shard_size=20_000)
    shard = SAFE_WEIGHTS_PATTERN_NAME.format(suffix="-00001-of-00002")
    assert {shard, SAFE_WEIGHTS_INDEX_NAME} <= set(os.listdir(tmp_path / "shards"))
    accelerator.save_model(
        model, str(tmp_path / "bin"), max_shard_size=20_000, safe_serialization=False
    )
    shard = WEIGHTS_PATTERN_NAME.format(suffix="-00002-of-00002")
    assert {shard, WEIGHTS_INDEX_NAME} <= set(os.listdir(tmp_path / "bin"))
    accelerator.save_model(model, str(tmp_path / "bin1"), safe_serialization=False)
    assert os.listdir(tmp_path / "bin1") == [WEIGHTS_NAME]
