"""Named choices: str enums printed as their values, with membership tests by value."""

from __future__ import annotations

import pytest

from slipstream.options.choices import (
    ComputeEnvironment,
    DynamoBackend,
    LoggerType,
    PrecisionType,
    RNGType,
)


def test_members_are_their_values():
    assert PrecisionType.BF16 == "bf16" and str(PrecisionType.BF16) == "bf16"
    assert f"{RNGType.GENERATOR}" == "generator"
    assert PrecisionType("fp16") is PrecisionType.FP16
    assert DynamoBackend.INDUCTOR.value == "INDUCTOR"


def test_membership_by_value_and_lists():
    assert "bf16" in PrecisionType and "fp32" not in PrecisionType
    assert "tensorboard" in LoggerType and "csv" in LoggerType
    assert PrecisionType.list() == ["no", "fp8", "fp16", "bf16"]
    assert ComputeEnvironment.list() == ["LOCAL_MACHINE", "AMAZON_SAGEMAKER"]
    with pytest.raises(ValueError, match="'tpu' is not a valid RNGType"):
        RNGType("tpu")


def test_log_with_takes_the_built_in_trackers_and_refuses_the_others():
    from slipstream.tracking import TRACKERS, resolve_log_with

    built_in = [t for t in LoggerType if t.value in TRACKERS]
    assert sorted(t.value for t in built_in) == ["csv", "mlflow", "tensorboard", "wandb"]
    assert resolve_log_with(built_in) == [t.value for t in built_in]
    with pytest.raises(ValueError, match="unknown tracker"):
        resolve_log_with(LoggerType.AIM)
