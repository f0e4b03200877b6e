"""The checks of ``gpu_check.py``: one function each, run in a worker process.

A check takes the :class:`Context` and returns a :class:`Result` (a one-line detail and
metrics for the JSON report), raises :class:`Skip` with the reason when it does not apply
here, and fails by raising anything else. Checks run on ``cuda:0`` when CUDA is present and
on the CPU otherwise, except those that only mean something on a GPU (fp8, CUDA memory
figures, NCCL), which SKIP without CUDA. Every comparison is against plain PyTorch doing the
same work on the same device.

``gpu_check.CHECKS`` lists them (check ``NAME`` is the function ``check_NAME`` here) in
running order, with their time budgets and the groups that share a worker process.
"""

from __future__ import annotations

import contextlib
import copy
import gc
import importlib.metadata
import importlib.util
import io
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
#: Printed by rank 0 of a multi-process check, one line per scenario.
RANK_PREFIX = "@@gpu_check_rank "
#: Packages whose versions the report records (none is installed by the check).
PACKAGES = ("deepspeed", "torchao", "transformers", "accelerate", "triton", "pytest")
#: estimate-memory's figures against the measured peak: the estimate leaves out activations
#: and the optimizer's temporaries, so the measured peak is somewhat above it; outside
#: these bounds the estimate (or a strategy's memory use) is wrong.
MEMORY_RATIO_BOUNDS = (0.8, 2.0)


M = TypeVar("M", bound=nn.Module)


class Skip(Exception):
    """The check does not apply on this machine; the message says why."""


@dataclass
class Result:
    detail: str
    metrics: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Context:
    quick: bool
    scratch: Path

    @property
    def cuda(self) -> bool:
        return torch.cuda.is_available()

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", 0) if self.cuda else torch.device("cpu")

    @property
    def gpus(self) -> int:
        return torch.cuda.device_count() if self.cuda else 0

    def require_cuda(self, what: str) -> None:
        if not self.cuda:
            raise Skip(f"needs CUDA ({what}); this machine has none")


# -- machine and process helpers ---------------------------------------------------------------
def machine_info() -> dict[str, Any]:
    """What the report says about the machine (reads no GPU memory)."""
    gpus = []
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            properties = torch.cuda.get_device_properties(index)
            gpus.append(
                {
                    "name": properties.name,
                    "capability": f"{properties.major}.{properties.minor}",
                    "memory_gib": properties.total_memory / 2**30,
                }
            )
    nccl = None
    with contextlib.suppress(Exception):
        version = torch.cuda.nccl.version() if torch.cuda.is_available() else None
        nccl = ".".join(map(str, version)) if isinstance(version, tuple) else version
    spec = importlib.util.find_spec("slipstream")
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda if torch.cuda.is_available() else None,
        "nccl": nccl,
        "gpus": gpus,
        "packages": {name: _version(name) for name in PACKAGES},
        "slipstream_from": str(Path(spec.origin).parent) if spec and spec.origin else None,
    }


def describe(machine: Mapping[str, Any]) -> str:
    gpus = machine["gpus"]
    if gpus:
        names = sorted({g["name"] for g in gpus})
        where = f"{len(gpus)} GPU(s): {', '.join(names)} (cc {gpus[0]['capability']})"
        where += f", CUDA {machine['cuda']}, NCCL {machine['nccl']}"
    else:
        where = "no CUDA: the CUDA-only checks SKIP, the others run on the CPU"
    packages = ", ".join(f"{k} {v or '-'}" for k, v in machine["packages"].items())
    return f"torch {machine['torch']}, {where}; {machine['cpus']} CPUs; {packages}"


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def stop_when_orphaned() -> None:
    """Exit when the parent goes away (killed from outside): a worker must not keep a GPU
    busy, or a launcher's processes alive, after the run that started it has ended."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="gpu-check-parent-watch", daemon=True).start()


def fresh_state() -> None:
    """Forget the previous check's Accelerator and free what it held (the process group of
    one process stays: every check on this device uses the same backend)."""
    from slipstream.runtime.state import set_current_state

    set_current_state(None)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def run_command(
    command: list[str], timeout: float, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``command``; past ``timeout`` stop it with SIGTERM (torchrun then stops its
    workers; a SIGKILL would leave them running) and raise."""
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        cwd=REPO,
        env=dict(env) if env is not None else None,
    )
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGTERM)
        try:
            output, _ = process.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            output, _ = process.communicate()
        print(output[-4000:])
        raise AssertionError(
            f"{' '.join(command[:4])} ... did not finish in {timeout:.0f} s"
        ) from None
    return subprocess.CompletedProcess(command, process.returncode, output, "")


def _tail(text: str, lines: int = 12) -> str:
    return "\n".join(text.strip().splitlines()[-lines:])


# -- models and data ---------------------------------------------------------------------------
def mlp(width: int = 16, hidden: int = 32, out: int = 4, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, hidden), nn.Tanh(), nn.Linear(hidden, out))


class TwoLayer(nn.Module):
    """``up`` (column-wise) then ``down`` (row-wise): the smallest tensor-parallel block."""

    def __init__(self, width: int = 16, hidden: int = 32, out: int = 4, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


TP_PLAN = {"up": "colwise", "down": "rowwise"}


def dataset(samples: int = 32, width: int = 16, out: int = 4, seed: int = 1) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(samples, width, generator=generator),
        torch.randn(samples, out, generator=generator),
        torch.arange(samples),
    )


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def max_difference(got: Mapping[str, Any], expected: Mapping[str, Any]) -> float:
    """Largest absolute difference between two state dicts (same names required)."""
    assert set(got) == set(expected), f"names differ: {sorted(set(got) ^ set(expected))}"
    return max(
        (_local(got[k]).float().cpu() - _local(expected[k]).float().cpu()).abs().max().item()
        for k in expected
    )


def _local(tensor: Any) -> torch.Tensor:
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor.detach()


