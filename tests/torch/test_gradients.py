"""The gradient matrix (torch): what every consumer of a gradient sees equals the reference's, step by step.

Every case below runs for every strategy (``no_shard``, ``optim``, ``optim_grads``,
``optim_grads_params``), with fusion on (the default threshold) and off, on a flat 2-rank mesh
and on a 2x2 HSDP mesh of 4 ranks (:func:`matrix`; all of one world size in one launch). In each step the sharded
model trains on this rank's slice of the global batch and a single-process copy on the whole of it;
after the step's backward every sharded gradient (``p.grad``, what the optimizer and clipping read,
and what a post-accumulate-grad hook sees) must be this rank's chunk of the reference's gradient,
``None`` exactly where the reference's is. After the last step the full parameters must match.

Each backward that syncs also counts the reduction collectives this rank issued
(``fullshard.core.buffers``'s call counter: reduce-scatters, all-reduces of ``no_shard``
and HSDP's replica all-reduces) and checks that (a) the count is what the plan says (one
reduction per bucket with trainable parameters of every unit the step used, per kind,
read from the groups' plans) and (b) every rank issued the same collectives, in the
same order (the sequence of reductions, recorded by wrapping
``fullshard.torch.collectives``).

The cases:

1. ``optimizer``: a plain step (control).
2. ``penalty_shard``: an L2 penalty on a layer's sharded parameter, written as an FSDP2 user does:
   the parameter object held since ``fully_shard`` (what the optimizer holds) is a DTensor shard;
   added to the plain loss it makes the loss a DTensor whose backward fails ("got mixed
   torch.Tensor and DTensor"), so the penalty reads ``p.to_local()``: each
   rank penalizes its own shard, autograd accumulates ``2 * lambda * shard`` straight into the
   sharded parameter's ``.grad``, and fullshard's reduced data gradient is added to it. (The
   module attribute cannot be used for this: after a forward that does not reshard, ZeRO-1/2
   or the root, it shows the unsharded parameter instead.) The loss value holds only this
   rank's share of the penalty; the gradients are the reference's.
   ``penalty_root``: a penalty on the ROOT's parameter read from the module after the forward. The
   root does not reshard after forward, so the module shows its unsharded (plain) parameter: a
   use of it outside its unit's forward, whose gradient joins the forward's before the reduction.
3. ``hooks``: ``register_post_accumulate_grad_hook`` on sharded parameters, one observing (it sees
   the reduced gradient, once per step) and one replacing it (``p.grad = p.grad * 0.5``, the
   reference does the same). ``Tensor.register_hook`` on a sharded parameter never fires: the
   modules compute with the unsharded parameter, so no gradient is ever computed *for* the
   DTensor shard (FSDP2 behaves the same, docs/fsdp2-compatibility.md); the reference has no such
   hook, and the gradients still match.
4. ``requires_grad``: one parameter frozen after ``fully_shard`` (from step 1 on), one frozen
   before it and unfrozen at step 2; the reference does the same. Buckets only join parameters
   of one trainability, so the plans change with them (and so do the counts).
5. ``subset``: torch's equivalent of MindSpore's ``value_and_grad(fn, None, subset)``.
   ``torch.autograd.grad(loss, subset)`` cannot serve: the sharded parameters are not in the graph
   (modules compute with the unsharded ones; it raises "appears to not have been used in the graph",
   on FSDP2 too) and fullshard reduces what autograd accumulates into ``.grad``. So: the optimizer holds a
   subset of the parameters (not the embedding), and in step 1 the loss does not use one block at
   all (the same on every rank): that unit gets no gradient and issues no reduction.
6. An MoE layer (router + 3 experts, top-1 routing by token id, dispatched with index selection and
   ``index_add_`` as Hugging Face's Mixtral does) where expert 2 gets no token on rank 1 and tokens
   on the others:
   ``moe_in_unit``: the experts belong to the layer's unit; the idle expert is called with an
   empty batch, so autograd gives it a zero gradient and every rank reduces the same buckets.
   ``moe_skip_in_unit``: the same but the loop skips an expert without tokens (Mixtral's newer
   loop), so rank 1 has *no* gradient for expert 2; with ``set_reduce_scatter_unused_params(True)``
   on the layer a missing gradient counts as zero and every rank reduces the same buckets.
   ``moe_skip_in_unit_no_flag``: the same loop without the setting: every rank reduces every bucket of
   the unit whichever gradients it holds (a zero stands in for the missing one), fused or not, and
   rank 1 installs the reduced gradient like the others (the presence counts say some rank had one).
   ``moe_expert_units``: each expert its own ``fully_shard`` unit with
   ``set_reduce_scatter_unused_params(True)`` (FSDP2's API for this), the idle expert called with
   an empty batch (autograd runs an expert's backward on an empty batch too, so under ZeRO-3
   every rank gathers it again in backward). Skipping the call cannot work here for any FSDP: a unit's parameters are
   gathered by its forward, a collective only the ranks that call it would issue (ZeRO-3), and
   its reduction, whatever the strategy, is a collective too; a rank that never ran the unit has
   nothing telling it to join either.
   ``moe_solo_in_unit`` and ``moe_solo_expert_unit``: experts of one weight large enough to be reduced alone
   (a single-member bucket, even fused), the skipping loop, no setting, AdamW with weight decay: expert 2
   is idle on rank 1 and a spare expert on every rank (no gradient anywhere: it keeps none, and AdamW
   leaves it alone). Every rank reduces every expert's bucket; the single buckets' presence counts travel
   in the group's first fused bucket (the router's, in the MoE unit), or, in a unit of experts only, in a
   small reduction of their own (counted in the plan's reductions). ``solo_gradient_borrowed_when_present``
   checks that a present lone gradient is still the collective's buffer itself (zero copy).
``unused_parameter``: a layer no forward calls sits in a fused bucket with used ones: no rank has a gradient for
   it, and it gets none (the bucket's presence counts say so), where the reference has none either.
7. ``accumulation``: two micro-batches, ``set_requires_gradient_sync(False)`` on the first: no
   reduction and no sharded gradient after it, the whole gradient after the second.

Fusion is internal on torch (parameters whose chunk is below ``DEFAULT_FUSE_BELOW_NUMEL`` share a
collective) and has no public switch (``GroupPlan`` takes a threshold, nothing public passes one), so
"off" is a test-only patch, as in tests/torch/test_parity.py: the threshold ``fullshard/torch/group.py``
reads is 0 for the whole scenario (plans are made again when trainability changes). Every scenario
asserts from the plans and the reductions issued that buckets really were fused, or not.

HSDP and ``no_shard``: ``fully_shard`` refuses ``strategy="no_shard"`` on a 2-D mesh (it would
replicate over the whole mesh: HSDP without a shard dim is DDP), so the 4-rank launch checks that
refusal and runs the ``no_shard`` column on the flat 4-rank mesh instead.
"""
from __future__ import annotations

