"""Big-model inference: models larger than a device, or than memory.

Build a model without memory (:func:`init_empty_weights`), plan where its parts go
(:func:`infer_auto_device_map`), load a checkpoint tensor by tensor straight to those
devices and run it with weights offloaded to the CPU or the disk
(:func:`load_checkpoint_and_dispatch`). The names and arguments are Accelerate's.

Submodules are imported on first use: ``import slipstream`` stays as cheap as ``import torch``.

Example::

    from slipstream import init_empty_weights, load_checkpoint_and_dispatch

    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    model = load_checkpoint_and_dispatch(model, "llama/", device_map="auto",
                                         max_memory={"cpu": "8GiB"}, offload_folder="offload/")
"""

from __future__ import annotations

from ..runtime.lazy import lazy_exports

_EXPORTS = {
    "AlignDevicesHook": "hooks",
    "CpuOffload": "hooks",
    "DeviceMapError": "budgets",
    "ModelHook": "hooks",
    "OffloadedWeightsLoader": "offload",
    "PrefixedDataset": "offload",
    "SequentialHook": "hooks",
    "UserCpuOffloadHook": "hooks",
    "add_hook_to_module": "hooks",
    "attach_align_device_hook": "hooks",
    "check_device_map": "device_map",
    "clean_device_map": "device_map",
    "compute_module_sizes": "tensors",
    "cpu_offload": "dispatch",
    "cpu_offload_with_hook": "dispatch",
    "disk_offload": "dispatch",
    "dispatch_model": "dispatch",
    "find_tied_parameters": "tensors",
    "get_balanced_memory": "budgets",
    "get_max_memory": "budgets",
    "has_offloaded_params": "hooks",
    "infer_auto_device_map": "device_map",
    "init_empty_weights": "empty",
    "init_on_device": "empty",
    "load_checkpoint_and_dispatch": "dispatch",
    "load_checkpoint_in_model": "loading",
    "named_module_tensors": "tensors",
    "offload_state_dict": "offload",
    "remove_hook_from_module": "hooks",
    "set_module_tensor_to_device": "tensors",
}

__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
