"""The one module that reads (and, for the launcher, writes) ``os.environ``.

Everything else in slipstream receives plain values from here. Workers learn their place in
the job from the variables set by torchrun (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ...),
by ``srun`` (SLURM) or by ``mpirun``; they learn the launcher's configuration from a single
JSON variable, :data:`LAUNCH_CONFIG_VARIABLE`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Accelerate's environment helpers (``slipstream.utils``) live beside this module.
from .helpers import (
    _YES as _YES,
)
from .helpers import (
    clear_environment as clear_environment,
)
from .helpers import (
    get_int_from_env as get_int_from_env,
)
from .helpers import (
    parse_choice_from_env as parse_choice_from_env,
)
from .helpers import (
    parse_flag_from_env as parse_flag_from_env,
)
from .helpers import (
    patch_environment as patch_environment,
)
from .helpers import (
    purge_accelerate_environment as purge_accelerate_environment,
)
from .helpers import (
    str_to_bool as str_to_bool,
)

#: JSON object with the launcher's resolved configuration (mixed precision, cpu, strategy...).
LAUNCH_CONFIG_VARIABLE = "SLIPSTREAM_LAUNCH_CONFIG"
#: Set to 1/true to check every collective for matching calls on all ranks.
DEBUG_VARIABLE = "SLIPSTREAM_DEBUG"
#: Overrides the default location of the configuration file.
CONFIG_FILE_VARIABLE = "SLIPSTREAM_CONFIG_FILE"
#: Where torchrun tells a worker to write its error report.
ERROR_FILE_VARIABLE = "TORCHELASTIC_ERROR_FILE"
#: Seconds without progress before a hang is reported (0: never); see
#: ``Accelerator(hang_timeout=...)``.
HANG_TIMEOUT_VARIABLE = "SLIPSTREAM_HANG_TIMEOUT"
#: The folder ``slipstream launch`` reads hang reports from (set by the launcher).
REPORT_DIR_VARIABLE = "SLIPSTREAM_REPORT_DIR"
#: torch's Flight Recorder: how many collectives each process keeps (torch's current name;
#: the second, NCCL-only name is the one older versions read: a user's setting of it wins).
FLIGHT_RECORDER_VARIABLES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


class LaunchEnvironmentError(ValueError):
    """A launcher variable holds a value slipstream cannot use."""


@dataclass(frozen=True)
class LaunchEnvironment:
    """Where this process sits in the job, as told by whoever started it."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str | None = None
    master_port: int | None = None
    #: "torchrun", "slurm", "mpi", "single", or the name of a framework that set the ranks.
    source: str = "single"
    launch_config: Mapping[str, Any] = field(default_factory=dict)
    debug: bool = False
    #: How many times torchrun's agent has restarted the workers (elastic restarts).
    restart_count: int = 0
    #: Whether torchrun's agent hosts the store at MASTER_ADDR:MASTER_PORT.
    agent_store: bool = False

    @property
    def needs_init_method(self) -> bool:
        """True when torch's ``env://`` cannot find RANK/WORLD_SIZE by itself."""
        return self.source not in ("torchrun", "single")


def _int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise LaunchEnvironmentError(f"environment variable {name} is required but not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise LaunchEnvironmentError(
            f"environment variable {name}={raw!r} is not an integer; unset it or set a number"
        ) from None


def _flag(env: Mapping[str, str], name: str) -> bool:
    return env.get(name, "").strip().lower() in _YES


def first_slurm_host(nodelist: str) -> str:
    """First host of a SLURM node list such as ``node[03-05,09],gpu1`` -> ``node03``."""
    match = re.match(r"([^,\[]+)(\[([^\]]+)\])?", nodelist.strip())
    if match is None:
        raise LaunchEnvironmentError(f"cannot parse SLURM node list {nodelist!r}")
    prefix, _, ranges = match.groups()
    if not ranges:
        return prefix
    first = ranges.split(",")[0].split("-")[0]
    return prefix + first


def _read_launch_config(env: Mapping[str, str]) -> dict[str, Any]:
    raw = env.get(LAUNCH_CONFIG_VARIABLE)
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as error:
        raise LaunchEnvironmentError(
            f"{LAUNCH_CONFIG_VARIABLE} is not valid JSON ({error}); it is set by `slipstream "
            "launch`: unset it when starting workers another way"
        ) from None
    if not isinstance(value, dict):
        raise LaunchEnvironmentError(f"{LAUNCH_CONFIG_VARIABLE} must hold a JSON object")
    return value


