"""Accelerate's own option objects, taken as slipstream's.

Code written for Accelerate builds ``accelerate.utils.DistributedDataParallelKwargs``,
``GradientAccumulationPlugin``, ``DataLoaderConfiguration``, ``TorchDynamoPlugin``,
``FullyShardedDataParallelPlugin`` or ``accelerate.ParallelismConfig`` objects and hands them
to the Accelerator (``transformers.Trainer`` does so for every run). Their names and fields
match slipstream's, their classes do not: each is converted here, field by field, into
slipstream's class of the same name. A field slipstream has no equivalent for is accepted
at its default and refused with an error naming it otherwise, so nothing is dropped
silently. Accelerate is never imported: the objects are recognised by their class names.

Example::

    from accelerate.utils import DistributedDataParallelKwargs
    Accelerator(kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)])
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TypeVar

from ..options import kwargs as options
from .compile import TorchDynamoPlugin

if TYPE_CHECKING:
    from ..parallel.config import ParallelismConfig
    from ..strategies.deepspeed_plugin import DeepSpeedPlugin
    from ..strategies.fsdp_plugin import FullyShardedDataParallelPlugin

T = TypeVar("T")

#: The kwargs handlers slipstream has, by class name.
HANDLERS: dict[str, type[options.KwargsHandler]] = {
    cls.__name__: cls
    for cls in (
        options.DistributedDataParallelKwargs,
        options.InitProcessGroupKwargs,
        options.AutocastKwargs,
        options.GradScalerKwargs,
        options.ProfileKwargs,
    )
}
# Accelerate's handlers that slipstream has no counterpart for, and what to use instead.
_NO_HANDLER = {
    "FP8RecipeKwargs": 'mixed_precision="fp8" (torchao\'s float8 layers) needs no recipe',
    "AORecipeKwargs": 'mixed_precision="fp8" (torchao\'s float8 layers) needs no recipe',
    "TERecipeKwargs": "there is no Transformer Engine backend",
    "MSAMPRecipeKwargs": "there is no MS-AMP backend",
}


def _plain(value: Any) -> Any:
    """An enum member of Accelerate's as its value (slipstream's fields take strings)."""
    return value.value if isinstance(value, enum.Enum) and isinstance(value, str) else value


def _default_of(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


def _convert(obj: Any, target: type[T], argument: str, ignored: Sequence[str] = ()) -> T:
    """``obj`` (Accelerate's ``target.__name__``) as slipstream's ``target``, field by field."""
    name = target.__name__
    if type(obj).__name__ != name or not dataclasses.is_dataclass(obj):
        raise TypeError(f"{argument} takes a {name}; got {type(obj).__name__}")
    known = {f.name for f in dataclasses.fields(target) if f.init}  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    for field in dataclasses.fields(obj):
        value = getattr(obj, field.name)
        if field.name in known:
            values[field.name] = _plain(value)
        elif field.name not in ignored and value != _default_of(field):
            raise ValueError(
                f"{argument}: Accelerate's {name}({field.name}={value!r}) has no slipstream "
                f"equivalent; leave {field.name} at its default (see docs/compatibility.md)"
            )
    return target(**values)


def kwargs_handlers(handlers: Sequence[Any] | None) -> list[options.KwargsHandler]:
    """The handlers as slipstream's: its own pass through, Accelerate's are converted."""
    adopted: list[options.KwargsHandler] = []
    for handler in handlers or ():
        if isinstance(handler, options.KwargsHandler):
            adopted.append(handler)
            continue
        name = type(handler).__name__
        if name in HANDLERS and dataclasses.is_dataclass(handler):
            adopted.append(_convert(handler, HANDLERS[name], "kwargs_handlers"))
        elif _NO_HANDLER.get(name):
            raise ValueError(f"kwargs_handlers: slipstream has no {name}: {_NO_HANDLER[name]}")
        else:
            raise TypeError(
                "kwargs_handlers takes option objects such as DistributedDataParallelKwargs "
                f"(slipstream's or Accelerate's); got {name}"
            )
    return adopted


def dataloader_config(config: Any) -> options.DataLoaderConfiguration | None:
    if config is None or isinstance(config, options.DataLoaderConfiguration):
        return config
    return _convert(config, options.DataLoaderConfiguration, "dataloader_config")


def accumulation_plugin(plugin: Any) -> options.GradientAccumulationPlugin | None:
    if plugin is None or isinstance(plugin, options.GradientAccumulationPlugin):
        return plugin
    return _convert(plugin, options.GradientAccumulationPlugin, "gradient_accumulation_plugin")


def project_config(config: Any) -> options.ProjectConfiguration | None:
    if config is None or isinstance(config, options.ProjectConfiguration):
        return config
    return _convert(config, options.ProjectConfiguration, "project_config")


def dynamo_plugin(plugin: Any) -> TorchDynamoPlugin | None:
    """Accelerate's ``TorchDynamoPlugin``: its backend enum as a name, ``disable=True`` as
    backend ``"no"``; regional compilation is refused."""
    if plugin is None or isinstance(plugin, TorchDynamoPlugin):
        return plugin
    if getattr(plugin, "use_regional_compilation", False):
        raise ValueError(
            "dynamo_plugin: use_regional_compilation is not provided; slipstream compiles the "
            "whole prepared model (set use_regional_compilation=False)"
        )
    converted = _convert(
        plugin, TorchDynamoPlugin, "dynamo_plugin", ("disable", "use_regional_compilation")
    )
    if getattr(plugin, "disable", False):
        converted.backend = "no"
    if str(converted.backend).lower() == "no" and converted.mode == "default":
        converted.mode = None  # Accelerate's placeholder when nothing is compiled
    return converted


def _wrap_policy(policy: Any) -> tuple[str | None, list[str], int]:
    """(policy name, layer class names, min_num_params) of Accelerate's ``auto_wrap_policy``,
    which its ``__post_init__`` turns into torch's policy function (or a partial of it)."""
    if policy is None or isinstance(policy, str):
        return policy, [], 0
    function = policy.func if isinstance(policy, functools.partial) else policy
    keywords = policy.keywords if isinstance(policy, functools.partial) else {}
    name = getattr(function, "__name__", "")
    if name == "transformer_auto_wrap_policy":
        classes = keywords.get("transformer_layer_cls") or ()
        return "transformer_based_wrap", sorted(c.__name__ for c in classes), 0
    if name == "size_based_auto_wrap_policy":
        return "size_based_wrap", [], int(keywords.get("min_num_params", 0))
    raise ValueError(
        f"fsdp_plugin: auto_wrap_policy={policy!r} is a custom function; slipstream's FSDP2 "
        "wraps by policy name: 'transformer_based_wrap' (with transformer_cls_names_to_wrap), "
        "'size_based_wrap' (with min_num_params) or 'no_wrap'"
    )


def _offloads(value: Any) -> bool:
    """Accelerate keeps ``cpu_offload`` as torch's ``CPUOffloadPolicy`` / ``OffloadPolicy``
    (FSDP2) or ``CPUOffload`` (FSDP1)."""
    if isinstance(value, bool) or value is None:
        return bool(value)
    if type(value).__name__ == "CPUOffloadPolicy":
        return True
    return bool(getattr(value, "offload_params", False))


def fsdp_plugin(plugin: Any) -> FullyShardedDataParallelPlugin | None:
    """Accelerate's ``FullyShardedDataParallelPlugin`` after its ``__post_init__`` (policy
    functions, torch's enums and offload policies) as slipstream's FSDP2 options. FSDP1's
    tuning knobs (prefetching, ``use_orig_params``, ``sync_module_states``, ...) have nothing
    to set under FSDP2 and are ignored, as in ``fsdp_config`` files."""
    from ..strategies.fsdp_plugin import FullyShardedDataParallelPlugin

    if plugin is None or isinstance(plugin, FullyShardedDataParallelPlugin):
        return plugin
    if type(plugin).__name__ != "FullyShardedDataParallelPlugin":
        raise TypeError(f"fsdp_plugin takes a FullyShardedDataParallelPlugin; got {plugin!r}")
    for name in ("ignored_modules", "param_init_fn"):
        if getattr(plugin, name, None) is not None:
            raise ValueError(
                f"fsdp_plugin: {name} is not provided by slipstream's FSDP2 strategy; leave it None"
            )
    if getattr(plugin, "activation_checkpointing_offload", False):
        raise ValueError(
            "fsdp_plugin: activation_checkpointing_offload is not provided; use "
            "activation_checkpointing=True alone"
        )
    policy, classes, min_params = _wrap_policy(plugin.auto_wrap_policy)
    names = getattr(plugin, "transformer_cls_names_to_wrap", None) or classes
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    version = int(getattr(plugin, "fsdp_version", 2) or 2)
    return FullyShardedDataParallelPlugin(
        auto_wrap_policy=policy,
        transformer_cls_names_to_wrap=list(names),
        min_num_params=int(getattr(plugin, "min_num_params", None) or min_params),
        reshard_after_forward=plugin.reshard_after_forward if version == 2 else None,
        cpu_offload=_offloads(getattr(plugin, "cpu_offload", False)),
        state_dict_type=plugin.state_dict_type or "FULL_STATE_DICT",
        activation_checkpointing=bool(getattr(plugin, "activation_checkpointing", False)),
        mixed_precision_policy=getattr(plugin, "mixed_precision_policy", None),
        fsdp_version=version,
        sharding_strategy=getattr(plugin, "sharding_strategy", None) if version != 2 else None,
    )


def deepspeed_plugin(plugin: Any) -> DeepSpeedPlugin | None:
    """Accelerate's ``DeepSpeedPlugin`` as slipstream's: its DeepSpeed config (the JSON
    ``transformers.TrainingArguments(deepspeed=...)`` wrote, or the one its short options
    built) is the whole configuration."""
    from ..strategies.deepspeed_plugin import DeepSpeedPlugin

    if plugin is None or isinstance(plugin, DeepSpeedPlugin):
        return plugin
    if type(plugin).__name__ != "DeepSpeedPlugin":
        raise TypeError(f"deepspeed_plugin takes a DeepSpeedPlugin; got {plugin!r}")
    config = getattr(plugin, "deepspeed_config", None)
    if not isinstance(config, dict):
        config = getattr(getattr(plugin, "hf_ds_config", None), "config", None)
    if not isinstance(config, dict):
        raise TypeError(f"deepspeed_plugin: {plugin!r} carries no DeepSpeed config")
    return DeepSpeedPlugin(hf_ds_config=dict(config))


def parallelism_config(config: Any) -> ParallelismConfig | None:
    """``accelerate.ParallelismConfig`` as slipstream's: the same sizes (Accelerate writes 1
    for every size left out), ``cp_backend`` and the context-parallel options. DeepSpeed's
    sequence parallelism (``sp_size > 1``) is refused."""
    from ..parallel.config import ParallelismConfig, TorchContextParallelConfig
    from ..parallel.errors import ParallelismConfigError

    if config is None or isinstance(config, ParallelismConfig):
        return config
    if type(config).__name__ != "ParallelismConfig":
        raise TypeError(f"parallelism_config takes a ParallelismConfig; got {config!r}")
    if (getattr(config, "sp_size", None) or 1) > 1:
        raise ParallelismConfigError(
            "parallelism_config: sp_size > 1 asks for DeepSpeed sequence parallelism (Ulysses), "
            "which slipstream does not provide; use cp_size for long sequences"
        )
    sizes: dict[str, Any] = {
        f"{dim}_size": getattr(config, f"{dim}_size", None)
        for dim in ("dp_replicate", "dp_shard", "tp", "cp")
    }
    handler = getattr(config, "cp_handler", None)
    strategy = getattr(handler, "cp_comm_strategy", None)
    return ParallelismConfig(
        **sizes,
        cp_backend=getattr(config, "cp_backend", None) or "torch",
        cp_handler=TorchContextParallelConfig(cp_comm_strategy=strategy) if strategy else None,
    )
