"""The torch runtime's one place that allocates, reclaims and writes communication storage, and the collectives
that move it, the way ``fullshard.plan.exchange`` chose.

Storage: the ownership types, the sanitizer and the byte meter are framework-free (``fullshard.core.buffers``);
this module supplies torch's storage operations and the allocating constructors. Each constructor takes the
tensors the new buffer is made from (``sources``), which the sanitizer checks it shares no storage with.

Collectives: every function starts the exchange asynchronously and returns a handle whose ``wait()`` returns
once the output is complete (a group of one rank exchanges nothing: LOCAL copies this rank's own data).
Buffers are plain tensors there: the caller passes only storage it may write (the outputs, scratch) and keeps
every input alive until the wait returns.

Meshes: which dims of the mesh ``fully_shard`` was given shard and replicate, and their process groups.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from fullshard.core import buffers as core
from fullshard.core.buffers import (  # noqa: F401  (re-exported: the torch runtime's whole buffer API)
    Borrowed,
    Kind,
    Owned,
    OwnershipError,
    check_ownership_enabled,
    comm_bytes,
    live_owned_buffers,
    release_all,
    reset_peak_comm_bytes,
    set_check_ownership,
)
from fullshard.core.checks import Ranks, alone
from fullshard.plan import Exchange
from fullshard.torch.errors import MeshError


class _TorchStorage:
    def key(self, tensor: torch.Tensor) -> int:
        # The StorageImpl address: the same for every view of one storage and
        # stable across resize_. Used only by the debug sanitizer, never to decide.
        return tensor.untyped_storage()._cdata

    def nbytes(self, tensor: torch.Tensor) -> int:
        return tensor.untyped_storage().nbytes()

    def resize(self, tensor: torch.Tensor, nbytes: int) -> None:
        tensor.untyped_storage().resize_(nbytes)

    def keys(self, tensor: torch.Tensor) -> frozenset:
        if is_traceable_wrapper_subclass(tensor):  # DTensor, TwoTensor...: the storages of what it wraps
            names, _ = tensor.__tensor_flatten__()
            return frozenset().union(*(self.keys(getattr(tensor, name)) for name in names))
        return frozenset((self.key(tensor),))

    def has_own_storage(self, tensor: torch.Tensor) -> bool:
        return not is_traceable_wrapper_subclass(tensor)


TORCH_STORAGE = _TorchStorage()


def allocate(
    shape: tuple[int, ...] | int,
    dtype: torch.dtype,
    device: torch.device,
    what: str,
    kind: Kind = Kind.TRANSIENT,
    sources: Iterable[Any] = (),
) -> Owned:
    """A fresh owned buffer, contents undefined, to be filled from ``sources``."""
    return Owned(torch.empty(shape, dtype=dtype, device=device), what, TORCH_STORAGE, kind, sources=sources)


def allocate_pooled(comm, numel: int, dtype: torch.dtype, device: torch.device, what: str,
                    sources: Iterable[Any] = ()) -> Owned:
    """A buffer from a custom collective's own allocator (FSDP2's ``AllGather``/``ReduceScatter.allocate``):
    fullshard writes it and drops it when done, never resizes it (``plan.ownership``: ``*_pooled``)."""
    return Owned(comm.allocate((numel,), dtype=dtype, device=device), what, TORCH_STORAGE, resizable=False,
                 sources=sources)


def copy_of(tensor: torch.Tensor, dtype: torch.dtype, device: torch.device, what: str,
            kind: Kind = Kind.TRANSIENT) -> Owned:
    """An owned copy of ``tensor`` in ``dtype`` on ``device``: allocated, then copied into, whatever
    ``tensor.to()`` would have returned (for the same dtype, or a tensor subclass, ``to`` may return
    ``tensor`` itself: the seed's bug)."""
    owned = allocate(tuple(tensor.shape), dtype, device, what, kind, sources=(tensor,))
    with torch.no_grad():
        owned.tensor.copy_(tensor)
    return owned


def _copy(tensor: torch.Tensor, dtype: torch.dtype, device: torch.device, non_blocking: bool) -> torch.Tensor:
    return tensor.to(device=device, dtype=dtype, non_blocking=non_blocking, memory_format=torch.contiguous_format,
                     copy=True)


def copy_out(tensor: torch.Tensor, dtype: torch.dtype, device: torch.device, what: str, non_blocking: bool = False
             ) -> torch.Tensor:
    """A contiguous copy of ``tensor`` to hand out (e.g. as a sharded gradient) before ``tensor``'s owned storage is
    freed; the sanitizer checks it shares no storage with ``tensor``."""
    copied = _copy(tensor, dtype, device, non_blocking)
    core.check_fresh(TORCH_STORAGE, copied, (tensor,), what)
    return copied


def borrow(tensor: torch.Tensor, what: str) -> Borrowed:
    return Borrowed(tensor, what, TORCH_STORAGE)


# ---------------------------------------------------------------------------------------------- collectives
def _all_gather(*args, **kwargs):
    # torch 2.13 renamed the tensor-in/tensor-out collectives; older releases only have the old
    # names. Looked up at each call, so wrappers installed later (profilers, benchmarks) see them.
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def _reduce_scatter(*args, **kwargs):
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


class PairwiseWork:
    """The sends and receives of one pairwise exchange; ``wait()`` also runs its completion (the sum)."""

    def __init__(self, works: list, complete: Optional[Callable[[], None]] = None) -> None:
        self._works = works
        self._complete = complete

    def wait(self) -> bool:
        works, self._works = self._works, []
        for work in works:
            work.wait()
        if self._complete is not None:
            complete, self._complete = self._complete, None
            complete()
        return True


class _CustomWork:
    """What a user's collective returned: its work to wait on, or None when it ran synchronously."""

    def __init__(self, work: Any) -> None:
        self._work = work

    def wait(self) -> bool:
        if self._work is not None:
            self._work.wait()
        return True


def _peers(group: Optional[dist.ProcessGroup]) -> tuple[int, list[tuple[int, int]]]:
    """This rank's index in ``group`` and (index, global rank) of every other member."""
    me = dist.get_rank(group)
    others = [
        (index, dist.get_global_rank(group, index) if group is not None else index)
        for index in range(dist.get_world_size(group))
        if index != me
    ]
    return me, others


def all_gather(
    exchange: Exchange, output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup],
    tag: int, input_in_place: bool = False, comm: Any = None,
) -> Any:
    """``output`` (rank-major) receives every rank's ``input``.

    ``input_in_place``: the caller already wrote ``input`` as this rank's chunk
    of ``output`` (the plan says so, nothing is inferred here). ``comm``: the
    user's collective for ``Exchange.CUSTOM`` (FSDP2's ``AllGather``).
    """
    if exchange is Exchange.COLLECTIVE:
        return _all_gather(output, input, group=group, async_op=True)
    if exchange is Exchange.CUSTOM:
        return _CustomWork(comm(output, input, group, async_op=True))
    if exchange is Exchange.LOCAL:
        if not input_in_place:
            output.copy_(input)
        return PairwiseWork([])
    me, peers = _peers(group)
    slots = output.view(len(peers) + 1, -1)
    source = input.view(-1)
    works = [dist.irecv(slots[index], rank, group=group, tag=tag) for index, rank in peers]
    works += [dist.isend(source, rank, group=group, tag=tag) for _, rank in peers]
    if not input_in_place:
        slots[me].copy_(source)  # while the peers' chunks are in flight
    return PairwiseWork(works)


