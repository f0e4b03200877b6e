"""save_state / load_state: everything needed to continue training exactly.

Saved: every prepared model and optimizer (in the layout the strategy chooses), schedulers,
the fp16 loss scaler, the dataloaders' positions, every process's RNG states, the step
counters and any object registered with ``register_for_checkpointing``. Loading validates
everything (files present, counts, names and shapes) before changing anything.

Every step that only the main process performs (naming, committing, rotating) reports its
outcome to all processes, so a failure raises on every rank instead of leaving the others
waiting in a collective.
"""

from __future__ import annotations

import threading
import uuid
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from torch import nn

from ..checkpoint.commit import (
    CheckpointError,
    Location,
    automatic_checkpoints,
    next_automatic_index,
    prepare_target,
    publish,
    read_marker,
    recover,
    rotate,
    write_marker,
)
from ..checkpoint.io import CheckpointReader, CheckpointWriter
from ..checkpoint.names import indexed_name
from ..checkpoint.rng import capture_rng_states, restore_rng_states
from ..checkpoint.storage import Storage
from ..optim.step import StepState
from ..options.kwargs import ProjectConfiguration
from ..runtime import collectives
from ..runtime.state import ProcessState
from ..strategies.base import Strategy

T = TypeVar("T")

SaveHook = Callable[[list[nn.Module], list[dict[str, Any]], str], None]
LoadHook = Callable[[list[nn.Module], str], None]


@dataclass
class TrainingObjects:
    """What a checkpoint holds, as prepared by the Accelerator (strategy-level models)."""

    models: list[nn.Module]
    optimizers: list[Any]
    schedulers: list[Any]
    dataloaders: list[Any]
    scaler: Any
    step_state: StepState
    custom: list[Any] = field(default_factory=list)
    save_hooks: list[SaveHook] = field(default_factory=list)
    load_hooks: list[LoadHook] = field(default_factory=list)
    strategy_name: str = ""
    mixed_precision: str = "no"
    #: Extra state to keep (the callbacks'), and where to hand it back on load.
    extra_state: Callable[[], dict[str, Any]] | None = None
    restore_extra: Callable[[dict[str, Any]], None] | None = None


@dataclass
class _PendingSave:
    """A save whose files are (being) written but which is not committed yet."""

    location: Location
    writer: CheckpointWriter
    manifest: dict[str, Any]
    thread: threading.Thread | None = None


