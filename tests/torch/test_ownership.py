"""Regression tests for the seed's bug class (issue 2), on 2 gloo ranks with the sanitizer on: the seed's
configuration, and an aliasing "copy" re-introduced at every site that makes an owned buffer (at 4 ranks, the
two sites only more ranks reach: the pairwise reduce-scatter's receive buffers and the chunks kept for
``reshard_after_forward=2``).

The runtime is observed from outside: which tensors it borrows and allocates
(by wrapping ``fullshard.torch.collectives``) and which gradients autograd handed it
(by wrapping ``ShardedParam.take_unsharded_grad``).
"""
from __future__ import annotations

import contextlib
import gc
import os
import weakref

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Shard

import fullshard.torch.group as group_module
from fullshard import MixedPrecisionPolicy, fully_shard
from fullshard.torch import collectives
from fullshard.plan import Unsharded
from fullshard.plan.exchange import EXCHANGE_ENV
from fullshard.torch.param import ShardedParam
from fullshard.torch.policies import TORCH_PROMOTES_REDUCE_DTYPE
from tests.conftest import Launch, scenario, scenarios
from tests.torch.parity import mesh_1d, run_parity

LAUNCH = Launch(world_sizes=(2,), env={"FULLSHARD_CHECK_OWNERSHIP": "1"})


@contextlib.contextmanager
def observe():
    """Record gradients handed to fullshard, and what it borrows and allocates."""
    seen = {"grads": [], "borrowed": [], "allocated": []}
    take, borrow, allocate = ShardedParam.take_unsharded_grad, collectives.borrow, collectives.allocate

    def take_and_record(self):
        grad = take(self)
        if grad is not None:
            seen["grads"].append((self.fqn, grad, grad.clone(), grad.untyped_storage().nbytes()))
        return grad

    def borrow_and_record(tensor, what):
        seen["borrowed"].append((what, tensor))
        return borrow(tensor, what)

    def allocate_and_record(*args, **kwargs):
        owned = allocate(*args, **kwargs)
        seen["allocated"].append((owned.what, weakref.ref(owned), owned.tensor))
        return owned

    ShardedParam.take_unsharded_grad = take_and_record
    collectives.borrow, collectives.allocate = borrow_and_record, allocate_and_record
    saved_fuse = group_module.DEFAULT_FUSE_BELOW_NUMEL
    group_module.DEFAULT_FUSE_BELOW_NUMEL = 0  # the seed's configuration: no communication fusion
    try:
        yield seen
    finally:
        ShardedParam.take_unsharded_grad = take
        collectives.borrow, collectives.allocate = borrow, allocate
        group_module.DEFAULT_FUSE_BELOW_NUMEL = saved_fuse


def _assert_caller_grads_intact(seen):
    assert seen["grads"], "no gradient reached fullshard"
    for fqn, grad, snapshot, nbytes in seen["grads"]:
        assert grad.untyped_storage().nbytes() == nbytes, f"{fqn}: caller's gradient storage was freed"
        assert torch.equal(grad, snapshot), f"{fqn}: caller's gradient was written"


class MLP(nn.Module):
    def __init__(self, sizes):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))

    def forward(self, x):
        for layer in self.layers[:-1]:
            x = torch.tanh(layer(x))
        return self.layers[-1](x)


def _batch_for(width_in, width_out):
    def make(step, batch):
        gen = torch.Generator().manual_seed(step)
        return torch.randn(batch, width_in, generator=gen), torch.randn(batch, width_out, generator=gen)

    return make


def _mse(model, batch):
    return nn.functional.mse_loss(model(batch[0]), batch[1])


