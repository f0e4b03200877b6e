"""save_state / load_state: everything needed to continue training exactly.

Saved: every prepared model and optimizer (in the layout the strategy chooses), schedulers,
the fp16 loss scaler, the dataloaders' positions, every process's RNG states, the step
counters and any object registered with ``register_for_checkpointing``. Loading validates
everything (files present, counts, names and shapes) before changing anything.

Every step that only some processes perform (committing, rotating) reports its outcome to
all processes, so a failure raises on every rank instead of leaving the others waiting in
a collective; so does every check a load makes.

Usually all processes save into one shared folder, committed by the main process. Each
process may also name its own folder, or the same path may be a different folder on each
machine (local disks): :func:`~slipstream.checkpoint.layout.discover_layout` finds out,
and then the first process of each folder writes the shared files into it and commits it
(strategies that write one checkpoint jointly, FSDP and DeepSpeed, are refused).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from torch import nn

from ..checkpoint.commit import (
    CheckpointError,
    Location,
    next_automatic_index,
    prepare_target,
    publish,
    read_marker,
    recover,
    rotate,
    write_marker,
)
from ..checkpoint.io import CheckpointReader, CheckpointWriter
from ..checkpoint.layout import (
    FolderLayout,
    discover_layout,
    everyone,
    gathered,
    newest_everywhere,
)
from ..checkpoint.names import indexed_name
from ..checkpoint.rng import capture_rng_states, restore_rng_states
from ..checkpoint.storage import Storage
from ..optim.elastic import describe_resize, resumed_micro_steps
from ..optim.step import StepState
from ..options.kwargs import ProjectConfiguration
from ..runtime import collectives
from ..runtime.events import announce
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
    layout: FolderLayout
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
        return everyone(self.state, action)

    def resolve_save_path(self, path: str | None) -> str:
        if path is not None:
            return str(path)
        if not self.project.automatic_checkpoint_naming:
            raise CheckpointError(
                "save_state() needs a path, or Accelerator(project_config=ProjectConfiguration("
                "project_dir=..., automatic_checkpoint_naming=True))"
            )
        storage = Storage.for_url(self._checkpoints_folder())
        # Each process names the checkpoint in its own project folder (they may differ, or
        # be node-local disks); the number is the next free one in every folder.
        taken = gathered(self.state, lambda: next_automatic_index(storage, storage.root))
        index = max(*taken, int(self.project.iteration))
        return storage.url(storage.join(storage.root, f"checkpoint_{index}"))

    def resolve_load_path(self, path: str | None) -> str:
        if path is not None:
            return str(path)
        if not self.project.automatic_checkpoint_naming:
            raise CheckpointError(
                "load_state() needs a path, or automatic checkpoint naming to find the latest"
            )
        found = self.latest()
        if found is None:
            folder = self._checkpoints_folder()
            raise CheckpointError(f"no complete checkpoint_N folder in {folder}")
        return found

    def latest(self) -> str | None:
        """The newest ``checkpoint_N`` complete in every process's project checkpoint folder
        (collective; each process gets its own folder's path), or ``None`` if there is none
        anywhere."""
        storage = Storage.for_url(self._checkpoints_folder())
        newest = newest_everywhere(storage, self.state)
        if newest is None:
            return None
        return storage.url(storage.join(storage.root, f"checkpoint_{newest}"))

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
        layout = discover_layout(location, self.state)
        if not layout.shared:
            self._check_separate_folders(objects, layout)
        owner = layout.is_owner(self.state.process_index)
        self._everyone(lambda: prepare_target(location) if owner else None)
        writer = CheckpointWriter(
            storage, location.staging, self.state, deferred=async_save, owner=owner
        )

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
        pending = _PendingSave(location, writer, manifest, layout)
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
        layout, rank = pending.layout, self.state.process_index
        if not layout.shared:
            # Every folder gets the main process's manifest (dataloader positions, counts).
            manifest = collectives.broadcast_object_list([manifest], 0, state=self.state)[0]
        # A folder lists the files of the processes that wrote into it.
        manifest["files"] = {str(r): files[r] for r in layout.members(rank)}

        def commit() -> None:
            if not layout.is_owner(rank):
                return
            write_marker(storage, location.staging, manifest)
            publish(location)
            if self.project.automatic_checkpoint_naming and self.project.total_limit:
                rotate(storage, storage.parent(location.path), self.project.total_limit)

        # Each owner commits its folder; a failure anywhere raises everywhere.
        self._everyone(commit)
        final = storage.url(location.path)
        self.project.iteration = (
            _automatic_index(final) + 1 if _is_automatic(final) else (self.project.iteration)
        )
        return final

    def _check_separate_folders(self, objects: TrainingObjects, layout: FolderLayout) -> None:
        """Refuse (on every process, before writing) a save into folders the processes do
        not share when the strategy writes its model or optimizer files jointly."""
        kind = type(self.strategy)
        joint = (
            kind.save_model_checkpoint is not Strategy.save_model_checkpoint
            or kind.save_optimizer_checkpoint is not Strategy.save_optimizer_checkpoint
        )
        if joint and (objects.models or objects.optimizers):
            raise CheckpointError(
                f"save_state: the processes write into folders they do not share "
                f"({layout.describe()}), but the {self.strategy.name} strategy writes model "
                "and optimizer state jointly, each process its part of one folder; save to "
                "a path every process shares (a shared filesystem or an object store URL)"
            )

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
        if writer.owner:  # the main process, or the first of a folder it does not share
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
                "data_parallel_size": self.state.data_parallel_size,
            },
            "files": {str(rank): names for rank, names in enumerate(files)},
        }

    # -- load -----------------------------------------------------------------------------
    def load(self, path: str | None, objects: TrainingObjects) -> str:
        """Restore ``objects`` from a checkpoint; returns the location it came from.

        Each process reads its own path (they may differ, or be node-local copies); a
        problem on any process raises on all of them before anything changes."""
        self.wait()
        source = self.resolve_load_path(path)
        reader = self._everyone(lambda: self._open(source))
        url = reader.storage.url(reader.folder)
        models = list(objects.models)
        for hook in objects.load_hooks:
            hook(models, url)
        apply, rng = self._everyone(lambda: self._read(reader, objects, models))
        for action in apply:
            action()
        step = reader.manifest["step"]
        objects.step_state.optimizer_steps = int(step["optimizer_steps"])
        objects.step_state.micro_steps = resumed_micro_steps(
            int(step["micro_steps"]), step.get("data_parallel_size"), self.state.data_parallel_size
        )
        if rng is not None:
            restore_rng_states(rng)  # last: nothing after this draws random numbers
        saved_by = int(reader.manifest["num_processes"])
        if saved_by != self.state.num_processes and self.state.is_main_process:
            announce(
                describe_resize(url, step, saved_by, self.state.num_processes, objects.step_state)
            )
        return url

    def _open(self, source: str) -> CheckpointReader:
        storage = Storage.for_url(source)
        folder = recover(storage, storage.root)
        reader = CheckpointReader(storage, folder, self.state, read_marker(storage, folder))
        self._check_files(reader)
        return reader

    def _read(
        self, reader: CheckpointReader, objects: TrainingObjects, models: list[nn.Module]
    ) -> tuple[list[Callable[[], None]], Any]:
        """Read and validate everything; the functions that apply it, and the RNG states."""
        manifest, url = reader.manifest, reader.storage.url(reader.folder)
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
        return apply, rng

    def _check_files(self, reader: CheckpointReader) -> None:
        files, rank = reader.manifest["files"], self.state.process_index
        saved_by = int(reader.manifest["num_processes"])
        if saved_by == self.state.num_processes and str(rank) not in files:
            # A folder that only some processes wrote (separate or machine-local folders):
            # this process's own state (RNG, dataloader) is elsewhere.
            writers = ", ".join(sorted(files, key=int))
            raise CheckpointError(
                f"{reader.storage.url(reader.folder)} holds the state of process(es) {writers}, "
                f"not of process {rank}: load each process from the folder it saved to (on "
                "machine-local disks, keep processes on the machines that saved them)"
            )
        present = set(reader.storage.listdir(reader.folder))
        listed = {name for names in files.values() for name in names}
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
            return None  # a process the checkpoint did not have: the resume line says so
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
