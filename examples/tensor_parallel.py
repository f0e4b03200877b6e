"""Tensor parallelism inside FSDP2: each layer's weights split over 2 processes, the rest of
the processes sharding data and optimizer state. Runs on CPU processes too.

    slipstream launch --num_processes 4 --cpu examples/tensor_parallel.py          # tp 2 x dp 2
    slipstream launch --num_processes 4 --cpu examples/tensor_parallel.py --llama  # transformers

The plain model gets its plan from the script (which Linear layers are split by output
columns, which by input rows); a transformers model brings its own. The training loop is the
same four lines as everywhere: processes of one tensor-parallel pair see the same batches,
and metrics count every evaluation sample once. The held-out loss and accuracy are printed
before training (chance) and after every epoch.

Options: --quick (one epoch, for tests), --llama (a tiny transformers Llama, needs
`pip install transformers`), --tp N (default 2), --save DIR (consolidated safetensors
weights).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split

from slipstream import Accelerator, ParallelismConfig, set_seed

VOCAB, LENGTH, CLASSES = 32, 16, 4

#: Module-name patterns ('*' is one name part) -> how the layer is split.
PLAN = {
    "blocks.*.attn.[qkv]": "colwise",  # each process computes half of the heads
    "blocks.*.attn.out": "rowwise",  # ... and the partial outputs are summed
    "blocks.*.mlp.up": "colwise",
    "blocks.*.mlp.down": "rowwise",
}


class Attention(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, width // heads
        self.q, self.k, self.v = (nn.Linear(width, width) for _ in range(3))
        self.out = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        # "-1" heads: under tensor parallelism each process holds only its share of them.
        q, k, v = (
            f(x).view(batch, length, -1, self.head_dim).transpose(1, 2)
            for f in (self.q, self.k, self.v)
        )
        mixed = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(mixed.transpose(1, 2).reshape(batch, length, -1))


class MLP(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn, self.mlp = Attention(width, heads), MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Classifier(nn.Module):
    """Tokens -> class of the sequence (here: the token group that occurs most often)."""

    def __init__(self, width: int = 64, heads: int = 4, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.position = nn.Parameter(torch.zeros(LENGTH, width))
        self.blocks = nn.Sequential(*[Block(width, heads) for _ in range(depth)])
        self.head = nn.Linear(width, CLASSES)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        hidden = self.blocks(self.embed(tokens) + self.position)
        return self.head(hidden[:, -1])  # causal: the last position has seen everything


def tiny_llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForSequenceClassification

    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_labels=CLASSES,
        pad_token_id=0,
    )
    return LlamaForSequenceClassification(config)


def make_data(count: int) -> TensorDataset:
    """Sequences of tokens labelled by the token group (token modulo 4) that occurs most
    often: attention has to gather the whole sequence into the last position."""
    tokens = torch.randint(1, VOCAB, (count, LENGTH), generator=torch.Generator().manual_seed(0))
    counts = F.one_hot(tokens % CLASSES, CLASSES).sum(dim=1)
    return TensorDataset(tokens, counts.argmax(dim=1))


def logits(model: nn.Module, tokens: torch.Tensor, llama: bool) -> torch.Tensor:
    return model(input_ids=tokens).logits if llama else model(tokens)


def evaluate(
    accelerator: Accelerator, model: nn.Module, loader: DataLoader, llama: bool
) -> tuple[float, float, int]:
    """Held-out loss and accuracy, every sample counted once (the processes of one
    tensor-parallel pair see the same samples; gather_for_metrics counts them once)."""
    model.eval()
    loss_sum, correct, seen = 0.0, 0, 0
    with torch.no_grad():
        for x, y in loader:
            outputs = logits(model, x, llama)
            losses = F.cross_entropy(outputs, y, reduction="none")
            losses, predictions, y = accelerator.gather_for_metrics(
                (losses, outputs.argmax(dim=-1), y)
            )
            loss_sum += float(losses.sum())
            correct += int((predictions == y).sum())
            seen += len(y)
    model.train()
    return loss_sum / seen, correct / seen, seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--llama", action="store_true")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--save", default=None)
    args = parser.parse_args()

    # tp processes split every layer; the rest shard data and optimizer state (FSDP2): with
    # no data-parallel size given, dp_shard takes the processes tp leaves.
    config = ParallelismConfig(tp_size=args.tp, tp_plan=None if args.llama else PLAN)
    accelerator = Accelerator(parallelism_config=config)
    set_seed(0)
    data = make_data(2048 if args.quick else 3072)
    train, held_out = random_split(data, [len(data) - 203, 203], torch.Generator().manual_seed(1))

    model = tiny_llama() if args.llama else Classifier()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer, loader, evaluation = accelerator.prepare(
        model,
        optimizer,
        DataLoader(train, batch_size=16, shuffle=True),
        DataLoader(held_out, batch_size=16),  # 203 samples: uneven on purpose
    )
    accelerator.print(
        f"layout {accelerator.torch_device_mesh}; this process: tp rank "
        f"{accelerator.tensor_parallel_rank}, dp shard {accelerator.data_parallel_shard_rank}"
    )

    def report(when: str) -> None:
        loss, accuracy, seen = evaluate(accelerator, model, evaluation, args.llama)
        accelerator.print(
            f"{when}: held-out loss {loss:.4f}, accuracy {accuracy:.3f} on {seen} samples "
            f"({accelerator.num_processes} processes)"
        )

    report("before training")  # an untrained model: loss about ln 4 = 1.386
    for epoch in range(1 if args.quick else 3):
        for x, y in loader:
            loss = F.cross_entropy(logits(model, x, args.llama), y)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)  # the global norm
            optimizer.step()
            optimizer.zero_grad()
        report(f"epoch {epoch}")
    if args.save:
        accelerator.save_model(model, args.save)  # whole weights, gathered from the shards
        accelerator.print(f"weights saved to {args.save}")


if __name__ == "__main__":
    main()
