"""DeepSpeed ZeRO 1/2/3 on 2 CPU processes (DeepSpeed's CPU accelerator over gloo)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pytest.importorskip("deepspeed")

from slipstream import Accelerator, DeepSpeedPlugin, DummyOptim, DummyScheduler, set_seed
from slipstream.checkpoint import load_weights
from slipstream.strategies.deepspeed_plugin import DeepSpeedConfigError
from tests.distributed import run_cli, run_distributed, run_python

SAMPLES = 32


def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(
        torch.randn(SAMPLES, 6, generator=generator),
        torch.randn(SAMPLES, 1, generator=generator),
        torch.arange(SAMPLES),
    )


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))


def _parity(stage: int, precision: str, accumulation: int, offload: bool) -> dict:
    plugin = DeepSpeedPlugin(
        zero_stage=stage,
        offload_optimizer_device="cpu" if offload else "none",
        zero3_save_16bit_model=True,
    )
    acc = Accelerator(
        deepspeed_plugin=plugin, mixed_precision=precision, gradient_accumulation_steps=accumulation
    )
    set_seed(0)
    model = _model()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(_data(), batch_size=2, shuffle=True)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    cycles, current, losses = [], [], []
    for x, y, index in loader:
        with acc.accumulate(model):
            loss = F.mse_loss(model(x), y)
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
        current.append(acc.gather(index))
        if acc.sync_gradients:
            cycles.append(torch.cat(current))
            current = []
    data = _data()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    for indices in cycles:
        ref_opt.zero_grad()
        F.mse_loss(reference(data.tensors[0][indices]), data.tensors[1][indices]).backward()
        ref_opt.step()
    full = acc.get_state_dict(model)
    expected = reference.state_dict()
    return {
        "type": acc.distributed_type.value,
        "steps": acc.step,
        "max_diff": max((full[k].float() - expected[k]).abs().max().item() for k in expected)
        if full
        else None,
        "first": losses[0],
        "last": sum(losses[-4:]) / 4,
    }


@pytest.mark.slow
@pytest.mark.parametrize(
    "stage,accumulation,offload",
    [(1, 1, False), (2, 2, True), (3, 1, False), (3, 2, False)],
    ids=["zero1", "zero2-accumulate-offload", "zero3", "zero3-accumulate"],
)
def test_zero_stages_match_a_single_process_big_batch(stage, accumulation, offload):
    r0, r1 = run_distributed(_parity, stage, "no", accumulation, offload, timeout=240)
    assert r0["type"] == "DEEPSPEED"
    assert r0["steps"] == SAMPLES // (2 * 2 * accumulation)
    assert r0["max_diff"] < 1e-5
    if stage == 3:
        assert r1["max_diff"] is None, "consolidated weights live on the main process"


@pytest.mark.slow
def test_bf16_zero3_trains_like_fp32():
    r0, _ = run_distributed(_parity, 3, "bf16", 1, False, timeout=240)
    assert r0["steps"] == SAMPLES // 4
    assert r0["max_diff"] < 0.05, "bf16 weights stay close to the fp32 reference"


def _save_resume(folder: str, phase: str) -> dict:
    plugin = DeepSpeedPlugin(zero_stage=3, zero3_save_16bit_model=True)
    acc = Accelerator(deepspeed_plugin=plugin)
    set_seed(0)
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(_data(), batch_size=2, shuffle=True)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    if phase == "resume":
        acc.load_state(folder)
    for x, y, _ in loader:
        acc.backward(F.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        if phase == "save" and acc.step == 3:
            acc.save_state(folder)
            acc.save_model(model, folder + "-weights")
    full = acc.get_state_dict(model)
    outputs = model(torch.ones(3, 6)).detach()
    return {"full": {k: v.clone() for k, v in full.items()}, "outputs": outputs, "steps": acc.step}


def _resume_on_one(folder: str) -> str:
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3))
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = DataLoader(_data(), batch_size=2, shuffle=True)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    try:
        acc.load_state(folder)
    except Exception as error:
        return str(error)
    return "loaded"


@pytest.mark.slow
def test_save_state_resumes_identically_and_weights_consolidate(tmp_path):
    folder = str(tmp_path / "ckpt")
    straight = run_distributed(_save_resume, folder, "save", timeout=240)[0]
    assert {"pytorch_model", "latest", "checkpoint.json"} <= set(os.listdir(folder))
    resumed = run_distributed(_save_resume, folder, "resume", timeout=240)[0]
    assert resumed["steps"] == straight["steps"]
    assert all(torch.equal(resumed["full"][k], straight["full"][k]) for k in straight["full"])
    # The 16-bit consolidated save loads into a plain module and reproduces the outputs.
    saved = load_weights(folder + "-weights")
    plain = _model()
    plain.load_state_dict(saved)
    assert saved.keys() == straight["full"].keys()
    merged = tmp_path / "merged"
    result = run_cli("merge-weights", folder, str(merged))
    assert result.returncode == 0, result.stderr
    fp32 = load_weights(str(merged))
    assert fp32.keys() == saved.keys()
    assert all(torch.equal(fp32[k], saved[k]) for k in saved), "merge-weights == get_state_dict"
    # A ZeRO checkpoint loads only on the number of processes that saved it: said clearly.
    message = run_distributed(_resume_on_one, folder, world_size=1, timeout=240)[0]
    assert "was saved by 2 processes" in message and "this job has 1" in message


def _saved_outputs(folder: str) -> torch.Tensor:
    plugin = DeepSpeedPlugin(zero_stage=3, zero3_save_16bit_model=True)
    acc = Accelerator(deepspeed_plugin=plugin, mixed_precision="bf16")
    set_seed(0)
    model = _model()
    model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.save_model(model, folder, dtype=torch.bfloat16)
    return model(torch.ones(3, 6)).detach()


@pytest.mark.slow
def test_16bit_consolidated_weights_reproduce_the_engine_outputs(tmp_path):
    engine_outputs = run_distributed(_saved_outputs, str(tmp_path / "w"), timeout=240)[0]
    weights = load_weights(str(tmp_path / "w"))
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    plain = _model().to(torch.bfloat16)
    plain.load_state_dict(weights)
    outputs = plain(torch.ones(3, 6, dtype=torch.bfloat16)).float()
    assert torch.allclose(outputs, engine_outputs, atol=1e-2)


def _json_config(path: str) -> dict:
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=path))
    set_seed(0)
    model = _model()
    optimizer = DummyOptim(model.parameters(), lr=0.05)
    scheduler = DummyScheduler(optimizer, total_num_steps=100, warmup_num_steps=4)
    loader = DataLoader(_data(), batch_size=4)
    model, optimizer, loader, scheduler = acc.prepare(model, optimizer, loader, scheduler)
    lrs = []
    for x, y, _ in loader:
        acc.backward(F.mse_loss(model(x), y))
        optimizer.step()
        scheduler.step()
        lrs.append(scheduler.get_last_lr()[0])
    engine = acc.strategy.engine
    return {
        "lrs": lrs,
        "micro": engine.train_micro_batch_size_per_gpu(),
        "config": acc.strategy.config,
    }


@pytest.mark.slow
def test_auto_values_and_placeholders_with_a_deepspeed_json(tmp_path):
    config = {
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        # torch_adam: torch's AdamW (DeepSpeed's FusedAdam is compiled on first use, ~40 s).
        "optimizer": {
            "type": "AdamW",
            "params": {"lr": "auto", "weight_decay": 0.0, "torch_adam": True},
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": 0, "warmup_max_lr": "auto", "warmup_num_steps": "auto"},
        },
        "zero_optimization": {"stage": 2},
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config).replace('"warmup_max_lr": "auto"', '"warmup_max_lr": 0.05'))
    r0 = run_distributed(_json_config, str(path), timeout=240)[0]
    assert r0["micro"] == 4 and r0["config"]["train_batch_size"] == 8
    assert r0["config"]["optimizer"]["params"]["lr"] == 0.05
    assert r0["config"]["gradient_clipping"] == 0.0, "clipping is always set explicitly"
    assert r0["lrs"][0] < r0["lrs"][3] <= 0.05, "the engine steps the warm-up schedule"


def _bad(case: str) -> str:
    try:
        if case == "both-optimizers":
            plugin = DeepSpeedPlugin(hf_ds_config={"optimizer": {"type": "AdamW", "params": {}}})
            acc = Accelerator(deepspeed_plugin=plugin)
            model = _model()
            acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        elif case == "batch-arithmetic":
            plugin = DeepSpeedPlugin(
                hf_ds_config={"train_batch_size": 7, "zero_optimization": {"stage": 1}}
            )
            acc = Accelerator(deepspeed_plugin=plugin)
            model = _model()
            acc.prepare(
                model,
                torch.optim.SGD(model.parameters(), lr=0.1),
                DataLoader(_data(), batch_size=2),
            )
        elif case == "no-16bit":
            acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3))
            model = _model()
            model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
            acc.get_state_dict(model)
        elif case == "two-models":
            acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=1))
            acc.prepare(_model(), _model())
    except (DeepSpeedConfigError, ValueError) as error:
        return str(error)
    return "no error"


@pytest.mark.parametrize(
    "case,message",
    [
        ("both-optimizers", 'the DeepSpeed config defines "optimizer" and prepare() got a SGD'),
        ("batch-arithmetic", "train_batch_size (7) must equal train_micro_batch_size_per_gpu (2)"),
        ("no-16bit", "set zero3_save_16bit_model: true"),
        ("two-models", "DeepSpeed trains one model per Accelerator"),
    ],
)
def test_bad_input_names_the_key(case, message):
    assert message in run_distributed(_bad, case, timeout=240)[0]


def test_plugin_validation_and_config_block():
    with pytest.raises(DeepSpeedConfigError, match="zero_stage must be 0, 1, 2 or 3"):
        DeepSpeedPlugin(zero_stage=4)
    with pytest.raises(
        DeepSpeedConfigError, match="offload_param_device must be none, cpu or nvme"
    ):
        DeepSpeedPlugin(offload_param_device="gpu")
    plugin = DeepSpeedPlugin.from_config(
        {
            "zero_stage": 3,
            "offload_optimizer_device": "cpu",
            "zero3_save_16bit_model": "true",
            "gradient_clipping": 1.0,
            "deepspeed_multinode_launcher": "standard",
        }
    )
    assert plugin.zero3_save_16bit_model and plugin.gradient_clipping == 1.0


def test_plugin_holds_a_config_object_and_describes_short_options_as_json():
    class HeldConfig:  # as transformers' HfTrainerDeepSpeedConfig holds its JSON
        def __init__(self, config: dict) -> None:
            self.config = config

    held = HeldConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 4})
    plugin = DeepSpeedPlugin(hf_ds_config=held)
    assert plugin.hf_ds_config is held and plugin.zero_stage == 3
    held.config["gradient_accumulation_steps"] = 2  # filled in after the plugin was made
    config = plugin.build_config(
        micro_batch_size=None, gradient_accumulation_steps=1, world_size=2, mixed_precision="no"
    )
    assert (config["gradient_accumulation_steps"], config["train_batch_size"]) == (2, 16)
    assert plugin.json_config() is held.config
    short = DeepSpeedPlugin(zero_stage=3, offload_param_device="cpu", zero3_save_16bit_model=True)
    assert short.deepspeed_config is None
    assert short.json_config() == {
        "train_micro_batch_size_per_gpu": "auto",
        "train_batch_size": "auto",
        "gradient_clipping": "auto",
        "gradient_accumulation_steps": "auto",
        "zero_optimization": {
            "stage": 3,
            "offload_param": {"device": "cpu", "pin_memory": False},
            "stage3_gather_16bit_weights_on_model_save": True,
        },
    }
    clipped = DeepSpeedPlugin(gradient_clipping=0.5, gradient_accumulation_steps=4).json_config()
    assert (clipped["gradient_clipping"], clipped["gradient_accumulation_steps"]) == (0.5, 4)
    with pytest.raises(DeepSpeedConfigError, match="hf_ds_config takes a DeepSpeed JSON path"):
        DeepSpeedPlugin(hf_ds_config=42)


def test_missing_deepspeed_is_a_clear_error():
    code = (
        "import sys; sys.modules['deepspeed'] = None\n"
        "from slipstream import Accelerator, DeepSpeedPlugin\n"
        "Accelerator(deepspeed_plugin=DeepSpeedPlugin())\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0 and "DeepSpeed is not installed" in result.stderr
    assert "--no-build-isolation" in result.stderr


def _zero_init() -> dict:
    acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3, zero3_init_flag=True))
    with acc.model_init_context():
        model = nn.Linear(64, 64)
    return {"local": model.weight.numel(), "full": getattr(model.weight, "ds_numel", None)}


@pytest.mark.slow
def test_zero3_init_never_materialises_the_whole_model():
    r0 = run_distributed(_zero_init, timeout=240)[0]
    assert r0["full"] == 64 * 64 and r0["local"] < r0["full"]


@pytest.mark.slow
def test_one_process_started_by_plain_python():
    code = (
        "import torch\n"
        "from slipstream import Accelerator, DeepSpeedPlugin\n"
        "acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=2, gradient_clipping=1.0))\n"
        "model = torch.nn.Linear(4, 1)\n"
        "model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))\n"
        "acc.backward(model(torch.randn(2, 4)).sum())\n"
        "opt.step()\n"
        "print('trained', acc.distributed_type.value)\n"
    )
    result = run_python("-c", code, timeout=240)
    assert result.returncode == 0, result.stderr
    assert "trained DEEPSPEED" in result.stdout
