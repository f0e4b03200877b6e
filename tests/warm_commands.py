"""Warm commands: ``python ARGS`` for the suite's commands without paying Python + torch
start-up each time.

A fresh interpreter spends about two seconds of CPU importing torch, and ``slipstream
launch`` another two importing slipstream and torch's compiler for the workers it forks,
before the command's own work starts; the suite runs a hundred such commands. A
:class:`CommandServer` is one long-lived process per test process with those imported; each
command is a fork of it, made to look like ``python ARGS`` started fresh before the command
runs — as ``slipstream launch`` does for its own workers (core/launcher/forked.py):

- the command's environment, working directory, ``sys.argv`` and ``sys.path[0]`` as
  ``python script.py``, ``python -m module`` or ``python -c code`` set them, ``__main__``
  its own, standard input empty, stdout and stderr to files of their own;
- default signal handlers, fresh torch and NumPy random seeds, the thread count its
  ``OMP_NUM_THREADS`` asks for;
- at the end what an interpreter does at exit: wait for non-daemon threads, run the exit
  handlers, flush; an uncaught exception prints its traceback and exits 1.

Commands the server cannot stand in for run as fresh processes, as before: other
interpreter options (``-u``, ``-X ...``), a call made while another is running, and (the
caller's choice, tests/distributed.py) a command whose environment changes a variable read
while the interpreter or torch starts (``PYTHON*``, the GPU choice, ...).

Messages, one JSON object per line: test -> server ``{"argv", "env", "cwd", "stdout",
"stderr"}``; server -> test ``{"pid"}`` when the command started, then ``{"code"}`` (its
exit code, negative for a signal, as ``subprocess`` reports it).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import traceback
from pathlib import Path
from typing import IO, Any

#: What the server imports before its first command: what nearly every command imports
#: (``slipstream.cli`` and ``slipstream.accelerator``), what ``slipstream launch`` preloads
#: for its forked workers, and the transformers models the examples and jobs build (~2.3 s
#: of CPU in every rank otherwise; none of them starts a thread at import).
PRELOAD = (
    "torch",
    "slipstream.cli",
    "slipstream.accelerator",
    "torch._dynamo",
    "transformers.modeling_utils",
    "transformers.models.llama.modeling_llama",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
)


class CommandServer:
    """One warm server; :meth:`run` runs a command in a fork of it (module docstring)."""

    def __init__(self, env: dict[str, str], cwd: Path, started_with: dict[str, str]) -> None:
        #: The variables read at start-up it began with (the caller's to compare a command's
        #: against: a command that wants others needs a fresh process).
        self.started_with = started_with
        self._lock = threading.Lock()
        self._folder = Path(tempfile.mkdtemp(prefix="warm-commands-"))
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tests.warm_commands"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            text=True,
        )
        self.calls = 0

    def alive(self) -> bool:
        return self._process.poll() is None

    def can_run(self, arguments: tuple[str, ...]) -> bool:
        """Whether ``python ARGUMENTS`` is one it stands in for: a script, ``-m`` or ``-c``
        (not other interpreter options), while it is alive and idle."""
        first = arguments[0] if arguments else "-"
        return self.alive() and (first in ("-m", "-c") or not first.startswith("-"))

    def run(
        self, arguments: tuple[str, ...], env: dict[str, str], cwd: Path, timeout: float
    ) -> subprocess.CompletedProcess[str] | None:
        """The command's result as ``subprocess.run(capture_output=True, text=True)`` gives
        it (raising ``subprocess.TimeoutExpired`` after ``timeout``), or None where it
        must run as a fresh process."""
        running = self.start(arguments, env, cwd)
        if running is None:
            return None
        try:
            running.wait(timeout)
        except subprocess.TimeoutExpired:
            running.kill()
            raise subprocess.TimeoutExpired(running.args, timeout, *running.output()) from None
        return subprocess.CompletedProcess(running.args, running.wait(), *running.output())

    def start(
        self,
        arguments: tuple[str, ...],
        env: dict[str, str],
        cwd: Path,
        *,
        merge_output: bool = False,
        new_session: bool = False,
    ) -> RunningCommand | None:
        """Start ``python ARGUMENTS`` (as ``subprocess.Popen`` would, with ``stderr=STDOUT``
        for ``merge_output`` and ``start_new_session``); None where it must run as a fresh
        process. The server runs one command at a time: the next waits for this one."""
        if not self.can_run(arguments) or not self._lock.acquire(blocking=False):
            return None
        self.calls += 1
        out, err = (self._folder / f"call{self.calls}.{name}" for name in ("out", "err"))
        request = {
            "argv": list(arguments), "env": env, "cwd": str(cwd), "stdout": str(out),
            "stderr": str(out if merge_output else err), "session": new_session,
        }  # fmt: skip
        assert self._process.stdin is not None and self._process.stdout is not None
        try:
            self._process.stdin.write(json.dumps(request) + "\n")
            self._process.stdin.flush()
            pid = json.loads(self._process.stdout.readline())["pid"]
        except (OSError, ValueError, KeyError):
            self._lock.release()
            return None  # the server is gone: a fresh process instead
        return RunningCommand(self, [sys.executable, *arguments], pid, out, err)

    def _finished(self, hung: bool) -> None:
        if hung:  # the server did not answer after its command was killed: no later call uses it
            self._process.kill()
        self._lock.release()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            assert self._process.stdin is not None
            self._process.stdin.close()
        try:
            self._process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


class RunningCommand:
    """A command the server started: ``pid``, ``poll()``, ``wait(timeout)``, ``kill()``,
    ``output()`` (stdout and stderr, once it ended)."""

    def __init__(self, server: CommandServer, args: list[str], pid: int, out: Path, err: Path):
        self.args, self.pid = args, pid
        self._server, self._out, self._err = server, out, err
        assert server._process.stdout is not None
        self._answer = _ReadLine(server._process.stdout)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and self._answer.wait(0) is not None:
            self._end(self._answer.wait(0))
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            line = self._answer.wait(timeout)
            if line is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self._end(line)
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        """SIGKILL the command (its whole session, if it has one) and wait for it."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(self.pid) == self.pid:
                os.killpg(self.pid, signal.SIGKILL)
            else:
                os.kill(self.pid, signal.SIGKILL)
        if self.returncode is None:
            line = self._answer.wait(30)
            self._end(line, hung=line is None)

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """As ``Popen.communicate``: stdout and stderr once it ended (``TimeoutExpired``
        if it has not within ``timeout``; call again after killing it)."""
        self.wait(timeout)
        return self.output()

    def output(self) -> tuple[str, str]:
        return _take(self._out), (_take(self._err) if self._err != self._out else "")

    def _end(self, line: str | None, hung: bool = False) -> None:
        self.returncode = json.loads(line)["code"] if line else -signal.SIGKILL
        self._server._finished(hung)


