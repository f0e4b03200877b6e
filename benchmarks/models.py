"""The models the parallelism benchmarks train: a stack of residual MLP blocks (the unit
FSDP2 shards and pipelines split on), and a small transformers Llama.

Example::

    model = nn.Sequential(*[Block(256) for _ in range(8)])   # pipeline stages
    model = Blocks(256, 8)                                   # tensor parallel: blocks.*.up/down
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
