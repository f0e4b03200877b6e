"""``slipstream config``'s Megatron-LM questions: Accelerate's, writing the keys Accelerate
writes (``megatron_lm_tp_degree`` ...) into the ``megatron_lm_config`` block, with the degrees
checked against the job's processes as they are given.

Example::

    block = megatron_questions(Questionnaire(), num_processes=4)
    # {'megatron_lm_tp_degree': 2, 'megatron_lm_sequence_parallelism': True, ...}
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

PREFIX = "megatron_lm_"


class Asker(Protocol):
    """What the questions need of ``slipstream.cli.configure.Questionnaire``."""

    say: Callable[[str], None]

    def text(
        self,
        question: str,
        default: str | None = None,
        check: Callable[[str], str | None] | None = None,
        show_default: bool = True,
    ) -> str: ...

    def yes(self, question: str, default: bool = False) -> bool: ...


def _degree(q: Asker, question: str, num_processes: int, times: int, default: int) -> int:
    """A degree that, multiplied by ``times``, divides ``num_processes`` (else asked again)."""

    def check(answer: str) -> str | None:
        if not answer.isdecimal() or int(answer) < 1:
            return f"'{answer}' is not a degree: give 1 or more"
        if num_processes % (int(answer) * times):
            shown = f"{answer} x {times}" if times > 1 else answer
            return f"{shown} does not divide the {num_processes} processes"
        return None

    return int(q.text(question, str(default), check))


def _at_least(q: Asker, question: str, minimum: int, why: str) -> int:
    def check(answer: str) -> str | None:
        if not answer.isdecimal() or int(answer) < minimum:
            return f"'{answer}' is not a whole number of at least {minimum} ({why})"
        return None

    return int(q.text(question, str(minimum), check))


def _clipping(q: Asker) -> float:
    def check(answer: str) -> str | None:
        try:
            return None if float(answer) >= 0 else "it must be 0 (off) or more"
        except ValueError:
            return f"'{answer}' is not a number"

    question = "What is the gradient clipping value based on global L2 Norm (0 to disable)?"
    return float(q.text(question, "1.0", check))


def megatron_questions(q: Asker, num_processes: int) -> dict[str, Any]:
    """The ``megatron_lm_config`` block, in Accelerate's order and with its defaults, except
    that the micro-batches default to the pipeline stages (torch's 1F1B schedule needs at
    least one per stage)."""
    q.say(
        "Megatron-LM layouts run on slipstream's tensor and pipeline parallelism with FSDP2; "
        f"the degrees must divide the {num_processes} processes (the rest is data parallel)."
    )
    block: dict[str, Any] = {}
    tp = _degree(q, "What is the Tensor Parallelism degree/size?", num_processes, 1, 1)
    block[PREFIX + "tp_degree"] = tp
    if tp > 1:
        block[PREFIX + "sequence_parallelism"] = q.yes(
            "Do you want to enable Sequence Parallelism?", True
        )
    pp = _degree(q, "What is the Pipeline Parallelism degree/size?", num_processes, tp, 1)
    block[PREFIX + "pp_degree"] = pp
    if pp > 1:
        block[PREFIX + "num_micro_batches"] = _at_least(
            q, "What is the number of micro-batches?", pp, "one per pipeline stage at least"
        )
    block[PREFIX + "recompute_activations"] = q.yes(
        "Do you want to enable activation recomputation (of the model's blocks)?", True
    )
    block[PREFIX + "use_distributed_optimizer"] = q.yes(
        "Do you want to use distributed optimizer which shards optimizer state and gradients "
        "across data parallel ranks (FSDP2)?",
        True,
    )
    block[PREFIX + "gradient_clipping"] = _clipping(q)
    return block
