"""The rows: one per public name of Accelerate's ``accelerate``, ``accelerate.utils`` and
``accelerate.logging``, and per member of its ``Accelerator``."""

from __future__ import annotations

from .table import (
    ACCELERATOR,
    DIFFERENT,
    LOGGING,
    NOT_PROVIDED,
    SAME,
    TOP,
    UTILS,
    add,
    add_each,
)

#: Names of the top level that ``accelerate.utils`` has too, with the same row in both.
_BOTH = (TOP, UTILS)

# -- accelerate (and what accelerate.utils has too) ------------------------------------------
_KEYWORDS = "pass the arguments by keyword (their order differs)"
add(
    TOP,
    SAME,
    """PartialState cpu_offload cpu_offload_with_hook disk_offload dispatch_model
    init_empty_weights init_on_device""",
)
add(
    _BOTH,
    SAME,
    """AutocastKwargs DDPCommunicationHookType DistributedDataParallelKwargs DistributedType GradScalerKwargs
    InitProcessGroupKwargs ProfileKwargs is_rich_available synchronize_rng_states""",
)
add(
    TOP,
    DIFFERENT,
    "Accelerator",
    "the keywords are Accelerate's except torch_tp_plugin (use parallelism_config="
    "ParallelismConfig(tp_size=...)) and deepspeed_plugins (one DeepSpeedPlugin per "
    "Accelerator); megatron_lm_plugin runs on slipstream's tensor, sequence and pipeline "
    "parallelism with FSDP2 (see MegatronLMPlugin); rng_types is accepted, and "
    "shuffles are kept alike on every process (the script's generator is synchronised each "
    "pass, otherwise a seeded sampler is used), so the global RNGs are not synchronised each "
    "epoch (a warning says so); Accelerate's own option objects (kwargs handlers, "
    "DataLoaderConfiguration, GradientAccumulationPlugin, TorchDynamoPlugin, "
    "FullyShardedDataParallelPlugin, DeepSpeedPlugin, ParallelismConfig) are converted field by "
    "field, a field without an equivalent set away from its default is refused; "
    "adds even_batches, debug, callbacks, hang_timeout, save_on_preemption and preemption_signals; "
    + _KEYWORDS,
)
add(_BOTH, DIFFERENT, "DataLoaderConfiguration", _KEYWORDS)
add(
    _BOTH,
    DIFFERENT,
    "DeepSpeedPlugin",
    "no is_train_batch_min, transformer_moe_cls_names, enable_msamp or msamp_opt_level; "
    + _KEYWORDS,
)
add(
    _BOTH,
    DIFFERENT,
    "FullyShardedDataParallelPlugin",
    "FSDP2 (fully_shard) only, as Accelerate's fsdp_version=2: sharding_strategy maps onto "
    "reshard_after_forward as `accelerate to-fsdp2` does (NO_SHARD and the hybrid strategies "
    "warn that FSDP2 still shards over all processes), state_dict_type takes and equals "
    "torch's StateDictType (not LOCAL_STATE_DICT), model.state_dict() holds DTensors; no "
    "backward_prefetch, ignored_modules, state_dict_config, optim_state_dict_config, "
    "limit_all_gathers, use_orig_params, param_init_fn, sync_module_states, forward_prefetch, "
    "activation_checkpointing_offload or cpu_ram_efficient_loading; " + _KEYWORDS,
)
add(
    _BOTH,
    DIFFERENT,
    "ParallelismConfig",
    "no sequence parallelism (sp_size, sp_handler; sp_backend, sp_size and sp_enabled read "
    "'deepspeed', 1 and False): use cp_size (context parallelism); Accelerate's "
    "ParallelismConfig objects are accepted by the Accelerator; adds pipeline parallelism (pp_size, pp_schedule, ...), expert parallelism "
    "(ep_size, ep_plan) and tp_plan; " + _KEYWORDS,
)
add(_BOTH, SAME, "find_executable_batch_size")
add(
    _BOTH,
    DIFFERENT,
    "infer_auto_device_map",
    "no fallback_allocation: a block that fits nowhere is an error naming the budget to raise; "
    "room for the largest block is kept on the execution device only when something is "
    "offloaded (GPUs are filled otherwise), so maps can differ from Accelerate's",
)
_LOAD_CHECKPOINT = (
    "local files only, no .dat offload folders (safetensors and an index.json); a checkpoint "
    "with no key in common with the model is refused even with strict=False; no "
    "keep_in_fp32_modules, offload_8bit_bnb, full_state_dict or broadcast_from_rank0"
)
add(TOP, DIFFERENT, "load_checkpoint_and_dispatch", _LOAD_CHECKPOINT)
add(_BOTH, DIFFERENT, "load_checkpoint_in_model", _LOAD_CHECKPOINT)
add(
    TOP,
    DIFFERENT,
    "notebook_launcher",
    "Accelerate's arguments in its order; use_port defaults to a free port on one machine "
    "(29500 across machines); rdzv_backend is static or c10d; adds keyword-only use_cpu and "
    "start_method; returns each local process's result (Accelerate returns None); one "
    "process also runs in a worker; workers fork, except in a script that holds a process "
    "group or has used CUDA (then they spawn); no TPU or Colab path",
)
add(
    TOP,
    DIFFERENT,
    "debug_launcher",
    "returns each process's result; a failure raises torch's ChildFailedError (Accelerate "
    "raises torch.multiprocessing's ProcessRaisedException)",
)
add(
    TOP,
    NOT_PROVIDED,
    "prepare_pippy",
    "use ParallelismConfig(pp_size=...): prepare splits the model into pipeline stages, "
    "which run inference in eval mode and train with accelerator.forward_backward",
)
add(TOP, NOT_PROVIDED, "rich", "no rich traceback handler is installed: rich.traceback.install()")
add(
    TOP,
    DIFFERENT,
    "skip_first_batches",
    "the first argument is named loader, and num_batches has no default",
)

