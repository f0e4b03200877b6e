"""N-D parallelism on 4 CPU processes over gloo (tensor parallel inside FSDP2, and HSDP),
against single-process references on the same global batches.

Each run trains a few AdamW steps with clipping, records every step's global batch (the
data-parallel gather of sample indices), loss and gradient norm, and returns the full
weights; the test replays those batches in one process and compares. Resume runs continue
a checkpoint in fresh processes and must end bitwise equal to the uninterrupted run.
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

transformers = pytest.importorskip("transformers")

SAMPLES = 32
EVAL = 39
PLAN = {"blocks.*.up": "colwise", "blocks.*.down": "rowwise"}
SP_PLAN = {
    "embed": "rowwise_split_input",
    "blocks.*.norm": "sequence_parallel",
    "blocks.*.up": "colwise",
    "blocks.*.down": "rowwise",
    "head": "colwise_gather_output",
}


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Net(nn.Module):
    """Per-token layers around two residual blocks: (batch, sequence, 6) -> (.., 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(6, 16)
        self.blocks = nn.Sequential(Block(16), Block(16))
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(x)))


def _llama(tied: bool) -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        tie_word_embeddings=tied,
    )
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config)


def _data(kind: str) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    index = torch.arange(SAMPLES)
    if kind == "llama":
        return TensorDataset(torch.randint(0, 64, (SAMPLES, 8), generator=generator), index)
    inputs = torch.randn(SAMPLES, 4, 6, generator=generator)
    return TensorDataset(inputs, torch.randn(SAMPLES, 4, 4, generator=generator), index)


def _model(kind: str) -> nn.Module:
    set_seed(0)
    return _llama(tied=kind == "llama") if kind == "llama" else Net()


def _loss(kind: str, model: nn.Module, batch: list[torch.Tensor]) -> torch.Tensor:
    if kind == "llama":
        return model(input_ids=batch[0], labels=batch[0]).loss
    return F.mse_loss(model(batch[0]), batch[1])


def _layout(name: str, kind: str) -> ParallelismConfig | None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = None if kind == "llama" else PLAN
    # DTensor ParallelStyle objects work as plan entries too.
    objects = {"blocks.*.up": ColwiseParallel(), "blocks.*.down": RowwiseParallel()}
    return {
        "tp2xdp2": ParallelismConfig(dp_shard_size=2, tp_size=2, tp_plan=plan),
        "hsdp": ParallelismConfig(dp_replicate_size=2, dp_shard_size=2),
        "dp4": ParallelismConfig(dp_shard_size=4),
        "replicas": ParallelismConfig(dp_replicate_size=2),
        "tp2": ParallelismConfig(tp_size=2, tp_plan=None if kind == "llama" else objects),
        "tp2-sp": ParallelismConfig(tp_size=2, tp_plan=SP_PLAN, sequence_parallel=True),
        "single": None,
    }[name]