class _ReadLine:
    """The next line of ``stream``, waited for with a timeout (a thread reads it)."""

    def __init__(self, stream: IO[str]) -> None:
        self._line: str | None = None
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        self._line = stream.readline()

    def wait(self, timeout: float) -> str | None:
        self._thread.join(timeout)
        return None if self._thread.is_alive() else self._line


def _take(path: Path) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    path.unlink()
    return text


# -- the server ---------------------------------------------------------------------------
def _serve() -> None:
    import importlib

    for name in PRELOAD:
        with contextlib.suppress(Exception):
            importlib.import_module(name)
    # A command's full garbage collections then skip the ~350,000 objects it inherits
    # (0.3 s of CPU each, and a copy of every page they touch).
    gc.freeze()
    requests, answers = sys.stdin, sys.stdout
    for line in requests:
        request = json.loads(line)
        answers.flush()
        pid = os.fork()
        if pid == 0:
            _command(request)  # never returns
        answers.write(json.dumps({"pid": pid}) + "\n")
        answers.flush()
        _, status = os.waitpid(pid, 0)
        answers.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n")
        answers.flush()


def _command(request: dict[str, Any]) -> None:
    """The forked child: become ``python ARGV`` (module docstring), run it, exit."""
    code = 1
    try:
        _look_fresh(request)
        code = _run_main(request["argv"])
    except BaseException:  # the set-up itself failed: say so as a crash would
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _look_fresh(request: dict[str, Any]) -> None:
    if request.get("session"):
        os.setsid()
    with open(os.devnull, "rb") as nothing:
        os.dup2(nothing.fileno(), 0)
    with open(request["stdout"], "wb") as stream:
        os.dup2(stream.fileno(), 1)
        if request["stderr"] == request["stdout"]:  # one file, one offset: stderr=STDOUT
            os.dup2(stream.fileno(), 2)
    if request["stderr"] != request["stdout"]:
        with open(request["stderr"], "wb") as stream:
            os.dup2(stream.fileno(), 2)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for name in ("SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGCHLD"):
        signal.signal(getattr(signal, name), signal.SIG_DFL)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    # What the server's imports noted of its own start: where it started (multiprocessing
    # resolves a relative __main__ path for spawned children from it) and its temp folder.
    import multiprocessing.process

    multiprocessing.process.ORIGINAL_DIR = os.getcwd()  # type: ignore[attr-defined]
    tempfile.tempdir = None
    import torch

    from tests.warm_workers import reseed

    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))
    reseed()


def _run_main(argv: list[str]) -> int:
    """Run ``python ARGV``'s main module; its exit code, as the interpreter would exit."""
    import runpy
    import types

    code: int = 0
    sys.modules["__main__"] = types.ModuleType("__main__")  # not the server's own
    try:
        if argv[0] == "-m":
            sys.argv = ["-m", *argv[2:]]
            sys.path[0] = os.getcwd()
            runpy._run_module_as_main(argv[1])  # type: ignore[attr-defined]
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path[0] = ""
            exec(compile(argv[1], "<string>", "exec"), sys.modules["__main__"].__dict__)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        code = exit_code(stop.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    # What an interpreter does at exit: non-daemon threads first, then the exit handlers.
    with contextlib.suppress(BaseException):
        threading._shutdown()  # type: ignore[attr-defined]
    try:
        atexit._run_exitfuncs()
    except SystemExit as stop:
        code = exit_code(stop.code)
    return code


def exit_code(value: object) -> int:
    """The exit code of ``SystemExit(value)``, printing a message to stderr as Python does."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value
    print(value, file=sys.stderr)  # sys.exit("message")
    return 1


if __name__ == "__main__":
    _serve()
