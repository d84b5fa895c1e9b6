"""How the MindSpore runtime communicates: device meshes and their groups, the collectives over them, and the
one place that allocates, reclaims and writes communication storage.

Meshes: a mesh is 1-D (every rank shards) or 2-D ``(replicate, shard)`` for
HSDP: rank ``r * S + s`` holds shard ``s`` of replica ``r``. Each rank
creates only the groups it belongs to (``mindspore.communication.create_group``),
once per process; a group that holds every rank is the world group, and a
group of one rank is none at all (nothing travels). torch has its own
``DeviceMesh``; MindSpore has none, so this is it.

Collectives run the way ``fullshard.plan.exchange`` chose. MindSpore's are out
of place: each returns new storage and only reads its input, so the caller may
pass storage it merely borrows. On CPU (mccl) every call blocks until done;
nothing here is asynchronous. Each call counts the bytes it really carried in
``fullshard.core.buffers``, under the collective that carried them: an
emulated reduce-scatter or sub-group gather counts as the all-reduce it is.

Storage: the ownership types, the sanitizer and the byte meter are
framework-free (``fullshard.core.buffers``); this module supplies MindSpore's
storage operations and the allocating constructors. MindSpore differs from
torch in ways that shape every call here:

* collectives and most ops return new storage, so an owned buffer is usually
  *adopted* (the result of an op the plan knows allocates: a cast to another
  dtype, ``mint.cat``, ``ops.zeros``, ``Tensor.copy``) rather than allocated
  empty and filled;
* a same-dtype ``to()``/``astype()`` and every ``reshape``/``view`` return a
  new object over the *same* storage (the seed's bug), which is why whatever
  fullshard reads from someone else is registered as borrowed while it is
  read: an alias of it adopted as owned then fails loudly in debug mode;
* in-place arithmetic (``add_``, ``mul_``, ``div_``) silently returns a new
  tensor on the CPU kernels of 2.10: owned storage is written only with
  ``ops.assign``, ``ops.assign_add`` or a storage copy (:func:`accumulate`,
  :func:`assign`, :func:`refill`).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from math import prod
from typing import Any, Iterable, Optional, Sequence

import mindspore as ms
from mindspore import Tensor, mint, ops

from fullshard.core import buffers as core
from fullshard.core.buffers import (  # noqa: F401  (re-exported: the MindSpore runtime's whole buffer API)
    Borrowed,
    Kind,
    Owned,
    OwnershipError,
    check_ownership_enabled,
    comm_bytes,
    count,
    live_owned_buffers,
    release_all,
    reset_peak_comm_bytes,
    set_check_ownership,
    timed,
)
from fullshard.core.checks import Ranks, alone
from fullshard.mindspore.autograd import no_grad
from fullshard.plan import Exchange
from fullshard.plan.exchange import Backend, backend_named
from fullshard.plan.formulas import DTYPE_BYTES


# ---------------------------------------------------------------------------------------------- meshes
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
    # Inside ms.DeviceCtx("meta") (a wrap before to_empty) the target reads "meta": the backend check below still
    # ties the mesh to a real device.
    if target not in (_DEVICE_TARGET[device], "meta"):
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
    target = ms.get_context("device_target")
    if target == "meta":  # inside ms.DeviceCtx("meta"): the device is the communication backend's
        device = "cpu" if GlobalComm.BACKEND == "mccl" else "npu"
    else:
        device = "cpu" if target == "CPU" else "npu"
    return init_device_mesh(device, (get_group_size(),))


# ---------------------------------------------------------------------------------------------- dtypes
FLOAT_DTYPES = (ms.float16, ms.bfloat16, ms.float32, ms.float64)


def dtype_name(dtype: Any) -> str:
    """ms.bfloat16 -> "bfloat16": how the planning code names dtypes."""
    return str(dtype).lower()


def dtype_named(name: str) -> Any:
    return getattr(ms, name)


def dtype_bytes(dtype: Any) -> int:
    return DTYPE_BYTES[dtype_name(dtype)]


# ---------------------------------------------------------------------------------------------- storage
class _MindSporeStorage:
    def key(self, tensor: Tensor) -> int:
        # The storage's base address: the same for every view of it while it is alive, and
        # changed when it is freed and regrown (the sanitizer re-registers then). Debug only.
        return tensor.untyped_storage().data_ptr()

    def nbytes(self, tensor: Tensor) -> int:
        return tensor.untyped_storage().nbytes()

    def resize(self, tensor: Tensor, nbytes: int) -> None:
        tensor.untyped_storage().resize_(nbytes)

    def keys(self, tensor: Tensor) -> frozenset:
        return frozenset((self.key(tensor),))

    def has_own_storage(self, tensor: Tensor) -> bool:
        return True  # MindSpore has no tensor subclasses that wrap other tensors


MINDSPORE_STORAGE = _MindSporeStorage()


def adopt(tensor: Tensor, what: str, sources: Iterable[Any], kind: Kind = Kind.TRANSIENT) -> Owned:
    """Take ownership of the result of an allocating op made from ``sources``.

    Callers reach here only on code paths the plan marks OWNED; the sanitizer
    verifies that the op really allocated: the result shares no storage with
    its sources, nor with any storage fullshard is borrowing.
    """
    return Owned(tensor, what, MINDSPORE_STORAGE, kind, sources=sources)


def zeros(shape: tuple[int, ...] | int, dtype: Any, what: str, kind: Kind = Kind.TRANSIENT) -> Owned:
    """A fresh owned buffer of zeros."""
    return adopt(ops.zeros(shape, dtype), what, (), kind)


def check_fresh(tensor: Tensor, sources: Iterable[Any], what: str) -> None:
    """A copy made to be handed out (not kept) shares no storage with ``sources`` (sanitizer on)."""
    core.check_fresh(MINDSPORE_STORAGE, tensor, sources, what)


def borrow(tensor: Tensor, what: str) -> Borrowed:
    return Borrowed(tensor, what, MINDSPORE_STORAGE)


def accumulate(buffer: Owned, value: Tensor, operation: str) -> None:
    """``buffer += value``, in place (``ops.assign_add``: ``Tensor.add_`` is not in place on CPU)."""
    ops.assign_add(buffer.writable(operation), value)


def assign(buffer: Owned, value: Tensor, operation: str) -> None:
    """``buffer[...] = value``, in place. The CPU backend has no bfloat16 Assign: those go through ``copy_``
    (which refuses a slice of a larger storage as its source; a cast to bfloat16 is a tensor of its own)."""
    target = buffer.writable(operation)
    if target.dtype == ms.bfloat16:
        target.copy_(value)
    else:
        ops.assign(target, value)


def refill(buffer: Owned, source: Tensor) -> None:
    """Give reclaimed storage its bytes back and copy ``source``'s storage (the same size) into it.

    Storage to storage: autograd keeps references to the tensors over this
    storage (saved for backward), and the copy neither replaces them nor
    counts as an in-place edit of them (``Tensor.copy_`` would: backward then
    refuses the saved tensors). Where MindSpore's storage copy does nothing
    (:func:`storage_copy_works`), the bytes are moved host to host.
    """
    buffer.regrow()
    target = buffer.writable("refill after an all-gather")
    if _STORAGE_COPY["works"] is None:
        storage_copy_works()
    if _STORAGE_COPY["works"]:
        target.untyped_storage().copy_(source.untyped_storage())
        return
    if ms.get_context("device_target") != "CPU":
        raise RuntimeError(
            "fullshard.mindspore: MindSpore's UntypedStorage.copy_ writes nothing in this process (it was first "
            "used after ms.DeviceCtx(\"meta\")); call fullshard.mindspore.collectives.storage_copy_works() once before "
            "entering the meta context (a storage copy made before it keeps working)"
        )
    from mindspore._c_expression import _wait_pipeline  # what DeviceCtx itself waits with: the source is computed

    _wait_pipeline()
    ctypes.memmove(target.untyped_storage().data_ptr(), source.untyped_storage().data_ptr(), source.untyped_storage().nbytes())


_STORAGE_COPY: dict = {"works": None}


def storage_copy_works() -> bool:
    """Whether ``UntypedStorage.copy_`` writes, probed on two tiny tensors (and remembered).

    MindSpore 2.10 (CPU): once ``ms.DeviceCtx("meta")`` has been entered in a process before its first storage
    copy, every later storage copy silently leaves the target unchanged (``Tensor.copy_`` still works). A meta
    init (``FSDPModule.to_empty``) probes again.
    """
    with no_grad():
        target, source = ops.zeros((2,), ms.float32), ops.ones((2,), ms.float32)
        target.untyped_storage().copy_(source.untyped_storage())
        _STORAGE_COPY["works"] = bool(target.asnumpy().all())
    return _STORAGE_COPY["works"]


# ---------------------------------------------------------------------------------------------- collectives
@dataclass(frozen=True)
class Comm:
    """One group as the collectives see it: its name (None: this rank alone), size and this rank's index."""

    group: Optional[str]
    size: int
    rank: int