def _local_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    """The shape this process holds (a DTensor's local shard)."""
    local = getattr(tensor, "to_local", None)
    return tuple((local() if local is not None else tensor).shape)


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
    options: dict[str, Any] | None = None,
    export: str | None = None,
    evaluate: bool = False,
) -> dict[str, Any]:
    options = options or {}
    acc = Accelerator(parallelism_config=_layout(layout, kind), **options)
    model = _model(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loader = DataLoader(_data(kind), batch_size=2, shuffle=True)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    shapes: list[tuple[int, ...]] = []
    if kind == "plain":
        norm = acc.unwrap_model(model).blocks[0].norm
        norm.register_forward_pre_hook(lambda _, args: shapes.append(_local_shape(args[0])))
    result: dict[str, Any] = {
        "ranks": {
            "tp": acc.tensor_parallel_rank,
            "dp_shard": acc.data_parallel_shard_rank,
            "dp_replicate": acc.data_parallel_rank,
            "cp": acc.context_parallel_rank,
            "pp": acc.pipeline_parallel_rank,
        },
        "length": len(loader),
        "type": acc.distributed_type.value,
        "mesh": tuple(acc.torch_device_mesh.mesh_dim_names) if acc.torch_device_mesh else None,
    }
    if options.get("log_with"):
        acc.init_trackers("tp")
    done = 0
    if resume:
        assert folder is not None
        acc.load_state(folder)
        done = acc.step
        result["loaded"] = _full(acc, model)
        result["optimizer_steps"] = sorted({int(s["step"]) for s in optimizer.state.values()})
    batches, losses, norms, seen = [], [], [], []
    while done < steps:
        for batch in loader:
            with acc.accumulate(model):
                loss = _loss(kind, model, batch)
                acc.backward(loss)
                if acc.sync_gradients:
                    norms.append(acc.clip_grad_norm_(model.parameters(), 1.0).item())
                optimizer.step()
                optimizer.zero_grad()
            seen.append(batch[-1].tolist())
            batches.append(acc.gather(batch[-1]))
            losses.append(acc.reduce(loss.detach(), "mean").item())
            if acc.sync_gradients:
                done += 1
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
        seen=seen,
        full=_full(acc, model),
    )
    result["norm_input"] = shapes[0] if shapes else None
    monitors = [c for c in acc.callbacks.callbacks if isinstance(c, GradientNormMonitor)]
    result["monitored_norm"] = monitors[0].last_norm if monitors else None
    if kind == "plain":
        with torch.no_grad():
            result["output_dtype"] = str(model(_data(kind).tensors[0][:2]).dtype)
    if options.get("log_with"):
        acc.end_training()
    if evaluate:
        result.update(_evaluate(acc, model))
    if export is not None:
        acc.save_model(model, export)
        if acc.is_main_process:
            acc.unwrap_model(model).config.save_pretrained(export)
    return result


def _evaluate(acc: Accelerator, model: nn.Module) -> dict[str, Any]:
    """An uneven evaluation set (39 samples): every sample counted exactly once. (With
    even_batches=False every data-parallel process still gets a last batch: 39 = 4 x 8 + 7.)"""
    data = TensorDataset(torch.randn(EVAL, 4, 6), torch.arange(EVAL))
    loader = acc.prepare(DataLoader(data, batch_size=2))
    indices, outputs = [], []
    with torch.no_grad():
        for x, index in loader:
            if acc.even_batches:  # otherwise processes run different numbers of forwards
                outputs.append(acc.gather_for_metrics(model(x)))
            indices.append(acc.gather_for_metrics(index))
    processes = acc.reduce(torch.ones(()), "sum")
    return {
        "evaluated": torch.cat(indices).tolist(),
        "outputs": torch.cat(outputs).shape[0] if outputs else None,
        "data_parallel_processes": processes.item(),
    }


