"""Shared helpers for real multi-process tests: processes on CPU over gloo, bound to
127.0.0.1 on a free port, with a timeout so a hang fails the test instead of the suite.

Processes these helpers start see no GPU unless the test's ``env`` names the GPUs itself
(``env={"CUDA_VISIBLE_DEVICES": "0,1"}``): on a machine with one GPU two ranks would both
take cuda:0 and NCCL would refuse them, so the suite chooses the CPU explicitly.

Example::

    def _body(scale):                       # module level, so spawned processes import it
        acc = Accelerator()
        return acc.process_index * scale

    def test_it():
        assert run_distributed(_body, 10) == [0, 10]
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import pickle
import queue
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tests.warm_commands import CommandServer, RunningCommand, exit_code
from tests.warm_workers import WarmPool

REPO = Path(__file__).resolve().parent.parent
DEFAULT_TIMEOUT = 120.0
#: The variable that chooses the GPUs a process sees (CUDA's own).
GPU_VARIABLE = "CUDA_VISIBLE_DEVICES"


def device_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """The device choice for a process a test starts: no GPU, unless ``env`` (the test's
    own variables) names the GPUs."""
    if env is not None and GPU_VARIABLE in env:
        return {}
    return {GPU_VARIABLE: ""}


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _child(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    rank: int,
    results: Any,
    release: Any,
) -> None:
    try:
        value = fn(*args, **kwargs)
        payload = (rank, True, pickle.dumps(value))
    except BaseException:
        payload = (rank, False, traceback.format_exc())
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    results.put(payload)
    results.close()
    results.join_thread()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    # Stay until every rank has sent its result (rank 0's process hosts the store the others
    # may still be reading), then skip the interpreter's teardown: atexit handlers, thread
    # joins and module cleanup cost ~0.6 s per process and launch.
    release.wait(timeout=DEFAULT_TIMEOUT)
    os._exit(0)


def _rank_environment(
    rank: int, world_size: int, port: str, env: dict[str, str] | None
) -> dict[str, str]:
    return {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": port,
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank),
        "LOCAL_WORLD_SIZE": str(world_size),
        "OMP_NUM_THREADS": "1",
        **device_environment(env),
        **(env or {}),
    }


#: Variables a process reads when it starts (or when torch, fsspec, ... are imported): a call
#: that changes one of them from what the warm workers started with gets fresh processes.
PROCESS_START_PREFIXES = (
    "CUDA_",
    "OMP_",
    "MKL_",
    "PYTHON",
    "LD_",
    "TORCH_",
    "FSSPEC_",
    "GLOO_",
    "NCCL_",
    "KMP_",
    "MALLOC_",
    "GLIBC_",
    "HF_",
    "TRANSFORMERS_",
)
#: Set to 1 to give every call brand-new interpreters (to tell a warm-worker problem apart).
FRESH_VARIABLE = "SLIPSTREAM_TEST_FRESH"
_pools: dict[int, WarmPool] = {}


def _process_start_variables(variables: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in variables.items() if k.startswith(PROCESS_START_PREFIXES)}


def _warm_pool(world_size: int, environments: list[dict[str, str]]) -> WarmPool | None:
    """The warm workers for ``world_size`` ranks, or None where the call's environment
    changes what a process reads at start-up from what they started with."""

    def base(rank: int) -> dict[str, str]:  # this test process's own environment, no call's
        return _process_start_variables(
            {**os.environ, **_rank_environment(rank, world_size, "0", None)}
        )

    pool = _pools.get(world_size)
    # A session fixture may change this process's environment for the tests after it (the S3
    # server's FSSPEC_S3_ENDPOINT_URL): new warm workers then, rather than fresh processes for
    # every later call.
    if pool is not None and (
        not pool.alive() or pool.started_with != [base(r) for r in range(world_size)]
    ):
        pool.close()
        pool = None
    if pool is None:
        pool = _pools[world_size] = WarmPool(world_size, base)
    for started, wanted in zip(pool.started_with, environments, strict=True):
        if started != _process_start_variables(wanted):
            return None
    return pool


@atexit.register
def _close_pools() -> None:
    for pool in _pools.values():
        pool.close()
    _pools.clear()


def run_distributed(
    fn: Callable[..., Any],
    *args: Any,
    world_size: int = 2,
    timeout: float = DEFAULT_TIMEOUT,
    env: dict[str, str] | None = None,
    kwargs: dict[str, Any] | None = None,
    fresh: bool = False,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` processes forming one gloo group.

    Returns the per-rank return values (index = rank). The first failing rank's traceback
    fails the test at once (the other ranks are stopped); so does the timeout. The processes
    see no GPU unless ``env`` sets ``CUDA_VISIBLE_DEVICES`` (then one GPU per rank, NCCL).

    Each rank's process is forked from a warm worker that already imported torch, slipstream
    and the test module (tests/warm_workers.py): a fresh process for the body, without the
    start-up. ``fresh=True`` starts brand-new interpreters instead — for tests about
    processes themselves; a call whose ``env`` changes what a process reads at start-up
    (``CUDA_VISIBLE_DEVICES``, ``OMP_*``, ``TORCH_*``, ...) gets them too.
    """
    port = str(free_port())
    environments = [
        {**os.environ, **_rank_environment(rank, world_size, port, env)}
        for rank in range(world_size)
    ]
    fresh = fresh or os.environ.get(FRESH_VARIABLE) == "1"
    pool = None if fresh else _warm_pool(world_size, environments)
    if pool is not None:
        return pool.run(fn, args, kwargs or {}, environments, timeout)
    return _run_fresh(fn, args, kwargs or {}, world_size, timeout, port, env)


