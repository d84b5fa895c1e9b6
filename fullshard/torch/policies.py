"""User-facing policies, compatible with PyTorch FSDP2's.

Instances of torch's own ``MixedPrecisionPolicy`` / ``OffloadPolicy`` /
``CPUOffloadPolicy`` are accepted wherever ours are (real clients build
those), and converted by :func:`as_mp_policy` / :func:`as_offload_policy`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for compute and communication (FSDP2's meaning).

    * ``param_dtype``: dtype of the all-gather and of the unsharded parameters
      used in forward/backward (``None``: the stored dtype).
    * ``reduce_dtype``: dtype of the gradient reduction (``None``: the
      gradient's dtype, i.e. ``param_dtype`` when set).
    * ``output_dtype``: floating outputs of the module's forward are cast to it.
    * ``cast_forward_inputs``: floating inputs are cast to ``param_dtype``.
    * ``main_dtype`` (beyond FSDP2; the seed's ``apply_grad_on_fp32_main_grad``):
      dtype of the sharded *main* parameters and of their gradients, which is
      what the optimizer steps on. For a model stored in bf16, ``float32``
      upcasts the shards once at ``fully_shard``; compute and all-gather stay
      in the stored dtype (unless ``param_dtype`` says otherwise) and the
      gradients, reduced in ``reduce_dtype``, reach the optimizer in fp32.
      ``None``: the stored dtype.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True
    main_dtype: Optional[torch.dtype] = None


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading (the default)."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients in CPU memory (``pin_memory`` for fast copies)."""

    pin_memory: bool = True


# torch's own policy classes, taken once at import: code that later swaps names in
# torch.distributed.fsdp (a test harness running FSDP2's suite on fullshard) must not change them.
from torch.distributed.fsdp import _fully_shard as _torch_api  # noqa: E402

_TORCH_MP, _TORCH_OFFLOAD, _TORCH_CPU_OFFLOAD = (
    _torch_api.MixedPrecisionPolicy, _torch_api.OffloadPolicy, _torch_api.CPUOffloadPolicy,
)


def as_mp_policy(policy: object, module_name: str) -> MixedPrecisionPolicy:
    if isinstance(policy, MixedPrecisionPolicy):
        result = policy
    else:
        if not isinstance(policy, _TORCH_MP):
            raise TypeError(
                f"fully_shard({module_name}): mp_policy must be a fullshard.MixedPrecisionPolicy "
                f"or torch's MixedPrecisionPolicy, got {type(policy).__name__}"
            )
        result = MixedPrecisionPolicy(
            policy.param_dtype, policy.reduce_dtype, policy.output_dtype, policy.cast_forward_inputs
        )
    for field in ("param_dtype", "reduce_dtype", "output_dtype", "main_dtype"):
        dtype = getattr(result, field)
        if dtype is not None and (not isinstance(dtype, torch.dtype) or not dtype.is_floating_point):
            raise ValueError(
                f"fully_shard({module_name}): MixedPrecisionPolicy.{field}={dtype!r} is not a "
                "floating-point torch.dtype; use e.g. torch.bfloat16 or torch.float32, or None"
            )
    return result


def as_offload_policy(policy: object, module_name: str) -> OffloadPolicy:
    if isinstance(policy, OffloadPolicy):
        return policy
    if isinstance(policy, _TORCH_CPU_OFFLOAD):
        return CPUOffloadPolicy(pin_memory=policy.pin_memory)
    if isinstance(policy, _TORCH_OFFLOAD):
        return OffloadPolicy()
    raise TypeError(
        f"fully_shard({module_name}): offload_policy must be a fullshard.OffloadPolicy / "
        f"CPUOffloadPolicy or torch's equivalent, got {type(policy).__name__}"
    )
