"""The torch runtime's one place that allocates, reclaims and writes communication storage.

The ownership types, the sanitizer and the byte meter are framework-free
(``fullshard.core.buffers``); this module supplies torch's storage operations
and the allocating constructors. Each constructor takes the tensors the new
buffer is made from (``sources``), which the sanitizer checks it shares no
storage with.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch
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