import contextlib
import copy
import functools
import itertools
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

import fullshard.torch.collectives as collectives
import fullshard.torch.group as group_module
from fullshard import fully_shard
from fullshard.core import buffers as traffic  # the traffic meter
from fullshard.core.unit import distinct_units
from fullshard.plan.group import Strategy
from tests.conftest import Launch, scenario, scenarios

LAUNCH = Launch(world_sizes=(2, 4))

STRATEGIES = [s.value for s in Strategy]
STEPS = 3
WIDTH, VOCAB, EXPERTS, SEQ = 8, 12, 3, 3
IDLE_EXPERT, IDLE_RANK = 2, 1
PENALTY = 0.05
RTOL, ATOL = 1e-5, 1e-6


# ---------------------------------------------------------------------------------------------- models
class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.lin(x))


class Net(nn.Module):
    """embed -> 3 blocks -> head; ``skip``: blocks the forward leaves out (a unit unused in a step)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor, skip: tuple[int, ...] = ()) -> torch.Tensor:
        x = self.embed(tokens)
        for index, layer in enumerate(self.layers):
            if index not in skip:
                x = layer(x)
        return self.head(x)


class NetWithUnused(Net):
    """A block holds a layer its forward never calls (a head kept for later, a disabled branch): no rank has a
    gradient for it, so it gets none, as in the reference, and an optimizer with weight decay leaves it alone."""

    def __init__(self) -> None:
        super().__init__()
        self.layers[1].unused = nn.Linear(WIDTH, WIDTH)


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x))


class MoE(nn.Module):
    """Top-1 routing by token id (``token % EXPERTS``), so the test decides which expert is idle; the routing
    weight comes from the router, which so gets a gradient. Dispatch as Mixtral's: ``torch.where`` on the
    expert mask, index selection, ``index_add_``."""

    def __init__(self, skip_idle: bool) -> None:
        super().__init__()
        self.skip_idle = skip_idle
        self.router = nn.Linear(WIDTH, EXPERTS)
        self.experts = nn.ModuleList(Expert() for _ in range(EXPERTS))

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        hidden = x.reshape(-1, WIDTH)
        choice = (tokens % EXPERTS).reshape(-1)
        weights = F.softmax(self.router(hidden), dim=-1).gather(1, choice[:, None])
        out = torch.zeros_like(hidden)
        mask = F.one_hot(choice, EXPERTS).T  # (experts, tokens)
        for index, expert in enumerate(self.experts):
            (rows,) = torch.where(mask[index])
            if self.skip_idle and rows.numel() == 0:
                continue
            out.index_add_(0, rows, expert(hidden[rows]) * weights[rows])
        return x + out.view_as(x)


class MoENet(nn.Module):
    def __init__(self, skip_idle: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.moe = MoE(skip_idle)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.moe(self.embed(tokens), tokens))


# Rows of an expert weight whose chunk on 2 ranks is reduced alone (a single-member bucket), fused or not.
BIG = 2 * group_module.DEFAULT_FUSE_BELOW_NUMEL // WIDTH


class BigExpert(nn.Module):
    """An expert of one weight large enough to be reduced alone."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, BIG, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.up(x)).view(-1, BIG // WIDTH, WIDTH).mean(1)