_ULYSSES = (
    "DeepSpeed Ulysses sequence parallelism is not supported: use context parallelism "
    "(ParallelismConfig(cp_size=...))"
)

# -- accelerate.utils ------------------------------------------------------------------------
add(
    UTILS,
    SAME,
    """ComputeEnvironment DummyOptim DynamoBackend GradientAccumulationPlugin
    KwargsHandler OffloadedWeightsLoader PrecisionType PrefixedDataset ProjectConfiguration
    RNGType TensorInformation TorchContextParallelConfig TorchTensorParallelConfig
    MODEL_NAME OPTIMIZER_NAME PROFILE_PATTERN_NAME RNG_STATE_NAME SAFE_MODEL_NAME
    SAFE_WEIGHTS_INDEX_NAME SAFE_WEIGHTS_NAME SAFE_WEIGHTS_PATTERN_NAME SCALER_NAME
    SCHEDULER_NAME WEIGHTS_INDEX_NAME WEIGHTS_NAME WEIGHTS_PATTERN_NAME
    are_libraries_initialized calculate_maximum_sizes check_device_map check_os_kernel
    clean_state_dict_for_safetensors clear_environment compare_versions concatenate
    copy_tensor_to_devices
    convert_bytes convert_file_size_to_int convert_outputs_to_fp32 convert_to_fp32
    dtype_byte_size extract_model_from_parallel find_batch_size find_device
    find_tied_parameters get_balanced_memory get_data_structure get_gpu_info get_int_from_env
    get_max_layer_size get_max_memory get_pretty_name has_compiled_regions has_offloaded_params
    honor_type id_tensor_storage ignorant_find_batch_size initialize_tensors is_compiled_module
    is_namedtuple is_peft_model is_port_in_use is_tensor_information is_torch_tensor
    is_torch_version listify load merge_dicts merge_fsdp_weights model_has_dtensor
    named_module_tensors offload_state_dict parse_choice_from_env parse_flag_from_env
    patch_environment purge_accelerate_environment recursive_getattr recursively_apply
    release_memory save set_seed slice_tensors str_to_bool synchronize_rng_state tqdm
    wait_for_everyone write_basic_config""",
)
# What is installed, which devices exist.
add(
    UTILS,
    SAME,
    """is_4bit_bnb_available is_8bit_bnb_available is_aim_available is_amdsmi_available
    is_bf16_available is_bnb_available is_boto3_available is_clearml_available
    is_comet_ml_available is_cuda_available is_datasets_available is_deepspeed_available
    is_dvclive_available is_fp8_available is_fp16_available is_hpu_available
    is_import_timer_available is_lomo_available is_matplotlib_available
    is_megatron_lm_available is_mlflow_available is_mlu_available is_mps_available
    is_msamp_available is_musa_available is_neuron_available is_npu_available
    is_pandas_available is_peft_available is_pippy_available is_pynvml_available
    is_pytest_available is_rocm_available is_sagemaker_available is_schedulefree_available
    is_sdaa_available is_swanlab_available is_tensorboard_available is_timm_available
    is_torch_xla_available is_torchao_available is_torchdata_available
    is_torchdata_stateful_dataloader_available is_torchvision_available is_trackio_available
    is_transformer_engine_available is_transformers_available is_triton_available
    is_wandb_available is_weights_only_available is_xccl_available is_xpu_available""",
)
add(
    UTILS,
    DIFFERENT,
    "broadcast gather pad_across_processes reduce",
    "the first argument is named data (any nested structure of tensors), not tensor: pass it "
    "positionally; state= picks a ProcessState",
)
add_each(
    UTILS,
    DIFFERENT,
    {
        "save_fsdp_model": (
            "use_dcp=False is refused: sharded weights always go through "
            "torch.distributed.checkpoint (pytorch_model_fsdp_{i}/, as save_state writes them); "
            "adapter_only keeps a PEFT model's trainable parameters"
        ),
        "load_fsdp_model": (
            "use_dcp=False is refused: sharded weights are read with "
            "torch.distributed.checkpoint; adapter_only loads a PEFT model's trainable parameters"
        ),
        "save_fsdp_optimizer": (
            "saved through the Accelerator's strategy as save_state saves it (optimizer_{i}/ "
            "with torch.distributed.checkpoint, state flattened by parameter name, or "
            "optimizer.bin); use_dcp=False is refused for sharded state"
        ),
        "load_fsdp_optimizer": (
            "loads what save_fsdp_optimizer (or save_state) wrote, in the current layout; "
            "use_dcp=False is refused for sharded state"
        ),
        "broadcast_object_list": "the first argument is named objects",
        "gather_object": "the argument is named obj, not object",
        "send_to_device": "the first argument is named data; no skip_keys",
        "compute_module_sizes": "no buffers_only",
        "DummyScheduler": (
            "the scheduler is the DeepSpeed config's: lr_scheduler_callable is not called "
            "(pass it by keyword; it is kept in .kwargs)"
        ),
        "set_module_tensor_to_device": (
            "no fp16_statistics, tied_params_map, non_blocking or clear_cache"
        ),
        "LoggerType": (
            "log_with takes csv (slipstream's own), tensorboard, wandb and mlflow; the other "
            "trackers are refused: pass a GeneralTracker of your own"
        ),
        "TorchDynamoPlugin": (
            "no disable or use_regional_compilation: backend='no' disables compiling"
        ),
        "pad_input_tensors": (
            "pads along dim to the next multiple of num_processes (Accelerate's arithmetic can "
            "leave a remainder, and always pads dimension 0)"
        ),
    },
)
add(
    UTILS,
    NOT_PROVIDED,
    """AbstractTrainStep BertTrainStep GPTTrainStep T5TrainStep MegatronEngine
    MegatronLMDummyDataLoader MegatronLMDummyScheduler MegatronLMOptimizerWrapper
    MegatronLMSchedulerWrapper add_model_config_to_megatron_parser
    avg_losses_across_data_parallel_group megatron_lm_initialize
    megatron_lm_prepare_data_loader megatron_lm_prepare_model_optimizer_scheduler
    megatron_lm_prepare_optimizer megatron_lm_prepare_scheduler""",
    "Megatron-LM's own engine is not used (megatron-core needs CUDA, docs/megatron.md): "
    "MegatronLMPlugin and megatron_lm_config run your model and loop on slipstream's tensor, "
    "pipeline, context and expert parallelism with FSDP2",
)
add(
    UTILS,
    DIFFERENT,
    "MegatronLMPlugin",
    "the same options, run without Megatron-LM on slipstream's parallelism with FSDP2: "
    "tp_degree/pp_degree/context_parallel_size/expert_model_parallel_size are the mesh sizes, "
    "num_micro_batches the pipeline micro-batches (each prepared batch holds that many "
    "DataLoader batches, as in Accelerate), sequence_parallelism, recompute_activations "
    "(checkpointing the model's blocks), use_distributed_optimizer (FSDP2 sharding; else "
    "replicas), gradient_clipping (before every optimizer step); options for Megatron-LM's "
    "own models, trainer, scheduler and logging are ignored with one warning, custom "
    "functions and megatron_dataset_flag are refused; context_parallel_size defaults to 1 "
    "and MEGATRON_LM_* environment variables are not read",
)
add(
    UTILS,
    NOT_PROVIDED,
    """AORecipeKwargs FP8RecipeKwargs MSAMPRecipeKwargs TERecipeKwargs apply_fp8_autowrap
    contextual_fp8_autocast convert_model convert_model_to_fp8_ao
    filter_first_and_last_linear_layers has_ao_layers has_transformer_engine_layers
    is_transformer_engine_mxfp8_available torchao_required""",
    'fp8 training is mixed_precision="fp8" (torchao\'s float8 linear layers, converted by '
    "prepare); there are no recipe objects and no Transformer Engine or MS-AMP backend",
)
add(
    UTILS,
    NOT_PROVIDED,
    """disable_fsdp_ram_efficient_loading enable_fsdp_ram_efficient_loading fsdp2_apply_ac
    fsdp2_canonicalize_names fsdp2_load_full_state_dict fsdp2_prepare_model
    fsdp2_switch_optimizer_parameters get_fsdp2_grad_scaler get_module_children_bottom_up""",
    "FSDP2 is the strategy's job: prepare shards the model, save_state/load_state and "
    "save_model save and load it (slipstream merge-weights merges a sharded checkpoint)",
)
add(
    UTILS,
    NOT_PROVIDED,
    """DeepSpeedEngineWrapper DeepSpeedOptimizerWrapper DeepSpeedSchedulerWrapper
    GatheredParameters HfDeepSpeedConfig deepspeed_required get_active_deepspeed_plugin
    map_pytorch_optim_to_deepspeed""",
    "DeepSpeed is the strategy's job: prepare builds the engine from the DeepSpeedPlugin "
    "(accelerator.deepspeed_plugin); use deepspeed's own API for anything else",
)
add(
    UTILS,
    NOT_PROVIDED,
    """PrepareForLaunch TORCH_LAUNCH_PARAMS check_cuda_p2p_ib_support
    convert_dict_to_env_variables get_cpu_distributed_information prepare_deepspeed_cmd_env
    prepare_multi_gpu_env prepare_simple_launcher_cmd_env set_numa_affinity""",
    "a launcher internal: use slipstream launch, notebook_launcher or debug_launcher",
)
add(
    UTILS,
    NOT_PROVIDED,
    """BnbQuantizationConfig has_4bit_bnb_layers is_bitsandbytes_multi_backend_available
    load_and_quantize_model""",
    "bitsandbytes quantization is not integrated: quantize with transformers "
    "(BitsAndBytesConfig) before prepare",
)
add(
    UTILS,
    NOT_PROVIDED,
    "load_offloaded_weight load_offloaded_weights offload_weight save_offload_index",
    "disk offload writes safetensors files and an index.json, not Accelerate's .dat files: "
    "use disk_offload, offload_state_dict or load_checkpoint_and_dispatch(offload_folder=...)",
)
add(
    UTILS,
    NOT_PROVIDED,
    """check_tied_parameters_in_config check_tied_parameters_on_same_device
    ensure_weights_retied retie_parameters""",
    "loading and dispatching keep tied weights tied themselves (a tied value is put at every "
    "name it feeds); find_tied_parameters lists them",
)
add_each(
    UTILS,
    DIFFERENT,
    {
        "install_xla": (
            "installs torch_xla[tpu] matching the installed torch from the package index, "
            "wherever pip works (Accelerate's installs a Colab wheel, on Colab only)"
        ),
        "prepare_tpu": (
            "debug sets SLIPSTREAM_DEBUG (Accelerate's: ACCELERATE_DEBUG_MODE); slipstream "
            "launch --tpu does not use it: bf16 on XLA is autocast, without XLA_USE_BF16"
        ),
    },
)
add(
    UTILS,
    NOT_PROVIDED,
    "SageMakerDistributedType prepare_sagemager_args_inputs",
    "launching on Amazon SageMaker is not supported",
)
add(
    UTILS,
    NOT_PROVIDED,
    """MITA_PROFILING_AVAILABLE_PYTORCH_VERSION XPU_PROFILING_AVAILABLE_PYTORCH_VERSION
    TORCH_DISTRIBUTED_OPERATION_TYPES extract_submodules_state_dict""",
    "an Accelerate internal with no use outside it",
)
add(
    UTILS,
    NOT_PROVIDED,
    "compile_regions compile_regions_deepspeed compile_regions_fsdp2",
    "regional compilation is not provided: compile the repeated blocks yourself "
    "(for block in model.layers: block.compile())",
)
add(
    UTILS,
    NOT_PROVIDED,
    "get_grad_scaler get_mixed_precision_context_manager",
    "use the accelerator's: accelerator.scaler, accelerator.autocast()",
)
add_each(
    UTILS,
    NOT_PROVIDED,
    {
        "CannotPadNestedTensorWarning": (
            "pad_across_processes has no special case for nested tensors"
        ),
        "CustomDtype": (
            "device maps size weights by their torch dtypes (torch.int4, torch.float8_e4m3fn, ...)"
        ),
        "DeepSpeedSequenceParallelConfig": _ULYSSES,
        "SAMPLER_NAME": (
            "save_state records the samplers' positions in its manifest, not in sampler.bin"
        ),
        "TorchTensorParallelPlugin": "use ParallelismConfig(tp_size=...)",
        "align_module_device": "offloaded modules are moved by their hooks when they run",
        "check_cuda_fp8_capability": "use torch.cuda.get_device_capability() >= (8, 9)",
        "gather_across_data_parallel_groups": (
            "accelerator.gather and gather_for_metrics gather over the data-parallel processes "
            "already"
        ),
        "get_current_device_type": "use PartialState().device.type",
        "get_model_tp_size": "use accelerator.parallelism_config.tp_size",
        "is_habana_gaudi1": "slipstream does not run on Intel Gaudi HPUs",
        "load_state_dict": (
            "read a checkpoint file with safetensors.torch.load_file or slipstream.utils.load"
        ),
    },
)
# -- accelerate.logging ----------------------------------------------------------------------
add(LOGGING, SAME, "MultiProcessAdapter get_logger")

