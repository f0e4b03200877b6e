"""Mixture-of-experts training with expert parallelism: the experts of every layer spread
over 2 processes, tokens sent to their experts and back with all_to_all, everything else
sharded by FSDP2. Runs on CPU processes too.

    slipstream launch --num_processes 4 --cpu examples/moe.py            # dp_shard 4, ep 2
    slipstream launch --num_processes 4 --cpu examples/moe.py --plain    # a plain module

The task: sequences that count up in steps of 1, 2 or 3 (modulo the vocabulary); the model
predicts each next token. With transformers installed the model is a tiny randomly
initialised Qwen3-MoE, which brings its own expert plan and load-balancing loss (computed
over the global batch, as one process would); otherwise (or with --plain) a plain module
whose experts are 3-D parameters, named by ``ep_plan``. The training loop is the usual four
lines; ``accelerator.expert_load()`` reports how evenly the router spreads the tokens. The
held-out next-token loss and accuracy are printed before training and after every epoch.

Options: --quick, --plain, --ep N (default 2), --save DIR (consolidated safetensors weights,
with a transformers model also its config: ``from_pretrained(DIR)`` loads it).
"""

from __future__ import annotations

import argparse
import importlib.util

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from slipstream import Accelerator, ParallelismConfig, set_seed

VOCAB, LENGTH, EXPERTS, TOP_K = 32, 12, 4, 2


class Experts(nn.Module):
    """The experts module: called with the router's choice, experts stacked along dim 0."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = EXPERTS  # under expert parallelism: the experts held here
        self.w_in = nn.Parameter(torch.randn(EXPERTS, hidden, width) * width**-0.5)
        self.w_out = nn.Parameter(torch.randn(EXPERTS, width, hidden) * hidden**-0.5)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in range(self.num_experts):
            token, slot = torch.where(index == expert)
            hidden = F.gelu(x[token] @ self.w_in[expert].T) @ self.w_out[expert].T
            out = out.index_add(0, token, hidden * weights[token, slot, None])
        return out


class MoEBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.router = nn.Linear(width, EXPERTS, bias=False)
        self.experts = Experts(width, 2 * width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = self.norm(x).reshape(-1, x.shape[-1])
        weights, index = torch.softmax(self.router(flat), dim=-1).topk(TOP_K, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return x + self.experts(flat, index, weights).view_as(x)


class PlainMoE(nn.Module):
    """Each position sees its token and the one before; predicts the next token."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.mix = nn.Linear(2 * width, width)
        self.blocks = nn.Sequential(MoEBlock(width), MoEBlock(width))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pairs = torch.cat([self.embed(tokens[:, :-2]), self.embed(tokens[:, 1:-1])], dim=-1)
        return self.head(self.blocks(self.mix(pairs)))  # predicts tokens[:, 2:]


def tiny_qwen3_moe() -> nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        max_position_embeddings=LENGTH,
        output_router_logits=True,  # adds the load-balancing loss to the loss
        router_aux_loss_coef=0.01,
    )
    return Qwen3MoeForCausalLM(config)


def counting_sequences(count: int, generator: torch.Generator) -> torch.Tensor:
    start = torch.randint(0, VOCAB, (count, 1), generator=generator)
    step = torch.randint(1, 4, (count, 1), generator=generator)
    return (start + step * torch.arange(LENGTH)) % VOCAB


def training_loss(model: nn.Module, tokens: torch.Tensor, plain: bool) -> torch.Tensor:
    """The next-token loss (a transformers model adds its load-balancing loss)."""
    if plain:
        logits = model(tokens)
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 2:].reshape(-1))
    return model(input_ids=tokens, labels=tokens).loss


def evaluate(
    accelerator: Accelerator, model: nn.Module, loader: DataLoader, plain: bool
) -> tuple[float, float]:
    """Held-out next-token loss and accuracy for every position from the third on (the plain
    model sees two tokens), every sequence counted once over all processes."""
    model.eval()
    loss_sum, correct, seen = 0.0, 0, 0
    with torch.no_grad():
        for (tokens,) in loader:
            logits = model(tokens) if plain else model(input_ids=tokens).logits[:, 1:-1]
            target = tokens[:, 2:]
            losses = F.cross_entropy(logits.transpose(1, 2), target, reduction="none")
            losses, hits = accelerator.gather_for_metrics((losses, logits.argmax(-1) == target))
            loss_sum += float(losses.sum())
            correct += int(hits.sum())
            seen += hits.numel()
    model.train()
    return loss_sum / seen, correct / seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--plain", action="store_true")
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--save", default=None)
    args = parser.parse_args()
    plain = args.plain or importlib.util.find_spec("transformers") is None

    # Experts over `ep` of the processes that shard the model; FSDP2 shards the rest.
    config = ParallelismConfig(
        dp_shard_size=-1, ep_size=args.ep, ep_plan=["blocks.*.experts"] if plain else None
    )
    accelerator = Accelerator(parallelism_config=config)
    set_seed(0)
    generator = torch.Generator().manual_seed(0)
    sequences = counting_sequences(2048 if args.quick else 4096, generator)
    train, held_out = TensorDataset(sequences[:-256]), TensorDataset(sequences[-256:])

    model = PlainMoE() if plain else tiny_qwen3_moe()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer, loader, evaluation = accelerator.prepare(
        model,
        optimizer,
        DataLoader(train, batch_size=16, shuffle=True),
        DataLoader(held_out, batch_size=16),
    )
    accelerator.print(
        f"{'plain module' if plain else 'transformers Qwen3-MoE'}; layout "
        f"{accelerator.parallelism_config.sizes.describe()}; this process holds experts "
        f"{accelerator.expert_parallel_rank * EXPERTS // args.ep}.."
        f"{(accelerator.expert_parallel_rank + 1) * EXPERTS // args.ep - 1} of every layer"
    )

    held_loss, accuracy = evaluate(accelerator, model, evaluation, plain)
    # An untrained model: loss about ln 32 = 3.47, accuracy about 1/32.
    accelerator.print(f"before training: held-out loss {held_loss:.4f}, accuracy {accuracy:.3f}")
    accelerator.expert_load()  # resets the counts, so the epoch's load counts training only
    report_every = max(1, len(loader) // 4)
    for epoch in range(1 if args.quick else 2):
        for step, (tokens,) in enumerate(loader):
            loss = training_loss(model, tokens, plain)
            accelerator.backward(loss)
            accelerator.clip_grad_norm_(model.parameters(), 1.0)  # experts and the rest
            optimizer.step()
            optimizer.zero_grad()
            if epoch == 0 and step % report_every == 0:
                mean_loss = accelerator.reduce(loss.detach(), "mean").item()
                accelerator.print(f"  step {step}: training loss {mean_loss:.4f}")
        load = accelerator.expert_load()  # tokens per expert this epoch, all processes
        held_loss, accuracy = evaluate(accelerator, model, evaluation, plain)
        accelerator.print(
            f"epoch {epoch}: held-out loss {held_loss:.4f}, accuracy {accuracy:.3f}, "
            f"expert load imbalance (max/mean) {load.max_imbalance:.2f}"
        )
    if args.save:
        accelerator.save_model(model, args.save)  # whole weights, every expert
        if not plain and accelerator.is_main_process:
            accelerator.unwrap_model(model).config.save_pretrained(args.save)
        accelerator.print(f"weights saved to {args.save}")


if __name__ == "__main__":
    main()
