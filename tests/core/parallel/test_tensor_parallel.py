"""Tensor-parallel plans: precedence, pattern matching, divisibility checks and their errors.

Applying plans to real processes is tested with the strategy (tests/core/strategies/
test_model_parallel.py); here everything is decided before any process group exists.
"""

from __future__ import annotations

import pytest
from torch import nn

from slipstream.parallel import ParallelismConfigError
from slipstream.parallel.tensor_parallel import (
    check_divisible,
    make_style,
    model_plan,
    resolve_plan,
)


class Block(nn.Module):
    def __init__(self, width: int = 8, hidden: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.blocks = nn.Sequential(Block(), Block())
        self.head = nn.Linear(8, 3)


def _tiny_llama(**overrides):
    transformers = pytest.importorskip("transformers")
    values = {
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    values.update(overrides)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**values))


def test_user_plan_patterns_match_one_name_part_per_star():
    plan = resolve_plan(Net(), {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}, 2)
    assert sorted((p.name, p.style) for p in plan) == [
        ("blocks.0.down", "rowwise"),
        ("blocks.0.up", "colwise"),
        ("blocks.1.down", "rowwise"),
        ("blocks.1.up", "colwise"),
    ]


def test_a_plan_can_be_a_function_of_the_model():
    plan = resolve_plan(Net(), lambda model: {"blocks.0.up": "colwise"}, 2)
    assert [p.name for p in plan] == ["blocks.0.up"]


def test_transformers_models_bring_their_own_plan():
    model = _tiny_llama()
    plan = model_plan(model)
    assert plan is not None
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise"
    assert plan["model.layers.*.mlp.down_proj"] == "rowwise"
    assert plan["lm_head"] == "colwise_gather_output"
    resolved = {p.name: p.style for p in resolve_plan(model, None, 2)}
    assert resolved["model.layers.1.self_attn.o_proj"] == "rowwise"
    assert resolved["lm_head"] == "colwise_gather_output"


def test_the_users_plan_wins_over_the_models():
    resolved = resolve_plan(_tiny_llama(), {"model.layers.*.mlp.up_proj": "colwise"}, 2)
    assert [p.name for p in resolved] == [
        "model.layers.0.mlp.up_proj",
        "model.layers.1.mlp.up_proj",
    ]


def test_a_model_without_a_plan_gets_the_modules_to_write_one():
    with pytest.raises(ParallelismConfigError) as error:
        resolve_plan(Net(), None, 2)
    text = str(error.value)
    assert "tp_size=2" in text and "tp_plan" in text
    assert "blocks.0.up (Linear 8->16)" in text and "embed (Embedding 10x8)" in text


@pytest.mark.parametrize(
    "plan,message",
    [
        ({"blocks.*.upp": "colwise"}, "matches no module of Net; its Linear/Embedding modules"),
        ({"blocks.*.up": "colwise", "blocks.0.*": "rowwise"}, "matched by two tp_plan patterns"),
        ({"head": "replicate"}, "splits no module"),
    ],
)
def test_plan_errors_say_what_to_change(plan, message):
    with pytest.raises(ParallelismConfigError, match=message):
        resolve_plan(Net(), plan, 2)


def test_unknown_styles_and_sequence_parallel_without_the_option_are_errors():
    with pytest.raises(ParallelismConfigError, match="unknown tensor-parallel style 'column'"):
        make_style("column", sequence_parallel=False, sequence_dim=1)
    with pytest.raises(ParallelismConfigError, match=r"sequence_parallel=True"):
        make_style("sequence_parallel", sequence_parallel=False, sequence_dim=1)


def test_split_sizes_must_divide_by_tp():
    plan = resolve_plan(Net(), {"head": "colwise"}, 2)
    with pytest.raises(
        ParallelismConfigError, match="does not divide the 3 output features of head"
    ):
        check_divisible(Net(), plan, 2)
    plan = resolve_plan(Net(), {"embed": "embedding_rowwise"}, 4)
    with pytest.raises(ParallelismConfigError, match="the 10 embedding rows of embed"):
        check_divisible(Net(), plan, 4)
    check_divisible(Net(), resolve_plan(Net(), {"blocks.*.up": "colwise"}, 4), 4)


def test_attention_heads_must_divide_by_tp():
    model = _tiny_llama()  # 4 query heads, 2 key/value heads
    check_divisible(model, resolve_plan(model, None, 2), 2)
    with pytest.raises(ParallelismConfigError) as error:
        check_divisible(model, resolve_plan(model, None, 4), 4)
    assert "tp_size=4 does not divide num_key_value_heads=2" in str(error.value)


def test_module_head_attributes_are_checked_too():
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.num_heads = 3
            self.qkv = nn.Linear(12, 36)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = Attention()

    model = Model()
    with pytest.raises(ParallelismConfigError, match=r"attn.num_heads=3"):
        check_divisible(model, resolve_plan(model, {"attn.qkv": "colwise"}, 2), 2)


def test_tied_weights_split_two_ways_are_refused_before_anything_changes():
    from slipstream.parallel.tensor_parallel import _check_tied_layouts, _tied_parameters

    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(8, 4)
            self.head = nn.Linear(4, 8, bias=False)
            self.head.weight = self.embed.weight

    model = Tied()
    groups = _tied_parameters(model)
    assert [[name for *_, name in group] for group in groups] == [["embed.weight", "head.weight"]]
    matching = resolve_plan(model, {"embed": "embedding_rowwise", "head": "colwise"}, 2)
    _check_tied_layouts(groups, matching)  # both split along the vocabulary: fine
    with pytest.raises(ParallelismConfigError) as error:
        _check_tied_layouts(groups, resolve_plan(model, {"head": "colwise"}, 2))
    assert "embed.weight not split, head.weight split along dim 0" in str(error.value)
