"""How an Accelerator is assembled from its arguments and the launcher's configuration:
the process state it joins, accumulation bookkeeping, ``torch.compile`` settings and the
strategy object. Kept apart from the facade so ``accelerator.py`` reads as the API."""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ..optim.elastic import accumulation_for_world
from ..optim.step import StepState
from ..options.kwargs import (
    AutocastKwargs,
    DistributedDataParallelKwargs,
    GradientAccumulationPlugin,
    KwargsHandler,
)
from ..runtime.state import ProcessState
from ..strategies import Strategy, available_strategies, get_strategy_class
from .compile import TorchDynamoPlugin, check_backend, normalise_backend

if TYPE_CHECKING:
    from ..parallel.config import ParallelismConfig
    from ..strategies.deepspeed_plugin import DeepSpeedPlugin
    from ..strategies.fsdp_plugin import FullyShardedDataParallelPlugin

#: distributed_type values in the launcher's configuration -> strategy registry names.
STRATEGY_FOR_TYPE = {
    "DEEPSPEED": "deepspeed",
    "FSDP": "fsdp",
    "MULTI_GPU": "ddp",
    "MULTI_CPU": "ddp",
    "XLA": "xla",
    "NO": None,
}


def xla_strategy_name(requested: str | None, plugin: object) -> str:
    """The strategy on an XLA device: ``xla`` (data parallelism as Accelerate runs it), or
    a clear error for FSDP, DeepSpeed and parallel layouts asked for by plugin or config."""
    from ..strategies.xla import refuse

    if plugin is not None:
        raise refuse(type(plugin).__name__)
    if requested not in (None, "xla", "ddp"):
        raise refuse(requested)
    return "xla"


def warn_about_rng_types(rng_types: Sequence[str] | None) -> None:
    """Accelerate's ``rng_types`` synchronise RNGs each epoch so shuffles agree; slipstream's
    shuffles are seeded alike on every process, so only a request for the global RNGs
    (which would also make dropout identical on every process) changes anything."""
    if rng_types is None:
        return
    if isinstance(rng_types, str):
        rng_types = [rng_types]
    global_rngs = sorted({str(r).lower() for r in rng_types} - {"generator"})
    if global_rngs:
        warnings.warn(
            f"rng_types={list(rng_types)}: slipstream does not synchronise the {global_rngs} "
            "RNG(s) every epoch (its shuffles are seeded alike on every process); call "
            "slipstream.utils.synchronize_rng_states(" + repr(global_rngs) + ") where you "
            "need identical random streams",
            stacklevel=3,
        )


def build_step_state(
    steps: int | None,
    plugin: GradientAccumulationPlugin | None,
    launch: dict[str, Any],
    world_size: int = 1,
) -> StepState:
    """Accumulation bookkeeping from ``gradient_accumulation_steps`` or the plugin; in an
    elastic job that keeps its global batch, scaled from the full size to ``world_size``."""
    if plugin is None:
        if steps is None:
            steps = int(launch.get("gradient_accumulation_steps", 1))
        return StepState(
            gradient_accumulation_steps=accumulation_for_world(steps, launch, world_size)
        )
    if steps is not None:
        raise ValueError(
            "pass gradient_accumulation_steps or gradient_accumulation_plugin, not both: "
            "put the steps in GradientAccumulationPlugin(num_steps=...)"
        )
    if plugin.num_steps is None:
        raise ValueError("GradientAccumulationPlugin needs num_steps=N (micro-batches per step)")
    return StepState(
        gradient_accumulation_steps=accumulation_for_world(plugin.num_steps, launch, world_size),
        sync_with_dataloader=plugin.sync_with_dataloader,
        sync_each_batch=plugin.sync_each_batch,
        average_short_cycles=plugin.average_short_cycles,
    )


def build_dynamo_plugin(
    backend: str | None, plugin: TorchDynamoPlugin | None, launch: dict[str, Any]
) -> TorchDynamoPlugin:
    """``torch.compile`` settings: the argument, else the launcher's ``dynamo_config``."""
    if plugin is None and not launch.get("dynamo_config"):
        plugin = TorchDynamoPlugin()  # accelerate launch's settings, if it started us
    if plugin is None:
        dynamo = launch.get("dynamo_config") or {}
        plugin = TorchDynamoPlugin(
            backend=str(dynamo.get("dynamo_backend", "no")),
            mode=dynamo.get("dynamo_mode"),
            fullgraph=bool(dynamo.get("dynamo_use_fullgraph", False)),
            dynamic=dynamo.get("dynamo_use_dynamic"),
        )
    if backend is not None:
        plugin.backend = backend
    plugin.backend = normalise_backend(plugin.backend)
    check_backend(plugin)
    return plugin


def build_strategy(
    name: str,
    state: ProcessState,
    launch: dict[str, Any],
    handlers: dict[type, KwargsHandler],
    *,
    fsdp_plugin: FullyShardedDataParallelPlugin | None,
    deepspeed_plugin: DeepSpeedPlugin | None,
    autocast: AutocastKwargs,
    mixed_precision: str,
    parallelism: ParallelismConfig | None,
    gradient_accumulation_steps: int,
    split_batches: bool,
) -> Strategy:
    """The strategy object ``name`` with its options from the arguments and the config."""
    options: dict[str, Any] = {}
    if name == "ddp":
        ddp = handlers.get(DistributedDataParallelKwargs)
        if isinstance(ddp, DistributedDataParallelKwargs):
            options = ddp.ddp_options()
            options.update(
                comm_hook=ddp.comm_hook,
                comm_wrapper=ddp.comm_wrapper,
                comm_state_option=ddp.comm_state_option,
                shared_memory_all_reduce=ddp.shared_memory_all_reduce,
            )
    elif name in ("fsdp", "model_parallel"):
        from ..strategies.fsdp_plugin import FullyShardedDataParallelPlugin

        options = {
            "plugin": fsdp_plugin
            or FullyShardedDataParallelPlugin.from_config(launch.get("fsdp_config") or {}),
            "mixed_precision": mixed_precision,
            "convert_outputs_to_fp32": autocast.convert_outputs_to_fp32,
        }
        if name == "model_parallel":
            options["parallelism"] = parallelism
            if fsdp_plugin is None and not launch.get("fsdp_config"):
                options["plugin"] = None  # the strategy's defaults (sharded checkpoints)
    elif name == "deepspeed":
        from ..strategies.deepspeed_plugin import DeepSpeedPlugin

        options = {
            "plugin": deepspeed_plugin
            or DeepSpeedPlugin.from_config(launch.get("deepspeed_config") or {}),
            "mixed_precision": mixed_precision,
            "gradient_accumulation_steps": gradient_accumulation_steps,
            "split_batches": split_batches,
        }
    if name not in available_strategies():
        raise ValueError(
            f"distributed_type={launch.get('distributed_type')} needs the '{name}' strategy, "
            "which this version of slipstream does not provide yet"
        )
    return get_strategy_class(name)(state, **options)
