"""Small models shared by the big-model tests."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn


class Block(nn.Module):
    """A residual block: splitting it across devices would be wrong, so tests list it in
    no_split_module_classes."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Stack(nn.Module):
    """embed -> blocks -> head, with the head tied to the embedding."""

    def __init__(self, width: int = 16, depth: int = 4, vocab: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight
        self.register_buffer("scale", torch.tensor(0.5))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(x) * self.scale


def tiny_llama_config(**overrides: Any) -> Any:
    transformers = pytest.importorskip("transformers")
    options = {
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        **overrides,
    }
    return transformers.LlamaConfig(**options)


class Plain(nn.Module):
    """Blocks without tied weights (FSDP shards each block)."""

    def __init__(self, width: int = 16, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.out = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(x))
