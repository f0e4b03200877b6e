"""``slipstream config``: write a configuration file by answering questions.

Also ``slipstream config default [--mixed_precision M]`` (a basic config using every
device) and ``slipstream config validate FILE``. Answers are checked as they are given (an
invalid one is asked again); the file is validated as a whole before anything is written.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ..launcher.config import (
    MIXED_PRECISION,
    ConfigError,
    config_from_dict,
    gpu_count,
    load_config,
    save_config,
    write_basic_config,
)
from ..launcher.megatron_config import megatron_notes
from ..runtime.env import default_config_file
from .configure_megatron import megatron_questions
from .text import description

Ask = Callable[[str], str]
Say = Callable[[str], None]


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "config",
        help="create, write a default, or validate a configuration file",
        description=description(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        # ACTION is optional (without one the questions are asked), which argparse's
        # generated usage does not show.
        usage="%(prog)s [-h] [--config_file FILE] [{default,validate} ...]",
    )
    parser.set_defaults(run=run, action=None)
    parser.add_argument(
        "--config_file",
        "--config-file",
        dest="config_file",
        default=None,
        metavar="FILE",
        help=f"where to save (default {default_config_file()})",
    )
    # prog given: argparse would build it from the usage above, options and all.
    actions = parser.add_subparsers(dest="action", metavar="ACTION", prog=parser.prog)
    default = actions.add_parser("default", help="write a basic config using all devices")
    default.add_argument(
        "--mixed_precision",
        "--mixed-precision",
        dest="mixed_precision",
        default="no",
        choices=list(MIXED_PRECISION),
    )
    default.add_argument(
        "--config_file", "--config-file", dest="config_file", default=argparse.SUPPRESS
    )
    validate = actions.add_parser("validate", help="check a config file and report problems")
    validate.add_argument("file", help="the YAML file to check")


def _say(text: str) -> None:
    # Flushed, so that what is printed and an error on stderr keep their order in a log.
    print(text, flush=True)


class Questionnaire:
    """Asks the questions; ``ask`` reads an answer (``input``), ``say`` prints. With
    ``echo`` (answers piped in, not typed) each answer is printed after its prompt, so
    every question stays on its own line, as on a terminal.

    Example::

        answers = iter(["multi-CPU", "2"])
        q = Questionnaire(ask=lambda prompt: next(answers), say=print)
        q.choice("Which type of machine?", ["no", "multi-CPU"], "no")   # 'multi-CPU'
    """

    def __init__(self, ask: Ask = input, say: Say = _say, echo: bool = False) -> None:
        self._ask = ask
        self.say = say
        self._echo = echo

    def _read(self, prompt: str) -> str:
        try:
            answer = self._ask(prompt).strip()
        except EOFError:
            self.say("")  # ends the prompt's line: the error gets a line of its own
            raise ConfigError(
                "the input ended before the questionnaire was finished; nothing was written"
            ) from None
        if self._echo:
            self.say(answer)
        return answer

    def text(
        self,
        question: str,
        default: str | None = None,
        check: Callable[[str], str | None] | None = None,
        show_default: bool = True,
    ) -> str:
        """Free text; ``check`` returns an error message or None."""
        suffix = f" [{default}]" if default is not None and show_default else ""
        while True:
            answer = self._read(f"{question}{suffix}: ") or (default or "")
            problem = check(answer) if check else (None if answer else "an answer is required")
            if problem is None:
                return answer
            self.say(f"  {problem}; please try again.")

    def choice(self, question: str, options: Sequence[str], default: str) -> str:
        """One of ``options`` (case-insensitive), or its number."""
        listing = ", ".join(f"{i}: {o}" for i, o in enumerate(options))
        lowered = {o.lower(): o for o in options}

        def check(answer: str) -> str | None:
            if answer.lower() in lowered or (answer.isdecimal() and int(answer) < len(options)):
                return None
            return f"'{answer}' is not one of: {', '.join(options)}"

        answer = self.text(f"{question} ({listing})", default, check)
        return options[int(answer)] if answer.isdecimal() else lowered[answer.lower()]

    def integer(
        self, question: str, default: int, minimum: int = 0, maximum: int | None = None
    ) -> int:
        def check(answer: str) -> str | None:
            if not answer.lstrip("-").isdecimal():
                return f"'{answer}' is not a whole number"
            value = int(answer)
            if value < minimum or (maximum is not None and value > maximum):
                top = f" and {maximum}" if maximum is not None else ""
                return f"{value} is out of range (between {minimum}{top})"
            return None

        return int(self.text(question, str(default), check))

    def number(self, question: str, default: float) -> float:
        def check(answer: str) -> str | None:
            try:
                return None if float(answer) > 0 else "it must be positive"
            except ValueError:
                return f"'{answer}' is not a number"

        return float(self.text(question, str(default), check))

    def yes(self, question: str, default: bool = False) -> bool:
        def check(answer: str) -> str | None:
            ok = answer.lower() in ("y", "yes", "n", "no", "true", "false")
            return None if ok else f"'{answer}' is not yes or no"

        shown = "yes/NO" if not default else "YES/no"  # the capitals are the default
        answer = self.text(
            f"{question} [{shown}]", "yes" if default else "no", check, show_default=False
        )
        return answer.lower() in ("y", "yes", "true")


def _dynamo_check(answer: str) -> str | None:
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=None)
    return None if answer.lower() in known else f"unknown backend; torch knows {', '.join(known)}"


def ask_questions(q: Questionnaire) -> dict[str, Any]:
    """The questionnaire itself: returns the config values."""
    values: dict[str, Any] = {
        "compute_environment": q.choice(
            "In which compute environment are you running?", ["LOCAL_MACHINE"], "LOCAL_MACHINE"
        )
    }
    machine = q.choice(
        "Which type of machine are you using?", ["no", "multi-CPU", "multi-GPU"], "no"
    )
    values["distributed_type"] = {"no": "NO", "multi-CPU": "MULTI_CPU", "multi-GPU": "MULTI_GPU"}[
        machine
    ]
    values["use_cpu"] = machine == "multi-CPU" or (machine == "no" and gpu_count() == 0)
    if machine != "no":
        values["num_machines"] = q.integer("How many machines will you use?", 1, minimum=1)
        if values["num_machines"] > 1:
            values["machine_rank"] = q.integer(
                "What is the rank of this machine?", 0, 0, values["num_machines"] - 1
            )
            values["main_process_ip"] = q.text(
                "What is the IP address of the machine that hosts the main process?"
            )
            values["main_process_port"] = q.integer(
                "What port should the main process use?", 29500, 1, 65535
            )
            values["rdzv_backend"] = q.choice(
                "Which rendezvous backend?", ["c10d", "static"], "c10d"
            )
    if q.yes("Do you want to compile your model with torch dynamo (torch.compile)?"):
        values["dynamo_config"] = {
            "dynamo_backend": q.text("Which dynamo backend?", "inductor", _dynamo_check).upper()
        }
    if machine != "no" and q.yes("Do you want to use DeepSpeed?"):
        values["distributed_type"] = "DEEPSPEED"
        values["deepspeed_config"] = _deepspeed_questions(q)
    elif machine != "no" and q.yes("Do you want to use FullyShardedDataParallel (FSDP2)?"):
        values["distributed_type"] = "FSDP"
        values["fsdp_config"] = _fsdp_questions(q)
    if machine != "no":
        suggested = max(2, gpu_count()) if machine == "multi-GPU" else 2
        per_machine = q.integer("How many processes per machine?", suggested, minimum=1)
        values["num_processes"] = per_machine * int(values.get("num_machines", 1))
    # DeepSpeed shards over every process itself, so a layout only makes sense without it.
    several = values.get("num_processes", 1) > 1 and values["distributed_type"] != "DEEPSPEED"
    # Accelerate asks for Megatron-LM when neither DeepSpeed nor FSDP was chosen.
    plain = values["distributed_type"] in ("MULTI_CPU", "MULTI_GPU")
    if several and plain and q.yes("Do you want to use Megatron-LM?"):
        values["distributed_type"] = "MEGATRON_LM"
        values["megatron_lm_config"] = megatron_questions(q, values["num_processes"])
    elif several and q.yes(
        "Do you want to use a parallelism config (tensor, context, pipeline or expert "
        "parallelism, or HSDP: TP, CP, PP, EP sizes)?"
    ):
        values["parallelism_config"] = _parallelism_questions(q, values["num_processes"])
    values["mixed_precision"] = q.choice(
        "Do you wish to use mixed precision?", list(MIXED_PRECISION), "no"
    )
    return values


def _deepspeed_questions(q: Questionnaire) -> dict[str, Any]:
    if q.yes("Do you want to give a DeepSpeed JSON config file?"):
        path = q.text(
            "Path to the DeepSpeed JSON file",
            None,
            lambda a: None if Path(a).is_file() else f"{a} does not exist",
        )
        return {"deepspeed_config_file": path}
    config: dict[str, Any] = {"zero_stage": q.integer("ZeRO stage (0-3)?", 2, 0, 3)}
    devices = ["none", "cpu", "nvme"]
    config["offload_optimizer_device"] = q.choice(
        "Where to offload optimizer states?", devices, "none"
    )
    config["offload_param_device"] = (
        q.choice("Where to offload parameters?", devices, "none")
        if config["zero_stage"] == 3
        else "none"
    )
    config["gradient_accumulation_steps"] = q.integer("How many gradient accumulation steps?", 1, 1)
    config["gradient_clipping"] = (
        q.number("Clip gradients to which norm?", 1.0)
        if q.yes("Do you want gradient clipping?")
        else 0.0
    )
    if config["zero_stage"] == 3:
        config["zero3_save_16bit_model"] = q.yes("Save consolidated 16-bit weights at ZeRO-3?")
        config["zero3_init_flag"] = q.yes("Build models under deepspeed.zero.Init?")
    return config


def _fsdp_questions(q: Questionnaire) -> dict[str, Any]:
    config: dict[str, Any] = {"fsdp_version": 2}
    policy = q.choice(
        "Which layers are sharded on their own?",
        ["TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"],
        "TRANSFORMER_BASED_WRAP",
    )
    config["fsdp_auto_wrap_policy"] = policy
    if policy == "TRANSFORMER_BASED_WRAP":
        config["fsdp_transformer_layer_cls_to_wrap"] = q.text(
            "Layer class names to wrap (comma-separated)"
        )
    elif policy == "SIZE_BASED_WRAP":
        config["fsdp_min_num_params"] = q.integer(
            "Minimum parameters of a wrapped module?", 100_000_000, 1
        )
    config["fsdp_reshard_after_forward"] = q.yes(
        "Reshard parameters after forward (less memory)?", True
    )
    config["fsdp_offload_params"] = q.yes("Offload parameters and optimizer state to the CPU?")
    config["fsdp_state_dict_type"] = q.choice(
        "How should save_state write the model?",
        ["SHARDED_STATE_DICT", "FULL_STATE_DICT"],
        "SHARDED_STATE_DICT",
    )
    config["fsdp_activation_checkpointing"] = q.yes("Use activation checkpointing?")
    return config


def _parallel_size(q: Questionnaire, question: str, default: int) -> int:
    def check(answer: str) -> str | None:
        if not answer.lstrip("-").isdecimal():
            return f"'{answer}' is not a whole number"
        if int(answer) < 1 and int(answer) != -1:
            return f"{answer} is not a size: give 1 or more, or -1 for the processes left over"
        return None

    return int(q.text(question, str(default), check))


def _ask_sizes(q: Questionnaire, num_processes: int) -> dict[str, Any]:
    """The sizes, asked again as a whole until they multiply to ``num_processes``."""
    from ..parallel.config import CONFIG_PREFIX, ParallelismConfig

    while True:
        q.say(
            f"The sizes must multiply to {num_processes} (processes); -1 takes the rest. "
            "Experts (ep_size) are asked for after them."
        )
        block: dict[str, Any] = {
            CONFIG_PREFIX + "dp_replicate_size": _parallel_size(
                q, "How many data-parallel replicas (dp_replicate_size)?", 1
            ),
            CONFIG_PREFIX + "dp_shard_size": _parallel_size(
                q, "Over how many processes are parameters sharded (dp_shard_size)?", -1
            ),
            CONFIG_PREFIX + "tp_size": _parallel_size(
                q, "How many tensor-parallel processes (tp_size)?", 1
            ),
            CONFIG_PREFIX + "cp_size": _parallel_size(
                q, "How many context-parallel processes (cp_size, CUDA only)?", 1
            ),
            CONFIG_PREFIX + "pp_size": _parallel_size(q, "How many pipeline stages (pp_size)?", 1),
        }
        try:
            ParallelismConfig.from_config(block).resolve(num_processes)
            return block
        except ConfigError as error:
            q.say(f"  {error}; please try again.")


def _expert_size(q: Questionnaire, shards: int) -> int:
    """Expert parallelism: over how many of the ``shards`` sharding processes the experts of
    a mixture-of-experts model are split (1: not split)."""

    def check(answer: str) -> str | None:
        if not answer.isdecimal() or int(answer) < 1:
            return f"'{answer}' is not a size: give 1 or more"
        if shards % int(answer):
            return f"{answer} does not divide the {shards} processes that shard the model"
        return None

    question = (
        f"For a mixture-of-experts model: over how many of the {shards} processes that shard "
        "the model are its experts split (ep_size; 1: not split)?"
    )
    return int(q.text(question, "1", check))


def _parallelism_questions(q: Questionnaire, num_processes: int) -> dict[str, Any]:
    """The ``parallelism_config`` block: the sizes, then the options they call for."""
    from ..parallel.config import CONFIG_PREFIX, ParallelismConfig
    from ..parallel.config_values import PIPELINE_SCHEDULES

    block = _ask_sizes(q, num_processes)
    sizes = ParallelismConfig.from_config(block).resolve(num_processes)
    shards = sizes.dp_shard * sizes.cp
    if shards > 1:
        experts = _expert_size(q, shards)
        if experts > 1:
            block[CONFIG_PREFIX + "ep_size"] = experts
    if block[CONFIG_PREFIX + "cp_size"] > 1:
        block[CONFIG_PREFIX + "cp_comm_strategy"] = q.choice(
            "How do context-parallel processes exchange keys and values?",
            ["allgather", "alltoall"],
            "allgather",
        )
    if block[CONFIG_PREFIX + "pp_size"] > 1:
        block[CONFIG_PREFIX + "pp_schedule"] = q.choice(
            "Which pipeline schedule?", list(PIPELINE_SCHEDULES), "1f1b"
        )
    if block[CONFIG_PREFIX + "tp_size"] > 1:
        block[CONFIG_PREFIX + "sequence_parallel"] = q.yes(
            "Shard activations along the sequence between tensor-parallel layers "
            "(sequence parallelism)?"
        )
    return block


def run(args: argparse.Namespace) -> int:
    if args.action == "validate":
        config, notes = load_config(args.file)
        for note in [*notes, *megatron_notes(config)]:
            print(f"note: {note}")
        layout = config.parallel_layout()
        print(
            f"{args.file} is a valid configuration ({config.distributed_type}, "
            f"{config.num_processes} process(es), mixed_precision={config.mixed_precision}"
            f"{f', parallel layout {layout}' if layout else ''})"
        )
        return 0
    target = Path(args.config_file) if args.config_file else default_config_file()
    if args.action == "default":
        written = write_basic_config(args.mixed_precision, target)
        if written is False:
            raise ConfigError(f"{target} already exists; delete it or pass --config_file elsewhere")
        print(f"configuration saved at {written}")
        return 0
    values = ask_questions(Questionnaire(echo=not sys.stdin.isatty()))
    config, _ = config_from_dict(values, where="your answers")
    print(f"configuration saved at {save_config(config, target)}")
    return 0
