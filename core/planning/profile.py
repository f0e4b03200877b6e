"""A model as the planner needs it, read once on the meta device: every parameter (its
size, whether tensor parallelism splits it, whether it is an expert weight, which pipeline
unit and which FSDP unit holds it) and every unit's activations and FLOPs per sample.

Example::

    profile = profile_model(resolve_model("llama3_8b.json"), seq_len=8192, compute_bytes=2)
    profile.parameter_count, profile.units[1].saved(tp=2)
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..options.errors import ConfigError
from .model_reading import describe_error, units
from .model_source import ModelSource
from .parameters import tensor_parallel_split

if TYPE_CHECKING:
    from torch import nn

    from ..parallel.pipeline.layout import PipelineLayout


@dataclass(frozen=True)
class ParameterInfo:
    """One distinct parameter of the model."""

    elements: int
    trainable: bool
    tp_split: bool
    #: Index of the experts module holding it; -1: not an expert weight.
    expert: int
    #: The pipeline unit holding it ("" when the model has no pipeline layout).
    unit: str
    #: The FSDP unit: the block (decoder layer) holding it, "" for the root's remainder.
    block: str


@dataclass(frozen=True)
class UnitProfile:
    """One pipeline unit's activations and work, per sample (bytes, FLOPs)."""

    name: str
    role: str  # "pre", "block" or "post"
    saved: float
    #: Of ``saved``: what tensor parallelism divides (the rest every tp process keeps).
    saved_split: float
    inputs: float
    largest: float
    flops: float
    flops_split: float
    #: What selective recomputation keeps (see :mod:`.tracing`), per sample.
    selective: float = 0.0

    def activations(self, tp: int) -> float:
        return self.saved - self.saved_split + self.saved_split / tp

    def selective_activations(self, tp: int) -> float:
        """What selective recomputation keeps, split by tp in the proportion ``saved`` is."""
        share = self.saved_split / self.saved if self.saved else 0.0
        return self.inputs + self.selective * (1 - share + share / tp)

    def forward_flops(self, tp: int) -> float:
        return self.flops - self.flops_split + self.flops_split / tp


class ModelProfile:
    """Parameters, units and per-sample costs of one model at one sequence length."""

    def __init__(
        self,
        source: ModelSource,
        model: nn.Module,
        parameters: tuple[ParameterInfo, ...],
        unit_profiles: tuple[UnitProfile, ...],
        pipeline: PipelineLayout | None,
        seq_len: int,
        compute_bytes: int,
        traced: bool,
    ) -> None:
        self.source = source
        self.model = model
        self.parameters = parameters
        self.units = unit_profiles
        self.pipeline = pipeline
        self.seq_len = seq_len
        self.compute_bytes = compute_bytes
        #: Whether activations and FLOPs were traced (False: a model without inputs).
        self.traced = traced

    @property
    def name(self) -> str:
        return type(self.model).__name__

    @property
    def block_classes(self) -> tuple[str, ...]:
        """The classes of the model's blocks (its ``_no_split_modules``): FSDP's units."""
        return tuple(getattr(self.model, "_no_split_modules", None) or ())

    @property
    def parameter_count(self) -> int:
        return sum(p.elements for p in self.parameters)

    @property
    def config(self) -> dict[str, Any]:
        return self.source.config

    @property
    def num_experts(self) -> int:
        for key in ("num_experts", "num_local_experts", "n_routed_experts"):
            value = self.config.get(key)
            if isinstance(value, int) and value > 1:
                return value
        return 0

    @property
    def blocks(self) -> int:
        return sum(1 for unit in self.units if unit.role == "block")

    def flops_per_sample(self) -> float:
        """Forward FLOPs of one sample through the whole model."""
        return sum(unit.flops for unit in self.units)

    @functools.cache  # noqa: B019 - a profile lives as long as its plan
    def tp_allowed(self, tp: int) -> bool:
        """Whether slipstream can split this model ``tp`` ways (its plan's sizes divide)."""
        if tp == 1:
            return True
        for key in ("num_attention_heads", "num_key_value_heads"):
            value = self.config.get(key)
            if isinstance(value, int) and value % tp:
                return False
        try:
            tensor_parallel_split(self.model, list(units(self.model)), tp)
        except Exception:
            return False
        return True

    def ep_allowed(self, ep: int) -> bool:
        return ep == 1 or (self.num_experts > 0 and self.num_experts % ep == 0)

    @functools.cache  # noqa: B019
    def stages(self, count: int) -> tuple[tuple[str, ...], ...] | None:
        """The units of each of ``count`` stages (slipstream's own balance), or None when
        the model cannot be split so."""
        if self.pipeline is None:
            return None
        from ..parallel.pipeline.layout import assign_stages

        try:
            return tuple(tuple(stage) for stage in assign_stages(self.pipeline, count))
        except Exception:
            return None


