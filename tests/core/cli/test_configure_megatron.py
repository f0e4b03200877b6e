"""``slipstream config``'s Megatron-LM questions: asked for multi-process jobs without DeepSpeed
or FSDP (as Accelerate does), writing Accelerate's ``megatron_lm_config`` keys, with degrees
that do not divide the processes asked again."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import yaml

from slipstream.cli.configure import Questionnaire, ask_questions
from slipstream.launcher.config import config_from_dict, load_config
from tests.core.cli.test_configure import answer

START = ["", "multi-CPU", "1", "no", "no", "no"]  # environment, machine, machines, dynamo, DS, FSDP


def _ask(lines: list[str]) -> tuple[dict, list[str]]:
    said: list[str] = []
    replies: Iterator[str] = iter(lines)

    def ask(prompt: str) -> str:
        said.append(prompt)
        return next(replies)

    return ask_questions(Questionnaire(ask=ask, say=said.append)), said


def test_piped_answers_write_accelerates_megatron_keys(tmp_path: Path):
    target = tmp_path / "megatron.yaml"
    degrees = ["yes", "2", "", "2", "", "", "no", "0.5", "bf16"]  # tp 2 (SP yes), pp 2, 2 micro
    result = answer(target, [*START, "4", *degrees])
    assert result.returncode == 0, result.stderr
    assert "Do you want to use Megatron-LM? [yes/NO]: yes" in result.stdout
    written = yaml.safe_load(target.read_text())
    assert written["distributed_type"] == "MEGATRON_LM"
    assert written["megatron_lm_config"] == {
        "megatron_lm_tp_degree": 2,
        "megatron_lm_sequence_parallelism": True,
        "megatron_lm_pp_degree": 2,
        "megatron_lm_num_micro_batches": 2,
        "megatron_lm_recompute_activations": True,
        "megatron_lm_use_distributed_optimizer": False,
        "megatron_lm_gradient_clipping": 0.5,
    }
    config, _ = load_config(target)
    assert config.parallel_layout() == "pp=2 x tp=2" and config.mixed_precision == "bf16"


def test_degrees_that_do_not_divide_the_processes_are_asked_again():
    values, said = _ask(
        [
            *START,
            "6",  # processes
            "y",  # Megatron-LM
            "4",  # tp: does not divide 6
            "3",  # tp
            "no",  # sequence parallelism
            "2",  # pp: 3 x 2 = 6
            "1",  # micro-batches: fewer than the stages
            "4",
            "no",  # recomputation
            "",  # distributed optimizer [YES]
            "-1",  # clipping: negative
            "0",  # clipping off
            "",  # precision
        ]
    )
    assert "  4 does not divide the 6 processes; please try again." in said
    assert any("'1' is not a whole number of at least 2" in line for line in said)
    assert "  it must be 0 (off) or more; please try again." in said
    assert not any("parallelism config" in line for line in said), "one layout is asked for"
    config, _ = config_from_dict(values)
    assert config.megatron_lm_config == {
        "megatron_lm_tp_degree": 3,
        "megatron_lm_sequence_parallelism": False,
        "megatron_lm_pp_degree": 2,
        "megatron_lm_num_micro_batches": 4,
        "megatron_lm_recompute_activations": False,
        "megatron_lm_use_distributed_optimizer": True,
        "megatron_lm_gradient_clipping": 0.0,
    }
    assert config.parallel_layout() == "pp=2 x tp=3"


def test_megatron_is_asked_only_for_several_processes_without_deepspeed_or_fsdp():
    _, one = _ask([*START, "1", ""])  # one process: no layout questions
    fsdp = ["", "multi-CPU", "1", "no", "no", "yes", "NO_WRAP", "", "", "", "", "2", "no", ""]
    _, sharded = _ask(fsdp)
    _, single = _ask(["", "no", "no", ""])  # one machine, one process
    for said in (one, sharded, single):
        assert not any("Megatron-LM" in line for line in said), said