class BigExperts(nn.Module):
    """The experts and Mixtral's dispatch loop, which skips an expert without tokens; ``spare``: an expert no
    token is routed to, on any rank (no gradient anywhere: none, and AdamW's weight decay leaves it alone)."""

    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(BigExpert() for _ in range(EXPERTS))
        self.spare = BigExpert()

    def forward(self, hidden: torch.Tensor, choice: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(hidden)
        mask = F.one_hot(choice, EXPERTS).T  # (experts, tokens)
        for index, expert in enumerate(self.experts):
            (rows,) = torch.where(mask[index])
            if rows.numel() == 0:
                continue
            out.index_add_(0, rows, expert(hidden[rows]) * weights[rows])
        return out


class BigMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(WIDTH, EXPERTS)
        self.experts = BigExperts()

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        hidden = x.reshape(-1, WIDTH)
        choice = (tokens % EXPERTS).reshape(-1)
        weights = F.softmax(self.router(hidden), dim=-1).gather(1, choice[:, None])
        return x + self.experts(hidden, choice, weights).view_as(x)


class BigMoENet(MoENet):
    """MoENet with experts whose weights are each reduced alone: expert 2 idle on rank 1, the spare everywhere."""

    def __init__(self) -> None:
        super().__init__()
        self.moe = BigMoE()


# ---------------------------------------------------------------------------------------------- data
def global_batch(step: int, world: int, rows_per_rank: int = 2, idle_expert: bool = False):
    """Tokens and targets of the global batch: rank ``r``'s slice is rows ``[r * rows_per_rank, ...)``.
    ``idle_expert``: rank IDLE_RANK's tokens never route to IDLE_EXPERT; every other rank's do."""
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (world * rows_per_rank, SEQ), generator=gen)
    targets = torch.randint(0, VOCAB, (world * rows_per_rank, SEQ), generator=gen)
    if idle_expert:
        for rank in range(world):
            part = tokens[rank * rows_per_rank:(rank + 1) * rows_per_rank]  # a view: written in place
            part.view(-1)[:EXPERTS] = torch.arange(EXPERTS)  # a token for every expert
            if rank == IDLE_RANK:
                part[part % EXPERTS == IDLE_EXPERT] -= 1  # ... but the idle one
            wanted = set(range(EXPERTS)) - ({IDLE_EXPERT} if rank == IDLE_RANK else set())
            assert set((part % EXPERTS).flatten().tolist()) == wanted, (rank, part)
    return tokens, targets


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))


