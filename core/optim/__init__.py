"""Optimizer and scheduler wrappers, and the step state that decides when a step is real
(gradient accumulation, skipped fp16 steps).
"""
