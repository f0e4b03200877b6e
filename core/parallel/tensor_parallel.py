"""Tensor-parallel plans: which module is split how, and applying them with DTensor.

A plan maps module-name patterns (``*`` matches one part of a dotted name, as in
transformers' ``layers.*.self_attn.q_proj``) to a style name or a DTensor ``ParallelStyle``.
Plans come, in this order, from the user (``ParallelismConfig(tp_plan=...)``), from a
transformers model itself (its ``tp_plan``: ``config.base_model_tp_plan`` plus the class's
``_tp_plan``), or not at all — then the error lists the model's Linear and Embedding
modules so a plan is easy to write.

Example::

    plan = {"blocks.*.attn.qkv": "colwise", "blocks.*.attn.out": "rowwise"}
    apply_tensor_parallel(model, tp_mesh, plan)
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from torch import nn

from .config import STYLE_SPLITS, ParallelismConfigError

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.parallel import ParallelStyle

_HEAD_ATTRIBUTES = (
    "num_attention_heads",
    "num_key_value_heads",
    "num_heads",
    "num_kv_heads",
    "n_head",
    "n_heads",
)


def make_style(name: str, *, sequence_parallel: bool, sequence_dim: int) -> ParallelStyle | None:
    """The DTensor ParallelStyle for a style name (``None`` for ``"replicate"``).

    With ``sequence_parallel`` the activations between TP regions stay split along the
    sequence: column-parallel layers gather their input from sequence shards and
    row-parallel layers reduce-scatter their output into them.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    between: Any = Shard(sequence_dim) if sequence_parallel else Replicate()
    if name == "colwise":
        return ColwiseParallel(input_layouts=between)
    if name in ("colwise_gather_output", "colwise_rep"):
        return ColwiseParallel(input_layouts=between, output_layouts=Replicate())
    if name == "rowwise":
        return RowwiseParallel(output_layouts=between)
    if name in ("rowwise_split_input", "rowwise_rep"):
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if name == "embedding_rowwise":
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if name == "embedding_colwise":
        return ColwiseParallel(input_layouts=Replicate(), output_layouts=between)
    if name == "sequence_parallel":
        if not sequence_parallel:
            raise ParallelismConfigError(
                "the plan marks modules 'sequence_parallel', which splits activations along the "
                "sequence between TP regions: set ParallelismConfig(sequence_parallel=True) "
                "(or parallelism_config_sequence_parallel: true) so the column- and row-wise "
                "layers around them take and give sequence shards"
            )
        return SequenceParallel(sequence_dim=sequence_dim, use_local_output=True)
    if name == "replicated_with_grad_allreduce":
        # A norm between a column- and a row-wise layer sees only this process's heads: its
        # weight stays whole, and marking the input as split (along any dimension but the
        # normalised one) makes DTensor sum the weight's partial gradients over the TP ranks.
        return SequenceParallel(sequence_dim=0, use_local_output=True)
    if name == "replicate":
        return None
    raise ParallelismConfigError(
        f"unknown tensor-parallel style {name!r}; use one of {', '.join(STYLE_SPLITS)} or a "
        "torch.distributed.tensor.parallel.ParallelStyle object"
    )


def model_plan(model: nn.Module) -> dict[str, Any] | None:
    """The plan a transformers model ships (``None`` for other models)."""
    plan = getattr(model, "tp_plan", None)
    if isinstance(plan, Mapping) and plan:
        return dict(plan)
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_tp_plan", None) or {}
    own = getattr(type(model), "_tp_plan", None) or {}
    if not base and not own:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    has_base = bool(prefix) and isinstance(getattr(model, prefix, None), nn.Module)
    combined = {(f"{prefix}.{k}" if has_base else k): v for k, v in dict(base).items()}
    combined.update(dict(own))
    return combined


def describe_modules(model: nn.Module, limit: int = 40) -> str:
    """Linear and Embedding modules of ``model``, for errors that ask for a plan."""
    found = []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            found.append(f"{name} (Linear {module.in_features}->{module.out_features})")
        elif isinstance(module, nn.Embedding):
            found.append(f"{name} (Embedding {module.num_embeddings}x{module.embedding_dim})")
    if not found:
        return "it has no Linear or Embedding modules"
    more = f", ... ({len(found) - limit} more)" if len(found) > limit else ""
    return "its Linear/Embedding modules: " + ", ".join(found[:limit]) + more


@dataclass(frozen=True)
class PlannedModule:
    """One module of the model and how the plan splits it."""

    name: str
    pattern: str
    style: Any  # a style name or a ParallelStyle


def name_matches(pattern: str, name: str) -> bool:
    """Whether a module name fits a plan pattern (``*`` matches one dotted part)."""
    wanted, parts = pattern.split("."), name.split(".")
    return len(wanted) == len(parts) and all(
        fnmatch.fnmatchcase(part, want) for part, want in zip(parts, wanted, strict=True)
    )