class Checkpointer:
    """Saves and loads :class:`TrainingObjects` with a strategy's layout."""

    def __init__(
        self, state: ProcessState, strategy: Strategy, project: ProjectConfiguration
    ) -> None:
        self.state = state
        self.strategy = strategy
        self.project = project
        self._pending: _PendingSave | None = None

    # -- where --------------------------------------------------------------------------------
    def _checkpoints_folder(self) -> str:
        if not self.project.project_dir:
            raise CheckpointError(
                "automatic checkpoint naming needs a project directory: "
                "ProjectConfiguration(project_dir=..., automatic_checkpoint_naming=True)"
            )
        storage = Storage.for_url(self.project.project_dir)
        return storage.url(storage.join(storage.root, "checkpoints"))

    def _on_main(self, action: Callable[[], T]) -> T:
        """Run ``action`` on the main process; every process gets its result or its error."""
        outcome: list[Any] = [None, None]
        if self.state.is_main_process:
            try:
                outcome = [action(), None]
            except Exception as error:
                outcome = [None, f"{type(error).__name__}: {error}"]
        outcome = collectives.broadcast_object_list(outcome, 0, state=self.state)
        if outcome[1] is not None:
            raise CheckpointError(f"on the main process: {outcome[1]}")
        return outcome[0]

    def _everyone(self, action: Callable[[], T]) -> T:
        """Run ``action`` everywhere; if it fails on any process, raise on all of them."""
        result: Any = None
        error: str | None = None
        try:
            result = action()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            if self.state.num_processes == 1:
                raise
        errors = collectives.gather_object([error], state=self.state)
        failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
        if failed:
            details = "; ".join(f"process {rank}: {e}" for rank, e in failed)
            raise CheckpointError(details)
        return result

    def resolve_save_path(self, path: str | None) -> str:
        if path is not None:
            return str(path)
        if not self.project.automatic_checkpoint_naming:
            raise CheckpointError(
                "save_state() needs a path, or Accelerator(project_config=ProjectConfiguration("
                "project_dir=..., automatic_checkpoint_naming=True))"
            )
        folder = self._checkpoints_folder()

        def name() -> str:
            storage = Storage.for_url(folder)
            index = max(next_automatic_index(storage, storage.root), int(self.project.iteration))
            return storage.url(storage.join(storage.root, f"checkpoint_{index}"))

        return self._on_main(name)

    def resolve_load_path(self, path: str | None) -> str:
        if path is not None:
            return str(path)
        if not self.project.automatic_checkpoint_naming:
            raise CheckpointError(
                "load_state() needs a path, or automatic checkpoint naming to find the latest"
            )
        folder = self._checkpoints_folder()
        storage = Storage.for_url(folder)
        found = automatic_checkpoints(storage, storage.root)
        if not found:
            raise CheckpointError(f"no complete checkpoint_N folder in {folder}")
        return storage.url(found[-1][1])

    def latest(self) -> str | None:
        """The newest complete ``checkpoint_N`` in the project's checkpoint folder, if any."""
        folder = self._checkpoints_folder()

        def find() -> str | None:
            storage = Storage.for_url(folder)
            if not storage.exists(storage.root):
                return None
            found = automatic_checkpoints(storage, storage.root)
            return storage.url(found[-1][1]) if found else None

        return self._on_main(find)

    # -- save -----------------------------------------------------------------------------
    def save(self, path: str | None, objects: TrainingObjects, async_save: bool = False) -> str:
        """Write a checkpoint of ``objects``; returns its final location.

        With ``async_save`` only a CPU snapshot is taken now; the files are written in a
        background thread and the checkpoint is committed by :meth:`wait` (called by the
        next save or load and by ``end_training``). Until then it is not visible.
        """
        self.wait()
        target = self.resolve_save_path(path)
        storage = Storage.for_url(target)
        token = self._on_main(lambda: uuid.uuid4().hex[:12])
        location = Location(storage, storage.root, token)
        self._on_main(lambda: prepare_target(location))
        writer = CheckpointWriter(storage, location.staging, self.state, deferred=async_save)

        weights = [self.strategy.checkpoint_state_dict(m) for m in objects.models]
        models = list(objects.models)
        for hook in objects.save_hooks:
            # Hooks write their own files into the folder that becomes the checkpoint.
            hook(models, weights, storage.url(location.staging))

        def write_parts() -> list[str]:
            self._write(writer, objects, models, weights)
            return writer.written

        self._everyone(write_parts)
        manifest = self._manifest(objects, len(weights), [])
        if self.state.is_main_process:
            manifest["dataloaders"] = [loader.position_state() for loader in objects.dataloaders]
        pending = _PendingSave(location, writer, manifest)
        if async_save:
            pending.thread = threading.Thread(target=writer.flush, name="slipstream-save")
            pending.thread.start()
            self._pending = pending
            return storage.url(location.path)
        return self._commit(pending)

    def wait(self) -> str | None:
        """Commit an asynchronous save that is still pending (collective); its location."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        return self._commit(pending)

    def _commit(self, pending: _PendingSave) -> str:
        location, writer, manifest = pending.location, pending.writer, pending.manifest
        storage = location.storage
        if pending.thread is not None:
            pending.thread.join()

        def check_written() -> None:
            if writer.error is not None:
                raise CheckpointError(
                    f"writing {storage.url(location.staging)} failed: {writer.error}"
                )

        self._everyone(check_written)
        files = collectives.gather_object([writer.written], state=self.state)
        manifest["files"] = {str(rank): names for rank, names in enumerate(files)}

        def commit() -> str:
            write_marker(storage, location.staging, manifest)
            publish(location)
            if self.project.automatic_checkpoint_naming and self.project.total_limit:
                rotate(storage, storage.parent(location.path), self.project.total_limit)
            return storage.url(location.path)

        final = self._on_main(commit)
        self.project.iteration = (
            _automatic_index(final) + 1 if _is_automatic(final) else (self.project.iteration)
        )
        return final

    def _write(
        self,
        writer: CheckpointWriter,
        objects: TrainingObjects,
        models: list[nn.Module],
        weights: list[dict[str, Any]],
    ) -> None:
        extra = objects.extra_state() if objects.extra_state is not None else {}
        for index, (model, state_dict) in enumerate(zip(models, weights, strict=True)):
            self.strategy.save_model_checkpoint(model, state_dict, writer, index)
        for index, optimizer in enumerate(objects.optimizers):
            self.strategy.save_optimizer_checkpoint(optimizer, writer, index)
        main = self.state.is_main_process
        if main:
            for index, scheduler in enumerate(objects.schedulers):
                writer.save_object(indexed_name("scheduler", index, ".bin"), scheduler.state_dict())
            if objects.scaler is not None:
                writer.save_object("scaler.pt", objects.scaler.state_dict())
            for index, obj in enumerate(objects.custom):
                writer.save_object(f"custom_checkpoint_{index}.pkl", obj.state_dict())
            if extra:
                writer.save_object("callbacks.pkl", extra)
        writer.save_object(f"random_states_{self.state.process_index}.pkl", capture_rng_states())
        loader_states = [loader.process_state() for loader in objects.dataloaders]
        if any(state is not None for state in loader_states):
            writer.save_object(f"dataloader_states_{self.state.process_index}.pkl", loader_states)

    def _manifest(
        self, objects: TrainingObjects, saved_models: int, files: list[Any]
    ) -> dict[str, Any]:
        from .. import __version__

        step = objects.step_state
        return {
            "slipstream": __version__,
            "num_processes": self.state.num_processes,
            "strategy": objects.strategy_name,
            "mixed_precision": objects.mixed_precision,
            "models": saved_models,
            "optimizers": len(objects.optimizers),
            "schedulers": len(objects.schedulers),
            "custom_objects": len(objects.custom),
            "scaler": objects.scaler is not None,
            "step": {
                "optimizer_steps": step.optimizer_steps,
                "micro_steps": step.micro_steps,
                "gradient_accumulation_steps": step.gradient_accumulation_steps,
            },
            "files": {str(rank): names for rank, names in enumerate(files)},
        }

    # -- load -----------------------------------------------------------------------------
    def load(self, path: str | None, objects: TrainingObjects) -> str:
        """Restore ``objects`` from a checkpoint; returns the location it came from."""
        self.wait()
        source = self.resolve_load_path(path)
        storage = Storage.for_url(source)
        folder = recover(storage, storage.root)
        manifest = read_marker(storage, folder)
        reader = CheckpointReader(storage, folder, self.state, manifest)
        url = storage.url(folder)
        self._check_files(reader)

        models = list(objects.models)
        for hook in objects.load_hooks:
            hook(models, url)
        _check_count(url, "model", manifest["models"], len(models))
        _check_count(url, "optimizer", manifest["optimizers"], len(objects.optimizers))
        _check_count(url, "scheduler", manifest["schedulers"], len(objects.schedulers))
        _check_count(
            url,
            "object registered for checkpointing",
            manifest["custom_objects"],
            len(objects.custom),
        )
        _check_count(
            url, "prepared dataloader", len(manifest["dataloaders"]), len(objects.dataloaders)
        )
        if manifest["scaler"] != (objects.scaler is not None):
            raise CheckpointError(
                f"{url} was saved with mixed_precision={manifest['mixed_precision']!r} "
                f"{'with' if manifest['scaler'] else 'without'} an fp16 loss scaler; this "
                "Accelerator uses the other; use the same mixed_precision to resume"
            )

        apply: list[Callable[[], None]] = []
        for index, model in enumerate(models):
            apply.append(self.strategy.load_model_checkpoint(model, reader, index))
        for index, optimizer in enumerate(objects.optimizers):
            apply.append(self.strategy.load_optimizer_checkpoint(optimizer, reader, index))
        for index, scheduler in enumerate(objects.schedulers):
            saved = reader.load_object(indexed_name("scheduler", index, ".bin"), "scheduler")
            apply.append(_applier(scheduler.load_state_dict, saved))
        if objects.scaler is not None:
            apply.append(
                _applier(objects.scaler.load_state_dict, reader.load_object("scaler.pt", "scaler"))
            )
        for index, obj in enumerate(objects.custom):
            saved = reader.load_object(f"custom_checkpoint_{index}.pkl", "registered object")
            apply.append(_applier(obj.load_state_dict, saved))
        own_states = self._dataloader_states(reader, manifest, len(objects.dataloaders))
        for loader, position, own in zip(
            objects.dataloaders, manifest["dataloaders"], own_states, strict=True
        ):
            loader.resume_position(position)  # validates before anything changes
            apply.append(_applier(loader.load_state_dict, {**position, "process_state": own}))
        rng = self._rng_states(reader, manifest)
        if objects.restore_extra is not None and reader.storage.exists(
            reader.path("callbacks.pkl")
        ):
            saved_extra = reader.load_object("callbacks.pkl", "callback state")
            apply.append(_applier(objects.restore_extra, saved_extra))

        for action in apply:
            action()
        step = manifest["step"]
        objects.step_state.optimizer_steps = int(step["optimizer_steps"])
        objects.step_state.micro_steps = int(step["micro_steps"])
        if rng is not None:
            restore_rng_states(rng)  # last: nothing after this draws random numbers
        return url

    def _check_files(self, reader: CheckpointReader) -> None:
        present = set(reader.storage.listdir(reader.folder))
        listed = {name for names in reader.manifest["files"].values() for name in names}
        missing = sorted(listed - present)
        if missing:
            raise CheckpointError(
                f"{reader.storage.url(reader.folder)} is incomplete: {missing[:6]} listed in its "
                "manifest are missing (was it copied partially?)"
            )

    def _dataloader_states(
        self, reader: CheckpointReader, manifest: dict[str, Any], count: int
    ) -> list[Any]:
        """Each loader's state of this process (stateful datasets), when saved by as many
        processes; otherwise ``None`` each: loaders then resume from their position."""
        name = f"dataloader_states_{self.state.process_index}.pkl"
        if manifest["num_processes"] != self.state.num_processes or not reader.storage.exists(
            reader.path(name)
        ):
            return [None] * count
        states = reader.load_object(name, "dataloader states")
        return list(states) if len(states) == count else [None] * count

    def _rng_states(self, reader: CheckpointReader, manifest: dict[str, Any]) -> Any:
        name = f"random_states_{self.state.process_index}.pkl"
        if not reader.storage.exists(reader.path(name)):
            warnings.warn(
                f"{reader.storage.url(reader.folder)} was saved by {manifest['num_processes']} "
                f"process(es) and has no RNG state for process {self.state.process_index}; its "
                "random number generators keep their current state",
                stacklevel=3,
            )
            return None
        return reader.load_object(name, "random states")


def _applier(load: Callable[[Any], Any], state: Any) -> Callable[[], None]:
    def apply() -> None:
        load(state)

    return apply


def _check_count(url: str, what: str, saved: int, prepared: int) -> None:
    if saved != prepared:
        raise CheckpointError(
            f"{url} holds {saved} {what}(s) but {prepared} {'is' if prepared == 1 else 'are'} "
            f"prepared now; prepare the same objects, in the same order, as when saving"
        )


def _is_automatic(url: str) -> bool:
    name = url.rstrip("/").rsplit("/", 1)[-1]
    return name.startswith("checkpoint_") and name[len("checkpoint_") :].isdecimal()


def _automatic_index(url: str) -> int:
    return int(url.rstrip("/").rsplit("_", 1)[-1])
