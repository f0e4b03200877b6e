"""This machine: ports in use, the kernel version check, the GPUs nvidia-smi lists."""

from __future__ import annotations

import logging
import platform
import socket
import subprocess

import pytest

from slipstream.utils import system
from slipstream.utils.system import check_os_kernel, get_gpu_info, is_port_in_use


def test_a_listening_port_is_in_use_and_a_closed_one_is_not():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        assert is_port_in_use(port)
    assert not is_port_in_use(port)


def _uname(system_name: str, release: str) -> platform.uname_result:
    return platform.uname_result(system_name, "host", release, "#1", "x86_64")


@pytest.mark.parametrize(
    ("system_name", "release", "warns"),
    [
        ("Linux", "4.15.0-1-generic", True),
        ("Linux", "5.15.0-91-generic", False),
        ("Darwin", "4.0.0", False),
    ],
)
def test_old_linux_kernels_are_warned_about(monkeypatch, caplog, system_name, release, warns):
    monkeypatch.setattr(system.platform, "uname", lambda: _uname(system_name, release))
    with caplog.at_level(logging.WARNING, logger="slipstream.utils.system"):
        check_os_kernel()
    assert ("older than the recommended 5.5.0" in caplog.text) is warns


def test_gpu_names_from_nvidia_smi(monkeypatch):
    calls = []

    def fake(command, text):
        calls.append(command)
        return "NVIDIA H100 80GB HBM3\nNVIDIA H100 80GB HBM3\n\n"

    monkeypatch.setattr(subprocess, "check_output", fake)
    assert get_gpu_info() == (["NVIDIA H100 80GB HBM3"] * 2, 2)
    assert calls[0][0] == "nvidia-smi"


def test_without_nvidia_smi(monkeypatch):
    def missing(*args, **kwargs):
        raise FileNotFoundError("nvidia-smi")

    monkeypatch.setattr(subprocess, "check_output", missing)
    with pytest.raises(FileNotFoundError):
        get_gpu_info()
