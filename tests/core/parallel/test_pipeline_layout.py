"""Splitting models into pipeline stages, in one process: layouts, balance, split points,
stage modules that chain to the whole model, and the errors."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from slipstream import ParallelismConfig
from slipstream.parallel import ParallelismConfigError
from slipstream.parallel.pipeline import assign_stages, pipeline_layout, resolve_plan
from slipstream.parallel.pipeline.stage import build_stage_module, materialise, prune_in_place


def _stack(blocks: int = 4, width: int = 8) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, width),
        nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(blocks)]),
        nn.Linear(width, 2),
    )


def _llama(layers: int = 4):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return transformers.LlamaForCausalLM(config)


class Declared(nn.Module):
    """A custom model that promises its forward applies these children in order."""

    _pp_plan = ("embed", "blocks", "head")

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(6, 8)
        self.blocks = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _chain(model: nn.Module, stages: list[list[str]], value: torch.Tensor) -> torch.Tensor:
    layout = pipeline_layout(model)
    for index, keep in enumerate(stages):
        stage = build_stage_module(
            model, layout, keep, first=index == 0, last=index == len(stages) - 1
        )
        value = stage(value)
    return value


def test_a_sequential_opens_its_nested_block_list():
    layout = pipeline_layout(_stack())
    assert layout.kind == "sequential"
    assert layout.names == ["0", "1.0", "1.1", "1.2", "1.3", "2"]


def test_transformers_models_describe_their_layout():
    layout = pipeline_layout(_llama())
    assert layout.kind == "transformers"
    assert layout.names[:2] == ["model.embed_tokens", "model.layers.0"]
    assert layout.names[-2:] == ["model.norm", "lm_head"]
    roles = {u.name: u.role for u in layout.units}
    assert roles["model.embed_tokens"] == "pre" and roles["lm_head"] == "post"


def test_blocks_balance_by_parameters_with_the_embedding_and_head_on_the_ends():
    model = _llama(layers=4)
    layout = pipeline_layout(model)
    stages = assign_stages(layout, 2)
    assert stages[0][0] == "model.embed_tokens" and stages[-1][-2:] == ["model.norm", "lm_head"]
    assert [n for s in stages for n in s] == layout.names  # every unit, once, in order
    by_count = assign_stages(layout, 4, balance="count")
    assert [len([n for n in s if "layers" in n]) for s in by_count] == [1, 1, 1, 1]


def test_balancing_is_exact_for_uneven_blocks():
    # Parameters: 110, 11, 2, 110, 110. The best 3 stages: [110, 11] [2, 110] [110].
    model = nn.Sequential(
        nn.Linear(10, 10), nn.Linear(10, 1), nn.Linear(1, 1), nn.Linear(10, 10), nn.Linear(10, 10)
    )
    stages = assign_stages(pipeline_layout(model), 3)
    sizes = dict(zip(["0", "1", "2", "3", "4"], [110, 11, 2, 110, 110], strict=True))
    assert max(sum(sizes[n] for n in stage) for stage in stages) == 121
    assert [n for stage in stages for n in stage] == ["0", "1", "2", "3", "4"]


def test_split_points_override_the_balance():
    layout = pipeline_layout(_llama())
    stages = assign_stages(layout, 2, split_points=["layers.1"])
    assert stages[0] == ["model.embed_tokens", "model.layers.0"]
    assert stages[1][0] == "model.layers.1"


@pytest.mark.parametrize(
    "make,stages",
    [
        (_stack, [["0", "1.0"], ["1.1", "1.2"], ["1.3", "2"]]),
        (Declared, [["embed", "blocks.0"], ["blocks.1", "blocks.2", "blocks.3", "head"]]),
    ],
    ids=["sequential", "declared"],
)
def test_stages_chained_are_the_whole_model(make, stages):
    model = make()
    x = torch.randn(3, 6)
    expected = model(x)
    assert torch.allclose(_chain(model, stages, x), expected, atol=1e-6)


def test_transformers_stages_chained_are_the_whole_model():
    model = _llama()
    tokens = torch.randint(0, 64, (2, 8))
    expected = model(input_ids=tokens).logits
    stages = assign_stages(pipeline_layout(model), 3)
    assert torch.allclose(_chain(model, stages, tokens), expected, atol=1e-5)


def test_a_stage_keeps_original_names_and_shares_the_modules():
    model = _llama()
    layout = pipeline_layout(model)
    keep = ["model.layers.2", "model.layers.3", "model.norm", "lm_head"]
    stage = build_stage_module(model, layout, keep, first=False, last=True)
    names = [n for n, _ in stage.named_parameters()]
    assert names[0].startswith("model.layers.2.") and names[-1] == "lm_head.weight"
    assert not any("embed_tokens" in n or "layers.0" in n for n in names)
    assert stage.lm_head is model.lm_head, "the modules are shared, not copied"
    assert type(stage).__name__ == "StageLlamaForCausalLM"


def test_pruning_in_place_drops_other_stages_and_meta_stages_materialise():
    with torch.device("meta"):
        model = _stack()
    layout = pipeline_layout(model)
    prune_in_place(model, layout, ["1.2", "1.3", "2"])
    assert sorted(n for n, _ in model.named_parameters()) == [
        "1.2.0.bias",
        "1.2.0.weight",
        "1.3.0.bias",
        "1.3.0.weight",
        "2.bias",
        "2.weight",
    ]
    stage = build_stage_module(model, layout, ["1.2", "1.3", "2"], first=False, last=True)
    materialise(stage, torch.device("cpu"))
    assert not any(p.is_meta for p in model.parameters()), "shared modules are real now"
    assert stage(torch.ones(1, 8)).shape == (1, 2)


def test_a_model_that_cannot_be_split_names_its_children():
    class Custom(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = nn.Linear(2, 2)
            self.decoder = nn.Linear(2, 2)

    with pytest.raises(ParallelismConfigError) as error:
        pipeline_layout(Custom())
    text = str(error.value)
    assert "cannot split Custom into pipeline stages" in text
    assert "top-level children are: encoder, decoder" in text and "_pp_plan" in text


@pytest.mark.parametrize(
    "stages,kwargs,message",
    [
        (7, {}, "7 pipeline stages need at least 7 blocks to split, but the model has 6"),
        (2, {"split_points": ["1.9"]}, "split point '1.9' is not the model's pipeline units"),
        (3, {"split_points": ["1.2"]}, "1 pipeline split point(s) make 2 stages"),
        (3, {"split_points": ["1.2", "1.1"]}, "must be in forward order"),
        (2, {"balance": "flops"}, "pp_balance must be one of parameters, count"),
    ],
)
def test_split_errors_say_what_to_change(stages, kwargs, message):
    with pytest.raises(ParallelismConfigError) as error:
        assign_stages(pipeline_layout(_stack()), stages, **kwargs)
    assert message in str(error.value)


def test_declared_layouts_must_name_children_and_own_all_parameters():
    class Wrong(Declared):
        _pp_plan = ("embed", "blocks", "tail")

    with pytest.raises(ParallelismConfigError, match="names 'tail', which is not one of"):
        pipeline_layout(Wrong())

    class Extra(Declared):
        def __init__(self) -> None:
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))

    model = Extra()
    with pytest.raises(ParallelismConfigError, match="holds parameters of its own"):
        build_stage_module(model, pipeline_layout(model), ["embed"], first=True, last=False)


def test_schedules_and_their_options():
    assert ParallelismConfig(pp_schedule="Interleaved1F1B").pp_schedule == "interleaved_1f1b"
    plan = resolve_plan(2, "interleaved_1f1b", None, None)
    assert (plan.stages_per_rank, plan.microbatches, plan.num_stages) == (2, 4, 4)
    assert plan.stages_of(1) == [1, 3]
    assert resolve_plan(2, "zbv", None, None).stages_of(0) == [0, 3], "V-shaped placement"
    assert resolve_plan(4, "gpipe", 8, None).stages_of(2) == [2]
    with pytest.raises(ParallelismConfigError, match="unknown pipeline schedule 'fast'"):
        ParallelismConfig(pp_schedule="fast")
    with pytest.raises(ParallelismConfigError, match="runs one stage per process"):
        resolve_plan(2, "gpipe", None, 2)
    with pytest.raises(ParallelismConfigError, match="places exactly 2 stages"):
        resolve_plan(2, "zbv", None, 3)
    with pytest.raises(ParallelismConfigError, match="multiple of pp_size=2"):
        resolve_plan(2, "interleaved_1f1b", 3, None)


def test_the_model_passed_in_is_not_needed_as_a_whole_copy():
    model = _stack()
    before = copy.deepcopy(model)
    prune_in_place(model, pipeline_layout(model), ["0", "1.0"])
    assert len(list(model.parameters())) == 4 < len(list(before.parameters()))
