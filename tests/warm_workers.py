"""Warm workers: multi-process tests without paying Python + torch start-up each time.

A :class:`WarmPool` keeps one long-lived *warm worker* per rank, started once per test
session with torch and slipstream imported (each a fork of one multiprocessing fork server
per test process, which imported them once). Each call forks every rank's warm worker: the
forked child runs the test's body in a fresh process (fresh globals, environment, signal
handlers, process group) that already holds everything its parent imported, then reports
its result and exits. A child that fails, hangs or dies takes nothing with it: the warm
worker stays clean because nothing ever runs in it but imports.

What a warm worker imports grows with use: it unpickles each test's function itself (so the
test module, with its top-level imports, is loaded once per session) and afterwards imports
the modules its children needed (slipstream's, torch's, transformers', ...), so the next
test from anywhere finds them loaded.

Messages between the test process and a warm worker (a duplex pipe):

    test -> worker   ("run", task bytes, env, cwd, output path) | ("release",) | None (stop)
    worker -> test   ("started", pid) then ("result", ok, payload) or ("died", exit code),
                     and ("done",) after a release
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

#: Modules a warm worker loads before its first test (the rest it learns from its children).
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.nn.parallel",
    "torch.distributed.fsdp",
    "torch.distributed.tensor",
    "torch.distributed.checkpoint",
    "slipstream",
    "slipstream.accelerator.accelerator",
)
#: Modules a warm worker never imports itself although its children did: they start threads
#: or bind process-wide resources at import, which a fork would copy into every child broken.
NEVER_PRELOAD = ("ray", "torchft", "lightning", "pytorch_lightning", "tensorboard", "moto")


def reseed() -> None:
    """A forked child would otherwise replay its parent's torch and NumPy random streams,
    where a freshly started process draws new seeds (``random`` reseeds itself at fork)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()


def _run_child(task: bytes, env: dict[str, str], cwd: str, output: str, result_fd: int) -> None:
    """The forked child: run the test's body, write (ok, payload) to ``result_fd``."""
    # stdout and stderr apart, as a freshly started rank's would be (tests read either).
    for fd, suffix in ((1, ".out"), (2, ".err")):
        with open(output + suffix, "ab", buffering=0) as stream:
            os.dup2(stream.fileno(), fd)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    reseed()
    try:
        fn, args, kwargs = pickle.loads(task)
        value = fn(*args, **kwargs)
        outcome = (True, pickle.dumps(value))
    except BaseException:
        outcome = (False, traceback.format_exc().encode())
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    data = pickle.dumps(outcome)
    view = memoryview(data)
    while view:
        written = os.write(result_fd, view)
        view = view[written:]
    os.close(result_fd)


def _read_all(fd: int) -> bytes:
    chunks = []
    while True:
        chunk = os.read(fd, 1 << 20)
        if not chunk:
            break
        chunks.append(chunk)
    os.close(fd)
    return b"".join(chunks)


def _warm_worker(connection: Connection) -> None:
    """A warm worker's loop: import, then fork one child per task."""
    for name in PRELOAD:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    while True:
        message = connection.recv()
        if message is None:
            os._exit(0)
        _, task, env, cwd, output = message
        try:
            pickle.loads(task)  # imports the test module here, once, for every later child
        except BaseException:
            connection.send(("result", False, traceback.format_exc().encode()))
            connection.recv()  # the release
            connection.send(("done",))
            continue
        before = set(sys.modules)
        modules_read, modules_write = os.pipe()
        result_read, result_write = os.pipe()
        release_read, release_write = os.pipe()
        gc.freeze()  # the child's full collections skip what it inherits (warm_commands)
        pid = os.fork()
        if pid == 0:
            os.close(result_read)
            os.close(release_write)
            os.close(modules_read)
            _run_child(task, env, cwd, output, result_write)
            os.write(modules_write, "\n".join(sorted(set(sys.modules) - before)).encode())
            os.close(modules_write)
            os.read(release_read, 1)  # stay until every rank has sent its result
            os._exit(0)
        for fd in (result_write, release_read, modules_write):
            os.close(fd)
        connection.send(("started", pid))
        data = _read_all(result_read)
        if data:
            ok, payload = pickle.loads(data)
            connection.send(("result", ok, payload))
        else:
            _, status = os.waitpid(pid, 0)
            pid = 0
            connection.send(("died", os.waitstatus_to_exitcode(status)))
        connection.recv()  # the release
        with contextlib.suppress(OSError):  # a child that died reads nothing
            os.write(release_write, b"x")
        os.close(release_write)
        learned = _read_all(modules_read).decode().split()
        if pid:
            os.waitpid(pid, 0)
        connection.send(("done",))
        _learn(learned)


def _learn(modules: list[str]) -> None:
    for name in modules:
        if name.split(".")[0] in NEVER_PRELOAD or name in sys.modules:
            continue
        with contextlib.suppress(BaseException):
            importlib.import_module(name)


class WorkerFailed(AssertionError):
    """A rank of a pooled call failed, died or timed out (the message says which)."""


#: The start-up variables of the fork server every warm worker is forked from (set when it
#: starts: with the first pool's), or None before.
_server_started_with: dict[str, str] | None = None