def _seed_config(sizes, dim):
    mesh = mesh_1d()
    mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    placement = (lambda p: Shard(min(dim, p.dim() - 1))) if dim else None

    def wrap(model):
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp, shard_placement_fn=placement)
        fully_shard(model, mesh=mesh, mp_policy=mp, shard_placement_fn=placement)

    with observe() as seen:
        run_parity(lambda: MLP(sizes), wrap, make_batch=_batch_for(sizes[0], sizes[-1]), loss_fn=_mse, steps=3)
    _assert_caller_grads_intact(seen)
    borrowed_grads = [what for what, _ in seen["borrowed"] if what.startswith("gradient of")]
    # (each group's single buckets' presence counts travel in a small owned buffer of their own: no gradient)
    packed_inputs = [what for what, _, _ in seen["allocated"]
                     if what.startswith("reduce-scatter input") and "presence counts" not in what]
    return {"borrowed": len(borrowed_grads), "packed": len(packed_inputs), "grads": len(seen["grads"])}


@scenario
def seed_config_even_dim0():
    """Even dim-0 shards, same dtype: the caller's gradient IS the reduce-scatter input (zero copy)."""
    counts = _seed_config([8, 16, 4], dim=0)
    assert counts["packed"] == 0, f"zero-copy path allocated reduce-scatter inputs: {counts}"
    assert counts["borrowed"] == counts["grads"] > 0, counts
    return counts


@scenario
def seed_config_padded_dim0():
    counts = _seed_config([7, 5, 3], dim=0)
    assert counts["packed"] == counts["grads"] and counts["borrowed"] == 0, counts
    return counts


@scenario
def seed_config_even_dim1():
    counts = _seed_config([8, 16, 4], dim=1)
    # weights (dim 1) are re-laid out; biases (1-D, dim 0 even) are borrowed
    assert counts["borrowed"] == counts["packed"] == counts["grads"] // 2 > 0, counts
    return counts


@scenario
def seed_config_padded_dim1():
    counts = _seed_config([7, 5, 3], dim=1)
    assert counts["borrowed"] == 0 and counts["packed"] == counts["grads"], counts
    return counts


class ConcatUser(nn.Module):
    """Two parameters concatenated in forward: autograd hands each a view of ONE gradient buffer."""

    def __init__(self):
        super().__init__()
        self.w1 = nn.Linear(6, 8, bias=False)
        self.w2 = nn.Linear(6, 8, bias=False)

    def forward(self, x):
        return x @ torch.cat([self.w1.weight, self.w2.weight]).t()


@scenario
def gradients_sharing_one_storage():
    mesh = mesh_1d()

    def wrap(model):  # one group; without fusion each weight has its own reduce-scatter
        fully_shard(model, mesh=mesh)

    with observe() as seen:
        run_parity(ConcatUser, wrap, make_batch=_batch_for(6, 16), loss_fn=_mse, steps=3)
    _assert_caller_grads_intact(seen)
    by_name = {}
    for fqn, grad, _, _ in seen["grads"]:
        by_name.setdefault(fqn, grad)
    g1, g2 = by_name["w1.weight"], by_name["w2.weight"]
    assert g1.untyped_storage().data_ptr() == g2.untyped_storage().data_ptr(), "premise: grads share a storage"
    return True


@scenario
def low_precision_stored_fp32_reduce():
    """bf16-stored parameters reduced in fp32: the fp32 mean lands, cast once, in the bf16 shard."""
    mesh = mesh_1d()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = MLP([8, 16, 4]).to(torch.bfloat16)
    reference = MLP([8, 16, 4]).to(torch.bfloat16)
    reference.load_state_dict(model.state_dict())
    mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    x, y = _batch_for(8, 4)(0, 4 * world)
    x, y = x.bfloat16(), y.bfloat16()
    with observe() as seen:
        _mse(model, (x.chunk(world)[rank], y.chunk(world)[rank])).backward()
    _assert_caller_grads_intact(seen)
    # Emulate: every rank's bf16 gradient, averaged in fp32, cast to bf16 once.
    _mse(reference, (x.chunk(world)[rank], y.chunk(world)[rank])).backward()
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        assert param.dtype == torch.bfloat16 and param.grad.dtype == torch.bfloat16, name
        gathered = [torch.empty_like(ref.grad, dtype=torch.float32) for _ in range(world)]
        dist.all_gather(gathered, ref.grad.float())
        expected = (sum(gathered) / world).bfloat16()
        assert torch.equal(param.grad.full_tensor(), expected), name
    return True


