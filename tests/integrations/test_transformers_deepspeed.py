"""DeepSpeed through transformers' Trainer on slipstream (TrainingArguments(deepspeed=...)),
against the Accelerate-backed Trainer running the same DeepSpeed configuration in the same
2 CPU processes: ZeRO-2 and ZeRO-3, saving, and resume_from_checkpoint."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("deepspeed")

from tests.distributed import run_distributed
from tests.integrations.test_transformers import assert_close, train

#: Starts its own processes for every test: left out of `pytest -m "not slow"`.
pytestmark = pytest.mark.slow

BATCH_KEYS = {
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "train_batch_size": "auto",
    "gradient_clipping": "auto",
}
#: ZeRO-2 with the Trainer's own optimizer and scheduler (torch's AdamW, a linear decay
#: saved in scheduler.pt).
ZERO2 = {**BATCH_KEYS, "zero_optimization": {"stage": 2}}
#: ZeRO-3 with the optimizer defined in the JSON (the Trainer passes Accelerate's DummyOptim,
#: and a DummyScheduler that builds the Trainer's linear decay on the engine's optimizer).
ZERO3 = {
    **BATCH_KEYS,
    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": "auto"},
    "optimizer": {
        "type": "AdamW",
        "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}
        | {"torch_adam": True},
    },
}


@contextlib.contextmanager
def accelerate_deepspeed_on_cpu() -> Iterator[None]:
    """Let the Accelerate-backed Trainer run DeepSpeed on CPU processes.

    With ``use_cpu=True`` Accelerate drops DeepSpeed (its state becomes MULTI_CPU and the
    Trainer trains with DDP); without it, Accelerate's process state chooses no backend on
    a machine without GPUs and counts one process, so the Trainer asks DeepSpeed for a
    quarter of the batch. Here its backend choice says gloo, as it says nccl on GPUs;
    everything else (its DeepSpeed plugin, prepare, engine, checkpoints) is Accelerate's own.
    """
    import accelerate.state
    from accelerate.utils import DistributedType

    state = accelerate.state.PartialState
    original = state._prepare_backend

    def prepare_backend(self: Any, cpu: bool = False, *args: Any, **kwargs: Any) -> Any:
        backend, kind = original(self, cpu, *args, **kwargs)
        if backend is None and os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":
            return "gloo", DistributedType.MULTI_CPU
        return backend, kind

    state._prepare_backend = prepare_backend
    try:
        yield
    finally:
        state._prepare_backend = original
        # Accelerate's Accelerator leaves it set: later Trainers would all pick DeepSpeed.
        os.environ.pop("ACCELERATE_USE_DEEPSPEED", None)


def _deepspeed(out: str) -> dict[str, Any]:
    import time

    # 12 samples, 2 per process on 2 processes: 3 batches per epoch, accumulated in cycles of
    # 2 then 1 (a short last cycle): 4 steps in 2 epochs. Checkpoint-3 is mid epoch 2.
    run: dict[str, Any] = {"samples": 12, "gradient_accumulation_steps": 2}
    run |= {"num_train_epochs": 2, "lr_scheduler_type": "linear", "max_grad_norm": 0.5}
    saving = {"save_strategy": "steps", "save_steps": 3}
    results: dict[str, Any] = {"seconds": {}}
    for name, config in (("zero2", ZERO2), ("zero3", ZERO3)):
        started = time.perf_counter()
        with accelerate_deepspeed_on_cpu():
            results[f"accelerate/{name}"] = train(
                "accelerate", f"{out}/accelerate-{name}", deepspeed=config, use_cpu=False, **run
            )
        results["seconds"][f"accelerate/{name}"] = time.perf_counter() - started
        settings = {**run, **saving, "deepspeed": config}
        started = time.perf_counter()
        results[name] = train("slipstream", f"{out}/{name}", **settings)
        results["seconds"][name] = time.perf_counter() - started
        resume = f"{out}/{name}/checkpoint-3"
        started = time.perf_counter()
        results[f"{name}/resumed"] = train("slipstream", f"{out}/{name}", resume=resume, **settings)
        results["seconds"][f"{name}/resumed"] = time.perf_counter() - started
    # DeepSpeed chosen without a deepspeed= argument (as by `slipstream launch
    # --use_deepspeed`; here through accelerator_options): the Trainer's config is made
    # from the plugin's options, its "auto" values from the arguments, as in ZERO2.
    from slipstream import DeepSpeedPlugin

    options = {"deepspeed_plugin": DeepSpeedPlugin(zero_stage=2)}
    results["zero2/options"] = train("slipstream", f"{out}/options", options=options, **run)
    # Without use_cpu, transformers' process state counts 1 process on CPU: refused.
    from slipstream.integrations.transformers import TrainerConfigurationError

    try:
        train("slipstream", f"{out}/refused", deepspeed=ZERO2, use_cpu=False, max_steps=0)
    except TrainerConfigurationError as error:
        results["refused"] = str(error)
    return results


def _comparable(config: dict[str, Any]) -> dict[str, Any]:
    # slipstream lets ZeRO use the torch optimizer it was given (DeepSpeed's CPU Adam is a
    # compiled op), Accelerate leaves these at DeepSpeed's defaults.
    # slipstream also writes DeepSpeed's default of stage3_gather_16bit_weights_on_model_save.
    ignored = {"zero_force_ds_cpu_optimizer", "zero_allow_untested_optimizer", "steps_per_print"}
    zero = dict(config["zero_optimization"])
    if zero.get("stage3_gather_16bit_weights_on_model_save") is False:
        del zero["stage3_gather_16bit_weights_on_model_save"]
    return {k: v for k, v in config.items() if k not in ignored} | {"zero_optimization": zero}


@pytest.mark.timeout(300)
def test_zero2_and_zero3_train_save_and_resume_as_accelerates_deepspeed_trainer(
    tmp_path: Path,
) -> None:
    results = run_distributed(_deepspeed, str(tmp_path), timeout=280)
    for rank in results:
        for name in ("zero2", "zero3"):
            ours, theirs = rank[name], rank[f"accelerate/{name}"]
            assert (ours["accelerator"], theirs["accelerator"]) == ("slipstream", "accelerate")
            assert ours["model"] == theirs["model"] == "DeepSpeedEngine"
            assert _comparable(ours["engine_config"]) == _comparable(theirs["engine_config"])
            assert len(theirs["loss"]) == 4
            # The same engine on the same configuration: equal to the bit in practice.
            assert_close(ours["loss"], theirs["loss"])
            assert_close(ours["grad_norm"], theirs["grad_norm"])
            # Resumed from checkpoint-3 (the engine's own checkpoint): its step 4 is the
            # uninterrupted run's (the history holds steps 1-3 from the checkpoint).
            assert_close(rank[f"{name}/resumed"]["loss"], theirs["loss"])
            assert_close(rank[f"{name}/resumed"]["grad_norm"], theirs["grad_norm"])
        assert_close(rank["zero2/options"]["loss"], rank["accelerate/zero2"]["loss"])
        assert rank["zero2/options"]["engine_config"]["gradient_clipping"] == 0.5
        assert rank["zero2"]["engine_config"]["train_batch_size"] == 8
        assert rank["zero3"]["engine_config"]["train_batch_size"] == 8
    assert "count 1 process(es) and this job runs 2" in results[0]["refused"]
    files = set(results[0]["zero2/resumed"]["files"])
    assert {"global_step3", "latest", "scheduler.pt"} <= files
