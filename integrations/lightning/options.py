"""Which core strategy the Lightning adapter builds, and with which options.

Precedence is the same as the Accelerator's: call arguments (``kind=``, plugins, options) >
the ``config`` given to the strategy (a slipstream/Accelerate config file, a dict or a
:class:`~slipstream.config.LaunchConfig`) > the configuration of ``slipstream launch`` (read
from the launcher environment) > defaults (DDP, fp32).

Example::

    resolved = resolve_options(kind=None, config={"distributed_type": "FSDP"})
    resolved.kind            # "fsdp"
    resolved.fsdp_plugin()   # FullyShardedDataParallelPlugin built from fsdp_config
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from slipstream.config import LaunchConfig, config_from_dict, load_config, read_config_values
from slipstream.env import read_launch_environment
from slipstream.precision import canonical_mode
from slipstream.strategies import DeepSpeedPlugin, FullyShardedDataParallelPlugin

#: The core strategies a Lightning run can use.
KINDS = ("ddp", "fsdp", "deepspeed")

#: Names registered with Lightning's StrategyRegistry -> (description, init arguments).
REGISTERED: dict[str, tuple[str, dict[str, Any]]] = {
    "slipstream": ("slipstream: DDP, FSDP or DeepSpeed as the launcher/config says", {}),
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
        raw = dict(config)
        validated, notes = config_from_dict(raw, where="SlipstreamStrategy(config=...)")
    else:
        raw = read_config_values(config)
        validated, notes = load_config(config)
    for note in notes:
        warnings.warn(note, stacklevel=4)
    full = validated.to_dict()
    return {key: full[key] for key in raw if key in full}


@dataclass(frozen=True)
class ResolvedOptions:
    """What the adapter builds: the kind, its plugin options and the default precision."""

    kind: str
    #: The precision named by the config or launcher (canonical), None when unset.
    mixed_precision: str | None
    fsdp_config: dict[str, Any] = field(default_factory=dict)
    deepspeed_config: dict[str, Any] = field(default_factory=dict)

    def fsdp_plugin(self) -> FullyShardedDataParallelPlugin:
        return FullyShardedDataParallelPlugin.from_config(self.fsdp_config)

    def deepspeed_plugin(self) -> DeepSpeedPlugin:
        return DeepSpeedPlugin.from_config(self.deepspeed_config)


def unknown_kind_message(kind: object) -> str:
    return (
        f"unknown slipstream strategy kind {kind!r}; choose one of {', '.join(KINDS)} "
        f"(Trainer(strategy=...) names: {', '.join(REGISTERED)})"
    )


def normalise_kind(kind: str) -> str:
    """``"ddp"``, ``"fsdp"`` or ``"deepspeed"`` (also from a registered name or a
    distributed_type); ValueError listing the valid names otherwise."""
    text = str(kind).strip()
    lowered = text.lower()
    if lowered in KINDS:
        return lowered
    if text.upper() in _KIND_FOR_TYPE:
        return _KIND_FOR_TYPE[text.upper()]
    if lowered in REGISTERED and "kind" in REGISTERED[lowered][1]:
        return str(REGISTERED[lowered][1]["kind"])
    raise ValueError(unknown_kind_message(kind))


def resolve_options(
    kind: str | None,
    config: ConfigInput,
    fsdp_options: Mapping[str, Any] | None = None,
    deepspeed_options: Mapping[str, Any] | None = None,
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
    )
