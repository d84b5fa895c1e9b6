"""How client libraries drive FSDP2 (torchtitan, accelerate, Lightning, PyTorch's examples).

Each scenario follows one usage pattern that works with torch.distributed.fsdp
and checks fullshard against a single-process reference, on 2 gloo ranks.
"""
from __future__ import annotations

import copy
import dataclasses
import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import fsdp as torch_fsdp
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from fullshard import fully_shard, register_fsdp_forward_method
from fullshard.torch.policies import TORCH_PROMOTES_REDUCE_DTYPE
from fullshard.models.gpt import GPT, Block
from tests.conftest import Launch, scenario
from tests.torch.parity import (
    TINY_GPT, TorchLayersLM, build_gpt, gpt_batch, gpt_loss, mesh_1d, run_parity, shard_blocks_then_root,
)

LAUNCH = Launch(world_sizes=(2,))


def _wrapped_blocks(impl: CheckpointImpl) -> nn.Module:
    """torchtitan's and accelerate's order: checkpoint_wrapper each block, then fully_shard the wrappers."""
    model = build_gpt()
    for index, block in enumerate(model.layers):
        model.layers[index] = checkpoint_wrapper(block, checkpoint_impl=impl)
    return model


class MLPCheckpointedBlock(Block):
    """A block that checkpoints part of itself inside its own forward."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + checkpoint(self.mlp, self.ln2(x), use_reentrant=False)


def _inner_checkpointing() -> nn.Module:
    model = build_gpt()
    for index in range(len(model.layers)):
        inner = MLPCheckpointedBlock(TINY_GPT)
        inner.load_state_dict(model.layers[index].state_dict())
        model.layers[index] = inner
    return model


class OuterCheckpointGPT(GPT):
    """Checkpoints every sharded block from outside, while each block checkpoints its MLP inside."""

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.wte(tokens) + self.wpe(torch.arange(tokens.shape[1]))
        for layer in self.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return self.lm_head(self.ln_f(x))


def _nested_checkpointing() -> nn.Module:
    model = _inner_checkpointing()
    model.__class__ = OuterCheckpointGPT
    return model


@scenario
def activation_checkpointing_wrapped_before_sharding():
    """Recomputation runs through modules without fullshard's hooks: they must see unsharded parameters."""
    mesh = mesh_1d()
    wrap = functools.partial(shard_blocks_then_root, mesh=mesh)
    losses = {}
    for impl in (CheckpointImpl.NO_REENTRANT, CheckpointImpl.REENTRANT):
        losses[impl.name] = run_parity(functools.partial(_wrapped_blocks, impl), wrap).losses
    losses["inside_forward"] = run_parity(_inner_checkpointing, wrap).losses
    losses["outside_and_inside"] = run_parity(_nested_checkpointing, wrap).losses
    return losses


def _unshard_then_loss(model, batch):
    """PyTorch's FSDP2 example with explicit prefetching: unshard the root before each forward."""
    if hasattr(model, "unshard"):
        model.unshard()
        model.layers[0].unshard(async_op=True).wait()
    return gpt_loss(model, batch)


@scenario
def explicit_unshard_before_forward():
    mesh = mesh_1d()
    result = run_parity(build_gpt, functools.partial(shard_blocks_then_root, mesh=mesh), loss_fn=_unshard_then_loss)
    return result.losses


def _evaluate_then_loss(model, batch):
    """An inference_mode evaluation before every training forward (Lightning's validation loop)."""
    with torch.inference_mode():
        evaluated = gpt_loss(model, batch)
    loss = gpt_loss(model, batch)
    torch.testing.assert_close(evaluated, loss.detach())
    return loss


@scenario
def inference_mode_between_steps():
    mesh = mesh_1d()
    wrap = functools.partial(shard_blocks_then_root, mesh=mesh, reshard_after_forward=True)
    return run_parity(build_gpt, wrap, loss_fn=_evaluate_then_loss).losses


