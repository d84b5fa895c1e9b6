"""The torch runtime's one place that allocates, reclaims and writes communication storage.

The ownership types, the sanitizer and the byte meter are framework-free
(``fullshard.core.buffers``); this module supplies torch's storage operations
and the allocating constructors.
"""
from __future__ import annotations

import torch

from fullshard.core.buffers import (  # noqa: F401  (re-exported: the torch runtime's whole buffer API)
    Borrowed,
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


TORCH_STORAGE = _TorchStorage()


def allocate(
    shape: tuple[int, ...] | int,
    dtype: torch.dtype,
    device: torch.device,
    what: str,
    working: bool = False,
) -> Owned:
    """A fresh owned buffer, contents undefined (``working``: it backs unsharded parameters)."""
    return Owned(torch.empty(shape, dtype=dtype, device=device), what, TORCH_STORAGE, working)


def allocate_pooled(comm, numel: int, dtype: torch.dtype, device: torch.device, what: str) -> Owned:
    """A buffer from a custom collective's own allocator (FSDP2's ``AllGather``/``ReduceScatter.allocate``):
    fullshard writes it and drops it when done, never resizes it (``plan.ownership``: ``*_pooled``)."""
    return Owned(comm.allocate((numel,), dtype=dtype, device=device), what, TORCH_STORAGE, resizable=False)


def adopt(tensor: torch.Tensor, what: str, working: bool = False) -> Owned:
    """Take ownership of the result of an allocating op (a cast to another dtype, a cat).

    Callers reach here only on code paths the plan marks OWNED; the sanitizer
    verifies the op really allocated.
    """
    return Owned(tensor, what, TORCH_STORAGE, working)


def borrow(tensor: torch.Tensor, what: str) -> Borrowed:
    return Borrowed(tensor, what, TORCH_STORAGE)
