"""Stage modules: the part of a model one pipeline stage runs, built from the real modules.

A stage module is a *shallow clone* of the user's model: the containers on the way to the
stage's units (the model, a transformers base model, the list of blocks) are copied, the
units and everything else are shared, and the units of other stages are dropped. Names
stay the original ones (``model.layers.5.mlp.up_proj.weight``), so checkpoints written by
any layout load into any other by name. Nothing of another stage is ever moved to the
device, and a model built on the meta device gets only its stage's weights materialised.

Example::

    stage = build_stage_module(model, layout, {"model.embed_tokens", "model.layers.0"},
                               first=True, last=False)
    hidden = stage(input_ids)
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..config import ParallelismConfigError
from .layout import PipelineLayout


def _clone(module: nn.Module) -> nn.Module:
    clone = copy.copy(module)  # same class and attributes ...
    for registry in ("_modules", "_parameters", "_buffers"):
        setattr(clone, registry, dict(getattr(module, registry)))  # ... own registries
    return clone


def _prune(
    module: nn.Module,
    prefix: str,
    keep: set[str],
    units: set[str],
    layout: PipelineLayout,
    in_place: bool = False,
) -> nn.Module:
    """``module`` (named ``prefix``) holding only the kept units below it: a clone, or the
    module itself with the other units dropped (``in_place``)."""
    clone = module if in_place else _clone(module)
    if any(p is not None for p in module._parameters.values()):
        raise ParallelismConfigError(
            f"{prefix or type(module).__name__} holds parameters of its own "
            f"({', '.join(module._parameters)}), outside the pipeline units; move them into "
            "a submodule that is one of the units"
        )
    for name, child in list(module._modules.items()):
        path = f"{prefix}.{name}" if prefix else name
        if child is None:
            continue
        if path in units:
            if path not in keep:
                _drop(clone, name, path, layout)
            continue
        if any(unit.startswith(path + ".") for unit in units):
            clone._modules[name] = _prune(child, path, keep, units, layout, in_place)
        elif any(p.requires_grad for p in child.parameters()):
            raise ParallelismConfigError(
                f"{path} has trainable parameters but is not part of the pipeline layout "
                f"({', '.join(sorted(units)[:6])}, ...); every trained module must belong to a "
                "stage"
            )
    return clone


def _drop(clone: nn.Module, name: str, path: str, layout: PipelineLayout) -> None:
    role = next(u.role for u in layout.units if u.name == path)
    if layout.kind == "transformers" and role == "post" and path.startswith(layout.base_prefix):
        clone._modules[name] = nn.Identity()  # the base model's forward still calls it
    elif layout.kind == "transformers" and role == "pre":
        clone._modules[name] = None  # unused: later stages pass inputs_embeds
    else:
        del clone._modules[name]


class _TransformersStage:
    """Forward of a stage of a transformers model: token ids or hidden states in, hidden
    states (or, on the last stage, logits) out."""

    _pipeline_first: bool
    _pipeline_last: bool
    _pipeline_base: str
    _pipeline_heads: tuple[str, ...]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        base: Any = getattr(self, self._pipeline_base) if self._pipeline_base else self
        call = base if base is not self else super().forward  # type: ignore[misc]
        if self._pipeline_first:
            output = call(input_ids=hidden, use_cache=False)
        else:
            output = call(inputs_embeds=hidden, use_cache=False)
        result = output[0] if isinstance(output, tuple) else output.last_hidden_state
        if self._pipeline_last:
            for head in self._pipeline_heads:
                result = getattr(self, head)(result)
        return result


class _DeclaredStage:
    """Forward of a stage of a model that declares its top-level children in order."""

    _pipeline_order: tuple[str, ...]

    def forward(self, value: torch.Tensor) -> torch.Tensor:
        for name in self._pipeline_order:
            child = self._modules.get(name)  # type: ignore[attr-defined]
            if child is None:
                continue
            if isinstance(child, nn.ModuleList):
                for block in child:
                    value = block(value)
            else:
                value = child(value)
        return value


def _swap_class(module: nn.Module, mixin: type, label: str) -> None:
    original = type(module)
    module.__class__ = type(f"{label}{original.__name__}", (mixin, original), {})


def build_stage_module(
    model: nn.Module, layout: PipelineLayout, keep: Iterable[str], *, first: bool, last: bool
) -> nn.Module:
    """The stage of ``model`` that holds the units ``keep`` (see the module docstring)."""
    units = set(layout.names)
    keep = set(keep)
    stage = _prune(model, "", keep, units, layout)
    if layout.kind == "transformers":
        heads = tuple(
            u.name
            for u in layout.units
            if u.role == "post" and "." not in u.name and u.name != layout.base_prefix
        )
        _swap_class(stage, _TransformersStage, "Stage")
        stage.__dict__.update(
            _pipeline_first=first,
            _pipeline_last=last,
            _pipeline_base=layout.base_prefix,
            _pipeline_heads=heads,
        )
    elif layout.kind == "declared":
        order = tuple(dict.fromkeys(u.name.split(".")[0] for u in layout.units))
        _swap_class(stage, _DeclaredStage, "Stage")
        stage.__dict__["_pipeline_order"] = order
    return stage


def prune_in_place(model: nn.Module, layout: PipelineLayout, keep: Iterable[str]) -> None:
    """Drop from ``model`` itself every unit not in ``keep`` (the stages of other
    processes), so nothing keeps them alive."""
    _prune(model, "", set(keep), set(layout.names), layout, in_place=True)


def materialise(module: nn.Module, device: torch.device) -> None:
    """Give a stage built on the meta device real, initialised weights on ``device``
    (only its own: other stages' modules are not part of it)."""
    if not any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
        return
    module.to_empty(device=device)
    initialise = getattr(module, "_init_weights", None)
    for submodule in module.modules():
        if callable(initialise):
            initialise(submodule)
        reset = getattr(submodule, "reset_parameters", None)
        if callable(reset) and not callable(initialise):
            reset()
    # Buffers computed at construction (rotary frequencies, position ids) are rebuilt by
    # modules that know how; others must not be left as uninitialised memory.
    for submodule in module.modules():
        rebuild: Any = getattr(submodule, "rope_init_fn", None)
        frequencies: Any = getattr(submodule, "inv_freq", None)
        if callable(rebuild) and isinstance(frequencies, torch.Tensor):
            inv_freq, _ = rebuild(submodule.config, device)
            frequencies.copy_(inv_freq)
            if hasattr(submodule, "original_inv_freq"):
                submodule.__dict__["original_inv_freq"] = inv_freq
