"""Initialize a model built on the meta device, one module at a time, the same at every world size.

The usual flow works too: ``with torch.device("meta"): model = Net()``,
``fully_shard(...)``, ``model.to_empty(device=...)``, then the model's own
init. But random init on sharded DTensors draws each shard from its rank's
generator, so the full parameters depend on the world size.

:func:`materialize` instead gives every parameter the values it would have in
an unsharded model: for each module owning parameters, in order, it builds
that module's parameters at full size (nothing else), seeds torch's generator
from ``(seed, module path)``, runs the init, and keeps only this rank's shard.
The same seed gives the same full parameters at any world size, and no rank
ever holds more than its shards plus one module's full parameters.
"""
from __future__ import annotations

import zlib
from contextlib import contextmanager
from typing import Callable, Iterator, Optional, Union

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

Init = Union[str, Callable[[nn.Module], None]]


def _full_like(param: torch.Tensor, device: torch.device) -> torch.Tensor:
    return torch.empty(param.shape, dtype=param.dtype, device=device)


@contextmanager
def _full_parameters(module: nn.Module, device: torch.device) -> Iterator[dict[str, torch.Tensor]]:
    """Temporarily register full, plain parameters on ``module`` (its direct ones only)."""
    saved = dict(module._parameters)
    full = {name: _full_like(p, device) for name, p in saved.items() if p is not None}
    for name, tensor in full.items():
        module._parameters[name] = nn.Parameter(tensor, requires_grad=saved[name].requires_grad)
    try:
        yield full
    finally:
        module._parameters.update(saved)


def _keep_local_shard(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write this rank's part of ``full`` into ``param`` (a DTensor shard or a plain tensor)."""
    with torch.no_grad():
        if isinstance(param, DTensor):
            param.copy_(_distribute_like(full, param))
        else:
            param.copy_(full)


def _distribute_like(full: torch.Tensor, like: DTensor) -> DTensor:
    # Each rank already holds the full tensor, so slicing needs no communication.
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.to(like.to_local().device), like.device_mesh, like.placements, src_data_rank=None)


def _seed_for(seed: int, path: str) -> int:
    return (seed * 1_000_003 + zlib.crc32(path.encode())) % (2**63)


def materialize(
    model: nn.Module,
    device: Optional[Union[str, torch.device]] = None,
    init: Init = "reset_parameters",
    seed: int = 0,
) -> dict[str, int]:
    """Allocate a meta-device (or any) model's storage and initialize it, world-size independently.

    ``init`` is the name of a per-module method (``"reset_parameters"``, the
    default) or a callable taking a module whose direct parameters it fills.
    Modules without that method keep the values ``to_empty`` gave them; make
    sure every module with parameters has an init. Returns
    ``{"peak_full_bytes": ..., "modules": ...}``: the largest module's full
    parameter bytes that were ever alive at once, and how many were initialized.
    """
    if device is not None:
        model.to_empty(device=device)
    generator_state = torch.random.get_rng_state()
    peak, count = 0, 0
    try:
        for path, module in model.named_modules():
            direct = {n: p for n, p in module._parameters.items() if p is not None}
            method = getattr(module, init, None) if isinstance(init, str) else init
            if not direct or method is None:
                continue
            compute_device = next(iter(direct.values())).device
            if isinstance(next(iter(direct.values())), DTensor):
                compute_device = next(iter(direct.values())).to_local().device
            with _full_parameters(module, compute_device) as full:
                peak = max(peak, sum(t.numel() * t.element_size() for t in full.values()))
                torch.manual_seed(_seed_for(seed, path))
                method() if isinstance(init, str) else method(module)
                for name, tensor in full.items():
                    _keep_local_shard(direct[name], tensor)
            count += 1
    finally:
        torch.random.set_rng_state(generator_state)
    return {"peak_full_bytes": peak, "modules": count}
