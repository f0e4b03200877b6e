"""DeepSpeedPlugin: DeepSpeed ZeRO options (Accelerate's short keys or a full JSON config),
and the placeholders that let a script stay unchanged when the JSON defines the optimizer.

Example::

    plugin = DeepSpeedPlugin(zero_stage=3, offload_optimizer_device="cpu",
                             zero3_save_16bit_model=True)
    accelerator = Accelerator(deepspeed_plugin=plugin, mixed_precision="bf16")

    # or a DeepSpeed JSON with "auto" values filled in from what prepare() sees
    accelerator = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config="ds.json"))
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

OFFLOAD_DEVICES = ("none", "cpu", "nvme")


class DeepSpeedConfigError(ValueError):
    """A DeepSpeed setting is invalid or contradicts what prepare() was given."""


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return bool(value)


@dataclass
class DeepSpeedPlugin:
    """DeepSpeed ZeRO settings.

    Either ``hf_ds_config`` (a DeepSpeed JSON file or dict, whose ``"auto"`` values are
    filled in by ``prepare()``) or the short options below. ``gradient_clipping`` is
    always written into the DeepSpeed config (DeepSpeed would otherwise clip at 1.0).
    ``hf_ds_config`` may also be an object holding the dict in ``.config`` (transformers'
    ``HfTrainerDeepSpeedConfig``, which the Trainer keeps filling in until ``prepare()``):
    it is kept, and its dict read when the engine is built.
    """

    hf_ds_config: Any = None
    zero_stage: int = 2
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float | None = None
    offload_optimizer_device: str = "none"
    offload_param_device: str = "none"
    offload_optimizer_nvme_path: str | None = None
    offload_param_nvme_path: str | None = None
    zero3_init_flag: bool = False
    zero3_save_16bit_model: bool = False

    def __post_init__(self) -> None:
        if str(self.zero_stage) not in ("0", "1", "2", "3"):
            raise DeepSpeedConfigError(f"zero_stage must be 0, 1, 2 or 3, got {self.zero_stage!r}")
        self.zero_stage = int(self.zero_stage)
        for key in ("offload_optimizer_device", "offload_param_device"):
            value = str(getattr(self, key) or "none").lower()
            if value not in OFFLOAD_DEVICES:
                raise DeepSpeedConfigError(f"{key} must be none, cpu or nvme, got {value!r}")
            setattr(self, key, value)
        if isinstance(self.hf_ds_config, str):
            try:
                with open(self.hf_ds_config) as handle:
                    self.hf_ds_config = json.load(handle)
            except FileNotFoundError:
                raise DeepSpeedConfigError(
                    f"deepspeed_config_file {self.hf_ds_config} does not exist"
                ) from None
            except json.JSONDecodeError as error:
                raise DeepSpeedConfigError(
                    f"deepspeed_config_file {self.hf_ds_config} is not valid JSON: {error}"
                ) from None
        config = self.deepspeed_config
        if config is None and self.hf_ds_config is not None:
            raise DeepSpeedConfigError(
                "hf_ds_config takes a DeepSpeed JSON path, a dict, or an object holding the dict "
                f"in .config; got {type(self.hf_ds_config).__name__}"
            )
        if config is not None:
            stage = config.get("zero_optimization", {}).get("stage", self.zero_stage)
            if str(stage) not in ("0", "1", "2", "3"):
                raise DeepSpeedConfigError(
                    f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}"
                )
            self.zero_stage = int(stage)
            save16 = config.get("zero_optimization", {}).get(
                "stage3_gather_16bit_weights_on_model_save"
            )
            if save16 is not None:
                self.zero3_save_16bit_model = _truthy(save16)

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> DeepSpeedPlugin:
        """Build from a ``deepspeed_config`` block of an (Accelerate) config file."""
        known = {f.name for f in fields(cls)}
        values: dict[str, Any] = {}
        for key, value in config.items():
            if key == "deepspeed_config_file":
                values["hf_ds_config"] = value
            elif key in known:
                values[key] = value
            # Launcher-only keys (hostfile, multinode launcher, ...) do not concern workers.
        for flag in ("zero3_init_flag", "zero3_save_16bit_model"):
            if flag in values:
                values[flag] = _truthy(values[flag])
        if values.get("gradient_clipping") is not None:
            values["gradient_clipping"] = float(values["gradient_clipping"])
        return cls(**values)

    @property
    def deepspeed_config(self) -> dict[str, Any] | None:
        """The DeepSpeed JSON as a dict (the live one: edits reach the engine built by
        ``prepare()``), or None when the short options describe the run."""
        config = getattr(self.hf_ds_config, "config", self.hf_ds_config)
        return config if isinstance(config, dict) else None

    def json_config(self) -> dict[str, Any]:
        """The DeepSpeed JSON this plugin stands for: its own, or one made of the short
        options with ``"auto"`` for what ``prepare()`` fills in (batch sizes, accumulation,
        clipping when unset).

        Example::

            DeepSpeedPlugin(zero_stage=3).json_config()["zero_optimization"]  # {"stage": 3}
        """
        if self.deepspeed_config is not None:
            return self.deepspeed_config
        config: dict[str, Any] = {
            key: "auto"
            for key in ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_clipping")
        }
        config["gradient_accumulation_steps"] = self.gradient_accumulation_steps or "auto"
        if self.gradient_clipping is not None:
            config["gradient_clipping"] = float(self.gradient_clipping)
        config["zero_optimization"] = self._zero_section()
        if self.zero_stage == 3:
            config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = (
                self.zero3_save_16bit_model
            )
        return config

    @property
    def config_defines_optimizer(self) -> bool:
        return "optimizer" in (self.deepspeed_config or {})

    @property
    def config_defines_scheduler(self) -> bool:
        return "scheduler" in (self.deepspeed_config or {})

    def build_config(
        self,
        *,
        micro_batch_size: int | None,
        gradient_accumulation_steps: int,
        world_size: int,
        mixed_precision: str,
        optimizer_defaults: Mapping[str, Any] | None = None,
        scheduler_values: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The DeepSpeed config dict with every ``"auto"`` resolved and checked."""
        if self.deepspeed_config is not None:
            config: dict[str, Any] = copy.deepcopy(self.deepspeed_config)
        else:
            config = {"zero_optimization": self._zero_section()}
        steps = self.gradient_accumulation_steps or gradient_accumulation_steps
        micro = micro_batch_size or 1
        _fill(config, "train_micro_batch_size_per_gpu", micro)
        _fill(config, "gradient_accumulation_steps", steps)
        expected = config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"]
        _fill(config, "train_batch_size", expected * world_size)
        if config["train_batch_size"] != expected * world_size:
            raise DeepSpeedConfigError(
                f"train_batch_size ({config['train_batch_size']}) must equal "
                f"train_micro_batch_size_per_gpu ({config['train_micro_batch_size_per_gpu']}) x "
                f"gradient_accumulation_steps ({config['gradient_accumulation_steps']}) x "
                f"processes ({world_size}) = {expected * world_size}; fix one of these keys or "
                'set them to "auto"'
            )
        clipping = self.gradient_clipping
        if config.get("gradient_clipping", "auto") == "auto":
            config["gradient_clipping"] = float(clipping) if clipping is not None else 0.0
        self._fill_precision(config, mixed_precision)
        zero = config.setdefault("zero_optimization", {})
        zero.setdefault("stage", self.zero_stage)
        if zero.get("stage") == 3:
            zero.setdefault(
                "stage3_gather_16bit_weights_on_model_save", self.zero3_save_16bit_model
            )
        for section, values in (("optimizer", optimizer_defaults), ("scheduler", scheduler_values)):
            if section in config and values:
                params = config[section].setdefault("params", {})
                for key, value in values.items():
                    if params.get(key) == "auto":
                        params[key] = value
        unresolved = _find_auto(config)
        if unresolved:
            raise DeepSpeedConfigError(
                f'these DeepSpeed keys are "auto" but nothing prepared tells their value: '
                f"{', '.join(unresolved)}; give them numbers in the config"
            )
        return config

    def _zero_section(self) -> dict[str, Any]:
        zero: dict[str, Any] = {"stage": self.zero_stage}
        if self.offload_optimizer_device != "none":
            zero["offload_optimizer"] = {
                "device": self.offload_optimizer_device,
                "pin_memory": False,
            }
            if self.offload_optimizer_nvme_path:
                zero["offload_optimizer"]["nvme_path"] = self.offload_optimizer_nvme_path
        if self.offload_param_device != "none":
            zero["offload_param"] = {"device": self.offload_param_device, "pin_memory": False}
            if self.offload_param_nvme_path:
                zero["offload_param"]["nvme_path"] = self.offload_param_nvme_path
        return zero

    @staticmethod
    def _fill_precision(config: dict[str, Any], mixed_precision: str) -> None:
        wanted = {"bf16": "bf16", "fp16": "fp16"}.get(mixed_precision)
        for section in ("bf16", "fp16"):
            block = config.setdefault(section, {})
            if block.get("enabled", "auto") == "auto":
                block["enabled"] = section == wanted
        if config["bf16"]["enabled"] and config["fp16"]["enabled"]:
            raise DeepSpeedConfigError("the DeepSpeed config enables both bf16 and fp16; keep one")


