"""FSDP2 behaviours that PyTorch's own FSDP2 tests found fullshard lacking (issue 16), as scenarios of ours.

On 2 gloo ranks. PyTorch's suite itself is run by
`python tools/fsdp2_suite` (its upstream files are never committed); docs/fsdp2-compatibility.md has its table.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import NamedTuple

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from fullshard import MixedPrecisionPolicy, fully_shard
from tests.conftest import Launch, scenario
from tests.torch.parity import mesh_1d, run_parity

LAUNCH = Launch(world_sizes=(2,))


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


@scenario
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


@scenario
def state_is_reachable_through_fully_shard():
    model = Stack()
    fully_shard(model.layers[0], mesh=mesh_1d())
    state = fully_shard.state(model.layers[0])
    assert state is model.layers[0]._fullshard_unit and fully_shard.state(model) is None
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


@scenario
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


# ----------------------------------------------------------------------------- custom collectives
class CountingAllGather:
    """FSDP2's AllGather protocol over torch's own collective, counting what fullshard asks of it."""

    def __init__(self) -> None:
        self.allocated, self.calls = [], 0

    def allocate(self, size, *, dtype, device):
        self.allocated.append(tuple(size))
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output, input, group, async_op=False):
        self.calls += 1
        return torch.distributed.all_gather_into_tensor(output, input, group=group, async_op=async_op)


class CountingReduceScatter(CountingAllGather):
    def __call__(self, output, input, group, op, async_op=False):
        self.calls += 1
        return torch.distributed.reduce_scatter_tensor(output, input, op=op, group=group, async_op=async_op)


@scenario
def custom_collectives_carry_the_bytes():
    """set_custom_all_gather / set_custom_reduce_scatter: every gather and reduction of the unit goes
    through the user's collectives, on buffers of their allocators, and training matches the reference."""
    mesh = mesh_1d()
    comms = {}

    def wrap(model):
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        comms["gather"], comms["reduce"] = CountingAllGather(), CountingReduceScatter()
        model.layers[1].set_custom_all_gather(comms["gather"])
        model.layers[1].set_custom_reduce_scatter(comms["reduce"])
        return model

    losses = run_parity(Stack, wrap, make_batch=_stack_batch, loss_fn=_mse, steps=3).losses
    gather, reduce = comms["gather"], comms["reduce"]
    # ZeRO-3: gathered for forward and again for backward; reduced once per step
    assert gather.calls == 2 * 3 and reduce.calls == 3, (gather.calls, reduce.calls)
    assert len(gather.allocated) == gather.calls and len(reduce.allocated) == reduce.calls
    return losses


def _stack_batch(step: int, batch: int):
    gen = torch.Generator().manual_seed(300 + step)
    return torch.randn(batch, 8, generator=gen), torch.randn(batch, 8, generator=gen)


# ----------------------------------------------------------------------------- all-gather extensions
@scenario
def all_gather_extensions_on_a_local_tensor():
    """fsdp_pre_all_gather / fsdp_post_all_gather set on a parameter's local tensor object (no subclass)
    decide what travels (bf16 here) and what the module sees; the pre hook gets the shard dim's mesh."""
    seen = {"pre": 0, "post": 0, "refill": 0, "mesh": None}

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        seen["pre"] += 1
        seen["mesh"] = (mesh.ndim, mesh.size())
        return (self.to(torch.bfloat16),), None

    @torch.no_grad()
    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (gathered,) = outputs
        assert gathered.dtype == torch.bfloat16, gathered.dtype
        if out is not None:
            seen["refill"] += 1
            out.copy_(gathered)
            return None
        seen["post"] += 1
        upcast = gathered.to(param_dtype)
        return upcast, (upcast,)

    def wrap(model):
        for layer in model.layers:
            fully_shard(layer, mesh=mesh_1d())
        fully_shard(model, mesh=mesh_1d())
        for name, param in model.named_parameters():
            if name.endswith("weight"):
                local = param._local_tensor
                local.fsdp_pre_all_gather = fsdp_pre_all_gather.__get__(local)
                local.fsdp_post_all_gather = fsdp_post_all_gather.__get__(local)
        return model

    losses = run_parity(Stack, wrap, make_batch=_stack_batch, loss_fn=_mse, steps=3,
                        rtol=2e-2, atol=2e-2, param_atol=3e-2).losses
    assert seen["pre"] > 0 and seen["post"] == 3 and seen["refill"] > 0, seen  # built once per weight, then refilled
    assert seen["mesh"] == (1, torch.distributed.get_world_size()), seen
    return losses


