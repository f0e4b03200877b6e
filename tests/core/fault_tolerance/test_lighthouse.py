"""A lighthouse starts without importing torch (core/fault_tolerance/lighthouse_process.py)."""

from __future__ import annotations

import importlib.util
import socket
from pathlib import Path

import pytest

from slipstream.fault_tolerance import lighthouse as lighthouse_module
from slipstream.fault_tolerance import lighthouse_process
from slipstream.fault_tolerance.lighthouse import Lighthouse, lighthouse_command

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchft") is None, reason="torchft is not installed"
)


def test_the_lighthouse_listens_without_importing_torch() -> None:
    assert Path(lighthouse_command()[-1]).name == "lighthouse_process.py"
    with Lighthouse(min_replicas=2, heartbeat_timeout=2) as lighthouse:
        assert lighthouse.process is not None
        with socket.create_connection((lighthouse.host, lighthouse.port), timeout=5):
            pass
        libraries = Path(f"/proc/{lighthouse.process.pid}/maps").read_text()
        assert "libtorch" not in libraries, "the lighthouse process loaded torch"
    assert lighthouse.process is None


def test_without_the_extension_torchfts_program_starts_it(monkeypatch, capsys) -> None:
    monkeypatch.setattr(lighthouse_module, "extension_file", lambda: None)
    assert lighthouse_command() == [lighthouse_module.lighthouse_program()]
    monkeypatch.setattr(lighthouse_process, "extension_file", lambda: None)
    assert lighthouse_process.main() == 2
    assert "_torchft" in capsys.readouterr().err
