"""Offload storage: an index of safetensors entries, written atomically, read lazily."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file

from slipstream.big_modeling import OffloadedWeightsLoader, offload_state_dict
from slipstream.big_modeling.offload import OffloadWriter, read_index
from slipstream.checkpoint import CheckpointError


def test_written_files_are_plain_safetensors_and_tied_tensors_are_stored_once(tmp_path):
    shared = torch.randn(8, 4)
    state = {
        "embed": shared,
        "head": shared,
        "bias": torch.arange(3),
        "half": torch.ones(2, dtype=torch.bfloat16),
    }
    offload_state_dict(tmp_path, state)
    files = [n for n in os.listdir(tmp_path) if n.endswith(".safetensors")]
    assert len(files) == 1 and not [n for n in os.listdir(tmp_path) if n.endswith(".tmp")]
    stored = load_file(tmp_path / files[0])  # any safetensors reader can read it
    assert set(stored) == {"embed", "bias", "half"}, "the tied head is the embedding"
    weights = OffloadedWeightsLoader(save_folder=tmp_path)
    assert set(weights) == set(state) and len(weights) == 4
    assert all(torch.equal(weights[k], v) for k, v in state.items())
    assert weights.source_of("head") == weights.source_of("embed")


def test_a_later_offload_adds_to_the_index(tmp_path):
    offload_state_dict(tmp_path, {"a": torch.ones(2)})
    offload_state_dict(tmp_path, {"b": torch.zeros(2)})
    assert set(read_index(str(tmp_path))) == {"a", "b"}


def test_entries_convert_to_their_dtype_when_read(tmp_path):
    from slipstream.big_modeling.offload import OffloadEntry

    offload_state_dict(tmp_path, {"w": torch.full((4,), 1.5)})
    entry = read_index(str(tmp_path))["w"]
    weights = OffloadedWeightsLoader(index={"w16": OffloadEntry(entry.file, "w", torch.float16)})
    assert weights["w16"].dtype == torch.float16 and weights["w16"][0].item() == 1.5


def test_a_foreign_index_or_a_vanished_file_is_named(tmp_path):
    (tmp_path / "index.json").write_text(json.dumps({"w": {"dtype": "float32", "shape": [2]}}))
    with pytest.raises(CheckpointError, match="not a slipstream offload index"):
        OffloadedWeightsLoader(save_folder=tmp_path)
    os.remove(tmp_path / "index.json")
    offload_state_dict(tmp_path, {"w": torch.ones(2)})
    file = read_index(str(tmp_path))["w"].file
    os.remove(file)
    with pytest.raises(CheckpointError, match="no longer exists"):
        OffloadedWeightsLoader(save_folder=tmp_path)["w"]


def test_an_aborted_writer_leaves_nothing(tmp_path):
    writer = OffloadWriter(str(tmp_path), {"w": (torch.float32, (2, 2))})
    writer.abort()
    assert os.listdir(tmp_path) == []
