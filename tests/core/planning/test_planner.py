"""slipstream.plan: the layouts of a tiny Llama on 4 CPU processes, ranked; what would fit
when nothing does; one-line errors for bad inputs."""

from __future__ import annotations

import json

import pytest

from slipstream.options.errors import ConfigError
from slipstream.parallel import ParallelismConfig
from slipstream.planning.planner import plan

pytest.importorskip("transformers")

TINY = {
    "model_type": "llama", "vocab_size": 64, "hidden_size": 16, "intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 2,
    "tie_word_embeddings": False,
}  # fmt: skip


@pytest.fixture
def tiny(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no saved calibration
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY))
    return str(path)


def test_ranked_layouts_that_fit_and_run_as_parallelism_configs(tiny):
    result = plan(tiny, devices_per_node=4, device="CPU", global_batch=8, seq_len=16)
    assert len(result) > 20 and result.considered >= len(result)
    seconds = [c.time.seconds for c in result]
    assert seconds == sorted(seconds)
    families = {c.layout.family for c in result}
    assert {"DDP", "FSDP", "HSDP", "TP+FSDP", "PP+FSDP", "PP+TP", "ZeRO-3"} <= families
    for candidate in result:
        assert candidate.fits and candidate.layout.samples_per_step == 8
        if candidate.layout.engine == "fsdp":
            sizes = ParallelismConfig(**candidate.parallelism).resolve(4)
            assert (sizes.tp, sizes.pp, sizes.dp_shard) == (
                candidate.layout.tp, candidate.layout.pp, candidate.layout.dp_shard,
            )  # fmt: skip
    table = result.table(3)
    assert "Plan for LlamaForCausalLM" in table and "memory: " in table and "time: " in table


def test_nothing_fits_says_what_would(tiny):
    result = plan(tiny, devices_per_node=4, device="CPU", device_memory="96KB",
                  global_batch=8, seq_len=16)  # fmt: skip
    assert result.best is None and result.closest
    assert (
        result.suggestions[0].startswith("no layout fits 96.0 KiB")
        or "no layout fits" in (result.suggestions[0])
    )
    assert any(s.startswith(("more devices", "offload fits", "even")) for s in result.suggestions)
    assert "closest (does not fit)" in result.table()


def test_an_unknown_model_is_one_line():
    # Not a Hub name either (three parts): refused without a network round trip.
    with pytest.raises(ConfigError, match="unknown model 'no/such/model': not module") as error:
        plan("no/such/model", global_batch=8, seq_len=16)
    assert "\n" not in str(error.value)


def test_impossible_sizes_are_one_line(tiny):
    # 8 devices: tp and pp reach at most 2 x 2 here, so at least 2 data-parallel processes.
    with pytest.raises(ConfigError, match="no layout of 8 devices splits a global batch of 1"):
        plan(tiny, devices_per_node=8, device="CPU", global_batch=1, seq_len=16)
    with pytest.raises(ConfigError, match="--global_batch and --seq_len must be at least 1"):
        plan(tiny, device="CPU", global_batch=8, seq_len=0)
    with pytest.raises(ConfigError, match="is not a transformers config"):
        bad = tiny.replace("config.json", "bad.json")
        with open(bad, "w") as handle:
            json.dump({"hidden_size": 4}, handle)
        plan(bad, global_batch=8, seq_len=16)