# ---------------------------------------------------------------------------------------------- cases
@dataclass
class Case:
    """One row of the matrix. ``params`` in the callbacks: the model's parameters by name as ``fully_shard``
    left them (the sharded ones, for the sharded model); ``sharded``: which of the two models it is."""

    build: Callable[[], nn.Module] = Net
    # before fully_shard, on the model and its reference alike
    prepare: Callable[[nn.Module], None] = lambda model: None
    # fully_shard calls: (model, **kwargs of fully_shard)
    wrap: Callable[..., None] = None
    # the step's loss on (model, params, tokens, targets, step, sharded)
    loss: Callable[..., torch.Tensor] = None
    # anything to set up once on (model, params, sharded); returns state for check()
    setup: Callable[..., Any] = lambda model, params, sharded: None
    # changes before step ``step`` on (model, params, step), the same for both models
    before_step: Callable[..., None] = lambda model, params, step: None
    # the parameter names the optimizer holds
    optimized: Callable[[list[str]], list[str]] = lambda names: names
    # modules whose unit the step leaves out (on every rank): (model, step) -> modules
    unused: Callable[..., list] = lambda model, step: []
    # after the step's backward: (sharded state, reference state, step, sharded params)
    check: Callable[..., None] = lambda state, ref_state, step, params: None
    micro_batches: int = 1
    idle_expert: bool = False
    fused_only: bool = False  # unfused, it would be a reduction only some ranks issue (a timeout)
    # AdamW with weight decay (it would move a parameter given a zero gradient where the reference has none)
    adamw: bool = False


def wrap_blocks_then_root(model: nn.Module, **kwargs) -> None:
    for layer in model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)


def plain_loss(model, params, tokens, targets, step, sharded):
    return cross_entropy(model(tokens), targets)


# 2a: a penalty on a layer's sharded parameter, through the parameter object held since fully_shard.
PENALIZED = "layers.0.lin.weight"


def shard_penalty_loss(model, params, tokens, targets, step, sharded):
    weight = params[PENALIZED]
    # The sharded parameter is a DTensor, whose penalty added to the plain loss would make the loss a DTensor
    # that cannot go backward through the plain forward; so (as with FSDP2) the penalty reads the local shard: each rank penalizes its own part, whose gradient is exactly its
    # chunk of the reference's 2 * lambda * W.
    local = weight.to_local() if sharded else weight
    return cross_entropy(model(tokens), targets) + PENALTY * local.pow(2).sum()


# 2b: a penalty on the root's parameter, read from the module after the forward.
def root_penalty_loss(model, params, tokens, targets, step, sharded):
    logits = model(tokens)
    head = model.head.weight  # after the forward: the root did not reshard, so this is the unsharded parameter
    assert not isinstance(head, DTensor), type(head)
    return cross_entropy(logits, targets) + PENALTY * head.pow(2).sum()


# 3: hooks on sharded parameters.
OBSERVED, HALVED, HOOKED = "layers.0.lin.weight", "layers.1.lin.weight", "layers.1.lin.bias"


def hook_setup(model, params, sharded):
    state = {"seen": [], "tensor_hook_calls": 0}

    def observe(param):
        grad = param.grad.to_local() if sharded else param.grad
        state["seen"].append(grad.detach().clone())

    def halve(param):
        param.grad = param.grad * 0.5

    params[OBSERVED].register_post_accumulate_grad_hook(observe)
    params[HALVED].register_post_accumulate_grad_hook(halve)
    if sharded:
        def tensor_hook(grad):
            state["tensor_hook_calls"] += 1
            return grad * 0.5

        params[HOOKED].register_hook(tensor_hook)
    return state


def hook_check(state, ref_state, step, params):
    """The observing hook fired once per step and saw this rank's chunk of the reference's gradient."""
    assert len(state["seen"]) == len(ref_state["seen"]) == step + 1, (len(state["seen"]), step)
    torch.testing.assert_close(state["seen"][-1], local_chunk(ref_state["seen"][-1], params[OBSERVED].grad),
                               rtol=RTOL, atol=ATOL)
    assert state["tensor_hook_calls"] == 0, "Tensor.register_hook on a sharded parameter fired"


# 4: requires_grad changed after fully_shard.
FROZEN_LATER, UNFROZEN_LATER = "layers.0.lin.weight", "layers.1.lin.bias"


def freeze_at_wrap(model):
    model.get_parameter(UNFROZEN_LATER).requires_grad_(False)