@scenario
def padding_path_reclaims_its_buffers():
    """100 steps on the padding path: every owned reduce-scatter input is reclaimed; nothing leaks."""
    mesh = mesh_1d()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = MLP([7, 5, 3])
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    live = []
    with observe() as seen:
        for step in range(100):
            x, y = _batch_for(7, 3)(step, 2 * world)
            _mse(model, (x.chunk(world)[rank], y.chunk(world)[rank])).backward()
            opt.step()
            opt.zero_grad()
            inputs = [t for what, _, t in seen["allocated"] if what.startswith("reduce-scatter input")]
            leaked = [what for what, _, t in seen["allocated"] if t.untyped_storage().nbytes() and "input" in what]
            assert inputs and not leaked, f"step {step}: not reclaimed: {leaked}"
            seen["allocated"].clear()
            seen["grads"].clear()
            gc.collect()  # earlier scenarios' models may be collected at any point: count after a collection
            live.append(collectives.live_owned_buffers())
    if collectives.check_ownership_enabled():
        assert len(set(live[1:])) == 1, f"owned buffer count grows: {live[:3]} ... {live[-3:]}"
    return live[-1]


@scenario
def no_shard_tensor_subclass():
    """no_shard with tensor-subclass parameters (TwoTensor): the replica is what the module computes with,
    borrowed (plan_replica), so training matches the unsharded subclass model and an explicit reshard()
    frees none of the replica's storage (the review's case: a subclass ``to()`` returned the replica itself,
    taken as an owned copy and resized)."""
    from torch.testing._internal.two_tensor import TwoTensor

    def build():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8, bias=False), nn.Linear(8, 4, bias=False))
        for layer in model:
            layer.weight = nn.Parameter(TwoTensor(layer.weight.detach(), layer.weight.detach().clone()))
        return model

    reference, model = build(), build()
    for layer in model:
        fully_shard(layer, mesh=mesh_1d(), strategy="no_shard")
    fully_shard(model, mesh=mesh_1d(), strategy="no_shard")
    world = dist.get_world_size()
    torch.manual_seed(7 + dist.get_rank())
    x = torch.randn(2, 8)
    for _ in range(3):
        ref_loss, loss = reference(x).sum(), model(x).sum()
        torch.testing.assert_close(loss, ref_loss)
        ref_loss.backward()
        loss.backward()
        with torch.no_grad():
            for ref_param, param in zip(reference.parameters(), model.parameters()):
                dist.all_reduce(ref_param.grad)
                torch.testing.assert_close(param.grad.to_local(), ref_param.grad.a / world)
                ref_param -= 0.1 * ref_param.grad / world
                param -= 0.1 * param.grad
                ref_param.grad = param.grad = None
    replicas = [p.to_local() for p in model.parameters()]
    values = [(r.a.clone(), r.b.clone()) for r in replicas]
    for layer in [*model, model]:
        layer.unshard()
        layer.reshard()
    for replica, (a, b) in zip(replicas, values):
        assert replica.a.untyped_storage().nbytes() == a.numel() * 4 and torch.equal(replica.a, a)
        assert torch.equal(replica.b, b)
    groups = [layer._fullshard_unit.group for layer in model]
    assert all(how is Unsharded.REPLICA for g in groups for how in g.plan.replica_plans)
    return float(loss)


