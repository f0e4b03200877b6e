"""Accelerate's TPU helpers: ``install_xla`` and ``prepare_tpu``.

slipstream runs on TPUs through torch_xla (see docs/xla.md): ``slipstream launch --tpu``.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

from ..runtime.xla import device_kind, xla_installed


def install_xla(upgrade: bool = False) -> None:
    """Install the torch_xla release that matches the installed torch (``pip install
    torch_xla[tpu]==<torch version>`` from the package index), first upgrading torch with
    ``upgrade``. Works wherever pip does (Accelerate's works only on Colab).

    Example::

        install_xla()   # then PJRT_DEVICE=TPU, slipstream launch --tpu train.py
    """
    pip = [sys.executable, "-m", "pip", "install"]
    if upgrade:
        subprocess.run([*pip, "-U", "torch"], check=True)
    from importlib.metadata import version

    torch_version = version("torch").split("+")[0]
    subprocess.run([*pip, f"torch_xla[tpu]=={torch_version}"], check=True)


def prepare_tpu(
    args: argparse.Namespace, current_env: dict[str, str], pod: bool = False
) -> tuple[argparse.Namespace, dict[str, str]]:
    """Accelerate's launcher step for TPU workers: on a TPU with ``mixed_precision: bf16``
    set ``XLA_DOWNCAST_BF16=1`` (``args.downcast_bf16``) or ``XLA_USE_BF16=1`` in
    ``current_env``; ``args.debug`` sets ``SLIPSTREAM_DEBUG``; ``pod`` copies
    ``args.tpu_vm``/``args.tpu_name`` to ``args.vm``/``args.tpu``.

    ``slipstream launch --tpu`` does not call it: its bf16 is autocast, as on other devices
    (torch_xla deprecated the two variables).
    """
    on_tpu = xla_installed() and device_kind() == "TPU"
    if getattr(args, "mixed_precision", None) == "bf16" and on_tpu:
        downcast = getattr(args, "downcast_bf16", False) not in (False, None, "no")
        current_env["XLA_DOWNCAST_BF16" if downcast else "XLA_USE_BF16"] = "1"
    if getattr(args, "debug", False):
        current_env["SLIPSTREAM_DEBUG"] = "true"
    if pod:
        args.vm = getattr(args, "tpu_vm", None)
        args.tpu = getattr(args, "tpu_name", None)
    return args, current_env
