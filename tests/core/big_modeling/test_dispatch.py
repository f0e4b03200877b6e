"""load_checkpoint_and_dispatch, dispatch_model and the offload helpers: outputs equal the
plain model's, offloaded weights live on disk or in RAM between forwards."""

from __future__ import annotations

import copy
import os

import pytest
import torch
from torch import nn

from slipstream import (
    cpu_offload,
    cpu_offload_with_hook,
    disk_offload,
    dispatch_model,
    infer_auto_device_map,
    init_empty_weights,
    load_checkpoint_and_dispatch,
    load_checkpoint_in_model,
)
from slipstream.big_modeling import (
    DeviceMapError,
    compute_module_sizes,
    remove_hook_from_module,
)
from slipstream.checkpoint import CheckpointError
from tests.core.big_modeling.models import Plain, Stack, tiny_llama_config


def _empty_llama():
    transformers = pytest.importorskip("transformers")
    with init_empty_weights():
        return transformers.LlamaForCausalLM(tiny_llama_config())


def _tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))


def test_llama_larger_than_the_cpu_budget_runs_from_disk(tmp_path, llama_checkpoint):
    reference, folder = llama_checkpoint
    assert len([n for n in os.listdir(folder) if n.endswith(".safetensors")]) > 2
    model = _empty_llama()
    sizes = compute_module_sizes(model)
    budget = sizes[""] // 3
    model = load_checkpoint_and_dispatch(
        model, folder, device_map="auto", max_memory={"cpu": budget},
        offload_folder=tmp_path / "offload",
    )  # fmt: skip
    devices = set(model.hf_device_map.values())
    assert devices == {"cpu", "disk"}, model.hf_device_map
    resident = sum(p.numel() * 4 for p in model.parameters() if not p.is_meta)
    assert resident <= budget - sizes["model.layers.0"], "room is kept for one decoder layer"
    assert os.listdir(tmp_path / "offload") == ["index.json"], "read from the checkpoint's files"
    tokens = _tokens()
    with torch.no_grad():
        expected = reference(tokens).logits
        assert torch.equal(model(tokens).logits, expected)
        assert torch.equal(model(tokens).logits, expected), "and again: weights were released"
    assert resident == sum(p.numel() * 4 for p in model.parameters() if not p.is_meta)
    mask = torch.ones(2, 4, dtype=torch.long)
    generated = model.generate(
        tokens[:, :4], attention_mask=mask, max_new_tokens=5, do_sample=False
    )
    assert torch.equal(
        generated,
        reference.generate(tokens[:, :4], attention_mask=mask, max_new_tokens=5, do_sample=False),
    )


@pytest.mark.parametrize("strategy", ["sequential", "balanced_low_0"])
def test_the_other_strategies_give_the_same_logits(tmp_path, llama_checkpoint, strategy):
    reference, folder = llama_checkpoint
    model = _empty_llama()
    budget = {"cpu": compute_module_sizes(model)[""] // 2}
    model = load_checkpoint_and_dispatch(
        model, folder, strategy, budget, offload_folder=tmp_path / "off"
    )
    tokens = _tokens()
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, reference(tokens).logits)


def test_an_explicit_map_and_bf16(tmp_path, llama_checkpoint):
    reference, folder = llama_checkpoint
    device_map = {
        "model.embed_tokens": "disk",
        "model.layers.0": "cpu",
        "model.layers.1": "disk",
        "model.layers.2.self_attn": "disk",
        "model.layers.2.mlp": "cpu",
        "model": "cpu",
        "lm_head": "disk",
    }
    model = load_checkpoint_and_dispatch(
        _empty_llama(), folder, device_map, offload_folder=tmp_path / "off", dtype=torch.bfloat16
    )
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    assert model.model.layers[1].mlp.up_proj.weight.is_meta
    plain = copy.deepcopy(reference)
    for parameter in plain.parameters():
        parameter.data = parameter.data.to(torch.bfloat16)
    tokens = _tokens()
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, plain(tokens).logits)


def test_auto_without_an_offload_folder_says_what_to_do(llama_checkpoint):
    _, folder = llama_checkpoint
    model = _empty_llama()
    with pytest.raises(
        DeviceMapError, match=r"does not fit max_memory=.*'disk'; pass offload_folder="
    ):
        load_checkpoint_and_dispatch(model, folder, "auto", {"cpu": "300KB"})
    assert all(p.is_meta for p in model.parameters()), "nothing was loaded"