def change_trainability(model, params, step):
    if step == 1:
        params[FROZEN_LATER].requires_grad_(False)
    if step == 2:
        params[UNFROZEN_LATER].requires_grad_(True)


# 5: a subset in the optimizer, a unit unused in step 1 on every rank.
SKIPPED_STEP, SKIPPED_LAYER = 1, 1


def subset_loss(model, params, tokens, targets, step, sharded):
    skip = (SKIPPED_LAYER,) if step == SKIPPED_STEP else ()
    return cross_entropy(model(tokens, skip=skip), targets)


def subset_unused(model, step):
    return [model.layers[SKIPPED_LAYER]] if step == SKIPPED_STEP else []


# 6: MoE.
def wrap_moe_unit(model, unused_params: bool = False, **kwargs):
    fully_shard(model.moe, **kwargs)
    if unused_params:
        model.moe.set_reduce_scatter_unused_params(True)
    fully_shard(model, **kwargs)


def wrap_expert_units(model, **kwargs):
    for expert in model.moe.experts:
        fully_shard(expert, **kwargs)
        expert.set_reduce_scatter_unused_params(True)
    fully_shard(model.moe, **kwargs)
    fully_shard(model, **kwargs)


def wrap_big_moe_unit(model, **kwargs):
    """The experts' weights share the MoE unit's group with the router's (a fused bucket carries their counts)."""
    fully_shard(model.moe, **kwargs)
    fully_shard(model, **kwargs)


def wrap_big_experts_unit(model, **kwargs):
    """The experts' unit holds only weights reduced alone: their counts travel in a reduction of their own."""
    fully_shard(model.moe.experts, **kwargs)
    fully_shard(model.moe, **kwargs)
    fully_shard(model, **kwargs)


CASES: dict[str, Case] = {
    "optimizer": Case(wrap=wrap_blocks_then_root, loss=plain_loss),
    "penalty_shard": Case(wrap=wrap_blocks_then_root, loss=shard_penalty_loss),
    "penalty_root": Case(wrap=wrap_blocks_then_root, loss=root_penalty_loss),
    "hooks": Case(wrap=wrap_blocks_then_root, loss=plain_loss, setup=hook_setup, check=hook_check),
    "requires_grad": Case(wrap=wrap_blocks_then_root, loss=plain_loss, prepare=freeze_at_wrap,
                          before_step=change_trainability),
    "subset": Case(wrap=wrap_blocks_then_root, loss=subset_loss, unused=subset_unused,
                   optimized=lambda names: [n for n in names if not n.startswith("embed.")]),
    "unused_parameter": Case(build=NetWithUnused, wrap=wrap_blocks_then_root, loss=plain_loss),
    "moe_in_unit": Case(build=MoENet, wrap=wrap_moe_unit, loss=plain_loss, idle_expert=True),
    "moe_skip_in_unit": Case(build=functools.partial(MoENet, skip_idle=True),
                             wrap=functools.partial(wrap_moe_unit, unused_params=True), loss=plain_loss,
                             idle_expert=True),
    "moe_skip_in_unit_no_flag": Case(build=functools.partial(MoENet, skip_idle=True), wrap=wrap_moe_unit,
                                     loss=plain_loss, idle_expert=True),
    "moe_expert_units": Case(build=MoENet, wrap=wrap_expert_units, loss=plain_loss, idle_expert=True),
    # 6b. Experts reduced alone (single-member buckets), Mixtral's skipping loop, no setting: expert 2 idle on
    # rank 1, the spare on every rank. Every rank reduces every bucket (zeros where it lacks the gradient).
    "moe_solo_in_unit": Case(build=BigMoENet, wrap=wrap_big_moe_unit, loss=plain_loss, idle_expert=True,
                             adamw=True),
    "moe_solo_expert_unit": Case(build=BigMoENet, wrap=wrap_big_experts_unit, loss=plain_loss, idle_expert=True,
                                 adamw=True),
    "accumulation": Case(wrap=wrap_blocks_then_root, loss=plain_loss, micro_batches=2),
}


