"""transformers' Trainer on slipstream: the usual Trainer script with one import changed.

    python examples/trainer.py                                        # one process
    slipstream launch --num_processes 2 --cpu examples/trainer.py     # DDP on 2 processes
    slipstream launch --num_processes 2 --cpu examples/trainer.py --fsdp   # FSDP2
    slipstream launch --num_processes 2 --cpu examples/trainer.py --tp     # tensor parallel

The task: sequences that count up in steps of 1, 2 or 3 (modulo the vocabulary); a tiny
randomly initialised Llama, built from its config (nothing is downloaded), predicts each
next token. The held-out next-token loss and accuracy are printed before training and after
every epoch. ``--tp`` splits every layer over the processes with the Llama's own tensor-
parallel plan (``accelerator_options``), which Accelerate's Trainer cannot do on CPUs.

Options: --quick, --fsdp, --tp, --save DIR (the trained model, loadable with
``LlamaForCausalLM.from_pretrained(DIR)``).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from typing import Any

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import transformers

from slipstream import ParallelismConfig
from slipstream.integrations.transformers import Trainer  # was: from transformers import Trainer

VOCAB, LENGTH = 32, 12


class Counting(torch.utils.data.Dataset):
    """Sequences start, start + step, start + 2 step, ... (mod VOCAB); labels = inputs."""

    def __init__(self, size: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (size, 1), generator=generator)
        step = torch.randint(1, 4, (size, 1), generator=generator)
        self.ids = (start + step * torch.arange(LENGTH)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def next_token_predictions(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return logits.argmax(-1)  # keep only what the accuracy needs


def accuracy(prediction: transformers.EvalPrediction) -> dict[str, float]:
    predicted, labels = prediction.predictions[:, :-1], prediction.label_ids[:, 1:]
    # The first two tokens do not tell the step yet: score from the third on.
    return {"accuracy": float((predicted[:, 1:] == labels[:, 1:]).mean())}


class PrintEvaluations(transformers.TrainerCallback):
    def __init__(self, trainer: Any, samples: int) -> None:
        self.trainer, self.samples = trainer, samples

    def on_evaluate(
        self, args: Any, state: Any, control: Any, metrics: Any = None, **_: Any
    ) -> None:
        when = "before training" if state.global_step == 0 else f"epoch {round(state.epoch) - 1}"
        report(self.trainer, when, metrics, self.samples)


def report(trainer: Any, when: str, metrics: dict[str, float], samples: int) -> None:
    if trainer.is_world_process_zero():
        accelerator = trainer.accelerator
        processes = (
            f"{accelerator.num_processes} process{'es' if accelerator.num_processes > 1 else ''}"
        )
        print(
            f"{when}: held-out loss {metrics['eval_loss']:.4f}, accuracy "
            f"{metrics['eval_accuracy']:.3f} on {samples} samples ({processes}, {accelerator.device.type})",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--fsdp", action="store_true")
    parser.add_argument("--tp", action="store_true")
    parser.add_argument("--save", default="")
    args = parser.parse_args()
    train, held_out = Counting(512 if args.quick else 2048, seed=0), Counting(200, seed=1)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=LENGTH,
    )
    model = transformers.LlamaForCausalLM(config)
    layers = {"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
    with tempfile.TemporaryDirectory() as scratch:
        training = transformers.TrainingArguments(
            output_dir=scratch,
            num_train_epochs=2,
            per_device_train_batch_size=16,
            per_device_eval_batch_size=50,
            learning_rate=3e-3,
            eval_strategy="epoch",
            save_strategy="no",
            logging_strategy="no",
            report_to=[],
            use_cpu=not torch.cuda.is_available(),
            seed=0,
            disable_tqdm=True,
            fsdp=args.fsdp,
            fsdp_config=layers if args.fsdp else None,
        )
        options = {"parallelism_config": ParallelismConfig(tp_size=-1)} if args.tp else {}
        trainer = Trainer(
            model=model,
            args=training,
            train_dataset=train,
            eval_dataset=held_out,
            compute_metrics=accuracy,
            preprocess_logits_for_metrics=next_token_predictions,
            accelerator_options=options,
        )
        trainer.add_callback(PrintEvaluations(trainer, len(held_out)))
        trainer.evaluate()
        trainer.train()
    if args.save:
        trainer.save_model(args.save)


if __name__ == "__main__":
    main()
