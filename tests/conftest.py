from __future__ import annotations

import contextlib
import gc
import hashlib
import importlib.util
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from slipstream.runtime.state import set_current_state
from tests.distributed import s3_server

# The order pytest-xdist workers take the files in (longest first) and --record-file-seconds.
pytest_plugins = ["tests.scheduling"]

# DeepSpeed JIT-compiles a small communication op on CPU the first time (about a minute);
# keep the build between test runs, one folder per Python environment: the build's include
# paths name the environment, so two clones' venvs sharing a folder would each rebuild it in
# turn, and a test killed mid-build leaves a lock the other clone's tests wait on.
os.environ.setdefault(
    "TORCH_EXTENSIONS_DIR",
    str(
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
        / "slipstream"
        / "torch_extensions"
        / hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
    ),
)
_deepspeed_build: subprocess.Popen[bytes] | None = None


def pytest_configure(config: pytest.Config) -> None:
    """On pytest-xdist workers (`-n 2`), keep each file's tests on one worker (`--dist
    loadfile`) unless the command line chooses a mode: a file's tests share module-scoped
    launches, which `--dist load` would start once per worker. Set here rather than in
    pyproject's addopts so that pytest without pytest-xdist (the XLA lane, a bare venv)
    still accepts the project's options."""
    if getattr(config.option, "dist", "no") != "load":
        return
    given = [*config.invocation_params.args, *os.environ.get("PYTEST_ADDOPTS", "").split()]
    if not any(str(arg).startswith("--dist") or arg == "-d" for arg in given):
        config.option.dist = "loadfile"
        # In tests/scheduling.py's order (longest file first), not by number of tests.
        config.option.loadscopereorder = False


#: The repository's packages that the suite's processes import (the installed ones have
#: their bytecode caches from pip).
BYTECODE_FOLDERS = ("core", "integrations", "tests", "benchmarks")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionstart(session: pytest.Session) -> None:
    """Write the checkout's bytecode caches once, before the pytest-xdist workers start, as
    installing a wheel does: under ``PYTHONDONTWRITEBYTECODE=1`` (set on CI machines) every
    process the suite starts would otherwise compile what it imports of the checkout from
    source, a few hundred of them. Python reads caches whatever that variable says."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    import compileall

    root = Path(__file__).resolve().parent.parent
    for folder in BYTECODE_FOLDERS:
        compileall.compile_dir(root / folder, quiet=1)


def pytest_collection_finish(session: pytest.Session) -> None:
    # Freeze the heap collection left (every test module and what it imports, about a
    # million objects): each full garbage collection, which tests and the library's memory
    # helpers run, would otherwise scan it again (~1 s of CPU).
    gc.collect()
    gc.freeze()
    _start_deepspeed_build(session)


def _start_deepspeed_build(session: pytest.Session) -> None:
    """Build DeepSpeed's CPU communication op in the background while the first tests run,
    when the chosen tests use DeepSpeed and the build is not cached: the first DeepSpeed test
    would otherwise spend its timeout compiling."""
    global _deepspeed_build
    if os.environ.get("PYTEST_XDIST_WORKER", "gw0") != "gw0":
        return  # with pytest-xdist, one worker builds it
    folder = Path(os.environ["TORCH_EXTENSIONS_DIR"]) / "deepspeed_shm_comm"
    _remove_stale_build_lock(folder / "lock")
    if (folder / "deepspeed_shm_comm.so").exists() or importlib.util.find_spec("deepspeed") is None:
        return
    files = {item.path for item in session.items}
    if not any("deepspeed" in path.read_text(errors="ignore").lower() for path in files):
        return
    _deepspeed_build = subprocess.Popen(
        [sys.executable, "-c", "from deepspeed.comm.torch import build_shm_op; build_shm_op()"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""},
    )


#: A build takes about a minute and a half of CPU; a lock older than this was left by a
#: build that was killed, and torch would wait for it forever (every DeepSpeed test timing out).
STALE_BUILD_LOCK_SECONDS = 15 * 60


def _remove_stale_build_lock(lock: Path) -> None:
    with contextlib.suppress(OSError):
        if time.time() - lock.stat().st_mtime > STALE_BUILD_LOCK_SECONDS:
            lock.unlink()


def pytest_sessionfinish(session: pytest.Session) -> None:
    # Never leave the build half done: its lock file would stall the next build.
    if _deepspeed_build is not None:
        _deepspeed_build.wait()


# The suite is written for the CPU (its tensors, tolerances and gloo process groups): on a
# GPU machine it hides the GPUs, so the whole suite runs there too. SLIPSTREAM_TEST_CUDA=1
# shows them (the CUDA tests, which skip otherwise; benchmarks/gpu_check.py covers the
# CUDA paths in one run).
if os.environ.get("SLIPSTREAM_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""


# One CPU thread per process, in this process and every process a test starts (unless the
# developer chose a count): the suite runs on 2 pytest workers whose tests start processes
# of their own, so the cores are taken already, and OpenMP threads idling between parallel
# regions spin: a one-process example run cost twice the CPU with 2 threads, for the same
# numbers. The launcher's own choice (cores / processes) is tested without it.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(autouse=True)
def _fresh_process_state() -> Iterator[None]:
    """Each test builds its own Accelerator / ProcessState from scratch."""
    set_current_state(None)
    yield
    set_current_state(None)


@pytest.fixture(scope="session")
def s3_environment() -> Iterator[dict[str, str]]:
    """Variables pointing s3:// at a moto server on 127.0.0.1 (started once)."""
    pytest.importorskip("s3fs")
    import fsspec.config

    with s3_server() as variables:
        saved = {k: os.environ.get(k) for k in variables}
        os.environ.update(variables)
        # fsspec reads FSSPEC_* variables when imported; this process imported it already.
        s3_options = fsspec.config.conf.setdefault("s3", {})
        s3_options["endpoint_url"] = variables["FSSPEC_S3_ENDPOINT_URL"]
        try:
            yield variables
        finally:
            s3_options.pop("endpoint_url", None)
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value


@pytest.fixture
def s3_bucket(s3_environment: dict[str, str], request: pytest.FixtureRequest) -> str:
    """A fresh bucket; returns its s3:// URL."""
    import fsspec

    name = (
        "test-"
        + request.node.name.lower().replace("_", "-").replace("[", "-").replace("]", "")[:40]
    )
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    if not fs.exists(name):
        fs.mkdir(name)
    return f"s3://{name}"
