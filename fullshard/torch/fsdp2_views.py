"""What PyTorch's own distributed code reads from an FSDP2 module's state, served by fullshard's.

fullshard's modules are instances of torch's ``FSDPModule`` (``api.FSDPModule``),
so torch code that looks for FSDP modules finds them. Most of it only calls
``FSDPModule`` methods, which fullshard defines. ``torch.distributed.pipelining``
also reaches into the state: after the last micro-batch of a schedule it reduces
the gradients itself, through ``fully_shard.state(module)._state_ctx.all_states``,
each state's ``_fsdp_param_groups[i].post_backward()``, then the root's
``_root_post_backward_final_callback()``. These read-only views answer those
three calls with fullshard's own reduction; nothing else of FSDP2's state exists.
"""
from __future__ import annotations

from collections import OrderedDict
from types import SimpleNamespace

import torch.nn as nn
from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY, RegistryItem
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from fullshard.torch.unit import ShardedUnit


class _GroupView:
    def __init__(self, state: ShardedUnit) -> None:
        self._state = state

    def post_backward(self) -> None:
        self._state.reduce_accumulated_grads()


class _StateView:
    def __init__(self, state: ShardedUnit) -> None:
        self._state = state

    @property
    def _fsdp_param_groups(self) -> list[_GroupView]:
        return [_GroupView(self._state)] if self._state.group is not None else []

    @property
    def _state_ctx(self) -> SimpleNamespace:
        states = self._state.root.units if self._state.root is not None else [self._state]
        return SimpleNamespace(all_states=[_StateView(state) for state in states])

    def _root_post_backward_final_callback(self) -> None:
        (self._state.root or self._state.lazy_init_as_root()).complete_backward()


def expose(module: nn.Module, state: ShardedUnit) -> None:
    """Answer ``torch.distributed.fsdp.fully_shard.state(module)`` with a view of ``state``, and mark the
    module in torch's registry of composable APIs as ``fully_shard``ed: torch's ``replicate()`` applied
    over fullshard units (DDP on the root) then leaves their parameters to fullshard, as it does FSDP2's."""
    # fully_shard.state(m) looks its state up under the undecorated function.
    module.__dict__.setdefault(STATE_KEY, {})[torch_fully_shard.__wrapped__] = _StateView(state)
    module.__dict__.setdefault(REGISTRY_KEY, OrderedDict()).setdefault("fully_shard", RegistryItem())
