"""Workers forked from the launcher, which has imported torch and slipstream already.

A fresh Python process spends about two seconds of CPU importing torch before the script's
first line; torchrun pays that once per worker, so a 32-process job on a small machine
spends a minute of CPU before training starts. ``slipstream launch`` instead runs torch's
elastic agent with a function entry point and the ``fork`` start method: each worker is a
copy of the agent (torch, slipstream and the Accelerator imported, nothing else run), made
to look like a fresh interpreter before the script starts — ``python -u``'s unbuffered
output, default signal handlers, its own thread count,
fresh torch and NumPy randomness, ``sys.path[0]`` the working directory, multiprocessing's
main process.

It is the default for CPU jobs (``worker_start: auto``), fault-tolerant ones included. GPU
jobs start fresh interpreters as torchrun does (a process that has touched CUDA cannot be forked safely, and a GPU job's
start-up is dominated by CUDA's own), and so does ``worker_start: exec``.

Example::

    run_agent(torchrun_namespace(request), fork=fork_wanted(config, request.no_python))
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import io
import os
import signal
import sys
import uuid
from typing import Any, TextIO

from ..runtime.env import cpu_threads_requested, visible_gpu_ids
from .config import LaunchConfig

#: What a worker imports anyway, imported once in the agent instead of once per worker
#: (torch._dynamo: the first optimizer step imports it, ~1.7 s of CPU).
PRELOADED = ("slipstream.accelerator", "torch._dynamo")
#: The signals the agent handles (or forwards); a fresh interpreter has the defaults.
_AGENT_SIGNALS = ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2")
#: The agent's own streams, kept alive in a forked worker: closing them would flush what
#: the agent had buffered a second time (and close its file descriptors).
_inherited_streams: list[TextIO] = []


def fork_wanted(config: LaunchConfig, no_python: bool = False) -> bool:
    """Whether the workers of ``config`` are forked from the agent (see the module docs)."""
    if no_python or config.worker_start == "exec":
        return False
    if config.worker_start == "fork":
        return True
    return config.use_cpu or visible_gpu_ids() == ""


def run_agent(namespace: argparse.Namespace, *, fork: bool) -> None:
    """Run torchrun's agent on ``namespace`` (torchrun's parsed arguments, entry point
    ``slipstream.launcher.worker``); with ``fork``, its workers are forked from this process."""
    from torch.distributed.run import config_from_args, run

    if not fork:
        run(namespace)
        return
    import importlib

    import torch.distributed.elastic.multiprocessing as processes
    from torch.distributed.launcher.api import elastic_launch

    for module in PRELOADED:
        importlib.import_module(module)
    _torchrun_rendezvous_defaults(namespace)
    config, _, _ = config_from_args(namespace)
    config = dataclasses.replace(config, start_method="fork")
    standard = processes.MultiprocessContext
    # start_processes makes its context for function workers from this name.
    processes.MultiprocessContext = _forked_workers_class()  # type: ignore[misc]
    try:
        elastic_launch(config, entrypoint=forked_worker)(*namespace.training_script_args)
    finally:
        processes.MultiprocessContext = standard  # type: ignore[misc]


def _forked_workers_class() -> Any:
    """torch's context for function workers, reporting every worker that ended badly (as its
    context for fresh interpreters does) instead of the first one only: the launcher's
    summary says which ranks failed by themselves (the same error on every rank is one
    line) and which it stopped."""
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    class ForkedWorkers(MultiprocessContext):
        def _poll(self) -> Any:
            result = super()._poll()  # on a failure, the others are stopped first
            if result is None or not result.failures or self._pc is None:
                return result
            for rank, process in enumerate(self._pc.processes):
                if rank not in result.failures and process.exitcode not in (None, 0):
                    result.failures[rank] = ProcessFailure(
                        local_rank=rank,
                        pid=process.pid,
                        exitcode=process.exitcode,
                        error_file=self.error_files[rank],
                    )
            return result

    return ForkedWorkers


def _torchrun_rendezvous_defaults(namespace: argparse.Namespace) -> None:
    """What ``torch.distributed.run.run`` fills in before it launches (a one-machine job
    rendezvouses on a free local port)."""
    one_machine_static = (
        namespace.rdzv_backend == "static"
        and not namespace.rdzv_endpoint
        and namespace.master_port is None
        and str(namespace.nnodes).split(":")[-1] == "1"
    )
    if namespace.standalone or one_machine_static:
        namespace.rdzv_backend = "c10d"
        namespace.rdzv_endpoint = "localhost:0"
        namespace.rdzv_id = str(uuid.uuid4())
    if namespace.master_port is None:
        namespace.master_port = 29500


def forked_worker(*argv: str) -> None:
    """A worker's life in a forked process: ``python -u -m slipstream.launcher.worker ARGV``."""
    from .worker import main

    _look_fresh()
    code: int | str | None = 0
    try:
        main(list(argv))
    except SystemExit as stop:
        code = stop.code
    finally:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    if code not in (None, 0):
        if not isinstance(code, int):  # sys.exit("message"): Python prints it, exit code 1
            print(code, file=sys.stderr, flush=True)
            code = 1
        os._exit(code)


def _look_fresh() -> None:
    """Undo what a fork inherits from the agent and a fresh interpreter would not have."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in _AGENT_SIGNALS:
        if hasattr(signal, name):
            signal.signal(getattr(signal, name), signal.SIG_DFL)
    # python -u: nothing waits in a buffer (a crash loses no line, ranks interleave by line).
    _inherited_streams.extend([sys.stdout, sys.stderr])
    sys.stdout = _unbuffered(sys.stdout, 1)
    sys.stderr = _unbuffered(sys.stderr, 2)
    sys.path[0] = os.getcwd()  # python -m's first path entry
    # multiprocessing would say this is a child of the agent; libraries ask it whether they
    # run in the main process.
    import multiprocessing.process

    processes: Any = multiprocessing.process
    processes._parent_process = None
    processes._current_process._identity = ()
    processes._current_process.name = "MainProcess"
    from .failures import restore_torchelastic_logging

    restore_torchelastic_logging()
    import torch

    # The agent's OpenMP read its own thread count when torch loaded; the launcher chose
    # this worker's (OMP_NUM_THREADS) after.
    threads = cpu_threads_requested()
    if threads is not None:
        torch.set_num_threads(threads)
    # Random generators seeded when the agent imported them would make every rank draw alike
    # (Python's own random reseeds itself after a fork).
    torch.seed()
    numpy_random: Any = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()


def _unbuffered(stream: TextIO, descriptor: int) -> TextIO:
    return io.TextIOWrapper(
        io.FileIO(descriptor, "w", closefd=False),
        encoding=stream.encoding,
        errors=stream.errors,
        write_through=True,
    )
