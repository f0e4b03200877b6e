"""load_checkpoint_in_model: everything checked before anything changes, each tensor read
once to its device, disk tensors left in the checkpoint's own files."""

from __future__ import annotations

import json
import os
import textwrap

import pytest
import torch
from safetensors.torch import save_file

from slipstream import init_empty_weights, load_checkpoint_in_model
from slipstream.big_modeling import DeviceMapError
from slipstream.big_modeling.offload import read_index
from slipstream.checkpoint import CheckpointError
from tests.core.big_modeling.models import Stack
from tests.distributed import run_python


def _empty() -> Stack:
    with init_empty_weights():
        return Stack()


def _save(path, state) -> None:
    save_file({k: v.contiguous() for k, v in state.items()}, path)


def test_missing_unexpected_and_misshapen_keys_are_named_and_nothing_is_loaded(tmp_path, stack):
    state = {k: v.clone() for k, v in stack.state_dict().items() if k != "head.weight"}
    state.pop("blocks.2.up.bias")
    state["blocks.0.extra"] = torch.zeros(3)
    state["blocks.1.down.weight"] = torch.zeros(5, 5)
    _save(tmp_path / "bad.safetensors", state)
    model = _empty()
    with pytest.raises(CheckpointError) as caught:
        load_checkpoint_in_model(model, tmp_path / "bad.safetensors", strict=True)
    message = str(caught.value)
    assert "does not fit Stack" in message and "Nothing was loaded" in message
    assert "missing 'blocks.2.up.bias'" in message
    assert "unexpected 'blocks.0.extra' (strict=False ignores these)" in message
    assert "blocks.1.down.weight (5, 5) in the checkpoint vs (16, 32)" in message
    assert all(p.is_meta for p in model.parameters()), "the model is untouched"


def test_by_default_unknown_keys_are_ignored_but_never_missing_weights(tmp_path, stack, caplog):
    """Accelerate's default (strict=False): a logged warning for the keys left out."""
    state = {k: v.clone() for k, v in stack.state_dict().items() if k != "head.weight"}
    _save(tmp_path / "extra.safetensors", {**state, "old.inv_freq": torch.ones(2)})
    model = _empty()
    load_checkpoint_in_model(model, tmp_path / "extra.safetensors")
    assert "were not used when loading Stack: 'old.inv_freq'" in caplog.text
    assert torch.equal(model.blocks[3].up.weight, stack.blocks[3].up.weight)
    state.pop("blocks.3.up.weight")
    _save(tmp_path / "short.safetensors", state)
    with pytest.raises(CheckpointError, match=r"missing 'blocks\.3\.up\.weight'"):
        load_checkpoint_in_model(_empty(), tmp_path / "short.safetensors", strict=False)
    built = Stack()  # real (random) weights: strict=False keeps the one that is missing
    kept = built.blocks[3].up.weight.clone()
    load_checkpoint_in_model(built, tmp_path / "short.safetensors")
    assert "lacks 'blocks.3.up.weight'; they keep their current values" in caplog.text
    assert torch.equal(built.blocks[3].up.weight, kept)
    with pytest.raises(CheckpointError, match="missing"):
        load_checkpoint_in_model(Stack(), tmp_path / "short.safetensors", strict=True)


def test_disk_tensors_point_at_the_checkpoint_files(tmp_path, stack, stack_checkpoint):
    model = _empty()
    offload = tmp_path / "offload"
    load_checkpoint_in_model(
        model, stack_checkpoint, {"embed": "cpu", "blocks": "disk", "head": "cpu", "scale": "cpu"},
        offload_folder=offload,
    )  # fmt: skip
    assert os.listdir(offload) == ["index.json"], "nothing rewritten"
    index = read_index(str(offload))
    assert set(index) == {k for k in stack.state_dict() if k.startswith("blocks.")}
    assert all(os.path.dirname(e.file) == str(stack_checkpoint) for e in index.values())
    assert all(p.is_meta for p in model.blocks.parameters())
    assert torch.equal(model.embed.weight, stack.embed.weight)


