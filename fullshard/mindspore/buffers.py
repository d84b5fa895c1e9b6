"""The MindSpore runtime's one place that allocates, reclaims and writes communication storage.

The ownership types, the sanitizer and the byte meter are framework-free
(``fullshard.core.buffers``); this module supplies MindSpore's storage
operations and the allocating constructors.

MindSpore differs from torch in ways that shape every call here:

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

from typing import Any, Iterable

import mindspore as ms
from mindspore import Tensor, ops

from fullshard.core import buffers as core
from fullshard.core.buffers import (  # noqa: F401  (re-exported: the MindSpore runtime's whole buffer API)
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
    counts as an in-place edit of them.
    """
    buffer.regrow()
    buffer.writable("refill after an all-gather").untyped_storage().copy_(source.untyped_storage())