def _experts_modules(model: nn.Module) -> list[Any]:
    from ..parallel.experts import resolve_experts

    try:
        return list(resolve_experts(model, None, 1, whole_model=False))
    except Exception:
        return []


def _pipeline(model: nn.Module) -> PipelineLayout | None:
    from ..parallel.pipeline.layout import pipeline_layout

    try:
        return pipeline_layout(model)
    except Exception:
        return None


def _parameters(model: nn.Module, pipeline: PipelineLayout | None) -> tuple[ParameterInfo, ...]:
    split = tensor_parallel_split(model, list(units(model)), 1)
    experts = _experts_modules(model)
    expert_of = {id(p): i for i, e in enumerate(experts) for p in e.module.parameters()}
    unit_of: dict[int, str] = {}
    if pipeline is not None:
        for unit in pipeline.units:
            for p in model.get_submodule(unit.name).parameters():
                unit_of.setdefault(id(p), unit.name)
    block_names = set(getattr(model, "_no_split_modules", None) or ())
    block_of: dict[int, str] = {}
    for name, module in model.named_modules():
        if name and type(module).__name__ in block_names:
            for p in module.parameters():
                block_of.setdefault(id(p), name)
    return tuple(
        ParameterInfo(
            elements=p.numel(),
            trainable=p.requires_grad,
            tp_split=info.split,
            expert=expert_of.get(id(p), -1),
            unit=unit_of.get(id(p), ""),
            block=block_of.get(id(p), ""),
        )
        for p, info in zip(model.parameters(), split.parameters, strict=True)
    )


def _inputs(profile_source: ModelSource, model: nn.Module, seq_len: int) -> dict[str, Any] | None:
    import torch

    if profile_source.kind == "config" or hasattr(getattr(model, "config", None), "vocab_size"):
        ids = torch.zeros((1, seq_len), dtype=torch.long, device="meta")
        return {"input_ids": ids, "labels": ids}
    example = getattr(model, "example_inputs", None)
    if callable(example):
        return dict(example(1, seq_len))
    return None


def _trace(source: ModelSource, tp_local: int, seq_len: int, dtype: Any) -> dict[str, Any]:
    from .tracing import trace_units

    model = source.build(tp_local=tp_local, dtype=dtype)
    pipeline = _pipeline(model)
    names = pipeline.names if pipeline is not None else [""]
    inputs = _inputs(source, model, seq_len)
    if inputs is None:
        return {}
    experts = [e.module for e in _experts_modules(model) if e.listed is None]
    return trace_units(model, inputs, names, experts)


#: Config keys that make decoder layers differ from each other (dense and sparse layers,
#: attention kinds): such models are read at their full depth.
_PER_LAYER_KEYS = ("layer_types", "mlp_only_layers", "first_k_dense_replace", "moe_layer_freq",
                   "interleave_moe_layer_step", "no_rope_layers", "sliding_window_pattern")  # fmt: skip
_SHALLOW = 3


