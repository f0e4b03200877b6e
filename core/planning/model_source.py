"""Where ``slipstream plan`` gets its model: a transformers config (a name on the Hub, a
folder holding ``config.json``, or the file itself) or a ``module:callable`` factory, built
on the meta device (no weights, no memory) or, for a check on this machine, for real with
fewer layers.

Example::

    source = resolve_model("configs/llama3_8b.json")
    model = source.build()                      # meta device, every layer
    small = source.build("cpu", layers=4)       # real weights, 4 decoder layers
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..options.errors import ConfigError
from .model_reading import build_model, describe_error, load_factory

if TYPE_CHECKING:
    import torch
    from torch import nn

#: Config fields a tensor-parallel process holds 1/tp of (heads, the MLP's hidden size).
TP_SPLIT_FIELDS = ("num_attention_heads", "num_key_value_heads", "intermediate_size")
_LAYER_FIELDS = ("num_hidden_layers", "n_layer", "num_layers")


@dataclass(frozen=True)
class ModelSource:
    """A model the planner can build: ``kind`` is ``"config"`` or ``"factory"``."""

    spec: str
    kind: str
    #: The transformers config as a plain dict (``"config"`` sources).
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def layers(self) -> int | None:
        """The number of decoder layers the config declares (None for factories)."""
        for name in _LAYER_FIELDS:
            if isinstance(self.config.get(name), int):
                return int(self.config[name])
        return None

    def scaled(self, layers: int | None) -> ModelSource:
        """The same model with ``layers`` decoder layers (itself for factories or None)."""
        if layers is None or self.kind != "config":
            return self
        values = dict(self.config)
        for name in _LAYER_FIELDS:
            if name in values:
                values[name] = layers
        if isinstance(values.get("layer_types"), list):
            values["layer_types"] = values["layer_types"][:layers]
        return ModelSource(self.spec, self.kind, values)

    def transformers_config(self, layers: int | None = None, tp_local: int = 1) -> Any:
        """The config object, with ``layers`` decoder layers and, with ``tp_local > 1``, the
        heads and MLP width one tensor-parallel process computes (what its activations are
        shaped by)."""
        import transformers

        values = dict(self.config)
        model_type = values.pop("model_type")
        if layers is not None:
            for name in _LAYER_FIELDS:
                if name in values:
                    values[name] = layers
            if isinstance(values.get("layer_types"), list):  # one entry per layer
                values["layer_types"] = values["layer_types"][:layers]
        if tp_local > 1:
            heads = values.get("num_attention_heads")
            if isinstance(heads, int) and not values.get("head_dim"):
                values["head_dim"] = values["hidden_size"] // heads
            for name in TP_SPLIT_FIELDS:
                if isinstance(values.get(name), int) and values[name] % tp_local == 0:
                    values[name] //= tp_local
        config = transformers.AutoConfig.for_model(model_type, **values)
        config._attn_implementation = "sdpa"
        return config

    def build(
        self,
        device: str = "meta",
        layers: int | None = None,
        tp_local: int = 1,
        dtype: torch.dtype | None = None,
    ) -> nn.Module:
        """The model on ``device`` (``"meta"``: no memory); see :meth:`transformers_config`.
        Factories are called as they are (``layers`` and ``tp_local`` do not apply)."""
        import torch

        if self.kind == "factory":
            if device == "meta":
                model = build_model(self.spec)
            else:
                with torch.device(device):
                    model = load_factory(self.spec)()
            return model.to(dtype) if dtype is not None else model
        import transformers

        config = self.transformers_config(layers, tp_local)
        with torch.device(device):
            try:
                model = transformers.AutoModelForCausalLM.from_config(config)
            except ValueError:  # not a causal LM: the bare model (its hidden states)
                model = transformers.AutoModel.from_config(config)
        return model.to(dtype) if dtype is not None else model

    def as_dict(self) -> dict[str, Any]:
        return {"spec": self.spec, "kind": self.kind, "config": self.config}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ModelSource:
        return cls(values["spec"], values["kind"], dict(values.get("config") or {}))


def resolve_model(spec: str) -> ModelSource:
    """The source named by MODEL; one-line errors for what cannot be read."""
    if not spec:
        raise ConfigError("MODEL is empty: give a transformers config name or path, or module:fn")
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        config_file = os.path.join(path, "config.json")
        if not os.path.isfile(config_file):
            raise ConfigError(f"unknown model {spec!r}: the folder has no config.json")
        return _from_file(spec, config_file)
    if os.path.isfile(path) and path.endswith(".json"):
        return _from_file(spec, path)
    if ":" in spec:
        load_factory(spec)  # errors now, in one line, not when first built
        return ModelSource(spec, "factory")
    return _from_hub(spec)


def _from_file(spec: str, path: str) -> ModelSource:
    try:
        with open(path) as handle:
            values = json.load(handle)
    except (OSError, ValueError) as error:
        raise ConfigError(f"cannot read {path}: {describe_error(error)}") from None
    if not isinstance(values, dict) or "model_type" not in values:
        raise ConfigError(f"{path} is not a transformers config: it has no 'model_type'")
    _check_model_type(spec, str(values["model_type"]))
    return ModelSource(spec, "config", values)


def _check_model_type(spec: str, model_type: str) -> None:
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"{spec} is a transformers config: pip install transformers") from None
    try:
        transformers.AutoConfig.for_model(model_type)
    except ValueError:
        raise ConfigError(
            f"unknown model {spec!r}: transformers does not know model_type {model_type!r}"
        ) from None


def _from_hub(spec: str) -> ModelSource:
    try:
        import transformers
    except ImportError:
        raise ConfigError(
            f"unknown model {spec!r}: not module:callable, not a config.json or a folder with "
            "one, and transformers (needed for Hub names) is not installed"
        ) from None
    try:
        config = transformers.AutoConfig.from_pretrained(spec)
    except Exception as error:  # OSError, ValueError, HTTP errors: all mean "cannot read"
        raise ConfigError(
            f"unknown model {spec!r}: not module:callable, not a config.json or a folder with "
            f"one, and transformers could not load it ({describe_error(error)})"
        ) from None
    return ModelSource(spec, "config", config.to_dict())
