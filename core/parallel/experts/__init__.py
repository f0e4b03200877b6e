"""Expert parallelism: the experts of mixture-of-experts models spread over processes.

``ParallelismConfig(ep_size=N)`` splits each experts module's experts over ``N`` of the
processes that shard the model (FSDP2's dp_shard x cp); tokens travel to their experts with
``all_to_all`` and back; each expert is FSDP2-sharded over the remaining processes. The
parts: finding the experts from a plan (:mod:`.plan`), moving tokens (:mod:`.dispatch`),
splitting one experts module and running it (:mod:`.layer`), the load-balancing loss over
the global batch (:mod:`.aux_loss`) and routing statistics (:mod:`.load`).

Example::

    from slipstream import Accelerator, ParallelismConfig
    accelerator = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=4, ep_size=2))
    model, optimizer = accelerator.prepare(model, optimizer)   # a transformers MoE model
"""

from .aux_loss import global_router_rows, install_global_aux_loss
from .dispatch import combine, dispatch
from .layer import ExpertParallel, expert_parallel_of
from .load import ExpertLoad, expert_load, expert_parallel_modules
from .plan import ExpertsModule, inside_experts, model_ep_plan, resolve_experts

__all__ = [
    "ExpertLoad",
    "ExpertParallel",
    "ExpertsModule",
    "combine",
    "dispatch",
    "expert_load",
    "expert_parallel_modules",
    "expert_parallel_of",
    "global_router_rows",
    "inside_experts",
    "install_global_aux_loss",
    "model_ep_plan",
    "resolve_experts",
]
