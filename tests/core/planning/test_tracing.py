"""The meta-device trace: saved bytes (each storage once, no parameters), FLOPs, and the
stand-ins for memory-efficient attention and balanced experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from slipstream.planning.tracing import trace_units


class TwoLayers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(8, 16, bias=False)
        self.second = nn.Linear(16, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.relu(self.first(x)))


class Attention(nn.Module):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_saved_bytes_and_flops_per_unit():
    with torch.device("meta"):
        model = TwoLayers()
        x = torch.empty(3, 8)
    traces = trace_units(model, {"x": x}, ["first", "second"])
    # first saves its input (3 x 8 fp32); relu saves its output (3 x 16), which second also
    # saves as its input: one storage, counted once, in the unit that made it.
    assert traces["first"].saved == 3 * 8 * 4 + 3 * 16 * 4
    assert traces["second"].saved == 0
    assert traces["first"].inputs == 3 * 8 * 4
    assert traces["first"].flops == 2 * 3 * 8 * 16
    assert traces["second"].flops == 2 * 3 * 16 * 4


def test_attention_keeps_q_k_v_output_and_log_sum_exp_and_counts_half_when_causal():
    with torch.device("meta"):
        q, k, v = (torch.empty(2, 4, 16, 8, requires_grad=True) for _ in range(3))
    traces = trace_units(Attention(), {"q": q, "k": k, "v": v}, [""])
    size = 2 * 4 * 16 * 8 * 4
    assert traces[""].saved == 4 * size + 2 * 4 * 16 * 4  # q, k, v, out + fp32 lse
    assert traces[""].flops == 4 * 2 * 4 * 16 * 16 * 8 / 2
    assert F.scaled_dot_product_attention.__name__ == "scaled_dot_product_attention"


class StackedExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up = nn.Parameter(torch.empty(4, 2 * 6, 8))  # [experts, 2 x hidden, width]
        self.down = nn.Parameter(torch.empty(4, 8, 6))

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        raise AssertionError("replaced by the balanced stand-in during the trace")


class Router(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = StackedExperts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        index = torch.zeros(x.shape[0], 2, dtype=torch.long, device=x.device)
        weights = torch.ones(x.shape[0], 2, device=x.device)
        return self.experts(x, index, weights)


def test_experts_compute_top_k_rows_as_if_routing_were_balanced():
    with torch.device("meta"):
        model = Router()
        x = torch.empty(5, 8, requires_grad=True)
    traces = trace_units(model, {"x": x}, [""], experts=[model.experts])
    # 5 tokens x top-2 = 10 rows through one expert's gate_up (12 x 8) and down (8 x 6).
    assert traces[""].flops == 2 * 10 * 12 * 8 + 2 * 10 * 8 * 6
    assert "forward" not in vars(model.experts)  # the stand-in is removed afterwards
