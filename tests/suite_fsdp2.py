"""FSDP2 behaviours that PyTorch's own FSDP2 tests found fullshard lacking (issue 16), as scenarios of ours.

Run by tests/test_fsdp2.py on 2 gloo ranks. PyTorch's suite itself is run by
tools/fsdp2_suite.py (never committed); docs/fsdp2-compatibility.md has its table.
"""
from __future__ import annotations

import copy
import dataclasses
import functools
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fullshard import MixedPrecisionPolicy, fully_shard
from tests.parity import mesh_1d, run_parity


# ----------------------------------------------------------------------------- registration
class Stack(nn.Module):
    def __init__(self, layers: int = 3, width: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def _kinds(module: nn.Module) -> set[str]:
    return {"dtensor" if isinstance(p, DTensor) else "plain" for p in module.parameters()}


def registration_follows_fsdp2():
    """What ``parameters()`` shows follows the gather, as in FSDP2: the unsharded (plain) parameters
    after a forward that did not reshard, the DTensor shards after reshard and after backward."""
    mesh = mesh_1d()
    observed = {}
    for reshard in (True, False, 2):
        model = Stack()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        out = model(torch.randn(4, 8))
        after_forward = [_kinds(layer) for layer in model.layers]
        out.sum().backward()
        after_backward = _kinds(model)
        observed[str(reshard)] = (after_forward, after_backward)
        expected = {"plain"} if reshard is False else {"dtensor"}
        assert all(kinds == expected for kinds in after_forward), (reshard, after_forward)
        assert after_backward == {"dtensor"}, (reshard, after_backward)
    model = Stack()
    fully_shard(model, mesh=mesh)
    model.unshard()
    assert _kinds(model) == {"plain"}
    model.reshard()
    assert _kinds(model) == {"dtensor"}
    handle = model.unshard(async_op=True)
    handle.wait()
    assert _kinds(model) == {"plain"}
    model.reshard()
    return {k: [sorted(s) for s in v[0]] for k, v in observed.items()}


def state_is_reachable_through_fully_shard():
    model = Stack()
    fully_shard(model.layers[0], mesh=mesh_1d())
    state = fully_shard.state(model.layers[0])
    assert state is model.layers[0]._fullshard_state and fully_shard.state(model) is None
    return True


# ----------------------------------------------------------------------------- structured activations
@dataclasses.dataclass
class Features:
    hidden: torch.Tensor
    gate: torch.Tensor
    step: int = 0


class Pair(NamedTuple):
    left: torch.Tensor
    right: torch.Tensor


class ToDataclass(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.gate = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> Features:
        return Features(torch.tanh(self.proj(x)), torch.sigmoid(self.gate(x)))


class DataclassToPair(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)

    def forward(self, features: Features) -> Pair:
        mixed = features.hidden * features.gate
        return Pair(self.a(mixed), self.b(mixed))


class PairToOut(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.out = nn.Linear(2 * width, 1)

    def forward(self, pair: Pair) -> torch.Tensor:
        return self.out(torch.cat([pair.left, pair.right], dim=-1))


class StructuredNet(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList([ToDataclass(width), DataclassToPair(width), PairToOut(width)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _float_batch(step: int, batch: int):
    gen = torch.Generator().manual_seed(900 + step)
    return torch.randn(batch, 8, generator=gen), torch.randn(batch, 1, generator=gen)


def _mse(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x).float(), y)


def structured_activations_under_mixed_precision():
    """Dataclass and NamedTuple activations between sharded modules are cast and hooked for backward
    (every unit is gathered again for its backward, so ZeRO-3 gets right gradients)."""
    mesh = mesh_1d()
    results = {}
    for name, mp, tolerances in (
        ("fp32", MixedPrecisionPolicy(), {}),
        ("bf16", MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                      output_dtype=torch.float32),
         dict(rtol=2e-2, atol=2e-2, param_atol=3e-2)),
    ):
        def wrap(model, mp=mp):
            for layer in model.layers:
                fully_shard(layer, mesh=mesh, mp_policy=mp)
            return fully_shard(model, mesh=mesh, mp_policy=mp)

        results[name] = run_parity(StructuredNet, wrap, make_batch=_float_batch, loss_fn=_mse, **tolerances).losses
    return results


def suite():
    return {
        "registration_follows_fsdp2": registration_follows_fsdp2,
        "state_is_reachable_through_fully_shard": state_is_reachable_through_fully_shard,
        "structured_activations_under_mixed_precision": structured_activations_under_mixed_precision,
    }
