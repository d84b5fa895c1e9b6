"""The one place that allocates, reclaims and writes communication storage.

Ownership is a type here, not a comment:

* :class:`Owned` wraps storage fullshard allocated. It may be written in place
  and reclaimed (its storage resized to 0) and regrown.
* :class:`Borrowed` wraps storage that belongs to someone else (the caller's
  gradient, a sharded parameter's storage). It offers no way to write or free:
  :meth:`Borrowed.release` only drops the reference.

Which one a buffer is comes from ``fullshard.plan.ownership``; this module only
carries out the decision. With ``FULLSHARD_CHECK_OWNERSHIP=1`` (or
:func:`set_check_ownership`) a sanitizer records every storage fullshard
allocates and every storage it borrows, and before each reclaim or in-place
write verifies that the storage is owned and not also lent to fullshard by
someone else; a violation raises :class:`OwnershipError` naming the buffer (its
parameters and module) and the operation. This catches the seed's bug: a
"cast" that silently returned the caller's storage would be adopted as owned
while that storage is registered as borrowed.
"""
from __future__ import annotations

import os
import weakref
from typing import Optional

import torch


class OwnershipError(RuntimeError):
    """fullshard was about to free or write storage it does not own."""


def _storage_key(tensor: torch.Tensor) -> int:
    # The StorageImpl address: the same for every view of one storage and
    # stable across resize_. Used only by the debug sanitizer, never to decide.
    return tensor.untyped_storage()._cdata


class _Sanitizer:
    def __init__(self) -> None:
        self.enabled = os.environ.get("FULLSHARD_CHECK_OWNERSHIP", "0") not in ("", "0")
        self.owned: dict[int, str] = {}
        self.borrowed: dict[int, list[str]] = {}

    def on_owned(self, tensor: torch.Tensor, what: str) -> None:
        key = _storage_key(tensor)
        lenders = self.borrowed.get(key)
        if lenders:
            raise OwnershipError(
                f"{what}: an allocating operation returned storage that fullshard only "
                f"borrows (from {lenders[0]}); it would later be freed or written as if owned. "
                "This is the seed's bug class: a same-dtype conversion or reshape aliasing "
                "the caller's tensor. The ownership plan must mark this path BORROWED."
            )
        self.owned[key] = what

    def on_disowned(self, key: int, what: str) -> None:
        if self.owned.get(key) == what:
            del self.owned[key]

    def on_borrowed(self, tensor: torch.Tensor, what: str) -> int:
        key = _storage_key(tensor)
        self.borrowed.setdefault(key, []).append(what)
        return key

    def on_released(self, key: int, what: str) -> None:
        lenders = self.borrowed.get(key)
        if lenders and what in lenders:
            lenders.remove(what)
            if not lenders:
                del self.borrowed[key]

    def check_mutation(self, tensor: torch.Tensor, what: str, operation: str) -> None:
        key = _storage_key(tensor)
        if key not in self.owned:
            raise OwnershipError(
                f"refusing to {operation} {what}: its storage was not allocated by fullshard. "
                "Only owned buffers may be resized or written in place; release borrowed "
                "ones by dropping the reference."
            )
        lenders = self.borrowed.get(key)
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
    """Owned storages currently registered (meaningful with the sanitizer on)."""
    return len(_SANITIZER.owned)


class _ByteMeter:
    """Bytes of owned storage alive now, and peaks since the last reset (always on).

    Kept twice: everything, and the *transient* part, i.e. without the
    working copies (unsharded parameters), which any FSDP must hold to compute.
    """

    live = peak = transient_live = transient_peak = 0

    @classmethod
    def add(cls, nbytes: int, working: bool) -> None:
        cls.live += nbytes
        cls.peak = max(cls.peak, cls.live)
        if not working:
            cls.transient_live += nbytes
            cls.transient_peak = max(cls.transient_peak, cls.transient_live)


def comm_bytes() -> dict[str, int]:
    """Bytes of fullshard-owned storage: ``live``/``peak`` (all of it) and ``transient_live``/
    ``transient_peak`` (communication buffers only, without the unsharded parameters)."""
    meter = _ByteMeter
    return {"live": meter.live, "peak": meter.peak,
            "transient_live": meter.transient_live, "transient_peak": meter.transient_peak}


def reset_peak_comm_bytes() -> None:
    _ByteMeter.peak, _ByteMeter.transient_peak = _ByteMeter.live, _ByteMeter.transient_live


