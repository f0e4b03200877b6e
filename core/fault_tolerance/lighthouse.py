"""Starting and stopping a torchft lighthouse (its ``torchft_lighthouse`` program) for a
single-machine or test job; a cluster runs one lighthouse of its own.

Example::

    with Lighthouse(min_replicas=1) as lighthouse:
        print(lighthouse.address)    # http://127.0.0.1:PORT, for FaultToleranceKwargs
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from slipstream.fault_tolerance.lighthouse_process import extension_file


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


def lighthouse_program() -> str:
    """The path of ``torchft_lighthouse`` (next to this Python, else on ``PATH``)."""
    beside = Path(sys.executable).with_name("torchft_lighthouse")
    if beside.exists():
        return str(beside)
    found = shutil.which("torchft_lighthouse")
    if found is None:
        raise RuntimeError(
            "fault tolerance needs torchft's lighthouse program (torchft_lighthouse), which "
            "was not found: pip install 'slipstream[fault-tolerance]' (or torchft>=0.2)"
        )
    return found


def lighthouse_command() -> list[str]:
    """The command that starts a lighthouse: torchft's compiled lighthouse run by this Python
    without importing torch (lighthouse_process.py; ~2 s of CPU less per lighthouse), else
    its ``torchft_lighthouse`` program."""
    if extension_file() is not None:
        return [sys.executable, str(Path(__file__).with_name("lighthouse_process.py"))]
    return [lighthouse_program()]


class Lighthouse:
    """A ``torchft_lighthouse`` process bound to ``host`` on a free port.

    ``heartbeat_timeout`` is how long a silent replica group counts as alive (the longest a
    survivor stalls on a dead peer); ``join_timeout`` how long a quorum waits for groups
    that heartbeat but have not asked to join yet (a group still starting up).
    """

    def __init__(
        self,
        min_replicas: int = 1,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        heartbeat_timeout: float = 5.0,
        join_timeout: float = 5.0,
        quorum_tick: float = 0.05,
    ) -> None:
        self.min_replicas = min_replicas
        self.host = host
        self.port = port or free_port(host)
        self.heartbeat_timeout = heartbeat_timeout
        self.join_timeout = join_timeout
        self.quorum_tick = quorum_tick
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, wait: float = 20.0) -> Lighthouse:
        command = [
            *lighthouse_command(),
            "--bind",
            f"{self.host}:{self.port}",
            "--min_replicas",
            str(self.min_replicas),
            "--heartbeat_timeout_ms",
            str(int(self.heartbeat_timeout * 1000)),
            "--join_timeout_ms",
            str(int(self.join_timeout * 1000)),
            "--quorum_tick_ms",
            str(max(1, int(self.quorum_tick * 1000))),
        ]
        self.process = subprocess.Popen(
            command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"torchft_lighthouse exited with code {self.process.returncode} at start "
                    f"(is {self.host}:{self.port} taken?)"
                )
            try:
                with socket.create_connection((self.host, self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"torchft_lighthouse did not listen on {self.address} in {wait} s")

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def __enter__(self) -> Lighthouse:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: Any) -> None:
        self.stop()
