"""Which mesh dims data parallelism uses, and how each parameter's shards are placed on the mesh.

A parameter may already be a DTensor: tensor parallelism put it on a ``tp``
mesh (``parallelize_module``), or an SPMD program put it on a mesh that has
data-parallel dims too (``fully_shard(..., dp_mesh_dims=...)``). fullshard
then shards the parameter's *local* tensor across the data-parallel shard
dim with its usual layouts, and the sharded parameter is a DTensor on the
mesh of both, with placements ``(<data parallel>, <the parameter's own>)``,
as FSDP2 makes it. When both shard the same tensor dim, the data-parallel
shard is inside the parameter's own chunks: ``_StridedShard`` says so.
The module sees the parameter's own DTensor (``unsharded``), gathered within
the data-parallel shard dim only.

Everything is validated here before ``fully_shard`` changes anything; each
error names the parameter, both meshes and the fix.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard

from fullshard.torch.errors import MeshError


@dataclass(frozen=True)
class DataParallelMeshDims:
    """The data-parallel dims of an SPMD mesh, by name (FSDP2's ``DataParallelMeshDims``; torch's is accepted)."""

    shard: Optional[str | tuple[str, ...]] = None
    replicate: Optional[str | tuple[str, ...]] = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError("At least one of shard or replicate must be set in DataParallelMeshDims")

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _names(self.replicate)


def _names(value: Optional[str | tuple[str, ...]]) -> tuple[str, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


@dataclass(frozen=True)
class DataParallelMesh:
    """The mesh ``fully_shard`` was given and which of its dims shard and replicate."""

    mesh: DeviceMesh
    shard_dim: Optional[int]  # None: replicate only (DDP-like)
    replicate_dim: Optional[int]
    spmd: bool  # the parameters are DTensors on ``mesh`` itself (dp_mesh_dims)

    @property
    def shard_group(self) -> dist.ProcessGroup:
        """Where gradients are reduced (the replicas' group when nothing shards)."""
        return self.mesh.get_group(self.shard_dim if self.shard_dim is not None else self.replicate_dim)

    @property
    def replicate_group(self) -> Optional[dist.ProcessGroup]:
        """HSDP: where reduced shards are summed across replicas."""
        if self.replicate_dim is None or self.shard_dim is None:
            return None
        return self.mesh.get_group(self.replicate_dim)

    @property
    def shard_mesh(self) -> DeviceMesh:
        """The 1-D mesh of the shard dim (what all-gather extensions are told)."""
        if self.mesh.ndim == 1:
            return self.mesh
        index = self.shard_dim if self.shard_dim is not None else self.replicate_dim
        return self.mesh[self.mesh.mesh_dim_names[index]]

    @property
    def shard_rank(self) -> int:
        return self.mesh.get_local_rank(self.shard_dim) if self.shard_dim is not None else 0

    @property
    def shard_size(self) -> int:
        return self.mesh.size(self.shard_dim) if self.shard_dim is not None else 1


def data_parallel_mesh(mesh: DeviceMesh, dp_mesh_dims, name: str) -> DataParallelMesh:
    """Read which dims of ``mesh`` are data parallel: the last shards and a leading one replicates (HSDP),
    or the ones ``dp_mesh_dims`` names."""
    if dp_mesh_dims is None:
        if mesh.ndim not in (1, 2):
            raise ValueError(
                f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}: fully_shard({name}) takes a 1-D (shard) "
                "or 2-D (replicate, shard) mesh for HSDP; for a mesh with model-parallel dims too, pass "
                "dp_mesh_dims naming the data-parallel ones, or pass mesh[<dp dims>]"
            )
        if mesh.ndim == 2 and mesh.mesh_dim_names is None:
            raise MeshError(
                f"Please init the 2D mesh for HSDP with mesh_dim_names specified: fully_shard({name}) got {mesh}; "
                "build it with init_device_mesh(..., mesh_dim_names=('replicate', 'shard'))"
            )
        return DataParallelMesh(mesh, mesh.ndim - 1, 0 if mesh.ndim == 2 else None, spmd=False)
    shard, replicate = dp_mesh_dims.shard_names, dp_mesh_dims.replicate_names
    if not shard and not replicate:
        raise ValueError(f"fully_shard({name}): dp_mesh_dims names no dim; set shard= and/or replicate=")
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError(
            f"fully_shard({name}): dp_mesh_dims needs a mesh with mesh_dim_names; build it with "
            "init_device_mesh(..., mesh_dim_names=(...))"
        )
    unknown = [n for n in shard + replicate if n not in names]
    if unknown:
        raise ValueError(
            f"dp_mesh_dims names {unknown}, not found in mesh.mesh_dim_names {names}: fully_shard({name}) needs "
            "the names of the data-parallel dims of the mesh it is given"
        )
    if len(shard) > 1 or len(replicate) > 1:
        raise NotImplementedError(
            f"fully_shard({name}): dp_mesh_dims with several shard or replicate dims ({shard}, {replicate}); "
            "flatten them into one mesh dim first (mesh[names]._flatten())"
        )
    return DataParallelMesh(
        mesh,
        names.index(shard[0]) if shard else None,
        names.index(replicate[0]) if replicate else None,
        spmd=True,
    )


