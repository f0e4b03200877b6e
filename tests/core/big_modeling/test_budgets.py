"""max_memory budgets and device names: parsed, ordered, and checked against this machine."""

from __future__ import annotations

import pytest
import torch

from slipstream.big_modeling import DeviceMapError, get_balanced_memory, get_max_memory
from slipstream.big_modeling.budgets import normalize_device
from tests.core.big_modeling.models import Stack


@pytest.fixture
def two_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plan as if this machine had 2 GPUs (planning never touches them)."""
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_strings_and_bytes_are_read_and_ordered(two_gpus):
    budgets = get_max_memory({"cpu": "30GiB", 1: "1GB", "cuda:0": 1024, "disk": "1TB"})
    assert budgets == {0: 1024, 1: 10**9, "cpu": 30 * 2**30, "disk": 10**12}
    assert list(budgets) == [0, 1, "cpu", "disk"]


def test_default_budget_is_the_available_memory():
    budgets = get_max_memory()
    assert set(budgets) == {"cpu"} | set(range(torch.cuda.device_count()))
    assert budgets["cpu"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without GPUs")
@pytest.mark.parametrize("device", [0, "cuda:0", torch.device("cuda", 0), "cuda"])
def test_budgets_may_plan_for_gpus_this_machine_lacks_but_weights_never_go_there(device):
    assert get_max_memory({device: "1GiB", "cpu": "1GiB"}) == {0: 2**30, "cpu": 2**30}
    with pytest.raises(DeviceMapError, match=r"which this machine does not have.*no GPU"):
        normalize_device(device, "execution_device")


@pytest.mark.parametrize(
    ("budget", "message"),
    [
        ({"tpu": "1GiB"}, "names device 'tpu'"),
        ({"cpu": "lots"}, r"max_memory\['cpu'\] = 'lots' is not a size"),
        ({"cpu": -1}, "is negative"),
    ],
)
def test_bad_budgets_name_what_to_change(budget, message):
    with pytest.raises(DeviceMapError, match=message):
        get_max_memory(budget)


def test_the_same_device_twice_is_an_error(two_gpus):
    with pytest.raises(DeviceMapError, match="twice"):
        get_max_memory({0: 1, "cuda:0": 2})


def test_device_names_normalise(two_gpus):
    assert normalize_device("cuda:1") == 1
    assert normalize_device(torch.device("cpu")) == "cpu"
    assert normalize_device("disk") == "disk"


def test_balanced_memory_splits_the_model_over_gpus(two_gpus):
    model = Stack(width=64, depth=8)
    total = sum(p.numel() * 4 for p in model.parameters())
    big = {0: 10 * total, 1: 10 * total, "cpu": 10 * total}
    balanced = get_balanced_memory(model, big, ["Block"])
    assert total // 2 < balanced[0] < total, "GPU 0 holds about half, plus a margin"
    assert balanced[1] == big[1] and balanced["cpu"] == big["cpu"]
    low = get_balanced_memory(model, big, ["Block"], low_zero=True)
    assert low[0] == 0, "GPU 1 can hold everything: GPU 0 is left free"


def test_balanced_memory_without_gpus_changes_nothing():
    assert get_balanced_memory(Stack(), {"cpu": 1000}) == {"cpu": 1000}
