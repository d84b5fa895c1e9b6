"""User-facing policies, compatible with PyTorch FSDP2's.

Instances of torch's own ``MixedPrecisionPolicy`` / ``OffloadPolicy`` /
``CPUOffloadPolicy`` are accepted wherever ours are (real clients build
those): ``fully_shard`` converts and checks them (``api.py``).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Callable, Optional

import torch
import torch.nn as nn
from torch.distributed import fsdp as _torch_fsdp

from fullshard.plan import TORCH_RUNTIME

# What the installed torch's FSDP2 means, read once at import (2.15 added the override field to its policy, and
# the gradient-dtype policies FSDP2 follows since then; 2.13 and 2.14 have neither).
TORCH_HAS_PARAM_DTYPE_OVERRIDE = "param_dtype_override_fn" in {f.name for f in fields(_torch_fsdp.MixedPrecisionPolicy)}
# FSDP2 2.15: with reduce_dtype=None the gradients are reduced in the promoted dtype they accumulate in (the
# parameter's own, or its explicit ``Tensor.grad_dtype``), not in param_dtype; and reset_iter_state drops the
# reduced sharded gradients too. 2.13/2.14 reduce in param_dtype and keep them.
TORCH_PROMOTES_REDUCE_DTYPE = hasattr(torch.Tensor, "_has_grad_dtype_override")
# And there a parameter may hold a gradient of another dtype (``Tensor.grad_dtype``): between backwards without
# sync the pending sum stays the unsharded parameter's ``.grad``, in the reduce dtype, as FSDP2 2.15 leaves it,
# where 2.13 and 2.14 (and fullshard on them) keep it apart (``plan.ownership.plan_accumulation``).
TORCH_RUNTIME_FACTS = replace(TORCH_RUNTIME, grads_in_any_dtype=TORCH_PROMOTES_REDUCE_DTYPE)


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
    * ``param_dtype_override_fn`` (FSDP2 2.15, keyword only): called once per parameter at ``fully_shard``;
      ``None`` or ``param_dtype`` keeps ``param_dtype``, the parameter's own dtype gathers and computes that
      parameter in it (e.g. an fp32 norm inside a bf16 block). Inputs are still cast to ``param_dtype``. It
      must answer alike on every rank.
    """

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True
    main_dtype: Optional[torch.dtype] = None
    param_dtype_override_fn: Optional[Callable[[nn.Parameter], Optional[torch.dtype]]] = field(
        default=None, kw_only=True)

    def compute_dtype_of(self, param: nn.Parameter) -> Optional[torch.dtype]:
        """The dtype ``param`` is gathered and computed in (None: its own), the override asked once."""
        if self.param_dtype_override_fn is None:
            return self.param_dtype
        chosen = self.param_dtype_override_fn(param)
        if chosen is None:
            return self.param_dtype
        # FSDP2's words, so that code matching them keeps working
        if not isinstance(chosen, torch.dtype):
            raise ValueError(f"param_dtype_override_fn must return a torch.dtype or None but got {type(chosen)}")
        if chosen not in (self.param_dtype, param.dtype):
            raise ValueError(
                "param_dtype_override_fn must return None, param_dtype, or the parameter's original dtype but got "
                f"{chosen} for a parameter with dtype {param.dtype} and param_dtype {self.param_dtype}"
            )
        return chosen


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading (the default)."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Keep sharded parameters and gradients in CPU memory (``pin_memory`` for fast copies)."""

    pin_memory: bool = True


# ------------------------------------------------------------------ Tensor.grad_dtype policies (FSDP2 2.15)
# A parameter's explicit ``Tensor.grad_dtype`` is its policy (ShardedParam.has_grad_dtype/grad_dtype): nn.Module's
# _apply and load_state_dict(assign=True) put new parameter objects in, which have none, so fullshard keeps the
# policy itself and gives it back to them (ShardedParam._apply_grad_dtype). Only where torch has such policies.
def capture_grad_dtype_policy(param) -> bool:
    """Adopt an explicit ``grad_dtype`` set on the parameter the module shows now (after fully_shard, or on a
    parameter loaded with assign=True): it is the user's latest word. An unset one never clears the policy (the
    rebuilt parameters have none). True if the policy changed (the group's plan must follow)."""
    if not TORCH_PROMOTES_REDUCE_DTYPE:
        return False
    module, name = param.owners[0]
    changed = False
    for tensor in (param.sharded, module._parameters.get(name)):
        # the unsharded parameter's grad_dtype is fullshard's (accumulation.hold_grad), never the user's
        if isinstance(tensor, torch.Tensor) and tensor._has_grad_dtype_override and tensor is not param.unsharded:
            changed |= not param.has_grad_dtype or param.grad_dtype != tensor.grad_dtype
            param.has_grad_dtype, param.grad_dtype = True, tensor.grad_dtype
    return changed


def show_grad_dtype_policy(param) -> None:
    """The parameter the module shows now carries the policy, if it has none of its own (one put in by
    load_state_dict(assign=True), before fullshard re-adopts it at the next forward)."""
    module, name = param.owners[0]
    current = module._parameters.get(name)
    if param.has_grad_dtype and isinstance(current, torch.Tensor) and not current._has_grad_dtype_override:
        current.grad_dtype = param.grad_dtype


def take_explicit_grad(param) -> Optional[torch.Tensor]:
    """Take the sharded gradient off a parameter whose explicit ``grad_dtype`` chose its dtype, before nn.Module's
    _apply: _apply would convert it with the parameter (``.bfloat16()`` would make an fp32 gradient bf16)."""
    grad = param.sharded.grad
    if grad is None or not param.has_grad_dtype:
        return None
    param.sharded.grad = None
    return grad


def restore_explicit_grad(param, grad: torch.Tensor) -> None:
    """Give a gradient ``take_explicit_grad`` took back to the (maybe rebuilt) sharded parameter, which has its
    policy again: moved to the parameter's device, its dtype kept."""
    param.sharded.grad = grad.to(device=param.sharded.device).requires_grad_(grad.requires_grad)


# ------------------------------------------------------------------ all-gather extensions' release policy (2.15)
RELEASE_HOOK = "fsdp_should_release_all_gather_outputs_after_post_all_gather"


def releases_gather_outputs(local: torch.Tensor) -> bool:
    """FSDP2 2.15's optional third extension hook (the caller checked the tensor has it): True declares that what
    ``fsdp_post_all_gather`` builds does not view the raw gather outputs, so fullshard may free them as soon as it
    has run (``extensions.py``). It is the user's tensor's method, not torch's, so it is honoured whatever torch
    is installed."""
    # FSDP2's exception types and words, which users may match on.
    if not hasattr(local, "fsdp_post_all_gather"):
        raise AssertionError(
            f"{RELEASE_HOOK} requires fsdp_pre_all_gather and fsdp_post_all_gather to be defined: {local}"
        )
    release = getattr(local, RELEASE_HOOK)()
    if not isinstance(release, bool):
        raise AssertionError(f"{RELEASE_HOOK} must return a bool, got {type(release)}")
    return release
