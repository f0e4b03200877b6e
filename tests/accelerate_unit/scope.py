"""Which of Accelerate's unit tests (``tests/test_*.py`` of its source distribution) the lane
runs against slipstream, and why the others are left out (README.md says the same in prose).

In scope: a test that exercises slipstream through public names slipstream provides. Out:
tests of Accelerate's internals (private attributes, its CLI's command builders, modules
outside the public ``accelerate``/``accelerate.utils``/``accelerate.logging`` names), tests
of names the compatibility table marks "not provided" (``slipstream migrate`` leaves them on
accelerate, so such a test runs Accelerate's code, not slipstream's), and files whose every
test needs GPUs or runs Accelerate's own scripts (tests/accelerate_scripts runs those,
migrated).
"""

from __future__ import annotations

import fnmatch

_SCRIPTS = (
    "runs Accelerate's own test scripts imported from accelerate.test_utils (Accelerate's "
    "code, left unmigrated) under debug_launcher; tests/accelerate_scripts runs those "
    "scripts migrated, on 2 CPU processes"
)
_CLI = (
    "tests Accelerate's command-line tool (`accelerate launch/config/estimate-memory/"
    "to-fsdp2/tpu-config`: its parsers, config classes and command builders); slipstream's "
    "commands have their own tests (tests/core/cli)"
)

#: Files left out whole: file -> why.
OUT_OF_SCOPE_FILES: dict[str, str] = {
    "test_cli.py": _CLI,
    "test_launch.py": _CLI,
    "test_sagemaker.py": "Accelerate's SageMaker launcher internals (not provided)",
    "test_tpu.py": "needs a TPU and runs Accelerate's TPU launcher script",
    "test_examples.py": (
        "runs the example scripts of Accelerate's repository (not in the source "
        "distribution) with `accelerate launch`, and needs datasets from the network"
    ),
    "test_hooks.py": (
        "accelerate.hooks (ModelHook, add_hook_to_module, AlignDevicesHook, ...) is an "
        "internal module: the compatibility table covers accelerate, accelerate.utils and "
        "accelerate.logging, and slipstream's offload hooks are its own"
    ),
    "test_compile.py": "compile_regions is not provided (see docs/compatibility.md)",
    "test_quantization.py": "bitsandbytes quantization is not provided; needs GPUs",
    "test_fp8.py": "the fp8 recipe objects are not provided; needs fp8 GPUs",
    "test_imports.py": "times `import accelerate` and checks Accelerate's own lazy imports",
    "test_activation_checkpointing_offload.py": "needs CUDA in every test",
    "test_load_checkpoint_and_dispatch_with_broadcast.py": (
        "broadcast_from_rank0 is not provided; every test needs several GPUs"
    ),
    "test_multidevice.py": (
        "every test needs several GPUs and launches Accelerate's scripts with `accelerate "
        "launch`; tests/accelerate_scripts runs those scripts migrated on 2 CPU processes"
    ),
    "test_cpu.py": _SCRIPTS,
    "test_grad_sync.py": _SCRIPTS,
    "test_metrics.py": _SCRIPTS,
}

_PRIVATE = "reads private attributes of Accelerate's objects ({})"
_NOT_PROVIDED = "uses {}, which slipstream does not provide (left on accelerate by migrate)"
_ACCELERATE_ONLY = "exercises only Accelerate's {} (a name slipstream does not provide)"

