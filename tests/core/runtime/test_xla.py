"""The XLA messages on a machine without torch_xla (the main suite's): the install hint
names a torch_xla that exists, PJRT_DEVICE without torch_xla stops instead of training on
the CPU, and ``slipstream env`` and ``slipstream launch --tpu`` say so."""

from __future__ import annotations

import pytest

from slipstream.runtime.xla import (
    NEWEST_TORCH_XLA,
    XlaError,
    install_hint,
    runtime_description,
    wants_xla,
    xla_installed,
)
from tests.distributed import run_cli, run_python

pytestmark = pytest.mark.skipif(xla_installed(), reason="these are the messages without torch_xla")


def test_the_install_hint_names_a_release_that_exists():
    assert NEWEST_TORCH_XLA == "2.9.0"
    newer = install_hint("2.13.0+cpu")
    assert 'pip install torch==2.9.0 "torch_xla[tpu]==2.9.0"' in newer
    assert "there is none for this torch 2.13.0" in newer
    assert "torch_xla==2.13" not in newer
    assert 'pip install "torch_xla[tpu]==2.8.0"' in install_hint("2.8.0")


def test_pjrt_device_without_torch_xla_stops_instead_of_training_on_the_cpu():
    with pytest.raises(XlaError, match=r"PJRT_DEVICE=TPU asks for torch_xla's TPU device"):
        wants_xla({}, cpu=False, environ={"PJRT_DEVICE": "tpu"})
    assert not wants_xla({}, cpu=True, environ={"PJRT_DEVICE": "TPU"})  # --cpu wins
    assert not wants_xla({}, cpu=False, environ={})
    assert runtime_description({})["PJRT_DEVICE"] == "not set"
    assert runtime_description({"PJRT_DEVICE": "TPU"})["PJRT_DEVICE"].startswith(
        "TPU (but torch_xla is not installed"
    )


@pytest.mark.slow
def test_the_command_line_says_it():
    shown = run_cli("env", env={"PJRT_DEVICE": "TPU"})
    assert shown.returncode == 0, shown.stderr
    assert "- torch_xla version: not installed" in shown.stdout
    assert "- PJRT_DEVICE: TPU (but torch_xla is not installed" in shown.stdout
    launched = run_cli("launch", "--tpu", "train.py")
    assert launched.returncode == 2, launched.stderr
    assert f'torch=={NEWEST_TORCH_XLA} "torch_xla[tpu]=={NEWEST_TORCH_XLA}"' in launched.stderr
    assert "torch_xla==2.13" not in launched.stderr
    script = "from slipstream import Accelerator; Accelerator()"
    refused = run_python("-c", script, env={"PJRT_DEVICE": "TPU"})
    assert refused.returncode != 0 and "PJRT_DEVICE=TPU asks for" in refused.stderr