def train_reference(
    model: M,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    optimizer: Callable[[Any], torch.optim.Optimizer],
    device: torch.device,
) -> M:
    """Plain PyTorch: the same steps on one device, the reference every check compares with."""
    model = model.to(device)
    opt = optimizer(model.parameters())
    for x, y in batches:
        opt.zero_grad()
        F.mse_loss(model(x.to(device)), y.to(device)).backward()
        opt.step()
    return model


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def same_result(difference: float, ctx: Context) -> tuple[bool, str]:
    """Whether two runs of the same steps agree, and how to say it: bitwise on the CPU; on
    a GPU within 1e-6, since cuBLAS promises identical results for identical calls only
    under CUBLAS_WORKSPACE_CONFIG (a wrong RNG state or batch differs by far more)."""
    if difference == 0.0:
        return True, "bitwise"
    return ctx.cuda and difference <= 1e-6, f"within {difference:.1e}"


def _has_deepspeed() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


@contextlib.contextmanager
def launched_alone() -> Iterator[dict[str, Any]]:
    """The variable a launcher (torchrun, ``slipstream launch -n 1``) sets and DeepSpeed
    insists on: ``deepspeed.initialize`` asserts that LOCAL_RANK exists even for one
    process. Yields whether it had to be set, for the report."""
    missing = "LOCAL_RANK" not in os.environ
    if missing:
        os.environ["LOCAL_RANK"] = "0"
    try:
        yield {"local_rank_set_by_check": missing}
    finally:
        if missing:
            os.environ.pop("LOCAL_RANK", None)


def _require_deepspeed() -> None:
    if not _has_deepspeed():
        raise Skip(
            "DeepSpeed is not installed (a declared extra: pip install --no-build-isolation "
            "'slipstream[deepspeed]')"
        )


# -- the checks ----------------------------------------------------------------------------------
def check_environment(ctx: Context) -> Result:
    import slipstream

    location = Path(slipstream.__file__).resolve().parent
    assert location == REPO / "core", (
        f"slipstream is imported from {location}, not from this checkout's core/: install it "
        "with pip install -e . or uninstall the other copy"
    )
    info = machine_info()
    if ctx.cuda:
        # One real allocation and kernel: a GPU that is listed but cannot compute fails here
        # with a clear cause instead of in every later check.
        ones = torch.ones(1 << 20, device=ctx.device)
        assert ones.sum().item() == 1 << 20
    return Result(describe(info), info)


def check_device_placement(ctx: Context) -> Result:
    from slipstream import Accelerator, DistributedType, send_to_device
    from slipstream.runtime.state import set_current_state

    acc = Accelerator()
    expected = ctx.device
    assert acc.device == expected, f"Accelerator() chose {acc.device}, expected {expected}"
    assert acc.num_processes == 1 and acc.distributed_type == DistributedType.NO
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    loader = DataLoader(dataset(), batch_size=8)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    for x, y, index in loader:
        assert {x.device, y.device, index.device} == {expected}, "batches are moved to the device"
        out = model(x)
        assert out.device == expected
        optimizer.zero_grad()
        acc.backward(F.mse_loss(out, y))
        optimizer.step()
    assert all(p.device == expected for p in model.parameters())
    states = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    assert states and all(t.device == expected for t in states), "optimizer state on the device"
    nested = send_to_device({"a": [torch.ones(2)], "b": (torch.zeros(1), "text")}, acc.device)
    assert nested["a"][0].device == expected and nested["b"][0].device == expected
    gathered = acc.gather(torch.tensor([3.0], device=acc.device))
    assert gathered.tolist() == [3.0] and gathered.device == expected
    set_current_state(None)
    assert Accelerator(cpu=True).device == torch.device("cpu"), "cpu=True chooses the CPU"
    name = f" ({torch.cuda.get_device_name(expected)})" if ctx.cuda else " (no CUDA here)"
    return Result(
        f"Accelerator() chose {expected}{name}; model, optimizer state, batches, outputs and "
        "gathers there; cpu=True chooses the CPU",
        {"device": str(expected)},
    )


def check_bf16_autocast(ctx: Context) -> Result:
    from slipstream import Accelerator

    acc = Accelerator(mixed_precision="bf16")
    model = mlp()
    reference = copy.deepcopy(model)
    seen: list[torch.dtype] = []
    model[0].register_forward_hook(lambda module, inputs, output: seen.append(output.dtype))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    x, y, _ = (t.to(ctx.device) for t in dataset().tensors)
    for _ in range(3):
        optimizer.zero_grad()
        out = model(x)
        acc.backward(F.mse_loss(out, y))
        optimizer.step()
    assert seen and set(seen) == {torch.bfloat16}, f"matmuls ran in {set(seen)}, not bfloat16"
    assert out.dtype == torch.float32, "outputs are converted back to float32"
    assert all(p.dtype == torch.float32 for p in model.parameters()), "weights stay float32"
    reference = train_reference(
        reference, [(x, y)] * 3, lambda p: torch.optim.SGD(p, lr=0.1), ctx.device
    )
    difference = max_difference(acc.unwrap_model(model).state_dict(), reference.state_dict())
    assert difference < 5e-2, f"bf16 training drifted from fp32 by {difference:.3g}"
    return Result(
        f"on {ctx.device}: matmuls in bfloat16, outputs and weights float32; 3 steps within "
        f"{difference:.1e} of fp32",
        {"max_difference_vs_fp32": difference},
    )