def expand_plan(model: nn.Module, plan: Mapping[str, Any], *, strict: bool) -> list[PlannedModule]:
    """The modules each pattern names. ``strict`` (user plans): a pattern that names no
    module, or a module named by two patterns, is an error."""
    modules = [name for name, _ in model.named_modules() if name]
    planned: dict[str, PlannedModule] = {}
    for pattern, style in plan.items():
        hits = [name for name in modules if name_matches(pattern, name)]
        if not hits and strict:
            raise ParallelismConfigError(
                f"tp_plan pattern {pattern!r} matches no module of {type(model).__name__}; "
                f"{describe_modules(model)}"
            )
        for name in hits:
            if name in planned and strict:
                raise ParallelismConfigError(
                    f"module {name!r} is matched by two tp_plan patterns, "
                    f"{planned[name].pattern!r} and {pattern!r}; keep one"
                )
            planned[name] = PlannedModule(name, pattern, style)
    return list(planned.values())


def resolve_plan(
    model: nn.Module,
    user_plan: Mapping[str, Any] | Callable[[nn.Module], Any] | None,
    tp: int,
    *,
    whole_model: bool = True,
) -> list[PlannedModule]:
    """The plan for ``model``: the user's, else the model's own, else an error.
    ``whole_model=False`` (a pipeline stage, holding only part of the model, whose plan was
    checked before splitting): patterns may match nothing."""
    plan = user_plan(model) if callable(user_plan) else user_plan
    strict = whole_model and plan is not None
    if plan is None:
        plan = model_plan(model)
    if not plan:
        raise ParallelismConfigError(
            f"tp_size={tp} splits layers across processes, but {type(model).__name__} has no "
            "tensor-parallel plan: pass ParallelismConfig(tp_plan={pattern: style}) mapping "
            "module names ('*' matches one part) to 'colwise' (split outputs) and 'rowwise' "
            f"(split inputs), e.g. {{'mlp.up': 'colwise', 'mlp.down': 'rowwise'}} (in a config "
            "file the parallelism_config key parallelism_config_tp_plan, on the command line "
            "slipstream launch --parallelism_config_tp_plan 'mlp.up=colwise,mlp.down=rowwise'); "
            f"{describe_modules(model)}"
        )
    planned = expand_plan(model, plan, strict=strict)
    if whole_model and not any(_splits(entry.style) for entry in planned):
        raise ParallelismConfigError(
            f"the tensor-parallel plan for {type(model).__name__} splits no module "
            f"({dict(plan)}); {describe_modules(model)}"
        )
    return planned


def check_sequence_parallel(model: nn.Module) -> None:
    """Refuse sequence parallelism for a transformers model: between the tensor-parallel
    regions its code (attention reshapes, rotary positions, masks) works on the whole
    sequence, which sequence parallelism splits over the processes (it would fail deep in
    DTensor on the first forward)."""
    library = next(
        (k for k in type(model).__mro__ if k.__module__.startswith("transformers.")), None
    )
    if library is None:
        return
    raise ParallelismConfigError(
        f"sequence parallelism (ParallelismConfig(sequence_parallel=True), or Megatron-LM's "
        f"sequence_parallelism: true) cannot run {type(model).__name__}: it splits the "
        "activations along the sequence between tensor-parallel regions, and transformers' "
        f"{library.__name__} shapes its attention, positions and masks there from the whole "
        "sequence (its code between the regions is not per-token). Use plain tensor "
        "parallelism (sequence_parallel: false, megatron_lm_sequence_parallelism: false); "
        "context parallelism (cp_size, on GPUs) splits the sequence for attention"
    )


def _splits(style: Any) -> bool:
    return not isinstance(style, str) or STYLE_SPLITS.get(style) is not None


def check_divisible(model: nn.Module, planned: list[PlannedModule], tp: int) -> None:
    """Raise when ``tp`` does not divide a size the plan splits (features, heads)."""
    modules = dict(model.named_modules())
    for entry in planned:
        if not isinstance(entry.style, str):
            continue
        module = modules[entry.name]
        split = STYLE_SPLITS.get(entry.style)
        size, what = _split_size(module, split)
        if size is not None and size % tp:
            raise ParallelismConfigError(
                f"tp_size={tp} does not divide the {size} {what} of {entry.name} "
                f"({type(module).__name__}, '{entry.style}'); choose a tp_size that divides it"
            )
    counts = _head_counts(model, [entry.name for entry in planned])
    for where, count in counts:
        if count % tp:
            raise ParallelismConfigError(
                f"tp_size={tp} does not divide {where}: tensor parallelism gives each "
                "process whole attention heads; choose a tp_size that divides the head counts"
            )


def _split_size(module: nn.Module, split: str | None) -> tuple[int | None, str]:
    if isinstance(module, nn.Linear):
        if split == "out":
            return module.out_features, "output features"
        if split == "in":
            return module.in_features, "input features"
    if isinstance(module, nn.Embedding):
        if split in ("rows", "in"):
            return module.num_embeddings, "embedding rows"
        if split in ("columns", "out"):
            return module.embedding_dim, "embedding columns"
    weight = getattr(module, "weight", None)
    if split in ("out", "rows") and weight is not None and weight.ndim >= 1:
        return int(weight.shape[0]), "weight rows"
    if split in ("in", "columns") and weight is not None and weight.ndim >= 2:
        return int(weight.shape[1]), "weight columns"
    return None, ""


