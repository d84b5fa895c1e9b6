"""Strategies (issue 3) on 2 gloo ranks: every strategy x precision x accumulation against the reference, CPU
offload, fp32 main gradients."""
from __future__ import annotations

import copy
import itertools

import torch.distributed as dist

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from fullshard import FSDPModule, MixedPrecisionPolicy
from fullshard.plan.group import Strategy
from fullshard.core.buffers import traffic
from fullshard.torch.policies import TORCH_PROMOTES_REDUCE_DTYPE
from tests.conftest import Launch, scenario, scenarios
from tests.torch.parity import build_gpt, gpt_batch, gpt_loss, mesh_1d, run_parity, shard_blocks_then_root

LAUNCH = Launch(world_sizes=(2,))

PRECISIONS = {
    "fp32": (MixedPrecisionPolicy(), dict(rtol=1e-5, atol=1e-6, param_atol=1e-5)),
    "bf16": (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        dict(rtol=2e-2, atol=2e-2, param_atol=3e-2),
    ),
}


def _parity(strategy: Strategy, precision: str, micro_batches: int):
    def parity():
        mesh = mesh_1d()
        mp, tolerances = PRECISIONS[precision]
        result = run_parity(
            build_gpt,
            lambda m: shard_blocks_then_root(m, mesh=mesh, mp_policy=mp, strategy=strategy.value),
            micro_batches=micro_batches, global_batch=8, **tolerances,
        )
        return result.losses

    return parity


@scenario
def placements_follow_strategy():
    mesh = mesh_1d()
    for strategy, placement in [(Strategy.NO_SHARD, Replicate()), (Strategy.OPTIM, Shard(0))]:
        model = shard_blocks_then_root(build_gpt(), mesh=mesh, strategy=strategy.value)
        for name, param in model.named_parameters():
            assert isinstance(param, DTensor) and param.placements == (placement,), (strategy, name)
        model(torch.randint(0, 64, (2, 16))).sum().backward()
        for name, param in model.named_parameters():
            assert param.grad.placements == (placement,), (strategy, name)
    return True


@scenario
def collectives_follow_strategy():
    """ZeRO-3 gathers twice, ZeRO-1/2 once (kept, refreshed next step), no_shard only all-reduces."""
    mesh = mesh_1d()
    counts = {}
    for strategy in Strategy:
        model = shard_blocks_then_root(build_gpt(), mesh=mesh, strategy=strategy.value)
        tokens = torch.randint(0, 64, (2, 16))
        for _ in range(2):  # the second step shows the steady state
            traffic.clear()
            model(tokens).sum().backward()
        counts[strategy.value] = dict(traffic)
    numel = sum(p.numel() for p in build_gpt().parameters())
    zero3, zero2 = counts["optim_grads_params"], counts["optim_grads"]
    assert counts["no_shard"].get("all_gather", 0) == 0 and counts["no_shard"]["all_reduce"] >= 4 * numel
    assert zero2["all_gather"] < zero3["all_gather"] < 2 * zero2["all_gather"], counts
    assert counts["optim"]["all_gather"] == zero2["all_gather"], counts
    assert zero3["reduce_scatter"] == zero2["reduce_scatter"] == counts["optim"]["reduce_scatter"], counts
    return counts


@scenario
def fp32_accumulation_of_bf16_grads():
    """bf16 compute, fp32 reduce, 4 micro-batches without sync: gradients are summed in fp32. On torch 2.15, as
    FSDP2 2.15, the first micro-batch's gradient is fp32 as autograd gives it (the unsharded parameter holds fp32
    gradients: a tied weight's two uses are summed in fp32), the later ones arrive in bf16 and are summed into it."""
    mesh = mesh_1d()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = build_gpt()
    emulator = copy.deepcopy(model).to(torch.bfloat16)  # the bf16 weights the sharded model computes with
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    shard_blocks_then_root(model, mesh=mesh, mp_policy=mp)
    fp32_sum = [torch.zeros_like(p, dtype=torch.float32) for p in emulator.parameters()]
    bf16_sum = [torch.zeros_like(p) for p in emulator.parameters()]
    micro = [tuple(t.chunk(world)[rank].chunk(4)[m] for t in gpt_batch(0, 16)) for m in range(4)]
    for index, part in enumerate(micro):
        model.set_requires_gradient_sync(index == 3)
        if TORCH_PROMOTES_REDUCE_DTYPE:
            for p in emulator.parameters():
                p.grad_dtype = torch.float32 if index == 0 else None
        gpt_loss(model, part).backward()
        gpt_loss(emulator, part).backward()
        for p, acc32, acc16 in zip(emulator.parameters(), fp32_sum, bf16_sum):
            acc32 += p.grad.float()
            acc16 += p.grad
            p.grad = None
    worst_bf16 = 0.0
    for (name, param), acc32, acc16 in zip(model.named_parameters(), fp32_sum, bf16_sum):
        expected = _mean_across_ranks(acc32)
        assert torch.equal(param.grad.full_tensor(), expected), name
        worst_bf16 = max(worst_bf16, (_mean_across_ranks(acc16.float()) - expected).abs().max().item())
    assert worst_bf16 > 1e-5, f"bf16 accumulation should differ measurably, differs by {worst_bf16}"
    return {"bf16_accumulation_error": worst_bf16}


