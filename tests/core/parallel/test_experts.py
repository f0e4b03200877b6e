"""Expert parallelism's parts that need no processes: the ep size in ParallelismConfig and
config files, finding experts from a plan, and routing statistics. (Token dispatch, the
aux loss over the global batch and checkpoints run on several processes in
tests/core/strategies/test_expert_parallel.py.)"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from slipstream import ParallelismConfig
from slipstream.launcher.config import ConfigError, config_from_dict
from slipstream.parallel import MeshSizes, ParallelismConfigError
from slipstream.parallel.experts import (
    ExpertLoad,
    inside_experts,
    model_ep_plan,
    resolve_experts,
)
from tests.core.strategies.test_expert_parallel import ListedExperts, Net, StackedExperts

# -- sizes and config files ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,world,expected",
    [
        ({"ep_size": 2}, 4, MeshSizes(dp_shard=4, ep=2)),  # only ep: every process shards
        ({"dp_shard_size": 2, "tp_size": 2, "ep_size": 2}, 4, MeshSizes(dp_shard=2, tp=2, ep=2)),
        ({"dp_replicate_size": 2, "dp_shard_size": -1, "ep_size": 4}, 8, None),
        ({"dp_shard_size": 4, "ep_size": 1}, 4, MeshSizes(dp_shard=4)),
    ],
)
def test_ep_borrows_from_the_shard_dimension(kwargs, world, expected):
    config = ParallelismConfig(**kwargs)
    sizes = config.resolve(world)
    assert sizes == (expected or MeshSizes(dp_replicate=2, dp_shard=4, ep=4))
    assert sizes.world_size == world, "ep is not a dimension of its own"
    assert config.ep_enabled == (sizes.ep > 1) and config.model_parallel == (sizes.ep > 1)


def test_ep_layout_descriptions_and_deepspeed():
    sizes = MeshSizes(dp_shard=4, ep=2)
    assert sizes.describe() == "dp_shard=4 (experts over ep=2)"
    assert sizes.beyond_data_parallel() == ["ep"], "DeepSpeed cannot split experts"


@pytest.mark.parametrize(
    "kwargs,world,message",
    [
        ({"dp_shard_size": 4, "ep_size": 3}, 4, "ep_size=3 does not divide dp_shard_size x"),
        ({"dp_replicate_size": 2, "ep_size": 2}, 2, "cp_size = 1: expert parallelism spreads"),
        (
            {"dp_shard_size": 2, "tp_size": 2, "ep_size": 2, "sequence_parallel": True},
            4,
            "ep_size > 1 with sequence_parallel=True is not supported",
        ),
    ],
)
def test_an_ep_size_that_does_not_divide_the_shards_is_refused(kwargs, world, message):
    with pytest.raises(ParallelismConfigError, match=message) as error:
        ParallelismConfig(**kwargs).resolve(world)
    assert isinstance(error.value, ConfigError), "launchers turn ConfigError into exit code 2"


def test_ep_size_must_be_a_positive_integer():
    with pytest.raises(ParallelismConfigError, match="ep_size must be a positive integer"):
        ParallelismConfig(ep_size=0)


def test_ep_keys_round_trip_through_a_config_block():
    block = {
        "parallelism_config_dp_shard_size": 4,
        "parallelism_config_ep_size": "2",
        "parallelism_config_ep_plan": "blocks.*.experts, layers.*.moe",
    }
    config = ParallelismConfig.from_config(block)
    assert config.ep_size == 2 and config.ep_plan == ["blocks.*.experts", "layers.*.moe"]
    assert config.to_config() == {
        "parallelism_config_dp_shard_size": 4,
        "parallelism_config_ep_size": 2,
        "parallelism_config_ep_plan": ["blocks.*.experts", "layers.*.moe"],
    }
    mapping = ParallelismConfig.from_config({"ep_plan": {"a.experts": "experts"}})
    assert mapping.ep_plan == {"a.experts": "experts"}
    with pytest.raises(ParallelismConfigError, match="ep_plan must list module-name patterns"):
        ParallelismConfig.from_config({"ep_plan": 3})


@pytest.mark.parametrize(
    "block,message",
    [
        (
            {"parallelism_config_dp_shard_size": 4, "parallelism_config_ep_size": 3},
            "parallelism_config_ep_size=3 does not divide parallelism_config_dp_shard_size",
        ),
        (
            {"parallelism_config_ep_size": 2, "deepspeed": True},
            "parallelism_config_ep_size=2 cannot be combined with DeepSpeed",
        ),
    ],
    ids=["divide", "deepspeed"],
)
def test_the_launcher_refuses_a_bad_ep_layout_before_starting(block: dict[str, Any], message):
    extra = {"distributed_type": "DEEPSPEED"} if block.pop("deepspeed", False) else {}
    with pytest.raises(ConfigError, match=message):
        config_from_dict({"num_processes": 4, "parallelism_config": block, **extra})


def test_the_launcher_describes_an_ep_layout():
    config, _ = config_from_dict(
        {"num_processes": 4, "parallelism_config": {"parallelism_config_ep_size": 2}}
    )
    assert config.parallel_layout() == "dp_shard=4 (experts over ep=2)"


# -- finding experts ----------------------------------------------------------------------------


def test_user_plans_find_stacked_and_listed_experts():
    stacked = resolve_experts(Net(), ["blocks.*.experts"], 2)
    assert [e.name for e in stacked] == ["blocks.0.experts", "blocks.1.experts"]
    assert stacked[0].num_experts == 4 and stacked[0].stacked == ("w_in", "w_out")
    assert stacked[0].listed is None
    listed = resolve_experts(Net(listed=True), {"blocks.*.experts": "experts"}, 4)
    assert listed[0].listed == "experts" and listed[0].num_experts == 4
    # A plan may be a function of the model; transformers' spelling is accepted.
    plan = {"blocks.*.experts": "ep_dispatch_experts", "blocks.*.experts.w_in": "grouped_gemm"}
    assert len(resolve_experts(Net(), lambda model: plan, 2)) == 2
    assert inside_experts("blocks.0.experts.w_in", stacked)
    assert not inside_experts("blocks.0.router", stacked)


def test_a_transformers_model_brings_its_own_plan():
    transformers = pytest.importorskip("transformers")
    from tests.core.strategies.test_expert_parallel import _qwen

    model = _qwen()
    assert model_ep_plan(model) == {
        "model.layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
        "model.layers.*.mlp.experts.down_proj": "grouped_gemm",
        "model.layers.*.mlp.experts": "ep_dispatch_experts",
    }
    found = resolve_experts(model, None, 2)
    assert [e.name for e in found] == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"]
    assert found[0].stacked == ("gate_up_proj", "down_proj")
    llama = transformers.LlamaConfig(
        vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1, num_attention_heads=2
    )
    assert model_ep_plan(transformers.LlamaForCausalLM(llama)) is None


class Shared(nn.Module):
    """An 'experts' module that also holds a weight every expert shares."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = StackedExperts(4, 8, 16)
        self.experts.scale = nn.Parameter(torch.ones(8))