# -- Accelerator members ---------------------------------------------------------------------
add(
    ACCELERATOR,
    SAME,
    """accumulate autocast backward check_trigger clear clip_grad_norm_ clip_grad_value_
    context_parallel_rank data_parallel_rank data_parallel_shard_rank deepspeed_plugin device
    dispatch_batches distributed_type end_training even_batches free_memory gather
    gather_for_metrics get_tracker gradient_accumulation_steps init_trackers is_fsdp2
    is_last_process is_local_main_process is_main_process local_main_process_first
    local_process_index log logging_dir main_process_first maybe_context_parallel
    mixed_precision multi_device no_sync non_blocking num_processes on_last_process
    on_local_process on_process optimizer_step_was_skipped pad_across_processes
    parallelism_config pipeline_parallel_rank prepare prepare_data_loader prepare_scheduler
    print process_index
    profile project_dir reduce register_for_checkpointing register_load_state_pre_hook
    register_save_state_pre_hook save save_iteration save_model set_trigger
    skip_first_batches split_batches split_between_processes sync_gradients
    tensor_parallel_rank torch_device_mesh trigger_sync_in_backward unscale_gradients
    use_distributed use_stateful_dataloader verify_device_map wait_for_everyone""",
)
add_each(
    ACCELERATOR,
    DIFFERENT,
    {
        "fp8_backend": 'the strings "TORCHAO" (fp8 training) or "NO"',
        "get_state_dict": "no unwrap: always the unwrapped model's",
        "is_composable_parallelism_enabled": (
            "also true for any N-D layout (tensor, context or pipeline parallel)"
        ),
        "join_uneven_inputs": (
            "raises under FSDP or DeepSpeed with uneven batches (keep even_batches=True there)"
        ),
        "load_state": "no load_kwargs: files are read with torch.load(weights_only=True); "
        'load_state("latest") resumes from the newest checkpoint',
        "prepare_model": (
            "evaluation_mode=True adds no data-parallel wrapper under DDP; models a strategy "
            "shards or splits (FSDP2, DeepSpeed, tensor/pipeline parallel) are prepared in "
            "full, and a later prepare() wraps an evaluation-only model for training"
        ),
        "prepare_optimizer": "no device_placement: the optimizer follows its model's parameters",
        "save_state": (
            "the second argument is async_save, not safe_serialization (models are always "
            "saved as safetensors; the keyword is accepted and ignored); a folder per process, "
            "or one path on machines without a shared disk, is detected and each folder is "
            "committed on its own (FSDP, DeepSpeed and model-parallel need one shared folder)"
        ),
        "should_save_model": "always True",
        "unwrap_model": (
            "keep_torch_compile defaults to False (Accelerate: True): torch.compile's wrapper "
            "is removed unless asked for; kept, it is the compiled module itself where it wraps "
            "the user's module, otherwise a new torch.compile wrapper of the unwrapped module"
        ),
        "use_seedable_sampler": (
            "accepted and changes nothing: a shuffle with the script's generator draws from it "
            "(synchronised from the main process each pass, so 2 processes see the batches 1 "
            "process would), one without uses a SeedableRandomSampler seeded with data_seed or "
            "torch.initial_seed() (Accelerate's seed: the same order as Accelerate's)"
        ),
    },
)
add(
    ACCELERATOR,
    DIFFERENT,
    "on_local_main_process on_main_process",
    "decorators only: the function is required",
)
add_each(
    ACCELERATOR,
    NOT_PROVIDED,
    {
        "lomo_backward": (
            "LOMO optimizers are not supported: use a torch optimizer with accelerator.backward"
        ),
        "deepspeed_ulysses_dl_adapter": _ULYSSES,
    },
)
