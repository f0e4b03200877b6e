"""ParallelismConfig: sizes, -1, Accelerate's config keys and the errors (one process)."""

from __future__ import annotations

import pytest

from slipstream import ParallelismConfig
from slipstream.launcher.config import ConfigError
from slipstream.parallel import MeshSizes, ParallelismConfigError, TorchContextParallelConfig


@pytest.mark.parametrize(
    "kwargs,world,expected",
    [
        ({"dp_shard_size": 2, "tp_size": 2}, 4, MeshSizes(dp_shard=2, tp=2)),
        ({"dp_shard_size": -1, "tp_size": 2}, 8, MeshSizes(dp_shard=4, tp=2)),
        ({"dp_replicate_size": 2, "dp_shard_size": -1}, 4, MeshSizes(dp_replicate=2, dp_shard=2)),
        ({"tp_size": -1}, 4, MeshSizes(tp=4)),
        ({"pp_size": 2, "dp_shard_size": 2, "tp_size": 2}, 8, MeshSizes(pp=2, dp_shard=2, tp=2)),
        ({}, 4, MeshSizes(dp_replicate=4)),  # nothing given: every process a replica (Accelerate)
        ({}, 1, MeshSizes()),
        ({"dp_shard_size": 1}, 1, MeshSizes()),
        # Neither data-parallel size given: dp_shard takes what the model-parallel sizes leave.
        ({"tp_size": 2}, 8, MeshSizes(dp_shard=4, tp=2)),
        ({"pp_size": 2}, 4, MeshSizes(pp=2, dp_shard=2)),
        ({"pp_size": 2, "tp_size": 2}, 4, MeshSizes(pp=2, tp=2)),
        ({"tp_size": 2, "ep_size": 2}, 8, MeshSizes(dp_shard=4, tp=2, ep=2)),
        # ... but sizes of 1 ask for nothing beyond data parallelism: replicas (Accelerate).
        ({"tp_size": 1}, 4, MeshSizes(dp_replicate=4)),
        # A data-parallel size given: the unset ones are 1 and the sizes must multiply.
        ({"dp_replicate_size": 2, "tp_size": 2}, 4, MeshSizes(dp_replicate=2, tp=2)),
    ],
)
def test_sizes_resolve_to_the_world(kwargs, world, expected):
    config = ParallelismConfig(**kwargs)
    sizes = config.resolve(world)
    assert sizes == expected
    assert sizes.world_size == world
    assert config.sizes == expected
    assert config.total_size == world


def test_accelerate_properties_follow_the_resolved_sizes():
    config = ParallelismConfig(dp_replicate_size=2, dp_shard_size=-1, tp_size=2)
    config.resolve(8)
    assert config.dp_replicate_enabled and config.dp_shard_enabled and config.tp_enabled
    assert not config.cp_enabled and not config.pp_enabled
    assert config.data_parallel_size == 4 and config.non_data_parallel_size == 2
    assert config.active_mesh_dims == ["dp_replicate", "dp_shard", "tp"]
    assert config.dp_shard_size == -1, "the user's object keeps what the user wrote"
    assert MeshSizes(dp_shard=2, tp=2).describe() == "dp_shard=2 x tp=2"


@pytest.mark.parametrize(
    "kwargs,world,message",
    [
        ({"dp_shard_size": 2, "tp_size": 2}, 2, "multiply to dp_shard_size=2 x tp_size=2 = 4"),
        ({"dp_shard_size": 3}, 4, "but the job has 4 process(es)"),
        ({"tp_size": 3, "dp_shard_size": -1}, 4, "does not divide the 4 processes"),
        ({"tp_size": 3}, 4, "dp_shard_size (not given) takes the processes the other sizes"),
        ({"tp_size": 4}, 2, "but the job has 2 process(es)"),
        ({"dp_shard_size": 1, "tp_size": 2}, 4, "multiply to tp_size=2 = 2"),
    ],
)
def test_sizes_that_do_not_fit_the_world_are_a_clear_error(kwargs, world, message):
    with pytest.raises(ParallelismConfigError) as error:
        ParallelismConfig(**kwargs).resolve(world)
    assert message in str(error.value)
    assert isinstance(error.value, ConfigError), "launchers turn ConfigError into exit code 2"


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"dp_shard_size": -1, "tp_size": -1}, "only one parallel size may be -1"),
        ({"tp_size": 0}, "tp_size must be a positive integer"),
        ({"cp_size": "2"}, "cp_size must be a positive integer"),
        ({"cp_backend": "ring"}, "cp_backend must be 'torch'"),
    ],
)
def test_invalid_values_are_rejected_when_built(kwargs, message):
    with pytest.raises(ParallelismConfigError, match=message):
        ParallelismConfig(**kwargs)