def _reference(kind: str, batches: list[list[int]], accumulation: int = 1) -> dict[str, Any]:
    """One process, the same model and optimizer, the same global batches."""
    data = _data(kind)
    model = _model(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
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


def _check_against_reference(result: dict[str, Any], kind: str, tolerance: float) -> None:
    reference = _reference(kind, result["batches"])
    assert len(result["losses"]) == len(reference["losses"]) > 0
    for ours, theirs in zip(result["losses"], reference["losses"], strict=True):
        assert abs(ours - theirs) <= tolerance, (result["losses"], reference["losses"])
    for ours, theirs in zip(result["norms"], reference["norms"], strict=True):
        assert abs(ours - theirs) <= tolerance * max(1.0, theirs)
    assert _max_difference(result["full"], reference["full"]) <= tolerance


def _check_data_parallel_coordinates(
    results: list[dict[str, Any]], tp: int, dp: int, split_batches: bool = False
) -> None:
    """Processes of one TP group read the same samples; data-parallel shards are disjoint."""
    global_batch = 2 if split_batches else 2 * dp
    for rank, result in enumerate(results):
        assert result["length"] == SAMPLES // global_batch
        assert result["seen"] == results[rank - rank % tp]["seen"], "TP peers see one batch"
    shards = [results[r]["seen"] for r in range(0, len(results), tp)]
    for step in range(len(shards[0])):
        indices = [i for shard in shards for i in shard[step]]
        assert len(set(indices)) == len(indices) == global_batch
    assert all(len(batch) == global_batch for batch in results[0]["batches"])


UNEVEN = {"even_batches": False}
SPLIT = {"split_batches": True}


def _resume(folder: str) -> dict[str, Any]:
    return {"folder": folder, "resume": True}


# -- tp2 x dp_shard2 on a plain module with a user plan -------------------------------------


@pytest.mark.slow
def test_tensor_parallel_inside_fsdp_matches_one_process_and_resumes_bitwise(tmp_path):
    folder = str(tmp_path / "ckpt")
    results = run_distributed(
        _train,
        "tp2xdp2",
        "plain",
        6,
        kwargs={"save_at": 4, "folder": folder, "evaluate": True},
        world_size=4,
        timeout=240,
    )
    first = results[0]
    assert first["type"] == "FSDP" and first["mesh"] == ("dp_replicate", "dp_shard", "tp")
    for result in results:  # metrics see every evaluation sample once, on every process
        assert result["evaluated"] == list(range(EVAL)) and result["outputs"] == EVAL
        assert result["data_parallel_processes"] == 2, "reduce() runs over the dp group"
    assert [r["ranks"]["tp"] for r in results] == [0, 1, 0, 1]
    assert [r["ranks"]["dp_shard"] for r in results] == [0, 0, 1, 1]
    assert all(r["ranks"]["dp_replicate"] == r["ranks"]["cp"] == 0 for r in results)
    _check_data_parallel_coordinates(results, tp=2, dp=2)
    _check_against_reference(first, "plain", 1e-5)
    assert first["norm_input"] == (2, 4, 16), "without sequence parallelism: whole sequences"
    # One writer per process for model and optimizer, no gathered copy.
    listing = os.listdir(folder)
    assert "pytorch_model_fsdp_0" in listing and "model.safetensors" not in listing
    assert len([n for n in os.listdir(os.path.join(folder, "pytorch_model_fsdp_0"))]) == 5
    merged = tmp_path / "merged"
    outcome = run_cli("merge-weights", folder, str(merged))
    assert outcome.returncode == 0, outcome.stderr
    assert _bitwise_equal(load_weights(str(merged)), first["saved"])

    resumed = run_distributed(
        _train, "tp2xdp2", "plain", 6, kwargs=_resume(folder), world_size=4, timeout=240
    )[0]
    assert _bitwise_equal(resumed["loaded"], first["saved"])
    assert resumed["optimizer_steps"] == [4]
    assert resumed["losses"] == first["losses"][4:], "the same batches and losses after resume"
    assert _bitwise_equal(resumed["full"], first["full"]), "resume is bitwise exact"

    # Another layout reads the same checkpoint: FSDP over 4 processes (no TP) ...
    resharded = run_distributed(
        _train, "dp4", "plain", 4, kwargs=_resume(folder), world_size=4, timeout=240
    )[0]
    assert _bitwise_equal(resharded["loaded"], first["saved"])
    assert resharded["optimizer_steps"] == [4]
    # ... and one plain process without any parallel layout.
    alone = run_distributed(
        _train, "single", "plain", 4, kwargs=_resume(folder), world_size=1, timeout=240
    )[0]
    assert alone["type"] == "NO" and alone["mesh"] is None
    assert _bitwise_equal(alone["loaded"], first["saved"])
    assert alone["optimizer_steps"] == [4]


# -- HSDP: dp_replicate2 x dp_shard2 ---------------------------------------------------------


def test_hybrid_sharding_matches_one_process_and_resumes_bitwise(tmp_path):
    folder = str(tmp_path / "ckpt")
    results = run_distributed(
        _train,
        "hsdp",
        "plain",
        5,
        kwargs={"save_at": 3, "folder": folder, "evaluate": True, "options": UNEVEN},
        world_size=4,
        timeout=240,
    )
    first = results[0]
    for result in results:  # exact metrics without completing the last batch, too
        assert result["evaluated"] == list(range(EVAL))
    assert [r["ranks"]["dp_replicate"] for r in results] == [0, 0, 1, 1]
    assert [r["ranks"]["dp_shard"] for r in results] == [0, 1, 0, 1]
    _check_data_parallel_coordinates(results, tp=1, dp=4)
    _check_against_reference(first, "plain", 1e-5)
    resumed = run_distributed(
        _train,
        "hsdp",
        "plain",
        5,
        kwargs={**_resume(folder), "options": UNEVEN},
        world_size=4,
        timeout=240,
    )[0]
    assert _bitwise_equal(resumed["full"], first["full"])
    # On half the processes (an elastic job that lost a machine) and under tensor parallelism.
    smaller = run_distributed(
        _train, "tp2", "plain", 3, kwargs={**_resume(folder), "options": UNEVEN}, world_size=2
    )[0]
    assert _bitwise_equal(smaller["loaded"], first["saved"])
    assert smaller["optimizer_steps"] == [3]


# -- a tiny transformers Llama with its own plan ---------------------------------------------


@pytest.mark.slow
def test_llama_with_its_own_plan_and_tied_embeddings(tmp_path):
    export, folder = str(tmp_path / "export"), str(tmp_path / "ckpt")
    trained = {"export": export, "save_at": 2, "folder": folder, "options": SPLIT}
    results = run_distributed(
        _train, "tp2xdp2", "llama", 4, kwargs=trained, world_size=4, timeout=240
    )
    first = results[0]
    _check_data_parallel_coordinates(results, tp=2, dp=2, split_batches=True)
    _check_against_reference(first, "llama", 1e-5)
    reloaded = transformers.LlamaForCausalLM.from_pretrained(export)
    assert reloaded.lm_head.weight is reloaded.model.embed_tokens.weight
    assert _bitwise_equal(reloaded.state_dict(), first["full"])

    resumed = run_distributed(
        _train,
        "tp2xdp2",
        "llama",
        4,
        kwargs={**_resume(folder), "options": SPLIT},
        world_size=4,
        timeout=240,
    )[0]
    assert _bitwise_equal(resumed["full"], first["full"]), "resume is bitwise exact"
    alone = run_distributed(
        _train,
        "single",
        "llama",
        2,
        kwargs={**_resume(folder), "options": SPLIT},
        world_size=1,
        timeout=240,
    )[0]
    assert _bitwise_equal(alone["loaded"], first["saved"])


def test_llama_under_hybrid_sharding(tmp_path):
    results = run_distributed(_train, "hsdp", "llama", 4, world_size=4, timeout=240)
    _check_against_reference(results[0], "llama", 1e-5)


# -- two processes: sequence parallelism, accumulation, bf16 --------------------------------


def test_sequence_parallel_plan_matches_one_process():
    results = run_distributed(_train, "tp2-sp", "plain", 4, world_size=2, timeout=180)
    assert results[0]["seen"] == results[1]["seen"]
    # Between the TP regions each process holds half of the sequence (4 positions).
    assert results[0]["norm_input"] == (2, 2, 16)
    _check_against_reference(results[0], "plain", 1e-5)


def test_replicas_only_train_like_ddp():
    results = run_distributed(_train, "replicas", "plain", 3, world_size=2, timeout=180)
    assert results[0]["type"] == "MULTI_CPU"
    _check_data_parallel_coordinates(results, tp=1, dp=2)
    _check_against_reference(results[0], "plain", 1e-5)


def test_accumulation_under_tensor_parallelism():
    options = {"gradient_accumulation_steps": 2}
    result = run_distributed(
        _train, "tp2", "plain", 3, kwargs={"options": options}, world_size=2, timeout=180
    )[0]
    reference = _reference("plain", result["batches"], accumulation=2)
    assert len(result["norms"]) == 3
    assert max(abs(a - b) for a, b in zip(result["norms"], reference["norms"], strict=True)) < 1e-5
    assert _max_difference(result["full"], reference["full"]) < 1e-5


@pytest.mark.slow
def test_mixed_precision_compile_callbacks_and_trackers_keep_working(tmp_path):
    options = {
        "mixed_precision": "bf16",
        "dynamo_backend": "aot_eager",
        "callbacks": [GradientNormMonitor()],
        "log_with": "csv",
        "project_dir": str(tmp_path),
    }
    result = run_distributed(
        _train, "tp2", "plain", 3, kwargs={"options": options}, world_size=2, timeout=240
    )[0]
    reference = _reference("plain", result["batches"])
    assert result["output_dtype"] == "torch.float32", "outputs are cast back to fp32"
    assert result["losses"] != reference["losses"], "bf16 compute differs from fp32 ..."
    assert (
        max(abs(a - b) for a, b in zip(result["losses"], reference["losses"], strict=True)) < 2e-2
    )
    assert _max_difference(result["full"], reference["full"]) < 2e-2, "... but trains alike"
    # The monitor sees the gradients just before the step: after clipping to 1.0.
    assert result["monitored_norm"] == pytest.approx(min(1.0, result["norms"][-1]), rel=1e-5)
    rows = (tmp_path / "tp" / "metrics.csv").read_text().splitlines()
    assert rows[0].split(",") == ["step", "grad_norm"] and len(rows) == 4


# -- errors: the same clear message on every process ----------------------------------------


def _attempt(build: Any) -> str:
    try:
        build()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


class TiedNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))