def test_a_budget_below_one_decoder_layer_names_it(tmp_path, llama_checkpoint):
    _, folder = llama_checkpoint
    with pytest.raises(DeviceMapError, match=r"cannot hold 'model.layers.\d' \(LlamaDecoderLayer"):
        load_checkpoint_and_dispatch(
            _empty_llama(), folder, "auto", {"cpu": "100KB"}, offload_folder=tmp_path
        )


def test_a_checkpoint_of_another_model_is_refused(tmp_path, llama_checkpoint):
    _, folder = llama_checkpoint
    with pytest.raises(
        CheckpointError, match=r"does not fit Stack: missing 'scale', 'embed.weight'.*another model"
    ):
        load_checkpoint_and_dispatch(Stack(), folder, {"": "cpu"})


def test_offloaded_weights_are_released_after_each_forward_and_on_errors(
    tmp_path, stack, stack_checkpoint
):
    with init_empty_weights():
        model = Stack()
    device_map = {
        "embed": "cpu",
        "blocks.0": "disk",
        "blocks": "cpu",
        "head": "cpu",
        "scale": "cpu",
    }
    model = load_checkpoint_and_dispatch(
        model, stack_checkpoint, device_map, offload_folder=tmp_path
    )
    seen = []
    layer = model.blocks[0].up
    original = layer.__dict__["_old_forward"]  # the forward the hook wraps

    def recording(x: torch.Tensor) -> torch.Tensor:
        seen.append(layer.weight.is_meta)
        return original(x)

    layer.__dict__["_old_forward"] = recording
    tokens = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(model(tokens), stack(tokens))
    assert seen == [False], "loaded for its forward"
    assert model.blocks[0].up.weight.is_meta, "released after it"
    with pytest.raises(RuntimeError):
        model.blocks[0].up(torch.zeros(1, 3))  # wrong width: the forward raises
    assert model.blocks[0].up.weight.is_meta, "released even so"
    with pytest.raises(RuntimeError, match="cannot be moved"):
        model.to("cpu")
    model.to(torch.float32)  # not a move


def test_dispatch_model_refuses_weights_that_were_never_loaded(tmp_path):
    with init_empty_weights():
        model = Plain()
    with pytest.raises(
        CheckpointError, match=r"'blocks.0.norm.weight'.* no data .*load the weights first"
    ):
        dispatch_model(model, {"": "cpu"})
    with pytest.raises(CheckpointError, match="neither the model nor the offload folder"):
        dispatch_model(model, {"": "disk"}, offload_dir=tmp_path)
    with pytest.raises(DeviceMapError, match="pass offload_dir"):
        dispatch_model(model, {"": "disk"})


def test_dispatch_model_writes_disk_weights_the_model_holds(tmp_path):
    torch.manual_seed(0)
    model = Plain()
    inputs = torch.randn(3, 16)
    with torch.no_grad():
        expected = model(inputs)
    dispatch_model(model, {"blocks.1": "disk", "": "cpu"}, offload_dir=tmp_path)
    assert model.blocks[1].up.weight.is_meta and not model.blocks[0].up.weight.is_meta
    assert any(n.startswith("offloaded-") for n in os.listdir(tmp_path))
    with torch.no_grad():
        assert torch.equal(model(inputs), expected)
    with pytest.raises(ValueError, match=r"already dispatched .*remove_hook_from_module"):
        dispatch_model(model, {"": "cpu"})
    with pytest.raises(ValueError, match="already dispatched"):
        cpu_offload(model)
    remove_hook_from_module(model, recurse=True)
    assert "forward" not in model.blocks[1].up.__dict__ and not hasattr(model, "_hf_hook")


