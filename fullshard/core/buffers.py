"""Ownership as a type, for every runtime: owned and borrowed buffers, the sanitizer, the byte meter.

Framework-free: each runtime supplies only how to read and resize a tensor's
storage (:class:`StorageOps`) and allocates through its own ``buffers`` module
(``fullshard.torch.collectives``, ``fullshard.mindspore.buffers``), the one place
per runtime that allocates, reclaims and writes communication storage.


* :class:`Owned` wraps storage fullshard allocated. It may be written in place
  and reclaimed (its storage resized to 0) and regrown.
* :class:`Borrowed` wraps storage that belongs to someone else (the caller's
  gradient, a sharded parameter's storage). It offers no way to write or free:
  :meth:`Borrowed.release` only drops the reference.

Which one a buffer is comes from ``fullshard.plan.ownership``; this module only
carries out the decision. An owned claim is checked, not trusted: every place
that makes an owned buffer names the tensors it was made from (``sources``).
With ``FULLSHARD_CHECK_OWNERSHIP=1`` (or :func:`set_check_ownership`) a
sanitizer

* rejects an owned buffer that shares storage with any of its sources, or that
  is a tensor subclass with no storage of its own to free (the seed's bug: a
  same-dtype "cast" that returned the caller's storage);
* records every storage fullshard owns and every storage it borrows, and
  before each reclaim or in-place write verifies that the storage is owned and
  not also lent to fullshard by someone else.

A violation raises :class:`OwnershipError` naming the buffer (its parameters
and module, and the site that made it) and the operation. With the sanitizer
off none of this runs: the sources are only passed along.

Owned bytes are metered by kind (:class:`Kind`): the unsharded parameters
(working copies any FSDP must hold), gradients kept across backward passes
(main gradients, accumulators, partial sums), and everything else, the
transient communication buffers.

The traffic meter (:func:`count`, :func:`traffic_bytes`) is what every collective of this process carried,
by kind: bytes, calls and the seconds spent in them. Each collective counts its full buffer (all-gather
output, reduce-scatter input, all-reduce buffer) and one call; point-to-point sends are counted by the
benchmark's own meter. A group of one rank moves nothing and counts nothing. ``timed`` adds the wall seconds
a blocking collective took (MindSpore's block; torch's run asynchronously, and the benchmark times their
waits itself).
"""
from __future__ import annotations

import contextlib
import enum
import os
import time
import weakref
from collections import Counter
from typing import Any, Iterable, Iterator, Optional, Protocol


class OwnershipError(RuntimeError):
    """fullshard was about to free or write storage it does not own."""


class StorageOps(Protocol):
    """What a runtime tells the ownership types about a tensor's storage."""

    def key(self, tensor: Any) -> int:
        """The same for every view of one live storage. Read by the debug sanitizer only, never to
        decide anything. It may change when the storage is freed and regrown (an address), and a
        freed key may be reused at once by another allocation: owned keys are registered only while
        their storage holds bytes."""

    def nbytes(self, tensor: Any) -> int:
        """Bytes the storage holds now (0 once reclaimed)."""

    def resize(self, tensor: Any, nbytes: int) -> None:
        """Give the storage ``nbytes`` (0 frees it; every view of it becomes empty)."""

    def keys(self, tensor: Any) -> frozenset:
        """The keys of every storage ``tensor`` reads: its own, or for a tensor subclass wrapping other
        tensors, theirs. Debug only, like :meth:`key`."""

    def has_own_storage(self, tensor: Any) -> bool:
        """Whether ``tensor`` is backed by a storage of its own that :meth:`resize` can free (a tensor
        subclass that only wraps others is not)."""


class Kind(enum.Enum):
    """What an owned buffer holds, for the byte meter."""

    TRANSIENT = "transient"  # communication buffers: inputs, outputs, scratch of the collectives
    WORKING = "working"  # unsharded parameters: the working copies every FSDP holds to compute
    MAIN_GRAD = "main_grad"  # gradients kept across backward passes: main grads, accumulators, partial sums