def test_other_formats_are_copied_into_the_offload_folder(tmp_path, stack):
    torch.save(stack.state_dict(), tmp_path / "pytorch_model.bin")
    offload = tmp_path / "offload"
    load_checkpoint_in_model(_empty(), tmp_path, {"": "disk"}, offload_folder=offload)
    files = sorted(os.listdir(offload))
    assert files[0] == "index.json" and files[1].startswith("offloaded-") and len(files) == 2
    load_checkpoint_in_model(_empty(), tmp_path, {"": "disk"}, offload_folder=offload)
    assert sorted(os.listdir(offload)) == files, "loading again replaces, never adds, a copy"
    body = json.loads((offload / "index.json").read_text())
    assert body["tensors"]["head.weight"]["key"] == body["tensors"]["embed.weight"]["key"], (
        "a tied weight is stored once"
    )


def test_disk_without_an_offload_folder_is_an_error(stack_checkpoint):
    model = _empty()
    with pytest.raises(
        DeviceMapError, match=r"puts 'blocks.0.norm.weight'.* on 'disk'; pass offload_folder"
    ):
        load_checkpoint_in_model(model, stack_checkpoint, {"": "cpu", "blocks": "disk"})
    assert all(p.is_meta for p in model.parameters())


def test_dtype_converts_floating_weights(stack, stack_checkpoint):
    model = _empty()
    load_checkpoint_in_model(model, stack_checkpoint, dtype="bfloat16")
    assert model.embed.weight.dtype == torch.bfloat16
    assert torch.equal(model.embed.weight, stack.embed.weight.to(torch.bfloat16))
    assert model.head.weight is model.embed.weight


def test_a_meta_buffer_no_checkpoint_holds_is_an_error(stack_checkpoint):
    with init_empty_weights(include_buffers=True):
        model = Stack()
    model.register_buffer("cache", torch.zeros(2, device="meta"), persistent=False)
    with pytest.raises(
        CheckpointError, match=r"'cache' is a buffer on the meta device.*include_buffers=False"
    ):
        load_checkpoint_in_model(model, stack_checkpoint)


def test_a_model_with_weights_is_overwritten(stack, stack_checkpoint):
    torch.manual_seed(5)
    other = Stack()
    load_checkpoint_in_model(other, stack_checkpoint)
    assert torch.equal(other.blocks[0].up.weight, stack.blocks[0].up.weight)
    assert other.head.weight is other.embed.weight


_PEAK = textwrap.dedent(
    """
    import sys, torch
    from torch import nn
    from slipstream import init_empty_weights, load_checkpoint_in_model

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field):
                return int(line.split()[1]) * 1024

    with init_empty_weights():
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(24)])
    open("/proc/self/clear_refs", "w").write("5")
    before = status("VmRSS:")
    device_map = {"": "cpu"} if sys.argv[2] == "all" else {"0": "cpu", "1": "cpu", "": "disk"}
    load_checkpoint_in_model(model, sys.argv[1], device_map, offload_folder=sys.argv[1] + "-off")
    print(status("VmHWM:") - before)
    """
)


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads /proc (Linux)")
def test_peak_memory_is_what_stays_loaded_plus_one_tensor(tmp_path):
    from slipstream.checkpoint import save_weights

    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(24)])  # 100 MB
    save_weights(model.state_dict(), str(tmp_path / "ckpt"), max_shard_size="30MB")
    del model
    env = {"MALLOC_MMAP_THRESHOLD_": "131072"}  # freed tensors leave the heap at once
    peaks = {}
    for mode in ("all", "two-layers"):
        done = run_python("-c", _PEAK, str(tmp_path / "ckpt"), mode, env=env, fresh=True)
        assert done.returncode == 0, done.stderr
        peaks[mode] = int(done.stdout.split()[-1])
    layer = 1024 * 1025 * 4
    assert peaks["all"] < 24 * layer * 1.15, "never the model twice"
    assert peaks["two-layers"] < 3 * layer + 8 * 2**20, "two layers resident, one in flight"


def test_an_index_may_be_a_bare_map_of_names_to_files(tmp_path, stack, stack_checkpoint):
    """transformers' index holds {"weight_map": {...}}; Accelerate also reads a plain map."""
    import json

    (index,) = stack_checkpoint.glob("*.index.json")
    bare = stack_checkpoint / "bare.json"
    bare.write_text(json.dumps(json.loads(index.read_text())["weight_map"]))
    model = _empty()
    load_checkpoint_in_model(model, bare, strict=True)
    assert torch.equal(model.blocks[1].up.weight, stack.blocks[1].up.weight)
    bare.write_text(json.dumps({"weights": ["model.safetensors"]}))
    with pytest.raises(CheckpointError, match="must map tensor names to files"):
        load_checkpoint_in_model(_empty(), bare)
