"""Sharded data loading: pure samplers with explicit (rank, world) and the loader wrapper."""

from ..active_loaders import ActiveLoaders
from .iterable import IterableDatasetShard
from .loader import PreparedDataLoader
from .prepare import DataLoaderPreparationError, prepare_data_loader, skip_first_batches
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