@scenario
def accumulators_are_counted_as_main_grad():
    """bf16 gradients summed in fp32 while sync is off: the accumulators are main-gradient memory in the meter
    and in memory_report, not communication memory, and they are gone once the synced backward reduced them
    (torch 2.13/2.14; on 2.15 autograd holds the sums, counted as gradients, and fullshard holds none)."""
    from fullshard.torch.accounting import memory_report

    rank, world = dist.get_rank(), dist.get_world_size()
    gc.collect()
    torch.manual_seed(0)
    model = MLP([7, 12, 5])
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh_1d(), mp_policy=mp)
    fully_shard(model, mesh=mesh_1d(), mp_policy=mp)
    x, y = _batch_for(7, 5)(0, 4 * world)
    before = collectives.comm_bytes()
    model.set_requires_gradient_sync(False)
    _mse(model, (x[4 * rank:4 * rank + 2].bfloat16(), y[4 * rank:4 * rank + 2].bfloat16())).backward()
    held = collectives.comm_bytes()
    full = sum(p.numel() for p in MLP([7, 12, 5]).parameters())
    report = memory_report(model)["measured"]
    # torch 2.15: autograd holds the fp32 sums, as the unsharded parameters' gradients (FSDP2 2.15's place)
    owned = 0 if TORCH_PROMOTES_REDUCE_DTYPE else 4 * full
    assert held["main_grad_live"] - before["main_grad_live"] == owned, (held, before)
    assert held["transient_live"] == before["transient_live"]
    assert report["main_grad"] - before["main_grad_live"] == owned
    if TORCH_PROMOTES_REDUCE_DTYPE:
        assert report["grads"] == 4 * full, report
    model.set_requires_gradient_sync(True)
    _mse(model, (x[4 * rank + 2:4 * rank + 4].bfloat16(), y[4 * rank + 2:4 * rank + 4].bfloat16())).backward()
    assert collectives.comm_bytes()["main_grad_live"] == before["main_grad_live"]
    return held["main_grad_live"] - before["main_grad_live"]


@contextlib.contextmanager
def aliasing_at(site: str):
    """Re-introduce the seed's bug at one site: the buffer it makes (``what`` starting with ``site``) is the
    storage it was made from. The site's own ``what`` and ``sources`` reach the real ownership check."""
    allocate, copy = collectives.allocate, collectives._copy
    hits = []

    def aliasing_allocate(shape, dtype, device, what, kind=collectives.Kind.TRANSIENT, sources=()):
        victims = [t for t in sources if t is not None and t.numel()]
        if not (what.startswith(site) and victims):
            return allocate(shape, dtype, device, what, kind, sources)
        hits.append(what)
        return collectives.Owned(victims[0], what, collectives.TORCH_STORAGE, kind, sources=sources)

    def aliasing_copy(tensor, dtype, device, non_blocking):
        hits.append(site)
        return tensor  # a "copy" that is its input, as a same-dtype to() is

    collectives.allocate = aliasing_allocate
    if site == "sharded gradient of":
        collectives._copy = aliasing_copy
    try:
        yield hits
    finally:
        collectives.allocate, collectives._copy = allocate, copy


def _bf16_compute():
    return {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)}


def _collective_bf16():  # the pairwise exchange packs into its output instead: no input buffer of its own
    return {**_bf16_compute(), "exchange": "collective"}


def _to_bf16(model: nn.Module) -> None:
    model.to(torch.bfloat16)


# site (the start of the buffer's ``what``) -> how to reach it: fully_shard arguments (and the exchange),
# micro-batches without sync, optionally what the user does after the first of them
SITES = {
    "all-gather input of": (_collective_bf16, 1),  # a cast packs the input
    "all-gather output of": (lambda: {}, 1),  # fused small parameters copy out of it
    "unsharded [": (lambda: {"fuse": False}, 1),  # a lone parameter is a view of its output
    "unsharded parameter '": (lambda: {}, 1),  # copied out of a fused output into storage of its own
    "reduce-scatter input of": (lambda: {}, 1),  # padded gradients are packed
    "reduce-scatter output of": (lambda: {}, 1),
    "bfloat16 copy of replica": (lambda: {**_bf16_compute(), "strategy": "no_shard"}, 1),
    # on any torch: fp32 gradients pending when the model is converted to bf16 between micro-batches (the new
    # bf16 unsharded parameters cannot hold them); on 2.13/2.14 also bf16 gradients summed in fp32 while sync
    # is off (2.15 sums those in autograd)
    "gradient accumulator of": (lambda: {}, 2, _to_bf16),
    "sharded gradient of": (lambda: {"shard_placement_fn": lambda p: Shard(p.dim() - 1)}, 1),  # copied out
}
FOUR_RANK_SITES = {
    "reduce-scatter receive buffer of": (lambda: {}, 1),  # pairwise over 4 ranks: 2 scratch chunks
    "post-forward chunks of": (lambda: {"reshard_after_forward": 2}, 1),
}


