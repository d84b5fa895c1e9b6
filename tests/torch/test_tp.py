"""fully_shard over tensor-parallel DTensor parameters (issue 15), on 4 gloo ranks: a (dp=2, tp=2) mesh.

Blocks are tensor parallel (``up``: ColwiseParallel, ``down``: RowwiseParallel)
on ``mesh["tp"]``; fully_shard shards them, and the plain parameters around
them, across ``mesh["dp"]``. Every case trains against a single-process
reference on the same global batches: per-step losses and the final
``full_tensor()`` of every parameter. Ranks with the same dp coordinate see
the same data (tensor parallelism splits the work, not the batch). Two checks of HSDP with tensor
parallelism run on 8 ranks, (2, 2, 2), kept tiny: 8 processes share the CPUs.
"""
from __future__ import annotations

import copy
import functools
import tempfile

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from fullshard import CPUOffloadPolicy, MixedPrecisionPolicy, clip_grad_norm_, fully_shard
from fullshard.torch.accounting import memory_report, reset_traffic
from tests.conftest import Launch, scenario

LAUNCH = Launch(world_sizes=(4,))

WIDTH, VOCAB = 8, 16


class TPBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class TPNet(nn.Module):
    def __init__(self, blocks: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleList(TPBlock() for _ in range(blocks))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def dp_tp_mesh(dp: int = 2, tp: int = 2):
    return init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))