def profile_model(source: ModelSource, seq_len: int, compute_bytes: int) -> ModelProfile:
    """Read ``source`` on the meta device and trace one sample of ``seq_len`` tokens in the
    compute dtype (2 bytes: bf16; 4: fp32).

    A deep transformers model whose layers are all alike is read with three layers and the
    last one repeated (minutes of meta-device work become seconds); if the two last of the
    three differ, the whole depth is read."""
    layers = source.layers
    uniform = source.kind == "config" and not any(
        source.config.get(key) not in (None, [], 0, 1) for key in _PER_LAYER_KEYS
    )
    if uniform and layers is not None and layers > _SHALLOW + 1:
        shallow = _profile(source.scaled(_SHALLOW), seq_len, compute_bytes)
        deep = _deepen(shallow, source, layers)
        if deep is not None:
            return deep
    return _profile(source, seq_len, compute_bytes)


def _deepen(shallow: ModelProfile, source: ModelSource, layers: int) -> ModelProfile | None:
    """``shallow`` with its last block repeated up to ``layers`` blocks (None: its blocks
    differ, so repeating one would mislead)."""
    import dataclasses

    from ..parallel.pipeline.layout import Unit

    blocks = [u for u in shallow.units if u.role == "block"]
    if shallow.pipeline is None or len(blocks) != _SHALLOW:
        return None
    template, before = blocks[-1], blocks[-2]
    if dataclasses.replace(before, name=template.name) != template:
        return None
    stem = template.name.rpartition(".")[0]
    names = [f"{stem}.{i}" for i in range(layers)]
    by_unit: dict[str, list[ParameterInfo]] = {}
    for p in shallow.parameters:
        by_unit.setdefault(p.unit, []).append(p)
    parameters: list[ParameterInfo] = list(by_unit.get("", []))
    units: list[UnitProfile] = []
    pipeline_units: list[Unit] = []
    for unit, profile in zip(shallow.pipeline.units, shallow.units, strict=True):
        copies = names[_SHALLOW - 1 :] if unit.name == template.name else [unit.name]
        for copy, name in enumerate(copies):
            parameters += [
                dataclasses.replace(p, unit=name, block=name if p.block else "",
                                    expert=p.expert + copy if p.expert >= 0 else -1)
                for p in by_unit.get(unit.name, [])
            ]  # fmt: skip
            units.append(dataclasses.replace(profile, name=name))
            pipeline_units.append(Unit(name, unit.parameters, unit.role))
    pipeline = dataclasses.replace(shallow.pipeline, units=tuple(pipeline_units))
    return ModelProfile(
        source, shallow.model, tuple(parameters), tuple(units), pipeline,
        shallow.seq_len, shallow.compute_bytes, shallow.traced,
    )  # fmt: skip


def _profile(source: ModelSource, seq_len: int, compute_bytes: int) -> ModelProfile:
    import torch

    dtype = torch.bfloat16 if compute_bytes == 2 else torch.float32
    model = source.build()
    pipeline = _pipeline(model)
    parameters = _parameters(model, pipeline)
    try:
        whole = _trace(source, 1, seq_len, dtype)
        # A process of a tensor-parallel pair computes half the heads and MLP width: what
        # halves between the two traces is what tensor parallelism splits.
        half = _trace(source, 2, seq_len, dtype) if source.kind == "config" else whole
    except Exception as error:
        raise ConfigError(
            f"cannot trace {type(model).__name__} on the meta device to measure its "
            f"activations: {describe_error(error)}"
        ) from None
    names = pipeline.names if pipeline is not None else [""]
    roles = {u.name: u.role for u in pipeline.units} if pipeline is not None else {"": "block"}
    profiles = []
    for name in names:
        one = whole.get(name)
        two = half.get(name, one)
        if one is None or two is None:
            profiles.append(UnitProfile(name, roles[name], 0.0, 0.0, 0.0, 0.0, 0.0, 0.0))
            continue
        saved_split = min(float(one.saved), max(0.0, 2.0 * (one.saved - two.saved)))
        flops_split = min(one.flops, max(0.0, 2.0 * (one.flops - two.flops)))
        profiles.append(
            UnitProfile(
                name,
                roles[name],
                float(one.saved),
                saved_split,
                float(one.inputs),
                float(one.largest),
                one.flops,
                flops_split,
                float(one.selective),
            )
        )
    return ModelProfile(
        source, model, parameters, tuple(profiles), pipeline, seq_len, compute_bytes,
        traced=bool(whole),
    )  # fmt: skip
