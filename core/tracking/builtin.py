"""Trackers shipped with slipstream: CSV and TensorBoard (built in), Weights & Biases and
MLflow (when installed)."""

from __future__ import annotations

import csv
import json
import os
from typing import Any, ClassVar

from .base import GeneralTracker, scalar


class CSVTracker(GeneralTracker):
    """``{logging_dir}/{run}/metrics.csv`` (a column per logged name, a row per log call)
    and ``hparams.yaml``; no dependency needed."""

    name: ClassVar[str] = "csv"
    requires_logging_directory: ClassVar[bool] = True

    def __init__(self, run_name: str = "", logging_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(run_name, logging_dir)
        self.folder = os.path.join(logging_dir or ".", run_name)
        os.makedirs(self.folder, exist_ok=True)
        self.path = os.path.join(self.folder, "metrics.csv")
        self.columns: list[str] = ["step"]
        self.rows: list[dict[str, Any]] = []

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        import yaml

        with open(os.path.join(self.folder, "hparams.yaml"), "w") as handle:
            yaml.safe_dump(json.loads(json.dumps(values, default=str)), handle, sort_keys=True)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        row = {"step": step, **{k: scalar(v) for k, v in values.items()}}
        self.rows.append(row)
        new = [key for key in row if key not in self.columns]
        if new:
            self.columns += new
            self._write_all()  # a new column: rewrite with the wider header
        else:
            with open(self.path, "a", newline="") as handle:
                csv.DictWriter(handle, self.columns).writerow(row)

    def _write_all(self) -> None:
        with open(self.path, "w", newline="") as handle:
            writer = csv.DictWriter(handle, self.columns)
            writer.writeheader()
            writer.writerows(self.rows)


class TensorBoardTracker(GeneralTracker):
    """TensorBoard event files under ``{logging_dir}/{run}`` (needs ``tensorboard``)."""

    name: ClassVar[str] = "tensorboard"
    requires_logging_directory: ClassVar[bool] = True

    def __init__(self, run_name: str = "", logging_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(run_name, logging_dir)
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise ImportError(
                "log_with='tensorboard' needs the tensorboard package: pip install tensorboard"
            ) from None
        self.writer = SummaryWriter(os.path.join(logging_dir or ".", run_name), **kwargs)

    @property
    def tracker(self) -> Any:
        return self.writer

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        import yaml

        flat = {
            k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in values.items()
        }
        self.writer.add_text("hparams", yaml.safe_dump(flat, sort_keys=True), 0)
        self.writer.add_hparams(flat, metric_dict={}, run_name=".")
        self.writer.flush()

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        for key, value in values.items():
            value = scalar(value)
            if isinstance(value, (int, float)):
                self.writer.add_scalar(key, value, global_step=step, **kwargs)
            elif isinstance(value, str):
                self.writer.add_text(key, value, global_step=step, **kwargs)
            elif isinstance(value, dict):
                self.writer.add_scalars(key, value, global_step=step, **kwargs)
        self.writer.flush()

    def finish(self) -> None:
        self.writer.close()


class WandBTracker(GeneralTracker):
    """A Weights & Biases run (needs ``wandb``; works offline with WANDB_MODE=offline)."""

    name: ClassVar[str] = "wandb"

    def __init__(self, run_name: str = "", logging_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(run_name, logging_dir)
        try:
            import wandb
        except ImportError:
            raise ImportError("log_with='wandb' needs wandb: pip install wandb") from None
        self.run = wandb.init(project=run_name, dir=logging_dir, **kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.run.config.update(values, allow_val_change=True)

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        self.run.log({k: scalar(v) for k, v in values.items()}, step=step, **kwargs)

    def finish(self) -> None:
        self.run.finish()


class MLflowTracker(GeneralTracker):
    """An MLflow run (needs ``mlflow``; a local ``mlruns`` folder unless configured)."""

    name: ClassVar[str] = "mlflow"

    def __init__(self, run_name: str = "", logging_dir: str | None = None, **kwargs: Any) -> None:
        super().__init__(run_name, logging_dir)
        try:
            import mlflow
        except ImportError:
            raise ImportError("log_with='mlflow' needs mlflow: pip install mlflow") from None
        self.mlflow = mlflow
        if logging_dir and not mlflow.get_tracking_uri().startswith(("http", "databricks")):
            mlflow.set_tracking_uri(f"file://{os.path.abspath(logging_dir)}/mlruns")
        mlflow.set_experiment(run_name or "slipstream")
        self.run = mlflow.start_run(**kwargs)

    @property
    def tracker(self) -> Any:
        return self.run

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        self.mlflow.log_params({k: str(v)[:250] for k, v in values.items()})

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        numbers = {k: scalar(v) for k, v in values.items()}
        self.mlflow.log_metrics(
            {k: v for k, v in numbers.items() if isinstance(v, (int, float))}, step=step
        )

    def finish(self) -> None:
        self.mlflow.end_run()
