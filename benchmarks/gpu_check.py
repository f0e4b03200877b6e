"""GPU readiness check: one command that proves slipstream's CUDA paths, check by check.

    python benchmarks/gpu_check.py            # every check; under 10 minutes on one GPU
    python benchmarks/gpu_check.py --quick    # small sizes; runs on CPU-only machines too
    python benchmarks/gpu_check.py --list     # the checks, what each proves, its time budget
    python benchmarks/gpu_check.py --only fsdp2 zero3 --report out/gpu_check.json

Each check prints one line, ``STATUS name elapsed/budget detail`` (PASS, FAIL or SKIP with
the reason), then a summary; the exit code is 1 if any check failed. A JSON report (and the
same table as Markdown beside it) is rewritten after every check, so even a run stopped
from outside leaves what it found.

Checks run in worker processes (checks of one group share one), so a check that hangs is
killed at its time budget and one that crashes the process (a CUDA error poisons it) costs
only itself: the remaining checks continue in a fresh worker. A global deadline (``--deadline``)
skips what would not finish in time. Nothing is installed: what a check needs and does not
find (DeepSpeed, torchao, a second GPU) makes it SKIP and say so. On a machine without CUDA
the checks that only mean something on a GPU SKIP; the others run on the CPU, so this mode
(the test suite runs it) exercises the same code.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime
import json
import os
import platform
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
RESULTS = HERE / "results"
#: Lines a worker prints for the parent: ``@@gpu_check start NAME`` and ``... result {json}``.
PROTOCOL = "@@gpu_check "
#: Seconds a worker may take to start (import torch, initialise CUDA) before its first check.
WORKER_START_BUDGET = 120.0
#: Default deadline for the whole run: the device tool stops a command at 600 s.
DEFAULT_DEADLINE = 540.0
#: A check is not started with less time than this left before the deadline.
MIN_TIME_LEFT = 15.0
#: After SIGTERM, how long a killed worker (and the launchers under it) may take to stop.
KILL_GRACE = 10.0
#: Lines of a failed check's output kept in the report (and fewer printed).
TAIL_LINES = 60
PRINTED_TAIL_LINES = 15
# Variables that would make a worker think it is one rank of a launched job.
_LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)


@dataclass(frozen=True)
class Check:
    """A check of gpu_check_cases.py (the function ``check_NAME``), with the most seconds it
    may take on one GPU (first-time compilation included) and its worker group: DeepSpeed,
    torch.compile and the memory and timing figures run in processes of their own, so that
    nothing one check leaves behind changes another's figures."""

    name: str
    budget: float
    group: str
    proves: str


# In running order: what every later check relies on first, the launchers last.
CHECKS = [
    Check("environment", 60, "core",
          "torch, CUDA, NCCL, GPUs and packages; this checkout's slipstream; one kernel runs"),
    Check("device_placement", 60, "core",
          "Accelerator() picks cuda:0; model, optimizer state, batches, gathers on it; cpu=True"),
    Check("bf16_autocast", 60, "core",
          "bf16 autocast: bf16 matmuls, fp32 outputs and weights, close to fp32 training"),
    Check("fp16_grad_scaler", 60, "core",
          "fp16 with a GradScaler: an overflow step is skipped, scale backs off, scheduler held"),
    Check("true_half", 60, "core",
          "bf16-true and fp16-true: half weights and gradients, fp32 outputs, a finite step"),
    Check("fp8_error", 30, "core",
          "where fp8 cannot run (no torchao, compute capability < 8.9, CPU): a clear error"),
    Check("fp8_training", 90, "core",
          "fp8 through torchao Float8Linear on compute capability >= 8.9: 20 steps learn"),
    Check("fsdp2", 120, "core",
          "FSDP2 with world size 1 on the GPU: DTensor shards, parity, sharded save/load, bf16"),
    Check("mesh_tp", 120, "core",
          "ParallelismConfig mesh on the GPU, TP styles and the DTensor clip on a 1-GPU mesh"),
    Check("checkpoint_roundtrip", 90, "core",
          "save_state/load_state with CUDA tensors and RNG states: resume equals straight run"),
    Check("zero1", 240, "deepspeed",
          "DeepSpeed ZeRO-1 with torch AdamW on the GPU (budget covers DeepSpeed's first use)"),
    Check("zero2", 90, "deepspeed",
          "DeepSpeed ZeRO-2 with torch AdamW on the GPU matches plain training"),
    Check("zero3", 120, "deepspeed",
          "DeepSpeed ZeRO-3 with torch AdamW on the GPU matches plain training; a bf16 step"),
    Check("estimate_memory", 180, "memory",
          "estimate-memory vs torch.cuda.max_memory_allocated for DDP/FSDP2/ZeRO-3 (ratio)"),
    Check("ddp_overhead", 180, "timing",
          "ddp_overhead.py's paired step times on one GPU: slipstream vs hand-written loop"),
    Check("torch_compile", 240, "compile",
          "dynamo_backend='inductor': compiled training matches eager; compile and step time"),
    Check("cli_test", 180, "launch",
          "`slipstream test` with no config: one process per GPU, the sanity checks pass"),
    Check("multi_process", 300, "launch",
          "with >= 2 GPUs, over NCCL on all of them: DDP parity, FSDP2, ZeRO-3, tp2"),
    Check("suite_on_gpu", 180, "launch",
          "the suite's CUDA tests, and multi-process tests that must choose the CPU on 1 GPU"),
]  # fmt: skip


