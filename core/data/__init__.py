"""Sharded data loading: pure samplers with explicit (rank, world) and the loader wrapper."""

from .iterable import IterableDatasetShard
from .loader import (
    ActiveLoaders,
    DataLoaderPreparationError,
    PreparedDataLoader,
    prepare_data_loader,
    skip_first_batches,
)
from .samplers import SeedableRandomSampler, ShardedBatchSampler, SkipBatchSampler

__all__ = [
    "ActiveLoaders",
    "DataLoaderPreparationError",
    "IterableDatasetShard",
    "PreparedDataLoader",
    "SeedableRandomSampler",
    "ShardedBatchSampler",
    "SkipBatchSampler",
    "prepare_data_loader",
    "skip_first_batches",
]
