"""Turn every process's account of what it is doing into one hang report that names the
processes that are behind or elsewhere, and where in the user's code they are.

Each process's account (a "dump", written by :mod:`slipstream.diagnostics.hang`) holds its
main thread's stack, the last collectives it entered (torch's Flight Recorder where there is
one, else slipstream's own log; with DDP's all-reduce through shared memory, its last
exchange) and its step. The analysis, for every group some processes
wait in:

* a member that never entered the collective the others wait in is **behind** (it sleeps,
  computes, waits in another group's collective, or finished its script);
* a member waiting in a collective of the same number but another kind or size is
  **elsewhere** (the others took another branch). When the sides are equal (2 processes),
  the side whose collective does not follow its own earlier pattern is named;
* a member that did not answer is named with its pid, for ``py-spy dump``.

Example::

    text, culprits = build_report(dumps, world_size=4, declared={"rank": 0, "reason": "..."})
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .stacks import format_frame, format_stack, is_library, user_frame

#: Culprits whose stacks the report prints (all are in the JSON file).
STACKS_SHOWN = 3


@dataclass
class Waiting:
    """A collective one process waits in."""

    group: str
    seq: int
    op: str
    data: str
    site: str

    @property
    def signature(self) -> tuple[str, str]:
        return (self.op, self.data)

    def describe(self) -> str:
        """``all_reduce #13 (float[3, 4])``."""
        data = f" ({self.data})" if self.data and self.data != "-" else ""
        return f"{self.op} #{self.seq}{data}"


@dataclass
class Account:
    """One process's dump, read for the analysis."""

    rank: int
    dump: Mapping[str, Any]
    waiting: Waiting | None = None
    #: group -> the highest collective number this process entered in it.
    entered: dict[str, int] = field(default_factory=dict)
    #: (op, site) of its last collectives, oldest first (for the pattern tie-break).
    history: list[tuple[str, str]] = field(default_factory=list)

    @property
    def frame(self) -> dict[str, Any] | None:
        return user_frame(list(self.dump.get("stack") or []))


def describe_ranks(ranks: list[int]) -> str:
    """``[0, 2, 3, 4]`` -> ``"ranks 0, 2-4"``; one rank -> ``"rank 0"``."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    spans: list[str] = []
    start = previous = ranks[0]
    for rank in [*ranks[1:], None]:
        if rank is not None and rank == previous + 1:
            previous = rank
            continue
        spans.append(str(start) if start == previous else f"{start}-{previous}")
        if rank is not None:
            start = previous = rank
    return "ranks " + ", ".join(spans)


def _verb(ranks: list[int], one: str, many: str) -> str:
    return f"{describe_ranks(ranks)} {one if len(ranks) == 1 else many}"


def _data(entry: Mapping[str, Any]) -> str:
    if "data" in entry:
        return str(entry["data"])
    sizes, dtypes = entry.get("sizes") or [], entry.get("dtypes") or []
    parts = [f"{str(d).lower()}{list(s)}" for s, d in zip(sizes, dtypes, strict=False)]
    return ", ".join(parts)


def _group_key(entry: Mapping[str, Any]) -> str:
    if "group_desc" in entry:
        return str(entry["group"])
    group = entry.get("group")
    return "all" if group is None else ",".join(str(r) for r in group)


def read_accounts(dumps: Mapping[int, Mapping[str, Any]]) -> tuple[dict[int, Account], str]:
    """Each dump as an :class:`Account`; the source of collective records used: torch's
    Flight Recorder when every process has one (its records include DDP's and FSDP's
    collectives), else slipstream's own log."""
    torch_everywhere = bool(dumps) and all(d.get("torch_collectives") for d in dumps.values())
    source = "torch" if torch_everywhere else "slipstream"
    accounts: dict[int, Account] = {}
    for rank, dump in dumps.items():
        account = Account(rank, dump)
        completed: dict[str, int] = {}
        if source == "torch":
            recorded = dump["torch_collectives"]
            entries = list(recorded.get("entries") or [])
            for group, counters in (recorded.get("status") or {}).items():
                account.entered[group] = int(counters.get("enqueued", 0))
                completed[group] = int(counters.get("completed", -1))
        else:
            entries = list(dump.get("collectives") or [])
        for entry in entries:
            key = _group_key(entry)
            account.entered[key] = max(account.entered.get(key, 0), int(entry["seq"]))
            account.history.append((str(entry["op"]), str(entry.get("site", "?"))))
        # DDP's all-reduce through shared memory, which no recorder sees: the reducer's last
        # exchange (not part of the history: its place among the others is not known).
        shared = list(dump.get("shared_memory_collectives") or [])
        for entry in shared:
            account.entered[_group_key(entry)] = int(entry["seq"])
        pending = [
            e
            for e in entries
            if e.get("pending") and int(e["seq"]) > completed.get(_group_key(e), -1)
        ]
        own = dump.get("collectives") or []
        if source == "torch" and not pending and entries and own and own[-1].get("pending"):
            # torch retires a collective it timed out; slipstream's log still has it open,
            # and it is the last one torch entered.
            pending = [entries[-1]]
        pending += [entry for entry in shared if entry.get("pending")]
        if pending:
            last = pending[-1]
            account.waiting = Waiting(
                _group_key(last),
                int(last["seq"]),
                str(last["op"]),
                _data(last),
                str(last.get("site", "?")),
            )
        accounts[rank] = account
    return accounts, source