# ---------------------------------------------------------------------------------------------- checks
def local_chunk(full: torch.Tensor, like: DTensor) -> torch.Tensor:
    """This rank's part of ``full`` as ``like`` (a sharded gradient) is placed on its mesh."""
    shape, offset = compute_local_shape_and_global_offset(full.shape, like.device_mesh, like.placements)
    return full[tuple(slice(o, o + s) for o, s in zip(offset, shape))]


def assert_grads_match(params: dict, ref_params: dict, step: int) -> None:
    for name, param in params.items():
        expected = ref_params[name].grad
        if expected is None:
            assert param.grad is None, f"step {step}: {name} has a gradient, the reference none"
            continue
        assert param.grad is not None, f"step {step}: {name} has no gradient, the reference has one"
        assert isinstance(param.grad, DTensor) and param.grad.placements == param.placements, (name, param.grad)
        torch.testing.assert_close(param.grad.to_local(), local_chunk(expected, param.grad), rtol=RTOL, atol=ATOL,
                                   msg=lambda m: f"step {step}: gradient of {name} differs\n{m}")


def assert_nothing_reduced(params: dict) -> None:
    """After a backward without sync: no reduction, and no sharded gradient for the optimizer yet."""
    assert reductions_issued() == {"reduce_scatter": 0, "all_reduce": 0}, reductions_issued()
    assert all(p.grad is None for p in params.values()), "a sharded gradient before the synced backward"


def groups_of(model: nn.Module) -> list:
    return [group for unit in distinct_units(model.modules()) for group in unit.groups]


def assert_fusion(model: nn.Module, fused: bool) -> int:
    """Fusion on: some bucket holds several parameters; off: none does. Returns the number of buckets."""
    buckets = [b for group in groups_of(model) for b in group.plan.buckets]
    shared = [b for b in buckets if len(b.members) > 1]
    assert bool(shared) == fused, f"fusion {'on' if fused else 'off'}: buckets of sizes {[len(b.members) for b in buckets]}"
    return len(buckets)


def planned_reductions(model: nn.Module, unused: list) -> tuple[dict[str, int], int, int]:
    """Reductions one synced backward issues, by kind, from the plans: each bucket with trainable parameters
    of every unit the step used (ZeRO-1: of every unit, at the end of backward), whichever gradients a rank
    holds, and the group's reduction of its single buckets' presence counts where no fused bucket carries
    them, reduce-scattered (all-reduced for no_shard), then all-reduced across HSDP replicas. Also those
    buckets and their trainable parameters, counted (not the counts-only reductions)."""
    skipped = {id(unit) for unit in distinct_units(unused) if not unit.reduces_at_end_of_backward}
    planned = {"reduce_scatter": 0, "all_reduce": 0}
    buckets = params = 0
    for unit in distinct_units(model.modules()):
        if id(unit) in skipped:
            continue
        for group in unit.groups:
            trainable = [b for b in group.plan.buckets if group.params[b.members[0]].requires_grad]
            buckets += len(trainable)
            params += sum(len(b.members) for b in trainable)
            reductions = len(trainable) + (group.plan.counts_only is not None)
            if group.replicated:
                planned["all_reduce"] += reductions
            else:
                planned["reduce_scatter"] += reductions
                if group.replicas > 1:
                    planned["all_reduce"] += reductions
    return planned, buckets, params


@contextlib.contextmanager
def recording_reductions():
    """Record the sequence of reductions this rank issues, wrapping the entry points of
    ``fullshard.torch.collectives`` (the replica all-reduce is counted by the traffic meter only)."""
    sequence: list = []
    saved = collectives.reduce_scatter, collectives.all_reduce_sum

    def reduce_scatter(exchange, output, input, group, tag, *args, **kwargs):
        sequence.append(("reduce_scatter", input.numel(), tag))
        return saved[0](exchange, output, input, group, tag, *args, **kwargs)

    def all_reduce_sum(exchange, buffer, group):
        sequence.append(("all_reduce", buffer.numel()))
        return saved[1](exchange, buffer, group)

    collectives.reduce_scatter, collectives.all_reduce_sum = reduce_scatter, all_reduce_sum
    try:
        yield sequence
    finally:
        collectives.reduce_scatter, collectives.all_reduce_sum = saved