@dataclass
class Outcome:
    """One check's result as the parent records it."""

    name: str
    status: str  # PASS, FAIL or SKIP
    seconds: float
    budget: float
    detail: str
    metrics: dict[str, Any] = field(default_factory=dict)
    output_tail: list[str] = field(default_factory=list)
    traceback: str | None = None

    def line(self) -> str:
        return (
            f"{self.status:<4}  {self.name:<22} {self.seconds:6.1f}s /{self.budget:4.0f}s  "
            f"{self.detail}"
        )

    def as_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "name": self.name,
            "status": self.status,
            "seconds": round(self.seconds, 2),
            "budget_s": self.budget,
            "detail": self.detail,
            "metrics": self.metrics,
        }
        if self.status == "FAIL":
            data["output_tail"] = self.output_tail
            data["traceback"] = self.traceback
        return data


# -- the worker side ---------------------------------------------------------------------------
def _send(kind: str, payload: Any) -> None:
    # default=str: a metric json cannot write must not cost the check its result.
    print(PROTOCOL + kind + " " + json.dumps(payload, default=str), flush=True)


def worker_main(names: list[str], quick: bool, scratch: Path, injected: dict[str, str]) -> int:
    """Run ``names`` in order in this process, announcing each; stop after a failure (the
    parent continues in a fresh process: a failed CUDA check may have poisoned this one)."""
    import traceback

    import gpu_check_cases as cases

    cases.stop_when_orphaned()
    context = cases.Context(quick=quick, scratch=scratch)
    for name in names:
        run = getattr(cases, f"check_{name}")
        _send("start", name)
        started = time.perf_counter()
        status, metrics, trace = "PASS", {}, None
        try:
            cases.fresh_state()
            _inject(injected.get(name))
            result = run(context)
            detail, metrics = result.detail, result.metrics
        except cases.Skip as skip:
            status, detail = "SKIP", str(skip)
        except BaseException as error:  # a check's failure, whatever it raised
            status = "FAIL"
            detail = f"{type(error).__name__}: {_first_line(error)}"
            trace = traceback.format_exc()
            print(trace, flush=True)
        seconds = time.perf_counter() - started
        _send(
            "result",
            {"name": name, "status": status, "detail": detail, "metrics": metrics,
             "seconds": seconds, "traceback": trace},
        )  # fmt: skip
        if status == "FAIL":
            return 3
        with contextlib.suppress(Exception):
            cases.fresh_state()
    return 0


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return text[0] if text else "(no message)"


def _inject(fault: str | None) -> None:
    """Faults the harness's own tests ask for (``--inject NAME=fail|hang|crash``)."""
    if fault == "fail":
        raise AssertionError("failure injected with --inject")
    if fault == "hang":
        while True:
            time.sleep(1)
    if fault == "crash":
        os._exit(7)


