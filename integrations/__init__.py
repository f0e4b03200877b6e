"""Thin adapters from the slipstream core to other frameworks (Lightning, transformers' Trainer,
torchmetrics, fsspec).

Each adapter is a subpackage imported on demand, so ``import slipstream.integrations`` is
free of optional dependencies.
"""