_PRIMITIVES: dict = {}


def _primitive(kind: str, group: str):
    key = (kind, group)
    if key not in _PRIMITIVES:
        if kind == "all_gather":
            _PRIMITIVES[key] = ops.AllGather(group=group)
        elif kind == "all_reduce":
            _PRIMITIVES[key] = ops.AllReduce(op=ops.ReduceOp.SUM, group=group)
        else:
            _PRIMITIVES[key] = ops.ReduceScatter(op=ops.ReduceOp.SUM, group=group)
    return _PRIMITIVES[key]


def all_gather(exchange: Exchange, chunk: Tensor, comm: Comm, label: str) -> Tensor:
    """Every rank's ``chunk`` (the same shape everywhere) concatenated along dim 0, rank-major, in new storage."""
    if exchange is Exchange.LOCAL:
        return chunk.copy()
    if exchange is Exchange.COLLECTIVE:
        with timed("all_gather"):
            out = _primitive("all_gather", comm.group)(chunk)
        count("all_gather", out.nbytes)
        return out
    if exchange is not Exchange.ZERO_FILLED_ALL_REDUCE:
        raise ValueError(f"all-gather of {label}: the MindSpore runtime has no {exchange.value} exchange")
    # Zero everywhere but this rank's chunk; the sum over the group is then every rank's chunk in place.
    rows, rest = chunk.shape[0], tuple(chunk.shape[1:])
    before, after = comm.rank * rows, (comm.size - comm.rank - 1) * rows
    parts = [ops.zeros((before,) + rest, chunk.dtype), chunk, ops.zeros((after,) + rest, chunk.dtype)]
    filled = adopt(mint.cat([p for p in parts if p.shape[0]]), f"zero-filled all-gather buffer of {label}",
                           (chunk,))
    try:
        with timed("all_reduce"):
            out = _primitive("all_reduce", comm.group)(filled.tensor)
        count("all_reduce", out.nbytes)
    finally:
        filled.reclaim()
    return out


