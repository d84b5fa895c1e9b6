"""User-facing policies: FSDP2's mixed precision, plus the seed library's fp32 main gradients."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Dtypes for compute and communication (FSDP2's meaning), and fp32 main gradients.

    * ``param_dtype``: dtype of the all-gather and of the unsharded parameters
      forward and backward compute with (``None``: the stored dtype).
    * ``reduce_dtype``: dtype the gradients are reduced in (``None``: the
      gradient's dtype, i.e. ``param_dtype`` when set).
    * ``output_dtype``: floating outputs of the cell's forward are cast to it.
    * ``cast_forward_inputs``: floating inputs are cast to ``param_dtype``.
    * ``apply_grad_on_fp32_main_grad`` (the seed library's name): every sharded
      parameter carries ``main_grad``, an fp32 tensor of its shard's shape
      that accumulates the reduced gradient over backward passes until
      ``zero_grad()``. The gradients ``value_and_grad`` returns are unchanged.
      Works for fp16- and bf16-stored parameters too.
    """

    param_dtype: Optional[Any] = None
    reduce_dtype: Optional[Any] = None
    output_dtype: Optional[Any] = None
    cast_forward_inputs: bool = True
    apply_grad_on_fp32_main_grad: bool = False


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading (the default; the only policy fullshard.mindspore has)."""