def _run_fresh(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    world_size: int,
    timeout: float,
    port: str,
    env: dict[str, str] | None,
) -> list[Any]:
    """:func:`run_distributed` on brand-new interpreters (spawned)."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    release = context.Event()  # set once every result is in: the processes may end
    processes = []
    for rank in range(world_size):
        with _environment(_rank_environment(rank, world_size, port, env)):
            process = context.Process(
                target=_child, args=(fn, args, kwargs, rank, results, release), daemon=True
            )
            process.start()
        processes.append(process)
    collected: dict[int, Any] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(collected) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise AssertionError(
                    f"{fn.__name__} timed out after {timeout:.0f}s on {world_size} processes; "
                    f"ranks that finished: {sorted(collected)}"
                )
            try:
                rank, ok, payload = results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(processes) if p.exitcode not in (None, 0)]
                if dead and not any(r in collected for r in dead):
                    time.sleep(0.5)  # a result may still be in flight
                    if results.empty():
                        raise AssertionError(
                            f"rank(s) {dead} of {fn.__name__} died without a result "
                            f"(exit codes {[processes[r].exitcode for r in dead]})"
                        ) from None
                continue
            if not ok:
                raise AssertionError(f"rank {rank} of {fn.__name__} failed:\n{payload}")
            collected[rank] = pickle.loads(payload)
    finally:
        release.set()
        for process in processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()
    return [collected[rank] for rank in range(world_size)]


def run_cli(
    *arguments: str,
    timeout: float = DEFAULT_TIMEOUT,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m slipstream.cli ARGS`` (the ``slipstream`` command) and capture output."""
    return run_python("-m", "slipstream.cli", *arguments, timeout=timeout, env=env, cwd=cwd)