class Owned:
    """Storage fullshard allocated: it may write, reclaim and regrow it."""

    __slots__ = ("tensor", "what", "working", "_nbytes", "_counted", "__weakref__")

    def __init__(self, tensor: torch.Tensor, what: str, working: bool = False) -> None:
        self.tensor = tensor
        self.what = what
        self.working = working  # an unsharded parameter's storage, not a transient buffer
        self._nbytes = tensor.untyped_storage().nbytes()
        self._counted = self._nbytes
        _ByteMeter.add(self._nbytes, working)
        if _SANITIZER.enabled:
            _SANITIZER.on_owned(tensor, what)
            weakref.finalize(self, _SANITIZER.on_disowned, _storage_key(tensor), what)

    @property
    def nbytes(self) -> int:
        return self._nbytes

    @property
    def is_reclaimed(self) -> bool:
        return self.tensor.untyped_storage().nbytes() == 0

    def writable(self, operation: str) -> torch.Tensor:
        """The tensor, for an in-place write (checked in debug mode)."""
        if _SANITIZER.enabled:
            _SANITIZER.check_mutation(self.tensor, self.what, operation)
        return self.tensor

    def reclaim(self) -> None:
        """Free the storage now (every view of it becomes empty)."""
        if _SANITIZER.enabled:
            _SANITIZER.check_mutation(self.tensor, self.what, "free (resize to 0)")
        self.tensor.untyped_storage().resize_(0)
        _ByteMeter.add(-self._counted, self.working)
        self._counted = 0

    def regrow(self) -> None:
        """Give reclaimed storage its bytes back (contents undefined)."""
        if _SANITIZER.enabled:
            _SANITIZER.check_mutation(self.tensor, self.what, "regrow")
        storage = self.tensor.untyped_storage()
        if storage.nbytes() != self._nbytes:
            storage.resize_(self._nbytes)
            _ByteMeter.add(self._nbytes - self._counted, self.working)
            self._counted = self._nbytes

    def hand_off(self) -> torch.Tensor:
        """Give the storage away (e.g. as a ``.grad``): fullshard never frees it again."""
        if _SANITIZER.enabled:
            _SANITIZER.on_disowned(_storage_key(self.tensor), self.what)
        _ByteMeter.add(-self._counted, self.working)
        self._counted = 0
        tensor, self.tensor = self.tensor, None
        return tensor

    def __del__(self) -> None:
        # Dropped without reclaim: the storage goes with the last reference.
        _ByteMeter.add(-self._counted, self.working)


class Borrowed:
    """Storage that belongs to someone else. Read it; never write or free it."""

    __slots__ = ("tensor", "what", "_key")

    def __init__(self, tensor: torch.Tensor, what: str) -> None:
        self.tensor = tensor
        self.what = what
        self._key = _SANITIZER.on_borrowed(tensor, what) if _SANITIZER.enabled else None

    def release(self) -> None:
        """Drop the reference: the only way fullshard lets go of borrowed storage."""
        if self._key is not None:
            _SANITIZER.on_released(self._key, self.what)
            self._key = None
        self.tensor = None


def allocate(
    shape: tuple[int, ...] | int,
    dtype: torch.dtype,
    device: torch.device,
    what: str,
    working: bool = False,
) -> Owned:
    """A fresh owned buffer, contents undefined (``working``: it backs unsharded parameters)."""
    return Owned(torch.empty(shape, dtype=dtype, device=device), what, working)


def adopt(tensor: torch.Tensor, what: str, working: bool = False) -> Owned:
    """Take ownership of the result of an allocating op (a cast to another dtype, a cat).

    Callers reach here only on code paths the plan marks OWNED; the sanitizer
    verifies the op really allocated.
    """
    return Owned(tensor, what, working)


def borrow(tensor: torch.Tensor, what: str) -> Borrowed:
    return Borrowed(tensor, what)


def release_all(buffers: list[Optional[Owned | Borrowed]]) -> None:
    """Let go of transient buffers once their collective is done.

    Owned ones are reclaimed at once (the memory comes back even if a work
    handle still references the tensor); borrowed ones are only dropped.
    """
    for buffer in buffers:
        if isinstance(buffer, Owned):
            buffer.reclaim()
        elif isinstance(buffer, Borrowed):
            buffer.release()
    buffers.clear()