def _mean_across_ranks(tensor):
    gathered = [torch.empty_like(tensor) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, tensor)
    total = gathered[0].clone()
    for other in gathered[1:]:
        total += other
    return total / dist.get_world_size()


@scenario
def divide_factor_one_sums_gradients():
    """set_gradient_divide_factor(1.0) turns the average into a sum (works on gloo: no PREMUL_SUM). As in
    FSDP2 it sets the module's own group only: clients call it on every FSDPModule; on the root alone the
    blocks keep averaging."""
    mesh = mesh_1d()
    rank, world = dist.get_rank(), dist.get_world_size()
    models = {}
    for label in ("averaged", "summed", "root only"):
        torch.manual_seed(0)
        models[label] = shard_blocks_then_root(build_gpt(), mesh=mesh)
    for module in models["summed"].modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
    models["root only"].set_gradient_divide_factor(1.0)
    batch = tuple(t.chunk(world)[rank] for t in gpt_batch(0, 4))
    for model in models.values():
        gpt_loss(model, batch).backward()
    named = {label: dict(model.named_parameters()) for label, model in models.items()}
    for name, a in named["averaged"].items():
        torch.testing.assert_close(named["summed"][name].grad.full_tensor(), a.grad.full_tensor() * world, msg=name)
        root_param = not name.startswith("layers.")
        factor = world if root_param else 1
        torch.testing.assert_close(named["root only"][name].grad.full_tensor(), a.grad.full_tensor() * factor,
                                   msg=name)
    return True


@scenario
def cpu_offload_parity():
    """CPUOffloadPolicy on a CPU mesh: the transfer is a no-op, the offload lifecycle runs; torch's policy too."""
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy

    from fullshard import CPUOffloadPolicy

    mesh = mesh_1d()
    for policy in (CPUOffloadPolicy(pin_memory=False), TorchCPUOffloadPolicy()):
        for strategy in ("optim_grads_params", "no_shard"):
            model_losses = run_parity(
                build_gpt, lambda m: shard_blocks_then_root(m, mesh=mesh, offload_policy=policy, strategy=strategy)
            ).losses
    model = shard_blocks_then_root(build_gpt(), mesh=mesh, offload_policy=CPUOffloadPolicy())
    gpt_loss(model, gpt_batch(0, 2)).backward()
    for name, param in model.named_parameters():
        assert param.to_local().device.type == "cpu" and param.grad.to_local().device.type == "cpu", name
    return model_losses


@scenario
def fp32_main_grads_for_bf16_stored_model():
    """A bf16-stored model with main_dtype=float32 tracks an fp32 reference far better than plain bf16."""
    mesh = mesh_1d()
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = build_gpt()
    plain, main = copy.deepcopy(reference).bfloat16(), copy.deepcopy(reference).bfloat16()
    shard_blocks_then_root(plain, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32))
    shard_blocks_then_root(
        main, mesh=mesh, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float32, main_dtype=torch.float32)
    )
    assert all(p.dtype == torch.float32 for p in main.parameters())  # what the optimizer steps on
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in (reference, plain, main)]
    for step in range(20):
        batch = gpt_batch(step, 4)
        local = tuple(t.chunk(world)[rank] for t in batch)
        gpt_loss(reference, batch).backward()
        for model in (plain, main):
            gpt_loss(model, local).backward()
        assert all(p.grad.dtype == torch.float32 for p in main.parameters())
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()

    def deviation(model):
        return max((p.full_tensor().float() - r).abs().max().item() for p, r in zip(model.parameters(), reference.parameters()))

    plain_dev, main_dev = deviation(plain), deviation(main)
    assert main_dev < plain_dev / 4, f"fp32 main grads deviate {main_dev}, plain bf16 {plain_dev}"
    return {"plain_bf16_max_deviation": plain_dev, "fp32_main_max_deviation": main_dev}


@scenarios
def parity_matrix(world_size):
    """Every strategy x precision x accumulation (1 or 4 micro-batches) against the reference."""
    return {f"parity_{strategy.value}_{precision}_accum{micro}": _parity(strategy, precision, micro)
            for strategy, precision, micro in itertools.product(Strategy, PRECISIONS, (1, 4))}