def check_fp16_grad_scaler(ctx: Context) -> Result:
    from slipstream import Accelerator, GradScalerKwargs

    acc = Accelerator(mixed_precision="fp16", kwargs_handlers=[GradScalerKwargs(init_scale=1024.0)])
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
    assert acc.scaler is not None and acc.scaler.is_enabled(), "fp16 brings a GradScaler"
    x, y, _ = (t.to(ctx.device) for t in dataset().tensors)

    def step(scale_loss_by: float) -> bool:
        before = snapshot(model)
        optimizer.zero_grad()
        acc.backward(F.mse_loss(model(x), y) * scale_loss_by)
        optimizer.step()
        scheduler.step()
        after = snapshot(model)
        return not all(torch.equal(before[k], after[k]) for k in before)

    assert step(1.0) and not acc.optimizer_step_was_skipped, "a normal step is applied"
    scale, epoch = acc.scaler.get_scale(), scheduler.last_epoch
    # An infinite loss overflows every gradient: the step must be skipped everywhere.
    changed = step(float("inf"))
    assert acc.optimizer_step_was_skipped and not changed, "an overflow step is skipped"
    assert acc.scaler.get_scale() == scale * 0.5, "the loss scale backs off after an overflow"
    assert scheduler.last_epoch == epoch, "the scheduler does not advance on a skipped step"
    assert step(1.0) and not acc.optimizer_step_was_skipped, "training continues afterwards"
    return Result(
        f"on {ctx.device}: step applied at scale {scale:g}; an overflow step was skipped "
        f"(weights unchanged, scale {scale:g} -> {scale * 0.5:g}, scheduler held); the next "
        "step applied",
        {"scale": scale},
    )


def check_true_half(ctx: Context) -> Result:
    from slipstream import Accelerator

    x, y, _ = (t.to(ctx.device) for t in dataset().tensors)
    found = []
    for mode, dtype in (("bf16-true", torch.bfloat16), ("fp16-true", torch.float16)):
        fresh_state()
        acc = Accelerator(mixed_precision=mode)
        model = mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        model, optimizer = acc.prepare(model, optimizer)
        assert {p.dtype for p in model.parameters()} == {dtype}, f"{mode}: weights in {dtype}"
        before = snapshot(model)
        out = model(x)  # float32 inputs are cast to the weights' dtype
        assert out.dtype == torch.float32, f"{mode}: outputs converted to float32"
        optimizer.zero_grad()
        acc.backward(F.mse_loss(out, y))
        assert {p.grad.dtype for p in model.parameters()} == {dtype}
        optimizer.step()
        after = snapshot(model)
        assert all(torch.isfinite(v).all() for v in after.values()), f"{mode}: finite weights"
        assert any(not torch.equal(before[k], after[k]) for k in before), f"{mode}: a step"
        found.append(f"{mode} weights and gradients {str(dtype).replace('torch.', '')}")
    return Result(f"on {ctx.device}: " + "; ".join(found) + "; outputs float32")


def check_fp8_error(ctx: Context) -> Result:
    from slipstream import Accelerator
    from slipstream.precision import fp8_unavailable_reason

    reason = fp8_unavailable_reason(ctx.device)
    if reason is None:
        raise Skip("fp8 is available here, so there is no error to check (see fp8_training)")
    try:
        Accelerator(mixed_precision="fp8")
    except ValueError as error:
        message = str(error)
    else:
        raise AssertionError("mixed_precision='fp8' was accepted where fp8 cannot run")
    assert reason in message and "bf16" in message, f"unclear error: {message}"
    return Result(f"clear error: {message}", {"message": message})


def check_fp8_training(ctx: Context) -> Result:
    from slipstream import Accelerator
    from slipstream.precision import fp8_unavailable_reason

    ctx.require_cuda("fp8 matmuls")
    reason = fp8_unavailable_reason(ctx.device)
    if reason is not None:
        if "torchao" in reason:
            reason += " (torchao is not a declared extra of slipstream, so nothing installs it)"
        raise Skip(reason)
    acc = Accelerator(mixed_precision="fp8")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer = acc.prepare(model, optimizer)
    kinds = {type(m).__name__ for m in acc.unwrap_model(model).modules()}
    assert "Float8Linear" in kinds, f"no Float8Linear among {sorted(kinds)}"
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(256, 64, generator=generator).to(ctx.device)
    y = torch.randn(256, 32, generator=generator).to(ctx.device)
    losses = []
    for _ in range(20):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        acc.backward(loss)
        optimizer.step()
        losses.append(loss.item())
    assert all(math.isfinite(loss) for loss in losses), f"losses {losses}"
    assert losses[-1] < losses[0], f"fp8 training did not learn: {losses[0]} -> {losses[-1]}"
    return Result(
        f"Float8Linear layers; 20 AdamW steps, loss {losses[0]:.3f} -> {losses[-1]:.3f}",
        {"losses": losses},
    )


def check_torch_compile(ctx: Context) -> Result:
    from slipstream import Accelerator
    from slipstream.accelerator.compile import is_compiled

    # Inductor generates kernels (Triton on CUDA, C++ on the CPU); the quick mode on a CPU
    # uses aot_eager, the same dynamo and autograd path without a compiler run.
    backend = "inductor" if ctx.cuda or not ctx.quick else "aot_eager"
    acc = Accelerator(dynamo_backend=backend)
    model = mlp()
    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = acc.prepare(model, optimizer)
    assert is_compiled(model), "prepare() compiles the model"
    assert not is_compiled(acc.unwrap_model(model)), "unwrap_model returns the original module"
    x, y, _ = (t.to(ctx.device) for t in dataset().tensors)
    times = []
    for _ in range(4):
        started = time.perf_counter()
        optimizer.zero_grad()
        acc.backward(F.mse_loss(model(x), y))
        optimizer.step()
        _synchronize(ctx.device)
        times.append(time.perf_counter() - started)
    reference = train_reference(
        reference, [(x, y)] * 4, lambda p: torch.optim.SGD(p, lr=0.1), ctx.device
    )
    difference = max_difference(acc.unwrap_model(model).state_dict(), reference.state_dict())
    assert difference < 1e-4, f"compiled training differs from eager by {difference:.3g}"
    return Result(
        f"{backend} on {ctx.device}: first step {times[0]:.1f} s (compiling), then "
        f"{statistics.median(times[1:]) * 1e3:.2f} ms; 4 steps within {difference:.1e} of eager",
        {"backend": backend, "step_seconds": times, "max_difference_vs_eager": difference},
    )