# -- the parent side ---------------------------------------------------------------------------
class Worker:
    """A worker process running some checks; its output arrives line by line on a queue."""

    def __init__(self, command: list[str], env: dict[str, str]) -> None:
        # A process group of its own (not a session: the device machine's cleanup must
        # still find it), so a kill reaches the launchers and processes it started.
        group: dict[str, Any] = (
            {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
        )
        self.process = subprocess.Popen(
            command,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
            env=env,
            cwd=REPO,
            **group,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        assert self.process.stdout is not None
        threading.Thread(target=self._read, args=(self.process.stdout,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def kill(self) -> None:
        """SIGTERM the worker's process group (torchrun's agent passes it on to its workers),
        then SIGKILL whatever is left after a grace period."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(KILL_GRACE)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()


class Run:
    """The parent: starts workers, enforces budgets, prints lines and keeps the report."""

    def __init__(self, args: argparse.Namespace, checks: list[Check]) -> None:
        self.args = args
        self.checks = checks
        # What the environment check reports replaces this; torch is not imported here,
        # so that listing the checks or a usage error costs no torch start.
        self.machine: dict[str, Any] = {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
        }
        self.outcomes: list[Outcome] = []
        self.started = time.monotonic()
        self.started_at = _now()
        self.deadline = self.started + args.deadline
        self.scratch = Path(tempfile.mkdtemp(prefix="gpu_check_"))
        self.env = _worker_environment(self.scratch)

    def time_left(self) -> float:
        return self.deadline - time.monotonic()

    def budget(self, check: Check) -> float:
        return float(self.args.budget.get(check.name, check.budget))

    def execute(self) -> None:
        for batch in _batches(self.checks, self.args.quick):
            pending = list(batch)
            while pending:
                if self.time_left() < MIN_TIME_LEFT:
                    for check in pending:
                        self.record(
                            Outcome(check.name, "SKIP", 0.0, self.budget(check),
                                    f"out of time: the {self.args.deadline:.0f} s deadline")
                        )  # fmt: skip
                    break
                done = self.run_worker(pending)
                pending = [check for check in pending if check.name not in done]

    def run_worker(self, checks: list[Check]) -> set[str]:
        """Run ``checks`` in one worker until they are done or it dies; the names done."""
        names = [check.name for check in checks]
        by_name = {check.name: check for check in checks}
        command = [sys.executable, str(HERE / "gpu_check.py"), "--worker", *names,
                   "--scratch", str(self.scratch)]  # fmt: skip
        command += ["--quick"] if self.args.quick else []
        command += [f"--inject={k}={v}" for k, v in self.args.inject.items() if k in by_name]
        worker = Worker(command, self.env)
        done: set[str] = set()
        current: str | None = None
        tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        began = time.monotonic()
        limit = began + min(WORKER_START_BUDGET, self.time_left())
        while True:
            try:
                line = worker.lines.get(timeout=max(0.0, limit - time.monotonic()))
            except queue.Empty:
                worker.kill()
                if current is None:
                    self.fail_rest(checks, done, "the worker did not start a check within "
                                   f"{WORKER_START_BUDGET:.0f} s", list(tail), began)  # fmt: skip
                    return {check.name for check in checks}
                budget = self.budget(by_name[current])
                reason = (
                    f"exceeded its budget of {budget:.0f} s and was stopped"
                    if limit - began >= budget
                    else f"stopped at the run's {self.args.deadline:.0f} s deadline"
                )
                self.record(self.failure(current, reason, tail, began))
                done.add(current)
                return done
            if line is None:  # the worker exited
                code = worker.process.wait()
                if current is not None:
                    reason = f"the worker process died during the check (exit code {code})"
                    self.record(self.failure(current, reason, tail, began))
                    done.add(current)
                elif not done or code not in (0, 3):
                    self.fail_rest(checks, done, f"the worker exited with code {code}",
                                   list(tail), began)  # fmt: skip
                    return {check.name for check in checks}
                return done
            message = _protocol_message(line)
            if message is not None:
                kind, data = message
                if kind == "start":
                    current, began = data, time.monotonic()
                    tail.clear()
                    limit = began + min(self.budget(by_name[current]), self.time_left())
                elif kind == "result":
                    self.record(
                        Outcome(
                            data["name"], data["status"], data["seconds"],
                            self.budget(by_name[data["name"]]), data["detail"], data["metrics"],
                            list(tail), data["traceback"],
                        )
                    )  # fmt: skip
                    done.add(data["name"])
                    current = None
                    limit = time.monotonic() + min(WORKER_START_BUDGET, self.time_left())
                continue
            tail.append(line)
            if self.args.verbose:
                print(f"    | {line}", flush=True)

    def failure(
        self, name: str, reason: str, tail: collections.deque[str], began: float
    ) -> Outcome:
        budget = self.budget(next(c for c in self.checks if c.name == name))
        return Outcome(name, "FAIL", time.monotonic() - began, budget, reason, {}, list(tail))

    def fail_rest(
        self, checks: list[Check], done: set[str], reason: str, tail: list[str], began: float
    ) -> None:
        for check in checks:
            if check.name not in done:
                seconds = time.monotonic() - began
                self.record(Outcome(check.name, "FAIL", seconds, self.budget(check), reason,
                                    {}, tail))  # fmt: skip

    def record(self, outcome: Outcome) -> None:
        self.outcomes.append(outcome)
        if outcome.name == "environment" and outcome.status == "PASS":
            self.machine = outcome.metrics
        print(outcome.line(), flush=True)
        if outcome.status == "FAIL":
            shown = (outcome.traceback or "").strip().splitlines() or outcome.output_tail
            for line in shown[-PRINTED_TAIL_LINES:]:
                print(f"        {line}", flush=True)
        self.write_report()

    # -- the report ------------------------------------------------------------------------
    def counts(self) -> dict[str, int]:
        statuses = [outcome.status for outcome in self.outcomes]
        return {
            "passed": statuses.count("PASS"),
            "failed": statuses.count("FAIL"),
            "skipped": statuses.count("SKIP"),
        }

    def report(self) -> dict[str, Any]:
        return {
            "script": "benchmarks/gpu_check.py",
            "mode": "quick" if self.args.quick else "full",
            "command": [Path(sys.argv[0]).name, *sys.argv[1:]],
            "started": self.started_at,
            "finished": _now(),
            "seconds": round(time.monotonic() - self.started, 1),
            "deadline_s": self.args.deadline,
            "budgets_s": {check.name: self.budget(check) for check in self.checks},
            "machine": self.machine,
            "checks": [outcome.as_dict() for outcome in self.outcomes],
            "summary": self.counts(),
        }

    def write_report(self) -> None:
        path = self.args.report
        path.parent.mkdir(parents=True, exist_ok=True)
        report = self.report()
        for target, text in (
            (path, json.dumps(report, indent=2) + "\n"),
            (path.with_suffix(".md"), markdown(report)),
        ):
            partial = target.with_name(target.name + ".partial")
            partial.write_text(text)
            partial.replace(target)  # atomic: a reader never sees half a report


def markdown(report: dict[str, Any]) -> str:
    """The report as a Markdown table (for benchmarks/README)."""
    machine = report["machine"]
    gpus = machine.get("gpus") or []
    where = (
        ", ".join(f"{g['name']} (cc {g['capability']}, {g['memory_gib']:.0f} GiB)" for g in gpus)
        or "no GPU"
    )
    counts = report["summary"]
    lines = [
        f"`benchmarks/gpu_check.py` ({report['mode']} mode), {report['started']}: {where}; "
        f"torch {machine.get('torch')}, CUDA {machine.get('cuda') or '-'}; "
        f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped "
        f"in {report['seconds']:.0f} s.",
        "",
        "| check | result | time | detail |",
        "|---|---|---|---|",
    ]
    for check in report["checks"]:
        detail = check["detail"].replace("|", "/")
        lines.append(
            f"| {check['name']} | {check['status']} | {check['seconds']:.1f} s "
            f"(budget {check['budget_s']:.0f} s) | {detail} |"
        )
    return "\n".join(lines) + "\n"


def _protocol_message(line: str) -> tuple[str, Any] | None:
    """``(kind, data)`` of a worker's protocol line; None for any other output."""
    if not line.startswith(PROTOCOL):
        return None
    kind, _, payload = line[len(PROTOCOL) :].partition(" ")
    if kind not in ("start", "result"):
        return None
    try:
        return kind, json.loads(payload)
    except json.JSONDecodeError:
        return None


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _batches(checks: list[Check], quick: bool) -> list[list[Check]]:
    """Consecutive checks of one group share a worker process; in the quick mode, whose
    figures mean nothing, all of them do (one start of torch instead of six)."""
    batches: list[list[Check]] = []
    for check in checks:
        if batches and (quick or batches[-1][0].group == check.group):
            batches[-1].append(check)
        else:
            batches.append([check])
    return batches


def _worker_environment(scratch: Path) -> dict[str, str]:
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in _LAUNCHER_VARIABLES and not key.startswith("SLIPSTREAM_")
    }
    env["PYTHONUNBUFFERED"] = "1"
    # DeepSpeed JIT-compiles ops into this folder on first use (on CPU: its shared-memory
    # communication op); inside the checkout a second run on the same machine reuses it.
    env.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".torch_extensions"))
    # A user's default slipstream config must not change what the checks run.
    env["SLIPSTREAM_CONFIG_FILE"] = str(scratch / "no-config.yaml")
    path = _slipstream_path(scratch)
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [path, env.get("PYTHONPATH")]))
    return env


