from __future__ import annotations

from collections.abc import Iterator

import pytest

from slipstream.state import set_current_state


@pytest.fixture(autouse=True)
def _fresh_process_state() -> Iterator[None]:
    """Each test builds its own Accelerator / ProcessState from scratch."""
    set_current_state(None)
    yield
    set_current_state(None)