@contextlib.contextmanager
def fusion(on: bool):
    """Fusion on torch has no public switch: the threshold fullshard.torch.group reads is patched (test-only, as
    tests/torch/test_parity.py does) for the whole scenario, since plans are made again when trainability changes."""
    saved = group_module.DEFAULT_FUSE_BELOW_NUMEL
    group_module.DEFAULT_FUSE_BELOW_NUMEL = saved if on else 0
    try:
        yield
    finally:
        group_module.DEFAULT_FUSE_BELOW_NUMEL = saved


def reductions_issued() -> dict[str, int]:
    calls = traffic.collective_calls()
    return {"reduce_scatter": calls["reduce_scatter"], "all_reduce": calls["all_reduce"]}


def same_on_every_rank(value: Any, what: str) -> None:
    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    assert all(v == values[0] for v in values), f"{what} differ between ranks: {values}"


def on_every_rank(check: Callable[[], None]) -> None:
    """Run ``check`` here and fail on every rank if it failed on any: a rank that left the scenario alone
    would leave the others waiting in their next collective, and the scenarios after it out of step."""
    try:
        check()
        error = None
    except AssertionError as failure:
        error = f"rank {dist.get_rank()}: {failure}"
    errors = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    failed = [e for e in errors if e is not None]
    assert not failed, "\n".join(failed)


# ---------------------------------------------------------------------------------------------- the run
_MESHES: dict = {}


