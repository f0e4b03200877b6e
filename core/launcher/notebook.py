"""``notebook_launcher``: start a function on several processes (a notebook's training);
``debug_launcher``: the same on CPU processes, to debug distributed code.

Built on torch's elastic agent like ``slipstream launch``, with Accelerate's arguments: the
processes form one group (static or c10d rendezvous, one machine or several), a failure stops
all of them and raises torch's ``ChildFailedError`` here, ``max_restarts`` restarts them.

Example::

    def training_function(lr):
        accelerator = Accelerator()
        ...

    notebook_launcher(training_function, (3e-4,), num_processes=2)
"""

from __future__ import annotations

import contextlib
import gc
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from typing import Any

from ..runtime.env import LAUNCH_CONFIG_VARIABLE, export_for_workers, patch_environment
from .config import MIXED_PRECISION, RDZV_BACKENDS

#: The port of machine 0 when several machines form the job and none is given (Accelerate's).
DEFAULT_PORT = 29500


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
        from ..runtime.env import connect_gloo_lazily
        from ..runtime.state import set_current_state
        from .lifecycle import watch_parent

        # A forked worker inherits the launcher's Python signal handlers: torch's agent's
        # SIGTERM handler runs only between bytecodes, so a worker blocked in C++ (a
        # rendezvous, a collective) ignored the agent's "stop" until it was killed 30 s later.
        # A worker starts with the handlers a new interpreter has, as a spawned one does.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        watch_parent()
        # A forked worker inherits the launcher's single-process state (a PartialState or
        # Accelerator made before launching, without a process group: one with a group is
        # refused before forking); its own state comes from the rank torch's agent gave it.
        set_current_state(None)
        # As on GPUs (NCCL connects lazily), a worker that returns without communicating
        # must not leave one that just made a PartialState waiting for it.
        connect_gloo_lazily()
        return self.function(*args)


def _start_method(requested: str | None) -> str:
    """How to start the workers: fork where Accelerate forks (so a function defined in a
    cell or a closure, and a ``multiprocessing`` queue made here, reach the workers), unless
    this process holds something a forked child cannot use."""
    import torch

    has_group = torch.distributed.is_available() and torch.distributed.is_initialized()
    # torch.cuda.is_initialized() only reads a flag: it loads no driver (which would itself
    # poison forked children).
    has_cuda = torch.cuda.is_initialized()
    if requested is None and not _in_notebook():
        # A script can spawn instead: its function is importable by the new interpreters.
        return "spawn" if has_group or has_cuda else "fork"
    method = requested or "fork"
    if method == "fork" and has_group:
        # A forked worker would inherit this process group, which it can neither use nor
        # tear down (gloo's threads do not survive a fork).
        raise RuntimeError(
            "this process already has a torch.distributed process group (an Accelerator or "
            "init_process_group ran here), so forked workers cannot form their own: create "
            "the Accelerator only inside the launched function, or call "
            "torch.distributed.destroy_process_group() before launching"
        )
    if method == "fork" and has_cuda:
        raise RuntimeError(
            "CUDA was initialized in this process before notebook_launcher could fork the "
            'workers, and a forked process cannot use it ("Cannot re-initialize CUDA in '
            'forked subprocess"): keep every use of the GPU (models moved to cuda, an '
            "Accelerator) inside the launched function, and restart the notebook"
        )
    return method


