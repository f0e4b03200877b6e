"""Device presets, sizes and bandwidths as users write them, and which links a group uses."""

from __future__ import annotations

import pytest

from slipstream.options.errors import ConfigError
from slipstream.planning.hardware import Cluster, parse_flops, parse_rate, parse_size, preset


def test_sizes_are_binary_and_rates_decimal():
    assert parse_size("80GB") == parse_size("80GiB") == 80 * 1024**3
    assert parse_size("512 MB") == 512 * 1024**2
    assert parse_size("1e3") == 1000
    assert parse_rate("900GB/s", "--intra_bw") == 900e9
    assert parse_rate("400Gb/s", "--inter_bw") == 50e9  # bits
    assert parse_flops("989") == 989e12


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: parse_size("eighty"), "--device_memory 'eighty' is not a size"),
        (lambda: parse_size("0GB"), "must be positive"),
        (lambda: parse_rate("fast", "--inter_bw"), "--inter_bw 'fast' is not a bandwidth"),
        (lambda: parse_flops("lots"), "--device_tflops 'lots' is not a number"),
        (lambda: preset("H900"), "unknown --device 'H900'; presets: H100, H200"),
        (lambda: Cluster(0, 8, preset("H100")), "--nodes and --devices_per_node"),
    ],
)
def test_bad_values_say_what_to_write(call, message):
    with pytest.raises(ConfigError, match=message):
        call()


def test_presets_by_any_spelling():
    assert preset("h100").memory == 80 * 1024**3
    assert preset("tpu-v5e").name == preset("TPU v5e").name == "TPU v5e"
    assert preset("MI300X").name == "MI300"
    assert not preset("CPU").overlaps


def test_groups_within_a_node_use_its_links_and_others_the_nic():
    cluster = Cluster(2, 8, preset("H100"))
    assert cluster.bandwidth(stride=1, size=8) == 450e9  # tp 8 in a node
    assert cluster.bandwidth(stride=8, size=2) == 50e9  # across the two nodes
    assert cluster.bandwidth(stride=4, size=4) == 50e9  # 4 processes 4 apart span both
    assert cluster.bandwidth(stride=2, size=4) == 450e9
