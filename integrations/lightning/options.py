"""Which core strategy the Lightning adapter builds, and with which options.

Precedence is the same as the Accelerator's: call arguments (``kind=``,
``parallelism_config=``, plugins, options) > the ``config`` given to the strategy (a
slipstream/Accelerate config file, a dict or a :class:`~slipstream.launcher.config.LaunchConfig`) >
the configuration of ``slipstream launch`` (read from the launcher environment) > defaults
(DDP, fp32). As with the Accelerator, a parallel layout (a ``ParallelismConfig`` or a
``parallelism_config:`` block) selects the core ``model_parallel`` strategy unless DeepSpeed
or DDP is named explicitly.

Example::

    resolved = resolve_options(kind=None, config={"distributed_type": "FSDP"})
    resolved.kind            # "fsdp"
    resolved.fsdp_plugin()   # FullyShardedDataParallelPlugin built from fsdp_config

    resolve_options(None, {"parallelism_config": {"parallelism_config_tp_size": 2}}).kind
    # "model_parallel"
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from slipstream.launcher.config import (
    ConfigError,
    LaunchConfig,
    config_from_dict,
    read_config_values,
)
from slipstream.parallel import ParallelismConfig
from slipstream.precision import canonical_mode
from slipstream.runtime.env import read_launch_environment
from slipstream.strategies import DeepSpeedPlugin, FullyShardedDataParallelPlugin

#: The core strategies a Lightning run can use.
KINDS = ("ddp", "fsdp", "deepspeed", "model_parallel")

#: Names registered with Lightning's StrategyRegistry -> (description, init arguments).
REGISTERED: dict[str, tuple[str, dict[str, Any]]] = {
    "slipstream": (
        "slipstream: DDP, FSDP, DeepSpeed or a parallel layout as the launcher/config says",
        {},
    ),
    "slipstream_ddp": ("slipstream DDP", {"kind": "ddp"}),
    "slipstream_fsdp": ("slipstream FSDP2", {"kind": "fsdp"}),
    "slipstream_deepspeed": ("slipstream DeepSpeed ZeRO", {"kind": "deepspeed"}),
    "slipstream_deepspeed_stage_1": (
        "slipstream DeepSpeed ZeRO stage 1",
        {"kind": "deepspeed", "deepspeed_options": {"zero_stage": 1}},
    ),
    "slipstream_deepspeed_stage_2": (
        "slipstream DeepSpeed ZeRO stage 2",
        {"kind": "deepspeed", "deepspeed_options": {"zero_stage": 2}},
    ),
    "slipstream_deepspeed_stage_3": (
        "slipstream DeepSpeed ZeRO stage 3",
        {"kind": "deepspeed", "deepspeed_options": {"zero_stage": 3}},
    ),
    "slipstream_deepspeed_stage_3_offload": (
        "slipstream DeepSpeed ZeRO stage 3, parameters and optimizer offloaded to the CPU",
        {
            "kind": "deepspeed",
            "deepspeed_options": {
                "zero_stage": 3,
                "offload_optimizer_device": "cpu",
                "offload_param_device": "cpu",
            },
        },
    ),
    "slipstream_model_parallel": (
        "slipstream N-D parallelism: tensor/expert parallel inside FSDP2/HSDP over a device mesh",
        {"kind": "model_parallel"},
    ),
}

# distributed_type values of a config -> kinds (a single process is still "ddp": the adapter
# then simply does not wrap the model).
_KIND_FOR_TYPE = {
    "DEEPSPEED": "deepspeed",
    "FSDP": "fsdp",
    "MULTI_GPU": "ddp",
    "MULTI_CPU": "ddp",
    "NO": "ddp",
}

ConfigInput = str | os.PathLike[str] | Mapping[str, Any] | LaunchConfig | None


def _config_values(config: ConfigInput) -> dict[str, Any]:
    """The keys the ``config`` argument really sets (validated; defaults are not included,
    so the launcher's values still apply to keys the config leaves out)."""
    if config is None:
        return {}
    if isinstance(config, LaunchConfig):
        return config.to_dict()
    if isinstance(config, Mapping):
        raw, where = dict(config), "SlipstreamStrategy(config=...)"
    else:
        raw, where = read_config_values(config), os.fspath(config)
    # The layout is checked against the Trainer's processes (devices x num_nodes) when the
    # Trainer is built, not against the config's num_processes, which a Trainer ignores.
    layout = raw.pop("parallelism_config", None) or {}
    validated, notes = config_from_dict(raw, where=where)
    for note in notes:
        warnings.warn(note, stacklevel=4)
    full = validated.to_dict()
    values = {key: full[key] for key in raw if key in full}
    if layout:
        _parallelism_from_block(layout, where)  # unknown keys and bad values fail here
        values["parallelism_config"] = dict(layout)
    return values


def _parallelism_from_block(block: Mapping[str, Any], where: str) -> ParallelismConfig:
    if not isinstance(block, Mapping):
        raise ConfigError(
            f"{where}: parallelism_config must map parallelism_config_* keys to values, got "
            f"{block!r}"
        )
    try:
        parallelism = ParallelismConfig.from_config(block)
    except ConfigError as error:
        raise ConfigError(f"{where}: {error}") from None
    return parallelism


@dataclass(frozen=True)
class ResolvedOptions:
    """What the adapter builds: the kind, its plugin options and the default precision."""

    kind: str
    #: The precision named by the config or launcher (canonical), None when unset.
    mixed_precision: str | None
    fsdp_config: dict[str, Any] = field(default_factory=dict)
    deepspeed_config: dict[str, Any] = field(default_factory=dict)
    #: The process layout of kind "model_parallel" (None for the other kinds).
    parallelism: ParallelismConfig | None = None

    def fsdp_plugin(self) -> FullyShardedDataParallelPlugin:
        return FullyShardedDataParallelPlugin.from_config(self.fsdp_config)

    def model_parallel_plugin(self) -> FullyShardedDataParallelPlugin | None:
        """The FSDP2 options under the mesh; None (the core strategy's defaults: sharded
        checkpoints, transformers blocks as units) when nothing sets any."""
        return self.fsdp_plugin() if self.fsdp_config else None

    def deepspeed_plugin(self) -> DeepSpeedPlugin:
        return DeepSpeedPlugin.from_config(self.deepspeed_config)


def unknown_kind_message(kind: object) -> str:
    return (
        f"unknown slipstream strategy kind {kind!r}; choose one of {', '.join(KINDS)} "
        f"(Trainer(strategy=...) names: {', '.join(REGISTERED)})"
    )


def normalise_kind(kind: str) -> str:
    """``"ddp"``, ``"fsdp"``, ``"deepspeed"`` or ``"model_parallel"`` (also from a registered
    name or a distributed_type); ValueError listing the valid names otherwise."""
    text = str(kind).strip()
    lowered = text.lower()
    if lowered in KINDS:
        return lowered
    if text.upper() in _KIND_FOR_TYPE:
        return _KIND_FOR_TYPE[text.upper()]
    if lowered in REGISTERED and "kind" in REGISTERED[lowered][1]:
        return str(REGISTERED[lowered][1]["kind"])
    raise ValueError(unknown_kind_message(kind))


def _choose_layout(
    kind: str | None,
    chosen: str,
    parallelism: ParallelismConfig | None,
    block: Mapping[str, Any],
) -> tuple[str, ParallelismConfig | None]:
    """The kind once a parallel layout is taken into account, and that layout."""
    if parallelism is not None:
        if not isinstance(parallelism, ParallelismConfig):
            raise TypeError(
                "parallelism_config takes a slipstream.ParallelismConfig, got "
                f"{type(parallelism).__name__}"
            )
        if kind is not None and chosen in ("ddp", "deepspeed"):
            raise ValueError(
                f"parallelism_config arranges the processes in a device mesh, which kind={kind!r} "
                "does not use; use kind='model_parallel' (tensor parallelism inside FSDP2) or "
                "drop parallelism_config"
            )
        return "model_parallel", parallelism
    if not block:
        return chosen, (ParallelismConfig() if chosen == "model_parallel" else None)
    # A layout from the config or the launcher applies unless DDP or DeepSpeed is named;
    # kind="ddp" in the call outranks the config.
    layout = _parallelism_from_block(block, "the configuration")
    if chosen == "deepspeed":
        # DeepSpeed shards over every process itself: only plain data parallelism fits.
        if layout.model_parallel or (layout.dp_replicate_enabled and layout.dp_shard_enabled):
            raise ConfigError(
                "parallelism_config asks for tensor/context/pipeline/expert parallelism or HSDP, "
                "which cannot be combined with DeepSpeed (it shards over all processes itself); drop "
                "those sizes, or use kind='model_parallel' (FSDP2) instead of DeepSpeed"
            )
        return chosen, None
    if kind is not None and chosen == "ddp":
        return chosen, None
    return "model_parallel", layout


def resolve_options(
    kind: str | None,
    config: ConfigInput,
    fsdp_options: Mapping[str, Any] | None = None,
    deepspeed_options: Mapping[str, Any] | None = None,
    parallelism: ParallelismConfig | None = None,
) -> ResolvedOptions:
    """Merge the call arguments, the ``config`` argument and the launcher's configuration."""
    launched = dict(read_launch_environment().launch_config)
    given = _config_values(config)

    def pick(key: str) -> Any:
        return given[key] if key in given else launched.get(key)

    if kind is not None:
        chosen = normalise_kind(kind)
    else:
        distributed = pick("distributed_type")
        chosen = _KIND_FOR_TYPE.get(str(distributed).upper(), "ddp") if distributed else "ddp"
    chosen, layout = _choose_layout(kind, chosen, parallelism, pick("parallelism_config") or {})
    precision = pick("mixed_precision")
    mode = canonical_mode(precision) if precision not in (None, "") else None
    fsdp = {
        **dict(launched.get("fsdp_config") or {}),
        **dict(given.get("fsdp_config") or {}),
        **dict(fsdp_options or {}),
    }
    deepspeed = {
        **dict(launched.get("deepspeed_config") or {}),
        **dict(given.get("deepspeed_config") or {}),
        **dict(deepspeed_options or {}),
    }
    return ResolvedOptions(
        kind=chosen,
        mixed_precision=None if mode == "no" else mode,
        fsdp_config=fsdp,
        deepspeed_config=deepspeed,
        parallelism=layout,
    )
