"""Accelerate's own option objects given to slipstream's Accelerator: converted field by field
into slipstream's classes (as transformers' Trainer passes them), fields without an
equivalent refused by name."""

from __future__ import annotations

import dataclasses

import pytest

accelerate_utils = pytest.importorskip("accelerate.utils")
import accelerate  # noqa: E402

from slipstream import Accelerator, ParallelismConfig  # noqa: E402
from slipstream.accelerator import adopt  # noqa: E402
from slipstream.options import kwargs as ours  # noqa: E402
from slipstream.strategies.fsdp_plugin import FullyShardedDataParallelPlugin  # noqa: E402


def test_accelerates_kwargs_handlers_become_slipstreams_with_the_same_values():
    handlers = adopt.kwargs_handlers(
        [
            accelerate_utils.DistributedDataParallelKwargs(
                find_unused_parameters=True, bucket_cap_mb=5, comm_hook="fp16"
            ),
            accelerate_utils.GradScalerKwargs(init_scale=1024.0),
            ours.AutocastKwargs(enabled=False),  # slipstream's own pass through
        ]
    )
    ddp, scaler, autocast = handlers
    assert type(ddp) is ours.DistributedDataParallelKwargs
    assert ddp.ddp_options() == {"bucket_cap_mb": 5, "find_unused_parameters": True}
    assert ddp.comm_hook is ours.DDPCommunicationHookType.FP16
    assert type(scaler) is ours.GradScalerKwargs and scaler.init_scale == 1024.0
    assert autocast.enabled is False


def test_accelerator_takes_the_objects_transformers_trainer_builds():
    accelerator = Accelerator(
        kwargs_handlers=[
            accelerate_utils.DistributedDataParallelKwargs(find_unused_parameters=True)
        ],
        gradient_accumulation_plugin=accelerate_utils.GradientAccumulationPlugin(
            num_steps=3, sync_each_batch=True
        ),
        dataloader_config=accelerate_utils.DataLoaderConfiguration(even_batches=False, data_seed=7),
        dynamo_plugin=accelerate_utils.TorchDynamoPlugin(backend=None, mode=None, dynamic=None),
        project_config=accelerate_utils.ProjectConfiguration(project_dir="runs", total_limit=2),
    )
    assert accelerator.gradient_accumulation_steps == 3
    assert accelerator.gradient_state.plugin_kwargs["sync_each_batch"] is True
    assert accelerator.even_batches is False and accelerator.dataloader_config.data_seed == 7
    assert accelerator.dynamo_plugin.backend == "no" and accelerator.dynamo_plugin.mode is None
    assert accelerator.project_configuration.total_limit == 2


def test_fields_without_an_equivalent_are_refused_by_name():
    regional = accelerate_utils.TorchDynamoPlugin(backend="eager", use_regional_compilation=True)
    with pytest.raises(ValueError, match="use_regional_compilation"):
        adopt.dynamo_plugin(regional)
    assert adopt.dynamo_plugin(accelerate_utils.TorchDynamoPlugin(disable=True)).backend == "no"
    with pytest.raises(ValueError, match="slipstream has no TERecipeKwargs"):
        adopt.kwargs_handlers([TERecipeKwargs()])
    with pytest.raises(TypeError, match=r"kwargs_handlers takes option objects.*got dict"):
        Accelerator(kwargs_handlers=[{"find_unused_parameters": True}])


@dataclasses.dataclass
class TERecipeKwargs:  # Accelerate's needs Transformer Engine installed to be built
    fp8_format: str = "HYBRID"


@dataclasses.dataclass
class DataLoaderConfiguration:  # a future Accelerate field slipstream does not know
    split_batches: bool = False
    prefetch_to_gpu: bool = False


def test_an_unknown_field_set_away_from_its_default_is_an_error():
    assert adopt.dataloader_config(DataLoaderConfiguration()).split_batches is False
    with pytest.raises(ValueError, match=r"DataLoaderConfiguration\(prefetch_to_gpu=True\)"):
        adopt.dataloader_config(DataLoaderConfiguration(prefetch_to_gpu=True))


def test_accelerates_fsdp_plugin_after_its_post_init():
    # Accelerate turns the policy name into torch's policy function, the offload flag into
    # an offload policy and the state dict type into torch's enum.
    plugin = accelerate_utils.FullyShardedDataParallelPlugin(
        fsdp_version=2,
        auto_wrap_policy="TRANSFORMER_BASED_WRAP",
        transformer_cls_names_to_wrap="LlamaDecoderLayer",
        state_dict_type="SHARDED_STATE_DICT",
        reshard_after_forward=False,
        activation_checkpointing=True,
    )
    assert callable(plugin.auto_wrap_policy)
    converted = adopt.fsdp_plugin(plugin)
    assert isinstance(converted, FullyShardedDataParallelPlugin)
    assert converted.auto_wrap_policy == "transformer_based_wrap"
    assert converted.transformer_cls_names_to_wrap == ["LlamaDecoderLayer"]
    assert converted.sharded_state_dict and converted.reshard_after_forward is False
    assert converted.activation_checkpointing and not converted.cpu_offload
    sized = adopt.fsdp_plugin(
        accelerate_utils.FullyShardedDataParallelPlugin(
            fsdp_version=2, auto_wrap_policy="SIZE_BASED_WRAP", min_num_params=100, cpu_offload=True
        )
    )
    assert (sized.auto_wrap_policy, sized.min_num_params, sized.cpu_offload) == (
        "size_based_wrap",
        100,
        True,
    )
    custom = accelerate_utils.FullyShardedDataParallelPlugin(fsdp_version=2)
    custom.auto_wrap_policy = lambda module, recurse, nonwrapped_numel: False
    with pytest.raises(ValueError, match="custom function"):
        adopt.fsdp_plugin(custom)


def test_accelerates_parallelism_config_and_deepspeed_plugin():
    config = adopt.parallelism_config(accelerate.ParallelismConfig(tp_size=2))
    assert isinstance(config, ParallelismConfig)
    assert (config.dp_replicate_size, config.dp_shard_size, config.tp_size) == (1, 1, 2)
    assert config.resolve(2).tp == 2
    with pytest.raises(ValueError, match="sequence parallelism"):
        adopt.parallelism_config(accelerate.ParallelismConfig(sp_size=2, sp_backend="deepspeed"))
    ds_config = {"zero_optimization": {"stage": 3}, "gradient_clipping": 1.0}
    converted = adopt.deepspeed_plugin(accelerate_utils.DeepSpeedPlugin(hf_ds_config=ds_config))
    assert converted.hf_ds_config["zero_optimization"]["stage"] == 3
    assert converted.zero_stage == 3


def test_state_and_parallelism_members_transformers_reads():
    accelerator = Accelerator()
    assert accelerator.state.fsdp_plugin is None and accelerator.state.deepspeed_plugin is None
    config = ParallelismConfig(tp_size=2)
    assert (config.sp_backend, config.sp_size, config.sp_enabled) == ("deepspeed", 1, False)
    assert config.to_json() == config.to_config()