def check_fsdp2(ctx: Context) -> Result:
    from torch.distributed.tensor import DTensor

    from slipstream import Accelerator, DistributedType, FullyShardedDataParallelPlugin

    plugin = FullyShardedDataParallelPlugin(
        auto_wrap_policy="size_based_wrap", min_num_params=100, state_dict_type="SHARDED_STATE_DICT"
    )
    acc = Accelerator(fsdp_plugin=plugin)
    assert acc.distributed_type == DistributedType.FSDP
    model = mlp()
    reference = copy.deepcopy(model)
    optimizer = _sgd(model.parameters())
    model, optimizer = acc.prepare(model, optimizer)
    parameters = list(model.parameters())
    assert all(isinstance(p, DTensor) for p in parameters), "parameters are sharded DTensors"
    assert {p.to_local().device for p in parameters} == {ctx.device}
    x, y, _ = (t.to(ctx.device) for t in dataset().tensors)

    def step() -> None:
        optimizer.zero_grad()
        acc.backward(F.mse_loss(model(x), y))
        optimizer.step()

    for _ in range(3):
        step()
    reference = train_reference(reference, [(x, y)] * 3, _sgd, ctx.device)
    full = acc.get_state_dict(model)
    difference = max_difference(full, reference.state_dict())
    assert difference < 1e-5, f"FSDP2 differs from plain training by {difference:.3g}"
    # A sharded checkpoint (torch.distributed.checkpoint) of device tensors, loaded back:
    # the step after loading must repeat the step after saving exactly.
    folder = str(ctx.scratch / "fsdp2_checkpoint")
    acc.save_state(folder)
    step()
    after_save = acc.get_state_dict(model)
    acc.load_state(folder)
    assert max_difference(acc.get_state_dict(model), full) == 0.0, "load_state restores weights"
    step()
    assert max_difference(acc.get_state_dict(model), after_save) == 0.0, "and optimizer state"
    # bf16 through FSDP2's MixedPrecisionPolicy (not autocast).
    fresh_state()
    acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin(), mixed_precision="bf16")
    model = acc.prepare(mlp())
    out = model(x)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    acc.backward(F.mse_loss(out, y))
    return Result(
        f"one process on {ctx.device}: DTensor shards there; 3 SGD steps within "
        f"{difference:.1e} of plain training; sharded save/load repeats the next step "
        "exactly; bf16 policy runs",
        {"max_difference": difference},
    )


def check_mesh_tp(ctx: Context) -> Result:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from slipstream import Accelerator, ParallelismConfig
    from slipstream.parallel.clipping import clip_grad_norm_
    from slipstream.parallel.tensor_parallel import apply_tensor_parallel, resolve_plan

    acc = Accelerator(parallelism_config=ParallelismConfig(dp_shard_size=1, tp_size=1))
    mesh = acc.state.mesh
    assert mesh is not None and mesh.mesh.device_type == ctx.device.type
    assert acc.state.data_parallel_size == 1 and acc.state.data_parallel_index == 0
    model = TwoLayer()
    initial = copy.deepcopy(model)
    optimizer = _sgd(model.parameters())
    model, optimizer = acc.prepare(model, optimizer)
    x, y, _ = (t.to(ctx.device) for t in dataset().tensors)
    for _ in range(3):
        optimizer.zero_grad()
        acc.backward(F.mse_loss(model(x), y))
        acc.clip_grad_norm_(model.parameters(), 1e6)
        optimizer.step()
    reference = train_reference(initial, [(x, y)] * 3, _sgd, ctx.device)
    layout = max_difference(acc.get_state_dict(model), reference.state_dict())
    assert layout < 1e-5, f"the mesh layout differs from plain training by {layout:.3g}"
    # The tensor-parallel code itself over a one-device "tp" mesh: DTensor weights, the
    # column/row-wise styles, and the global-norm clip over DTensor gradients.
    tp_mesh = init_device_mesh(ctx.device.type, (1,), mesh_dim_names=("tp",))
    split, plain = TwoLayer(), TwoLayer()
    split.to(ctx.device)
    plain.to(ctx.device)
    apply_tensor_parallel(split, tp_mesh, resolve_plan(split, TP_PLAN, 1))
    assert isinstance(split.up.weight, DTensor) and isinstance(split.down.weight, DTensor)
    F.mse_loss(split(x), y).backward()
    F.mse_loss(plain(x), y).backward()
    norm = clip_grad_norm_(split.parameters(), 0.5)
    expected = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
    assert torch.allclose(norm.float().cpu(), expected.float().cpu(), rtol=1e-5), (norm, expected)
    clipped = max_difference(
        {n: p.grad for n, p in split.named_parameters()},
        {n: p.grad for n, p in plain.named_parameters()},
    )
    assert clipped < 1e-6, f"clipped gradients differ by {clipped:.3g}"
    return Result(
        f"mesh {mesh.dim_names} on {ctx.device.type}: 3 steps within {layout:.1e} of plain "
        f"training; colwise/rowwise DTensor layers on a 1-device tp mesh: clipped norm "
        f"{float(norm):.4f} = plain's, gradients within {clipped:.1e}",
        {"max_difference": layout, "clip_norm": float(norm)},
    )


