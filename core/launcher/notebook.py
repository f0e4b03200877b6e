"""``notebook_launcher``: start a function on several processes (a notebook's training);
``debug_launcher``: the same on CPU processes, to debug distributed code.

Built on torchrun's elastic agent like ``slipstream launch``: the processes form one group
on a free local port, a failure stops all of them and raises here.

Example::

    def training_function(lr):
        accelerator = Accelerator()
        ...

    notebook_launcher(training_function, (3e-4,), num_processes=2)
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable
from typing import Any

from ..runtime.env import LAUNCH_CONFIG_VARIABLE, export_for_workers, patch_environment


def _in_notebook() -> bool:
    shell = getattr(sys.modules.get("IPython"), "get_ipython", lambda: None)()
    return shell is not None and "IPKernelApp" in getattr(shell, "config", {})


class _WatchingParent:
    """``function`` run in a worker that ends when the notebook (its launcher) dies."""

    def __init__(self, function: Callable[..., Any]) -> None:
        self.function = function
        # torchrun names the entry point in its logs and events.
        self.__name__ = getattr(function, "__name__", "function")
        self.__qualname__ = getattr(function, "__qualname__", self.__name__)

    def __call__(self, *args: Any) -> Any:
        from .lifecycle import watch_parent

        watch_parent()
        return self.function(*args)


def notebook_launcher(
    function: Callable[..., Any],
    args: tuple[Any, ...] = (),
    num_processes: int | None = None,
    mixed_precision: str = "no",
    use_cpu: bool = False,
    max_restarts: int = 0,
    start_method: str | None = None,
) -> list[Any]:
    """Run ``function(*args)`` on ``num_processes`` processes; returns each one's result.

    Processes are forked in notebooks (so functions defined in a cell work) and spawned
    elsewhere (the function must then be importable).
    """
    import torch
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    if num_processes is None:
        num_processes = (
            torch.cuda.device_count() if torch.cuda.is_available() and not use_cpu else 1
        )
    if num_processes < 1:
        raise ValueError(f"num_processes must be at least 1, got {num_processes}")
    method = start_method or ("fork" if _in_notebook() else "spawn")
    if method == "fork" and torch.distributed.is_available() and torch.distributed.is_initialized():
        # A forked worker would inherit this process group, which it can neither use nor
        # tear down (gloo's threads do not survive a fork).
        raise RuntimeError(
            "this process already has a torch.distributed process group (an Accelerator or "
            "init_process_group ran here), so forked workers cannot form their own: create "
            "the Accelerator only inside the launched function, or call "
            "torch.distributed.destroy_process_group() before launching"
        )
    export_for_workers(
        {"mixed_precision": mixed_precision, "use_cpu": use_cpu},
        {"CUDA_VISIBLE_DEVICES": ""} if use_cpu else {},
    )
    config = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=num_processes,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="localhost:0",
        max_restarts=max_restarts,
        monitor_interval=0.1,
        start_method=method,
    )
    try:
        results = elastic_launch(config, _WatchingParent(function))(*args)
    except ChildFailedError as failure:
        raise RuntimeError(f"notebook_launcher: a process failed\n{failure.format_msg()}") from None
    return [results[rank] for rank in sorted(results)]


def debug_launcher(
    function: Callable[..., Any], args: tuple[Any, ...] = (), num_processes: int = 2
) -> list[Any]:
    """Run ``function(*args)`` on ``num_processes`` CPU processes, to debug distributed code
    on a laptop; returns each one's result. Not meant for real training.

    The processes are forked (as in Accelerate), so a function defined anywhere works; the
    caller's environment is as it was afterwards.

    Example::

        debug_launcher(training_function, num_processes=2)
    """
    with patch_environment(**{LAUNCH_CONFIG_VARIABLE: "", "CUDA_VISIBLE_DEVICES": ""}):
        return notebook_launcher(
            function, args, num_processes=num_processes, use_cpu=True, start_method="fork"
        )
