"""What Accelerate's own unit tests show: the tests of its repository (``tests/test_*.py``
of the source distribution) that exercise public names slipstream provides and still fail
under slipstream, each with why and the slipstream test that shows the intended behaviour.
tests/accelerate_unit runs them all, imports rewritten by ``slipstream migrate``, and keeps
this list true; its README says which tests are out of scope and why.

Keys are ``file::Class::test`` patterns (``*`` covers a test's parameterized variants).

Example::

    UNIT_TEST_DIFFERENCES["test_memory_utils.py::MemoryTest::test_memory_implicit"]
"""

from __future__ import annotations

#: ``file::Class::test`` pattern -> why it fails under slipstream too.
UNIT_TEST_DIFFERENCES: dict[str, str] = {}