def _fill(config: dict[str, Any], key: str, value: Any) -> None:
    if config.get(key, "auto") == "auto":
        config[key] = value


def _find_auto(config: Any, prefix: str = "") -> list[str]:
    found: list[str] = []
    if isinstance(config, Mapping):
        for key, value in config.items():
            found += _find_auto(value, f"{prefix}{key}.")
    elif config == "auto":
        found.append(prefix.rstrip("."))
    return found


class DummyOptim:
    """Stands in for the optimizer defined in the DeepSpeed JSON.

    Example::

        optimizer = DummyOptim(model.parameters(), lr=1e-4)   # "auto" lr becomes 1e-4
    """

    def __init__(self, params: Any, lr: float = 1e-3, weight_decay: float = 0.0, **kwargs: Any):
        self.params = list(params)
        self.lr = lr
        self.weight_decay = weight_decay
        self.kwargs = kwargs


class DummyScheduler:
    """Stands in for the scheduler defined in the DeepSpeed JSON, or for the one
    ``lr_scheduler_callable(optimizer)`` builds on the engine's optimizer (a JSON that
    defines the optimizer but no scheduler); the engine steps it.

    Example::

        scheduler = DummyScheduler(optimizer, total_num_steps=1000, warmup_num_steps=100)
    """

    def __init__(
        self,
        optimizer: Any,
        total_num_steps: int | None = None,
        warmup_num_steps: int = 0,
        lr_scheduler_callable: Callable[[Any], Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.optimizer = optimizer
        self.total_num_steps = total_num_steps
        self.warmup_num_steps = warmup_num_steps
        self.lr_scheduler_callable = lr_scheduler_callable
        self.kwargs = kwargs
        #: The engine's scheduler built from the config (set by the DeepSpeed strategy).
        self.engine_scheduler: Any = None

    def step(self, *args: Any, **kwargs: Any) -> None:
        """The engine steps its scheduler itself."""

    def get_last_lr(self) -> list[float]:
        return list(self.engine_scheduler.get_last_lr()) if self.engine_scheduler else []

    def state_dict(self) -> dict[str, Any]:
        return {}  # saved inside the engine checkpoint

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restored with the engine checkpoint."""
