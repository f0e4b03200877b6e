"""Context parallelism: refused clearly where torch cannot run it (CPU), checked inputs, and
on 2 GPUs the same loss and gradients as one process on whole sequences."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from slipstream.parallel import ParallelismConfigError
from slipstream.parallel.context_parallel import (
    check_context_parallel_model,
    check_context_parallel_supported,
    context_parallel_region,
)
from tests.distributed import run_distributed


def test_context_parallelism_is_refused_on_the_cpu():
    with pytest.raises(ParallelismConfigError, match="CUDA devices only; this process runs on cpu"):
        check_context_parallel_supported(torch.device("cpu"))


def test_attention_must_go_through_sdpa():
    class Config:
        _attn_implementation = "eager"

    model = nn.Linear(2, 2)
    model.config = Config()  # type: ignore[assignment]
    with pytest.raises(ParallelismConfigError, match="attn_implementation='sdpa'"):
        check_context_parallel_model(model)
    Config._attn_implementation = "sdpa"
    check_context_parallel_model(model)
    check_context_parallel_model(nn.Linear(2, 2))  # not a transformers model: nothing to check


def _buffer_checks() -> list[str]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    messages = []
    for buffers, dims in (([torch.zeros(1, 6)], [1]), ([torch.zeros(1, 8)], [1, 1])):
        try:
            with context_parallel_region(mesh, buffers, dims, None, "allgather"):
                pass
        except ValueError as error:
            messages.append(str(error))
    return messages


def test_buffers_are_checked_before_splitting():
    messages = run_distributed(_buffer_checks, world_size=2, timeout=120)[0]
    assert "sequence length 6 (dim 1), which 2 x cp_size = 4 does not divide" in messages[0]
    assert "1 buffers but 2 buffer_seq_dims" in messages[1]


# -- on GPUs -------------------------------------------------------------------------------

SEQUENCE = 16


def _llama() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    return transformers.LlamaForCausalLM(config)


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 64, (2, SEQUENCE), generator=torch.Generator().manual_seed(0))
    # Every position has a target (the next token, wrapping), so each sequence slice holds
    # the same number of targets and the mean of slice means is the whole mean.
    targets = torch.roll(tokens, -1, dims=1)
    positions = torch.arange(SEQUENCE).expand(2, SEQUENCE).contiguous()
    return tokens, targets, positions


def _context_parallel_step() -> dict[str, Any]:
    from slipstream import Accelerator, ParallelismConfig

    acc = Accelerator(parallelism_config=ParallelismConfig(cp_size=2))
    model = acc.prepare(_llama())
    tokens, targets, positions = (t.to(acc.device) for t in _batch())
    with acc.maybe_context_parallel(
        buffers=[tokens, targets, positions],
        buffer_seq_dims=[1, 1, 1],
        no_restore_buffers={tokens, targets, positions},
    ):
        loss = model(input_ids=tokens, position_ids=positions, shift_labels=targets).loss
        acc.backward(loss)
    norm = acc.clip_grad_norm_(model.parameters(), 1e9)
    return {
        "loss": acc.reduce(loss.detach(), "mean").item(),
        "norm": norm.item(),
        "held": tokens.shape[1],
    }


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_context_parallel_attention_matches_one_process_on_two_gpus():
    results = run_distributed(
        _context_parallel_step, env={"CUDA_VISIBLE_DEVICES": "0,1"}, world_size=2, timeout=300
    )
    assert [r["held"] for r in results] == [SEQUENCE // 2] * 2, "each GPU holds half"
    model = _llama()
    tokens, targets, positions = _batch()
    loss = model(input_ids=tokens, position_ids=positions, shift_labels=targets).loss
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item()
    assert results[0]["loss"] == pytest.approx(loss.item(), rel=1e-4)
    assert results[0]["norm"] == pytest.approx(norm, rel=1e-3)
