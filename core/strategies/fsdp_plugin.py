"""FullyShardedDataParallelPlugin: the FSDP2 options, readable from Accelerate's fsdp_config.

Example::

    plugin = FullyShardedDataParallelPlugin(
        auto_wrap_policy="transformer_based_wrap",
        transformer_cls_names_to_wrap=["Block"],
        state_dict_type="SHARDED_STATE_DICT",
    )
    accelerator = Accelerator(fsdp_plugin=plugin)

The same settings as YAML (``distributed_type: FSDP``)::

    fsdp_config:
      fsdp_version: 2
      fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
      fsdp_transformer_layer_cls_to_wrap: Block
      fsdp_reshard_after_forward: true
      fsdp_offload_params: false
      fsdp_state_dict_type: SHARDED_STATE_DICT
      fsdp_activation_checkpointing: false
"""

from __future__ import annotations

import difflib
import enum
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

WRAP_POLICIES = ("transformer_based_wrap", "size_based_wrap", "no_wrap")
STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")
#: FSDP1's sharding strategies (torch's ``ShardingStrategy``, numbered 1-5 in this order) as
#: FSDP2's ``reshard_after_forward``: the mapping of Accelerate's ``accelerate to-fsdp2``.
SHARDING_STRATEGIES = {
    "FULL_SHARD": True,
    "SHARD_GRAD_OP": False,
    "NO_SHARD": False,
    "HYBRID_SHARD": True,
    "HYBRID_SHARD_ZERO2": False,
}
# What FSDP2 over all processes does not reproduce of these, and what does.
_SHARDED_ANYWAY = {
    "NO_SHARD": "for replicated parameters use DDP (no fsdp_plugin)",
    "HYBRID_SHARD": "for sharding within groups replicated across them use "
    "ParallelismConfig(dp_replicate_size=..., dp_shard_size=...), or in a config file "
    "parallelism_config_dp_replicate_size / parallelism_config_dp_shard_size (the same "
    "flags on slipstream launch)",
}
_SHARDED_ANYWAY["HYBRID_SHARD_ZERO2"] = _SHARDED_ANYWAY["HYBRID_SHARD"]
# FSDP1 options that FSDP2 handles by itself; accepted from old config files and ignored.
_FSDP1_ONLY = {
    "backward_prefetch",
    "forward_prefetch",
    "use_orig_params",
    "sync_module_states",
    "cpu_ram_efficient_loading",
}
_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in _TRUE
    return bool(value)


class StateDictTypeName(str):
    """A state dict type's name (``"SHARDED_STATE_DICT"``) that also equals torch's
    ``StateDictType`` member of that name: Accelerate keeps the enum, and code written for
    it compares ``plugin.state_dict_type == StateDictType.SHARDED_STATE_DICT``."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        return str.__eq__(self, other.name if isinstance(other, enum.Enum) else other) is True

    def __ne__(self, other: object) -> bool:
        return not self == other

    __hash__ = str.__hash__


def sharding_strategy_name(value: Any) -> str:
    """``"FULL_SHARD"`` from a name (any case), a number 1-5 or torch's ``ShardingStrategy``."""
    raw = value.name if isinstance(value, enum.Enum) else value
    names = list(SHARDING_STRATEGIES)
    if isinstance(raw, int) and not isinstance(raw, bool) and 1 <= raw <= len(names):
        return names[raw - 1]
    text = str(raw).strip().upper().lstrip("_")
    if text.isdigit() and 1 <= int(text) <= len(names):
        return names[int(text) - 1]
    if text not in SHARDING_STRATEGIES:
        raise ValueError(
            f"sharding_strategy must be one of {', '.join(names)} (or torch's ShardingStrategy, "
            f"or 1-{len(names)}), got {value!r}"
        )
    return text


