"""Expert parallelism on 2 and 4 CPU processes over gloo, against one-process references on
the same global batches.

The models: a plain module whose experts are stacked 3-D parameters, the same with an
``nn.ModuleList`` of expert MLPs (both with a user ``ep_plan``), and a tiny randomly
initialised transformers Qwen3-MoE with its own ``base_model_ep_plan`` and its
load-balancing loss. Each run trains a few AdamW steps with clipping, records every step's
global batch, loss and gradient norm, and returns the full weights; the test replays those
batches in one process. Several runs share one launch where the layout allows it.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from slipstream import Accelerator, GradientNormMonitor, ParallelismConfig, set_seed
from slipstream.checkpoint import load_weights
from tests.distributed import run_cli, run_distributed

#: Starts its own processes for every test: left out of `pytest -m "not slow"`.
pytestmark = pytest.mark.slow

transformers = pytest.importorskip("transformers")

SAMPLES = 32
LR = 1e-3


# -- models -----------------------------------------------------------------------------------


class StackedExperts(nn.Module):
    """Experts as 3-D parameters (transformers' layout), called with the router's choice."""

    def __init__(self, experts: int, width: int, hidden: int) -> None:
        super().__init__()
        self.num_experts = experts
        self.w_in = nn.Parameter(torch.randn(experts, hidden, width) * 0.3)
        self.w_out = nn.Parameter(torch.randn(experts, width, hidden) * 0.3)

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert in range(self.num_experts):
            token, slot = torch.where(index == expert)
            h = torch.relu(x[token] @ self.w_in[expert].T) @ self.w_out[expert].T
            out = out.index_add(0, token, h * weights[token, slot, None])
        return out


class MLP(nn.Module):
    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class ListedExperts(nn.Module):
    """Experts as an nn.ModuleList of MLPs."""

    def __init__(self, experts: int, width: int, hidden: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList([MLP(width, hidden) for _ in range(experts)])

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for expert, module in enumerate(self.experts):
            token, slot = torch.where(index == expert)
            out = out.index_add(0, token, module(x[token]) * weights[token, slot, None])
        return out


class MoE(nn.Module):
    """A dense MLP (tensor-parallel in the tp layouts), then a top-k routed mixture."""

    def __init__(self, width: int, listed: bool, top_k: int = 2) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.router = nn.Linear(width, 4, bias=False)
        self.experts = (ListedExperts if listed else StackedExperts)(4, width, 2 * width)
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.down(torch.relu(self.up(x)))
        flat = x.reshape(-1, x.shape[-1])
        weights, index = torch.softmax(self.router(flat), -1).topk(self.top_k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        return x + self.experts(flat, index, weights).view_as(x)


class Net(nn.Module):
    def __init__(self, listed: bool = False, top_k: int = 2) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 16)
        self.blocks = nn.Sequential(MoE(16, listed, top_k), MoE(16, listed, top_k))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


def _qwen(aux: bool = True) -> nn.Module:
    config = transformers.Qwen3MoeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=4,
        num_experts_per_tok=2,
        max_position_embeddings=32,
        output_router_logits=aux,
        router_aux_loss_coef=0.1,
    )
    config._attn_implementation = "sdpa"
    return transformers.Qwen3MoeForCausalLM(config)


def _model(kind: str) -> nn.Module:
    set_seed(0)
    if kind in ("qwen", "qwen-pp"):
        return _qwen(aux=kind == "qwen")
    if kind == "uneven":
        # A frozen router that sends every token to expert 0: the other process's experts
        # receive nothing, every step.
        model = Net(top_k=1)
        for block in model.blocks:
            block.router = nn.Linear(16, 4)
            nn.init.zeros_(block.router.weight)
            block.router.bias.data = torch.tensor([10.0, 0.0, 0.0, 0.0])
            block.router.requires_grad_(False)
        return model
    return Net(listed=kind == "listed")


def _data(kind: str) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    index = torch.arange(SAMPLES)
    if kind.startswith("qwen"):
        return TensorDataset(torch.randint(0, 64, (SAMPLES, 8), generator=generator), index)
    inputs = torch.randn(SAMPLES, 4, 6, generator=generator)
    return TensorDataset(inputs, torch.randn(SAMPLES, 4, 4, generator=generator), index)


def _loss(kind: str, model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    if kind.startswith("qwen"):
        return model(input_ids=batch[0], labels=batch[0]).loss
    return F.mse_loss(model(batch[0]), batch[1])


PLANS: dict[str, Any] = {
    "stacked": ["blocks.*.experts"],
    "uneven": ["blocks.*.experts"],
    "listed": {"blocks.*.experts": "experts"},
}
TP_PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
LAYOUTS: dict[str, dict[str, Any]] = {
    "ep2": {"ep_size": 2},  # only ep: every process shards (dp_shard=2)
    "ep2xdp2": {"dp_shard_size": 4, "ep_size": 2},
    "ep4": {"dp_shard_size": 4, "ep_size": 4},
    "dp4": {"dp_shard_size": 4},
    "hsdp-ep2": {"dp_replicate_size": 2, "dp_shard_size": 2, "ep_size": 2},
    "tp2-ep2": {"dp_shard_size": 2, "tp_size": 2, "ep_size": 2},
    "pp2-ep2": {"pp_size": 2, "dp_shard_size": 2, "ep_size": 2, "pp_microbatches": 2},
}


def _layout(name: str, kind: str) -> ParallelismConfig | None:
    if name == "single":
        return None
    sizes = dict(LAYOUTS[name])
    if name.startswith("tp") and kind in PLANS:
        sizes["tp_plan"] = TP_PLAN
    return ParallelismConfig(**sizes, ep_plan=PLANS.get(kind))


# -- training -------------------------------------------------------------------------------


def _full(acc: Accelerator, model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in acc.get_state_dict(model).items()}


def _train(
    layout: str,
    kind: str,
    steps: int,
    *,
    save_at: int | None = None,
    folder: str | None = None,
    resume: bool = False,
    export: str | None = None,
    options: dict[str, Any] | None = None,
    plugin: dict[str, Any] | None = None,
) -> dict[str, Any]:
    from slipstream import FullyShardedDataParallelPlugin

    options = dict(options or {})
    if plugin:
        options["fsdp_plugin"] = FullyShardedDataParallelPlugin(**plugin)
    acc = Accelerator(parallelism_config=_layout(layout, kind), **options)
    model = _model(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    loader = DataLoader(_data(kind), batch_size=2, shuffle=True)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    result: dict[str, Any] = {
        "ep_rank": acc.expert_parallel_rank,
        "ep_size": acc.expert_parallel_size,
        "expert_shapes": {
            n: tuple(getattr(p, "to_local", lambda p=p: p)().shape)
            for n, p in model.named_parameters()
            if ".experts." in n or n.endswith((".w_in", ".w_out"))
        },
    }
    if options.get("log_with"):
        acc.init_trackers("moe")
    done = 0
    if resume:
        assert folder is not None
        acc.load_state(folder)
        done = acc.step
        result["loaded"] = _full(acc, model)
        result["optimizer_steps"] = sorted({int(s["step"]) for s in optimizer.state.values()})
    batches, losses, norms, imbalance, routed = [], [], [], [], []
    while done < steps:
        for batch in loader:
            with acc.accumulate(model):
                if kind == "qwen-pp":
                    loss = acc.forward_backward(model, {"input_ids": batch[0], "labels": batch[0]})
                else:
                    loss = _loss(kind, model, batch)
                    acc.backward(loss)
                if acc.sync_gradients:
                    norms.append(acc.clip_grad_norm_(model.parameters(), 1.0).item())
                optimizer.step()
                optimizer.zero_grad()
            batches.append(acc.gather(batch[-1]))
            losses.append(acc.reduce(loss.detach(), "mean").item())
            if acc.sync_gradients:
                done += 1
                load = acc.expert_load()
                imbalance.append(load.max_imbalance)
                routed.append([int(t.sum()) for t in load.tokens.values()])
                if options.get("log_with"):
                    acc.log(load.metrics(), step=done)
                if done == save_at:
                    assert folder is not None
                    acc.save_state(folder)
                    result["saved"] = _full(acc, model)
            if done == steps:
                break
    result.update(
        batches=[b.tolist() for b in batches],
        losses=losses,
        norms=norms,
        imbalance=imbalance,
        routed=routed,
        full=_full(acc, model),
    )
    if options.get("log_with"):
        acc.end_training()
    if export is not None:
        acc.save_model(model, export)
        if acc.is_main_process:
            acc.unwrap_model(model).config.save_pretrained(export)
    return result


def _runs(*runs: tuple[Any, ...]) -> list[dict[str, Any]]:
    """Several runs, one after another, in the same processes (one launch)."""
    return [_train(*run[:3], **(run[3] if len(run) > 3 else {})) for run in runs]


def _reference(kind: str, batches: list[list[int]], accumulation: int = 1) -> dict[str, Any]:
    """One process, the same model and optimizer, the same global batches."""
    data = _data(kind)
    model = _model("qwen-pp" if kind == "qwen-pp" else kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, norms = [], []
    for step in range(0, len(batches), accumulation):
        group = batches[step : step + accumulation]
        for indices in group:
            batch = [t[torch.tensor(indices)] for t in data.tensors]
            loss = _loss(kind, model, batch)
            (loss / len(group)).backward()
            losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        optimizer.zero_grad()
    return {"losses": losses, "norms": norms, "full": copy.deepcopy(model.state_dict())}


def _max_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _check_against_reference(result: dict[str, Any], kind: str, tolerance: float = 1e-5) -> None:
    reference = _reference(kind, result["batches"])
    assert len(result["losses"]) == len(reference["losses"]) > 0
    for ours, theirs in zip(result["losses"], reference["losses"], strict=True):
        assert abs(ours - theirs) <= tolerance, (result["losses"], reference["losses"])
    for ours, theirs in zip(result["norms"], reference["norms"], strict=True):
        assert abs(ours - theirs) <= tolerance * max(1.0, theirs), (result["norms"], reference)
    assert _max_difference(result["full"], reference["full"]) <= tolerance


def _resume(folder: str) -> dict[str, Any]:
    return {"folder": folder, "resume": True}


# -- 2 processes: plain modules with a user plan ----------------------------------------------


def test_plain_experts_on_two_processes_match_one_process_resume_and_uneven_routing(tmp_path):
    stacked, listed = str(tmp_path / "stacked"), str(tmp_path / "listed")
    first = run_distributed(
        _runs,
        ("ep2", "stacked", 4, {"save_at": 2, "folder": stacked}),
        ("ep2", "listed", 4, {"save_at": 2, "folder": listed}),
        ("ep2", "uneven", 3),
        world_size=2,
        timeout=300,
    )
    for kind, run in zip(("stacked", "listed", "uneven"), first[0], strict=True):
        _check_against_reference(run, kind)
    ranks = [[run["ep_rank"] for run in process] for process in first]
    assert ranks == [[0, 0, 0], [1, 1, 1]] and first[0][0]["ep_size"] == 2
    # Each process keeps half of the experts: 2 of 4 stacked, 2 listed MLPs.
    assert first[0][0]["expert_shapes"]["blocks.0.experts.w_in"] == (2, 32, 16)
    listed_names = sorted(first[1][1]["expert_shapes"])
    assert listed_names[0].startswith("blocks.0.experts.experts.2."), listed_names
    assert not any(".experts.0." in n or ".experts.1." in n for n in listed_names)
    # All tokens go to expert 0: the second process's experts receive nothing (no hang),
    # and the load is as uneven as it gets (4 experts, one takes all: max/mean = 4).
    assert first[0][2]["imbalance"] == [4.0, 4.0, 4.0]
    assert 1.0 <= first[0][0]["imbalance"][0] < 4.0

    resumed = run_distributed(
        _runs,
        ("ep2", "stacked", 4, _resume(stacked)),
        ("ep2", "listed", 4, _resume(listed)),
        world_size=2,
        timeout=300,
    )[0]
    for before, after in zip(first[0][:2], resumed, strict=True):
        assert _bitwise_equal(after["loaded"], before["saved"])
        assert after["optimizer_steps"] == [2]
        assert after["losses"] == before["losses"][2:], "the same batches and losses"
        assert _bitwise_equal(after["full"], before["full"]), "resume is bitwise exact"
    # One plain process reads both checkpoints (every expert, by name).
    alone = run_distributed(
        _runs,
        ("single", "stacked", 2, _resume(stacked)),
        ("single", "listed", 2, _resume(listed)),
        world_size=1,
        timeout=300,
    )[0]
    for before, after in zip(first[0][:2], alone, strict=True):
        assert _bitwise_equal(after["loaded"], before["saved"])
        assert after["optimizer_steps"] == [2]


# -- 4 processes: a transformers Qwen3-MoE with its own plan and its aux loss ------------------


def test_qwen_moe_matches_one_process_exports_and_reshards(tmp_path):
    folder, export, merged = (str(tmp_path / n) for n in ("ckpt", "export", "merged"))
    results = run_distributed(
        _train,
        "ep2xdp2",
        "qwen",
        4,
        kwargs={"save_at": 2, "folder": folder, "export": export},
        world_size=4,
        timeout=300,
    )
    first = results[0]
    assert [r["ep_rank"] for r in results] == [0, 1, 0, 1]
    # The load-balancing loss is that of the global batch: losses, norms and weights match.
    _check_against_reference(first, "qwen")
    assert first["expert_shapes"]["model.layers.0.mlp.experts.gate_up_proj"] == (1, 32, 32)
    # Consolidated weights: transformers loads them; merge-weights joins the sharded parts.
    reloaded = transformers.Qwen3MoeForCausalLM.from_pretrained(export)
    assert _bitwise_equal(reloaded.state_dict(), first["full"])
    outcome = run_cli("merge-weights", folder, merged)
    assert outcome.returncode == 0, outcome.stderr
    assert _bitwise_equal(load_weights(merged), first["saved"])
    assert not os.path.exists(os.path.join(folder, "model.safetensors")), "sharded parts only"

    resumed = run_distributed(
        _train, "ep2xdp2", "qwen", 4, kwargs=_resume(folder), world_size=4, timeout=300
    )[0]
    assert _bitwise_equal(resumed["loaded"], first["saved"])
    assert resumed["losses"] == first["losses"][2:]
    assert _bitwise_equal(resumed["full"], first["full"]), "resume is bitwise exact"
    # Other layouts read the same checkpoint: plain FSDP over 4, experts over 4, one process.
    for layout, world in (("dp4", 4), ("ep4", 4), ("single", 1)):
        other = run_distributed(
            _train, layout, "qwen", 3, kwargs=_resume(folder), world_size=world, timeout=300
        )[0]
        assert _bitwise_equal(other["loaded"], first["saved"]), layout
        assert other["optimizer_steps"] == [2], layout
        if world == 4:  # the same global batches: the training continues alike
            assert abs(other["losses"][0] - first["losses"][2]) < 1e-5, layout


# -- composition: TP, PP, HSDP; precision, checkpointing, accumulation, compile, trackers ----


def test_experts_next_to_tensor_parallelism():
    # Attention (Qwen's own plan, q_norm/k_norm summed over TP) or the dense MLP split over
    # tp=2; experts split over ep=2 and whole on both TP processes.
    qwen, plain = run_distributed(
        _runs, ("tp2-ep2", "qwen", 3), ("tp2-ep2", "stacked", 3), world_size=4, timeout=300
    )[0]
    _check_against_reference(qwen, "qwen")
    _check_against_reference(plain, "stacked")


def test_experts_inside_pipeline_stages():
    # Each stage's experts are split over its two data-parallel processes. (The stages pass
    # only hidden states, so the pipeline's loss is the model's loss without the aux loss.)
    result = run_distributed(_train, "pp2-ep2", "qwen-pp", 3, world_size=4, timeout=300)
    assert [r["ep_rank"] for r in result] == [0, 1, 0, 1]
    _check_against_reference(result[0], "qwen-pp")


def test_experts_under_hybrid_sharding():
    listed, stacked = run_distributed(
        _runs, ("hsdp-ep2", "listed", 3), ("hsdp-ep2", "stacked", 3), world_size=4, timeout=300
    )[0]
    _check_against_reference(listed, "listed")
    _check_against_reference(stacked, "stacked")


def test_accumulation_activation_checkpointing_compile_precision_and_trackers(tmp_path):
    wrap = {
        "auto_wrap_policy": "transformer_based_wrap",
        "transformer_cls_names_to_wrap": ["Qwen3MoeDecoderLayer"],
        "activation_checkpointing": True,
    }
    exact = {"gradient_accumulation_steps": 2, "dynamo_backend": "aot_eager"}
    loose = {
        "mixed_precision": "bf16",
        "callbacks": [GradientNormMonitor()],
        "log_with": "csv",
        "project_dir": str(tmp_path),
    }
    accumulated, bf16 = run_distributed(
        _runs,
        ("ep2", "qwen", 3, {"options": exact, "plugin": wrap}),
        ("ep2", "qwen", 3, {"options": loose}),
        world_size=2,
        timeout=300,
    )[0]
    reference = _reference("qwen", accumulated["batches"], accumulation=2)
    assert len(accumulated["norms"]) == 3
    for ours, theirs in zip(accumulated["norms"], reference["norms"], strict=True):
        assert abs(ours - theirs) < 1e-5
    assert _max_difference(accumulated["full"], reference["full"]) < 1e-5
    # Activation checkpointing runs the experts' forward again in backward: not counted
    # twice. Per step and layer: 2 micro-batches x 2 processes x 2 x 8 tokens x top-2.
    assert accumulated["routed"] == [[128, 128]] * 3

    reference = _reference("qwen", bf16["batches"])
    assert bf16["losses"] != reference["losses"], "bf16 compute differs from fp32 ..."
    assert max(abs(a - b) for a, b in zip(bf16["losses"], reference["losses"], strict=True)) < 2e-2
    assert _max_difference(bf16["full"], reference["full"]) < 2e-2, "... but trains alike"
    rows = (tmp_path / "moe" / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    assert "expert_load/max_imbalance" in header and "grad_norm" in header, header
    assert "expert_load/model.layers.1.mlp.experts/imbalance" in header


# -- errors: the same clear message on every process ------------------------------------------


def _attempt(build: Any) -> str:
    try:
        build()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


class ThreeExperts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = StackedExperts(3, 4, 8)


def _errors() -> dict[str, str]:
    from slipstream import DeepSpeedPlugin, FullyShardedDataParallelPlugin

    def ep2(plan: Any = None, **options: Any) -> Accelerator:
        return Accelerator(parallelism_config=ParallelismConfig(ep_size=2, ep_plan=plan), **options)

    full = FullyShardedDataParallelPlugin(state_dict_type="FULL_STATE_DICT")
    return {
        "shards": _attempt(
            lambda: Accelerator(
                parallelism_config=ParallelismConfig(dp_replicate_size=2, ep_size=2)
            )
        ),
        "deepspeed": _attempt(
            lambda: ep2(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2, gradient_clipping=1.0))
        ),
        "no experts": _attempt(lambda: ep2().prepare(nn.Linear(4, 4))),
        "divide": _attempt(lambda: ep2(["experts"]).prepare(ThreeExperts())),
        "pattern": _attempt(lambda: ep2(["blocks.*.moe"]).prepare(Net())),
        "listed full": _attempt(
            lambda: ep2(["blocks.*.experts"], fsdp_plugin=full).prepare(Net(listed=True))
        ),
    }


def test_errors_are_clear_and_the_same_on_every_process():
    first, second = run_distributed(_errors, world_size=2, timeout=180)
    assert first == second
    expected = {
        "shards": "ep_size=2 does not divide dp_shard_size x cp_size = 1",
        "deepspeed": "DeepSpeed cannot be combined with a parallel layout (dp_shard=2 (experts",
        "no experts": "no experts were found in Linear: looked for ParallelismConfig(ep_plan=...)",
        "divide": "ep_size=2 does not divide the 3 experts of experts",
        "pattern": "ep_plan pattern 'blocks.*.moe' matches no module of Net",
        "listed full": "use state_dict_type='SHARDED_STATE_DICT'",
    }
    for case, text in expected.items():
        assert first[case].startswith("ParallelismConfigError") and text in first[case], (
            case,
            first[case],
        )


def test_plain_data_parallelism_uses_the_load_balancing_loss_of_the_global_batch():
    # Without a parallel layout (DDP, and FSDP2 over both processes) a transformers MoE
    # model's aux loss is that of the global batch too: losses and weights match one process.
    ddp, fsdp = run_distributed(
        _runs,
        ("single", "qwen", 3),
        ("single", "qwen", 3, {"plugin": {"reshard_after_forward": True}}),
    )[0]
    _check_against_reference(ddp, "qwen")
    _check_against_reference(fsdp, "qwen")
