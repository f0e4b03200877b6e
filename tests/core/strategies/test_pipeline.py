"""Pipeline parallelism on CPU processes over gloo: every schedule, with FSDP2 and with
tensor parallelism (2-D and 3-D meshes), against one-process references on the same
global batches; resume, resharding, meta-device construction and the errors.

Every run uses ``accelerator.forward_backward``, which is also what a script without
pipeline parallelism calls: the one-process runs here are that same script.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from slipstream import Accelerator, ParallelismConfig, set_seed
from slipstream.checkpoint import load_weights
from tests.distributed import run_cli, run_distributed

transformers = pytest.importorskip("transformers")

SAMPLES, BATCH, EVAL = 32, 4, 12
SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "looped_bfs", "interleaved_zb", "zbv")
PLAN = {"1.*.up": "colwise", "1.*.down": "rowwise"}


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


def _model(kind: str) -> nn.Module:
    set_seed(0)
    if kind == "llama":
        config = transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
        return transformers.LlamaForCausalLM(config)
    # embedding -> a list of blocks -> head, as nn.Sequential
    return nn.Sequential(
        nn.Linear(6, 16), nn.Sequential(*[Block(16) for _ in range(4)]), nn.Linear(16, 4)
    )


def _data(kind: str, samples: int = SAMPLES, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    index = torch.arange(samples)
    if kind == "llama":
        return TensorDataset(torch.randint(0, 64, (samples, 8), generator=generator), index)
    inputs = torch.randn(samples, 6, generator=generator)
    return TensorDataset(inputs, torch.randn(samples, 4, generator=generator), index)


def _step(acc: Accelerator, kind: str, model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    if kind == "llama":
        return acc.forward_backward(model, {"input_ids": batch[0], "labels": batch[0]})
    return acc.forward_backward(model, batch[0], target=batch[1], loss_fn=F.mse_loss)


def _layout(name: str, kind: str, schedule: str = "1f1b") -> ParallelismConfig | None:
    plan = None if kind == "llama" else PLAN
    sizes: dict[str, dict[str, Any]] = {
        "pp2": {"pp_size": 2},
        "pp2xdp2": {"pp_size": 2, "dp_shard_size": 2},
        "pp2xtp2xdp2": {"pp_size": 2, "tp_size": 2, "dp_shard_size": 2, "tp_plan": plan},
    }
    if name == "single":
        return None
    return ParallelismConfig(**sizes[name], pp_schedule=schedule, pp_microbatches=2)


def _train(
    layout: str,
    kind: str,
    steps: int,
    *,
    schedule: str = "1f1b",
    save_at: int | None = None,
    folder: str | None = None,
    resume: bool = False,
    export: str | None = None,
) -> dict[str, Any]:
    acc = Accelerator(parallelism_config=_layout(layout, kind, schedule))
    model = _model(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(_data(kind), batch_size=BATCH, shuffle=True)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    result: dict[str, Any] = {
        "stage_parameters": sorted(n for n, _ in model.named_parameters()),
        "pp_rank": acc.pipeline_parallel_rank,
    }
    if resume:
        assert folder is not None
        acc.load_state(folder)
        result["loaded"] = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
    batches, losses, norms = [], [], []
    while acc.step < steps:
        for batch in loader:
            loss = _step(acc, kind, model, batch)
            norms.append(acc.clip_grad_norm_(model.parameters(), 1.0).item())
            optimizer.step()
            optimizer.zero_grad()
            batches.append(acc.gather(batch[-1]).tolist())
            losses.append(acc.reduce(loss, "mean").item())
            if acc.step == save_at:
                assert folder is not None
                acc.save_state(folder)
                result["saved"] = {k: v.clone() for k, v in acc.get_state_dict(model).items()}
            if acc.step == steps:
                break
    model.eval()
    evaluation = acc.prepare(DataLoader(_data(kind, EVAL, seed=1), batch_size=BATCH))
    outputs = []
    with torch.no_grad():
        for batch in evaluation:
            output = model(input_ids=batch[0]).logits if kind == "llama" else model(batch[0])
            outputs.append(acc.gather_for_metrics(output))
    result.update(
        batches=batches,
        losses=losses,
        norms=norms,
        outputs=torch.cat(outputs),
        full={k: v.clone() for k, v in acc.get_state_dict(model).items()},
    )
    if export is not None:
        acc.save_model(model, export)
        if acc.is_main_process:
            acc.unwrap_model(model).config.save_pretrained(export)
    return result


def _reference(kind: str, batches: list[list[int]]) -> dict[str, Any]:
    data, model = _data(kind), _model(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses, norms = [], []
    for indices in batches:
        batch = [t[torch.tensor(indices)] for t in data.tensors]
        if kind == "llama":
            loss = model(input_ids=batch[0], labels=batch[0]).loss
        else:
            loss = F.mse_loss(model(batch[0]), batch[1])
        loss.backward()
        losses.append(loss.item())
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        optimizer.zero_grad()
    evaluation = _data(kind, EVAL, seed=1).tensors[0]
    with torch.no_grad():
        model.eval()
        outputs = model(input_ids=evaluation).logits if kind == "llama" else model(evaluation)
    return {
        "losses": losses,
        "norms": norms,
        "full": copy.deepcopy(model.state_dict()),
        "outputs": outputs,
    }


def _check(result: dict[str, Any], kind: str, tolerance: float = 1e-5) -> None:
    reference = _reference(kind, result["batches"])
    assert len(result["losses"]) == len(reference["losses"]) > 0
    for ours, theirs in zip(result["losses"], reference["losses"], strict=True):
        assert abs(ours - theirs) <= tolerance, (result["losses"], reference["losses"])
    for ours, theirs in zip(result["norms"], reference["norms"], strict=True):
        assert abs(ours - theirs) <= tolerance * max(1.0, theirs)
    full, expected = result["full"], reference["full"]
    assert full.keys() == expected.keys(), sorted(set(full) ^ set(expected))
    assert max((full[k] - expected[k]).abs().max().item() for k in full) <= tolerance
    assert (result["outputs"] - reference["outputs"]).abs().max().item() <= tolerance


def _bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- two processes: every schedule -----------------------------------------------------------


def _every_schedule() -> dict[str, Any]:
    return {schedule: _train("pp2", "plain", 3, schedule=schedule) for schedule in SCHEDULES}


def test_every_schedule_matches_one_process():
    first, second = run_distributed(_every_schedule, world_size=2, timeout=300)
    for schedule in SCHEDULES:
        _check(first[schedule], "plain")
        assert first[schedule]["losses"] == second[schedule]["losses"], "one loss everywhere"
    # Each process holds its stages' parameters only: the two halves, no overlap.
    one, two = set(first["1f1b"]["stage_parameters"]), set(second["1f1b"]["stage_parameters"])
    assert not one & two and "0.weight" in one and "2.weight" in two
    assert {n.split(".")[1] for n in one if n.startswith("1.")} == {"0", "1"}
    interleaved = set(first["interleaved_1f1b"]["stage_parameters"])
    assert "0.weight" in interleaved and any(n.startswith("1.2.") for n in interleaved)


# -- pp2 x dp_shard2 -------------------------------------------------------------------------


@pytest.mark.slow
def test_pipeline_inside_fsdp_resumes_bitwise_and_loads_into_one_process(tmp_path):
    folder = str(tmp_path / "ckpt")
    results = run_distributed(
        _train,
        "pp2xdp2",
        "plain",
        6,
        kwargs={"save_at": 4, "folder": folder},
        world_size=4,
        timeout=300,
    )
    first = results[0]
    _check(first, "plain")
    assert [r["pp_rank"] for r in results] == [0, 0, 1, 1]
    resumed = run_distributed(
        _train,
        "pp2xdp2",
        "plain",
        6,
        kwargs={"folder": folder, "resume": True},
        world_size=4,
        timeout=300,
    )[0]
    assert _bitwise(resumed["loaded"], first["saved"])
    assert resumed["losses"] == first["losses"][4:]
    assert _bitwise(resumed["full"], first["full"]), "resume is bitwise exact"
    # The same script, one process, no pipeline: the checkpoint reshards by name.
    alone = run_distributed(
        _train,
        "single",
        "plain",
        6,
        kwargs={"folder": folder, "resume": True},
        world_size=1,
        timeout=300,
    )[0]
    assert _bitwise(alone["loaded"], first["saved"])
    merged = tmp_path / "merged"
    outcome = run_cli("merge-weights", folder, str(merged))
    assert outcome.returncode == 0, outcome.stderr
    assert _bitwise(load_weights(str(merged)), first["saved"])


def test_llama_pipeline_with_data_parallel_and_export(tmp_path):
    export = str(tmp_path / "export")
    results = run_distributed(
        _train, "pp2xdp2", "llama", 4, kwargs={"export": export}, world_size=4, timeout=300
    )
    _check(results[0], "llama")
    reloaded = transformers.LlamaForCausalLM.from_pretrained(export)
    assert _bitwise(reloaded.state_dict(), results[0]["full"])


# -- pp2 x tp2 x dp_shard2 on 8 processes ----------------------------------------------------


def _three_dimensional() -> dict[str, Any]:
    return {kind: _train("pp2xtp2xdp2", kind, 3) for kind in ("plain", "llama")}


@pytest.mark.slow
def test_three_dimensional_layout_on_eight_processes():
    first = run_distributed(_three_dimensional, world_size=8, timeout=420)[0]
    _check(first["plain"], "plain")
    _check(first["llama"], "llama")


# -- meta-device construction and errors -----------------------------------------------------


def _meta_and_errors() -> dict[str, Any]:
    acc = Accelerator(parallelism_config=ParallelismConfig(pp_size=2, pp_microbatches=2))
    with torch.device("meta"):
        model = _model("llama")
    model = acc.prepare(model)
    tokens = torch.randint(0, 64, (4, 8))
    loss = acc.forward_backward(model, {"input_ids": tokens, "labels": tokens})
    result: dict[str, Any] = {
        "meta": [n for n, p in model.named_parameters() if p.is_meta],
        "layers": sorted({n.split(".")[2] for n, _ in model.named_parameters() if ".layers." in n}),
        "loss": loss.item(),
    }

    def attempt(action: Any) -> str:
        try:
            action()
        except Exception as error:
            return f"{type(error).__name__}: {error}"
        return "no error"

    plain = acc.prepare(_model("plain"))
    x = torch.randn(4, 6)
    result["backward"] = attempt(lambda: acc.backward(torch.ones((), requires_grad=True) * 2))
    result["called"] = attempt(lambda: plain(x))
    result["no loss"] = attempt(lambda: acc.forward_backward(plain, x))
    result["batch"] = attempt(
        lambda: acc.forward_backward(plain, x[:3], target=x[:3], loss_fn=F.mse_loss)
    )
    result["0-dim"] = attempt(
        lambda: acc.forward_backward(plain, x[0, 0], target=x[:3], loss_fn=F.mse_loss)
    )
    result["padding"] = attempt(
        lambda: acc.forward_backward(
            model, {"input_ids": tokens, "labels": tokens, "attention_mask": tokens * 0}
        )
    )
    return result


def test_meta_device_models_and_clear_errors():
    first, second = run_distributed(_meta_and_errors, world_size=2, timeout=300)
    assert first["meta"] == second["meta"] == []
    assert first["layers"] == ["0", "1"] and second["layers"] == ["2", "3"]
    assert first["loss"] == second["loss"] and 3.5 < first["loss"] < 5.0  # ~ log(64)
    assert "replace `loss = loss_fn(model(x), y); accelerator.backward(loss)`" in first["backward"]
    assert "forward and backward run together" in first["called"]
    assert "for evaluation call the model in eval mode" in first["called"]
    assert "needs loss_fn=..." in first["no loss"]
    assert "a batch of 3 samples does not split into pp_microbatches=2" in first["batch"]
    assert "must have a batch dimension" in first["0-dim"]
    assert "padding masks are not supported" in first["padding"]


# -- accumulation, mixed precision and callbacks under a pipeline ---------------------------


def _accumulate(mixed_precision: str) -> dict[str, Any]:
    from slipstream import GradientNormMonitor

    monitor = GradientNormMonitor()
    acc = Accelerator(
        parallelism_config=ParallelismConfig(pp_size=2, pp_microbatches=2),
        gradient_accumulation_steps=2,
        mixed_precision=mixed_precision,
        callbacks=[monitor],
    )
    model = _model("plain")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(_data("plain"), batch_size=BATCH, shuffle=True)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    dtypes: list[str] = []
    for module in model.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_hook(lambda _, __, out: dtypes.append(str(out.dtype)))
    batches, norms = [], []
    for step, batch in enumerate(loader):
        with acc.accumulate(model):
            _step(acc, "plain", model, batch)
            if acc.sync_gradients:
                norms.append(acc.clip_grad_norm_(model.parameters(), 1.0).item())
            optimizer.step()
            optimizer.zero_grad()
        batches.append(acc.gather(batch[-1]).tolist())
        if step == 3:
            break
    return {
        "batches": batches,
        "norms": norms,
        "steps": acc.step,
        "compute": sorted(set(dtypes)),
        "monitored": monitor.last_norm,
        "full": {k: v.clone() for k, v in acc.get_state_dict(model).items()},
    }


def _accumulated_reference(batches: list[list[int]]) -> dict[str, Any]:
    data, model = _data("plain"), _model("plain")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    norms = []
    for first, second in zip(batches[::2], batches[1::2], strict=True):
        for indices in (first, second):
            x, y, _ = (t[torch.tensor(indices)] for t in data.tensors)
            (F.mse_loss(model(x), y) / 2).backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        optimizer.zero_grad()
    return {"norms": norms, "full": model.state_dict()}


def _accumulate_both() -> dict[str, Any]:
    return {mode: _accumulate(mode) for mode in ("no", "bf16")}


def test_accumulation_mixed_precision_and_callbacks_keep_working():
    first = run_distributed(_accumulate_both, world_size=2, timeout=300)[0]
    exact, bf16 = first["no"], first["bf16"]
    reference = _accumulated_reference(exact["batches"])
    assert exact["steps"] == 2 and len(exact["norms"]) == 2
    for ours, theirs in zip(exact["norms"], reference["norms"], strict=True):
        assert abs(ours - theirs) <= 1e-5 * max(1.0, theirs)
    full = exact["full"]
    assert max((full[k] - reference["full"][k]).abs().max().item() for k in full) <= 1e-5
    assert exact["monitored"] == pytest.approx(min(1.0, exact["norms"][-1]), rel=1e-5)
    assert exact["compute"] == ["torch.float32"] and bf16["compute"] == ["torch.bfloat16"]
    low = bf16["full"]
    assert 0 < max((low[k] - full[k]).abs().max().item() for k in full) < 2e-2