def _free_port(address: str) -> int:
    """A port nothing listens on at ``address`` now (torch's static rendezvous needs the
    number before it binds; the c10d one binds port 0 itself)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((address, 0))
        return int(probe.getsockname()[1])


def _rendezvous(
    backend: str,
    endpoint: str,
    conf: dict[str, Any] | None,
    address: str,
    port: str | int | None,
    node_rank: int,
    num_nodes: int,
) -> tuple[str, dict[str, Any]]:
    """The rendezvous endpoint and configuration, as Accelerate builds them; on one machine
    without a port a free one is used, so two launches (or test runs) never collide."""
    configs = dict(conf or {})
    if backend == "static":
        configs["rank"] = node_rank
    if endpoint:
        return endpoint, configs
    if port is None and num_nodes > 1:
        port = DEFAULT_PORT
    elif port is None:
        port = _free_port(address) if backend == "static" else 0
    return f"{address}:{port}", configs


def notebook_launcher(
    function: Callable[..., Any],
    args: tuple[Any, ...] = (),
    num_processes: int | None = None,
    mixed_precision: str = "no",
    use_port: str | int | None = None,
    master_addr: str = "127.0.0.1",
    node_rank: int = 0,
    num_nodes: int = 1,
    rdzv_backend: str = "static",
    rdzv_endpoint: str = "",
    rdzv_conf: dict[str, Any] | None = None,
    rdzv_id: str = "none",
    max_restarts: int = 0,
    monitor_interval: float = 0.1,
    log_line_prefix_template: str | None = None,
    *,
    use_cpu: bool = False,
    start_method: str | None = None,
) -> list[Any]:
    """Run ``function(*args)`` on ``num_processes`` processes of this machine (of each of
    ``num_nodes`` machines); returns each local process's result, in rank order.

    The arguments are Accelerate's, in its order. ``use_port`` defaults to a free port on
    one machine and to 29500 across machines. ``rdzv_backend`` is ``"static"`` or
    ``"c10d"``; ``rdzv_endpoint``, ``rdzv_conf``, ``rdzv_id``, ``max_restarts`` (restart all
    processes after a failure), ``monitor_interval`` and ``log_line_prefix_template`` go to
    torch's elastic agent. When a process fails (after the restarts), the others are stopped
    and torch's ``ChildFailedError`` is raised, naming the failed rank and its error.

    The workers are forked, as in Accelerate (a function defined in a cell, a closure, a
    ``multiprocessing`` queue made by the caller all reach them), except in a script whose
    process already holds a process group or has used CUDA: they are spawned then (the
    function must be importable); in a notebook that is an error. Keyword-only extras:
    ``use_cpu`` (run on the CPU even with GPUs) and ``start_method`` (``"fork"``,
    ``"spawn"`` or ``"forkserver"``).

    Example::

        def train(queue):
            accelerator = Accelerator()
            ...

        notebook_launcher(train, (queue,), num_processes=2, max_restarts=3)
    """
    import torch
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    precision = mixed_precision.lower()
    if precision not in MIXED_PRECISION:
        raise ValueError(
            f"Unknown mixed_precision mode: {mixed_precision!r}; choose one of "
            f"{', '.join(MIXED_PRECISION)}"
        )
    if num_processes is None:
        # device_count asks NVML, which leaves CUDA uninitialized here (forks stay usable).
        num_processes = 1 if use_cpu else max(1, torch.cuda.device_count())
    if num_processes < 1:
        raise ValueError(f"num_processes must be at least 1, got {num_processes}")
    if not 0 <= node_rank < num_nodes:
        raise ValueError(
            f"node_rank must be at least 0 and less than num_nodes ({num_nodes}), got {node_rank}"
        )
    if rdzv_backend not in RDZV_BACKENDS:
        raise ValueError(f"rdzv_backend must be 'static' or 'c10d', got {rdzv_backend!r}")
    method = _start_method(start_method)
    endpoint, configs = _rendezvous(
        rdzv_backend, rdzv_endpoint, rdzv_conf, master_addr, use_port, node_rank, num_nodes
    )
    extra = {"CUDA_VISIBLE_DEVICES": ""} if use_cpu else {}
    options: dict[str, Any] = {}
    if hasattr(LaunchConfig, "numa_options"):
        # Given none, LaunchConfig asks torch.cuda.is_available(), which loads the CUDA driver
        # in this process and poisons every forked worker: pass some, then clear them (as
        # Accelerate does).
        from torch.numa.binding import AffinityMode, NumaOptions

        options["numa_options"] = NumaOptions(AffinityMode.NODE)
    config = LaunchConfig(
        min_nodes=num_nodes,
        max_nodes=num_nodes,
        nproc_per_node=num_processes,
        run_id=rdzv_id,
        rdzv_backend=rdzv_backend,
        rdzv_endpoint=endpoint,
        rdzv_configs=configs,
        max_restarts=max_restarts,
        monitor_interval=monitor_interval,
        start_method=method,
        log_line_prefix_template=log_line_prefix_template,
        **options,
    )
    if options:
        config.numa_options = None
    # The workers inherit these while they start (restarts included); the caller's
    # environment is as it was afterwards.
    with patch_environment(**{LAUNCH_CONFIG_VARIABLE: "", **extra}), _frozen_heap(method):
        export_for_workers({"mixed_precision": precision, "use_cpu": use_cpu}, extra)
        results = elastic_launch(config, _WatchingParent(function))(*args)
    return [results[rank] for rank in sorted(results)]


@contextlib.contextmanager
def _frozen_heap(start_method: str) -> Iterator[None]:
    """Forked workers inherit this process's heap, garbage included: the elastic agent of
    an earlier launch that failed (its process contexts, log tailers, locks) waits there for
    the collector, and collected in a worker its finalizers wait on threads and processes
    that are not the worker's (a re-run after a failed call deadlocked this way). Collect
    first and freeze what is left, so workers never collect what they inherit."""
    if start_method != "fork":
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def debug_launcher(
    function: Callable[..., Any], args: tuple[Any, ...] = (), num_processes: int = 2
) -> list[Any]:
    """Run ``function(*args)`` on ``num_processes`` CPU processes, to debug distributed code
    on a laptop; returns each one's result. Not meant for real training.

    The processes are forked (as in Accelerate), so a function defined anywhere works; the
    caller's environment is as it was afterwards. A failure raises torch's
    ``ChildFailedError``.

    Example::

        debug_launcher(training_function, num_processes=2)
    """
    return notebook_launcher(
        function, args, num_processes=num_processes, use_cpu=True, start_method="fork"
    )
