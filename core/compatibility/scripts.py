"""What Accelerate's own test scripts show: the functions of the distributed test scripts in
the accelerate package (``accelerate/test_utils/scripts``) that fail under slipstream too,
each with why and the slipstream test that shows the intended behaviour. Every other
function their entry points call on 2 CPU processes passes (tests/accelerate_scripts runs
them all, imports rewritten by ``slipstream migrate``, and keeps this list true).

Example::

    SCRIPT_DIFFERENCES[("test_merge_weights.py", "test_merge_weights_pytorch")]
"""

from __future__ import annotations

_MERGE = (
    "the script compares model.state_dict() with plain tensors; under FSDP2 (slipstream's, "
    "and Accelerate's fsdp_version=2) the state dict holds DTensors, which torch.allclose "
    "refuses; Accelerate runs it with FSDP1 on GPUs only "
    "(tests/core/utils/test_saving.py runs the same flow comparing full tensors)"
)
_BF16_HOOK = (
    "torch's bf16 gradient-compression hooks need GPUs with NCCL: on CPU processes slipstream "
    "refuses them when the Accelerator is made (Accelerate fails in prepare) "
    "(tests/core/strategies/test_ddp_comm_hooks.py)"
)
_SHARDED_STREAM = (
    "slipstream shards an IterableDataset by default (a stream that shards itself is read in "
    "parts, another is read by every process keeping its share), so the prepared loader is a "
    "DataLoaderShard; Accelerate dispatches it from the main process by default, and "
    "dispatch_batches=True gives its DataLoaderDispatcher "
    "(tests/core/data/test_prepare.py::test_prepare_data_loader_takes_accelerates_arguments)"
)

#: (script, test function — or one call of it) -> why it fails under slipstream too.
SCRIPT_DIFFERENCES: dict[tuple[str, str], str] = {
    ("external_deps/test_metrics.py", "test_gather_for_metrics_with_iterable_dataset"): (
        _SHARDED_STREAM
    ),
    **{
        ("test_merge_weights.py", f"test_merge_weights_{kind}"): _MERGE
        for kind in ("safetensors", "command_safetensors", "pytorch", "command_pytorch")
    },
    **{
        ("test_ddp_comm_hook.py", f"test_ddp_comm_hook({hook}, {wrapper}, {{}})"): _BF16_HOOK
        for hook, wrapper in (("BF16", "NO"), ("POWER_SGD", "BF16"), ("BATCHED_POWER_SGD", "BF16"))
    },
}

#: Changes a CPU run of two scripts needs outside their checks (Accelerate runs them on GPUs
#: only): script -> [(text, replacement, why)].
CPU_ADAPTATIONS: dict[str, list[tuple[str, str, str]]] = {
    "test_ddp_comm_hook.py": [
        (
            "device_ids=[accelerator.local_process_index],\n"
            "        output_device=accelerator.local_process_index,",
            "device_ids=None,\n        output_device=None,",
            "the script's own reference DDP model pins a GPU; torch refuses device_ids for a "
            "CPU module",
        )
    ],
}