@scenario
def found_as_torch_fsdp_modules():
    """isinstance checks against torch's classes find fullshard's modules; every torch method is ours."""
    model = shard_blocks_then_root(build_gpt(), mesh=mesh_1d())
    assert isinstance(model, torch_fsdp.FSDPModule) and isinstance(model.layers[0], torch_fsdp.FSDPModule)
    assert [m for m in model.modules() if isinstance(m, torch_fsdp.FSDPModule)] == [model, *model.layers]
    handle = model.layers[0].unshard(async_op=True)
    assert isinstance(handle, torch_fsdp.UnshardHandle)
    handle.wait()
    model.layers[0].reshard()
    from fullshard import FSDPModule

    # Every method torch's class defines is fullshard's own (its versions need FSDP2 state): found on fullshard's
    # classes before torch's in the method resolution order.
    methods = [name for name, value in vars(torch_fsdp.FSDPModule).items() if callable(value) and name != "__new__"]
    assert "_apply" in methods and "unshard" in methods
    assert [name for name in methods if getattr(FSDPModule, name) is vars(torch_fsdp.FSDPModule)[name]] == []
    with pytest.raises(ValueError, match="allocate"):
        model.set_custom_all_gather(object())  # not a collective (tests/torch/test_fsdp2.py trains with real ones)
    with pytest.raises(NotImplementedError, match="set_separate_reduce_scatter_group"):
        model.set_separate_reduce_scatter_group(True)
    model.set_separate_reduce_scatter_group(False)  # off is what fullshard does anyway
    with pytest.warns(UserWarning, match="ignores it"):
        model.set_symm_mem_for_comm("NCCL")
    with pytest.warns(UserWarning, match="ignores it"):
        model.set_reduce_scatter_max_input_buffers(2, recurse=False)

    # torch's own register_fsdp_forward_method drives fullshard's state through _get_fsdp_state.
    class Projector(nn.Linear):
        def project(self, x: torch.Tensor) -> torch.Tensor:
            return x @ self.weight.t()

    torch.manual_seed(0)
    reference = Projector(4, 6)
    projector = fully_shard(copy.deepcopy(reference), mesh=mesh_1d())
    torch_fsdp.register_fsdp_forward_method(projector, "project")
    x = torch.randn(3, 4)
    torch.testing.assert_close(projector.project(x), reference.project(x))
    assert not isinstance(projector.weight, DTensor)  # a backward may follow: the root keeps them, as in FSDP2
    projector.reshard()
    assert isinstance(projector.weight, DTensor)
    with pytest.warns(FutureWarning, match="set_gradient_divide_factor"):
        model.set_reduce_scatter_divide_factor(2.0)
    # as in FSDP2: the module's own group only
    assert model._fullshard_unit.group.divide_factor == 2.0
    assert model.layers[0]._fullshard_unit.group.divide_factor is None
    model.set_force_sum_reduction_for_comms(True)

    # Slicing a sharded Sequential builds the original class, as in FSDP2.
    sequential = fully_shard(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)), mesh=mesh_1d())
    assert type(sequential[0:2]) is nn.Sequential
    return True


class BranchingBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.shared = nn.Linear(32, 32)
        self.expert = nn.Linear(32, 32)

    def forward(self, h, use_expert: bool):
        h = torch.tanh(self.shared(h))
        return h + self.expert(h) if use_expert else h


class TwoBranches(nn.Module):
    """A branch only some ranks take in a step (conditional computation, experts)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.block = BranchingBlock()
        self.head = nn.Linear(32, 64)

    def forward(self, tokens, use_expert: bool):
        return self.head(self.block(self.embed(tokens), use_expert))


def _uses_expert(rank: int) -> bool:
    return rank == 0


@scenario
def parameters_used_on_some_ranks_only():
    """set_reduce_scatter_unused_params: every rank reduces every bucket; gradients match the reference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = TwoBranches()
    model = copy.deepcopy(reference)
    fully_shard(model.block, mesh=mesh_1d())
    fully_shard(model, mesh=mesh_1d())
    model.set_reduce_scatter_unused_params(True)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    for step in range(3):
        tokens, targets = gpt_batch(step, 4 * world)
        slices = list(zip(tokens.chunk(world), targets.chunk(world)))
        loss = nn.functional.cross_entropy(
            model(slices[rank][0], _uses_expert(rank)).flatten(0, 1), slices[rank][1].flatten()
        )
        loss.backward()
        ref_loss = sum(
            nn.functional.cross_entropy(reference(t, _uses_expert(r)).flatten(0, 1), y.flatten())
            for r, (t, y) in enumerate(slices)
        ) / world
        ref_loss.backward()
        for (name, param), ref_param in zip(model.named_parameters(), reference.parameters()):
            assert param.grad is not None, name  # on every rank, even where the expert was unused
            torch.testing.assert_close(param.grad.full_tensor(), ref_param.grad, msg=name)
        optimizer.step(), ref_optimizer.step()
        optimizer.zero_grad(), ref_optimizer.zero_grad()
    return True