def all_reduce_sum(exchange: Exchange, buffer: torch.Tensor, group: Optional[dist.ProcessGroup]) -> Any:
    """Sum ``buffer`` in place across ``group`` (replicated parameters); a group of one has nothing to add."""
    if exchange is Exchange.LOCAL:
        return PairwiseWork([])
    return dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group, async_op=True)


def reduce_scatter(
    exchange: Exchange, output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup],
    tag: int, scratch: Sequence[torch.Tensor] = (), comm: Any = None,
) -> Any:
    """``output`` receives the sum over ranks of this rank's chunk of each rank's ``input`` (read only).

    Pairwise: the first peer's contribution is received into ``output`` (its
    last bytes, when the input travels in a narrower dtype than the output
    sums in), the others' into ``scratch`` (``plan.reduce_scratch_chunks`` of
    them, in the input's dtype); this rank's own chunk and the rest are added
    at the wait, in the output's dtype.
    """
    if exchange is Exchange.COLLECTIVE:
        return _reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=group, async_op=True)
    if exchange is Exchange.CUSTOM:
        return _CustomWork(comm(output, input, group, dist.ReduceOp.SUM, async_op=True))
    if exchange is Exchange.LOCAL:  # a group of one: the sum is this rank's own chunk
        output.copy_(input.view(-1))
        return PairwiseWork([])
    me, peers = _peers(group)
    chunks = input.view(len(peers) + 1, -1)
    widen = output.dtype != input.dtype
    first = output.view(input.dtype)[-output.numel():] if widen else output
    targets = [first, *scratch]
    if len(targets) != len(peers):
        raise ValueError(f"pairwise reduce-scatter over {len(peers) + 1} ranks needs {len(peers) - 1} scratch chunks")
    works = [dist.irecv(target, rank, group=group, tag=tag) for target, (_, rank) in zip(targets, peers)]
    works += [dist.isend(chunks[index], rank, group=group, tag=tag) for index, rank in peers]

    def add_own_and_scratch() -> None:
        if widen:
            _widen_and_add(output, first, chunks[me])
        else:
            output.add_(chunks[me])
        for extra in scratch:
            output.add_(extra)

    return PairwiseWork(works, add_own_and_scratch)


# Elements widened per step by _widen_and_add (a 256 KiB fp32 temporary).
_WIDEN_BLOCK = 1 << 16


def _widen_and_add(output: torch.Tensor, received: torch.Tensor, own: torch.Tensor) -> None:
    """``output = received + own`` in the output's dtype, where ``received`` (narrower) lives in output's last bytes.

    Blocks go front to back, and each block of ``received`` is copied out
    before that block of the output is written. Writing output[:end] touches
    its first end*R bytes (R, W: the output's and the received dtype's sizes,
    R > W), while received[end:] starts at byte C*R - (C-end)*W >= end*R:
    nothing still to be read is ever overwritten.
    """
    for start in range(0, output.numel(), _WIDEN_BLOCK):
        end = min(output.numel(), start + _WIDEN_BLOCK)
        peer = received[start:end].to(output.dtype)  # a copy, taken before output[start:end] is written
        torch.add(peer, own[start:end], out=output[start:end])


def ranks_summing_over(groups: Sequence[Optional[dist.ProcessGroup]], device: torch.device) -> Ranks:
    """Every rank of the default group, summing a short float32 vector over ``groups`` in turn (None: the
    default group): control messages (agreement, shared failures), never counted as traffic. Alone without a
    process group."""
    if not dist.is_initialized():
        return alone()

    def sum_over_ranks(values: list[float]) -> list[float]:
        buffer = torch.tensor(values, dtype=torch.float32, device=device)
        for group in groups:
            dist.all_reduce(buffer, group=group)
        return buffer.tolist()

    return Ranks(sum_over_ranks, dist.get_rank(), dist.get_world_size())


# ---------------------------------------------------------------------------------------------- meshes
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