def mesh_of(kind: str):
    """Meshes are made once per process (each init_device_mesh of a 2-D mesh makes new groups)."""
    if kind not in _MESHES:
        world = dist.get_world_size()
        _MESHES[kind] = (init_device_mesh("cpu", (world,)) if kind == "flat" else
                         init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")))
    return _MESHES[kind]


def run_case(case: Case, strategy: str, fused: bool, mesh_kind: str) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    with fusion(fused):
        torch.manual_seed(0)
        ref = case.build()
        case.prepare(ref)
        model = copy.deepcopy(ref)
        case.wrap(model, mesh=mesh_of(mesh_kind), strategy=strategy)
        buckets = assert_fusion(model, fused)
        params, ref_params = dict(model.named_parameters()), dict(ref.named_parameters())
        assert params.keys() == ref_params.keys()
        state, ref_state = case.setup(model, params, True), case.setup(ref, ref_params, False)
        make = (functools.partial(torch.optim.AdamW, lr=0.01, weight_decay=0.1) if case.adamw else
                functools.partial(torch.optim.SGD, lr=0.1, momentum=0.9))
        optimizer = make([params[n] for n in case.optimized(list(params))])
        ref_optimizer = make([ref_params[n] for n in case.optimized(list(ref_params))])
        counts = []
        for step in range(STEPS):
            case.before_step(model, params, step)
            case.before_step(ref, ref_params, step)
            tokens, targets = global_batch(step, world, rows_per_rank=2, idle_expert=case.idle_expert)
            case.loss(ref, ref_params, tokens, targets, step, False).backward()
            local = [t.chunk(world)[rank] for t in (tokens, targets)]
            micro = list(zip(*(t.chunk(case.micro_batches) for t in local)))
            with recording_reductions() as sequence:
                for index, (micro_tokens, micro_targets) in enumerate(micro):
                    last = index == len(micro) - 1
                    if case.micro_batches > 1:
                        model.set_requires_gradient_sync(last)
                    traffic.reset_traffic()
                    loss = case.loss(model, params, micro_tokens, micro_targets, step, True) / len(micro)
                    loss.backward()
                    if not last:
                        on_every_rank(functools.partial(assert_nothing_reduced, params))
                issued = reductions_issued()
            planned, reduced_buckets, reduced_params = planned_reductions(model, case.unused(model, step))

            def step_checks():
                assert issued == planned, f"step {step}: issued {issued}, the plan says {planned}"
                # fusion on: fewer reductions than the parameters they carry; off: one each
                assert (reduced_buckets < reduced_params) if fused else (reduced_buckets == reduced_params), \
                    (fused, reduced_buckets, reduced_params)
                assert_grads_match(params, ref_params, step)
                case.check(state, ref_state, step, params)

            on_every_rank(step_checks)
            same_on_every_rank((issued, sequence), f"step {step}: reductions")
            counts.append(sum(issued.values()))
            for opt, named in ((optimizer, params), (ref_optimizer, ref_params)):
                opt.step()
                for p in named.values():
                    p.grad = None
        full = {name: param.full_tensor() for name, param in params.items()}  # collectives: on every rank

        def final_checks():
            for name, tensor in full.items():
                torch.testing.assert_close(tensor, ref_params[name].detach(), rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"final {name} differs\n{m}")

        on_every_rank(final_checks)
    return {"reductions_per_step": counts, "buckets": buckets}


@scenario(world_sizes=(4,))
def no_shard_refused_on_hsdp_mesh():
    """no_shard replicates over the whole mesh; on a 2-D mesh fully_shard refuses it before changing anything."""
    model = Net()
    try:
        fully_shard(model, mesh=mesh_of("hsdp"), strategy="no_shard")
    except ValueError as error:
        assert "1-D mesh" in str(error), error
        return True
    raise AssertionError("no_shard on a 2-D mesh was accepted")


@scenario(world_sizes=(2,))
def solo_gradient_borrowed_when_present():
    """The experts' weights reduced alone: where this rank holds the gradient, the gradient itself is the
    reduce-scatter's input (borrowed, no copy); where it lacks it (expert 2 on rank 1, the spare everywhere),
    an owned buffer of zeros is; nothing else is packed for them."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = BigMoENet()
    wrap_big_moe_unit(model, mesh=mesh_of("flat"), strategy="optim_grads")
    seen = {"borrowed": [], "allocated": []}
    borrow, allocate = collectives.borrow, collectives.allocate

    def borrow_and_record(tensor, what):
        seen["borrowed"].append(what)
        return borrow(tensor, what)

    def allocate_and_record(shape, dtype, device, what, *args, **kwargs):
        seen["allocated"].append(what)
        return allocate(shape, dtype, device, what, *args, **kwargs)

    tokens, targets = (t.chunk(world)[rank] for t in global_batch(0, world, idle_expert=True))
    collectives.borrow, collectives.allocate = borrow_and_record, allocate_and_record
    try:
        cross_entropy(model(tokens), targets).backward()
    finally:
        collectives.borrow, collectives.allocate = borrow, allocate
    experts = [f"moe.experts.experts.{i}.up.weight" for i in range(EXPERTS)] + ["moe.experts.spare.up.weight"]
    lacking = {"moe.experts.spare.up.weight"} | ({experts[IDLE_EXPERT]} if rank == IDLE_RANK else set())

    def check():
        for name in experts:
            borrowed = [w for w in seen["borrowed"] if w == f"gradient of [{name}] of module 'moe'"]
            packed = [w for w in seen["allocated"] if w == f"reduce-scatter input of [{name}] of module 'moe'"]
            assert (len(borrowed), len(packed)) == ((0, 1) if name in lacking else (1, 0)), (name, seen)

    on_every_rank(check)
    return {"borrowed": len(seen["borrowed"])}


def _matrix(mesh_kind: str) -> dict[str, Callable[[], Any]]:
    found = {}
    for (name, case), strategy, fused in itertools.product(CASES.items(), STRATEGIES, (True, False)):
        if case.fused_only and not fused:
            continue
        # no_shard cannot run on the HSDP mesh (refused, above): its column runs on the flat mesh of the world
        kind = "flat" if strategy == "no_shard" else mesh_kind
        label = f"{name}-{strategy}-{'fused' if fused else 'unfused'}" + ("-flat" if kind != mesh_kind else "")
        found[label] = functools.partial(run_case, case, strategy, fused, kind)
    return found


@scenarios
def matrix(world_size: int) -> dict[str, Callable[[], Any]]:
    """Every case x strategy x fusion: on a flat mesh of 2 ranks, and on a 2x2 (replicate, shard) mesh of 4
    (no_shard: flat, 4 ranks)."""
    return _matrix("flat" if world_size == 2 else "hsdp")


def test_fusion_changes_the_reduction_count(scenario_data):
    """The same case reduces once per parameter unfused, once per bucket fused: fewer collectives."""
    names = set(matrix(2))
    for name in names:
        if name.endswith("-fused") and name.replace("-fused", "-unfused") in names:
            fused = scenario_data(name, 2)[0]["reductions_per_step"]
            unfused = scenario_data(name.replace("-fused", "-unfused"), 2)[0]["reductions_per_step"]
            assert all(f < u for f, u in zip(fused, unfused)), (name, fused, unfused)
