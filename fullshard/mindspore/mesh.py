"""Device meshes over MindSpore's communication groups, and the ``Shard`` placement.

A mesh is 1-D (every rank shards) or 2-D ``(replicate, shard)`` for HSDP:
rank ``r * S + s`` holds shard ``s`` of replica ``r``. Each rank creates only
the groups it belongs to (``mindspore.communication.create_group``), once per
process; a group that holds every rank is the world group, and a group of one
rank is none at all (nothing travels).
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Optional, Sequence

from fullshard.plan.exchange import Backend, backend_named

# The backend each device type's collectives run on.
_BACKEND_OF_DEVICE = {"cpu": "mccl", "npu": "hccl", "ascend": "hccl"}
_DEVICE_TARGET = {"cpu": "CPU", "npu": "Ascend", "ascend": "Ascend"}
_CREATED_GROUPS: set[str] = set()


@dataclass(frozen=True)
class Shard:
    """Placement of a parameter: chunked along ``dim`` (``torch.chunk`` semantics)."""

    dim: int


class DeviceMesh:
    """Ranks laid out as a 1-D or 2-D grid, with one communication group per dim for this rank."""

    def __init__(
        self, device_type: str, shape: tuple[int, ...], dim_names: Optional[tuple[str, ...]], rank: int,
        groups: tuple[Optional[str], ...], group_ranks: tuple[tuple[int, ...], ...], world_group: str,
        backend: Backend,
    ) -> None:
        self.device_type = device_type
        self.shape = shape
        self.mesh_dim_names = dim_names
        self.rank = rank
        self._groups = groups
        self._group_ranks = group_ranks
        self._world_group = world_group
        self.backend = backend

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def size(self, dim: Optional[int] = None) -> int:
        return prod(self.shape) if dim is None else self.shape[dim]

    def get_local_rank(self, dim: int) -> int:
        """This rank's index within its group along ``dim``."""
        return self._group_ranks[dim].index(self.rank)

    def get_group(self, dim: int) -> Optional[str]:
        """The communication group along ``dim`` (None: a group of this rank alone)."""
        return self._groups[dim]

    def get_group_ranks(self, dim: int) -> tuple[int, ...]:
        return self._group_ranks[dim]

    def is_world_group(self, dim: int) -> bool:
        return self._groups[dim] == self._world_group

    @property
    def world_group(self) -> str:
        return self._world_group

    def __repr__(self) -> str:
        names = f", mesh_dim_names={self.mesh_dim_names}" if self.mesh_dim_names else ""
        return f"DeviceMesh({self.device_type!r}, {self.shape}{names})"


def _group(name: str, ranks: Sequence[int], world: int, world_group: str) -> Optional[str]:
    if len(ranks) == world:
        return world_group
    if len(ranks) == 1:
        return None
    if name not in _CREATED_GROUPS:
        from mindspore.communication import create_group

        create_group(name, list(ranks))
        _CREATED_GROUPS.add(name)
    return name


def init_device_mesh(
    device_type: str, mesh_shape: Sequence[int], *, mesh_dim_names: Optional[Sequence[str]] = None
) -> DeviceMesh:
    """A mesh over every rank: ``(world,)`` shards across all, ``(replicate, shard)`` is HSDP.

    Needs ``mindspore.communication.init()`` (under ``msrun``) first.
    """
    import mindspore as ms
    from mindspore.communication import GlobalComm, get_group_size, get_rank

    device = str(device_type).lower()
    if device not in _BACKEND_OF_DEVICE:
        raise ValueError(f"init_device_mesh: device type {device_type!r} is not one of 'cpu', 'npu'")
    target = ms.get_context("device_target")
    if target != _DEVICE_TARGET[device]:
        raise ValueError(
            f"init_device_mesh: device type {device_type!r} but MindSpore runs on {target}; "
            f"pass {'cpu' if target == 'CPU' else 'npu'!r} or call ms.set_device({_DEVICE_TARGET[device]!r}) first"
        )
    if not GlobalComm.INITED:
        raise RuntimeError(
            "init_device_mesh: MindSpore's communication is not initialized; call "
            "mindspore.communication.init() first (launch the script with msrun)"
        )
    shape = tuple(mesh_shape)
    if not shape or len(shape) > 2 or not all(isinstance(n, int) and n >= 1 for n in shape):
        raise ValueError(
            f"init_device_mesh: mesh_shape {mesh_shape!r} must be (shard,) or (replicate, shard) with sizes >= 1"
        )
    world = get_group_size()
    if prod(shape) != world:
        raise ValueError(
            f"init_device_mesh: mesh_shape {shape} holds {prod(shape)} ranks but the world has {world} "
            f"(msrun --worker_num); use a shape whose sizes multiply to {world}, e.g. ({world},)"
        )
    names = tuple(mesh_dim_names) if mesh_dim_names is not None else None
    if names is not None and len(names) != len(shape):
        raise ValueError(f"init_device_mesh: {len(names)} mesh_dim_names {names} for a {len(shape)}-D mesh_shape {shape}")
    backend = backend_named(GlobalComm.BACKEND)
    if backend.name != _BACKEND_OF_DEVICE[device]:
        raise ValueError(f"init_device_mesh: {device_type!r} meshes use {_BACKEND_OF_DEVICE[device]}, "
                         f"but communication was initialized with {backend.name}")
    rank, world_group = get_rank(), GlobalComm.WORLD_COMM_GROUP
    replicas, shards = (1, shape[0]) if len(shape) == 1 else shape
    r, s = divmod(rank, shards)
    shard_ranks = tuple(r * shards + j for j in range(shards))
    replica_ranks = tuple(i * shards + s for i in range(replicas))
    shard_group = _group(f"fullshard_shard_{replicas}x{shards}_{r}", shard_ranks, world, world_group)
    if len(shape) == 1:
        return DeviceMesh(device, shape, names, rank, (shard_group,), (shard_ranks,), world_group, backend)
    replica_group = _group(f"fullshard_replicate_{replicas}x{shards}_{s}", replica_ranks, world, world_group)
    return DeviceMesh(
        device, shape, names, rank, (replica_group, shard_group), (replica_ranks, shard_ranks), world_group, backend
    )


def default_mesh() -> DeviceMesh:
    """A 1-D mesh over every rank, on the device MindSpore runs on."""
    import mindspore as ms
    from mindspore.communication import GlobalComm, get_group_size

    if not GlobalComm.INITED:
        raise RuntimeError(
            "fully_shard: no mesh given and MindSpore's communication is not initialized; call "
            "mindspore.communication.init() (under msrun) or pass mesh=init_device_mesh(...)"
        )
    device = "cpu" if ms.get_context("device_target") == "CPU" else "npu"
    return init_device_mesh(device, (get_group_size(),))