#: Single tests of the files that run: ``file::Class::test`` pattern (fnmatch, so
#: ``*`` covers parameterized variants) -> why it is left out.
OUT_OF_SCOPE_TESTS: dict[str, str] = {
    # test_accelerator.py
    "test_accelerator.py::*::test_partial_state_after_reset": (
        "tests the private PartialState._reset_state itself"
    ),
    "test_accelerator.py::*::test_accelerator_state_after_reset": (
        "tests the private AcceleratorState._reset_state itself"
    ),
    "test_accelerator.py::*::test_accelerator_can_be_reinstantiated": _PRIVATE.format(
        "AcceleratorState._shared_state"
    ),
    "test_accelerator.py::*::test_accelerator_bnb_multi_device": _PRIVATE.format(
        "AcceleratorState._shared_state"
    ),
    "test_accelerator.py::*::test_prepared_objects_are_referenced*": _PRIVATE.format(
        "Accelerator._models, _optimizers, _schedulers, _dataloaders"
    ),
    "test_accelerator.py::*::test_free_memory_dereferences_prepared_components": _PRIVATE.format(
        "Accelerator._models, _optimizers, _schedulers, _dataloaders"
    ),
    "test_accelerator.py::*::test_prepare_model_twice_does_not_double_wrap": _PRIVATE.format(
        "Accelerator._models"
    ),
    "test_accelerator.py::*::test_can_pickle_dataloader*": _PRIVATE.format(
        "Accelerator._dataloaders"
    ),
    "test_accelerator.py::*::test_get_state_dict_from_offload*": _NOT_PROVIDED.format(
        "accelerate.utils.modeling.get_state_dict_from_offload"
    ),
    "test_accelerator.py::*::test_can_unwrap_model_te": _NOT_PROVIDED.format("FP8RecipeKwargs"),
    # test_data_loader.py
    "test_data_loader.py::*::test_batch_sampler_*": _ACCELERATE_ONLY.format("BatchSamplerShard"),
    "test_data_loader.py::*::test_split_batches_validates_*": _ACCELERATE_ONLY.format(
        "BatchSamplerShard"
    ),
    "test_data_loader.py::*::test_skip_data_loader": _ACCELERATE_ONLY.format("SkipDataLoader"),
    "test_data_loader.py::*::test_dataloader_inheritance": _NOT_PROVIDED.format(
        "SkipDataLoader and DataLoaderStateMixin"
    ),
    "test_data_loader.py::*::test_stateful_dataloader_adapter_equivalent_*": (
        _NOT_PROVIDED.format("SkipDataLoader")
    ),
    "test_data_loader.py::*::test_decoupled_stateful_dataloader_adapter_*": (
        _NOT_PROVIDED.format("SkipDataLoader") + "; " + _PRIVATE.format("_shared_state")
    ),
    # test_dataclasses.py
    "test_dataclasses.py::*::test_get_mesh*": _PRIVATE.format("ParallelismConfig._get_mesh"),
    "test_dataclasses.py::*::test_sp_deepspeed_handler": _NOT_PROVIDED.format(
        "DeepSpeedSequenceParallelConfig (DeepSpeed Ulysses sequence parallelism)"
    ),
    "test_dataclasses.py::*::test_tp_handler": "asserts nothing (`assert True`)",
    # test_modeling_utils.py
    "test_modeling_utils.py::*::test_infer_auto_device_map_on_t0pp": (
        "downloads bigscience/T0pp's configuration from the Hugging Face Hub, which these "
        "machines cannot reach (infer_auto_device_map on transformers models is covered by "
        "the file's other tests)"
    ),
    "test_modeling_utils.py::*::test_get_non_persistent_buffers_does_not_mutate_module": (
        _ACCELERATE_ONLY.format("get_non_persistent_buffers")
    ),
    "test_modeling_utils.py::*::test_retie_parameters": _ACCELERATE_ONLY.format("retie_parameters"),
    "test_modeling_utils.py::*::test_compute_module_total_buffer_size": _ACCELERATE_ONLY.format(
        "compute_module_total_buffer_size"
    ),
    "test_modeling_utils.py::*::test_clean_device_map": _ACCELERATE_ONLY.format("clean_device_map"),
    "test_modeling_utils.py::*::test_get_module_size_with_ties": _ACCELERATE_ONLY.format(
        "get_module_size_with_ties"
    ),
    "test_modeling_utils.py::*::test_load_state_dict": _NOT_PROVIDED.format("load_state_dict"),
    "test_modeling_utils.py::*::test_get_state_dict_offloaded_model": _NOT_PROVIDED.format(
        "accelerate.utils.modeling.get_state_dict_offloaded_model"
    ),
    "test_modeling_utils.py::*::test_align_module_device_*": _NOT_PROVIDED.format(
        "align_module_device"
    ),
    # test_utils.py
    "test_utils.py::*::test_can_undo_*": _PRIVATE.format("the model's _original_forward"),
    "test_utils.py::*::test_dynamo": _PRIVATE.format("the model's _original_forward"),
    "test_utils.py::*::test_pad_across_processes": _NOT_PROVIDED.format(
        "CannotPadNestedTensorWarning"
    ),
    "test_utils.py::*::test_convert_dict_to_env_variables": _ACCELERATE_ONLY.format(
        "convert_dict_to_env_variables"
    ),
    "test_utils.py::*::test_has_offloaded_params": _NOT_PROVIDED.format(
        "accelerate.hooks.attach_align_device_hook"
    ),
    "test_utils.py::*::test_get_model_tp_size": _ACCELERATE_ONLY.format("get_model_tp_size"),
    # test_tracking.py
    "test_tracking.py::CometMLTest::*": _NOT_PROVIDED.format("CometMLTracker"),
    "test_tracking.py::ClearMLTest::*": _PRIVATE.format("ClearML's _get_offline_dir"),
    "test_tracking.py::TrackerDeferredInitializationTest::*": _PRIVATE.format(
        "AcceleratorState._shared_state"
    ),
    # test_scheduler.py
    "test_scheduler.py::*::test_lambda_scheduler_*": _PRIVATE.format(
        "the prepared optimizer's _is_overflow"
    ),
    # test_kwargs_handlers.py
    "test_kwargs_handlers.py::*::test_grad_scaler_kwargs": _PRIVATE.format(
        "GradScaler's _init_scale, _growth_factor, ..."
    ),
    # test_offload.py
    "test_offload.py::*::test_offload_weight": _NOT_PROVIDED.format(
        "offload_weight and load_offloaded_weight"
    ),
    "test_offload.py::*::test_extract_submodules_state_dict": _ACCELERATE_ONLY.format(
        "extract_submodules_state_dict"
    ),
    # test_big_modeling.py
    "test_big_modeling.py::RefuseRecurrentLayersTester::*": _PRIVATE.format(
        "accelerate.big_modeling._refuse_recurrent_layers_under_sequence_parallelism"
    ),
    "test_big_modeling.py::*::test_dispatch_model_tied_weights_memory_with_nested_*": (
        _PRIVATE.format("the module's _hf_hook")
    ),
}


def files_to_run(available: list[str]) -> list[str]:
    """The files of ``available`` (names) that run: every ``test_*.py`` not left out whole."""
    return sorted(n for n in available if n.startswith("test_") and n not in OUT_OF_SCOPE_FILES)


def out_of_scope(test_id: str) -> str | None:
    """Why ``file::Class::test`` (pytest's node id, parameters included) is left out, or
    ``None`` when it is in scope."""
    name = test_id.split("[", 1)[0]
    for pattern, why in OUT_OF_SCOPE_TESTS.items():
        if fnmatch.fnmatchcase(name, pattern):
            return why
    return None
