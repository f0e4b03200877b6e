"""What slipstream, slipstream.utils and slipstream.logging export, and that importing them
stays cheap (no optional dependency, no slipstream module before it is used)."""

from __future__ import annotations

import importlib

import slipstream
import slipstream.logging
import slipstream.utils
from slipstream.compatibility import NOT_PROVIDED, TABLE
from tests.distributed import run_python

#: Optional dependencies (installed for the tests) that importing slipstream must not import.
OPTIONAL = (
    "deepspeed",
    "lightning",
    "torchmetrics",
    "s3fs",
    "tensorboard",
    "tqdm",
    "rich",
    "transformers",
    "libcst",
    "torchdata",
    "matplotlib",
    "safetensors",
)


def _provided(namespace: str) -> set[str]:
    return {n for n, row in TABLE[namespace].items() if row.status != NOT_PROVIDED}


def test_every_exported_name_exists_and_every_provided_name_is_exported():
    for module, namespace in (
        (slipstream, "accelerate"),
        (slipstream.utils, "accelerate.utils"),
        (slipstream.logging, "accelerate.logging"),
    ):
        assert [n for n in module.__all__ if not hasattr(module, n)] == []
        assert len(set(module.__all__)) == len(module.__all__)
        assert sorted(_provided(namespace) - set(module.__all__)) == [], module.__name__


def test_the_top_level_exports_are_lazy_and_complete():
    assert set(slipstream.__all__) - {"__version__"} == set(slipstream._EXPORTS)
    for name, module in slipstream._EXPORTS.items():
        assert getattr(importlib.import_module(f"slipstream.{module}"), name) is getattr(
            slipstream, name
        )
    assert "debug_launcher" in dir(slipstream)


def test_utils_exports_the_same_objects_as_their_modules():
    from slipstream.runtime.env import str_to_bool
    from slipstream.runtime.nested import find_batch_size
    from slipstream.runtime.synchronize import synchronize_rng_states

    assert slipstream.utils.str_to_bool is str_to_bool
    assert slipstream.utils.find_batch_size is find_batch_size
    assert slipstream.utils.synchronize_rng_states is slipstream.synchronize_rng_states
    assert synchronize_rng_states is slipstream.synchronize_rng_states


def test_importing_slipstream_imports_no_optional_dependency():
    code = (
        "import sys\n"
        "import torch\n"  # torch's own imports (torch.hub imports tqdm) are not ours
        "before = {m.split('.')[0] for m in sys.modules}\n"
        "import slipstream\n"
        "print(sorted(m for m in sys.modules if m.startswith('slipstream.')))\n"
        "import slipstream.utils, slipstream.logging\n"
        "added = {m.split('.')[0] for m in sys.modules} - before\n"
        f"print(sorted(added & set({OPTIONAL!r})))\n"
    )
    result = run_python("-c", code, fresh=True)  # (a warm command has slipstream imported)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["[]", "[]"]
