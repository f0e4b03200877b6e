"""The Accelerator's side of Accelerate's Megatron-LM options: a ``MegatronLMPlugin`` (given
or read from the launcher's ``megatron_lm_config`` block) becomes the job's
``ParallelismConfig``, activation recomputation of the model's blocks, clipping before every
optimizer step, and prepared batches of ``num_micro_batches`` DataLoader batches.

Example::

    accelerator = Accelerator(megatron_lm_plugin=MegatronLMPlugin(tp_degree=2, pp_degree=2))
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from torch.utils.data import DataLoader, IterableDataset

from ..callbacks.base import Callback

if TYPE_CHECKING:
    from ..parallel.config import ParallelismConfig
    from ..strategies.megatron_plugin import MegatronLMPlugin
# ..strategies.megatron_plugin is imported only where a job uses Megatron-LM's options
# (benchmarks/startup.py: `from slipstream import Accelerator` does not load it).


def megatron_plugin_for(
    given: MegatronLMPlugin | None, launch: Mapping[str, Any]
) -> MegatronLMPlugin | None:
    """The plugin passed to the Accelerator, else the launcher's ``megatron_lm_config``
    block (or ``distributed_type: MEGATRON_LM`` alone: Accelerate's defaults)."""
    block = launch.get("megatron_lm_config") or {}
    wanted = block or str(launch.get("distributed_type", "")).upper() == "MEGATRON_LM"
    if given is None and not wanted:
        return None
    from ..strategies.megatron_plugin import MegatronLMPlugin

    if given is not None:
        if not isinstance(given, MegatronLMPlugin):
            raise TypeError(
                f"megatron_lm_plugin takes a slipstream MegatronLMPlugin, got {type(given).__name__}"
            )
        return given
    return MegatronLMPlugin.from_config(block)


def megatron_layout(
    plugin: MegatronLMPlugin,
    parallelism_config: ParallelismConfig | None,
    deepspeed_plugin: Any,
    state: Any,
    launch: Mapping[str, Any],
) -> ParallelismConfig:
    """The ``ParallelismConfig`` the plugin asks for; refuses a second layout. The options
    without an equivalent are named in one warning (by the main process), unless the
    launcher read them from its config and named them in its note."""
    from ..strategies.megatron_plugin import MegatronLMConfigError

    if parallelism_config is not None or launch.get("parallelism_config"):
        raise MegatronLMConfigError(
            "a Megatron-LM configuration (megatron_lm_plugin or megatron_lm_config) and a "
            "parallelism_config both describe the layout; keep one "
            "(MegatronLMPlugin(...).to_parallelism_config() shows the ParallelismConfig it means)"
        )
    if deepspeed_plugin is not None:
        raise MegatronLMConfigError(
            "megatron_lm_plugin cannot be combined with deepspeed_plugin: it runs on tensor and "
            "pipeline parallelism with FSDP2; pass one of them"
        )
    message = plugin.ignored_message()
    # Read from the launcher's megatron_lm_config block: `slipstream launch` has said it in
    # its own note already (once is enough).
    from_launcher = bool(launch.get("megatron_lm_config"))
    if message and state.is_main_process and not from_launcher:
        warnings.warn(message, stacklevel=3)
    return plugin.to_parallelism_config()


def configure_strategy(strategy: Any, plugin: MegatronLMPlugin | None) -> None:
    """Activation recomputation (``recompute_activations``) of the model's blocks."""
    if plugin is not None and plugin.recompute_activations:
        strategy.plugin.activation_checkpointing = True


class MegatronGradientClipping(Callback):
    """Clips the global gradient norm to ``max_norm`` before every optimizer step, as
    Megatron-LM's optimizer does with ``gradient_clipping``."""

    def __init__(self, max_norm: float) -> None:
        self.max_norm = max_norm

    def on_before_optimizer_step(self, accelerator: Any, optimizer: Any) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        accelerator.clip_grad_norm_(params, self.max_norm)


def callbacks(accelerator: Any) -> list[Callback]:
    """The clipping callback when the Accelerator runs a Megatron-LM configuration."""
    plugin: MegatronLMPlugin | None = accelerator.megatron_lm_plugin
    if plugin is None or not plugin.gradient_clipping:
        return []
    return [MegatronGradientClipping(float(plugin.gradient_clipping))]


def micro_batched(loader: DataLoader[Any], plugin: MegatronLMPlugin | None) -> DataLoader[Any]:
    """``loader`` with ``num_micro_batches`` of its batches in each batch: Accelerate's
    Megatron path takes the DataLoader's batch size as the micro-batch size."""
    factor = plugin.batch_factor if plugin is not None else 1
    if factor == 1:
        return loader
    if loader.batch_size is None:
        from ..strategies.megatron_plugin import MegatronLMConfigError

        raise MegatronLMConfigError(
            f"num_micro_batches={factor}: each prepared batch holds {factor} batches of the "
            "DataLoader (Accelerate's Megatron-LM rule), which needs a DataLoader built with "
            "batch_size=N; this one has a batch_sampler. Build it with batch_size=N, or set "
            "num_micro_batches=1 and size the batches yourself"
        )
    from ..data.prepare import _copied_arguments

    iterable = isinstance(loader.dataset, IterableDataset)
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size * factor,
        sampler=None if iterable else loader.sampler,
        drop_last=loader.drop_last,
        **_copied_arguments(loader),
    )