def read_launch_environment(environ: Mapping[str, str] | None = None) -> LaunchEnvironment:
    """Read this process's rank, world size and launcher configuration.

    Precedence: torchrun-style variables (``RANK``/``WORLD_SIZE``, also set by
    ``slipstream launch``), then SLURM's ``srun``, then MPI, else a single process.
    """
    env = os.environ if environ is None else environ
    launch_config = _read_launch_config(env)
    debug = _flag(env, DEBUG_VARIABLE) or bool(launch_config.get("debug", False))
    addr = env.get("MASTER_ADDR") or None
    port = _int(env, "MASTER_PORT", 0) or None
    restart_count = 0
    agent_store = False

    if "RANK" in env and "WORLD_SIZE" in env:
        world = _int(env, "WORLD_SIZE")
        rank = _int(env, "RANK")
        local_rank = _int(env, "LOCAL_RANK", rank)
        local_world = _int(env, "LOCAL_WORLD_SIZE", world)
        restart_count = _int(env, "TORCHELASTIC_RESTART_COUNT", 0)
        agent_store = _flag(env, "TORCHELASTIC_USE_AGENT_STORE")
        source = "torchrun"
    elif _int(env, "SLURM_STEP_NUM_TASKS", 1) > 1 and "SLURM_PROCID" in env:
        # Only a job step started by srun has SLURM_STEP_NUM_TASKS > 1; a plain python run
        # inside an allocation stays a single process instead of waiting for peers forever.
        world = _int(env, "SLURM_STEP_NUM_TASKS")
        rank = _int(env, "SLURM_PROCID")
        local_rank = _int(env, "SLURM_LOCALID", 0)
        nodes = _int(env, "SLURM_STEP_NUM_NODES", _int(env, "SLURM_NNODES", 1))
        local_world = max(1, world // max(1, nodes))
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_NODELIST") or "127.0.0.1"
        addr = addr or first_slurm_host(nodelist)
        # A port derived from the job id lets concurrent jobs on one node coexist.
        port = port or 15000 + _int(env, "SLURM_JOB_ID", 0) % 20000
        source = "slurm"
    elif "OMPI_COMM_WORLD_RANK" in env or "PMI_RANK" in env:
        if "OMPI_COMM_WORLD_RANK" in env:
            rank, world = _int(env, "OMPI_COMM_WORLD_RANK"), _int(env, "OMPI_COMM_WORLD_SIZE")
            local_rank = _int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0)
            local_world = _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", world)
        else:
            rank, world = _int(env, "PMI_RANK"), _int(env, "PMI_SIZE")
            local_rank = _int(env, "MPI_LOCALRANKID", 0)
            local_world = _int(env, "MPI_LOCALNRANKS", world)
        if world > 1 and (addr is None or port is None):
            raise LaunchEnvironmentError(
                "started by MPI with several ranks but MASTER_ADDR/MASTER_PORT are not set; "
                "export them (the address and a free port of rank 0's machine) in mpirun"
            )
        source = "mpi" if world > 1 else "single"
    else:
        return LaunchEnvironment(launch_config=launch_config, debug=debug)

    if world < 1 or not 0 <= rank < world:
        raise LaunchEnvironmentError(
            f"inconsistent launcher variables: rank {rank} with world size {world}"
        )
    if world == 1:
        source = "single" if source != "torchrun" else source
    return LaunchEnvironment(
        rank=rank,
        world_size=world,
        local_rank=local_rank,
        local_world_size=local_world,
        master_addr=addr,
        master_port=port,
        source=source,
        launch_config=launch_config,
        debug=debug,
        restart_count=restart_count,
        agent_store=agent_store,
    )