class _Sanitizer:
    """Which live storages fullshard owns and which it borrows, by storage key.

    Each owned buffer registers under a token of its own (its identity), so
    only that buffer's free or death removes its entry, whatever address
    another buffer is given later.
    """

    def __init__(self) -> None:
        self.enabled = os.environ.get("FULLSHARD_CHECK_OWNERSHIP", "0") not in ("", "0")
        self.owned: dict[int, tuple[int, str]] = {}  # storage key -> (token, what)
        self.keys: dict[int, Optional[int]] = {}  # token -> its storage key (None while reclaimed)
        self.borrowed: dict[int, list[str]] = {}

    def on_owned(self, token: int, key: Optional[int], what: str) -> None:
        """A buffer came to hold bytes (allocated, adopted, regrown); ``key`` None: it holds none."""
        if key is not None:
            lenders = self.borrowed.get(key)
            if lenders:
                raise OwnershipError(
                    f"{what}: an allocating operation returned storage that fullshard only "
                    f"borrows (from {lenders[0]}); it would later be freed or written as if owned. "
                    "This is the seed's bug class: a same-dtype conversion or reshape aliasing "
                    "the caller's tensor. The ownership plan must mark this path BORROWED."
                )
            self.owned[key] = (token, what)
        self.keys[token] = key

    def check_fresh(self, ops: StorageOps, tensor: Any, sources: Iterable[Any], what: str) -> None:
        """``tensor`` is claimed as new storage made from ``sources``: refuse a subclass without storage of its
        own, and any storage shared with a source."""
        if not ops.has_own_storage(tensor):
            raise OwnershipError(
                f"{what}: the buffer fullshard was about to own is a {type(tensor).__name__}, a tensor subclass "
                "with no storage of its own to free or write; the site that made it must allocate a plain tensor "
                "and copy into it"
            )
        if not ops.nbytes(tensor):
            return
        key = ops.key(tensor)
        for index, source in enumerate(sources):
            if source is not None and key in ops.keys(source):
                shape = tuple(getattr(source, "shape", ()))
                lenders = self.borrowed.get(key)
                lent = f", the {lenders[0]} fullshard borrows" if lenders else ""
                raise OwnershipError(
                    f"{what}: claimed as a new buffer fullshard owns, but it shares storage with what it was made "
                    f"from (source {index}: a {getattr(source, 'dtype', '?')} tensor of shape {shape}{lent}), so "
                    "freeing or writing it would free or write that tensor. This is the seed's bug class: a "
                    "same-dtype conversion, a view or a reshape returned its input. The plan must mark this path "
                    "BORROWED, or the site must really allocate."
                )

    def on_emptied(self, token: int) -> None:
        """The buffer's storage was freed: its key may now be another allocation's."""
        key = self.keys.get(token)
        if key is not None and self.owned.get(key, (None,))[0] == token:
            del self.owned[key]
        if token in self.keys:
            self.keys[token] = None

    def on_disowned(self, token: int) -> None:
        self.on_emptied(token)
        self.keys.pop(token, None)

    def on_borrowed(self, key: int, what: str) -> int:
        self.borrowed.setdefault(key, []).append(what)
        return key

    def on_released(self, key: int, what: str) -> None:
        lenders = self.borrowed.get(key)
        if lenders and what in lenders:
            lenders.remove(what)
            if not lenders:
                del self.borrowed[key]

    def check_mutation(self, token: int, key: Optional[int], what: str, operation: str) -> None:
        if token not in self.keys:
            raise OwnershipError(
                f"refusing to {operation} {what}: its storage was not allocated by fullshard. "
                "Only owned buffers may be resized or written in place; release borrowed "
                "ones by dropping the reference."
            )
        lenders = self.borrowed.get(key) if key is not None else None
        if lenders:
            raise OwnershipError(
                f"refusing to {operation} {what}: its storage is also borrowed from "
                f"{lenders[0]}, which would lose its data."
            )


_SANITIZER = _Sanitizer()


def set_check_ownership(enabled: bool) -> None:
    """Turn the ownership sanitizer on or off (default: ``FULLSHARD_CHECK_OWNERSHIP``)."""
    _SANITIZER.enabled = enabled


def check_ownership_enabled() -> bool:
    return _SANITIZER.enabled


def live_owned_buffers() -> int:
    """Owned storages holding bytes now (meaningful with the sanitizer on)."""
    return len(_SANITIZER.owned)


def check_fresh(ops: StorageOps, tensor: Any, sources: Iterable[Any], what: str) -> None:
    """Check (sanitizer on) that a copy fullshard made, to hand out rather than keep, shares no storage with
    its sources: the site frees a source next (e.g. the reduced buffer a gradient was copied out of)."""
    if _SANITIZER.enabled:
        _SANITIZER.check_fresh(ops, tensor, sources, what)


