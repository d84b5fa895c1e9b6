"""The pairwise exchange (point-to-point all-gather / reduce-scatter on gloo), at N = 2 and N = 4.

Checked against torch's own collectives on the same inputs, in the orders and
groups the runtime uses them, and shown to be the path a gloo model takes.
The backend-collective path (what NCCL uses) keeps a parity run of its own here.
"""
from __future__ import annotations

import contextlib
import copy
import os

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import Shard

import fullshard.torch.group as group_module
from fullshard import MixedPrecisionPolicy
from fullshard.plan import Exchange, exchange_tag, reduce_scratch_chunks
from fullshard.plan.exchange import EXCHANGE_ENV
from fullshard.torch import collectives
from tests.conftest import Launch, scenario
from tests.torch.parity import build_gpt, gpt_batch, gpt_loss, mesh_1d, run_parity, shard_blocks_then_root

LAUNCH = Launch(world_sizes=(2, 4))


def _integer_valued(numel: int, dtype: torch.dtype, salt: int) -> torch.Tensor:
    """Small integers: sums are exact in any order, so pairwise and ring results must be equal."""
    gen = torch.Generator().manual_seed(1000 * dist.get_rank() + salt)
    return torch.randint(-8, 8, (numel,), generator=gen).to(dtype)


def _groups() -> list:
    """The whole world, and (with 4 ranks) pairs, as HSDP's shard groups are."""
    world = dist.get_world_size()
    groups = [None]
    if world == 4:
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        groups.append(pairs[dist.get_rank() // 2])
    return groups


def _pairwise_reduce_scatter(output, input, group, tag):
    scratch = [torch.empty_like(output) for _ in range(reduce_scratch_chunks(Exchange.PAIRWISE, dist.get_world_size(group)))]
    return collectives.reduce_scatter(Exchange.PAIRWISE, output, input, group, tag, scratch)


@scenario
def pairwise_equals_backend_collectives():
    checked = 0
    for group in _groups():
        n = dist.get_world_size(group)
        for dtype in (torch.float32, torch.bfloat16):
            for chunk in (1, 5, 4096):
                shard = _integer_valued(chunk, dtype, salt=chunk)
                expected = torch.empty(n * chunk, dtype=dtype)
                dist.all_gather_into_tensor(expected, shard, group=group)
                gathered = torch.full((n * chunk,), float("nan"), dtype=dtype)
                collectives.all_gather(Exchange.PAIRWISE, gathered, shard, group, tag=11).wait()
                assert torch.equal(gathered, expected), (n, dtype, chunk)

                full = _integer_valued(n * chunk, dtype, salt=chunk + 1)
                snapshot = full.clone()
                expected = torch.empty(chunk, dtype=dtype)
                dist.reduce_scatter_tensor(expected, full, group=group)
                reduced = torch.full((chunk,), float("nan"), dtype=dtype)
                _pairwise_reduce_scatter(reduced, full, group, tag=12).wait()
                assert torch.equal(reduced, expected), (n, dtype, chunk)
                assert torch.equal(full, snapshot), "the reduce-scatter input (possibly a borrowed gradient) was written"
                checked += 1
    return checked


@scenario
def all_gather_in_place_sends_this_ranks_row():
    n, rank = dist.get_world_size(), dist.get_rank()
    output = torch.full((n * 6,), float("nan"))
    own = output.view(n, -1)[rank]
    own.copy_(torch.arange(6.0) + 10 * rank)
    collectives.all_gather(Exchange.PAIRWISE, output, own, None, tag=13, input_in_place=True).wait()
    assert torch.equal(output, torch.cat([torch.arange(6.0) + 10 * r for r in range(n)]))
    return True


@scenario
def exchanges_issued_in_different_orders_match_by_tag():
    """Ranks may start exchanges in any order: each bucket's tag keeps its messages apart."""
    n, rank = dist.get_world_size(), dist.get_rank()
    labels = [f"[layers.{i}.weight] of module 'layers.{i}'" for i in range(3)]
    order = labels if rank % 2 == 0 else labels[::-1]
    pending = {}
    for label in order:
        value = labels.index(label)
        full = torch.full((n * 8,), float(value + 1))
        output = torch.empty(8)
        pending[label] = (output, _pairwise_reduce_scatter(output, full, None, exchange_tag(label, "reduce_scatter")))
    for label, (output, work) in pending.items():
        work.wait()
        assert torch.equal(output, torch.full((8,), float(n * (labels.index(label) + 1)))), label
    return len(pending)


@contextlib.contextmanager
def _exchange_env(value: str):
    saved = os.environ.get(EXCHANGE_ENV)
    os.environ[EXCHANGE_ENV] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ[EXCHANGE_ENV]
        else:
            os.environ[EXCHANGE_ENV] = saved


@contextlib.contextmanager
def _count_calls():
    """Calls to torch.distributed's collectives and sends, and fullshard's owned all-gather inputs."""
    counts = {"collectives": 0, "sends": 0, "packed_gather_inputs": 0}
    names = ("all_gather_single", "all_gather_into_tensor", "reduce_scatter_single", "reduce_scatter_tensor")
    originals = {name: getattr(dist, name) for name in names if hasattr(dist, name)}
    original_isend, original_allocate = dist.isend, collectives.allocate

    def counting(name):
        def call(*args, **kwargs):
            counts["collectives"] += 1
            return originals[name](*args, **kwargs)
        return call

    def isend(*args, **kwargs):
        counts["sends"] += 1
        return original_isend(*args, **kwargs)

    def allocate(*args, **kwargs):
        owned = original_allocate(*args, **kwargs)
        counts["packed_gather_inputs"] += owned.what.startswith("all-gather input")
        return owned

    for name in originals:
        setattr(dist, name, counting(name))
    dist.isend, collectives.allocate = isend, allocate
    try:
        yield counts
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
        dist.isend, collectives.allocate = original_isend, original_allocate


def _one_step_counts(**kwargs) -> dict:
    model = shard_blocks_then_root(build_gpt(), mesh=mesh_1d(), **kwargs)
    world = dist.get_world_size()
    with _count_calls() as counts:
        gpt_loss(model, tuple(t.chunk(world)[dist.get_rank()] for t in gpt_batch(0, 2 * world))).backward()
    return counts


@scenario
def gloo_models_exchange_pairwise_and_pack_in_place():
    """On gloo: no backend all-gather/reduce-scatter, and fused buckets need no all-gather input of their own."""
    saved = group_module.DEFAULT_FUSE_BELOW_NUMEL
    group_module.DEFAULT_FUSE_BELOW_NUMEL = 1 << 20  # every parameter of a block in one fused bucket
    try:
        pairwise = _one_step_counts()
        with _exchange_env("collective"):
            collective = _one_step_counts()
    finally:
        group_module.DEFAULT_FUSE_BELOW_NUMEL = saved
    assert pairwise["collectives"] == 0 and pairwise["sends"] > 0, pairwise
    assert pairwise["packed_gather_inputs"] == 0, pairwise
    assert collective["sends"] == 0 and collective["collectives"] > 0, collective
    assert collective["packed_gather_inputs"] > 0, collective
    return {"pairwise": pairwise, "collective": collective}


@scenario
def collective_exchange_parity():
    """The backend-collective path (NCCL's) against the reference: fused, uneven, dim-1, bf16, accumulation."""
    mesh = mesh_1d()
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    losses = {}
    with _exchange_env("collective"):
        losses["zero3"] = run_parity(build_gpt, lambda m: shard_blocks_then_root(m, mesh=mesh)).losses
        losses["zero2_accumulate"] = run_parity(
            build_gpt, lambda m: shard_blocks_then_root(m, mesh=mesh, reshard_after_forward=False),
            micro_batches=2, global_batch=8,
        ).losses
        losses["dim1"] = run_parity(
            build_gpt, lambda m: shard_blocks_then_root(m, mesh=mesh, shard_placement_fn=lambda p: Shard(p.dim() - 1))
        ).losses
        losses["bf16"] = run_parity(
            build_gpt, lambda m: shard_blocks_then_root(m, mesh=mesh, mp_policy=bf16), rtol=2e-2, atol=2e-2, param_atol=3e-2,
        ).losses
    return losses


@scenario
def narrow_gradients_are_summed_widened():
    """bf16 chunks travel as bf16 and are summed in fp32: equal to casting first, input untouched."""
    checked = 0
    for group in _groups():
        n = dist.get_world_size(group)
        for chunk in (3, 200_003):  # the second spans several widening blocks
            full = torch.randn(n * chunk, generator=torch.Generator().manual_seed(dist.get_rank() + chunk)).bfloat16()
            snapshot = full.clone()
            expected = torch.empty(chunk)
            dist.reduce_scatter_tensor(expected, full.float(), group=group)  # cast first, then sum in fp32
            reduced = torch.full((chunk,), float("nan"))
            scratch = [torch.empty(chunk, dtype=torch.bfloat16) for _ in range(reduce_scratch_chunks(Exchange.PAIRWISE, n))]
            collectives.reduce_scatter(Exchange.PAIRWISE, reduced, full, group, 14, scratch).wait()
            assert torch.equal(full, snapshot), "the bf16 input was written"
            if n == 2:  # two terms: the same sum whatever the order, bit for bit
                assert torch.equal(reduced, expected), chunk
            else:
                torch.testing.assert_close(reduced, expected, rtol=1e-6, atol=1e-6)
            checked += 1
    return checked


@scenario
def bf16_model_sends_bf16_gradients():
    """bf16 compute with fp32 reduction: every byte sent is bf16 (half the fp32 payload), the step still matches."""
    from fullshard.torch.accounting import reset_traffic, traffic_bytes

    mesh = mesh_1d()
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = shard_blocks_then_root(build_gpt(), mesh=mesh, mp_policy=bf16)
    sent_dtypes, original = set(), dist.isend

    def recording(tensor, *args, **kwargs):
        sent_dtypes.add(tensor.dtype)
        return original(tensor, *args, **kwargs)

    world = dist.get_world_size()
    reset_traffic()
    dist.isend = recording
    try:
        gpt_loss(model, tuple(t.chunk(world)[dist.get_rank()] for t in gpt_batch(0, 2 * world))).backward()
    finally:
        dist.isend = original
    num_params = sum(p.numel() for p in model.parameters())
    # every rank's chunk of a reduction pass carries its presence counts (plan.group.plan_presence), bf16 too
    presence = world * sum(m._fullshard_unit.group.plan.presence_numel for m in model.modules()
                           if hasattr(m, "_fullshard_unit"))
    assert sent_dtypes == {torch.bfloat16}, sent_dtypes
    assert traffic_bytes()["reduce_scatter"] == 2 * (num_params + presence), (traffic_bytes(), num_params)
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    return sorted(str(d) for d in sent_dtypes)


EXTRA = [narrow_gradients_are_summed_widened, bf16_model_sends_bf16_gradients]


class _Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x, which):
        outputs = {"a": self.a(x), "b": self.b(x)}
        return sum(outputs[name] for name in which)


@scenario
def accumulation_with_rank_dependent_branches():
    """bf16 + fp32 reduce, a no_sync micro-batch whose gradients reach different parameters on different ranks.

    One unit (every rank runs its forward and backward, as FSDP requires), each
    parameter in its own bucket. After the synced micro-batch a parameter holds
    an fp32 accumulator on the rank whose loss used it before, a bf16 gradient
    on the other: both ranks must still send the same dtype.
    """
    from fullshard import fully_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = _Branches()
    reference = copy.deepcopy(model).to(torch.bfloat16)
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    saved = group_module.DEFAULT_FUSE_BELOW_NUMEL
    group_module.DEFAULT_FUSE_BELOW_NUMEL = 0  # each parameter in a bucket of its own
    try:
        fully_shard(model, mesh=mesh_1d(), mp_policy=bf16)
    finally:
        group_module.DEFAULT_FUSE_BELOW_NUMEL = saved

    def inputs(r):
        gen = torch.Generator().manual_seed(r)
        return [torch.randn(4, 8, generator=gen) for _ in range(2)]

    plan = {r: [("a",) if r % 2 == 0 else ("b",), ("a", "b")] for r in range(world)}
    with model.no_sync():
        model(inputs(rank)[0], plan[rank][0]).sum().backward()
    model(inputs(rank)[1], plan[rank][1]).sum().backward()
    # reference: every rank's micro-batches in bf16, gradients summed in fp32, averaged over ranks
    expected = {name: torch.zeros_like(p, dtype=torch.float32) for name, p in reference.named_parameters()}
    for r in range(world):
        for x, which in zip(inputs(r), plan[r]):
            reference.zero_grad()
            reference(x.bfloat16(), which).sum().backward()
            for name, p in reference.named_parameters():
                if p.grad is not None:  # the branch this micro-batch's loss skipped has none
                    expected[name] += p.grad.float() / world
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad.full_tensor(), expected[name], rtol=1e-2, atol=1e-2, msg=name)
    return True


EXTRA.append(accumulation_with_rank_dependent_branches)