@scenario
def all_gather_extensions_on_a_subclass():
    """A parameter of a tensor subclass whose class defines the extensions (torch's TwoTensor, two inner
    tensors gathered separately) trains like the unsharded subclass model."""
    from torch.testing._internal.two_tensor import TwoTensor

    def pre(self, mesh):
        return (self.a, self.b), None

    def post(self, outputs, metadata, param_dtype, *, out=None):
        a, b = outputs
        if out is not None:
            if a.dtype != param_dtype:
                out.a.copy_(a)
                out.b.copy_(b)
            return None
        return TwoTensor(a, b).to(param_dtype), (a, b)

    def build():
        model = Stack()
        for layer in model.layers:
            layer.weight = nn.Parameter(TwoTensor(layer.weight.detach(), layer.weight.detach().clone()))
            # no bias: the reference's would get a TwoTensor gradient through the TwoTensor output (as
            # PyTorch's own test notes), which no plain parameter can match
            layer.register_parameter("bias", None)
        return model

    from torch.distributed.tensor import distribute_tensor

    TwoTensor.fsdp_pre_all_gather, TwoTensor.fsdp_post_all_gather = pre, post
    try:
        torch.manual_seed(0)
        reference = build()
        model = copy.deepcopy(reference)
        for layer in model.layers:
            fully_shard(layer, mesh=mesh_1d())
        fully_shard(model, mesh=mesh_1d())
        # As PyTorch's own test does: every rank its own input; the reference averages gradients itself
        # (a TwoTensor loss cannot go through run_parity's all-reduce of losses).
        torch.manual_seed(42 + torch.distributed.get_rank())
        x = torch.randn(2, 8)
        losses = []
        for _ in range(3):
            ref_loss, loss = reference(x).sum(), model(x).sum()
            torch.testing.assert_close(loss, ref_loss)
            ref_loss.backward()
            loss.backward()
            with torch.no_grad():
                for ref_param, param in zip(reference.parameters(), model.parameters()):
                    torch.distributed.all_reduce(ref_param.grad)
                    ref_param.grad.div_(torch.distributed.get_world_size())
                    expected = distribute_tensor(ref_param.grad, param.device_mesh, param.placements).to_local()
                    torch.testing.assert_close(param.grad.to_local(), expected)
                    ref_param -= 0.1 * ref_param.grad
                    param -= 0.1 * param.grad
                    ref_param.grad = param.grad = None
            losses.append(float(loss))
        return losses
    finally:
        del TwoTensor.fsdp_pre_all_gather, TwoTensor.fsdp_post_all_gather


@scenario
def extensions_must_pad_uneven_shards():
    model = nn.Linear(8, 3)  # 3 rows on 2 ranks: padded chunks of 2
    fully_shard(model, mesh=mesh_1d())
    local = model.weight._local_tensor
    local.fsdp_pre_all_gather = (lambda self, mesh: ((self,), None)).__get__(local)
    local.fsdp_post_all_gather = (lambda self, outputs, metadata, dtype, *, out=None: (outputs[0], ())).__get__(local)
    try:
        model(torch.randn(2, 8))
    except ValueError as error:
        assert "padded sharded size" in str(error) and "weight" in str(error), str(error)
        return str(error)[:80]
    raise AssertionError("an unpadded extension input was accepted")


# ----------------------------------------------------------------------------- composition, freezing
class Tower(nn.Module):
    """A root Linear (left to DDP) over sharded MLP blocks."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(width, 2 * width), nn.Tanh(), nn.Linear(2 * width, width))
                                    for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = x + layer(x)
        return x


@scenario
def replicate_over_fully_shard_units():
    """torch's replicate() (DDP) on the root, fully_shard on the blocks: DDP leaves the blocks'
    parameters to fullshard, as it does FSDP2's, and training matches the reference."""
    from torch.distributed._composable import replicate

    def wrap(model):
        for layer in model.layers:
            fully_shard(layer, mesh=mesh_1d())
        replicate(model)
        return model

    result = run_parity(Tower, wrap, make_batch=_stack_batch, loss_fn=_mse, steps=3)
    return result.losses


