"""Which of Hugging Face Accelerate's public names slipstream provides, and how.

One row per name of ``accelerate``, ``accelerate.utils``, ``accelerate.logging`` and the
``Accelerator`` class's members: ``same`` (the same name with a compatible signature),
``different`` (provided, with a difference the note describes) or ``not provided`` (the
note says why and what to use instead); and what Accelerate's own test scripts show
(:mod:`~slipstream.compatibility.scripts`) and its unit tests
(:mod:`~slipstream.compatibility.unit_tests`). ``docs/compatibility.md`` is generated from these
(``python -m slipstream.compatibility``); ``slipstream migrate`` reports every use of a name
that is not provided with its note; tests keep the rows complete and true.

Example::

    lookup("accelerate", "prepare_pippy")
    # Row(status='not provided', note='use ParallelismConfig(pp_size=...): ...')
"""

from __future__ import annotations

from . import names as _names  # noqa: F401  (fills TABLE)
from .document import markdown
from .scripts import CPU_ADAPTATIONS, SCRIPT_DIFFERENCES
from .table import DIFFERENT, NAMESPACES, NOT_PROVIDED, SAME, TABLE, Row, lookup
from .unit_tests import UNIT_TEST_DIFFERENCES

__all__ = [
    "CPU_ADAPTATIONS",
    "DIFFERENT",
    "NAMESPACES",
    "NOT_PROVIDED",
    "SAME",
    "SCRIPT_DIFFERENCES",
    "TABLE",
    "UNIT_TEST_DIFFERENCES",
    "Row",
    "lookup",
    "markdown",
]
