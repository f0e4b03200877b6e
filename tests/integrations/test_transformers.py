"""transformers' Trainer on slipstream against the Accelerate-backed Trainer, run back to back
in the same processes: plain DDP, accumulation with a short last cycle, evaluation, resume,
FSDP2 checkpoints (losses equal to 1e-6); then layouts only slipstream runs on CPU."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.distributed import run_distributed

os.environ["HF_HUB_OFFLINE"] = "1"  # models are built from configs: nothing may be fetched
VOCAB, LENGTH = 64, 8
TOLERANCE = 1e-6


def tiny_llama(layers: int = 2) -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(config)


class Tokens(torch.utils.data.Dataset):
    """Random token sequences; each is its own label (causal LM)."""

    def __init__(self, size: int, seed: int = 1) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (size, LENGTH), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def train(
    backend: str,
    out: str,
    *,
    samples: int = 20,
    eval_samples: int = 0,
    resume: str | None = None,
    model: Any = None,
    options: dict[str, Any] | None = None,
    callbacks: list[Any] | None = None,
    **arguments: Any,
) -> dict[str, Any]:
    """One Trainer run on ``backend`` ("accelerate" or "slipstream"); its logged numbers."""
    import transformers

    from slipstream.integrations.transformers import Trainer

    settings: dict[str, Any] = {
        "output_dir": out,
        "per_device_train_batch_size": 2,
        "per_device_eval_batch_size": 4,
        "num_train_epochs": 1,
        "learning_rate": 1e-2,
        "lr_scheduler_type": "constant",
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": [],
        "use_cpu": True,
        "seed": 0,
        "disable_tqdm": True,
    }
    settings.update(arguments)
    args = transformers.TrainingArguments(**settings)
    common = {
        "model": model if model is not None else tiny_llama(),
        "args": args,
        "train_dataset": Tokens(samples),
        "eval_dataset": Tokens(eval_samples, seed=2) if eval_samples else None,
        "callbacks": callbacks,
    }
    if backend == "accelerate":
        trainer = transformers.Trainer(**common)
    else:
        trainer = Trainer(**common, accelerator_options=options)
    trainer.train(resume_from_checkpoint=resume)
    history = trainer.state.log_history
    return {
        "loss": [row["loss"] for row in history if "loss" in row],
        "grad_norm": [row["grad_norm"] for row in history if "grad_norm" in row],
        "eval_loss": [row["eval_loss"] for row in history if "eval_loss" in row],
        "accelerator": type(trainer.accelerator).__module__.split(".")[0],
        "model": type(trainer.model_wrapped).__name__,
        "dtensors": any(hasattr(p, "device_mesh") for p in trainer.model_wrapped.parameters()),
        "files": sorted(os.listdir(resume)) if resume else [],
    }


def assert_close(ours: list[float], theirs: list[float], tolerance: float = TOLERANCE) -> None:
    assert len(ours) == len(theirs) and ours, (ours, theirs)
    assert max(abs(a - b) for a, b in zip(ours, theirs, strict=True)) <= tolerance, (ours, theirs)


# -- data parallelism, accumulation, evaluation, resume ----------------------------------------
def _data_parallel(out: str) -> dict[str, Any]:
    # 20 samples, 2 per process on 2 processes: 5 batches per epoch, accumulated in cycles of
    # 3 then 2 (the short last cycle); 10 evaluation samples leave a final global batch of 2.
    run = {"gradient_accumulation_steps": 3, "eval_samples": 10}
    run |= {"eval_strategy": "steps", "eval_steps": 1}
    results = {
        "accelerate": train("accelerate", f"{out}/accelerate", **run),
        "slipstream": train("slipstream", f"{out}/slipstream", **run),
    }
    # Two epochs of 3 steps, a checkpoint every 2 steps; resuming from step 4 starts inside
    # the second epoch (its first 2 batches are skipped).
    resume = {"gradient_accumulation_steps": 2, "num_train_epochs": 2}
    saving = {"save_strategy": "steps", "save_steps": 2}
    results["accelerate_2_epochs"] = train("accelerate", f"{out}/reference", **resume)
    results["saving"] = train("slipstream", f"{out}/run", **resume, **saving)
    checkpoint = f"{out}/run/checkpoint-4"
    results["resumed"] = train("slipstream", f"{out}/run", resume=checkpoint, **resume, **saving)
    return results


def test_trainer_matches_accelerate_with_ddp_accumulation_evaluation_and_resume(
    tmp_path: Path,
) -> None:
    results = run_distributed(_data_parallel, str(tmp_path), timeout=240)
    for rank in results:
        ours, theirs = rank["slipstream"], rank["accelerate"]
        assert ours["accelerator"] == "slipstream" and theirs["accelerator"] == "accelerate"
        assert len(ours["loss"]) == 2  # one full and one short accumulation cycle
        assert_close(ours["loss"], theirs["loss"])
        assert_close(ours["grad_norm"], theirs["grad_norm"])
        assert_close(ours["eval_loss"], theirs["eval_loss"])
        # The run that saved is the uninterrupted one; the resumed run's new steps 5 and 6
        # (its history holds steps 1-4 from the checkpoint) equal Accelerate's.
        reference = rank["accelerate_2_epochs"]["loss"]
        assert len(reference) == 6
        assert_close(rank["saving"]["loss"], reference)
        assert_close(rank["resumed"]["loss"], reference)
        assert "optimizer.pt" in rank["resumed"]["files"]


def _one_process(out: str) -> dict[str, Any]:
    # One process: the final evaluation batch (2 of 10 samples, batch 4) is cut to its real
    # samples, as Accelerate's gather_for_metrics cuts it to gradient_state.remainder.
    run = {"eval_samples": 10, "eval_strategy": "steps", "eval_steps": 2, "samples": 8}
    results = {
        "accelerate": train("accelerate", f"{out}/accelerate", **run),
        "slipstream": train("slipstream", f"{out}/slipstream", **run),
    }
    # slipstream's callbacks reach the Trainer's steps: BadStepGuard skips the one step whose
    # loss is not finite (the model's output is poisoned in step 2's forward).
    from slipstream import BadStepGuard

    guard = BadStepGuard(max_bad_steps=None)
    model, forwards = tiny_llama(), []

    def poison(module: Any, inputs: Any, output: torch.Tensor) -> torch.Tensor | None:
        forwards.append(1)
        return output * float("nan") if len(forwards) == 2 else None

    model.lm_head.register_forward_hook(poison)
    options = {"callbacks": [guard]}
    guarded = train("slipstream", f"{out}/guarded", model=model, options=options, samples=8)
    weights = [p.detach() for p in model.parameters()]
    results["guard"] = {
        "skipped": guard.skipped_steps,
        "finite": all(bool(w.isfinite().all()) for w in weights),
        "steps": len(guarded["loss"]),
    }
    # What is refused, with the reason (last: DeepSpeed's arguments set up DeepSpeed).
    from slipstream.integrations.transformers import TrainerConfigurationError

    refused = []
    for options, arguments in (
        ({"gradient_accumulation_steps": 2}, {}),
        (None, {"deepspeed": {"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0}}),
    ):
        try:
            train("slipstream", f"{out}/refused", options=options, samples=8, **arguments)
        except TrainerConfigurationError as error:
            refused.append(str(error))
    results["refused"] = refused
    return results


def test_evaluation_on_one_process_matches_accelerate(tmp_path: Path) -> None:
    (result,) = run_distributed(_one_process, str(tmp_path), world_size=1, timeout=180)
    assert len(result["slipstream"]["eval_loss"]) == 2
    assert_close(result["slipstream"]["eval_loss"], result["accelerate"]["eval_loss"])
    assert_close(result["slipstream"]["loss"], result["accelerate"]["loss"])
    assert result["guard"] == {"skipped": 1, "finite": True, "steps": 4}
    clash, deepspeed = result["refused"]
    assert "accelerator_options cannot set ['gradient_accumulation_steps']" in clash
    assert "TrainingArguments(deepspeed=...) is not supported" in deepspeed


# -- FSDP2 ----------------------------------------------------------------------------------
def _fsdp(out: str) -> dict[str, Any]:
    layers = {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
    run: dict[str, Any] = {"gradient_accumulation_steps": 2, "num_train_epochs": 2}
    saving = {"save_strategy": "steps", "save_steps": 2}
    accelerate = train("accelerate", f"{out}/accelerate", fsdp=True, fsdp_config=layers, **run)
    results = {"accelerate": accelerate}
    for kind in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
        config = {**layers, "state_dict_type": kind}
        settings = {**run, **saving, "fsdp": True, "fsdp_config": config}
        results[kind] = train("slipstream", f"{out}/{kind}", **settings)
        checkpoint = f"{out}/{kind}/checkpoint-4"
        results[f"{kind}/resumed"] = train(
            "slipstream", f"{out}/{kind}", resume=checkpoint, **settings
        )
    return results


def test_fsdp2_sharded_and_full_checkpoints_resume_as_accelerate_trains(tmp_path: Path) -> None:
    results = run_distributed(_fsdp, str(tmp_path), timeout=300)
    for rank in results:
        reference = rank["accelerate"]["loss"]
        assert len(reference) == 6
        for kind in ("SHARDED_STATE_DICT", "FULL_STATE_DICT"):
            assert_close(rank[kind]["loss"], reference)
            assert_close(rank[f"{kind}/resumed"]["loss"], reference)
            assert_close(rank[kind]["grad_norm"], rank["accelerate"]["grad_norm"])
    files = results[0]
    assert {"pytorch_model_fsdp_0", "optimizer_0"} <= set(
        files["SHARDED_STATE_DICT/resumed"]["files"]
    )
    assert {"pytorch_model_fsdp.bin", "optimizer.bin"} <= set(
        files["FULL_STATE_DICT/resumed"]["files"]
    )


# -- layouts only slipstream runs on CPU ------------------------------------------------------
def tiny_moe() -> Any:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=16,
        intermediate_size=32,
        moe_intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
    )
    return Qwen3MoeForCausalLM(config)


#: 16 samples, 2 per process on 2 data-parallel processes, 2 micro-batches per step: the
#: Accelerate-backed DDP reference (and the fault-tolerant job's settings).
LAYOUT_RUN: dict[str, Any] = {"gradient_accumulation_steps": 2, "samples": 16}


def _layouts(out: str) -> dict[str, Any]:
    from slipstream import ParallelismConfig

    # Tensor- and pipeline-parallel pairs read one batch: 4 samples, the 2 x 2 of DDP.
    whole_batch = {**LAYOUT_RUN, "per_device_train_batch_size": 4}
    layouts = {"tp": ParallelismConfig(tp_size=2), "pp": ParallelismConfig(pp_size=2)}
    results = {"accelerate": train("accelerate", f"{out}/accelerate", **LAYOUT_RUN)}
    for name, layout in layouts.items():
        options = {"parallelism_config": layout}
        results[name] = train("slipstream", f"{out}/{name}", options=options, **whole_batch)
    # The tensor-parallel run again, saving (sharded, through the layout) after step 1; then
    # resumed from there.
    saving = {**whole_batch, "save_strategy": "steps", "save_steps": 1}
    options = {"parallelism_config": layouts["tp"]}
    train("slipstream", f"{out}/tp_saving", options=options, **saving)
    resume = f"{out}/tp_saving/checkpoint-1"
    results["tp/resumed"] = train(
        "slipstream", f"{out}/tp_saving", options=options, resume=resume, **saving
    )
    # Experts split over the 2 processes (which also shard the rest with FSDP2).
    results["accelerate_moe"] = train("accelerate", f"{out}/moe", model=tiny_moe(), **LAYOUT_RUN)
    options = {"parallelism_config": ParallelismConfig(ep_size=2)}
    results["ep"] = train(
        "slipstream", f"{out}/ep", model=tiny_moe(), options=options, **LAYOUT_RUN
    )
    return results


@pytest.mark.timeout(420)
def test_tensor_pipeline_expert_parallel_and_fault_tolerant_trainers_train_as_accelerates_ddp(
    tmp_path: Path,
) -> None:
    from tests.distributed import run_fault_tolerant_job

    results = run_distributed(_layouts, str(tmp_path), timeout=300)
    for rank in results:
        reference = rank["accelerate"]
        assert rank["tp"]["dtensors"], "the tensor-parallel plan was not applied"
        assert rank["pp"]["model"].startswith("Pipelined"), rank["pp"]["model"]
        assert rank["ep"]["dtensors"]
        for name in ("tp", "pp", "tp/resumed"):
            assert_close(rank[name]["loss"], reference["loss"])
            assert_close(rank[name]["grad_norm"], reference["grad_norm"])
        assert_close(rank["ep"]["loss"], rank["accelerate_moe"]["loss"])
        assert_close(rank["ep"]["grad_norm"], rank["accelerate_moe"]["grad_norm"])
        assert {"pytorch_model_fsdp_0", "optimizer_0"} <= set(rank["tp/resumed"]["files"])

    # Fault tolerance: 2 replica groups of 1 process (slipstream launch --fault_tolerance),
    # each logging the loss of its half of every global batch; their mean is the loss of
    # the whole batch as the DDP Trainer above logged it, and every step committed.
    pytest.importorskip("torchft")
    job = Path(__file__).with_name("transformers_ft_job.py")
    result = run_fault_tolerant_job(job, tmp_path, [], processes=2, groups=2, timeout=200)
    assert result.returncode == 0, result.stdout[-3000:]
    groups = [json.loads((tmp_path / f"replica{g}.json").read_text()) for g in (0, 1)]
    for group in groups:
        assert (group["groups"], group["committed"], group["steps"]) == (2, 2, 2)
        assert group["quorum"] == [2, 2], "a step ran without both groups"
    means = [(a + b) / 2 for a, b in zip(groups[0]["loss"], groups[1]["loss"], strict=True)]
    assert_close(means, results[0]["accelerate"]["loss"], 1e-5)


# -- TRL ------------------------------------------------------------------------------------
def word_tokenizer() -> Any:
    """A word-level tokenizer over ``w0 w1 ...`` built here (nothing is downloaded)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<pad>", "<eos>", "<unk>"] + [f"w{i}" for i in range(VOCAB - 3)]
    model = models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>")
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def _sft(out: str) -> dict[str, Any]:
    import random

    import datasets
    import trl

    from slipstream.integrations.transformers import on_slipstream

    draw = random.Random(0)
    texts = [
        " ".join(f"w{draw.randrange(VOCAB - 3)}" for _ in range(draw.randrange(3, 9)))
        for _ in range(20)
    ]
    data = datasets.Dataset.from_dict({"text": texts})  # in memory, sequences of 3-8 words
    results = {}
    # TRL's defaults stay: bf16 autocast and gradient checkpointing.
    for backend, trainer_class in (
        ("accelerate", trl.SFTTrainer),
        ("slipstream", on_slipstream(trl.SFTTrainer)),
    ):
        config = trl.SFTConfig(
            output_dir=f"{out}/{backend}",
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            num_train_epochs=1,
            max_length=16,
            learning_rate=1e-2,
            lr_scheduler_type="constant",
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            seed=0,
            disable_tqdm=True,
        )
        trainer = trainer_class(
            model=tiny_llama(), args=config, train_dataset=data, processing_class=word_tokenizer()
        )
        trainer.train()
        history = trainer.state.log_history
        results[backend] = {
            "loss": [row["loss"] for row in history if "loss" in row],
            "grad_norm": [row["grad_norm"] for row in history if "grad_norm" in row],
            "tokens": [row["num_tokens"] for row in history if "num_tokens" in row],
            "accelerator": type(trainer.accelerator).__module__.split(".")[0],
        }
    return results


def test_trl_sft_trainer_on_slipstream_matches_accelerate(tmp_path: Path) -> None:
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    for rank in run_distributed(_sft, str(tmp_path), timeout=240):
        ours, theirs = rank["slipstream"], rank["accelerate"]
        assert (ours["accelerator"], theirs["accelerator"]) == ("slipstream", "accelerate")
        assert len(ours["loss"]) == 3
        assert_close(ours["loss"], theirs["loss"])
        assert_close(ours["grad_norm"], theirs["grad_norm"])
        assert ours["tokens"] == theirs["tokens"]
