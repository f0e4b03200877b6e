"""tests/warm_commands.py: a command run in a fork of the warm server behaves as the same
command started fresh — each probe runs both ways and must print the same."""

from __future__ import annotations

import contextlib
import json
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from tests.distributed import run_python

#: What a fresh interpreter shows a script: its arguments, paths, environment, __main__,
#: signal handlers and thread count; then it starts a non-daemon thread and registers an exit
#: handler, both of which must run before the process ends.
PROBE = textwrap.dedent(
    """
    import atexit, json, os, signal, sys, threading, time
    import torch

    def late():
        time.sleep(0.3)
        print("thread finished", flush=True)

    seen = {
        "argv": sys.argv,
        "path0": sys.path[0],
        "cwd": os.getcwd(),
        "variable": os.environ.get("PROBE_VARIABLE"),
        "slipstream_variables": sorted(k for k in os.environ if k.startswith("SLIPSTREAM_")),
        "main": __name__,
        "main_names": sorted(n for n in dir(sys.modules["__main__"]) if not n.startswith("__")),
        "sigterm": signal.getsignal(signal.SIGTERM) == signal.SIG_DFL,
        "threads": torch.get_num_threads(),
        "stdin": sys.stdin.read(),
    }
    print(json.dumps(seen))
    threading.Thread(target=late).start()
    atexit.register(lambda: print("exit handler ran", flush=True))
    code = sys.argv[-1]
    if code == "message":
        sys.exit("stopped with a message")
    if code == "raise":
        raise ValueError("uncaught")
    sys.exit(int(code))
    """
)


def _both(*arguments: str, cwd: Path, env: dict[str, str]) -> list[subprocess.CompletedProcess]:
    return [run_python(*arguments, cwd=cwd, env=env, fresh=fresh) for fresh in (False, True)]


@pytest.mark.parametrize("ending", ["0", "3", "message", "raise"])
def test_a_script_sees_what_a_fresh_interpreter_shows_it(tmp_path: Path, ending: str):
    script = tmp_path / "scripts" / "probe.py"
    script.parent.mkdir()
    script.write_text(PROBE)
    env = {"PROBE_VARIABLE": "set", "OMP_NUM_THREADS": "1"}
    warm, fresh = _both(str(script), "an argument", ending, cwd=tmp_path, env=env)
    assert warm.returncode == fresh.returncode == {"0": 0, "3": 3}.get(ending, 1)
    assert warm.stdout == fresh.stdout
    first = json.loads(warm.stdout.splitlines()[0])
    assert first["argv"] == [str(script), "an argument", ending]
    assert first["path0"] == str(script.parent) and first["cwd"] == str(tmp_path)
    assert (first["variable"], first["threads"], first["stdin"]) == ("set", 1, "")
    assert first["sigterm"] and first["slipstream_variables"] == []
    assert warm.stdout.splitlines()[1:] == ["thread finished", "exit handler ran"]
    if ending == "message":
        assert warm.stderr == fresh.stderr == "stopped with a message\n"
    if ending == "raise":
        assert warm.stderr.splitlines()[-1] == "ValueError: uncaught"
        assert "Traceback (most recent call last):" in warm.stderr


def test_module_and_code_arguments_start_as_python_m_and_python_c(tmp_path: Path):
    (tmp_path / "probe_module.py").write_text(PROBE)
    for arguments in (["-m", "probe_module", "0"], ["-c", PROBE, "0"]):
        warm, fresh = _both(*arguments, cwd=tmp_path, env={})
        assert warm.returncode == fresh.returncode == 0, warm.stderr + fresh.stderr
        assert warm.stdout == fresh.stdout
        assert json.loads(warm.stdout.splitlines()[0])["path0"] == (
            "" if "-c" in arguments else str(tmp_path)
        )


def test_ctrl_c_interrupts_a_command_as_in_a_terminal():
    """(A fresh process started by a pytest-xdist worker inherits the worker's ignored
    SIGINT; a command started from a shell, and a warm one, get Python's own handler.)"""
    code = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    assert run_python("-c", code).stdout == "True\n"


def test_commands_a_fork_cannot_stand_in_for_start_fresh(tmp_path: Path):
    """Each command's torch is seeded anew; an interpreter option, or a variable read while
    the interpreter starts, gets a fresh process (one that has not imported torch yet)."""
    code = "import sys, torch; print('torch' in sys.modules, torch.rand(1).item())"
    preloaded = "import sys; print('torch' in sys.modules)"
    first, second = (run_python("-c", code).stdout.split() for _ in range(2))
    assert first[0] == second[0] == "True" and first[1] != second[1], "a new seed each time"
    assert run_python("-c", preloaded, env={"PYTHONHASHSEED": "7"}).stdout == "False\n"
    assert run_python("-u", "-c", preloaded).stdout == "False\n"
    assert run_python("-c", preloaded, fresh=True).stdout == "False\n"


def test_a_command_past_its_timeout_is_killed_and_the_next_runs(tmp_path: Path):
    with pytest.raises(subprocess.TimeoutExpired):
        run_python("-c", "import time; print('started', flush=True); time.sleep(60)", timeout=2)
    after = run_python("-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)")
    assert after.returncode == -15, "killed by a signal: negative, as subprocess says"
    assert run_python("-c", "print('next')").stdout == "next\n"


def test_a_started_command_merges_its_output_and_dies_with_its_session(tmp_path: Path):
    """What run_fault_tolerant_job needs of a started launcher: stderr after stdout in one
    stream, and a session whose every process one killpg ends."""
    from tests.distributed import REPO, _warm_command_server, command_environment

    variables = command_environment()
    server = _warm_command_server(variables)
    assert server is not None
    code = (
        "import subprocess, sys, time\n"
        "print('out', flush=True); print('err', file=sys.stderr, flush=True)\n"
        f"child = subprocess.Popen(['sleep', '60']); open({str(tmp_path / 'pid')!r}, 'w')"
        ".write(str(child.pid))\n"
        "time.sleep(60)\n"
    )
    job = server.start(("-c", code), variables, REPO, merge_output=True, new_session=True)
    assert job is not None
    while not (tmp_path / "pid").exists() or not (tmp_path / "pid").read_text():
        assert job.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        job.communicate(timeout=0.5)
    job.kill()
    assert job.communicate() == ("out\nerr\n", "") and job.returncode == -9
    grandchild = Path(f"/proc/{(tmp_path / 'pid').read_text()}/stat")
    deadline = time.monotonic() + 10
    while grandchild.exists() and time.monotonic() < deadline:  # killed, then reaped by init
        with contextlib.suppress(OSError):
            if grandchild.read_text().split()[2] in ("Z", "X"):
                break
        time.sleep(0.05)
    else:
        assert not grandchild.exists(), "the session's other process outlived the kill"