class _ByteMeter:
    """Bytes of owned storage alive now, and peaks since the last reset (always on): all of it, and per
    :class:`Kind`."""

    live = peak = 0
    kind_live = {kind: 0 for kind in Kind}
    kind_peak = {kind: 0 for kind in Kind}

    @classmethod
    def add(cls, nbytes: int, kind: Kind) -> None:
        cls.live += nbytes
        cls.peak = max(cls.peak, cls.live)
        cls.kind_live[kind] += nbytes
        cls.kind_peak[kind] = max(cls.kind_peak[kind], cls.kind_live[kind])


def comm_bytes() -> dict[str, int]:
    """Bytes of fullshard-owned storage: ``live``/``peak`` (all of it), and per kind ``<kind>_live``/
    ``<kind>_peak``: ``transient`` (communication buffers only), ``working`` (unsharded parameters) and
    ``main_grad`` (gradients kept across backward passes)."""
    meter = _ByteMeter
    figures = {"live": meter.live, "peak": meter.peak}
    for kind in Kind:
        figures[f"{kind.value}_live"] = meter.kind_live[kind]
        figures[f"{kind.value}_peak"] = meter.kind_peak[kind]
    return figures


def reset_peak_comm_bytes() -> None:
    _ByteMeter.peak = _ByteMeter.live
    _ByteMeter.kind_peak = dict(_ByteMeter.kind_live)


class Owned:
    """Storage fullshard allocated: it may write, reclaim and regrow it.

    ``sources``: the tensors it was made from (what was cast, copied, packed or gathered into it); with
    the sanitizer on, sharing storage with any of them is an :class:`OwnershipError`.
    """

    __slots__ = ("tensor", "what", "kind", "resizable", "_ops", "_nbytes", "_counted", "__weakref__")

    def __init__(self, tensor: Any, what: str, ops: StorageOps, kind: Kind = Kind.TRANSIENT, resizable: bool = True,
                 sources: Iterable[Any] = ()) -> None:
        if _SANITIZER.enabled:
            _SANITIZER.check_fresh(ops, tensor, sources, what)
        self.tensor = tensor
        self.what = what
        self.kind = kind
        # False: storage from someone else's allocator made for fullshard (a custom collective's
        # pool): written by fullshard, but let go of by dropping it, never resized.
        self.resizable = resizable
        self._ops = ops
        self._nbytes = ops.nbytes(tensor)
        self._counted = self._nbytes
        _ByteMeter.add(self._nbytes, kind)
        if _SANITIZER.enabled:
            _SANITIZER.on_owned(id(self), self._live_key(), what)
            weakref.finalize(self, _SANITIZER.on_disowned, id(self))

    def _live_key(self) -> Optional[int]:
        return self._ops.key(self.tensor) if self._ops.nbytes(self.tensor) else None

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def is_reclaimed(self) -> bool:
        return self._ops.nbytes(self.tensor) == 0

    def retag(self, kind: Kind) -> None:
        """Count the bytes under another kind from now on (a reduced buffer kept as a partial sum)."""
        _ByteMeter.add(-self._counted, self.kind)
        self.kind = kind
        _ByteMeter.add(self._counted, kind)

    def _check(self, operation: str) -> None:
        if _SANITIZER.enabled:
            _SANITIZER.check_mutation(id(self), self._live_key(), self.what, operation)

    def writable(self, operation: str) -> Any:
        """The tensor, for an in-place write (checked in debug mode)."""
        self._check(operation)
        return self.tensor

    def reclaim(self) -> None:
        """Free the storage now (every view of it becomes empty); pooled storage is only dropped."""
        if not self.resizable:
            self.drop()
            return
        self._check("free (resize to 0)")
        self._ops.resize(self.tensor, 0)
        if _SANITIZER.enabled:
            _SANITIZER.on_emptied(id(self))
        _ByteMeter.add(-self._counted, self.kind)
        self._counted = 0

    def regrow(self) -> None:
        """Give reclaimed storage its bytes back (contents undefined)."""
        self._check("regrow")
        if self._ops.nbytes(self.tensor) != self._nbytes:
            self._ops.resize(self.tensor, self._nbytes)
            if _SANITIZER.enabled:
                _SANITIZER.on_owned(id(self), self._live_key(), self.what)
            _ByteMeter.add(self._nbytes - self._counted, self.kind)
            self._counted = self._nbytes

    def hand_off(self) -> Any:
        """Give the storage away (e.g. as a ``.grad``): fullshard never frees it again."""
        if _SANITIZER.enabled:
            _SANITIZER.on_disowned(id(self))
        _ByteMeter.add(-self._counted, self.kind)
        self._counted = 0
        tensor, self.tensor = self.tensor, None
        return tensor

    def drop(self) -> None:
        """Let go without freeing: the storage goes with its last reference.

        For storage that may not be idle (a transfer that failed may still be
        writing into it): only storage known to be idle is resized.
        """
        self.hand_off()

    def __del__(self) -> None:
        # Dropped without reclaim: the storage goes with the last reference. (A buffer the sanitizer refused
        # in __init__ was never counted.)
        counted = getattr(self, "_counted", 0)
        if counted:
            _ByteMeter.add(-counted, self.kind)