def _head_counts(model: nn.Module, planned_names: list[str]) -> list[tuple[str, int]]:
    """Head counts that the split modules must divide: those of modules containing split
    modules, and the model config's when an attention module is split."""
    found: list[tuple[str, int]] = []
    parents = {name.rsplit(".", 1)[0] for name in planned_names if "." in name}
    splits_attention = False
    for name, module in model.named_modules():
        if name not in parents:
            continue
        splits_attention |= "attention" in type(module).__name__.lower() or "attn" in name
        for attribute in _HEAD_ATTRIBUTES:
            value = getattr(module, attribute, None)
            if isinstance(value, int) and value > 0:
                found.append((f"{name}.{attribute}={value}", value))
    config = getattr(model, "config", None)
    text = getattr(config, "get_text_config", None)
    config = text() if callable(text) else config
    if splits_attention and config is not None:
        for attribute in _HEAD_ATTRIBUTES:
            value = getattr(config, attribute, None)
            if isinstance(value, int) and value > 0:
                found.append((f"{attribute}={value} (the model's config)", value))
    return found


def _tied_parameters(model: nn.Module) -> list[list[tuple[nn.Module, str, str]]]:
    """Groups of (module, attribute, qualified name) sharing one Parameter object."""
    owners: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for module_name, module in model.named_modules(remove_duplicate=False):
        for attribute, parameter in module.named_parameters(recurse=False):
            qualified = f"{module_name}.{attribute}" if module_name else attribute
            entries = owners.setdefault(id(parameter), [])
            if not any(m is module and a == attribute for m, a, _ in entries):
                entries.append((module, attribute, qualified))
    return [group for group in owners.values() if len(group) > 1]


_WEIGHT_DIM = {"out": 0, "rows": 0, "in": 1, "columns": 1}


def _check_tied_layouts(
    groups: list[list[tuple[nn.Module, str, str]]], planned: list[PlannedModule]
) -> None:
    """Refuse, before anything changes, a plan that splits one tied weight two ways."""
    styles = {entry.name: entry.style for entry in planned}
    for group in groups:
        layouts: dict[str, Any] = {}
        for _, attribute, qualified in group:
            module_name = qualified[: -len(attribute)].rstrip(".")
            style = styles.get(module_name)
            if style is not None and not isinstance(style, str):
                return  # a ParallelStyle object: checked after splitting (_retie)
            split = STYLE_SPLITS.get(style) if isinstance(style, str) else None
            layouts[qualified] = _WEIGHT_DIM.get(split) if split is not None else None
        if len(set(layouts.values())) > 1:
            shown = ", ".join(
                f"{name} {'split along dim ' + str(dim) if dim is not None else 'not split'}"
                for name, dim in layouts.items()
            )
            raise ParallelismConfigError(
                f"{' and '.join(layouts)} are one tied weight, but the tensor-parallel plan "
                f"gives them different layouts ({shown}); give both modules matching styles "
                "(e.g. 'embedding_rowwise' with 'colwise_gather_output') or untie the weights"
            )


def _retie(groups: list[list[tuple[nn.Module, str, str]]]) -> None:
    """Point tied parameters at one tensor again after their modules were split."""
    from torch.distributed.tensor import DTensor

    for group in groups:
        first_module, first_attribute, first_name = group[0]
        keep = getattr(first_module, first_attribute)
        for module, attribute, name in group[1:]:
            current = getattr(module, attribute)
            if current is keep:
                continue
            layouts = [
                tuple(p.placements) if isinstance(p, DTensor) else "not split"
                for p in (keep, current)
            ]
            if layouts[0] != layouts[1] or tuple(keep.shape) != tuple(current.shape):
                raise ParallelismConfigError(
                    f"{first_name} and {name} are one tied weight, but the tensor-parallel plan "
                    f"gives them different layouts ({layouts[0]} vs {layouts[1]}); give both "
                    "modules matching styles (e.g. 'embedding_rowwise' with "
                    "'colwise_gather_output') or untie the weights"
                )
            module.register_parameter(attribute, keep)


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    planned: list[PlannedModule],
    *,
    sequence_parallel: bool = False,
    sequence_dim: int = 1,
) -> None:
    """Split ``model``'s planned modules over ``tp_mesh`` in place (DTensor
    ``parallelize_module``); tied weights stay tied."""
    from torch.distributed.tensor.parallel import parallelize_module

    tied = _tied_parameters(model)
    _check_tied_layouts(tied, planned)
    styles: dict[str, Any] = {}
    for entry in planned:
        style = (
            make_style(entry.style, sequence_parallel=sequence_parallel, sequence_dim=sequence_dim)
            if isinstance(entry.style, str)
            else entry.style
        )
        if style is not None:
            styles[entry.name] = style
    parallelize_module(model, tp_mesh, styles)
    _retie(tied)
