"""Planning a job: which layout fits a model, a batch and a cluster, and trains fastest
(``slipstream plan``; see docs/plan.md).

Example::

    plan = slipstream.plan("config.json", devices_per_node=8, device="H100",
                           global_batch=16, seq_len=8192)
    accelerator = Accelerator(**plan[0].accelerator_kwargs())
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..runtime.lazy import lazy_exports

if TYPE_CHECKING:
    from .layouts import Layout
    from .planner import Candidate, Plan, plan

_EXPORTS = {"plan": "planner", "Plan": "planner", "Candidate": "planner", "Layout": "layouts"}
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
__all__ = ["Candidate", "Layout", "Plan", "plan"]