def _group_members(dumps: Mapping[int, Mapping[str, Any]], group: str, world: int) -> list[int]:
    if group == "all":
        return list(range(world))
    if all(part.isdecimal() for part in group.split(",")) and "," in group:
        return [int(part) for part in group.split(",")]
    for dump in dumps.values():
        known = ((dump.get("torch_collectives") or {}).get("groups") or {}).get(group)
        if known:
            if known.get("default"):
                return list(range(world))
            return [int(r) for r in known.get("ranks") or []]
    return list(range(world))


def _group_name(dumps: Mapping[int, Mapping[str, Any]], group: str, world: int) -> str:
    members = _group_members(dumps, group, world)
    if group in ("all", "0") or members == list(range(world)):
        return "all processes"
    return f"group {group} ({describe_ranks(members)})"


def _novel(account: Account) -> bool:
    """Whether this process's last collective breaks the pattern of its earlier ones (its
    (previous, last) pair of call sites never occurred before)."""
    history = account.history
    if len(history) < 3:
        return False
    pair = (history[-2], history[-1])
    return all((history[i - 1], history[i]) != pair for i in range(1, len(history) - 1))


def _where(account: Account) -> str:
    if account.dump.get("finishing"):
        return "it finished its script and waits at exit"
    waiting = account.waiting
    if waiting is not None:
        # (The shared-memory all-reduce records no call site: the stack has it.)
        site = waiting.site if waiting.site != "?" else _describe_site(account)
        return f"it waits in {waiting.op} #{waiting.seq} of group {waiting.group} at {site}"
    return "it is at " + format_frame(account.frame)


def _describe_site(account: Account) -> str:
    """Where a waiting process called its collective: its user frame (with the code)."""
    frame = account.frame
    return (
        format_frame(frame)
        if frame is not None
        else account.waiting.site
        if account.waiting
        else "?"
    )


def analyse(
    dumps: Mapping[int, Mapping[str, Any]], world: int, pids: Mapping[int, str] | None = None
) -> tuple[list[tuple[int, str]], list[str], str]:
    """``(findings, others, source)``: one ``(rank, sentence)`` per process that is behind,
    elsewhere or silent; lines on the processes that wait as they should. ``pids`` gives
    ``host:pid`` of processes that may not have answered."""
    accounts, source = read_accounts(dumps)
    findings: dict[int, str] = {}
    others: list[str] = []
    missing = [r for r in range(world) if r not in accounts]
    by_group: dict[str, dict[int, Waiting]] = {}
    for account in accounts.values():
        if account.waiting is not None:
            by_group.setdefault(account.waiting.group, {})[account.rank] = account.waiting
    for group, waiters in sorted(by_group.items()):
        seq = max(w.seq for w in waiters.values())
        at_seq = {r: w for r, w in waiters.items() if w.seq == seq}
        sides: dict[tuple[str, str], list[int]] = {}
        for rank, waiting in at_seq.items():
            sides.setdefault(waiting.signature, []).append(rank)
        ordered = sorted(sides.items(), key=lambda item: -len(item[1]))
        main_signature, main_ranks = ordered[0]
        undecided = False
        if len(ordered) > 1 and len(ordered[1][1]) == len(main_ranks):
            # As many on each side: the side whose last collective breaks its own pattern.
            novel = [sig for sig, ranks in ordered if all(_novel(accounts[r]) for r in ranks)]
            if len(novel) == len(ordered) - 1:
                main_signature = next(sig for sig, _ in ordered if sig not in novel)
                main_ranks = sides[main_signature]
            else:
                undecided = True
        name = _group_name(dumps, group, world)
        what = f"{at_seq[main_ranks[0]].describe()} of {name}"
        for signature, ranks in ordered:
            if signature == main_signature and not undecided:
                continue
            for rank in ranks:
                other = at_seq[rank]
                if undecided:
                    text = (
                        f"{describe_ranks([rank])} disagrees with the others: it waits in "
                        f"{other.describe()} of {name} at {_describe_site(accounts[rank])}"
                    )
                else:
                    text = (
                        f"{describe_ranks([rank])} is elsewhere: it waits in {other.describe()} at "
                        f"{_describe_site(accounts[rank])}, while "
                        f"{_verb(main_ranks, 'waits', 'wait')} in {what}"
                    )
                findings.setdefault(rank, text)
        for rank in _group_members(dumps, group, world):
            member = accounts.get(rank)
            if member is None or rank in at_seq:
                continue
            if member.entered.get(group, 0) < seq or rank in waiters:
                findings.setdefault(
                    rank,
                    f"{describe_ranks([rank])} is behind: it has not reached {what}, which "
                    f"{_verb(main_ranks, 'waits', 'wait')} in; {_where(member)}",
                )
        if not undecided:
            site = _describe_site(accounts[main_ranks[0]])
            others.append(f"{_verb(main_ranks, 'waits', 'wait')} in {what}, called at {site}")
    for rank in missing:
        where = (pids or {}).get(rank)
        findings[rank] = (
            f"{describe_ranks([rank])} did not answer: its Python is blocked (a native call that "
            "holds the interpreter) or it is gone; "
            + (
                f"`py-spy dump --pid {where.split(':')[-1]}` on {where.split(':')[0]} shows "
                "where it is"
                if where
                else "`py-spy dump --pid PID` on its machine shows where it is"
            )
        )
    if not by_group:
        others += _nobody_waits(accounts, findings)
    ordered_findings = sorted(findings.items())
    return ordered_findings, others, source


