"""Sharded data loading: pure samplers with explicit (rank, world) and the loader wrapper.

Names are imported from their modules on first use: the Accelerator holds an
:class:`ActiveLoaders` without importing ``torch.utils.data`` (benchmarks/startup.py).
"""

from __future__ import annotations

from ..runtime.lazy import lazy_exports

_EXPORTS = {
    "ActiveLoaders": "active_loaders",
    "DataLoaderDispatcher": "named_loaders",
    "DataLoaderPreparationError": "prepare",
    "DataLoaderShard": "named_loaders",
    "IterableDatasetShard": "iterable",
    "PreparedDataLoader": "loader",
    "SeedableRandomSampler": "samplers",
    "ShardedBatchSampler": "samplers",
    "SkipBatchSampler": "samplers",
    "prepare_data_loader": "prepare",
    "shard_data_loader": "prepare",
    "skip_first_batches": "prepare",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, globals())