def _context(started_with: list[dict[str, str]]) -> Any:
    """Where a pool's warm workers come from: forks of one server per test process that has
    imported PRELOAD once (each warm worker would otherwise spend ~3 s of CPU importing it),
    or brand-new interpreters for a pool whose start-up variables differ from the server's."""
    global _server_started_with
    if _server_started_with is None:
        _server_started_with = started_with[0]
    if any(variables != _server_started_with for variables in started_with):
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(list(PRELOAD))
    return context


class WarmPool:
    """One warm worker per rank for ``world_size`` ranks (see the module docstring)."""

    def __init__(self, world_size: int, environment: Callable[[int], dict[str, str]]) -> None:
        self.world_size = world_size
        self._connections: list[Connection] = []
        self._processes: list[Any] = []
        self._folder = Path(tempfile.mkdtemp(prefix=f"warm-workers-{world_size}-"))
        saved = dict(os.environ)
        #: What each warm worker's environment was when it started.
        self.started_with = [environment(rank) for rank in range(world_size)]
        context = _context(self.started_with)
        try:
            for rank in range(world_size):
                os.environ.update(self.started_with[rank])
                ours, theirs = context.Pipe(duplex=True)
                process = context.Process(target=_warm_worker, args=(theirs,), daemon=True)
                with open(os.devnull, "wb") as quiet:
                    # The warm worker's own stdout/stderr: what its imports print goes nowhere
                    # (each child writes to its call's output file instead).
                    saved_fds = (os.dup(1), os.dup(2))
                    os.dup2(quiet.fileno(), 1)
                    os.dup2(quiet.fileno(), 2)
                    try:
                        process.start()
                    finally:
                        os.dup2(saved_fds[0], 1)
                        os.dup2(saved_fds[1], 2)
                        os.close(saved_fds[0])
                        os.close(saved_fds[1])
                theirs.close()
                self._connections.append(ours)
                self._processes.append(process)
        finally:
            os.environ.clear()
            os.environ.update(saved)
        self.calls = 0

    def alive(self) -> bool:
        return all(process.is_alive() for process in self._processes)

    def run(
        self,
        fn: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        env: list[dict[str, str]],
        timeout: float,
    ) -> list[Any]:
        """Run ``fn`` on every rank (``env[rank]`` added to its environment); returns the
        per-rank results or raises :class:`WorkerFailed` with the first failure."""
        self.calls += 1
        task = pickle.dumps((fn, args, kwargs))
        outputs = [self._folder / f"call{self.calls}-rank{rank}" for rank in range(self.world_size)]
        for rank, connection in enumerate(self._connections):
            connection.send(("run", task, env[rank], os.getcwd(), str(outputs[rank])))
        children: dict[int, int] = {}
        collected: dict[int, Any] = {}
        failure: str | None = None
        deadline = time.monotonic() + timeout
        try:
            while len(collected) < self.world_size and failure is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    failure = (
                        f"{fn.__name__} timed out after {timeout:.0f}s on {self.world_size} "
                        f"processes; ranks that finished: {sorted(collected)}"
                    )
                    break
                ready = wait(self._connections, timeout=min(remaining, 1.0))
                for connection in ready:
                    rank = self._connections.index(connection)
                    message = self._receive(connection, rank)
                    if message[0] == "started":
                        children[rank] = message[1]
                    elif message[0] == "died":
                        failure = f"rank(s) [{rank}] of {fn.__name__} died without a result (exit codes [{message[1]}])"
                        collected.setdefault(rank, None)
                    elif message[1]:
                        collected[rank] = pickle.loads(message[2])
                    else:
                        failure = f"rank {rank} of {fn.__name__} failed:\n{message[2].decode()}"
                        collected.setdefault(rank, None)
        finally:
            if failure is not None:
                for pid in children.values():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
            self._finish(children, set(collected), kill=failure is not None)
            self._relay(outputs)
        if failure is not None:
            raise WorkerFailed(failure)
        return [collected[rank] for rank in range(self.world_size)]

    def _receive(self, connection: Connection, rank: int) -> tuple[Any, ...]:
        try:
            return connection.recv()  # type: ignore[no-any-return]
        except (EOFError, OSError):
            self.close()
            raise WorkerFailed(f"the warm worker of rank {rank} died") from None

    def _finish(self, children: dict[int, int], answered: set[int], kill: bool) -> None:
        """Collect every rank's outstanding answers (after a failure, killing the children
        still running), release the children and wait for them."""
        for rank, connection in enumerate(self._connections):
            if rank in answered:
                continue
            message = self._receive(connection, rank)
            if message[0] == "started":  # its result, or that it died, comes next
                if kill:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(message[1], signal.SIGKILL)
                self._receive(connection, rank)
        for connection in self._connections:
            connection.send(("release",))
        for rank, connection in enumerate(self._connections):
            self._receive(connection, rank)  # "done"

    @staticmethod
    def _relay(outputs: list[Path]) -> None:
        """Pass on what the children printed, stdout to stdout and stderr to stderr, rank by
        rank (pytest captures both, as it would a freshly started rank's)."""
        for path in outputs:
            for suffix, stream in ((".out", sys.stdout), (".err", sys.stderr)):
                printed = Path(f"{path}{suffix}")
                with contextlib.suppress(OSError):
                    text = printed.read_text(errors="replace")
                    printed.unlink()
                    if text:
                        stream.write(text)
                        stream.flush()

    def close(self) -> None:
        for connection in self._connections:
            with contextlib.suppress(Exception):
                connection.send(None)
        for process in self._processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
        self._connections.clear()
        self._processes.clear()