@scenario
def all_reduce_hook_sees_the_sum_before_division():
    torch.manual_seed(0)
    reference = build_gpt()
    model = shard_blocks_then_root(copy.deepcopy(reference), mesh=mesh_1d())
    calls = []

    def add_one(reduced: torch.Tensor) -> None:
        calls.append(reduced.numel())
        reduced.add_(1.0)  # before the division by the world size: every gradient grows by 1/world

    for unit in (model, *model.layers):
        unit.set_all_reduce_hook(add_one)
    world = dist.get_world_size()
    batch = gpt_batch(0, 4)
    local = tuple(t.chunk(world)[dist.get_rank()] for t in batch)
    gpt_loss(model, local).backward()
    gpt_loss(reference, batch).backward()
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad.full_tensor(), ref_param.grad + 1.0 / world, msg=name)
    assert len(calls) >= 3  # at least one bucket per unit
    return len(calls)


@scenario
def embedding_not_gathered_for_backward():
    """set_unshard_in_backward(False): the embedding's weight gradient needs only the indices."""
    mesh = mesh_1d()
    backward_gathers = []

    def wrap(model):
        fully_shard(model.embed, mesh=mesh)
        model.embed.set_unshard_in_backward(False)
        group = model.embed._fullshard_unit.group
        unshard = group.unshard

        def counting_unshard():
            if torch._C._current_graph_task_id() != -1:  # inside a backward pass
                backward_gathers.append(1)
            unshard()

        group.unshard = counting_unshard
        return shard_blocks_then_root(model, mesh=mesh)

    losses = run_parity(TorchLayersLM, wrap).losses
    assert backward_gathers == []
    return losses


class FailOnce:
    """Raises the first time it is called: a step that dies half-way (an OOM, a bad batch)."""

    def __init__(self) -> None:
        self.armed = True

    def __call__(self, *_args) -> None:
        if self.armed:
            self.armed = False
            raise RuntimeError("injected failure")


@scenario
def training_continues_after_a_failed_step():
    """reset_iter_state: after a forward or a backward raised, the next steps match the reference."""
    torch.manual_seed(0)
    reference = build_gpt(dataclasses.replace(TINY_GPT, n_layers=3))  # blocks 2 and 1 reduce before block 0 fails
    model = shard_blocks_then_root(copy.deepcopy(reference), mesh=mesh_1d())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(4):
        batch = gpt_batch(step, 4)
        local = tuple(t.chunk(world)[rank] for t in batch)
        if step in (1, 2):
            failure = FailOnce()
            if step == 1:  # in forward, inside the second block
                handle = model.layers[1].register_forward_pre_hook(failure)
                failing = lambda: gpt_loss(model, local)  # noqa: E731
            else:  # in backward, after the head and the later blocks reduced
                handle = model.layers[0].register_full_backward_pre_hook(failure)
                failing = lambda: gpt_loss(model, local).backward()  # noqa: E731
            with pytest.raises(RuntimeError, match="injected failure"):
                failing()
            handle.remove()
            model.reset_iter_state()
            assert all(isinstance(p, DTensor) for p in model.parameters())
            # as the installed FSDP2: 2.15 drops the reduced gradients too, 2.13/2.14 keep them (zero_grad does)
            kept = [p.grad is not None for p in model.parameters()]
            assert not any(kept) if TORCH_PROMOTES_REDUCE_DTYPE or step == 1 else any(kept), kept
            optimizer.zero_grad()
        gpt_loss(model, local).backward()
        gpt_loss(reference, batch).backward()
        optimizer.step(), ref_optimizer.step()
        optimizer.zero_grad(), ref_optimizer.zero_grad()
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.full_tensor(), ref_param, msg=name)
    return True


@scenario
def plain_module_calls_are_accepted_or_refused_clearly():
    plain = nn.Linear(4, 4)
    register_fsdp_forward_method(plain, "forward")  # a no-op, as in FSDP2: the same code runs unsharded
    sharded = fully_shard(nn.Linear(4, 4), mesh=mesh_1d())
    with pytest.raises(ValueError, match="has no method 'generate'"):
        register_fsdp_forward_method(sharded, "generate")
    with pytest.raises(TypeError, match="Deepcopy the model before fully_shard"):
        copy.deepcopy(sharded)
    with pytest.raises(ValueError, match="containers that do not implement forward"):
        fully_shard(nn.ModuleList([nn.Linear(4, 4)]), mesh=mesh_1d())

    class Event:  # CPU has no torch.Event; the root calls wait() on whatever it was given, once
        waits = 0

        def wait(self) -> None:
            self.waits += 1

    event = Event()
    sharded.set_post_optim_event(event)
    sharded(torch.randn(2, 4))
    sharded(torch.randn(2, 4))
    assert event.waits == 1 and sharded._fullshard_unit.root.post_optim_event is None
    return True


