"""The models the parallelism benchmarks train: a stack of residual MLP blocks (the unit
FSDP2 shards and pipelines split on), a stack of mixture-of-experts blocks (expert
parallelism), and a small transformers Llama.

Example::

    model = nn.Sequential(*[Block(256) for _ in range(8)])   # pipeline stages
    model = Blocks(256, 8)                                   # tensor parallel: blocks.*.up/down
    model = MoEBlocks(256, 4, experts=8)                     # experts: blocks.*.experts
"""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Blocks(nn.Module):
    # As in a transformers model: the unit FSDP2 shards on its own.
    _no_split_modules = ["Block"]

    def __init__(self, width: int, blocks: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block(width) for _ in range(blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)


def llama(width: int, layers: int, vocabulary: int, positions: int) -> nn.Module:
    """A randomly initialised ``LlamaForCausalLM`` (needs transformers)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocabulary,
        hidden_size=width,
        intermediate_size=3 * width,
        num_hidden_layers=layers,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=positions,
        # Tensor parallelism splits the embedding and lm_head differently, and pipeline
        # stages put them on different processes: they cannot share one tensor.
        tie_word_embeddings=False,
    )
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config)


class StackedExperts(nn.Module):
    """Experts stacked as 3-D parameters (transformers' layout), called with the router's
    choice; the (token, expert) pairs are grouped per expert, one matmul pair each."""

    def __init__(self, experts: int, width: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.w_in = nn.Parameter(torch.randn(experts, hidden, width) * width**-0.5)
        self.w_out = nn.Parameter(torch.randn(experts, width, hidden) * hidden**-0.5)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        flat = index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x[order // index.shape[-1]].split(counts)
        outputs = [
            torch.relu(part @ self.w_in[e].T) @ self.w_out[e].T for e, part in enumerate(rows)
        ]
        pairs = torch.cat(outputs) * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add(0, order // index.shape[-1], pairs)


class MoEBlock(nn.Module):
    def __init__(self, width: int, experts: int, top_k: int = 2) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.router = nn.Linear(width, experts, bias=False)
        self.experts = StackedExperts(experts, width, 2 * width)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = self.norm(x).reshape(-1, x.shape[-1])
        weights, index = torch.softmax(self.router(flat), dim=-1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return x + self.experts(flat, index, weights).view_as(x)


class MoEBlocks(nn.Module):
    """A stack of mixture-of-experts blocks (experts: ``blocks.*.experts``)."""

    _no_split_modules = ["MoEBlock"]

    def __init__(self, width: int, blocks: int, experts: int) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[MoEBlock(width, experts) for _ in range(blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x)