def debug_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether :data:`DEBUG_VARIABLE` asks for collective checking."""
    return _flag(os.environ if environ is None else environ, DEBUG_VARIABLE)


def default_config_file(environ: Mapping[str, str] | None = None) -> Path:
    """``$SLIPSTREAM_CONFIG_FILE`` or ``~/.cache/slipstream/default_config.yaml``."""
    env = os.environ if environ is None else environ
    override = env.get(CONFIG_FILE_VARIABLE)
    if override:
        return Path(override).expanduser()
    cache = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / "slipstream" / "default_config.yaml"


def error_file() -> str | None:
    """The file torchrun asked this worker to write its exception into, if any."""
    return os.environ.get(ERROR_FILE_VARIABLE) or None


def debug_watchdog() -> bool:
    """``SLIPSTREAM_DEBUG_WATCHDOG``: say why a hang watchdog stopped (for its developers)."""
    return bool(os.environ.get("SLIPSTREAM_DEBUG_WATCHDOG"))


def hang_timeout_from_environment() -> float | None:
    """:data:`HANG_TIMEOUT_VARIABLE` in seconds, if set."""
    raw = os.environ.get(HANG_TIMEOUT_VARIABLE, "").strip()
    if not raw:
        return None
    try:
        return float(raw)
    except ValueError:
        raise LaunchEnvironmentError(
            f"{HANG_TIMEOUT_VARIABLE}={raw!r} is not a number of seconds; unset it or set e.g. 600"
        ) from None


def report_dir() -> str | None:
    """The folder the launcher collects hang reports in (``None`` without ``slipstream
    launch``)."""
    return os.environ.get(REPORT_DIR_VARIABLE) or None


def enable_flight_recorder(entries: int) -> None:
    """Have torch record the last ``entries`` collectives of each process group formed from
    now on (its Flight Recorder, read by hang reports). The user's own setting wins."""
    if entries > 0 and not any(name in os.environ for name in FLIGHT_RECORDER_VARIABLES):
        os.environ[FLIGHT_RECORDER_VARIABLES[0]] = str(entries)


def export_for_workers(launch_config: Mapping[str, Any], extra: Mapping[str, str]) -> None:
    """Set the variables the launched workers inherit (called by the launcher only)."""
    os.environ[LAUNCH_CONFIG_VARIABLE] = json.dumps(dict(launch_config), sort_keys=True)
    os.environ.update(extra)


#: Set by a process that starts copies of its own script (Lightning's script launcher):
#: its pid, so the copies know whom to outlive not.
SPAWNER_VARIABLE = "SLIPSTREAM_SPAWNER_PID"


def mark_as_spawner() -> None:
    """Tell the processes this one is about to start that it is their spawner."""
    os.environ[SPAWNER_VARIABLE] = str(os.getpid())


def spawner_pid() -> int | None:
    """The process that started this one as a copy of its script, if it said so."""
    raw = os.environ.get(SPAWNER_VARIABLE, "")
    return int(raw) if raw.isdecimal() else None


def provide_local_rank() -> None:
    """Set ``LOCAL_RANK=0`` for a single process started without a launcher: DeepSpeed
    reads it from the environment and refuses to start without it."""
    os.environ.setdefault("LOCAL_RANK", "0")


def connect_gloo_lazily() -> None:
    """Let gloo connect the processes at their first collective, not when the group is
    formed (torch's ``TORCH_GLOO_LAZY_INIT``): forming a group then never waits for peers,
    as with NCCL on GPUs, so a notebook worker that ends without communicating cannot leave
    another waiting. The user's own setting wins."""
    os.environ.setdefault("TORCH_GLOO_LAZY_INIT", "1")


#: torch_xla's runtime choice (``TPU``, ``CPU``, ``CUDA``); set, it also asks slipstream to
#: run on the XLA device when torch_xla is installed.
PJRT_DEVICE_VARIABLE = "PJRT_DEVICE"


def pjrt_device(environ: Mapping[str, str] | None = None) -> str | None:
    """:data:`PJRT_DEVICE` (upper-cased), if set."""
    env = os.environ if environ is None else environ
    value = env.get(PJRT_DEVICE_VARIABLE, "").strip()
    return value.upper() or None