def _slipstream_path(scratch: Path) -> str | None:
    """A folder to put on PYTHONPATH when ``slipstream`` is not installed from this checkout
    (a fresh GPU machine): there ``slipstream`` is a link to core/, so the workers import
    this checkout's code without installing anything."""
    import importlib.util

    spec = importlib.util.find_spec("slipstream")
    origin = Path(spec.origin).resolve().parent if spec is not None and spec.origin else None
    if origin == REPO / "core":
        return None
    folder = scratch / "site"
    folder.mkdir(exist_ok=True)
    link = folder / "slipstream"
    if not link.exists():
        link.symlink_to(REPO / "core", target_is_directory=True)
    return str(folder)


def _parse_pairs(values: list[str], option: str) -> dict[str, str]:
    pairs = {}
    for value in values:
        key, equals, setting = value.partition("=")
        if not equals:
            raise SystemExit(f"gpu_check.py: {option} takes NAME=VALUE, got {value!r}")
        pairs[key] = setting
    return pairs


def parse_arguments(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="small sizes (the test suite's mode)")
    parser.add_argument("--only", nargs="+", metavar="CHECK", help="run these checks only")
    parser.add_argument("--skip", nargs="+", metavar="CHECK", default=[], help="leave these out")
    parser.add_argument("--list", action="store_true", help="list the checks and exit")
    parser.add_argument("--report", type=Path, help="JSON report (default: results/gpu_check.json)")
    parser.add_argument(
        "--deadline",
        type=float,
        default=DEFAULT_DEADLINE,
        help=f"seconds for the whole run (default {DEFAULT_DEADLINE:.0f})",
    )
    parser.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="CHECK=SECONDS",
        help="change one check's time budget",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="show the checks' output")
    # For the harness's own tests: make a check fail, hang or crash its process.
    parser.add_argument("--inject", action="append", default=[], help=argparse.SUPPRESS)
    # Internal: this process is a worker (of the parent) or a rank (of torchrun).
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--scratch", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--rank-worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.inject = _parse_pairs(args.inject, "--inject")
    args.budget = {k: float(v) for k, v in _parse_pairs(args.budget, "--budget").items()}
    if args.report is None:
        args.report = RESULTS / ("gpu_check_quick.json" if args.quick else "gpu_check.json")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_arguments(argv)
    if args.rank_worker:
        import gpu_check_cases as cases

        return cases.rank_worker(args.rank_worker)
    if args.worker:
        return worker_main(args.worker, args.quick, args.scratch, args.inject)

    known = [check.name for check in CHECKS]
    unknown = [
        n for n in [*(args.only or []), *args.skip, *args.inject, *args.budget] if n not in known
    ]
    if unknown:
        print(f"gpu_check.py: unknown check(s) {', '.join(unknown)}; the checks are: "
              f"{', '.join(known)}", file=sys.stderr)  # fmt: skip
        return 2
    chosen = [c for c in CHECKS if (not args.only or c.name in args.only)
              and c.name not in args.skip]  # fmt: skip
    if args.list:
        for check in CHECKS:
            print(f"{check.name:<22} {check.budget:4.0f}s  {check.group:<9}  {check.proves}")
        print(f"{'budgets in all':<22} {sum(c.budget for c in CHECKS):4.0f}s")
        return 0
    run = Run(args, chosen)
    print(f"gpu_check ({'quick' if args.quick else 'full'} mode): {len(chosen)} checks; their "
          f"budgets (each check's limit) add up to {sum(run.budget(c) for c in chosen):.0f} s, "
          f"the run stops at {args.deadline:.0f} s")  # fmt: skip
    try:
        run.execute()
    finally:
        shutil.rmtree(run.scratch, ignore_errors=True)  # checkpoints and model files
    run.write_report()  # once more: the whole run's time
    counts = run.counts()
    seconds = time.monotonic() - run.started
    print(
        f"SUMMARY: {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} "
        f"skipped in {seconds:.1f} s; report {args.report}"
    )
    return 1 if counts["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