def _reshard_flag(value: Any) -> bool:
    """``reshard_after_forward`` from a bool, true/false, or an FSDP1 sharding strategy (what
    Accelerate's FSDP1 configs write under ``fsdp_reshard_after_forward``)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in (*_TRUE, *_FALSE):
        return value.strip().lower() in _TRUE
    return SHARDING_STRATEGIES[sharding_strategy_name(value)]


def _state_dict_type_name(value: Any) -> StateDictTypeName:
    """From a name (any case, ``FULL``/``SHARDED`` short), torch's ``StateDictType`` or its
    number (1 full, 2 local, 3 sharded)."""
    raw = value.name if isinstance(value, enum.Enum) else str(value).strip().upper()
    numbered = {"1": "FULL_STATE_DICT", "2": "LOCAL_STATE_DICT", "3": "SHARDED_STATE_DICT"}
    name = numbered.get(raw, raw)
    if name in ("FULL", "SHARDED", "LOCAL"):
        name += "_STATE_DICT"
    if name == "LOCAL_STATE_DICT":
        raise ValueError(
            "FSDP2 does not support LOCAL_STATE_DICT; use SHARDED_STATE_DICT (one part per "
            "process, loadable by any number of processes) or FULL_STATE_DICT"
        )
    if name not in STATE_DICT_TYPES:
        raise ValueError(
            f"state_dict_type must be FULL_STATE_DICT or SHARDED_STATE_DICT, got {value!r}"
        )
    return StateDictTypeName(name)


@dataclass
class FullyShardedDataParallelPlugin:
    """Options of the FSDP2 (``torch.distributed.fsdp.fully_shard``) strategy.

    Args:
        auto_wrap_policy: which submodules are sharded as their own unit besides the root:
            ``"transformer_based_wrap"`` (classes named in ``transformer_cls_names_to_wrap``),
            ``"size_based_wrap"`` (modules with at least ``min_num_params`` parameters) or
            ``"no_wrap"`` (the root only). ``None`` picks transformer-based when class names
            are given, size-based when ``min_num_params`` is, else no wrap.
            Transformer-based without class names takes the model's ``_no_split_modules``
            (Hugging Face models name their layers there).
        reshard_after_forward: free gathered parameters after forward (full shard, less
            memory) or keep them until backward (shard-grad-op behaviour, less communication).
            Default ``True``; FSDP1 strategy names are accepted too (see below).
        cpu_offload: keep parameters, gradients and optimizer state on the CPU.
        state_dict_type: ``"SHARDED_STATE_DICT"`` (save_state writes one part per process
            with torch.distributed.checkpoint) or ``"FULL_STATE_DICT"`` (gathered to the main
            process); torch's ``StateDictType`` members work too, and the value compares
            equal to them.
        sharding_strategy: Accelerate's FSDP1 option (a name, number or torch's
            ``ShardingStrategy``), mapped as ``accelerate to-fsdp2`` does: ``FULL_SHARD`` and
            ``HYBRID_SHARD`` reshard after forward, ``SHARD_GRAD_OP``, ``HYBRID_SHARD_ZERO2``
            and ``NO_SHARD`` do not. FSDP2 shards over all processes either way (a warning
            says so for NO_SHARD and the hybrid ones).
        activation_checkpointing: recompute the wrapped layers' activations in backward.
        mixed_precision_policy: overrides the policy derived from ``mixed_precision``.
    """

    auto_wrap_policy: str | None = None
    transformer_cls_names_to_wrap: list[str] = field(default_factory=list)
    min_num_params: int = 0
    #: ``None``: decided by ``sharding_strategy``, else ``True``; a bool after construction.
    reshard_after_forward: bool | None = None
    cpu_offload: bool = False
    state_dict_type: str = "FULL_STATE_DICT"
    activation_checkpointing: bool = False
    mixed_precision_policy: Any = None
    fsdp_version: int = 2
    sharding_strategy: str | None = None

    def __post_init__(self) -> None:
        self._resolve_sharding()
        if isinstance(self.transformer_cls_names_to_wrap, str):
            self.transformer_cls_names_to_wrap = [
                name.strip() for name in self.transformer_cls_names_to_wrap.split(",") if name
            ]
        if self.auto_wrap_policy is None:
            if self.transformer_cls_names_to_wrap:
                self.auto_wrap_policy = "transformer_based_wrap"
            elif self.min_num_params:
                self.auto_wrap_policy = "size_based_wrap"
            else:
                self.auto_wrap_policy = "no_wrap"
        self.auto_wrap_policy = self.auto_wrap_policy.lower()
        if self.auto_wrap_policy not in WRAP_POLICIES:
            raise ValueError(
                f"auto_wrap_policy must be one of {', '.join(WRAP_POLICIES)} (any case), got "
                f"{self.auto_wrap_policy!r}"
            )
        if self.auto_wrap_policy == "size_based_wrap" and self.min_num_params <= 0:
            raise ValueError(
                "auto_wrap_policy size_based_wrap needs min_num_params (fsdp_min_num_params) > 0"
            )
        self.state_dict_type = _state_dict_type_name(self.state_dict_type)
        if int(self.fsdp_version) != 2:
            raise ValueError(
                f"fsdp_version {self.fsdp_version} is not supported: slipstream implements FSDP "
                "with FSDP2 (torch.distributed.fsdp.fully_shard); set fsdp_version: 2"
            )

    def _resolve_sharding(self) -> None:
        if self.sharding_strategy is None:
            self.reshard_after_forward = (
                True
                if self.reshard_after_forward is None
                else _reshard_flag(self.reshard_after_forward)
            )
            return
        name = self.sharding_strategy = sharding_strategy_name(self.sharding_strategy)
        mapped = SHARDING_STRATEGIES[name]
        if (
            self.reshard_after_forward is not None
            and _reshard_flag(self.reshard_after_forward) != mapped
        ):
            raise ValueError(
                f"sharding_strategy={name} means reshard_after_forward={mapped}, but "
                f"reshard_after_forward={self.reshard_after_forward!r} was given; pass one of them"
            )
        self.reshard_after_forward = mapped
        if name in _SHARDED_ANYWAY:
            warnings.warn(
                f"sharding_strategy={name} is FSDP1's; slipstream's FSDP2 shards parameters over "
                f"all processes (reshard_after_forward={mapped}): {_SHARDED_ANYWAY[name]}",
                stacklevel=4,
            )

    @property
    def sharded_state_dict(self) -> bool:
        return self.state_dict_type == "SHARDED_STATE_DICT"

    def wrap_classes(self, model: nn.Module) -> list[str]:
        """The layer classes transformer-based wrapping shards as their own units: the names
        given, else the model's ``_no_split_modules``. Raises when there are none."""
        names = list(self.transformer_cls_names_to_wrap) or list(
            getattr(model, "_no_split_modules", None) or []
        )
        if not names:
            raise ValueError(
                "auto_wrap_policy transformer_based_wrap needs transformer_cls_names_to_wrap "
                f"(fsdp_transformer_layer_cls_to_wrap), e.g. 'GPT2Block'; {type(model).__name__} "
                "names none in _no_split_modules"
            )
        return names

    def set_auto_wrap_policy(self, model: nn.Module) -> None:
        """Settle the wrap policy for ``model``, as Accelerate's method does: transformer-based
        wrapping takes the model's ``_no_split_modules`` when no class names are given, and
        the classes must exist in the model. ``prepare`` does the same by itself; the other
        policies need nothing from the model.

        Example::

            plugin = FullyShardedDataParallelPlugin(auto_wrap_policy="transformer_based_wrap")
            plugin.set_auto_wrap_policy(model)   # e.g. ["LlamaDecoderLayer"]
            print(plugin.transformer_cls_names_to_wrap)
        """
        if self.auto_wrap_policy == "transformer_based_wrap":
            names = self.wrap_classes(model)
            present = {type(m).__name__ for m in model.modules()}
            missing = [name for name in names if name not in present]
            if missing:
                raise ValueError(
                    f"could not find the transformer layer class(es) {missing} in "
                    f"{type(model).__name__}; its module classes are: {', '.join(sorted(present))}"
                )
            self.transformer_cls_names_to_wrap = names

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> FullyShardedDataParallelPlugin:
        """Build from an ``fsdp_config`` block (keys with or without the ``fsdp_`` prefix)."""
        renames = {
            "transformer_layer_cls_to_wrap": "transformer_cls_names_to_wrap",
            "offload_params": "cpu_offload",
        }
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        for raw_key, value in config.items():
            key = raw_key if raw_key in known else raw_key.removeprefix("fsdp_")
            key = renames.get(key, key)
            if key in _FSDP1_ONLY:
                continue
            if key not in known:
                spelled = [f"fsdp_{k}" for k in [*known, *renames]] + ["fsdp_version"]
                close = difflib.get_close_matches(f"fsdp_{key}", spelled, 1, cutoff=0.8)
                hint = f" (did you mean '{close[0]}'?)" if close else ""
                raise ValueError(f"fsdp_config: unknown key '{raw_key}'{hint}")
            values[key] = value
        for flag in ("cpu_offload", "activation_checkpointing"):
            if flag in values:
                values[flag] = _truthy(values[flag])
        if "min_num_params" in values:
            values["min_num_params"] = int(values["min_num_params"])
        return cls(**values)
