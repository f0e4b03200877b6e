"""Accelerate's is_*_available checks: a package counts when it is importable and installed;
versions compared with packaging's rules."""

from __future__ import annotations

import importlib.metadata
import sys

import pytest
import torch

from slipstream.utils import availability
from slipstream.utils.availability import (
    are_libraries_initialized,
    compare_versions,
    is_bf16_available,
    is_cuda_available,
    is_package_available,
    is_rich_available,
    is_torch_version,
    parse,
)


def test_installed_packages_count_and_missing_ones_do_not():
    assert is_package_available("yaml", "PyYAML")  # module and distribution names differ
    assert is_package_available("torch")
    assert not is_package_available("surely_not_a_module_here")
    assert not is_package_available("yaml", "not-the-yaml-distribution")


def test_a_stray_folder_with_the_name_is_not_a_package(tmp_path, monkeypatch):
    (tmp_path / "fake_unlisted_package").mkdir()
    (tmp_path / "fake_unlisted_package" / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert not is_package_available("fake_unlisted_package")


def test_version_bounds():
    installed = parse(importlib.metadata.version("torch"))
    assert is_package_available("torch", min_version="2.0")
    assert not is_package_available("torch", min_version=f"{installed.major + 1}.0")
    assert not is_package_available("torch", below="2.0")


def test_the_checks_answer_for_what_is_installed(monkeypatch):
    assert is_rich_available() == is_package_available("rich")
    assert availability.is_wandb_available.__name__ == "is_wandb_available"
    monkeypatch.setattr(availability, "is_package_available", lambda *a, **k: False)
    assert not is_rich_available()
    assert not availability.is_torchao_available()


def test_compare_versions_of_libraries_and_versions():
    assert compare_versions("torch", ">=", "2.0")
    assert not compare_versions("torch", "<", "2.0")
    assert compare_versions(parse("1.2.0"), "==", "1.2")
    assert compare_versions(parse("1.10"), ">", "1.9")  # not a string comparison
    with pytest.raises(ValueError, match="operation must be one of"):
        compare_versions("torch", "=>", "2.0")
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        compare_versions("surely-not-installed-here", ">", "1")


def test_is_torch_version():
    assert is_torch_version(">=", "2.4")
    assert is_torch_version("<", "99")
    assert not is_torch_version("==", "1.0")


def test_are_libraries_initialized():
    assert are_libraries_initialized("torch", "surely_not_imported") == ["torch"]
    assert "sys" in sys.modules and are_libraries_initialized("sys") == ["sys"]


def test_devices_on_this_cpu_machine():
    assert is_cuda_available() == torch.cuda.is_available()
    if not torch.cuda.is_available():
        assert is_bf16_available()  # every CPU computes in bfloat16
    assert availability.is_fp16_available()
    assert availability.is_npu_available() is False  # no torch_npu here
    with pytest.raises(ValueError, match="cannot both be true"):
        availability.is_torch_xla_available(check_is_tpu=True, check_is_gpu=True)
