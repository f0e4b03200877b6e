"""The XLA lane: these tests run on torch_xla's XLA:CPU device (``PJRT_DEVICE=CPU``) in the
separate venv that ``.ci/xla_lane`` builds (torch_xla publishes wheels only for particular
torch releases). Where torch_xla is not installed (the main suite) they are skipped.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator

import pytest

from slipstream.runtime.state import reset_shared_state

HAVE_XLA = importlib.util.find_spec("torch_xla") is not None
SKIP_REASON = (
    "torch_xla is not installed here: the XLA tests run in their own lane (.ci/xla_lane, "
    "torch 2.9 + torch_xla 2.9 on XLA:CPU)"
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_XLA:
        return
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.skip(reason=SKIP_REASON))


@pytest.fixture(autouse=True)
def _xla_cpu(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """PJRT's CPU client (a test never reaches a TPU) and a fresh shared state per test."""
    monkeypatch.setenv("PJRT_DEVICE", os.environ.get("PJRT_DEVICE") or "CPU")
    reset_shared_state(reset_partial_state=True)
    yield
    reset_shared_state(reset_partial_state=True)