def run_cli_here(
    *arguments: str,
    input: str | None = None,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.CompletedProcess[str]:
    """:func:`run_cli` in this process: ``slipstream.cli.main(arguments)`` with ``input`` as
    its standard input and its output captured, in the environment a ``run_cli`` process
    would see (no ``SLIPSTREAM_*``, no rank variables, no GPU, plus ``env``) and ``cwd``.

    For commands that neither start processes nor change the process's own state (config,
    env, migrate, estimate-memory, argument errors): a fresh interpreter costs two seconds
    of CPU importing torch, more than such a command's own work. At least one test per
    command still runs it through :func:`run_cli`, as the console script does."""
    import io
    from unittest import mock

    from slipstream.cli import main

    variables = command_environment(env)
    stdout, stderr = io.StringIO(), io.StringIO()
    before = Path.cwd()
    with (
        mock.patch.dict(os.environ, variables, clear=True),
        mock.patch.object(sys, "stdin", io.StringIO(input or "")),
        contextlib.redirect_stdout(stdout),
        contextlib.redirect_stderr(stderr),
    ):
        os.chdir(cwd or REPO)
        try:
            code = main(list(arguments))
        except SystemExit as stop:  # argparse's errors and --help
            code = exit_code(stop.code)
        finally:
            os.chdir(before)
    command = [sys.executable, "-m", "slipstream.cli", *arguments]
    return subprocess.CompletedProcess(command, code, stdout.getvalue(), stderr.getvalue())


def command_environment(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a command a test runs: this one's without ``SLIPSTREAM_*`` or
    rank variables, no GPU unless ``env`` names one, plus ``env``."""
    variables = {k: v for k, v in os.environ.items() if not k.startswith("SLIPSTREAM_")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        variables.pop(key, None)
    variables.update(device_environment(env))
    variables.update(env or {})
    return variables


_command_server: CommandServer | None = None


def _command_start_variables(variables: dict[str, str]) -> dict[str, str]:
    fixed = _process_start_variables(variables)
    fixed.pop("OMP_NUM_THREADS", None)  # a forked command sets its own thread count
    return fixed


def _warm_command_server(variables: dict[str, str]) -> CommandServer | None:
    """The warm command server (tests/warm_commands.py), or None where the command must
    start fresh: ``SLIPSTREAM_TEST_FRESH=1``, or its environment changes what a process reads
    at start-up from what the server started with."""
    global _command_server
    if os.environ.get(FRESH_VARIABLE) == "1":
        return None
    base = command_environment()
    server = _command_server
    if server is not None and (
        not server.alive() or server.started_with != _command_start_variables(base)
    ):
        server.close()  # a session fixture changed this process's environment: a new one
        server = None
    if server is None:
        server = _command_server = CommandServer(base, REPO, _command_start_variables(base))
    if _command_start_variables(variables) != server.started_with:
        return None
    return server


@atexit.register
def _close_command_server() -> None:
    if _command_server is not None:
        _command_server.close()


def run_python(
    *arguments: str,
    timeout: float = DEFAULT_TIMEOUT,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    fresh: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Run this interpreter with ``arguments``; a hang fails after ``timeout`` seconds.

    Like :func:`run_distributed`'s processes (and the launchers and workers they start),
    it sees no GPU unless ``env`` sets ``CUDA_VISIBLE_DEVICES``. The command runs in a fork
    of a warm server made to look like a fresh interpreter (tests/warm_commands.py) where it
    can; ``fresh=True`` starts a new interpreter (for what a fork cannot show: start-up
    cost, what is imported, peak memory)."""
    variables = command_environment(env)
    server = None if fresh else _warm_command_server(variables)
    if server is not None:
        done = server.run(arguments, variables, cwd or REPO, timeout)
        if done is not None:
            return done
    return subprocess.run(
        [sys.executable, *arguments],
        stdin=subprocess.DEVNULL,  # as a warm command's: a test never types into one
        capture_output=True,
        text=True,
        timeout=timeout,
        env=variables,
        cwd=cwd or REPO,
    )


@contextlib.contextmanager
def s3_server() -> Iterator[dict[str, str]]:
    """A real S3-compatible server (moto) on 127.0.0.1; yields the variables that point
    boto3/s3fs at it (also for spawned processes)."""
    import shutil
    import urllib.request

    executable = shutil.which("moto_server") or str(Path(sys.executable).parent / "moto_server")
    port = free_port()
    server = subprocess.Popen(
        [executable, "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(endpoint, timeout=1)
                break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("moto_server did not start") from None
                time.sleep(0.2)
        yield {
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing",
            "AWS_DEFAULT_REGION": "us-east-1",
            "FSSPEC_S3_ENDPOINT_URL": endpoint,
        }
    finally:
        server.terminate()
        server.wait(timeout=10)


def run_fault_tolerant_job(
    script: Path,
    out: Path,
    script_args: list[str],
    *,
    processes: int,
    groups: int,
    launch_args: tuple[str, ...] = (),
    kill_when: Path | None = None,
    timeout: float = DEFAULT_TIMEOUT,
) -> subprocess.CompletedProcess[str]:
    """Run ``script`` with ``slipstream launch --fault_tolerance`` (its own lighthouse, each
    group restarted once); with ``kill_when``, SIGKILL the process whose pid that file
    holds as soon as it appears (a replica group's worker, mid-training)."""
    import signal as signals

    command = [
        sys.executable, "-m", "slipstream.cli", "launch", "--cpu", "-n", str(processes),
        "--fault_tolerance", "--ft_replica_groups", str(groups), "--ft_heartbeat_timeout", "2",
        "--max_restarts", "1", *launch_args, str(script), str(out), *script_args,
    ]  # fmt: skip
    variables = command_environment({"OMP_NUM_THREADS": "1"})
    server = _warm_command_server(variables)
    job: subprocess.Popen[str] | RunningCommand | None = None
    if server is not None:  # the launcher forked from the warm command server
        job = server.start(tuple(command[1:]), variables, REPO, merge_output=True, new_session=True)
    if job is None:
        job = subprocess.Popen(
            command, cwd=REPO, env=variables, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        )  # fmt: skip
    deadline = time.monotonic() + timeout
    try:
        while kill_when is not None and job.poll() is None and time.monotonic() < deadline:
            if kill_when.exists() and kill_when.read_text():
                os.kill(int(kill_when.read_text()), signals.SIGKILL)
                break
            time.sleep(0.05)
        output, _ = job.communicate(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(job.pid, signals.SIGKILL)
        output, _ = job.communicate()
        raise AssertionError(f"fault-tolerant job timed out after {timeout} s:\n{output}") from None
    return subprocess.CompletedProcess(command, job.returncode, output, "")