@contextlib.contextmanager
def _exchange(name):
    """FULLSHARD_EXCHANGE while groups are planned (on every rank alike)."""
    saved = os.environ.get(EXCHANGE_ENV)
    if name:
        os.environ[EXCHANGE_ENV] = name
    try:
        yield
    finally:
        os.environ.pop(EXCHANGE_ENV, None)
        if saved is not None:
            os.environ[EXCHANGE_ENV] = saved


def _caught_at(site: str, wrap_kwargs, micro_batches: int, after_first=None):
    def caught():
        rank, world = dist.get_rank(), dist.get_world_size()
        torch.manual_seed(0)
        model = MLP([7, 12, 5])
        names = {n for n, _ in model.named_parameters()}
        kwargs = wrap_kwargs()
        exchange, fuse = kwargs.pop("exchange", None), kwargs.pop("fuse", True)
        saved_fuse = group_module.DEFAULT_FUSE_BELOW_NUMEL
        group_module.DEFAULT_FUSE_BELOW_NUMEL = saved_fuse if fuse else 0
        try:
            with _exchange(exchange):
                for layer in model.layers:
                    fully_shard(layer, mesh=mesh_1d(), **kwargs)
                fully_shard(model, mesh=mesh_1d(), **kwargs)
        finally:
            group_module.DEFAULT_FUSE_BELOW_NUMEL = saved_fuse
        x, y = _batch_for(7, 5)(0, 2 * world * micro_batches)
        with aliasing_at(site) as hits:
            try:
                for index in range(micro_batches):
                    model.set_requires_gradient_sync(index == micro_batches - 1)
                    part = slice((rank * micro_batches + index) * 2, (rank * micro_batches + index + 1) * 2)
                    dtype = next(model.parameters()).dtype  # a conversion after the first changes it
                    _mse(model, (x[part].to(dtype), y[part].to(dtype))).backward()
                    if index == 0 and after_first is not None:
                        after_first(model)
            except collectives.OwnershipError as error:
                message = str(error)
            else:
                raise AssertionError(f"an aliasing {site!r} was not caught (reached {len(hits)} times)")
        assert hits and site in message, message
        assert any(name in message for name in names), f"no parameter named: {message}"
        model.reset_iter_state()
        return message.split(":")[0]

    return caught


@scenarios(world_sizes=(2, 4))
def aliasing_caught_at(world_size):
    """Each site's aliasing is caught, naming the parameter: every site 2 ranks reach, and at 4 those only more
    ranks reach."""
    sites = SITES if world_size == 2 else FOUR_RANK_SITES
    return {f"aliasing_caught_at[{site}]": _caught_at(site, *how) for site, how in sites.items()}


@scenario
def soak_500_steps_flat_buffer_count():
    """500 steps with the sanitizer on: the number of live owned buffers and their bytes stay flat."""
    mesh = mesh_1d()
    rank, world = dist.get_rank(), dist.get_world_size()
    gc.collect()
    torch.manual_seed(0)
    model = MLP([7, 12, 5, 3])
    for layer in model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)  # cheap: the soak is about buffers, not the optimizer
    counts, sizes = [], []
    for step in range(500):
        x, y = _batch_for(7, 3)(step, 2 * world)
        _mse(model, (x.chunk(world)[rank], y.chunk(world)[rank])).backward()
        opt.step()
        opt.zero_grad()
        counts.append(collectives.live_owned_buffers())
        sizes.append(collectives.comm_bytes()["live"])
    assert len(set(sizes[1:])) == 1, f"owned bytes drift: {sizes[1:4]} ... {sizes[-3:]}"
    if collectives.check_ownership_enabled():
        assert len(set(counts[1:])) == 1, f"owned buffer count drifts: {counts[1:4]} ... {counts[-3:]}"
    return {"owned_buffers": counts[-1], "owned_bytes": sizes[-1]}