@dataclass(frozen=True)
class ShardedSpec:
    """Where a sharded parameter lives: its DTensor's mesh, placements and global shape, and what the
    module sees when it is unsharded (``unsharded``: the parameter's own DTensor spec; None: a plain tensor)."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    unsharded: Optional[DTensorSpec] = None
    # SPMD meshes: the data-parallel dims of ``unsharded``'s mesh. A gradient's placement there (a
    # Partial sum per rank) is kept for fullshard's reduction to sum, not redistributed by DTensor.
    data_parallel_dims: frozenset[int] = frozenset()

    def grad_placements(self, grad_placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
        """Where an unsharded gradient must be placed before its local tensor is reduced."""
        own = self.unsharded.placements
        return tuple(grad_placements[i] if i in self.data_parallel_dims else own[i] for i in range(len(own)))

    def unsharded_spec(self, dtype: torch.dtype) -> DTensorSpec:
        """The unsharded DTensor's spec in the compute dtype."""
        spec = self.unsharded
        meta = TensorMeta(spec.tensor_meta.shape, spec.tensor_meta.stride, dtype)
        return DTensorSpec(spec.mesh, spec.placements, tensor_meta=meta)


def sharded_spec(param: torch.Tensor, fqn: str, name: str, dp: DataParallelMesh, dim: int,
                 replicated: bool) -> ShardedSpec:
    """How ``param`` is placed once sharded on tensor dim ``dim`` (``replicated``: kept whole, no_shard)."""
    if not isinstance(param, DTensor):
        if dp.spmd:
            raise ValueError(
                f"When dp_mesh_dims is provided, all parameters must be DTensors on the SPMD mesh: fully_shard({name}) "
                f"got a plain tensor for '{fqn}'; distribute it first (distribute_module / distribute_tensor)"
            )
        placements = tuple(
            Replicate() if index != dp.shard_dim or replicated else Shard(dim) for index in range(dp.mesh.ndim)
        )
        return ShardedSpec(dp.mesh, placements, param.shape)
    own = param._spec
    if dp.spmd:
        return _on_spmd_mesh(param, fqn, name, dp, dim, replicated)
    names = set(dp.mesh.mesh_dim_names or ()) & set(own.mesh.mesh_dim_names or ())
    if names or own.mesh == dp.mesh:
        raise ValueError(
            f"fully_shard({name}): parameter '{fqn}' is a DTensor placed {own.placements} on {own.mesh}, which "
            f"shares the data-parallel dims {sorted(names) or dp.mesh.mesh_dim_names} with the mesh given to "
            f"fully_shard ({dp.mesh}); keep the parameter's mesh to the model-parallel dims (mesh['tp']) and "
            "pass the data-parallel dims as mesh, or pass the whole mesh with dp_mesh_dims"
        )
    try:
        mesh = DeviceMesh._concatenate([dp.mesh, own.mesh])
    except Exception as error:  # torch says what is wrong in its own words; name ours
        raise ValueError(
            f"fully_shard({name}): parameter '{fqn}' is a DTensor on {own.mesh}, which is not a dimension of "
            f"the same mesh as the data-parallel mesh {dp.mesh} ({error}); build both from one "
            "init_device_mesh(..., mesh_dim_names=(...)) and pass mesh[<dp dims>] to fully_shard"
        ) from None
    inner = own.num_shards_map[dim]  # chunks the parameter's own placements already cut dim into
    shard: Placement = _StridedShard(dim, split_factor=inner) if inner > 1 else Shard(dim)
    placements = tuple(
        Replicate() if index != dp.shard_dim or replicated else shard for index in range(dp.mesh.ndim)
    ) + tuple(own.placements)
    return ShardedSpec(mesh, placements, param.shape, own)


def _on_spmd_mesh(param: DTensor, fqn: str, name: str, dp: DataParallelMesh, dim: int,
                  replicated: bool) -> ShardedSpec:
    own = param._spec
    if own.mesh is not dp.mesh:  # FSDP2 asks for the very mesh object: the dims' groups are its
        raise ValueError(
            f"Expected param's DTensor mesh to be the same mesh passed to fully_shard: parameter '{fqn}' is a "
            f"DTensor on {own.mesh}, but fully_shard({name}) was given {dp.mesh} with dp_mesh_dims; distribute "
            "every parameter on that mesh object"
        )
    placements = list(own.placements)
    names = dp.mesh.mesh_dim_names
    for index in (dp.shard_dim, dp.replicate_dim):
        if index is not None and not isinstance(placements[index], Replicate):
            raise ValueError(
                f"Expected Replicate() on the data-parallel dim '{names[index]}': fully_shard({name}) found parameter "
                f"'{fqn}' placed {placements[index]} there; it must be Replicate() (fully_shard shards it across "
                "that dim)"
            )
    if dp.shard_dim is not None and not replicated:
        # the data-parallel shard is inside every chunk that later mesh dims cut the same tensor dim into
        inner = 1
        for later in range(dp.shard_dim + 1, dp.mesh.ndim):
            placement = placements[later]
            if isinstance(placement, (Shard, _StridedShard)) and placement.dim == dim:
                inner *= dp.mesh.size(later)
        placements[dp.shard_dim] = _StridedShard(dim, split_factor=inner) if inner > 1 else Shard(dim)
    dims = frozenset(index for index in (dp.shard_dim, dp.replicate_dim) if index is not None)
    return ShardedSpec(dp.mesh, tuple(placements), param.shape, own, dims)
