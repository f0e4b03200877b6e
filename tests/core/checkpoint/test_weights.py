"""Model weights: sharded safetensors with an index, 16-bit consolidation, tied weights."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from slipstream import Accelerator
from slipstream.checkpoint import export_weights, load_weights, save_weights
from slipstream.checkpoint.serialization import parse_size
from slipstream.utils import ProjectConfiguration
from tests.distributed import run_distributed


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.hidden = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied, as in language models


def test_sharded_round_trip_with_index(tmp_path):
    acc = Accelerator()
    torch.manual_seed(0)
    model = acc.prepare(nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)]))
    acc.save_model(model, str(tmp_path / "out"), max_shard_size="5KB")
    files = sorted(os.listdir(tmp_path / "out"))
    assert files[-1] == "model.safetensors.index.json" and len(files) > 2
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(model.state_dict())
    assert index["metadata"]["total_size"] == sum(
        t.numel() * 4 for t in model.state_dict().values()
    )
    fresh = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
    acc.load_model(fresh, str(tmp_path / "out"))
    assert all(
        torch.equal(a, b)
        for a, b in zip(fresh.state_dict().values(), model.state_dict().values(), strict=True)
    )


def test_single_file_16_bit_and_tied_weights(tmp_path):
    acc = Accelerator()
    model = acc.prepare(Tied())
    acc.save_model(model, str(tmp_path / "bf16"), dtype=torch.bfloat16)
    raw = load_file(str(tmp_path / "bf16" / "model.safetensors"))
    assert all(t.dtype == torch.bfloat16 for t in raw.values())
    assert "head.weight" not in raw, "a tied tensor is stored once"
    restored = load_weights(str(tmp_path / "bf16"))
    assert torch.equal(restored["head.weight"], restored["embed.weight"])
    fresh = Tied()
    acc.load_model(fresh, str(tmp_path / "bf16"))
    assert fresh.head.weight is fresh.embed.weight
    assert torch.allclose(fresh.hidden.weight, model.hidden.weight, atol=1e-2)


def test_pickle_layout_and_missing_weights(tmp_path):
    state = {"a": torch.ones(3), "b": torch.zeros(2, dtype=torch.int64)}
    names = save_weights(state, str(tmp_path / "bin"), safe_serialization=False, max_shard_size=8)
    assert names[-1] == "pytorch_model.bin.index.json"
    loaded = load_weights(str(tmp_path / "bin"))
    assert torch.equal(loaded["a"], state["a"]) and torch.equal(loaded["b"], state["b"])
    with pytest.raises(FileNotFoundError, match="holds no model weights"):
        load_weights(str(tmp_path))


def test_resharding_to_a_single_file_removes_stale_shards(tmp_path):
    state = {f"w{i}": torch.ones(100) for i in range(4)}
    save_weights(state, str(tmp_path), max_shard_size=500)
    assert len(os.listdir(tmp_path)) == 5
    save_weights(state, str(tmp_path))
    assert os.listdir(tmp_path) == ["model.safetensors"]


def test_saving_touches_only_files_of_its_own_naming_scheme(tmp_path):
    # Files that merely start with "model"/"pytorch_model", and the sharded checkpoint folder
    # that merge_fsdp_weights reads beside its output, survive every save.
    (tmp_path / "pytorch_model_fsdp_0").mkdir()
    (tmp_path / "pytorch_model_fsdp_0" / "__0_0.distcp").write_bytes(b"shard")
    (tmp_path / "model-00001-of-00002.safetensors.bak").write_text("backup")
    others = ["model_card.md", "modeling_notes.txt", "pytorch_model.bin.md"]
    for name in others:
        (tmp_path / name).write_text("keep me")
    state = {f"w{i}": torch.ones(100) for i in range(4)}
    kept = {"pytorch_model_fsdp_0", "model-00001-of-00002.safetensors.bak", *others}
    pickle_shards = {f"pytorch_model-0000{i}-of-00004.bin" for i in range(1, 5)}
    save_weights(state, str(tmp_path), safe_serialization=False, max_shard_size=500)
    save_weights(state, str(tmp_path), max_shard_size=500)
    # The pickle shards are another format's files, left alone; their index (which loaders
    # read before anything else) is stale now and went.
    safe_shards = {f"model-0000{i}-of-00004.safetensors" for i in range(1, 5)}
    expected = kept | pickle_shards | safe_shards | {"model.safetensors.index.json"}
    assert set(os.listdir(tmp_path)) == expected
    save_weights(state, str(tmp_path), safe_serialization=False)  # one pytorch_model.bin
    save_weights(state, str(tmp_path))  # one model.safetensors
    assert set(os.listdir(tmp_path)) == kept | {"pytorch_model.bin", "model.safetensors"}
    assert os.listdir(tmp_path / "pytorch_model_fsdp_0") == ["__0_0.distcp"]
    assert all(torch.equal(v, state[k]) for k, v in load_weights(str(tmp_path)).items())


def test_export_replaces_the_folder_atomically(tmp_path):
    target = tmp_path / "weights"
    old = {f"w{i}": torch.full((100,), float(i)) for i in range(4)}
    export_weights(old, str(target), max_shard_size=500)
    assert len(os.listdir(target)) == 5
    # A failed export (a value safetensors cannot write) leaves the previous one whole.
    with pytest.raises(Exception):  # noqa: B017 - whatever the serializer raises
        export_weights({"w0": "not a tensor"}, str(target))  # type: ignore[dict-item]
    assert all(torch.equal(load_weights(str(target))[k], old[k]) for k in old)
    assert sorted(os.listdir(tmp_path)) == ["weights"]
    new = {"w0": torch.zeros(3)}
    assert export_weights(new, str(target), dtype=torch.bfloat16) == ["model.safetensors"]
    assert os.listdir(target) == ["model.safetensors"]
    assert load_weights(str(target))["w0"].dtype == torch.bfloat16
    assert sorted(os.listdir(tmp_path)) == ["weights"]  # no staging folders left behind


def test_export_to_an_object_store_writes_the_index_last():
    url = "memory://export-test/weights"
    state = {f"w{i}": torch.ones(100) for i in range(4)}
    names = export_weights(state, url, max_shard_size=500)
    assert names[-1] == "model.safetensors.index.json" and len(names) == 5
    assert all(torch.equal(v, state[k]) for k, v in load_weights(url).items())


@pytest.mark.parametrize(
    "size,expected", [(10, 10), ("10GB", 10**10), ("2MiB", 2 * 2**20), (" 1.5 kb", 1500)]
)
def test_parse_size(size, expected):
    assert parse_size(size) == expected


def test_parse_size_error():
    with pytest.raises(ValueError, match="write it like '10GB'"):
        parse_size("ten gigs")


def _save_model_from_two(folder: str) -> list[str]:
    acc = Accelerator()
    torch.manual_seed(0)
    model = acc.prepare(nn.Linear(4, 4))
    acc.save_model(model, folder)
    acc.save({"note": torch.ones(1)}, os.path.join(folder, "extra.pt"))
    return sorted(os.listdir(folder))


def test_save_model_on_two_processes_writes_once(tmp_path):
    folder = str(tmp_path / "two")
    listings = run_distributed(_save_model_from_two, folder)
    assert listings[0] == listings[1] == ["extra.pt", "model.safetensors"]


def test_project_configuration_is_importable_from_utils():
    assert ProjectConfiguration(project_dir="x").logging_dir == "x"
    with pytest.raises(ValueError, match="total_limit must be >= 1"):
        ProjectConfiguration(total_limit=0)
