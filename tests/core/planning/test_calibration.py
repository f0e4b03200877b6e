"""Fitting the time model to measured steps, and keeping the fit for later plans."""

from __future__ import annotations

import dataclasses

import pytest

from slipstream.planning.calibration import (
    Constants,
    calibration_file,
    fit,
    load_calibration,
    save_calibration,
)
from slipstream.planning.hardware import preset


def _seconds(constants: Constants, features: list[tuple[float, ...]]) -> list[float]:
    coefficients = dataclasses.astuple(constants)
    return [sum(c * x for c, x in zip(coefficients, row, strict=True)) for row in features]


FEATURES = [
    (4e9, 0.01, 10.0, 1e8),
    (2e9, 0.05, 40.0, 5e7),
    (3e9, 0.00, 0.0, 2e8),
    (1e9, 0.20, 100.0, 1e8),
    (5e9, 0.02, 20.0, 3e8),
]


def test_fit_recovers_the_constants_that_made_the_times():
    truth = Constants(2.5e-10, 1.7, 3e-4, 1e-9)
    fitted = fit(FEATURES, _seconds(truth, FEATURES))
    for got, want in zip(dataclasses.astuple(fitted), dataclasses.astuple(truth), strict=True):
        assert got == pytest.approx(want, rel=1e-6)


def test_fit_keeps_every_constant_non_negative():
    # Times that a negative latency would fit best: the fit drops that term instead.
    truth = Constants(2.5e-10, 1.0, -1e-3, 1e-9)
    fitted = fit(FEATURES, [max(t, 0.1) for t in _seconds(truth, FEATURES)])
    assert min(dataclasses.astuple(fitted)) >= 0


def test_saved_constants_replace_the_preset_for_later_plans(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cpu = preset("CPU")
    assert load_calibration(cpu, 4) == cpu  # nothing saved yet
    path = save_calibration(cpu, Constants(1e-10, 2.0, 1e-3, 2e-10), processes=4)
    assert path == calibration_file() and path.startswith(str(tmp_path))
    calibrated = load_calibration(cpu, 4)
    assert calibrated.flops_fp32 == pytest.approx(1e10) and calibrated.efficiency == 1.0
    assert calibrated.intra_bw == pytest.approx(cpu.intra_bw / 2)
    assert calibrated.latency == 1e-3 and calibrated.memory_bw == pytest.approx(5e9)
    # Other devices keep their presets.
    assert load_calibration(preset("H100"), 8) == preset("H100")


def test_cpu_rates_follow_the_cores_each_process_gets(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    save_calibration(preset("CPU"), Constants(1e-10, 1.0, 0.0, 1e-10), processes=4)
    # 4 processes on 2 cores: each had half a core; 2 processes get a whole one.
    assert load_calibration(preset("CPU"), 2).flops_fp32 == pytest.approx(2e10)
    assert load_calibration(preset("CPU"), 8).flops_fp32 == pytest.approx(5e9)
