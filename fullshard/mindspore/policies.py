"""User-facing policies: FSDP2's mixed precision, plus the seed library's fp32 main gradients."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import mindspore as ms

from fullshard.plan.exchange import DTYPE_BYTES

FLOAT_DTYPES = (ms.float16, ms.bfloat16, ms.float32, ms.float64)


def dtype_name(dtype: Any) -> str:
    """ms.bfloat16 -> "bfloat16": how the planning code names dtypes."""
    return str(dtype).lower()


def dtype_named(name: str) -> Any:
    return getattr(ms, name)


def dtype_bytes(dtype: Any) -> int:
    return DTYPE_BYTES[dtype_name(dtype)]


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


def check_mp_policy(policy: Any, cell_name: str) -> MixedPrecisionPolicy:
    if policy is None:
        return MixedPrecisionPolicy()
    if not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(
            f"fully_shard({cell_name}): mp_policy must be a fullshard.mindspore.MixedPrecisionPolicy, "
            f"got {type(policy).__name__}"
        )
    for field in ("param_dtype", "reduce_dtype", "output_dtype"):
        dtype = getattr(policy, field)
        if dtype is not None and dtype not in FLOAT_DTYPES:
            raise ValueError(
                f"fully_shard({cell_name}): MixedPrecisionPolicy.{field}={dtype!r} is not a floating-point "
                "MindSpore dtype; use e.g. ms.float16 or ms.float32, or None"
            )
    return policy


def check_offload_policy(policy: Any, cell_name: str) -> OffloadPolicy:
    if policy is None or type(policy) is OffloadPolicy:
        return OffloadPolicy()
    raise ValueError(
        f"fully_shard({cell_name}): offload_policy={policy!r} is not supported by fullshard.mindspore, which keeps "
        "shards on the device they compute on; pass None"
    )
