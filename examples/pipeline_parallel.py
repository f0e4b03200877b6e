"""Pipeline parallelism: the model's blocks split over processes, micro-batches flowing
through them. The same script runs without a pipeline (one process, or --pp 1).

    slipstream launch --num_processes 2 --cpu examples/pipeline_parallel.py           # 2 stages
    slipstream launch --num_processes 4 --cpu examples/pipeline_parallel.py           # 2 x FSDP2
    slipstream launch --num_processes 2 --cpu examples/pipeline_parallel.py --llama   # transformers
    python examples/pipeline_parallel.py --pp 1                                       # no pipeline

An ``nn.Sequential`` (or a transformers model) is split automatically, balanced by
parameter count. Forward and backward run together inside the pipeline schedule, so the
training step is one call, ``accelerator.forward_backward``, which also works without
pipeline parallelism; evaluation calls the model as usual and every process gets the last
stage's outputs. The held-out loss and accuracy are printed before training (chance) and
after every epoch.

Options: --quick (one epoch, for tests), --llama (a tiny transformers Llama, needs
`pip install transformers`), --pp N (stages, default 2), --dp N (FSDP2 processes per stage,
default: the processes the stages leave), --schedule NAME (gpipe, 1f1b, interleaved_1f1b,
...; default 1f1b), --save DIR.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split

from slipstream import Accelerator, ParallelismConfig, gather_object, set_seed

VOCAB, LENGTH, CLASSES = 32, 16, 4


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Pool(nn.Module):
    """Mean over the sequence, so the head sees one vector per sample."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=1)


def block_stack(width: int = 64, depth: int = 8) -> nn.Sequential:
    """Embedding -> a list of blocks -> head: nn.Sequential splits without any description."""
    return nn.Sequential(
        nn.Embedding(VOCAB, width),
        nn.Sequential(*[Block(width) for _ in range(depth)]),
        nn.Sequential(nn.LayerNorm(width), Pool(), nn.Linear(width, CLASSES)),
    )


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LlamaForCausalLM(config)


def make_data(count: int, llama: bool) -> TensorDataset:
    """The block stack classifies a bag of tokens: the label is the token group (token
    modulo 4) that occurs most often, so the order of the tokens does not matter (the model
    mean-pools and has no positions). The language model predicts sequences that count up
    in steps of 1, 2 or 3."""
    generator = torch.Generator().manual_seed(0)
    if llama:
        start = torch.randint(0, VOCAB, (count, 1), generator=generator)
        step = torch.randint(1, 4, (count, 1), generator=generator)
        tokens = (start + step * torch.arange(LENGTH)) % VOCAB
        return TensorDataset(tokens, tokens)  # the labels are the tokens themselves
    tokens = torch.randint(1, VOCAB, (count, LENGTH), generator=generator)
    counts = F.one_hot(tokens % CLASSES, CLASSES).sum(dim=1)
    return TensorDataset(tokens, counts.argmax(dim=1))


def logits_and_targets(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, llama: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Predictions in rows, one target each: a class per sequence, or the next token."""
    if llama:
        return model(input_ids=x).logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1)
    return model(x), y


def evaluate(
    accelerator: Accelerator, model: nn.Module, loader: DataLoader, llama: bool
) -> tuple[float, float]:
    """Held-out loss and accuracy over every sample once; every process gets the last
    stage's outputs, so this is the same code with and without a pipeline."""
    model.eval()
    loss_sum, correct, seen = 0.0, 0, 0
    with torch.no_grad():
        for x, y in loader:
            logits, target = logits_and_targets(model, x, y, llama)
            losses = F.cross_entropy(logits, target, reduction="none")
            losses, predicted, target = accelerator.gather_for_metrics(
                (losses, logits.argmax(-1), target)
            )
            loss_sum += float(losses.sum())
            correct += int((predicted == target).sum())
            seen += target.numel()
    model.train()
    return loss_sum / seen, correct / seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--llama", action="store_true")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=None)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--save", default=None)
    args = parser.parse_args()

    # Without --dp the processes the stages leave shard each stage (FSDP2): 4 processes and
    # 2 stages are 2 x dp_shard 2.
    layout = ParallelismConfig(
        pp_size=args.pp, dp_shard_size=args.dp, pp_schedule=args.schedule, pp_microbatches=4
    )
    accelerator = Accelerator(parallelism_config=layout if args.pp > 1 else None)
    set_seed(0)
    data = make_data(2048 if args.quick else 4096, args.llama)
    train, held_out = random_split(data, [len(data) - 256, 256], torch.Generator().manual_seed(1))
    model = tiny_llama() if args.llama else block_stack()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(train, batch_size=16, shuffle=True)
    model, optimizer, loader, held_out = accelerator.prepare(
        model, optimizer, loader, DataLoader(held_out, batch_size=16)
    )
    held = sum(p.numel() for p in model.parameters())  # this process's stage only
    if args.pp > 1:
        accelerator.print(f"layout {accelerator.parallelism_config.sizes.describe()}")
    # One report from the main process rather than one print per process, which interleave.
    stages = gather_object([(accelerator.pipeline_parallel_rank, held)])
    for process, (stage, count) in enumerate(stages):
        accelerator.print(f"process {process}: pipeline stage {stage}, {count:,} parameters")

    processes = accelerator.num_processes

    def report(when: str) -> None:
        loss, accuracy = evaluate(accelerator, model, held_out, args.llama)
        accelerator.print(
            f"{when}: held-out loss {loss:.4f}, accuracy {accuracy:.3f} "
            f"({processes} process{'es' if processes > 1 else ''})"
        )

    report("before training")  # an untrained model: loss about ln 4 = 1.386
    for epoch in range(1 if args.quick else 2):
        for x, y in loader:
            if args.llama:  # a language model: the loss is the model's own
                accelerator.forward_backward(model, {"input_ids": x, "labels": y})
            else:
                accelerator.forward_backward(model, x, target=y, loss_fn=F.cross_entropy)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)  # over all stages
            optimizer.step()
            optimizer.zero_grad()
        report(f"epoch {epoch}")
    if args.save:
        accelerator.save_model(model, args.save)  # the whole model, gathered from the stages
        accelerator.print(f"weights saved to {args.save}")


if __name__ == "__main__":
    main()