def _nobody_waits(accounts: Mapping[int, Account], findings: dict[int, str]) -> list[str]:
    """No process waits in a collective: group the processes by where they are; those away
    from the majority are named."""
    places: dict[str, list[int]] = {}
    for account in accounts.values():
        places.setdefault(_where(account), []).append(account.rank)
    ordered = sorted(places.items(), key=lambda item: -len(item[1]))
    if len(ordered) > 1 and len(ordered[0][1]) > len(ordered[1][1]):
        for place, ranks in ordered[1:]:
            for rank in ranks:
                findings.setdefault(rank, f"{describe_ranks([rank])} is elsewhere: {place}")
        ordered = ordered[:1]
    return [f"{describe_ranks(ranks)}: no collective pending; {place}" for place, ranks in ordered]


def _stack_lines(dump: Mapping[str, Any]) -> list[str]:
    """The user's frames of a stack and the innermost library frame (where it waits)."""
    frames = list(dump.get("stack") or [])
    shown = [f for f in frames if not is_library(str(f.get("file", "")))]
    if frames and (not shown or shown[-1] is not frames[-1]):
        shown.append(frames[-1])
    return format_stack(shown[-12:], indent="      ")


def build_report(
    dumps: Mapping[int, Mapping[str, Any]],
    world_size: int,
    declared: Mapping[str, Any],
    *,
    details: str | None = None,
    exit_code: int | None = None,
    pids: Mapping[int, str] | None = None,
) -> tuple[str, list[int]]:
    """The report's text and the ranks it names.

    ``declared`` says who noticed the hang and why (``{"rank": 0, "reason": "..."}``);
    ``details`` is where the full dumps were written.
    """
    findings, others, source = analyse(dumps, world_size, pids)
    first = dumps.get(0) or next(iter(dumps.values()), {})
    step = first.get("step")
    lines = [
        f"slipstream: hang report: {declared.get('reason', 'the job stopped making progress')} "
        f"(noticed by rank {declared.get('rank', '?')}"
        + (f", at step {step})" if step is not None else ")")
    ]
    if findings:
        lines.append("  behind or elsewhere:")
        lines += [f"    {text}" for _, text in findings]
    else:
        lines.append("  no process is behind or elsewhere: the collective itself does not complete")
    if others:
        lines.append("  the others:")
        lines += [f"    {text}" for text in others]
    for rank, _ in findings[:STACKS_SHOWN]:
        if rank in dumps:
            dump = dumps[rank]
            lines.append(
                f"  rank {rank} (pid {dump.get('pid')} on {dump.get('host')}), innermost last:"
            )
            lines += _stack_lines(dump)
    if source == "slipstream":
        lines.append(
            "  (collectives: slipstream's own record; torch's Flight Recorder was not available)"
        )
    if details:
        lines.append(f"  every process's stack and last collectives: {details}")
    if exit_code is not None:
        lines.append(f"  the job ends with exit code {exit_code} (hang)")
    return "\n".join(lines), [rank for rank, _ in findings]
