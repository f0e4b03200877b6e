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
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

WRAP_POLICIES = ("transformer_based_wrap", "size_based_wrap", "no_wrap")
STATE_DICT_TYPES = ("FULL_STATE_DICT", "SHARDED_STATE_DICT")
# FSDP1 options that FSDP2 handles by itself; accepted from old config files and ignored.
_FSDP1_ONLY = {
    "backward_prefetch",
    "forward_prefetch",
    "use_orig_params",
    "sync_module_states",
    "cpu_ram_efficient_loading",
    "sharding_strategy",
}


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return bool(value)


@dataclass
class FullyShardedDataParallelPlugin:
    """Options of the FSDP2 (``torch.distributed.fsdp.fully_shard``) strategy.

    Args:
        auto_wrap_policy: which submodules are sharded as their own unit besides the root:
            ``"transformer_based_wrap"`` (classes named in ``transformer_cls_names_to_wrap``),
            ``"size_based_wrap"`` (modules with at least ``min_num_params`` parameters) or
            ``"no_wrap"`` (the root only). ``None`` picks transformer-based when class names
            are given, size-based when ``min_num_params`` is, else no wrap.
        reshard_after_forward: free gathered parameters after forward (full shard, less
            memory) or keep them until backward (shard-grad-op behaviour, less communication).
        cpu_offload: keep parameters, gradients and optimizer state on the CPU.
        state_dict_type: ``"SHARDED_STATE_DICT"`` (save_state writes one part per process
            with torch.distributed.checkpoint) or ``"FULL_STATE_DICT"`` (gathered to the main
            process).
        activation_checkpointing: recompute the wrapped layers' activations in backward.
        mixed_precision_policy: overrides the policy derived from ``mixed_precision``.
    """

    auto_wrap_policy: str | None = None
    transformer_cls_names_to_wrap: list[str] = field(default_factory=list)
    min_num_params: int = 0
    reshard_after_forward: bool = True
    cpu_offload: bool = False
    state_dict_type: str = "FULL_STATE_DICT"
    activation_checkpointing: bool = False
    mixed_precision_policy: Any = None
    fsdp_version: int = 2

    def __post_init__(self) -> None:
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
        if (
            self.auto_wrap_policy == "transformer_based_wrap"
            and not self.transformer_cls_names_to_wrap
        ):
            raise ValueError(
                "auto_wrap_policy transformer_based_wrap needs transformer_cls_names_to_wrap "
                "(fsdp_transformer_layer_cls_to_wrap), e.g. 'GPT2Block'"
            )
        if self.auto_wrap_policy == "size_based_wrap" and self.min_num_params <= 0:
            raise ValueError(
                "auto_wrap_policy size_based_wrap needs min_num_params (fsdp_min_num_params) > 0"
            )
        self.state_dict_type = self.state_dict_type.upper()
        if self.state_dict_type in ("FULL", "SHARDED"):
            self.state_dict_type += "_STATE_DICT"
        if self.state_dict_type not in STATE_DICT_TYPES:
            raise ValueError(
                f"state_dict_type must be FULL_STATE_DICT or SHARDED_STATE_DICT, got "
                f"{self.state_dict_type!r}"
            )
        if int(self.fsdp_version) != 2:
            raise ValueError(
                f"fsdp_version {self.fsdp_version} is not supported: slipstream implements FSDP "
                "with FSDP2 (torch.distributed.fsdp.fully_shard); set fsdp_version: 2"
            )

    @property
    def sharded_state_dict(self) -> bool:
        return self.state_dict_type == "SHARDED_STATE_DICT"

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
        for flag in ("reshard_after_forward", "cpu_offload", "activation_checkpointing"):
            if flag in values:
                values[flag] = _truthy(values[flag])
        if "min_num_params" in values:
            values["min_num_params"] = int(values["min_num_params"])
        return cls(**values)