def reduce_scatter(exchange: Exchange, flat: Tensor, comm: Comm) -> tuple[Tensor, int]:
    """The sum over the group of every rank's ``flat`` (rank-major), and where this rank's chunk starts in it.

    The backend's reduce-scatter returns only the chunk (offset 0); the
    emulation returns the whole sum (``Exchange.ALL_REDUCE_CHUNK``), the
    chunk at ``rank * len(flat) / size``.
    """
    if exchange is Exchange.LOCAL:
        return flat.copy(), 0
    if exchange is Exchange.COLLECTIVE:
        with timed("reduce_scatter"):
            out = _primitive("reduce_scatter", comm.group)(flat)
        count("reduce_scatter", flat.nbytes)
        return out, 0
    with timed("all_reduce"):
        out = _primitive("all_reduce", comm.group)(flat)
    count("all_reduce", out.nbytes)
    return out, comm.rank * (flat.shape[0] // comm.size)


def all_reduce(flat: Tensor, comm: Comm) -> Tensor:
    """The sum of ``flat`` over the group, in new storage (a copy for a group of one)."""
    if comm.size == 1:
        return flat.copy()
    with timed("all_reduce"):
        out = _primitive("all_reduce", comm.group)(flat)
    count("all_reduce", out.nbytes)
    return out


def sum_floats(values: list[float], comm: Comm) -> list[float]:
    """``values`` summed over the group as float32 (a control message, not model bytes: not counted as traffic)."""
    import numpy as np

    with no_grad():
        return _primitive("all_reduce", comm.group)(Tensor(np.asarray(values, np.float32))).asnumpy().tolist()


def world_ranks() -> Ranks:
    """Every rank, summing float32 on the world group (every mesh spans it, and no setting can change it), or
    this process alone before ``init()``."""
    from mindspore.communication import GlobalComm, get_group_size, get_rank

    if not GlobalComm.INITED:
        return alone()
    world = Comm(GlobalComm.WORLD_COMM_GROUP, get_group_size(), get_rank())
    return Ranks(lambda values: sum_floats(values, world), world.rank, world.size)