@scenario
def reset_forgets_hsdp_partial_sums():
    """HSDP: partial sums kept while the replica all-reduce is off do not survive reset_iter_state."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (dist.get_world_size(), 1), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    reference = build_gpt()
    model = shard_blocks_then_root(copy.deepcopy(reference), mesh=mesh)
    rank, world = dist.get_rank(), dist.get_world_size()
    first, second = gpt_batch(0, 4), gpt_batch(1, 4)
    model.set_requires_all_reduce(False)  # an accumulation cycle: partial sums wait in fullshard's buffers
    gpt_loss(model, tuple(t.chunk(world)[rank] for t in first)).backward()
    failure = FailOnce()
    handle = model.layers[0].register_forward_pre_hook(failure)
    with pytest.raises(RuntimeError, match="injected failure"):
        gpt_loss(model, tuple(t.chunk(world)[rank] for t in first))
    handle.remove()
    model.reset_iter_state()  # the cycle is abandoned, its partial sums with it
    model.set_requires_all_reduce(True)
    gpt_loss(model, tuple(t.chunk(world)[rank] for t in second)).backward()
    gpt_loss(reference, second).backward()
    for (name, param), ref_param in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad.full_tensor(), ref_param.grad, msg=name)
    return True


@scenario
def unused_params_reduce_only_after_grad_enabled_forwards():
    """An evaluation forward (no_grad) does not make a unit reduce zeros in the next backward."""
    torch.manual_seed(0)
    model = TwoBranches()
    fully_shard(model.block.expert, mesh=mesh_1d())
    fully_shard(model, mesh=mesh_1d())
    model.set_reduce_scatter_unused_params(True)
    tokens, targets = gpt_batch(0, 2)
    with torch.no_grad():
        model(tokens, True)  # evaluation through the expert on every rank
    loss = nn.functional.cross_entropy(model(tokens, False).flatten(0, 1), targets.flatten())
    loss.backward()  # no rank used the expert with grad enabled: like the reference, no gradient at all
    assert model.block.expert.weight.grad is None and model.block.expert.bias.grad is None
    assert model.block.shared.weight.grad is not None
    return True


@scenario
def pipeline_schedule_reduces_after_the_last_micro_batch():
    """torch.distributed.pipelining treats fullshard stages as FSDP2 ones: sync off per
    micro-batch, then its own reduction through the FSDP2 state (``fullshard.torch.api.StateView``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))  # one stage per rank
    torch.manual_seed(0)
    reference = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(4)])
    stage_module = copy.deepcopy(reference[2 * rank : 2 * rank + 2])
    reference_stage = reference[2 * rank : 2 * rank + 2]
    for block in stage_module:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(stage_module, mesh=mesh["dp"])
    stage = PipelineStage(stage_module, rank, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    mse = lambda out, target: ((out - target) ** 2).mean()  # noqa: E731
    schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=mse)
    inputs = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    targets = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    for _ in range(2):
        schedule.step(inputs) if rank == 0 else schedule.step(target=targets)
        (sum(mse(reference(x), y) for x, y in zip(inputs.chunk(2), targets.chunk(2))) / 2).backward()
        for (name, param), ref_param in zip(stage_module.named_parameters(), reference_stage.parameters()):
            torch.testing.assert_close(param.grad.full_tensor(), ref_param.grad, msg=name)
            assert isinstance(param, DTensor), name  # resharded after the reduction
        stage_module.zero_grad(), reference.zero_grad()
    return True


@scenario
def unfreezing_between_micro_batches_keeps_the_accumulated_gradients():
    """Accumulation without sync, then a parameter unfrozen before the synced micro-batch (fine-tuning that thaws a
    layer): fullshard plans the group afresh, and the gradients the first micro-batch accumulated must survive
    it; the reduced gradients and the step match one process doing the same."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    reference[2].bias.requires_grad_(False)
    model = copy.deepcopy(reference)
    mesh = mesh_1d()
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(7)
    batches = [torch.randn(4 * world, 8, generator=gen) for _ in range(2)]
    for micro, x in enumerate(batches):
        last = micro == len(batches) - 1
        if last:  # thawed before the synced micro-batch, on the model and on the reference alike
            reference[2].bias.requires_grad_(True)
            model[2].bias.requires_grad_(True)
        model.set_requires_gradient_sync(last)
        model(x.chunk(world)[rank]).pow(2).mean().div(len(batches)).backward()
        reference(x).pow(2).mean().div(len(batches)).backward()
    for (name, p), r in zip(model.named_parameters(), reference.parameters()):
        assert p.grad is not None, f"{name} has no gradient"
        torch.testing.assert_close(p.grad.full_tensor(), r.grad, rtol=1e-5, atol=1e-6, msg=name)
