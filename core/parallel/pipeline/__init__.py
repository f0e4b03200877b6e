"""Pipeline parallelism: the model split into stages over the mesh's ``pp`` dimension.

:func:`build_pipeline` turns the user's model (in place) into the part this process runs:
its stage modules (split by :mod:`.layout`, built by :mod:`.stage`, each then tensor- and
data-parallelised by the strategy) driven by a torch.distributed.pipelining schedule
(:mod:`.runtime`). The model object itself becomes the process's view of the pipeline: it
holds only this process's stages (original parameter names, so optimizers, checkpoints and
``get_state_dict`` work by name) and calling it runs the forward-only schedule.

Example::

    model = build_pipeline(model, mesh=mesh, config=config, device=device, parallelize=wrap)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ...precision.base import move_forward_patch
from ..config_values import schedule_name
from .layout import PipelineLayout, assign_stages, pipeline_layout
from .runtime import PipelinePlan, PipelineRuntime, resolve_plan
from .stage import build_stage_module, materialise, prune_in_place

if TYPE_CHECKING:
    from ..config import ParallelismConfig
    from ..mesh import ParallelMesh

__all__ = [
    "PipelineLayout",
    "PipelinePlan",
    "PipelineRuntime",
    "assign_stages",
    "build_pipeline",
    "pipeline_layout",
    "pipeline_of",
    "resolve_plan",
    "schedule_name",
]


class _Pipelined:
    """Forward of the user's model under pipeline parallelism: the forward-only schedule
    (evaluation, inference); training runs through ``accelerator.forward_backward``."""

    _pipeline: PipelineRuntime
    _pipeline_kind: str
    training: bool

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if torch.is_grad_enabled() and self.training:
            raise RuntimeError(
                "under pipeline parallelism forward and backward run together, micro-batch "
                "by micro-batch: train with `loss = accelerator.forward_backward(model, ...)`; "
                "for evaluation call the model in eval mode or under torch.no_grad()"
            )
        inputs, labels = pipeline_inputs(self._pipeline_kind, args, kwargs)
        if self._pipeline_kind != "transformers":
            return self._pipeline.evaluate(inputs)[0]
        from transformers.modeling_outputs import CausalLMOutput

        loss_fn = model_loss(self) if labels is not None else None  # type: ignore[arg-type]
        logits, loss = self._pipeline.evaluate(inputs, labels, loss_fn)
        return CausalLMOutput(loss=loss, logits=logits)


def model_loss(model: nn.Module) -> Callable[[Any, Any], torch.Tensor]:
    """The loss a (pipelined) transformers model computes from logits and labels."""
    compute = getattr(model, "loss_function", None)
    config = getattr(model, "config", None)
    if not callable(compute) or config is None:
        raise ValueError(
            "under pipeline parallelism forward_backward needs loss_fn=... (and target=...): "
            "the last stage computes the loss from its outputs"
        )
    text = getattr(config, "get_text_config", None)
    vocab_size = (text() if callable(text) else config).vocab_size

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if labels is None:
            raise ValueError("forward_backward: the batch has no labels to compute the loss from")
        return compute(logits=logits, labels=labels, vocab_size=vocab_size)

    return loss


def pipeline_inputs(kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """The first stage's inputs and the labels, from a call's arguments."""
    if kind != "transformers":
        if kwargs:
            raise ValueError(
                f"under pipeline parallelism the first stage takes positional tensors; got "
                f"keyword arguments {sorted(kwargs)}"
            )
        return args, None
    values = dict(kwargs)
    if args:
        values.setdefault("input_ids", args[0])
    input_ids = values.pop("input_ids", None)
    labels = values.pop("labels", None)
    mask = values.pop("attention_mask", None)
    if mask is not None and not bool(torch.all(mask == 1)):
        raise ValueError(
            "under pipeline parallelism the stages pass only hidden states to each other: "
            "padding masks are not supported; pack or bucket sequences to equal lengths"
        )
    values.pop("position_ids", None)
    unused = sorted(k for k, v in values.items() if v is not None)
    if input_ids is None or unused:
        raise ValueError(
            "under pipeline parallelism a transformers model takes input_ids (and labels, "
            f"an all-ones attention_mask); got {sorted(kwargs) or 'positional arguments'}"
        )
    return (input_ids,), labels


def pipeline_of(model: nn.Module) -> PipelineRuntime | None:
    """The pipeline a prepared model runs, if it is split into stages (also through a
    wrapper that passes attributes on, such as torch.compile's)."""
    # Read from the instance's own attributes first: every pipelined step asks, and a
    # missing attribute of an nn.Module costs an exception.
    pipeline = getattr(model, "__dict__", {}).get("_pipeline")
    return pipeline if pipeline is not None else getattr(model, "_pipeline", None)


def build_pipeline(
    model: nn.Module,
    *,
    mesh: ParallelMesh,
    config: ParallelismConfig,
    device: torch.device,
    parallelize: Callable[[nn.Module], nn.Module],
) -> nn.Module:
    """Split ``model`` over the pipeline (in place) and return it (see the module doc)."""
    from torch.distributed.pipelining import PipelineStage

    plan = resolve_plan(
        mesh.sizes.pp, config.pp_schedule, config.pp_microbatches, config.pp_stages_per_rank
    )
    layout = pipeline_layout(model)
    assignment = assign_stages(
        layout, plan.num_stages, split_points=config.pp_split_points, balance=config.pp_balance
    )
    local = plan.stages_of(mesh.local_rank("pp"))
    prune_in_place(model, layout, [name for s in local for name in assignment[s]])
    pp_mesh = mesh.submesh("pp")
    assert pp_mesh is not None
    group = pp_mesh.get_group()
    modules = [
        build_stage_module(
            model, layout, assignment[index], first=index == 0, last=index == plan.num_stages - 1
        )
        for index in local
    ]
    # A precision patch of the model's forward (autocast) belongs on each stage's forward.
    move_forward_patch(model, modules)
    stages = []
    for index, module in zip(local, modules, strict=True):
        materialise(module, device)
        module = parallelize(module)
        stages.append(PipelineStage(module, index, plan.num_stages, device, group=group))
    runtime = PipelineRuntime(stages, group, plan)
    original = type(model)
    model.__class__ = type(f"Pipelined{original.__name__}", (_Pipelined, original), {})
    model.__dict__.update(
        _pipeline=runtime,
        _pipeline_kind=layout.kind,
    )
    return model
