"""Pipeline parallelism: the model's blocks split over processes, micro-batches flowing
through them. The same script runs without a pipeline (one process, or --pp 1).

    slipstream launch --num_processes 2 --cpu examples/pipeline_parallel.py               # 2 stages
    slipstream launch --num_processes 4 --cpu examples/pipeline_parallel.py --dp 2        # 2 x FSDP2
    slipstream launch --num_processes 2 --cpu examples/pipeline_parallel.py --llama       # transformers
    python examples/pipeline_parallel.py --pp 1                                           # no pipeline

An ``nn.Sequential`` (or a transformers model) is split automatically, balanced by
parameter count. Forward and backward run together inside the pipeline schedule, so the
training step is one call, ``accelerator.forward_backward``, which also works without
pipeline parallelism; evaluation calls the model as usual and every process gets the last
stage's outputs.

Options: --quick, --llama (a tiny transformers Llama, needs `pip install transformers`),
--pp N (stages, default 2), --dp N (FSDP2 processes per stage, default 1),
--schedule NAME (gpipe, 1f1b, interleaved_1f1b, ...; default 1f1b), --save DIR.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from slipstream import Accelerator, ParallelismConfig, set_seed

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--llama", action="store_true")
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--schedule", default="1f1b")
    parser.add_argument("--save", default=None)
    args = parser.parse_args()

    layout = ParallelismConfig(
        pp_size=args.pp, dp_shard_size=args.dp, pp_schedule=args.schedule, pp_microbatches=4
    )
    accelerator = Accelerator(parallelism_config=layout if args.pp > 1 else None)
    set_seed(0)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(1, VOCAB, (1024 if args.quick else 8192, LENGTH), generator=generator)
    labels = tokens[:, 0] % CLASSES  # the class of a sequence: its first token modulo 4
    model = tiny_llama() if args.llama else block_stack()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(TensorDataset(tokens[:-200], labels[:-200]), batch_size=16, shuffle=True)
    held_out = DataLoader(TensorDataset(tokens[-200:], labels[-200:]), batch_size=16)
    model, optimizer, loader, held_out = accelerator.prepare(model, optimizer, loader, held_out)
    held = sum(p.numel() for p in model.parameters())  # this process's stage only
    print(
        f"process {accelerator.process_index}: pipeline stage "
        f"{accelerator.pipeline_parallel_rank}, {held:,} parameters",
        flush=True,
    )

    for epoch in range(1 if args.quick else 3):
        model.train()
        for x, y in loader:
            if args.llama:  # a language model: labels are the tokens themselves
                loss = accelerator.forward_backward(model, {"input_ids": x, "labels": x})
            else:
                loss = accelerator.forward_backward(model, x, target=y, loss_fn=F.cross_entropy)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)  # over all stages
            optimizer.step()
            optimizer.zero_grad()
        model.eval()
        correct = seen = 0
        with torch.no_grad():
            for x, y in held_out:
                if args.llama:
                    predicted, target = model(input_ids=x).logits[:, :-1].argmax(-1), x[:, 1:]
                else:
                    predicted, target = model(x).argmax(-1), y
                predicted, target = accelerator.gather_for_metrics((predicted, target))
                correct += int((predicted == target).sum())
                seen += target.numel()
        accelerator.print(
            f"epoch {epoch}: loss {accelerator.reduce(loss, 'mean').item():.4f}, held-out "
            f"accuracy {correct / seen:.3f} ({accelerator.num_processes} processes)"
        )
    if args.save:
        accelerator.save_model(model, args.save)  # the whole model, gathered from the stages
        accelerator.print(f"weights saved to {args.save}")


if __name__ == "__main__":
    main()
