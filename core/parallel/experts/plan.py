"""Which modules of a model hold its experts, found from a plan.

An *experts module* is what a mixture-of-experts layer calls once its router has chosen:
``experts(hidden_states, top_k_index, top_k_weights)`` with ``hidden_states`` of shape
``[tokens, hidden]``, the chosen experts' ids and weights of shape ``[tokens, k]``, returning
``[tokens, hidden]`` = the weighted sum of the chosen experts' outputs (transformers' experts
call). It holds its experts in one of two ways:

* **stacked** — its own parameters are 3-D (or 2-D for biases) with the experts along dim 0
  (transformers' ``gate_up_proj`` [E, 2I, H] / ``down_proj`` [E, H, I]); under expert
  parallelism its own forward runs on this process's experts, with ids counted from 0 and
  ``num_experts`` (if it has that attribute) set to the local count;
* **listed** — an ``nn.ModuleList`` of expert modules (the module itself or its one
  ``ModuleList`` child), each mapping ``[n, hidden] -> [n, hidden]``; slipstream calls them.

Plans come, in this order, from ``ParallelismConfig(ep_plan=...)`` (module-name patterns,
``*`` matching one part of a dotted name), from a transformers model's own
``base_model_ep_plan``, or not at all — then the error lists the modules that look like
experts, so a plan is quick to write.

Example::

    experts = resolve_experts(model, ["blocks.*.moe.experts"], ep=2)
    experts[0].num_experts, experts[0].stacked      # 8, ("w_in", "w_out")
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..errors import ParallelismConfigError
from ..tensor_parallel import name_matches

#: Plan styles that name an experts module (ours, and transformers' spelling).
MODULE_STYLES = ("experts", "ep_dispatch_experts")
#: transformers' style for the stacked parameters inside an experts module (implied here).
PARAMETER_STYLES = ("grouped_gemm",)
#: transformers' tensor-parallel styles for experts; experts are split by ep instead.
EXPERT_TP_STYLES = ("moe_tp_experts", "packed_colwise", "packed_rowwise", "grouped_gemm")


@dataclass(frozen=True)
class ExpertsModule:
    """One experts module of the model and how it holds its experts."""

    name: str
    module: nn.Module
    num_experts: int
    #: Its own parameters stacked along dim 0 (empty for listed experts).
    stacked: tuple[str, ...] = ()
    #: The nn.ModuleList of experts: ``""`` when the module is one, else its child's name.
    listed: str | None = None

    @property
    def experts_list(self) -> nn.ModuleList:
        assert self.listed is not None
        found = self.module.get_submodule(self.listed) if self.listed else self.module
        assert isinstance(found, nn.ModuleList)
        return found


def model_ep_plan(model: nn.Module) -> dict[str, str] | None:
    """The expert plan a transformers model ships (``None`` for other models)."""
    own = getattr(model, "_ep_plan", None)
    if isinstance(own, Mapping) and own:
        return {str(k): str(v) for k, v in own.items()}
    config = getattr(model, "config", None)
    base = getattr(config, "base_model_ep_plan", None) or {}
    if not base:
        return None
    prefix = getattr(model, "base_model_prefix", "")
    has_base = bool(prefix) and isinstance(getattr(model, prefix, None), nn.Module)
    return {(f"{prefix}.{k}" if has_base else k): str(v) for k, v in dict(base).items()}


def module_patterns(plan: Any, *, user: bool) -> list[str]:
    """The patterns of a plan that name experts modules (parameter entries dropped)."""
    if isinstance(plan, str):
        plan = [plan]
    if isinstance(plan, Mapping):
        patterns = []
        for pattern, style in plan.items():
            if style in MODULE_STYLES:
                patterns.append(str(pattern))
            elif style not in PARAMETER_STYLES and user:
                raise ParallelismConfigError(
                    f"ep_plan: '{pattern}' has style {style!r}; name experts modules with "
                    f"'experts' (or transformers' 'ep_dispatch_experts'), or pass a list of "
                    "module-name patterns"
                )
        return patterns
    if isinstance(plan, Sequence):
        return [str(p) for p in plan]
    raise ParallelismConfigError(
        f"ep_plan must list module-name patterns of the experts modules (or map them to "
        f"'experts'), got {plan!r}"
    )


def describe_candidates(model: nn.Module, limit: int = 12) -> str:
    """Modules that look like experts (3-D parameters or a ModuleList), for errors."""
    found = []
    for name, module in model.named_modules():
        stacked = [n for n, p in module.named_parameters(recurse=False) if p.ndim == 3]
        lists = [n for n, c in module.named_children() if isinstance(c, nn.ModuleList)]
        if stacked:
            found.append(f"{name or '(the model)'} (3-D parameters {', '.join(stacked)})")
        elif lists and not isinstance(module, nn.ModuleList):
            found.append(f"{name or '(the model)'} (ModuleList {', '.join(lists)})")
    if not found:
        return "it has no module with 3-D parameters or a ModuleList"
    more = f", ... ({len(found) - limit} more)" if len(found) > limit else ""
    return "modules that may hold experts: " + ", ".join(found[:limit]) + more


def _how_to_declare(model: nn.Module) -> str:
    return (
        "name the experts modules with ParallelismConfig(ep_plan=['blocks.*.moe.experts']) "
        "(module-name patterns, '*' matches one part; in a config file the parallelism_config "
        "key parallelism_config_ep_plan, on the command line slipstream launch "
        "--parallelism_config_ep_plan 'blocks.*.moe.experts'): each is called as "
        "experts(hidden_states, "
        "top_k_index, top_k_weights) and holds its experts as 3-D parameters [num_experts, ...] "
        f"or an nn.ModuleList (see docs/moe.md); {describe_candidates(model)}"
    )


def inspect_experts(name: str, module: nn.Module) -> ExpertsModule:
    """How ``module`` holds its experts; raises when it fits neither layout."""
    where = f"{name} ({type(module).__name__})"
    own = dict(module.named_parameters(recurse=False))
    lists = [n for n, c in module.named_children() if isinstance(c, nn.ModuleList)]
    if isinstance(module, nn.ModuleList) or (lists and not own):
        listed = "" if isinstance(module, nn.ModuleList) else lists[0]
        experts = module if listed == "" else module.get_submodule(listed)
        assert isinstance(experts, nn.ModuleList)
        outside = [
            n
            for n, _ in module.named_parameters()
            if not (n.split(".")[0] == listed or (listed == "" and n.split(".")[0].isdecimal()))
        ]
        if len(lists) > 1 or outside:
            raise ParallelismConfigError(
                f"the experts module {where} holds weights outside its one ModuleList of experts "
                f"({', '.join(outside[:5]) or ', '.join(lists)}); keep shared weights outside the "
                "experts module, which holds only the experts"
            )
        return ExpertsModule(name, module, len(experts), listed=listed)
    stacked3 = {n: p for n, p in own.items() if p.ndim == 3}
    if not stacked3:
        raise ParallelismConfigError(
            f"the ep_plan names {where}, which holds no experts: it has neither 3-D parameters "
            "[num_experts, ...] nor an nn.ModuleList of experts"
        )
    declared = getattr(module, "num_experts", None)
    count = declared if isinstance(declared, int) else next(iter(stacked3.values())).shape[0]
    wrong = [f"{n} {tuple(p.shape)}" for n, p in own.items() if p.ndim == 0 or p.shape[0] != count]
    inner = [n for n, _ in module.named_parameters() if n not in own]
    if wrong or inner:
        raise ParallelismConfigError(
            f"the experts module {where} has {count} experts stacked along dim 0, but also "
            f"weights that are not per expert ({', '.join((wrong + inner)[:5])}); keep only "
            "the stacked expert weights in the experts module"
        )
    return ExpertsModule(name, module, int(count), stacked=tuple(own))


def resolve_experts(
    model: nn.Module,
    user_plan: Any | Callable[[nn.Module], Any] | None,
    ep: int,
    *,
    whole_model: bool = True,
) -> list[ExpertsModule]:
    """The experts modules of ``model``: the user's plan, else the model's own, else an
    error. ``whole_model=False`` (a pipeline stage, checked as a whole before): patterns
    may match nothing and a stage may hold no experts."""
    plan = user_plan(model) if callable(user_plan) else user_plan
    user = plan is not None
    looked = "ParallelismConfig(ep_plan=...)" + (" (given)" if user else " (none given)")
    if plan is None:
        plan = model_ep_plan(model)
        looked += " and a transformers config.base_model_ep_plan" + (" (found)" if plan else "")
    patterns = module_patterns(plan, user=user) if plan else []
    modules = dict(model.named_modules())
    found: dict[str, ExpertsModule] = {}
    for pattern in patterns:
        hits = [name for name in modules if name and name_matches(pattern, name)]
        if not hits and user and whole_model:
            raise ParallelismConfigError(
                f"ep_plan pattern {pattern!r} matches no module of {type(model).__name__}; "
                f"{describe_candidates(model)}"
            )
        for name in hits:
            found.setdefault(name, inspect_experts(name, modules[name]))
    if not found and whole_model:
        raise ParallelismConfigError(
            f"ep_size={ep} spreads experts over processes, but no experts were found in "
            f"{type(model).__name__}: looked for {looked}; {_how_to_declare(model)}"
        )
    for entry in found.values():
        if entry.num_experts % ep:
            raise ParallelismConfigError(
                f"ep_size={ep} does not divide the {entry.num_experts} experts of {entry.name}; "
                "each process keeps an equal share of the experts: choose an ep_size that "
                "divides the number of experts"
            )
    return list(found.values())


def inside_experts(name: str, experts: Sequence[ExpertsModule]) -> bool:
    """Whether the module or parameter ``name`` is (inside) one of the experts modules."""
    return any(name == e.name or name.startswith(e.name + ".") for e in experts)