@scenario
def freezing_after_fully_shard_is_followed():
    """requires_grad changed on the sharded parameters after fully_shard (fine-tuning schedules): frozen
    ones get no gradient and do not train, in every unit and across units, and unfreezing trains them."""
    mesh = mesh_1d()
    torch.manual_seed(0)
    reference = Stack(layers=4)
    model = copy.deepcopy(reference)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    pairs = list(zip(model.parameters(), reference.parameters()))
    opt = torch.optim.SGD([p for p, _ in pairs], lr=0.1)
    ref_opt = torch.optim.SGD([r for _, r in pairs], lr=0.1)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    for step in range(4):
        frozen = {0, 2} if step < 2 else {2} if step == 2 else set()  # interleaved, then unfrozen
        for index, (layer, ref_layer) in enumerate(zip(model.layers, reference.layers)):
            for p, r in zip(layer.parameters(), ref_layer.parameters()):
                p.requires_grad_(index not in frozen)
                r.requires_grad_(index not in frozen)
        x, y = _stack_batch(step, 4)
        if step == 1:
            with torch.no_grad():
                model(x.chunk(world)[rank])
                reference(x)
        loss = _mse(model, (x.chunk(world)[rank], y.chunk(world)[rank]))
        loss.backward()
        _mse(reference, (x, y)).backward()
        for index, layer in enumerate(model.layers):
            for p in layer.parameters():
                assert (p.grad is None) == (index in frozen), (step, index)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    for p, r in pairs:
        torch.testing.assert_close(p.full_tensor(), r, rtol=1e-5, atol=1e-6)
    return True


@scenario
def kept_gathered_after_synced_backward():
    """set_reshard_after_backward(False) keeps a unit gathered for the next micro-batch even when that
    backward reduced (FSDP2's meaning): one gather per step; the optimizer's step is still seen."""
    from fullshard.core.buffers import traffic

    mesh = mesh_1d()
    torch.manual_seed(0)
    reference = Stack()
    model = copy.deepcopy(reference)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    gathers = []
    for step in range(2):
        before = traffic["all_gather"]
        for micro in range(3):
            model.set_reshard_after_backward(micro == 2)
            x, y = _stack_batch(10 * step + micro, 4)
            _mse(model, (x.chunk(world)[rank], y.chunk(world)[rank])).div(3).backward()  # reduced every time
            _mse(reference, (x, y)).div(3).backward()
        gathers.append(traffic["all_gather"] - before)
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
    one_gather = sum(p.numel() * 4 for p in reference.parameters())
    assert gathers == [one_gather, one_gather], (gathers, one_gather)
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.full_tensor(), r)
    return gathers


def _sgd_like_the_reference(model: nn.Module, reference: nn.Module, run=None) -> list:
    """Three SGD steps of the sharded ``model`` (called through ``run``, e.g. its compiled form) on this rank's
    part of each batch, and of ``reference`` on the whole batch: the mean loss each step and the final full
    parameters must match. Returns the reference's losses."""
    run = run if run is not None else model
    opt, ref_opt = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    losses = []
    for step in range(3):
        x, y = _stack_batch(step, 4)
        loss = _mse(run, (x.chunk(world)[rank], y.chunk(world)[rank]))
        loss.backward()
        ref_loss = _mse(reference, (x, y))
        ref_loss.backward()
        opt.step(), ref_opt.step()
        opt.zero_grad(), ref_opt.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        torch.testing.assert_close(mean / world, ref_loss.detach(), rtol=1e-5, atol=1e-6)
        losses.append(float(ref_loss))
    for p, r in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.full_tensor(), r, rtol=1e-5, atol=1e-6)
    return losses


@scenario
def compiled_model_trains_like_the_reference():
    """torch.compile over a sharded model (FSDP2's compile tests do this): the modules' forwards are
    traced, fullshard's hooks run eagerly between the graphs; losses and parameters match."""
    mesh = mesh_1d()
    torch.manual_seed(0)
    reference = Stack()
    model = copy.deepcopy(reference)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=2)  # as in FSDP2's compile test
    fully_shard(model, mesh=mesh)
    compiled = torch.compile(model, backend="aot_eager")  # traced like inductor, without a C++ build
    return _sgd_like_the_reference(model, reference, run=compiled)


@scenario
def non_contiguous_parameters_train_like_the_reference():
    """FSDP2 refuses a non-contiguous parameter (NotImplementedError); fullshard takes it: its shard is a
    contiguous copy of its chunk, and training matches the reference (docs/fsdp2-compatibility.md)."""
    mesh = mesh_1d()
    torch.manual_seed(0)
    reference = Stack()
    for layer in reference.layers:  # the transpose of a contiguous tensor: same values' layout, strides (1, 8)
        layer.weight = nn.Parameter(layer.weight.detach().t().contiguous().t())
    assert not reference.layers[0].weight.is_contiguous()
    model = copy.deepcopy(reference)
    assert not model.layers[0].weight.is_contiguous()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return _sgd_like_the_reference(model, reference)
