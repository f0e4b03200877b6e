"""Ray Train adapter: run a slipstream script inside Ray Train's ``TorchTrainer``.

Ray Train starts the workers and their process group (gloo on CPU, NCCL on GPUs) and sets
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``; the ``Accelerator`` joins that group as it is (it
does not initialise another). These helpers send metrics and checkpoints through Ray's
APIs, so Ray's ``FailureConfig`` restarts a failed run from the last reported checkpoint.
Ray is imported only when they are used (``pip install "slipstream[ray]"``).

Example::

    from slipstream.integrations.ray import RayTracker, load_checkpoint, report

    def train_loop(config):
        accelerator = Accelerator(log_with=[RayTracker()])
        model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
        load_checkpoint(accelerator)          # resume after Ray restarted the run
        for batch in loader:
            ...
            report(accelerator, {"loss": loss.item()})   # save_state + ray.train.report

    TorchTrainer(train_loop, scaling_config=ScalingConfig(num_workers=2),
                 run_config=RunConfig(failure_config=FailureConfig(max_failures=3))).fit()
"""

from .train import RayTracker, in_ray_train, load_checkpoint, report

__all__ = ["RayTracker", "in_ray_train", "load_checkpoint", "report"]
