"""Accelerate's view of a :class:`~slipstream.parallel.config.ParallelismConfig`: sizes read
from ``accelerate launch``'s ``PARALLELISM_CONFIG_*`` variables, the names of the enabled
mesh dimensions by role, and ``build_device_mesh``, which builds the
``DeviceMesh`` with Accelerate's flattened dimensions (``dp``, ``dp_shard_cp``, ``dp_cp``)
for code that builds its own mesh. The Accelerator builds the job's mesh itself
(:func:`slipstream.parallel.mesh.configure_parallelism`); these are for scripts written
against Accelerate's ``ParallelismConfig``.

Example::

    config = ParallelismConfig(dp_shard_size=2, tp_size=2)
    mesh = config.build_device_mesh("cpu")       # 4 processes: dims ("dp_shard", "tp")
    mesh["dp_shard_cp"]                          # what FSDP2 shards over
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from ..runtime.env import parallelism_environment

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh


#: The order of the dimensions in the mesh, outermost first (as in config.MESH_DIMS).
_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class AccelerateView:
    """Mixed into ``ParallelismConfig``: Accelerate's launcher variables, size properties
    and mesh names."""

    pp_size: int | None
    ep_size: int | None
    dp_replicate_size: int | None
    dp_shard_size: int | None
    cp_size: int | None
    tp_size: int | None
    #: The resolved sizes (config.MeshSizes) once the job's layout is known.
    sizes: Any

    def _size(self, dim: str) -> int:
        if self.sizes is not None:
            return self.sizes.size(dim)
        value = getattr(self, f"{dim}_size")
        return 1 if value in (None, -1) else int(value)

    @property
    def dp_replicate_enabled(self) -> bool:
        return self._size("dp_replicate") > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self._size("dp_shard") > 1

    @property
    def tp_enabled(self) -> bool:
        return self._size("tp") > 1

    @property
    def cp_enabled(self) -> bool:
        return self._size("cp") > 1

    @property
    def pp_enabled(self) -> bool:
        return self._size("pp") > 1

    @property
    def ep_enabled(self) -> bool:
        return self._size("ep") > 1

    @property
    def total_size(self) -> int:
        return math.prod(self._size(d) for d in _ORDER)

    @property
    def data_parallel_size(self) -> int:
        return self._size("dp_replicate") * self._size("dp_shard")

    @property
    def non_data_parallel_size(self) -> int:
        return self._size("tp") * self._size("cp") * self._size("pp")

    @property
    def model_parallel(self) -> bool:
        """Whether anything beyond plain data parallelism is asked for."""
        return self.tp_enabled or self.cp_enabled or self.pp_enabled or self.ep_enabled

    @property
    def active_mesh_dims(self) -> list[str]:
        return [d for d in _ORDER if self._size(d) > 1]

    #: Accelerate's DeepSpeed (Ulysses) sequence parallelism, which slipstream does not
    #: provide: never enabled (``transformers.Trainer`` asks).
    sp_backend = "deepspeed"
    sp_size = 1
    sp_enabled = False

    def to_config(self) -> dict[str, Any]:
        raise NotImplementedError

    def to_json(self) -> dict[str, Any]:
        """The settings as ``TrainingArguments.to_dict`` stores them (:meth:`to_config`)."""
        return self.to_config()

    def resolve(self, world_size: int) -> Any:  # config.MeshSizes
        raise NotImplementedError

    def _read_launcher_variables(self) -> None:
        """Sizes not given come from ``accelerate launch``'s variables, so a script started
        by either launcher sees the same layout."""
        from .config_values import as_size
        from .errors import ParallelismConfigError

        variables = parallelism_environment()
        for dim in ("dp_replicate", "dp_shard", "tp", "cp", "pp", "ep"):
            value = variables.get(f"{dim}_size")
            if getattr(self, f"{dim}_size") is None and value not in (None, ""):
                setattr(
                    self, f"{dim}_size", as_size(f"PARALLELISM_CONFIG_{dim.upper()}_SIZE", value)
                )
        if variables.get("sp_size", "1") not in ("", "1"):
            raise ParallelismConfigError(
                f"PARALLELISM_CONFIG_SP_SIZE={variables['sp_size']} asks for DeepSpeed sequence "
                "parallelism (Ulysses), which slipstream does not provide; use "
                "parallelism_config_cp_size (context parallelism) for long sequences"
            )

    def _enabled(self, *dims: str) -> list[str]:
        return [d for d in dims if self._size(d) > 1]

    @property
    def dp_dim_names(self) -> list[str]:
        """The enabled data-parallel dimensions (they see different samples)."""
        return self._enabled("dp_replicate", "dp_shard")

    @property
    def non_dp_dim_names(self) -> list[str]:
        """The enabled dimensions whose processes see the same batch."""
        return self._enabled("tp", "cp", "pp")

    @property
    def dp_shard_cp_dim_names(self) -> list[str]:
        """The enabled dimensions FSDP shards the model over (flattened as ``dp_shard_cp``)."""
        return self._enabled("dp_shard", "cp")

    @property
    def dp_cp_dim_names(self) -> list[str]:
        """The enabled dimensions a loss is averaged over (flattened as ``dp_cp``)."""
        return self._enabled("dp_replicate", "dp_shard", "cp")

    @property
    def fsdp_dim_names(self) -> list[str]:
        """The dimensions of FSDP's mesh: replicas (when enabled) and ``dp_shard_cp``."""
        return [*self._enabled("dp_replicate"), "dp_shard_cp"]

    def build_device_mesh(self, device_type: str) -> DeviceMesh | None:
        """A ``DeviceMesh`` over the enabled dimensions, with Accelerate's flattened
        dimensions ``dp``, ``dp_shard_cp`` and ``dp_cp`` (``None`` when no size is above 1).

        A collective over the job's processes (a process group must exist when the sizes
        multiply to more than 1). Sizes left unset take the rest of the processes as in an
        Accelerator; without a process group, the sizes given must multiply to the layout.

        Example::

            ParallelismConfig(dp_shard_size=2, tp_size=2).build_device_mesh("cpu")
        """
        import torch.distributed as dist
        import torch.distributed.device_mesh as device_mesh

        if dist.is_available() and dist.is_initialized():
            world = dist.get_world_size()
        else:
            given = (self.pp_size, self.dp_replicate_size, self.dp_shard_size, self.cp_size)
            world = math.prod(s for s in (*given, self.tp_size) if s is not None and s > 0)
        sizes = self.resolve(world)
        names = tuple(d for d in _ORDER if sizes.size(d) > 1)
        if not names:
            return None
        shape = tuple(sizes.size(d) for d in names)
        # Looked up on the module when called, as Accelerate does (tests replace it there).
        mesh: DeviceMesh = device_mesh.init_device_mesh(device_type, shape, mesh_dim_names=names)
        for dims, name in (
            (self.dp_dim_names, "dp"),
            (self.dp_shard_cp_dim_names, "dp_shard_cp"),
            (self.dp_cp_dim_names, "dp_cp"),
        ):
            if dims:  # indexed by the list itself, as Accelerate does (torch takes it)
                mesh[dims]._flatten(name)  # type: ignore[index]
        return mesh
