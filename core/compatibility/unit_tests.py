"""What Accelerate's own unit tests show: the tests of its repository (``tests/test_*.py``
of the source distribution) that exercise public names slipstream provides and still fail
under slipstream, each with why and the slipstream test that shows the intended behaviour.
tests/accelerate_unit runs them all, imports rewritten by ``slipstream migrate``, and keeps
this list true; its README says which tests are out of scope and why.

Keys are ``file::Class::test`` patterns (``*`` covers a test's parameterized variants).

Example::

    UNIT_TEST_DIFFERENCES["test_offload.py::OffloadTester::test_offload_state_dict"]
"""

from __future__ import annotations

_PLANNER = (
    "slipstream's planner keeps room for the largest block on the execution device only "
    "when something is offloaded, so GPUs are filled when the model fits (and a model that "
    "fits on the GPUs is not offloaded); Accelerate keeps the largest layer's room on every "
    "GPU but the last all the same, so its maps differ "
    "(tests/core/big_modeling/test_device_map.py::"
    "test_buffers_of_offloaded_modules_that_cannot_fit_on_the_gpu_are_warned_about and "
    "::test_a_small_cpu_budget_sends_the_rest_to_disk_keeping_room_for_one_block)"
)
_FALLBACK = (
    "infer_auto_device_map has no fallback_allocation: placement keeps the model's order "
    "(Accelerate's default), and a budget that cannot hold the block an offloaded part "
    "needs is an error naming the budget to raise "
    "(tests/core/big_modeling/test_device_map.py::test_a_budget_that_cannot_hold_one_block_names_it)"
)

#: ``file::Class::test`` pattern -> why it fails under slipstream too.
UNIT_TEST_DIFFERENCES: dict[str, str] = {
    "test_modeling_utils.py::ModelingUtilsTester::test_infer_auto_device_map": _PLANNER,
    "test_modeling_utils.py::ModelingUtilsTester::test_infer_auto_device_map_with_tied_weights": (
        _PLANNER
    ),
    "test_modeling_utils.py::ModelingUtilsTester::"
    "test_infer_auto_device_map_with_buffer_check_and_multi_devices": _PLANNER,
    "test_modeling_utils.py::ModelingUtilsTester::test_infer_auto_device_map_with_fallback_*": (
        _FALLBACK
    ),
    "test_offload.py::OffloadTester::test_offload_state_dict": (
        "the offload folder holds safetensors files and an index.json (read through a memory "
        "map; a safetensors checkpoint's own files are used in place, never copied), not "
        "Accelerate's .dat file per tensor the test looks for "
        "(tests/core/big_modeling/test_offload.py::"
        "test_written_files_are_plain_safetensors_and_tied_tensors_are_stored_once)"
    ),
}
