"""This machine: ports in use, the kernel version, the GPUs ``nvidia-smi`` lists.

Example::

    is_port_in_use(29500)     # is another job's rendezvous there?
    names, count = get_gpu_info()
"""

from __future__ import annotations

import platform
import re
import socket
import subprocess

from ..logging import get_logger
from .availability import parse

logger = get_logger(__name__)

#: Older Linux kernels can hang distributed jobs (Accelerate's issue #1929).
MINIMUM_KERNEL = "5.5.0"


def is_port_in_use(port: int | None = None) -> bool:
    """Whether something listens on ``localhost:port`` (default 29500, torchrun's port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        return sock.connect_ex(("localhost", 29500 if port is None else port)) == 0


def check_os_kernel() -> None:
    """Warn (from the main process) when the Linux kernel is older than 5.5."""
    info = platform.uname()
    if info.system != "Linux":
        return
    match = re.search(r"\d+\.\d+\.\d+", info.release)
    if match is not None and parse(match.group()) < parse(MINIMUM_KERNEL):
        logger.warning(
            f"the Linux kernel is {match.group()}, older than the recommended {MINIMUM_KERNEL}; "
            "distributed jobs can hang on it: upgrade the kernel",
            main_process_only=True,
        )


def get_gpu_info() -> tuple[list[str], int]:
    """(names, count) of the NVIDIA GPUs, asked of ``nvidia-smi`` (CUDA stays uninitialised).

    Raises ``FileNotFoundError`` where ``nvidia-smi`` is not installed.
    """
    output = subprocess.check_output(
        ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], text=True
    )
    names = [line.strip() for line in output.splitlines() if line.strip()]
    return names, len(names)
