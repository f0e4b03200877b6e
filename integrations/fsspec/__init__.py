"""fsspec adapter: checkpoint files and model weights on any fsspec URL.

``FsspecCheckpointIO`` has the interface of Lightning's ``CheckpointIO`` (save, load,
remove) without importing Lightning; the Lightning strategy wraps it. The Accelerator's own
``save_state``/``load_state``/``save_model`` take the same URLs through the core storage.

Example::

    io = FsspecCheckpointIO()
    io.save_checkpoint({"state_dict": model.state_dict()}, "s3://bucket/run/last.ckpt")
    checkpoint = io.load_checkpoint("s3://bucket/run/last.ckpt")
"""

from .checkpoint_io import FsspecCheckpointIO, load_weights, save_weights

__all__ = ["FsspecCheckpointIO", "load_weights", "save_weights"]
