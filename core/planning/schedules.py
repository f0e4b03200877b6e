"""Pipeline schedules as the planner sees them: the order of forward and backward actions on
each process, the micro-batches whose activations are held at each point, and the idle
fraction ("bubble") of a step.

A process of a ``pp``-stage pipeline with ``v`` stages each (``v = 1``: GPipe, 1F1B) runs
``m`` micro-batches through each of its stages. The orders follow torch's schedules:

- ``gpipe``: every forward, then every backward (all ``m`` micro-batches held);
- ``1f1b``: ``pp - rank`` warm-up forwards (at most ``m``), then one backward and one
  forward in turn, then the remaining backwards;
- ``interleaved_1f1b``: Megatron's interleaving: ``(v - 1) pp + 2 (pp - rank - 1)`` warm-up
  forwards of stage chunks, then one forward and one backward in turn.

Bubbles: ``(pp - 1) / (m + pp - 1)`` for GPipe and 1F1B, ``(pp - 1) / (v m + pp - 1)``
interleaved (each chunk is 1/v of the work).

Example::

    actions("1f1b", pp=2, rank=0, microbatches=4)
    # [("F", 0, 0), ("F", 0, 1), ("B", 0, 0), ("F", 0, 2), ("B", 0, 1), ...]
"""

from __future__ import annotations

#: The schedules the planner enumerates (the others run, but are not predicted).
PLANNED_SCHEDULES = ("1f1b", "interleaved_1f1b", "gpipe")
Action = tuple[str, int, int]  # ("F" or "B", chunk on this process, micro-batch)


def actions(schedule: str, pp: int, rank: int, microbatches: int, chunks: int = 1) -> list[Action]:
    """Forward ("F") and backward ("B") actions of process ``rank``, in order."""
    m = microbatches
    if schedule == "gpipe":
        forwards = [("F", c, i) for i in range(m) for c in range(chunks)]
        return forwards + [("B", c, i) for i in range(m) for c in reversed(range(chunks))]
    if schedule == "1f1b" or chunks == 1:
        warmup = min(m, pp - rank)
        steady: list[Action] = [("F", 0, i) for i in range(warmup)]
        for i in range(m):
            steady.append(("B", 0, i))
            if warmup + i < m:
                steady.append(("F", 0, warmup + i))
        return steady
    # Interleaved: (chunk, micro-batch) pairs in groups of pp micro-batches per chunk; the
    # backwards visit the chunks in reverse.
    total = m * chunks
    pairs = [_interleaved(k, pp, chunks) for k in range(total)]
    warmup = min(total, (chunks - 1) * pp + 2 * (pp - rank - 1))
    order: list[Action] = [("F", c, i) for c, i in pairs[:warmup]]
    for k in range(total):
        if warmup + k < total:
            order.append(("F", *pairs[warmup + k]))
        chunk, micro = pairs[k]
        order.append(("B", chunks - 1 - chunk, micro))
    return order


def _interleaved(k: int, pp: int, chunks: int) -> tuple[int, int]:
    """The (chunk, micro-batch) of the k-th forward of an interleaved schedule."""
    group, offset = divmod(k, pp * chunks)
    chunk, position = divmod(offset, pp)
    return chunk, group * pp + position


def most_in_flight(schedule: str, pp: int, rank: int, microbatches: int, chunks: int = 1) -> int:
    """The most (chunk, micro-batch) forwards whose activations ``rank`` holds at once."""
    held = most = 0
    for kind, _, _ in actions(schedule, pp, rank, microbatches, chunks):
        held += 1 if kind == "F" else -1
        most = max(most, held)
    return most


def bubble(schedule: str, pp: int, microbatches: int, chunks: int = 1) -> float:
    """The idle fraction of a pipeline step."""
    if pp == 1:
        return 0.0
    work = microbatches * (chunks if schedule == "interleaved_1f1b" else 1)
    return (pp - 1) / (work + pp - 1)
