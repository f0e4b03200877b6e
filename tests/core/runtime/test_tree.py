"""Nested batch structures: moving, mapping and describing them."""

from __future__ import annotations

import dataclasses
from collections import OrderedDict, namedtuple

import torch

from slipstream import send_to_device
from slipstream.runtime.tree import describe, map_tensors, replace_tensors, tensor_leaves

Pair = namedtuple("Pair", "a b")


@dataclasses.dataclass(frozen=True)
class Record:
    x: torch.Tensor
    name: str


class Movable:
    def __init__(self) -> None:
        self.device = None

    def to(self, device, non_blocking=False):
        self.device = torch.device(device)
        return self


def test_send_to_device_keeps_every_container_type():
    batch = {
        "pair": Pair(torch.ones(2), [torch.zeros(1), "s"]),
        "record": Record(torch.ones(3), "r"),
        "ordered": OrderedDict(k=torch.ones(1)),
        "custom": Movable(),
        "number": 3,
    }
    moved = send_to_device(batch, "meta")
    assert moved["pair"].a.device.type == "meta" and isinstance(moved["pair"], Pair)
    assert moved["pair"].b[0].device.type == "meta" and moved["pair"].b[1] == "s"
    assert isinstance(moved["record"], Record) and moved["record"].x.device.type == "meta"
    assert isinstance(moved["ordered"], OrderedDict)
    assert moved["custom"].device == torch.device("meta")
    assert moved["number"] == 3
    assert batch["record"].x.device.type == "cpu", "the input is not modified"


def test_map_leaves_replace_and_describe():
    data = [torch.ones(2), {"b": (torch.zeros(1, 3, dtype=torch.int64), "x")}]
    doubled = map_tensors(lambda t: t * 2, data)
    assert doubled[0].tolist() == [2.0, 2.0]
    leaves = tensor_leaves(data)
    assert [tuple(t.shape) for t in leaves] == [(2,), (1, 3)]
    swapped = replace_tensors(data, [torch.tensor(7), torch.tensor(8)])
    assert swapped[0].item() == 7 and swapped[1]["b"][0].item() == 8 and swapped[1]["b"][1] == "x"
    assert describe(data) == [
        ("Tensor", (2,), "float32"),
        {"b": [("Tensor", (1, 3), "int64"), "str"]},
    ]


def test_a_flat_batch_already_in_place_is_returned_as_is_and_others_still_move():
    batch = [torch.ones(2), torch.zeros(3)]
    assert send_to_device(batch, "cpu") is batch  # the per-batch fast path
    moved = send_to_device(batch, "meta")
    assert isinstance(moved, list) and moved is not batch
    assert [t.device.type for t in moved] == ["meta", "meta"]
    # A parameter or a mixed tuple takes the general path, which keeps the container type.
    mixed = Pair(torch.nn.Parameter(torch.ones(1)), torch.ones(1, device="meta"))
    moved_mixed = send_to_device(mixed, "meta")
    assert type(moved_mixed) is Pair
    assert [t.device.type for t in moved_mixed] == ["meta", "meta"]