def tensor_parallel(model: TPNet, tp_mesh) -> TPNet:
    for block in model.layers:
        parallelize_module(block, tp_mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return model


def shard(model: TPNet, dp_mesh, **kwargs) -> TPNet:
    for block in model.layers:
        fully_shard(block, mesh=dp_mesh, **kwargs)
    fully_shard(model, mesh=dp_mesh, **kwargs)
    return model


def batch(step: int, size: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(700 + step)
    tokens = torch.randint(0, VOCAB, (size, 5), generator=gen)
    return tokens, torch.roll(tokens, 1, dims=1)


def loss_of(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return nn.functional.cross_entropy(logits.float().reshape(-1, VOCAB), targets.reshape(-1))


def train_against_reference(wrap, *, steps: int = 3, micro_batches: int = 1, clip: float | None = None,
                            rtol: float = 1e-5, atol: float = 1e-6, param_atol: float = 1e-5, dp_dims=("dp",),
                            mesh=None, blocks: int = 2) -> dict:
    """Train ``wrap(model, mesh)`` and a plain reference on the same global batches; compare."""
    mesh = mesh if mesh is not None else dp_tp_mesh()
    dp_mesh = mesh[dp_dims] if len(dp_dims) > 1 else mesh[dp_dims[0]]
    dp_rank, dp_size = dp_mesh.get_coordinate()[-1] if len(dp_dims) == 1 else _flat_rank(dp_mesh), dp_mesh.size()
    torch.manual_seed(0)
    reference = TPNet(blocks)
    model = wrap(copy.deepcopy(reference), mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.5, momentum=0.9)
    losses, ref_losses, norms, tp_norms = [], [], [], []
    for step in range(steps):
        tokens, targets = batch(step)
        local = (tokens.chunk(dp_size)[dp_rank], targets.chunk(dp_size)[dp_rank])
        total = torch.zeros(())
        for index in range(micro_batches):
            if micro_batches > 1:
                model.set_requires_gradient_sync(index == micro_batches - 1)
            part = tuple(t.chunk(micro_batches)[index] for t in local)
            loss = loss_of(model, *part) / micro_batches
            loss.backward()
            total += loss.detach()
        if clip is not None:
            tp_params = [p for p in model.parameters() if p.device_mesh.ndim == 2]
            tp_norm = torch.nn.utils.clip_grad_norm_(tp_params, float("inf"))  # torch's, on one (dp, tp) mesh
            tp_norms.append(tp_norm.full_tensor().item())
            norms.append(clip_grad_norm_(model.parameters(), clip).item())  # all meshes at once
        opt.step()
        opt.zero_grad()
        dist.all_reduce(total, group=dp_mesh.get_group() if dp_mesh.ndim == 1 else None)
        losses.append(total.item() / (dp_size if dp_mesh.ndim == 1 else dist.get_world_size()))
        ref_loss = loss_of(reference, tokens, targets)
        ref_loss.backward()
        if clip is not None:
            ref_tp = [p for n, p in reference.named_parameters() if ".up." in n or ".down." in n]
            ref_tp_norm = torch.nn.utils.get_total_norm([p.grad for p in ref_tp]).item()
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip).item()
            assert abs(tp_norms[-1] - ref_tp_norm) <= 1e-4 * max(1.0, ref_tp_norm), (tp_norms[-1], ref_tp_norm)
            assert abs(norms[-1] - ref_norm) <= 1e-4 * max(1.0, ref_norm), (norms[-1], ref_norm)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(ref_loss.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=atol,
                               msg=lambda m: f"losses {losses} vs reference {ref_losses}\n{m}")
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        full = param.full_tensor()
        assert full.shape == ref.shape, name
        diff = (full.float() - ref.float()).abs().max().item()
        assert diff <= param_atol, f"{name}: final parameters differ by {diff}"
    return {"losses": losses, "model": model}


def _flat_rank(mesh) -> int:
    coordinate, rank = mesh.get_coordinate(), 0
    for index, size in zip(coordinate, mesh.shape):
        rank = rank * size + index
    return rank


def _tp_then_shard(model, mesh, **kwargs):
    return shard(tensor_parallel(model, mesh["tp"]), mesh["dp"], **kwargs)


@scenario
def placements_are_fsdp2s():
    """Sharded parameters are DTensors on the (dp, tp) mesh placed (dp, tp) as FSDP2 places them; the module
    sees the tp DTensor in forward; gradients have the parameters' placements."""
    mesh = dp_tp_mesh()
    model = _tp_then_shard(TPNet(), mesh)
    block = model.layers[0]
    up, down, norm = block.up.weight, block.down.weight, block.norm.weight
    assert up.device_mesh.mesh_dim_names == ("dp", "tp"), up.device_mesh
    assert up.placements == (_StridedShard(0, split_factor=2), Shard(0)), up.placements  # both cut dim 0
    assert down.placements == (Shard(0), Shard(1)), down.placements
    assert block.down.bias.placements == (Shard(0), Replicate())
    assert norm.placements == (Shard(0),) and norm.device_mesh.mesh_dim_names == ("dp",)
    seen = {}

    def record(module, _inputs):
        weight = module.weight
        seen["up"] = (isinstance(weight, DTensor), weight.placements, weight.device_mesh.mesh_dim_names,
                      tuple(weight.to_local().shape))

    block.up.register_forward_pre_hook(record)
    loss_of(model, *batch(0, 2)).backward()
    assert seen["up"] == (True, (Shard(0),), ("tp",), (2 * WIDTH, WIDTH)), seen  # the tp DTensor, gathered over dp
    assert isinstance(block.up.weight, DTensor) and block.up.weight.placements == up.placements
    assert block.up.weight.grad.placements == up.placements
    torch.testing.assert_close(up.full_tensor().shape, torch.Size([4 * WIDTH, WIDTH]))
    return True


@scenario
def parity_fp32():
    return train_against_reference(_tp_then_shard)["losses"]


@scenario
def parity_bf16_compute_fp32_reduce():
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return train_against_reference(functools.partial(_tp_then_shard, mp_policy=mp),
                                   rtol=3e-2, atol=3e-2, param_atol=5e-2)["losses"]


@scenario
def parity_shard_dim_1():
    shard_fn = lambda p: Shard(p.dim() - 1)  # noqa: E731
    result = train_against_reference(functools.partial(_tp_then_shard, shard_placement_fn=shard_fn))
    up = result["model"].layers[0].up.weight
    assert up.placements == (Shard(1), Shard(0)), up.placements
    return result["losses"]


@scenario
def parity_strategies_and_resharding():
    """Strategies by name, reshard_after_forward False and int, gradient accumulation, CPU offload."""
    runs = {
        "optim": dict(strategy="optim"),
        "optim_grads": dict(strategy="optim_grads"),
        "no_shard": dict(strategy="no_shard"),
        "no_reshard_after_forward": dict(reshard_after_forward=False),
        "cpu_offload": dict(offload_policy=CPUOffloadPolicy(pin_memory=False)),
    }
    losses = {name: train_against_reference(functools.partial(_tp_then_shard, **kw))["losses"] for name, kw in runs.items()}
    losses["accumulate"] = train_against_reference(_tp_then_shard, micro_batches=2)["losses"]
    return losses


@scenario
def clipping_uses_the_global_norm():
    """torch's clip_grad_norm_ over the (dp, tp) gradients, and fullshard's over every mesh at once, give the
    reference's norms (torch's own refuses to stack norms from two meshes, with FSDP2 as here)."""
    return train_against_reference(_tp_then_shard, clip=0.5)["losses"]


@scenario
def prefetch_with_tp():
    def wrap(model, mesh):
        _tp_then_shard(model, mesh)
        layers = list(model.layers)
        for current, following in zip(layers, layers[1:]):
            current.set_modules_to_forward_prefetch([following])
            following.set_modules_to_backward_prefetch([current])
        return model

    return train_against_reference(wrap)["losses"]


@scenario
def checkpoint_between_2d_and_1d():
    """DCP on the (dp, tp) mesh loads into a 1-D fullshard model over all 4 ranks, and back."""
    mesh = dp_tp_mesh()
    torch.manual_seed(1)
    source = _tp_then_shard(TPNet(), mesh)
    loss_of(source, *batch(0, 4)).backward()  # non-trivial values in every parameter
    with torch.no_grad():
        for param in source.parameters():
            param.add_(param.grad)
    expected = {name: p.full_tensor() for name, p in source.named_parameters()}
    directory = [tempfile.mkdtemp() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(directory)
    dcp.save({"model": source.state_dict()}, checkpoint_id=directory[0])
    flat = init_device_mesh("cpu", (dist.get_world_size(),))
    target = shard(TPNet(), flat)
    state = {"model": target.state_dict()}
    dcp.load(state, checkpoint_id=directory[0])
    target.load_state_dict(state["model"])
    for name, param in target.named_parameters():
        torch.testing.assert_close(param.full_tensor(), expected[name], msg=lambda m: f"2-D -> 1-D {name}\n{m}")
    dcp.save({"model": target.state_dict()}, checkpoint_id=directory[0] + "/back")
    again = _tp_then_shard(TPNet(), mesh)
    state = {"model": again.state_dict()}
    dcp.load(state, checkpoint_id=directory[0] + "/back")
    again.load_state_dict(state["model"])
    for name, param in again.named_parameters():
        torch.testing.assert_close(param.full_tensor(), expected[name], msg=lambda m: f"1-D -> 2-D {name}\n{m}")
    return len(expected)


@scenario
def memory_and_traffic_with_tp():
    """Bytes held and moved per rank equal the formulas for the tp-local parameters (1/tp of each
    tensor-parallel tensor) over the dp group."""
    mesh = dp_tp_mesh()
    model = _tp_then_shard(TPNet(), mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(2):
        reset_traffic()
        loss_of(model, *batch(step, 2)).backward()
        report = memory_report(model, optimizer)
        optimizer.step()
        optimizer.zero_grad()
    theory = report["theory"]
    local = sum(p.to_local().numel() for p in model.parameters())
    assert report["measured"]["params"] == theory["memory"]["params"] == local * 4, (report, local)
    assert report["measured"]["grads"] == theory["memory"]["grads"], report
    assert report["traffic"] == {k: int(v) for k, v in theory["traffic"].items()}, report
    return report["traffic"]


@scenario
def ownership_with_tp_local_tensors():
    """The tp-local gradients are borrowed as reduce-scatter inputs exactly where the plan proves it safe
    (a lone parameter, dim 0, even, same dtype), and never written or freed (the sanitizer is on in CI)."""
    from tests.torch.test_ownership import _assert_caller_grads_intact, observe

    with observe() as seen:
        mesh = dp_tp_mesh()
        model = _tp_then_shard(TPNet(), mesh)
        loss_of(model, *batch(0, 2)).backward()
    _assert_caller_grads_intact(seen)
    borrowed = sorted(what for what, _ in seen["borrowed"] if what.startswith("gradient of") and "'layers." in what)
    # up.weight (32x8 -> tp-local 16x8) and up.bias (16) split evenly on dim 0 over dp: zero copy;
    # down.weight's tp-local (8x16) too; down.bias (8) is Replicate on tp and even: zero copy as well.
    expected = sorted(f"gradient of [layers.{i}.{name}] of module 'layers.{i}'"
                      for i in range(2) for name in ("norm.weight", "norm.bias", "up.weight", "up.bias",
                                                     "down.weight", "down.bias"))
    assert borrowed == expected, borrowed
    return len(borrowed)


@scenario
def mesh_errors_name_both_meshes():
    """A dp mesh that is not a dim of the parameters' mesh, or a parameter already on a dp dim: clear errors."""
    mesh = dp_tp_mesh()
    other = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("world",))
    messages = []
    for dp_mesh, expected in ((other, "not a dimension of the same mesh"), (mesh["tp"], "shares the data-parallel")):
        model = tensor_parallel(TPNet(), mesh["tp"])
        try:
            fully_shard(model.layers[0], mesh=dp_mesh)
        except ValueError as error:
            assert expected in str(error) and "'up.weight'" in str(error), str(error)
            assert not hasattr(model.layers[0], "_fullshard_unit")  # nothing half-applied
            messages.append(str(error))
        else:
            raise AssertionError(f"no error for {dp_mesh}")
    return messages


@scenario(world_sizes=(8,))
def hsdp_tp_parity():
    """HSDP with tensor parallelism on a (dp_replicate=2, dp_shard=2, tp=2) mesh of 8 ranks."""
    mesh = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "tp"))

    def wrap(model, mesh):
        return shard(tensor_parallel(model, mesh["tp"]), mesh["dp_replicate", "dp_shard"])

    result = train_against_reference(wrap, mesh=mesh, dp_dims=("dp_replicate", "dp_shard"), steps=2, blocks=1)
    up = result["model"].layers[0].up.weight
    assert up.device_mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "tp"), up.device_mesh
    assert up.placements == (Replicate(), _StridedShard(0, split_factor=2), Shard(0)), up.placements
    return result["losses"]


@scenario(world_sizes=(8,))
def int_reshard_after_forward_with_tp():
    """reshard_after_forward=2 on a (dp=4, tp=2) mesh: backward gathers within pairs of dp ranks."""
    mesh = dp_tp_mesh(4, 2)
    return train_against_reference(functools.partial(_tp_then_shard, reshard_after_forward=2), mesh=mesh,
                                   steps=2, blocks=1)["losses"]