class Borrowed:
    """Storage that belongs to someone else. Read it; never write or free it."""

    __slots__ = ("tensor", "what", "_key")

    def __init__(self, tensor: Any, what: str, ops: StorageOps) -> None:
        self.tensor = tensor
        self.what = what
        self._key = _SANITIZER.on_borrowed(ops.key(tensor), what) if _SANITIZER.enabled else None

    def release(self) -> None:
        """Drop the reference: the only way fullshard lets go of borrowed storage."""
        if self._key is not None:
            _SANITIZER.on_released(self._key, self.what)
            self._key = None
        self.tensor = None

    def __del__(self) -> None:
        # Dropped without release (its holder went away mid-step): forget the registration, or a later
        # allocation at the same address would look borrowed.
        if getattr(self, "_key", None) is not None:
            self.release()


def release_all(buffers: list[Optional[Owned | Borrowed]], idle: bool = True) -> None:
    """Let go of transient buffers once their collective is done.

    Owned ones are reclaimed at once (the memory comes back even if a work
    handle still references the tensor); borrowed ones are only dropped.
    ``idle=False`` (the collective failed, and may still be writing): owned
    ones are only dropped too.
    """
    for buffer in buffers:
        if isinstance(buffer, Owned):
            buffer.reclaim() if idle else buffer.drop()
        elif isinstance(buffer, Borrowed):
            buffer.release()
    buffers.clear()


# ---------------------------------------------------------------------------------------------- traffic
KINDS = ("all_gather", "reduce_scatter", "all_reduce")

traffic: Counter = Counter()  # bytes
calls: Counter = Counter()
seconds: Counter = Counter()
by_mesh: dict[str, Counter] = {}  # bytes per mesh a runtime names (its group's key), by kind


def count(kind: str, nbytes: int, mesh: Optional[str] = None) -> None:
    """One collective of ``kind`` carried ``nbytes``, for the parameters of ``mesh`` (a group's key, where the
    runtime gives one: a model on several meshes is reported per mesh)."""
    traffic[kind] += nbytes
    calls[kind] += 1
    if mesh is not None:
        by_mesh.setdefault(mesh, Counter())[kind] += nbytes


@contextlib.contextmanager
def timed(kind: str) -> Iterator[None]:
    """Add the wall time of the block to ``kind``'s seconds (the time this rank waited in the collective)."""
    start = time.perf_counter()
    try:
        yield
    finally:
        seconds[kind] += time.perf_counter() - start


def reset_traffic() -> None:
    """Start counting afresh (e.g. at the start of a step)."""
    traffic.clear()
    calls.clear()
    seconds.clear()
    by_mesh.clear()


def traffic_bytes() -> dict[str, int]:
    return {kind: traffic.get(kind, 0) for kind in KINDS}


def traffic_by_mesh() -> dict[str, dict[str, int]]:
    """The bytes of :func:`traffic_bytes` that collectives counted for a mesh, per mesh key."""
    return {mesh: {kind: kinds.get(kind, 0) for kind in KINDS} for mesh, kinds in by_mesh.items()}


def collective_calls() -> dict[str, int]:
    return {kind: calls.get(kind, 0) for kind in KINDS}


def collective_seconds() -> dict[str, float]:
    return {kind: seconds.get(kind, 0.0) for kind in KINDS}
