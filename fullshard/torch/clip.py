"""Gradient clipping by the global norm when gradients live on different meshes (tensor parallelism).

``torch.nn.utils.clip_grad_norm_`` stacks every gradient's norm into one
tensor, which DTensor refuses across meshes: with tensor parallelism the
tensor-parallel parameters' shards live on the ``(dp, tp)`` mesh and the
others' on ``dp`` alone (FSDP2 places them so too, and fails the same way).
Within one mesh torch's function works unchanged; this one takes the norm
per mesh, combines them, and scales every gradient by the same factor.
"""
from __future__ import annotations

from typing import Iterable, Union

import torch
from torch.distributed.tensor import DTensor


def clip_grad_norm_(
    parameters: Union[torch.Tensor, Iterable[torch.Tensor]], max_norm: float, norm_type: float = 2.0,
    error_if_nonfinite: bool = False, foreach: bool | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for gradients on any mix of meshes; returns the total norm
    (a plain tensor, the same on every rank)."""
    parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    grads = [p.grad for p in parameters if p.grad is not None]
    by_mesh: dict[object, list[torch.Tensor]] = {}
    for grad in grads:
        by_mesh.setdefault(grad.device_mesh if isinstance(grad, DTensor) else None, []).append(grad)
    norms = []
    for group in by_mesh.values():
        norm = torch.nn.utils.get_total_norm(group, norm_type, error_if_nonfinite, foreach)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device) for n in norms]), norm_type)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for group in by_mesh.values():  # one mesh at a time: DTensor refuses to mix meshes in one op
        torch._foreach_mul_(group, coefficient.to(group[0].device))
    return total