def test_plan_errors_say_what_was_looked_for_and_how_to_declare_experts():
    with pytest.raises(ParallelismConfigError) as error:
        resolve_experts(nn.Sequential(nn.Linear(4, 4)), None, 2)
    text = str(error.value)
    assert (
        "ep_size=2 spreads experts over processes, but no experts were found in Sequential" in text
    )
    assert "looked for ParallelismConfig(ep_plan=...) (none given) and a transformers" in text
    assert "ep_plan=['blocks.*.moe.experts']" in text and "3-D parameters" in text
    assert "it has no module with 3-D parameters or a ModuleList" in text

    cases = {
        "blocks.*.moe": "ep_plan pattern 'blocks.*.moe' matches no module of Net; modules that "
        "may hold experts: blocks.0.experts (3-D parameters w_in, w_out)",
        "blocks.*.up": "names blocks.0.up (Linear), which holds no experts",
        "experts": "also weights that are not per expert (scale (8,))",
    }
    for pattern, message in cases.items():
        model = Shared() if pattern == "experts" else Net()
        with pytest.raises(ParallelismConfigError) as error:
            resolve_experts(model, [pattern], 2)
        assert message in str(error.value), str(error.value)
    with pytest.raises(ParallelismConfigError, match="ep_size=3 does not divide the 4 experts"):
        resolve_experts(Net(), ["blocks.*.experts"], 3)
    with pytest.raises(ParallelismConfigError, match="has style 'colwise'"):
        resolve_experts(Net(), {"blocks.*.experts": "colwise"}, 2)
    listed = Net(listed=True)
    listed.blocks[0].experts.gate = nn.Linear(2, 2)  # type: ignore[assignment]
    with pytest.raises(ParallelismConfigError, match="holds weights outside its one ModuleList"):
        resolve_experts(listed, ["blocks.*.experts"], 2)
    # A pipeline stage may hold no experts.
    assert resolve_experts(nn.Linear(2, 2), ["blocks.*.experts"], 2, whole_model=False) == []
    assert isinstance(ListedExperts(2, 4, 4).experts, nn.ModuleList)


# -- routing statistics ---------------------------------------------------------------------------


def test_expert_load_imbalance_and_metrics():
    load = ExpertLoad({"a": torch.tensor([4, 4, 4, 4]), "b": torch.tensor([16, 0, 0, 0])})
    assert load.imbalance == {"a": 1.0, "b": 4.0} and load.max_imbalance == 4.0
    assert load.metrics() == {
        "expert_load/max_imbalance": 4.0,
        "expert_load/a/imbalance": 1.0,
        "expert_load/b/imbalance": 4.0,
    }
    assert ExpertLoad().max_imbalance == 0.0
