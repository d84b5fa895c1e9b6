"""User-facing policies, compatible with PyTorch FSDP2's.

Instances of torch's own ``MixedPrecisionPolicy`` / ``OffloadPolicy`` /
``CPUOffloadPolicy`` are accepted wherever ours are (real clients build
those): ``fully_shard`` converts and checks them (``api.py``).
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