def test_context_parallel_communication_strategy_is_checked():
    with pytest.raises(
        ParallelismConfigError,
        match="Invalid cp_comm_strategy: ring; use one of allgather, alltoall",
    ):
        TorchContextParallelConfig(cp_comm_strategy="ring")


def test_config_block_round_trip_with_accelerate_keys():
    block = {
        "parallelism_config_dp_replicate_size": 2,
        "parallelism_config_dp_shard_size": "-1",
        "parallelism_config_tp_size": 2,
        "parallelism_config_cp_size": 1,
        "parallelism_config_cp_comm_strategy": "alltoall",
        "parallelism_config_tp_plan": {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"},
        "parallelism_config_sequence_parallel": "true",
        # Accelerate's DeepSpeed-Ulysses keys at their "off" values are accepted.
        "parallelism_config_sp_size": 1,
        "parallelism_config_sp_backend": "deepspeed",
    }
    config = ParallelismConfig.from_config(block)
    assert (config.dp_replicate_size, config.dp_shard_size, config.tp_size) == (2, -1, 2)
    assert config.sequence_parallel is True
    assert config.cp_handler is not None and config.cp_handler.cp_comm_strategy == "alltoall"
    again = ParallelismConfig.from_config(config.to_config())
    assert again.to_config() == config.to_config()
    assert again.resolve(8) == MeshSizes(dp_replicate=2, dp_shard=2, tp=2)
    # Keys also work without the prefix.
    assert ParallelismConfig.from_config({"tp_size": 2}).tp_size == 2


@pytest.mark.parametrize(
    "block,message",
    [
        ({"parallelism_config_tp_sise": 2}, "did you mean 'parallelism_config_tp_size'"),
        ({"parallelism_config_tp_size": "two"}, "must be an integer"),
        ({"parallelism_config_sp_size": 2}, "DeepSpeed sequence parallelism"),
        ({"parallelism_config_tp_plan": "colwise"}, "must map module-name patterns"),
        ({"parallelism_config_sequence_parallel": "maybe"}, "must be true or false"),
    ],
)
def test_config_block_errors_name_the_key(block, message):
    with pytest.raises(ParallelismConfigError, match=message):
        ParallelismConfig.from_config(block)


def test_pipeline_options_round_trip_through_a_config_block():
    block = {
        "parallelism_config_pp_size": 2,
        "parallelism_config_dp_shard_size": -1,
        "parallelism_config_pp_schedule": "Interleaved1F1B",
        "parallelism_config_pp_microbatches": "8",
        "parallelism_config_pp_stages_per_rank": 2,
        "parallelism_config_pp_split_points": "layers.2, layers.4, layers.6",
        "parallelism_config_pp_balance": "count",
    }
    config = ParallelismConfig.from_config(block)
    assert config.pp_schedule == "interleaved_1f1b" and config.pp_microbatches == 8
    assert config.pp_split_points == ["layers.2", "layers.4", "layers.6"]
    again = ParallelismConfig.from_config(config.to_config())
    assert again.to_config() == config.to_config()
    assert again.resolve(8) == MeshSizes(pp=2, dp_shard=4)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"pp_schedule": "fast"}, "unknown pipeline schedule 'fast'; use one of gpipe, 1f1b"),
        ({"pp_balance": "flops"}, "pp_balance must be one of parameters, count"),
        ({"pp_microbatches": 0}, "pp_microbatches must be a positive integer"),
    ],
)
def test_pipeline_option_errors(kwargs, message):
    with pytest.raises(ParallelismConfigError, match=message):
        ParallelismConfig(pp_size=2, **kwargs)