def check_checkpoint_roundtrip(ctx: Context) -> Result:
    from slipstream import Accelerator, set_seed
    from slipstream.checkpoint.rng import capture_rng_states

    folder = str(ctx.scratch / "checkpoint")

    def build() -> tuple[Any, Any, Any, Any]:
        fresh_state()
        acc = Accelerator()
        set_seed(0)
        torch.manual_seed(0)
        # Dropout on the device draws from the device's generator (CUDA's on a GPU): a
        # resumed run repeats the straight one only if that state was saved and restored.
        model = nn.Sequential(nn.Linear(16, 32), nn.Dropout(0.2), nn.Tanh(), nn.Linear(32, 4))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        loader = DataLoader(dataset(64), batch_size=8, shuffle=True)
        return acc, *acc.prepare(model, optimizer, loader)

    def train(acc: Any, model: Any, optimizer: Any, batches: Iterator[Any]) -> list[float]:
        losses = []
        for _ in range(3):
            x, y, _ = next(batches)
            optimizer.zero_grad()
            loss = F.mse_loss(model(x), y)
            acc.backward(loss)
            optimizer.step()
            losses.append(loss.item())
        return losses

    acc, model, optimizer, loader = build()
    batches = iter(loader)
    train(acc, model, optimizer, batches)
    acc.save_state(folder)  # mid-epoch: the loader's position is saved too
    straight = train(acc, model, optimizer, batches)
    expected = snapshot(acc.unwrap_model(model))
    acc, model, optimizer, loader = build()
    acc.load_state(folder)
    states = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    assert {t.device for t in states if t.dim() > 0} == {ctx.device}, "AdamW state on the device"
    resumed = train(acc, model, optimizer, iter(loader))
    weights = max_difference(acc.unwrap_model(model).state_dict(), expected)
    losses = max(abs(a - b) for a, b in zip(resumed, straight, strict=True))
    same, how = same_result(max(weights, losses), ctx)
    assert same, f"the resumed run differs: losses by {losses:.3g}, weights by {weights:.3g}"
    kinds = sorted(capture_rng_states())
    assert ("cuda" in kinds) == ctx.cuda
    return Result(
        f"on {ctx.device}: save_state mid-epoch, load_state in a new Accelerator, 3 more steps "
        f"equal to the straight run {how} (dropout, shuffled loader, AdamW state; RNG states "
        f"{'/'.join(kinds)})",
        {"losses": straight},
    )


def _zero(ctx: Context, stage: int) -> Result:
    _require_deepspeed()
    with launched_alone() as launch:
        return _zero_steps(ctx, stage, launch)


