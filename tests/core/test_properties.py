"""Property-based tests (hypothesis): config parsing, and collectives on arbitrary nesting.

The collective properties run on 2 real processes: hypothesis is derandomised, so both
ranks generate the same structures and call the collectives in lockstep.
"""

from __future__ import annotations

from typing import Any

import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from slipstream.launcher.config import (
    ConfigError,
    LaunchConfig,
    config_from_dict,
    load_config,
    save_config,
)
from tests.distributed import run_distributed

VALID_VALUES: dict[str, Any] = {
    "distributed_type": st.sampled_from(["NO", "MULTI_CPU", "MULTI_GPU", "multi_cpu"]),
    "mixed_precision": st.sampled_from(["no", "fp16", "bf16", "BF16", "bf16-true"]),
    "use_cpu": st.booleans(),
    "debug": st.booleans(),
    "num_processes": st.sampled_from([1, 2, 4, 8]),
    "main_process_port": st.one_of(st.none(), st.integers(1, 65535)),
    "rdzv_backend": st.sampled_from(["static", "c10d"]),
    "gradient_accumulation_steps": st.integers(1, 64),
    "max_restarts": st.integers(0, 5),
    "gpu_ids": st.sampled_from(["all", "0,1"]),
    "dynamo_config": st.just({"dynamo_backend": "INDUCTOR"}),
}


@settings(max_examples=60, deadline=None)
@given(st.fixed_dictionaries({}, optional=VALID_VALUES))
def test_valid_configs_parse_and_round_trip(tmp_path_factory, values):
    config, notes = config_from_dict(values)
    assert notes == []
    path = save_config(config, tmp_path_factory.mktemp("cfg") / "c.yaml")
    assert load_config(path)[0] == config


ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 10**6),
    st.floats(allow_nan=True),
    st.text(max_size=8),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from([*LaunchConfig.__dataclass_fields__, "bogus", "tpu_env"]),
        ANY_VALUE,
        max_size=5,
    )
)
@example({"num_processes": "²"})  # a digit to str.isdigit, not to int()
def test_arbitrary_configs_either_parse_or_raise_a_config_error(values):
    try:
        config_from_dict(values, where="fuzz.yaml")
    except ConfigError as error:
        assert str(error).startswith("fuzz.yaml")


def _specs() -> st.SearchStrategy[Any]:
    leaf = st.lists(st.integers(1, 3), min_size=1, max_size=3).map(lambda s: ("T", tuple(s)))
    return st.recursive(
        leaf,
        lambda children: st.one_of(
            st.lists(children, max_size=3),
            st.tuples(children, children),
            st.dictionaries(st.text("abc", min_size=1, max_size=2), children, max_size=3),
        ),
        max_leaves=6,
    )


def _build(spec: Any, fill: float, grow: int = 0) -> Any:
    if isinstance(spec, tuple) and spec and spec[0] == "T":
        shape = (spec[1][0] + grow, *spec[1][1:])
        return torch.full(shape, fill)
    if isinstance(spec, dict):
        return {k: _build(v, fill, grow) for k, v in spec.items()}
    if isinstance(spec, tuple):
        return tuple(_build(v, fill, grow) for v in spec)
    return [_build(v, fill, grow) for v in spec]


def _same_structure(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor)
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same_structure(a[k], b[k]) for k in a)
    return len(a) == len(b) and all(_same_structure(x, y) for x, y in zip(a, b, strict=True))


def _leaves(data: Any) -> list[torch.Tensor]:
    from slipstream.runtime.tree import tensor_leaves

    return tensor_leaves(data)


def _collective_properties(examples: int) -> int:
    from slipstream import Accelerator, gather, pad_across_processes, reduce

    acc = Accelerator()
    rank = acc.process_index
    ran = []

    @settings(
        max_examples=examples,
        derandomize=True,
        deadline=None,
        database=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(_specs())
    def check(spec: Any) -> None:
        mine = _build(spec, float(rank + 1))
        gathered = gather(mine)
        assert _same_structure(gathered, mine)
        for before, after in zip(_leaves(mine), _leaves(gathered), strict=True):
            rows = before.shape[0]
            assert after.shape == (2 * rows, *before.shape[1:])
            assert bool((after[:rows] == 1).all()) and bool((after[rows:] == 2).all())
        summed = reduce(mine, "sum")
        assert _same_structure(summed, mine)
        assert all(bool((t == 3).all()) for t in _leaves(summed))
        ragged = _build(spec, float(rank + 1), grow=rank)
        padded = pad_across_processes(ragged, dim=0, pad_index=-1)
        for before, after in zip(_leaves(ragged), _leaves(padded), strict=True):
            assert after.shape[0] == before.shape[0] + (1 - rank)
            if rank == 0:
                assert bool((after[-1] == -1).all())
        ran.append(1)

    check()
    return len(ran)


def test_collectives_on_arbitrary_nested_structures():
    counts = run_distributed(_collective_properties, 40, timeout=180)
    assert counts == [40, 40]