def test_two_steps_load_then_dispatch(tmp_path, stack, stack_checkpoint):
    with init_empty_weights():
        model = Stack()
    device_map = infer_auto_device_map(model, {"cpu": 6000}, ["Block"])
    assert "disk" in device_map.values()
    load_checkpoint_in_model(model, stack_checkpoint, device_map, offload_folder=tmp_path)
    dispatch_model(model, device_map, offload_dir=tmp_path)
    tokens = torch.tensor([[4, 5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(model(tokens), stack(tokens))


def test_cpu_and_disk_offload_of_a_whole_model(tmp_path):
    torch.manual_seed(0)
    model = Plain()
    inputs = torch.randn(3, 16)
    with torch.no_grad():
        expected = model(inputs)
        on_cpu = cpu_offload(copy.deepcopy(model), execution_device="cpu")
        assert torch.equal(on_cpu(inputs), expected)
        on_disk = disk_offload(copy.deepcopy(model), tmp_path / "offload")
        assert all(p.is_meta for p in on_disk.parameters())
        assert torch.equal(on_disk(inputs), expected)
        with init_empty_weights():
            empty = Plain()
        again = disk_offload(empty, tmp_path / "offload")  # reads the folder written above
        assert torch.equal(again(inputs), expected)
    with init_empty_weights():
        empty = Plain()
    with pytest.raises(CheckpointError, match="holds no offload index"):
        disk_offload(empty, tmp_path / "nothing")


def test_a_stale_offload_folder_is_refused(tmp_path):
    disk_offload(Plain(), tmp_path)
    with init_empty_weights():
        wider = Plain(width=32)
    with pytest.raises(CheckpointError, match="a stale offload folder"):
        disk_offload(wider, tmp_path)


def test_cpu_offload_with_hook_chains_models():
    torch.manual_seed(0)
    first, second = nn.Linear(4, 4), nn.Linear(4, 2)
    inputs = torch.randn(2, 4)
    with torch.no_grad():
        expected = second(first(inputs))
    first, hook_1 = cpu_offload_with_hook(first, "cpu")
    second, hook_2 = cpu_offload_with_hook(second, "cpu", prev_module_hook=hook_1)
    with torch.no_grad():
        assert torch.equal(second(first(inputs)), expected)
    hook_2.offload()
    hook_1.remove()
    assert "forward" not in first.__dict__


@pytest.fixture
def gpu_played_by_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU 0 exists, and its memory is the CPU's: the GPU code paths (CPU offload between
    forwards, inputs brought to the main device) run, and outputs stay comparable."""
    from slipstream.big_modeling import budgets, dispatch, loading

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    played = lambda device: torch.device("cpu") if isinstance(device, int) else torch.device(device)  # noqa: E731
    for module in (budgets, dispatch, loading):
        monkeypatch.setattr(module, "torch_device", played)


def test_gpu_paths_offload_to_cpu_between_forwards(
    tmp_path, llama_checkpoint, gpu_played_by_the_cpu
):
    reference, folder = llama_checkpoint
    model = _empty_llama()
    sizes = compute_module_sizes(model)
    layer = sizes["model.layers.0"]
    budget = {0: sizes["model.embed_tokens"] + 2 * layer, "cpu": 2 * layer}
    model = load_checkpoint_and_dispatch(model, folder, "auto", budget, offload_folder=tmp_path)
    assert model.hf_device_map["model.embed_tokens"] == 0
    assert model.hf_device_map["model.layers.0"] == 0
    assert model.hf_device_map["model.layers.1"] == "cpu"
    assert model.hf_device_map["lm_head"] == "disk"
    assert not model.model.layers[0].mlp.up_proj.weight.is_meta, "on the GPU to stay"
    assert model.model.layers[1].mlp.up_proj.weight.is_meta, "in RAM between forwards"
    tokens = _tokens()
    with torch.no_grad():
        assert torch.equal(model(tokens).logits, reference(tokens).logits)
    assert model.model.layers[1].mlp.up_proj.weight.is_meta


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_with_cpu_and_disk_offload(tmp_path, llama_checkpoint):
    reference, folder = llama_checkpoint
    model = _empty_llama()
    sizes = compute_module_sizes(model)
    layer = sizes["model.layers.0"]
    # GPU 0: the embedding and a layer (plus room for one in flight); the CPU: one more.
    budget = {0: sizes["model.embed_tokens"] + 2 * layer, "cpu": 2 * layer}
    model = load_checkpoint_and_dispatch(model, folder, "auto", budget, offload_folder=tmp_path)
    assert set(model.hf_device_map.values()) == {0, "cpu", "disk"}
    tokens = _tokens()
    with torch.no_grad():
        logits = model(tokens).logits
        assert logits.device.type == "cpu", "outputs come back to the inputs' device"
        torch.testing.assert_close(logits, reference(tokens).logits, rtol=1e-4, atol=1e-4)