def _zero_steps(ctx: Context, stage: int, launch: dict[str, Any]) -> Result:
    from slipstream import Accelerator, DeepSpeedPlugin, DistributedType

    plugin = DeepSpeedPlugin(
        zero_stage=stage, gradient_clipping=0.0, zero3_save_16bit_model=stage == 3
    )
    acc = Accelerator(deepspeed_plugin=plugin)
    assert acc.distributed_type == DistributedType.DEEPSPEED
    model = mlp()
    reference = copy.deepcopy(model)
    optimizer = _adamw(model.parameters())
    loader = DataLoader(dataset(), batch_size=8)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)
    assert model.device == ctx.device, f"the engine runs on {model.device}"
    batches = []
    for x, y, _ in loader:
        batches.append((x, y))
        acc.backward(F.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    reference = train_reference(reference, batches, _adamw, ctx.device)
    difference = max_difference(acc.get_state_dict(model), reference.state_dict())
    assert difference < 1e-5, f"ZeRO-{stage} differs from plain AdamW by {difference:.3g}"
    detail = (
        f"one process on {ctx.device}: {len(batches)} steps with torch AdamW within "
        f"{difference:.1e} of plain training"
    )
    if stage == 3:
        # bf16, the usual way to run ZeRO-3 on GPUs: the engine holds bf16 weights and
        # fp32 master copies; inputs and outputs are converted for the fp32 script.
        fresh_state()
        acc = Accelerator(deepspeed_plugin=DeepSpeedPlugin(zero_stage=3), mixed_precision="bf16")
        model = mlp()
        model, optimizer = acc.prepare(model, _adamw(model.parameters()))
        x, y = batches[0]
        out = model(x)
        assert out.dtype == torch.float32 and torch.isfinite(out).all()
        acc.backward(F.mse_loss(out, y))
        optimizer.step()
        detail += "; a bf16 step runs"
    if launch["local_rank_set_by_check"]:
        detail += " (LOCAL_RANK=0 set as a launcher would: DeepSpeed asserts it)"
    return Result(detail, {"max_difference": difference, **launch})


def check_zero1(ctx: Context) -> Result:
    return _zero(ctx, 1)


def check_zero2(ctx: Context) -> Result:
    return _zero(ctx, 2)


def check_zero3(ctx: Context) -> Result:
    return _zero(ctx, 3)


def _estimate(ctx: Context, width: int, layers: int) -> dict[str, int]:
    """``slipstream estimate-memory --json`` (the command's own code) for an MLP stack."""
    from slipstream.cli import main as cli

    factory = ctx.scratch / "estimate_model.py"
    factory.write_text(
        "from torch import nn\n\n\ndef model():\n"
        f"    return nn.Sequential(*[nn.Linear({width}, {width}) for _ in range({layers})])\n"
    )
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = cli(["estimate-memory", f"{factory}:model", "--json", "--dtypes", "fp32"])
    assert code == 0, printed.getvalue()
    rows = json.loads(printed.getvalue())["training"]
    return {row["strategy"]: row["total"] for row in rows}


# DeepSpeed's defaults keep up to 1e9 gathered parameters alive and use 5e8-element buckets
# (gigabytes for a small model); bounded as one would for a model this size, ZeRO-3 holds
# what the estimate counts. The default configuration is measured too, and reported.
_ZERO3_BOUNDED = {
    "zero_optimization": {
        "stage": 3,
        "stage3_max_live_parameters": 2e6,
        "stage3_max_reuse_distance": 2e6,
        "stage3_prefetch_bucket_size": 2e6,
        "stage3_param_persistence_threshold": 1e4,
        "reduce_bucket_size": 2e6,
        "sub_group_size": 4e6,
    },
    "gradient_clipping": 0.0,
}


def _peak_bytes(ctx: Context, strategy: str, width: int, layers: int) -> int | None:
    """Peak CUDA memory above what was allocated before the model, over 3 AdamW steps
    (``None`` without CUDA, where the same steps run as a rehearsal)."""
    from slipstream import Accelerator, DeepSpeedPlugin, FullyShardedDataParallelPlugin

    fresh_state()
    fsdp = FullyShardedDataParallelPlugin(transformer_cls_names_to_wrap=["Linear"])
    plugins: dict[str, dict[str, Any]] = {
        "DDP": {},
        "FSDP": {"fsdp_plugin": fsdp},
        "ZeRO-3": {"deepspeed_plugin": DeepSpeedPlugin(hf_ds_config=copy.deepcopy(_ZERO3_BOUNDED))},
        "ZeRO-3 defaults": {
            "deepspeed_plugin": DeepSpeedPlugin(zero_stage=3, gradient_clipping=0.0)
        },
    }
    before = 0
    with launched_alone():
        acc = Accelerator(**plugins[strategy])
        if ctx.cuda:
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        model, optimizer = acc.prepare(model, optimizer)
        for _ in range(3):
            loss = model(torch.randn(8, width, device=ctx.device)).pow(2).mean()
            acc.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        peak = None
        if ctx.cuda:
            torch.cuda.synchronize()
            peak = torch.cuda.max_memory_allocated() - before
        acc.free_memory()
    del model, optimizer, acc
    fresh_state()
    return peak


def check_estimate_memory(ctx: Context) -> Result:
    width, layers = (512, 4) if ctx.quick else (1024, 8)
    estimate = _estimate(ctx, width, layers)
    strategies = ["DDP", "FSDP"]
    if _has_deepspeed():
        strategies += ["ZeRO-3", "ZeRO-3 defaults"]
    if not ctx.cuda:
        # The same training steps, small, so that the GPU run meets no surprise; then SKIP.
        for strategy in strategies[:3]:
            _peak_bytes(ctx, strategy, 32, 2)
        mib = {k: v / 2**20 for k, v in estimate.items()}
        figures = f"DDP {mib['DDP']:.1f}, FSDP {mib['FSDP']:.1f}, ZeRO-3 {mib['ZeRO-3']:.1f} MiB"
        ctx.require_cuda(
            f"torch.cuda.max_memory_allocated; rehearsed {', '.join(strategies[:3])} on the CPU, "
            f"the estimate for {width}x{layers}: {figures}"
        )
    # cuBLAS takes its workspace at the first matmul and keeps it: take it now, so that it
    # is in every baseline instead of in the first strategy's peak.
    (torch.ones(8, 8, device=ctx.device) @ torch.ones(8, 8, device=ctx.device)).sum().item()
    measured = {s: _peak_bytes(ctx, s, width, layers) or 0 for s in strategies}
    ratios = {s: measured[s] / estimate[s.split()[0]] for s in strategies}
    parts = [
        f"{s} {ratios[s]:.2f} ({measured[s] / 2**20:.1f}/{estimate[s.split()[0]] / 2**20:.1f} MiB)"
        for s in strategies
    ]
    low, high = MEMORY_RATIO_BOUNDS
    judged = {s: r for s, r in ratios.items() if s != "ZeRO-3 defaults"}
    outside = {s: round(r, 2) for s, r in judged.items() if not low <= r <= high}
    assert not outside, f"measured/estimated outside [{low}, {high}]: {outside}; {'; '.join(parts)}"
    note = "" if _has_deepspeed() else " (ZeRO-3 not measured: DeepSpeed is not installed)"
    return Result(
        f"{width}x{layers} MLP, 1 process, fp32 AdamW, peak/estimate: " + "; ".join(parts) + note,
        {"estimate_bytes": estimate, "peak_bytes": measured, "ratios": ratios},
    )


@dataclass
class _Loop:
    """One variant of the timed training loop: its model, batches and step function."""

    name: str
    model: nn.Module
    batches: Iterator[Any]
    step: Callable[[Any], None]


def _hand_written_loop(
    name: str, width: int, layers: int, steps: int, device: torch.device
) -> _Loop:
    import ddp_overhead  # benchmarks/ddp_overhead.py, beside this file

    model = ddp_overhead._model(width, layers).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = ddp_overhead._data(width, steps, 1)
    loader = DataLoader(data, batch_size=ddp_overhead.PER_PROCESS_BATCH)

    def step(batch: Any) -> None:
        x, y = (t.to(device) for t in batch)
        optimizer.zero_grad()
        F.mse_loss(model(x), y).backward()
        optimizer.step()

    return _Loop(name, model, iter(loader), step)


def _prepared_loop(width: int, layers: int, steps: int, device: torch.device) -> _Loop:
    import ddp_overhead

    from slipstream import Accelerator

    fresh_state()
    acc = Accelerator(cpu=device.type == "cpu")
    model = ddp_overhead._model(width, layers)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = ddp_overhead._data(width, steps, 1)
    loader = DataLoader(data, batch_size=ddp_overhead.PER_PROCESS_BATCH)
    model, optimizer, loader = acc.prepare(model, optimizer, loader)

    def step(batch: Any) -> None:
        x, y = batch
        optimizer.zero_grad()
        acc.backward(F.mse_loss(model(x), y))
        optimizer.step()

    return _Loop("slipstream", acc.unwrap_model(model), iter(loader), step)


def _timed_rounds(
    loops: list[_Loop], rounds: int, timed: int, device: torch.device,
    wall: dict[str, list[float]], cpu: dict[str, list[float]],
) -> None:  # fmt: skip
    """ddp_overhead.py's rounds: every loop in turn, in a rotating order, one untimed warm-up
    step and then ``timed`` steps each timed on its own (synchronised with the device)."""
    import ddp_overhead

    for round_index in range(rounds):
        shift = round_index % len(loops)
        for loop in loops[shift:] + loops[:shift]:
            for _ in range(ddp_overhead.WARMUP_STEPS):
                loop.step(next(loop.batches))
            _synchronize(device)
            for _ in range(timed):
                batch = next(loop.batches)
                started, started_cpu = time.perf_counter(), time.thread_time()
                loop.step(batch)
                _synchronize(device)
                cpu[loop.name].append(time.thread_time() - started_cpu)
                wall[loop.name].append(time.perf_counter() - started)


def check_ddp_overhead(ctx: Context) -> Result:
    """ddp_overhead.py's measurement on one device (absolute times mean something on a
    GPU): the prepared loop against the same loop hand-written and a second copy of it
    (the noise floor), taking turns, with paired per-step ratios."""
    import ddp_overhead
    import workers

    device = ctx.device
    parts, metrics, agreement = [], {}, []
    for size in ["tiny"] if ctx.quick else list(ddp_overhead.SIZES):
        width, layers = ddp_overhead.SIZES[size]
        generations, rounds, timed = (1, 3, 2) if ctx.quick else ddp_overhead.ROUNDS[size]
        steps = rounds * (ddp_overhead.WARMUP_STEPS + timed)
        wall: dict[str, list[float]] = {"torch": [], "slipstream": [], "control": []}
        cpu: dict[str, list[float]] = {name: [] for name in wall}
        for _ in range(generations):
            loops = [
                _hand_written_loop("torch", width, layers, steps, device),
                _prepared_loop(width, layers, steps, device),
                _hand_written_loop("control", width, layers, steps, device),
            ]
            _timed_rounds(loops, rounds, timed, device, wall, cpu)
            reference = loops[0].model.state_dict()
            for loop in loops[1:]:
                same, how = same_result(max_difference(loop.model.state_dict(), reference), ctx)
                assert same, f"{size}: {loop.name}'s weights differ from the hand-written loop's"
                agreement.append(how)
        bases = [wall["torch"], wall["control"]]
        ratio = workers.median_ratio(wall["slipstream"], bases)
        low, high = workers.median_ratio_interval(wall["slipstream"], bases, timed)
        control = workers.median_ratio(wall["control"], [wall["torch"]])
        extra_us = 1e6 * statistics.median(
            [a - b for a, b in zip(cpu["slipstream"], cpu["torch"], strict=True)]
        )
        medians = {name: statistics.median(values) for name, values in wall.items()}
        parts.append(
            f"{size} {medians['slipstream'] * 1e3:.3f} vs {medians['torch'] * 1e3:.3f} ms, "
            f"ratio {ratio:.3f}x ({low:.3f}-{high:.3f}; control {control:.3f}), "
            f"CPU {extra_us:+.0f} us"
        )
        metrics[size] = {
            "median_step_seconds": medians,
            "ratio": ratio,
            "interval": [low, high],
            "control_ratio": control,
            "cpu_extra_us": extra_us,
            "paired_steps": len(wall["torch"]),
        }
    return Result(
        f"one {device.type} device, slipstream vs hand-written step: "
        + "; ".join(parts)
        + f"; weights equal ({'bitwise' if set(agreement) == {'bitwise'} else 'within 1e-6'})",
        metrics,
    )


def check_cli_test(ctx: Context) -> Result:
    """What a user tries first: ``slipstream test`` with no configuration (one process per
    GPU, else one on the CPU)."""
    done = run_command([sys.executable, "-m", "slipstream.cli", "test"], timeout=150)
    summary = re.search(
        r"running the sanity checks on (\d+) process\(es\) \(([^)]*)\)", done.stdout
    )
    assert done.returncode == 0 and "all checks passed" in done.stdout, _tail(done.stdout)
    assert summary is not None, _tail(done.stdout)
    processes = int(summary.group(1))
    assert processes == max(ctx.gpus, 1), f"{processes} process(es) for {ctx.gpus} GPU(s)"
    return Result(
        f"slipstream test: {processes} process(es) ({summary.group(2)}), all checks passed",
        {"processes": processes},
    )


def check_multi_process(ctx: Context) -> Result:
    """The suite's multi-process scenarios (DDP parity, FSDP2, ZeRO-3, tp2) on one process
    per GPU over NCCL. NCCL needs a GPU per rank: with fewer than 2 GPUs this SKIPs; without
    CUDA the same workers are rehearsed on 2 CPU processes over gloo first."""
    gpus = ctx.gpus
    if gpus == 1:
        raise Skip(
            "needs 2 GPUs: NCCL needs one GPU per rank and this machine has 1 (the CPU suite "
            "runs these scenarios over gloo)"
        )
    # An even number of ranks, so tensor parallelism of 2 divides them.
    ranks = gpus - gpus % 2 if gpus >= 2 else 2
    scenarios = ["ddp", "fsdp2", "zero3", "tp2"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if gpus < 2:
        env["CUDA_VISIBLE_DEVICES"] = ""  # the rehearsal: CPU processes over gloo
    # (With GPUs, rank r takes cuda:r of the GPUs this process sees.)
    command = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
        str(ranks), str(HERE / "gpu_check.py"), "--rank-worker", *scenarios,
    ]  # fmt: skip
    done = run_command(command, timeout=280, env=env)
    reports = [
        json.loads(line[len(RANK_PREFIX) :])
        for line in done.stdout.splitlines()
        if line.startswith(RANK_PREFIX)
    ]
    by_scenario = {r["scenario"]: r for r in reports}
    missing = [s for s in scenarios if s not in by_scenario]
    if done.returncode != 0 or missing:
        print(done.stdout[-6000:])  # into the report's output tail
    failed = {s: r["error"] for s, r in by_scenario.items() if r.get("error")}
    assert not failed, f"failed: {failed}"
    assert not missing and done.returncode == 0, (
        f"no result for {missing}; torchrun exited with {done.returncode}"
    )
    backend = by_scenario["ddp"]["backend"]
    parts = [
        f"{s} {r['detail']}" if r.get("skipped") is None else f"{s} skipped ({r['skipped']})"
        for s, r in by_scenario.items()
    ]
    where = f"{ranks} GPUs over {backend}" if gpus >= 2 else f"2 CPU processes over {backend}"
    detail = f"{where}: " + "; ".join(parts)
    if gpus < 2:
        raise Skip(f"needs 2 GPUs for NCCL (no CUDA here); rehearsed on {detail}")
    return Result(detail, {"ranks": ranks, "scenarios": by_scenario})


#: The suite's tests that only run with CUDA, and multi-process tests that must keep choosing
#: the CPU on a machine with one GPU (two ranks would otherwise both take cuda:0).
SUITE_TESTS = [
    "tests/core/runtime/test_cuda.py",
    "tests/core/precision/test_precision.py::test_fp16_on_cuda_scales_and_steps",
    "tests/core/precision/test_precision.py::test_fp8_trains_on_a_supporting_gpu",
    "tests/core/parallel/test_context_parallel.py::test_context_parallel_attention_matches_one_process_on_two_gpus",
    "tests/test_distributed.py",
    "tests/core/strategies/test_ddp.py::test_ddp_matches_single_process_references",
    "tests/core/launcher/test_launch.py::test_plain_torchrun_forms_one_group",
]


def check_suite_on_gpu(ctx: Context) -> Result:
    ctx.require_cuda("the suite's CUDA tests; the CPU suite runs the rest")
    if importlib.util.find_spec("pytest") is None:
        raise Skip("pytest is not installed")
    command = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", *SUITE_TESTS]
    done = run_command(command, timeout=170)
    last = (done.stdout.strip().splitlines() or [""])[-1]
    counts = re.findall(r"(\d+) (passed|failed|skipped|errors?)", last)
    summary = ", ".join(f"{n} {word}" for n, word in counts)
    assert done.returncode == 0, f"pytest: {summary or 'no summary'}\n{_tail(done.stdout, 30)}"
    return Result(f"pytest on {len(SUITE_TESTS)} selections: {summary}", {"summary": summary})


# -- the multi-process scenarios (run under torchrun by check_multi_process) --------------------
def _scenario_training(acc: Any, model: nn.Module, optimizer: Any, steps: int = 3) -> Any:
    """Train on the data-parallel share of each global batch; return the global batches (the
    data-parallel gather of sample indices) for the reference."""
    data = dataset(64)
    loader = acc.prepare(DataLoader(data, batch_size=4))
    global_batches = []
    for x, y, index in loader:
        acc.backward(F.mse_loss(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        global_batches.append(acc.gather(index).cpu())
        if len(global_batches) == steps:
            break
    return data, global_batches


def _scenario(name: str) -> dict[str, Any]:
    from slipstream import (
        Accelerator,
        DeepSpeedPlugin,
        FullyShardedDataParallelPlugin,
        ParallelismConfig,
        gather_object,
    )

    optimizer_factory: Callable[[Any], torch.optim.Optimizer] = _sgd
    model: nn.Module = mlp()
    if name == "ddp":
        acc = Accelerator()
    elif name == "fsdp2":
        acc = Accelerator(fsdp_plugin=FullyShardedDataParallelPlugin())
    elif name == "zero3":
        if not _has_deepspeed():
            return {"skipped": "DeepSpeed is not installed"}
        plugin = DeepSpeedPlugin(zero_stage=3, gradient_clipping=0.0, zero3_save_16bit_model=True)
        acc = Accelerator(deepspeed_plugin=plugin)
        optimizer_factory = _adamw
    elif name == "tp2":
        world = int(os.environ["WORLD_SIZE"])
        config = ParallelismConfig(dp_shard_size=world // 2, tp_size=2, tp_plan=TP_PLAN)
        acc = Accelerator(parallelism_config=config)
        model = TwoLayer()
    else:
        raise ValueError(f"unknown scenario {name!r}")
    reference = copy.deepcopy(model)
    optimizer = optimizer_factory(model.parameters())
    model, optimizer = acc.prepare(model, optimizer)
    data, global_batches = _scenario_training(acc, model, optimizer)
    full = acc.get_state_dict(model)  # a collective for the sharded strategies
    devices = gather_object([str(acc.device)])
    result: dict[str, Any] = {"backend": acc.state.backend, "devices": devices}
    if acc.is_main_process:
        x, y, _ = data.tensors
        batches = [(x[i], y[i]) for i in global_batches]
        reference = train_reference(reference, batches, optimizer_factory, acc.device)
        difference = max_difference(full, reference.state_dict())
        assert difference < 1e-5, (
            f"differs from one process on the global batch by {difference:.3g}"
        )
        if acc.device.type == "cuda":
            assert len(set(devices)) == len(devices), f"ranks share a GPU: {devices}"
        kind = acc.distributed_type.value
        if acc.state.mesh is not None:
            kind += f", {acc.state.mesh.sizes.describe()}"
        result["max_difference"] = difference
        result["detail"] = f"max|dw| {difference:.1e} vs 1 process ({kind})"
    return result


def rank_worker(scenarios: list[str]) -> int:
    """One rank of check_multi_process: run each scenario; rank 0 prints one line each."""
    stop_when_orphaned()
    from slipstream.runtime.state import set_current_state

    rank = int(os.environ.get("RANK", "0"))
    for name in scenarios:
        set_current_state(None)
        try:
            result = _scenario(name)
        except Exception as error:
            print(f"rank {rank}: {name} failed", file=sys.stderr, flush=True)
            import traceback

            traceback.print_exc()
            print(
                RANK_PREFIX + json.dumps({"scenario": name, "error": f"rank {rank}: {error!r}"}),
                flush=True,
            )
            sys.stdout.flush()
            # The other ranks may wait in a collective for this one: end the job now
            # (torchrun stops them) instead of waiting for the check's budget.
            os._exit(1)
        if rank == 0:
            print(RANK_PREFIX + json.dumps({"scenario": name, **result}), flush=True)
        gc.collect()
    return 0
