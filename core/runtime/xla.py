"""XLA devices (TPUs, and XLA:CPU for testing) through torch_xla's PJRT runtime.

torch_xla is imported only here and only on the XLA path: ``import slipstream`` never loads
it, and a machine that merely has it installed keeps running plain CPU/GPU jobs.

When XLA is used (:func:`wants_xla`): torch_xla is installed and either the launcher asked
for it (``slipstream launch --tpu``, ``distributed_type: XLA``) or ``PJRT_DEVICE`` is set.
``Accelerator(cpu=True)`` (or ``--cpu``) always wins.

XLA tensors are lazy: operations record a graph that runs at the next *step barrier*
(:func:`sync`). slipstream puts a barrier after every optimizer step and before every batch
a prepared dataloader hands out, as ``xm.optimizer_step(barrier=True)`` and torch_xla's
``MpDeviceLoader`` do.

Collectives use torch_xla's own (``xm.all_gather``, ``xm.all_reduce``,
``xm.collective_broadcast``, ``xm.rendezvous``), over the processes PJRT forms.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import pickle
import sys
from collections.abc import Mapping
from typing import Any

import torch

from .env import pjrt_device
from .tree import map_tensors, replace_tensors, tensor_leaves

#: What PJRT's CPU client does with several processes, as measured with torch_xla 2.9 (see
#: docs/xla.md): each torchrun process is rank 0 of a world of 1.
CPU_WORLD_NOTE = (
    "PJRT's CPU client forms no multi-process world (torch_xla 2.9: under torchrun every "
    "process is rank 0 of 1, and xmp.spawn runs one process whose collectives wait for a "
    "thread per device); several XLA processes need TPUs (PJRT_DEVICE=TPU)"
)


class XlaError(RuntimeError):
    """XLA was asked for but cannot be used as asked."""


def xla_installed() -> bool:
    """Whether torch_xla can be imported (checked without importing it)."""
    if "torch_xla" in sys.modules:
        return True
    try:
        return importlib.util.find_spec("torch_xla") is not None
    except (ImportError, ValueError):
        return False


def xla_loaded() -> bool:
    """Whether torch_xla has been imported in this process (then XLA state is worth saving)."""
    return "torch_xla" in sys.modules


def xla_version() -> str | None:
    """The installed torch_xla's version (without importing it), or ``None``."""
    for name in ("torch_xla", "torch-xla"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


#: The newest torch_xla release (it needs the torch of the same version); install_hint
#: never names a torch_xla that does not exist.
NEWEST_TORCH_XLA = "2.9.0"


def _release(version: str) -> tuple[int, ...]:
    parts = []
    for part in version.split("+")[0].split(".")[:3]:
        digits = "".join(c for c in part if c.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def install_hint(torch_version: str | None = None) -> str:
    """How to install a torch_xla that fits (torch_xla publishes wheels only for the torch
    release of the same number, and none past :data:`NEWEST_TORCH_XLA`).

    Example::

        install_hint("2.13.0")  # 'pip install torch==2.9.0 "torch_xla[tpu]==2.9.0" ...'
    """
    version = (torch_version or torch.__version__).split("+")[0]
    if _release(version) <= _release(NEWEST_TORCH_XLA):
        return (
            f'pip install "torch_xla[tpu]=={version}" (torch_xla publishes wheels only for '
            "the torch release of the same number; [tpu] adds libtpu, for TPU VMs)"
        )
    return (
        f'pip install torch=={NEWEST_TORCH_XLA} "torch_xla[tpu]=={NEWEST_TORCH_XLA}" '
        f"(torch_xla's newest release is {NEWEST_TORCH_XLA} and needs torch "
        f"{NEWEST_TORCH_XLA}; there is none for this torch {version}: use a separate "
        "environment; [tpu] adds libtpu, for TPU VMs)"
    )


def wants_xla(
    launch_config: Mapping[str, Any], cpu: bool, environ: Mapping[str, str] | None = None
) -> bool:
    """Whether this process runs on the XLA device (see the module docstring)."""
    requested = str(launch_config.get("distributed_type", "")).upper() == "XLA"
    if cpu:
        return False
    if requested:
        if not xla_installed():
            raise XlaError(
                "distributed_type: XLA (slipstream launch --tpu) needs torch_xla, which is not "
                f"installed: {install_hint()}"
            )
        return True
    device = pjrt_device(environ)
    if device is not None and not xla_installed():
        # A TPU VM without torch_xla would otherwise train on its host CPU, silently.
        raise XlaError(
            f"PJRT_DEVICE={device} asks for torch_xla's {device} device, but torch_xla is not "
            f"installed, so this would train on the {'GPU' if device == 'CUDA' else 'CPU'} "
            f"instead: {install_hint()}; or unset PJRT_DEVICE to train without XLA"
        )
    return device is not None


def _xm() -> Any:
    import torch_xla.core.xla_model as xm

    return xm


def _xr() -> Any:
    import torch_xla.runtime as xr

    return xr


def xla_world() -> tuple[torch.device, int, int]:
    """This process's XLA device, its global ordinal and the number of XLA processes."""
    import torch_xla

    xr = _xr()
    device = torch_xla.device() if hasattr(torch_xla, "device") else _xm().xla_device()
    return torch.device(device), int(xr.global_ordinal()), int(xr.world_size())


def device_kind() -> str:
    """``TPU``, ``CPU``, ``CUDA``, ... as PJRT reports it."""
    return str(_xr().device_type())


def process_layout(launch_world: int, local_rank: int, local_world: int) -> dict[str, Any]:
    """The XLA process's place in the job, as ProcessState's keyword arguments.

    ``launch_world`` is what the launcher said (torchrun's WORLD_SIZE); PJRT must agree.
    """
    device, rank, world = xla_world()
    if launch_world > 1 and world != launch_world:
        raise XlaError(
            f"the launcher started {launch_world} processes but torch_xla's runtime "
            f"({device_kind()}) sees a world of {world}: {CPU_WORLD_NOTE}. Run one XLA:CPU "
            "process (slipstream launch --tpu --num_processes 1)"
        )
    if world > 1:
        join_xla_process_group()
    if launch_world != world:  # started by xmp.spawn: PJRT knows the places
        local_rank, local_world = int(_xr().local_ordinal()), world
    return {
        "process_index": rank,
        "num_processes": world,
        "local_process_index": local_rank,
        "num_local_processes": local_world,
        "device": device,
        "backend": "xla",
        "owns_process_group": False,
    }


def join_xla_process_group() -> None:
    """torch.distributed's ``xla`` backend over PJRT's processes (as torch_xla's docs have
    torchrun scripts do); formed once."""
    import torch.distributed as dist
    import torch_xla.distributed.xla_backend  # noqa: F401  (registers the backend)

    if not dist.is_initialized():
        dist.init_process_group("xla", init_method="xla://")


def sync() -> None:
    """The step barrier: run the graph recorded so far (``torch_xla.sync()``)."""
    import torch_xla

    if hasattr(torch_xla, "sync"):
        torch_xla.sync()
    else:  # torch_xla before 2.6
        _xm().mark_step()


def send_to_xla(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Copy host tensors to the XLA device in one asynchronous PJRT transfer (what
    torch_xla's ``MpDeviceLoader`` calls): the copy overlaps the device still running the
    previous step's graph."""
    if not tensors:
        return []
    moved = _xm().send_cpu_data_to_device(tensors, device)
    return list(moved)


def to_cpu(value: Any) -> Any:
    """``value`` with every XLA tensor (in nested lists, tuples, dicts, dataclasses) copied
    to the CPU, after one barrier so pending work runs once, not once per tensor."""
    if not any(t.device.type == "xla" for t in tensor_leaves(value)):
        return value
    sync()
    return map_tensors(lambda t: t.cpu() if t.device.type == "xla" else t, value)


def place_batch(batch: Any, device: torch.device) -> Any:
    """A dataloader's batch on the XLA device, as torch_xla's ``MpDeviceLoader`` hands it
    out: the step barrier first (the graph recorded for the previous batch runs, while the
    host goes on), then the batch's host tensors in one asynchronous PJRT transfer that
    overlaps that run (``xm.send_cpu_data_to_device``)."""
    sync()
    leaves = tensor_leaves(batch)
    if not leaves:
        return batch
    host = [t for t in leaves if t.device.type == "cpu"]
    moved = iter(send_to_xla(host, device))
    placed = [next(moved) if t.device.type == "cpu" else t.to(device) for t in leaves]
    return replace_tensors(batch, placed)


# -- collectives (several XLA processes) ------------------------------------------------------
def all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """Every process's ``tensor`` concatenated along dim 0."""
    return _xm().all_gather(tensor, dim=0)


def all_reduce(tensor: torch.Tensor, reduction: str, scale: float = 1.0) -> torch.Tensor:
    """``sum``/``mean``/``max``/``min`` of ``tensor`` over the processes (a new tensor)."""
    xm = _xm()
    ops = {"sum": xm.REDUCE_SUM, "mean": xm.REDUCE_SUM, "max": xm.REDUCE_MAX, "min": xm.REDUCE_MIN}
    if reduction == "mean":
        scale = scale / int(_xr().world_size())
    return xm.all_reduce(ops[reduction], tensor, scale=scale)


def all_reduce_gradients(parameters: list[torch.Tensor]) -> None:
    """Average the gradients of ``parameters`` over the processes, in place."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if grads:
        _xm().all_reduce(_xm().REDUCE_SUM, grads, scale=1.0 / int(_xr().world_size()))


def broadcast(tensor: torch.Tensor, source: int) -> torch.Tensor:
    """Process ``source``'s ``tensor`` on every process (in place)."""
    _xm().collective_broadcast([tensor], root_ordinal=source)
    return tensor


def rendezvous(tag: str, payload: bytes = b"") -> list[bytes]:
    """Wait for every process at ``tag``; returns what each contributed."""
    return list(_xm().rendezvous(tag, payload))


def gather_objects(tag: str, obj: Any) -> list[Any]:
    """Every process's picklable ``obj``, in process order."""
    return [pickle.loads(data) for data in rendezvous(tag, pickle.dumps(obj))]


# -- random numbers ---------------------------------------------------------------------------
def rng_state() -> int | None:
    """The XLA generator's seed state when torch_xla is in use (else ``None``)."""
    return int(_xm().get_rng_state()) if xla_loaded() else None


def set_rng_state(seed: int) -> None:
    """Seed (or restore) the XLA generator when torch_xla is in use."""
    if xla_loaded():
        _xm().set_rng_state(int(seed))


def runtime_description(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """What ``slipstream env`` shows about XLA (without importing torch_xla)."""
    from .env import xla_variables

    version = xla_version()
    device = pjrt_device(environ)
    if version is None:
        if device is None:
            return {"torch_xla": "not installed", "PJRT_DEVICE": "not set"}
        return {
            "torch_xla": "not installed",
            "PJRT_DEVICE": f"{device} (but torch_xla is not installed: Accelerator() stops "
            f"with an error; {install_hint()})",
        }
    info = {"torch_xla": version}
    info["PJRT_DEVICE"] = device or "not set (slipstream uses XLA only with it or --tpu)"
    for name, value in xla_variables(environ).items():
        if name != "PJRT_DEVICE":
            info[name] = value
    return info