def xla_variables(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that steer torch_xla's runtime (for ``slipstream env``)."""
    env = os.environ if environ is None else environ
    names = ("PJRT_DEVICE", "CPU_NUM_DEVICES", "TPU_VISIBLE_CHIPS", "XLA_FLAGS", "XLA_USE_BF16")
    return {name: env[name] for name in names if env.get(name)}


def slurm_job_id() -> str | None:
    """The SLURM job this process belongs to, if any (for requeueing it)."""
    return os.environ.get("SLURM_JOB_ID") or None


def visible_gpu_ids() -> str | None:
    """``CUDA_VISIBLE_DEVICES`` (``""``: no GPU; ``None``: not set, every GPU)."""
    return os.environ.get("CUDA_VISIBLE_DEVICES")


def cpu_threads_requested() -> int | None:
    """The thread count ``OMP_NUM_THREADS`` asks for (``None`` when unset or not a count)."""
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


def is_set(name: str) -> bool:
    """Whether an environment variable is present (used for torch's own knobs)."""
    return name in os.environ


#: Accelerate's launcher hands the layout to its workers in these (``accelerate launch
#: --parallelism_config_tp_size 2`` or a config file's ``parallelism_config`` block).
PARALLELISM_PREFIX = "PARALLELISM_CONFIG_"


def parallelism_environment() -> dict[str, str]:
    """``PARALLELISM_CONFIG_*`` by option: ``PARALLELISM_CONFIG_TP_SIZE=2`` -> ``{"tp_size": "2"}``."""
    return {
        key.removeprefix(PARALLELISM_PREFIX).lower(): value
        for key, value in os.environ.items()
        if key.startswith(PARALLELISM_PREFIX)
    }


def device_override() -> str | None:
    """Accelerate's ``ACCELERATE_TORCH_DEVICE``: the device every process uses, if set."""
    return os.environ.get("ACCELERATE_TORCH_DEVICE") or None


def accelerate_layout_requested() -> bool:
    """Whether ``accelerate launch`` set ``ACCELERATE_USE_PARALLELISM_CONFIG=true``."""
    return os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "").lower() in _YES


def dynamo_environment() -> dict[str, str]:
    """``accelerate launch``'s ``torch.compile`` settings (``ACCELERATE_DYNAMO_BACKEND`` ->
    ``{"backend": ...}``, ``MODE``, ``USE_FULLGRAPH``, ``USE_DYNAMIC``)."""
    prefix = "ACCELERATE_DYNAMO_"
    return {
        k.removeprefix(prefix).lower(): v for k, v in os.environ.items() if k.startswith(prefix)
    }


def agent_logs_requested(environ: Mapping[str, str] | None = None) -> bool:
    """Whether the user asked to see torchrun's agent logs: torch's own ``LOGLEVEL`` (or
    ``SLIPSTREAM_LOG_LEVEL``) at ``INFO`` or ``DEBUG``. ``slipstream launch`` otherwise hides
    the agent's lines about stopping and failed workers, which its own summary replaces."""
    env = os.environ if environ is None else environ
    levels = (env.get("LOGLEVEL", ""), env.get("SLIPSTREAM_LOG_LEVEL", ""))
    return any(level.strip().upper() in ("DEBUG", "INFO") for level in levels)


def log_level_from_environment() -> str | None:
    """``SLIPSTREAM_LOG_LEVEL`` (or Accelerate's ``ACCELERATE_LOG_LEVEL``), if set."""
    return os.environ.get("SLIPSTREAM_LOG_LEVEL") or os.environ.get("ACCELERATE_LOG_LEVEL") or None


#: Per-step fault tolerance: the replica group a process belongs to and the torchft
#: lighthouse, set for each group by ``slipstream launch --fault_tolerance``.
FT_REPLICA_ID_VARIABLE = "SLIPSTREAM_FT_REPLICA_ID"
FT_LIGHTHOUSE_VARIABLE = "SLIPSTREAM_FT_LIGHTHOUSE"
#: A file the launcher creates once a replica group has finished the training: a group
#: restarted after that finds no one to recover from and stops instead of starting over.
FT_FINISHED_VARIABLE = "SLIPSTREAM_FT_FINISHED"


def fault_tolerance_environment() -> dict[str, str | None]:
    """The launcher's replica group name, lighthouse address (torchft's own
    ``TORCHFT_LIGHTHOUSE`` too) and job-finished mark; ``None`` where unset."""
    return {
        "replica_id": os.environ.get(FT_REPLICA_ID_VARIABLE) or None,
        "lighthouse": os.environ.get(FT_LIGHTHOUSE_VARIABLE)
        or os.environ.get("TORCHFT_LIGHTHOUSE")
        or None,
        "finished_file": os.environ.get(FT_FINISHED_VARIABLE) or None,
    }


def child_environment(extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment plus ``extra``, for a child process started with its own
    variables (a replica group of a fault-tolerant launch)."""
    return {**os.environ, **extra}