def _errors() -> dict[str, str]:
    from slipstream import DeepSpeedPlugin

    def tp2(plan: Any = None) -> Accelerator:
        return Accelerator(parallelism_config=ParallelismConfig(tp_size=2, tp_plan=plan))

    return {
        "sizes": _attempt(
            lambda: Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2, tp_size=2))
        ),
        "deepspeed": _attempt(
            lambda: Accelerator(
                parallelism_config=ParallelismConfig(tp_size=2),
                deepspeed_plugin=DeepSpeedPlugin(zero_stage=2, gradient_clipping=1.0),
            )
        ),
        "pipeline": _attempt(
            lambda: Accelerator(
                parallelism_config=ParallelismConfig(pp_size=2, pp_stages_per_rank=2)
            )
        ),
        "context": _attempt(lambda: Accelerator(parallelism_config=ParallelismConfig(cp_size=2))),
        "no plan": _attempt(lambda: tp2().prepare(Net())),
        "features": _attempt(lambda: tp2({"0": "colwise"}).prepare(nn.Sequential(nn.Linear(4, 3)))),
        "heads": _attempt(lambda: tp2().prepare(_llama(tied=False).__class__(_heads_config()))),
        "tied": _attempt(lambda: tp2({"head": "colwise"}).prepare(TiedNet())),
        "second layout": _attempt(
            lambda: Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=2))
        ),
    }


def _heads_config() -> Any:
    return transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=1,
    )


def test_layout_and_plan_errors_are_clear_and_the_same_on_every_process():
    first, second = run_distributed(_errors, world_size=2, timeout=180)
    assert first == second
    expected = {
        "sizes": "multiply to dp_shard_size=2 x tp_size=2 = 4 but the job has 2 process(es)",
        "deepspeed": "DeepSpeed cannot be combined with a parallel layout (tp=2)",
        "pipeline": "pp_schedule='1f1b' runs one stage per process",
        "context": "torch provides for CUDA devices only; this process runs on cpu",
        "no plan": "Net has no tensor-parallel plan",
        "features": "tp_size=2 does not divide the 3 output features of 0",
        "heads": "tp_size=2 does not divide num_key_value_heads=1",
        "tied": "embed.weight and head.weight are one tied weight",
        "second layout": "already arranged as tp=2",
    }
    for case, text in expected.items():
        assert first[case].startswith("ParallelismConfigError") and text in first[case], (
            case,
            first[case],
        )
