"""Mixture of experts and expert parallelism (issue 30) on gloo ranks, each case against one process.

The reference is a single process that holds the whole model (every expert) and computes, on the whole global
batch, the mean cross-entropy over all its tokens; it steps SGD with momentum on that loss's gradient. The
sharded model gives each rank one equal slice of the batch. Parity means, step by step, the mean of the ranks'
losses equals the reference's loss, and at the end every parameter's ``full_tensor()`` equals the reference's.

The model is written plainly: an embedding, blocks of ``x + moe(norm(x))`` and a head. The MoE layer routes each
token to its top-2 experts (softmax of a router, renormalised over the chosen two), runs a shared dense expert
on every token, and sums. Experts are one grouped weight per projection (``[n_experts, d, h]``), or per-expert
Linears (the idle-expert case, where an expert with no tokens is skipped and gets no gradient on that rank).

Expert parallelism (``EP``) on 4 ranks is torchtitan's layout: a mesh ``(efsdp=2, ep=2)``, ep innermost. Each
``ep`` group ({0, 1}, {2, 3}) holds the experts between them, the grouped weights DTensors ``Shard(0)`` on
``ep``; tokens travel to their experts' rank and back with ``all_to_all_single``. ``fully_shard`` gets the
4-rank dense mesh, and a ``shard_placement_fn`` that answers FSDP2's ``ShardPlacementResult(Shard(0),
FSDPMeshInfo(mesh["efsdp"]))`` for the experts: they shard over the expert-FSDP mesh ({0, 2}, {1, 3}). On 2
ranks the expert mesh has one rank (efsdp=1, ep=2), where FSDP2's default leaves the experts' gradients twice
too large. Every collective fullshard issues is recorded with its process group's ranks, so a group that fell
back to another mesh would show.
"""
from __future__ import annotations

import contextlib
import copy
import os
from collections import Counter

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.nn.functional as dist_fn
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo, ShardPlacementResult
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

from fullshard import MixedPrecisionPolicy, clip_grad_norm_, fully_shard
from fullshard.torch import collectives, group as fullshard_group
from tests.conftest import Launch, scenario

LAUNCH = Launch(world_sizes=(2, 4))

D, H, VOCAB, SEQ, TOP_K = 8, 12, 16, 6, 2


def local(weight: torch.Tensor) -> torch.Tensor:
    """An expert-parallel weight's local experts (the module sees the ``ep`` DTensor)."""
    return weight.to_local() if isinstance(weight, DTensor) else weight


class GroupedExperts(nn.Module):
    def __init__(self, n_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n_experts, D, H) * 0.4)
        self.w2 = nn.Parameter(torch.randn(n_experts, H, D) * 0.4)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        w1, w2 = local(self.w1), local(self.w2)
        parts = torch.split(x, counts)
        return torch.cat([torch.tanh(part @ w1[e]) @ w2[e] for e, part in enumerate(parts)])


class LinearExperts(nn.Module):
    """One small MLP per expert; an expert given no token does not run (no gradient on that rank)."""

    def __init__(self, n_experts: int) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, D))
                                     for _ in range(n_experts))

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        parts = torch.split(x, counts)
        return torch.cat([expert(part) if len(part) else part for expert, part in zip(self.experts, parts)])


class ExpertParallel:
    """Token exchange of one ``ep`` group: tokens sorted by expert go to the rank holding it, and come back."""

    def __init__(self, group: dist.ProcessGroup, n_experts: int) -> None:
        self.group, self.size = group, dist.get_world_size(group)
        self.per_rank = n_experts // self.size

    def __call__(self, experts: nn.Module, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        received = torch.empty_like(counts)  # [source rank, local expert] tokens this rank receives
        dist.all_to_all_single(received, counts, group=self.group)
        send = counts.view(self.size, self.per_rank).sum(1).tolist()
        recv = received.view(self.size, self.per_rank).sum(1).tolist()
        tokens = dist_fn.all_to_all_single(x.new_empty(sum(recv), D), x, recv, send, group=self.group)
        # received per source rank, each sorted by local expert: regroup by expert for the experts, then back
        by_source = received.view(self.size, self.per_rank)
        source_of = torch.repeat_interleave(torch.arange(by_source.numel()), by_source.flatten())
        expert_of = source_of % self.per_rank
        order = torch.argsort(expert_of * by_source.numel() + source_of, stable=True)
        out = experts(tokens[order], by_source.sum(0).tolist())
        back = torch.empty_like(out).index_copy(0, order, out)
        return dist_fn.all_to_all_single(x.new_empty(sum(send), D), back, send, recv, group=self.group)


class MoE(nn.Module):
    def __init__(self, n_experts: int, linear_experts: bool = False) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.router = nn.Linear(D, n_experts, bias=False)
        self.shared = nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, D))
        self.experts = LinearExperts(n_experts) if linear_experts else GroupedExperts(n_experts)
        self.exchange = None  # ExpertParallel, or None: every expert here

    def forward(self, x: torch.Tensor, forbidden: torch.Tensor | None = None) -> torch.Tensor:
        logits = self.router(x)
        if forbidden is not None:  # [tokens, experts] True: that token may not go there
            logits = logits.masked_fill(forbidden, float("-inf"))
        gates, chosen = torch.softmax(logits, -1).topk(TOP_K, -1)
        gates = gates / gates.sum(-1, keepdim=True)
        flat = chosen.flatten()
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs by expert
        token = order // TOP_K
        counts = torch.bincount(flat, minlength=self.n_experts)
        inputs = x[token]
        if self.exchange is None:
            out = self.experts(inputs, counts.tolist())
        else:
            out = self.exchange(self.experts, inputs, counts)
        weighted = out * gates.flatten()[order].unsqueeze(-1)
        return self.shared(x) + torch.zeros_like(x).index_add(0, token, weighted)


class Block(nn.Module):
    def __init__(self, n_experts: int, linear_experts: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)
        self.moe = MoE(n_experts, linear_experts)

    def forward(self, x: torch.Tensor, forbidden: torch.Tensor | None = None) -> torch.Tensor:
        return x + self.moe(self.norm(x), forbidden)


class MoENet(nn.Module):
    def __init__(self, n_experts: int = 4, layers: int = 2, linear_experts: bool = False) -> None:
        super().__init__()
        self.n_experts = n_experts
        self.embed = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList(Block(n_experts, linear_experts) for _ in range(layers))
        self.head = nn.Linear(D, VOCAB)
        self.forbid = None  # (token ids -> [tokens, experts] bool), the same rule on every rank

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        flat = tokens.flatten()
        forbidden = self.forbid(flat) if self.forbid is not None else None
        x = self.embed(flat)
        for layer in self.layers:
            x = layer(x, forbidden)
        return self.head(x)


def batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    tokens = torch.randint(0, VOCAB, (size, SEQ + 1), generator=gen)
    return tokens[:, :-1], tokens[:, 1:]


def token_loss_sum(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(tokens), targets.flatten(), reduction="sum")


# ---------------------------------------------------------------------------------------------- recording
class Recorder:
    """Every gather and reduction fullshard issues, by operation and the global ranks of its group."""

    def __init__(self) -> None:
        self.calls: Counter = Counter()
        self._originals = {}

    def __enter__(self) -> "Recorder":
        for name in ("all_gather", "reduce_scatter", "all_reduce_sum"):
            original = self._originals[name] = getattr(collectives, name)
            setattr(collectives, name, self._recording(name, original))
        return self

    def _recording(self, name, original):
        def record(*args, **kwargs):
            group = kwargs.get("group", args[3] if name != "all_reduce_sum" else args[2])
            self.calls[(name, tuple(dist.get_process_group_ranks(group)))] += 1
            return original(*args, **kwargs)
        return record

    def __exit__(self, *exc) -> None:
        for name, original in self._originals.items():
            setattr(collectives, name, original)

    def by_ranks(self, name: str) -> dict:
        return {ranks: count for (op, ranks), count in self.calls.items() if op == name}


# ---------------------------------------------------------------------------------------------- training
def expert_parallel(model: MoENet, ep_mesh) -> MoENet:
    """Keep each rank's experts: the grouped weights become DTensors ``Shard(0)`` on the ``ep`` mesh."""
    for block in model.layers:
        experts = block.moe.experts
        for name in ("w1", "w2"):
            weight = getattr(experts, name)
            setattr(experts, name, nn.Parameter(distribute_tensor(weight.detach(), ep_mesh, [Shard(0)])))
        block.moe.exchange = ExpertParallel(ep_mesh.get_group(), model.n_experts)
    return model


def shard_with_expert_mesh(model: MoENet, dense, expert_mesh, info=None, **kwargs) -> MoENet:
    """Blocks, then the root, on the dense mesh; the experts' parameters on ``expert_mesh`` (FSDP2's way)."""
    info = info or FSDPMeshInfo(expert_mesh, shard_mesh_dim=0)  # one object per mesh, as FSDP2 asks
    experts = {id(p) for block in model.layers for p in block.moe.experts.parameters()}

    def placement(param: nn.Parameter):
        return ShardPlacementResult(Shard(0), info) if id(param) in experts else None

    for block in model.layers:
        fully_shard(block, mesh=dense, shard_placement_fn=placement, **kwargs)
    fully_shard(model, mesh=dense, **kwargs)
    return model


def train(model: nn.Module, reference: nn.Module, rank_slice, *, steps: int = 3, sum_loss: bool = False,
          clip: float | None = None, global_batch: int = 8, rtol: float = 1e-5, atol: float = 1e-6) -> dict:
    """Step ``model`` on this rank's slice and ``reference`` on the whole batch; compare every step's loss and
    every parameter's reduced gradient, then the final parameters.

    ``sum_loss``: each rank's loss is its token losses' sum over the global token count (torchtitan's way, with
    ``set_gradient_divide_factor(1.0)``); otherwise each rank's loss is the mean over its own tokens."""
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.3, momentum=0.9)
    losses, ref_losses = [], []
    for step in range(steps):
        tokens, targets = batch(step, global_batch)
        ref_loss = token_loss_sum(reference, tokens, targets) / tokens.numel()
        ref_loss.backward()
        ref_losses.append(ref_loss.item())
        mine = (tokens[rank_slice], targets[rank_slice])
        summed = token_loss_sum(model, *mine)
        loss = summed / tokens.numel() if sum_loss else summed / mine[0].numel()
        loss.backward()
        assert_same_grads(model, reference, step, rtol, atol)
        if clip is not None:
            norm = clip_grad_norm_(model.parameters(), clip)
            ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), clip)
            torch.testing.assert_close(norm, ref_norm, rtol=1e-4, atol=1e-6)
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad()
        total = (summed / tokens.numel()).detach()
        dist.all_reduce(total)
        losses.append(total.item())
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=rtol, atol=atol,
                               msg=lambda m: f"losses {losses} vs reference {ref_losses}\n{m}")
    assert_same_parameters(model, reference, atol=max(1e-5, 10 * atol))
    return {"losses": losses}


def assert_same_grads(model: nn.Module, reference: nn.Module, step: int, rtol: float, atol: float) -> None:
    """Every reduced gradient is the reference's (the ratio of their norms is in the message: 2.0 is FSDP2's
    default under expert parallelism on 2 ranks)."""
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
        assert grad is not None, f"step {step}: {name} has no gradient"
        ratio = (grad.norm() / ref.grad.norm()).item() if ref.grad.norm() > 0 else float("nan")
        torch.testing.assert_close(grad, ref.grad, rtol=rtol, atol=atol,
                                   msg=lambda m: f"step {step}: gradient of {name} (norm ratio {ratio:.4f})\n{m}")


def assert_same_parameters(model: nn.Module, reference: nn.Module, atol: float = 1e-5) -> None:
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        full = param.full_tensor() if isinstance(param, DTensor) else param
        assert full.shape == ref.shape, f"{name}: {tuple(full.shape)} vs {tuple(ref.shape)}"
        diff = (full - ref).abs().max().item()
        assert diff <= atol, f"{name}: final parameters differ by {diff} (> {atol})"


def ep_meshes(world: int):
    """torchtitan's sparse mesh (efsdp, ep) with ep innermost, ep = 2; and the dense mesh of every rank."""
    sparse = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("efsdp", "ep"))
    dense = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    return sparse, dense


def ep_model(world: int, **shard_kwargs):
    sparse, dense = ep_meshes(world)
    torch.manual_seed(0)
    reference = MoENet()
    model = shard_with_expert_mesh(expert_parallel(copy.deepcopy(reference), sparse["ep"]), dense, sparse["efsdp"],
                                   **shard_kwargs)
    return model, reference, sparse, dense


def rank_slice():
    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = 8 // world
    return slice(rank * per_rank, (rank + 1) * per_rank)


def check_groups_and_collectives(model: MoENet, recorder: Recorder, sparse, dense, steps: int) -> dict:
    """Each block holds two groups (dense, then experts) on their own process groups, and every gather and
    reduction of the experts ran on the expert mesh: a group of one rank exchanges nothing (LOCAL)."""
    dense_ranks = tuple(dist.get_process_group_ranks(dense.get_group()))
    expert_ranks = tuple(dist.get_process_group_ranks(sparse["efsdp"].get_group()))
    for block in model.layers:
        groups = block._fullshard_unit.groups
        assert [tuple(dist.get_process_group_ranks(g.process_group)) for g in groups] == [dense_ranks, expert_ranks]
        assert sorted(p.fqn.rpartition(".")[2] for p in groups[1].params) == ["w1", "w2"], groups[1].params
        assert all(g.default_divide_factor == dist.get_world_size() for g in groups)
        # the expert-FSDP shard lies inside each ep chunk of the same dim: _StridedShard, as FSDP2 places it
        assert block.moe.experts.w1.placements == (_StridedShard(0, split_factor=2), Shard(0))
        assert block.moe.experts.w1.device_mesh.mesh_dim_names == ("efsdp", "ep")
    expert_buckets = sum(len(block._fullshard_unit.groups[1].plan.buckets) for block in model.layers)
    gathers, reduces = recorder.by_ranks("all_gather"), recorder.by_ranks("reduce_scatter")
    # every block gathers its experts in forward and again in backward, and reduces them once, each step
    assert gathers.get(expert_ranks) == 2 * expert_buckets * steps, gathers
    assert reduces.get(expert_ranks) == expert_buckets * steps, reduces
    assert set(gathers) == set(reduces) == {dense_ranks, expert_ranks}, (gathers, reduces)
    assert not recorder.by_ranks("all_reduce_sum")
    return {"all_gather": {str(k): v for k, v in gathers.items()}, "reduce_scatter": {str(k): v for k, v in
                                                                                     reduces.items()}}


# ---------------------------------------------------------------------------------------------- scenarios
@scenario
def expert_parallel_default_averaging():
    """EP 2 x expert-FSDP (2 on 4 ranks, 1 on 2): the default division (by the call's data-parallel size) with
    each rank's mean loss matches the reference, the experts' too; the collectives ran on each group's mesh."""
    model, reference, sparse, dense = ep_model(dist.get_world_size())
    with Recorder() as recorder:
        result = train(model, reference, rank_slice())
    result["collectives"] = check_groups_and_collectives(model, recorder, sparse, dense, steps=3)
    return result


@scenario
def expert_parallel_sum_over_global_tokens():
    """torchtitan's way: divide factor 1.0 on every unit, each loss a sum over the global token count."""
    model, reference, _, _ = ep_model(dist.get_world_size())
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
    return train(model, reference, rank_slice(), sum_loss=True)


@scenario
def expert_parallel_clip_and_checkpoint():
    """clip_grad_norm_ over both meshes matches the reference's; a DCP round trip restores every parameter."""
    model, reference, sparse, dense = ep_model(dist.get_world_size())
    train(model, reference, rank_slice(), clip=0.5, steps=2)
    directory = [os.path.join(os.environ.get("FULLSHARD_TEST_DIR", "/tmp"), "moe_ckpt")]
    dcp.save({"model": model.state_dict()}, checkpoint_id=directory[0])
    torch.manual_seed(1)  # different initial values, to be overwritten
    other = MoENet()
    other = shard_with_expert_mesh(expert_parallel(other, sparse["ep"]), dense, sparse["efsdp"])
    state = {"model": other.state_dict()}
    dcp.load(state, checkpoint_id=directory[0])
    other.load_state_dict(state["model"])
    assert_same_parameters(other, reference)
    return True


@scenario
def expert_parallel_explicit_factor_fp16_reduce():
    """An explicit factor (the world size) with gradients reduced in fp16, the experts' mesh of one rank on 2
    ranks: divided once (torch 2.13's FSDP2 divides twice there: factor squared)."""
    mp = MixedPrecisionPolicy(reduce_dtype=torch.float16)
    model, reference, _, _ = ep_model(dist.get_world_size(), mp_policy=mp)
    for module in model.modules():
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(float(dist.get_world_size()))
    return train(model, reference, rank_slice(), rtol=2e-3, atol=2e-4)


@scenario(world_sizes=(4,))
def expert_parallel_reshard_to_blocks():
    """reshard_after_forward=2 on 4 ranks: the dense groups keep blocks of 2 ranks after forward, the experts
    (whose mesh has 2 ranks) reshard fully; both still match."""
    model, reference, _, dense = ep_model(4, reshard_after_forward=2)
    groups = model.layers[0]._fullshard_unit.groups
    assert dist.get_world_size(groups[0].post_forward_group) == 2 and groups[1].post_forward_group is None
    return train(model, reference, rank_slice())


@scenario(world_sizes=(4,))
def experts_on_an_hsdp_mesh():
    """No expert parallelism: every rank runs every expert, whose weights go on a (replicate 2, shard 2) mesh
    through an HSDPMeshInfo; placements (Replicate(), Shard(0)), reduced within a shard pair then summed across
    the replicas, divided by 4 like the dense weights."""
    hsdp = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    dense = init_device_mesh("cpu", (4,), mesh_dim_names=("fsdp",))
    torch.manual_seed(0)
    reference = MoENet()
    info = HSDPMeshInfo(hsdp, shard_mesh_dim=1, replicate_mesh_dim=0)
    model = shard_with_expert_mesh(copy.deepcopy(reference), dense, None, info=info)
    experts = model.layers[0]._fullshard_unit.groups[1]
    assert dist.get_process_group_ranks(experts.replicate_group) == dist.get_process_group_ranks(hsdp.get_group(0))
    assert model.layers[0].moe.experts.w1.placements == (Replicate(), Shard(0))
    return train(model, reference, rank_slice())


@scenario(world_sizes=(2,))
def uneven_experts_and_idle_experts():
    """3 experts as per-expert Linears in one unit on 2 ranks (Shard(0) of 3 rows: 2 + 1, of 12 + 0 ...); a rule
    keeps expert 2 from every even token, and rank 1's tokens are all even, so expert 2 is idle there (no
    gradient on that rank) and runs on rank 0; expert 2's gradient reaches both ranks' shards. Then the same
    with one grouped weight [3, d, h] (uneven rows). Last, every parameter travels alone (as a large expert
    weight does), where a rank with no gradient for it must still join its reduction:
    set_reduce_scatter_unused_params(True) on the blocks."""
    rank = dist.get_rank()
    results = {}
    for linear, alone in ((True, False), (False, False), (True, True)):
        torch.manual_seed(0)
        reference = MoENet(n_experts=3, linear_experts=linear)
        reference.forbid = lambda flat: (flat % 2 == 0).unsqueeze(-1) & (torch.arange(3) == 2)
        model = copy.deepcopy(reference)
        fuse = fullshard_group.DEFAULT_FUSE_BELOW_NUMEL
        fullshard_group.DEFAULT_FUSE_BELOW_NUMEL = 1 if alone else fuse
        try:
            for block in model.layers:
                fully_shard(block)
                block.set_reduce_scatter_unused_params(alone)
            fully_shard(model)
        finally:
            fullshard_group.DEFAULT_FUSE_BELOW_NUMEL = fuse
        assert all(b.is_single for b in model.layers[0]._fullshard_unit.groups[0].plan.buckets) == alone
        opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
        ref_opt = torch.optim.SGD(reference.parameters(), lr=0.3, momentum=0.9)
        for step in range(3):
            tokens, targets = batch(step, 4)
            tokens = tokens.clone()
            tokens[2:] = tokens[2:] // 2 * 2  # rank 1's half: even tokens only
            mine = slice(2 * rank, 2 * rank + 2)
            loss = token_loss_sum(model, tokens[mine], targets[mine]) / tokens[mine].numel()
            loss.backward()
            idle = model.layers[0].moe.experts
            if linear and rank == 1:  # nothing ran expert 2 here, yet its reduced gradient arrived
                assert idle.experts[2][0].weight.grad is not None
            opt.step()
            opt.zero_grad()
            (token_loss_sum(reference, tokens, targets) / tokens.numel()).backward()
            if linear:
                assert reference.layers[0].moe.experts.experts[2][0].weight.grad.abs().sum() > 0
            ref_opt.step()
            ref_opt.zero_grad()
        assert_same_parameters(model, reference)
        if not linear:
            local_rows = model.layers[0].moe.experts.w1.to_local().shape[0]
            assert local_rows == (2 if rank == 0 else 1), local_rows
        results[("linear" if linear else "grouped") + (" alone" if alone else "")] = True
    return results


@scenario(world_sizes=(2,))
def mesh_info_checks():
    """A mesh_info that names no data-parallel mesh is refused, naming the parameter and the fix; two that name
    the same groups make one group."""
    mesh = init_device_mesh("cpu", (2,))

    class NotAMeshInfo:
        mesh, shard_mesh_dim = "nope", 0

    model = MoENet()
    try:
        fully_shard(model.layers[0], mesh=mesh,
                    shard_placement_fn=lambda p: ShardPlacementResult(Shard(0), NotAMeshInfo()))
    except ValueError as error:
        text = str(error)
        assert "norm.weight" in text and "FSDPMeshInfo(mesh, shard_mesh_dim=0)" in text and "Block" in text, text
    else:
        raise AssertionError("a bad mesh_info was accepted")
    assert not hasattr(model.layers[0], "_fullshard_unit")  # nothing changed
    # two mesh-info objects naming the same groups: one group (FSDP2 raises), not two that split a bucket
    first, second = FSDPMeshInfo(mesh, shard_mesh_dim=0), FSDPMeshInfo(mesh, shard_mesh_dim=0)
    fully_shard(model.layers[0], mesh=mesh, shard_placement_fn=lambda p: ShardPlacementResult(
        None, first if p.ndim == 1 else second))
    assert len(model.layers[0]._fullshard_unit.groups) == 1
    return True


class ChunkedHeadNet(MoENet):
    """torchtitan's DeepSeek-V3 under its ChunkedLossWrapper: the forward stops after the final norm, the loss
    applies the head."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(D)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens.flatten())
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def chunked_loss(model: ChunkedHeadNet, tokens, targets, total: int, chunks: int = 3,
                 recorder: Recorder | None = None) -> torch.Tensor:
    """ChunkedLossWrapper's steps: the head kept gathered over the chunks, each chunk's loss with a backward of
    its own (gradient sync only at the last), then backward through the model from the chunks' gradients.
    ``recorder`` records the chunks' forwards and backwards."""
    hidden = model(tokens)
    pieces = [piece.detach().requires_grad_() for piece in hidden.chunk(chunks)]
    labels = targets.flatten().chunk(chunks)
    head, sharded = model.head, hasattr(model.head, "unshard")
    if sharded:
        head.set_reshard_after_forward(False)
        head.set_reshard_after_backward(False)
        head.set_requires_gradient_sync(False, recurse=False)
        head.unshard()
    loss = 0.0
    with recorder or contextlib.nullcontext():
        for index, (piece, label) in enumerate(zip(pieces, labels)):
            if sharded and index == chunks - 1:
                head.set_requires_gradient_sync(True, recurse=False)
            part = nn.functional.cross_entropy(head(piece), label, reduction="sum") / total
            part.backward()
            loss = loss + part.detach()
    if sharded:
        head.set_reshard_after_forward(True)
        head.set_reshard_after_backward(True)
        head.set_requires_gradient_sync(True, recurse=False)
        head.reshard()
    hidden.backward(torch.cat([piece.grad for piece in pieces]))
    return loss


@scenario(world_sizes=(2,))
def chunked_loss_head_prefetches_nothing():
    """torchtitan's DeepSeek-V3 with its chunked loss: [norm, head] one unit (torchtitan keeps it after forward),
    the head run alone on each chunk with a backward of its own, and torchtitan's explicit backward prefetch of
    the last block from the head. Such a backward ends at the head, and its end reshards what a prefetch
    gathered: the last block was gathered again for every chunk (found with tools/torchtitan_moe.py). A unit
    whose forward ran only some of its modules prefetches nothing in backward (FSDP2 hooks no pre-backward
    there): the chunks' backwards gather nothing, and training still matches one process."""
    torch.manual_seed(0)
    reference = ChunkedHeadNet()
    model = copy.deepcopy(reference)
    for block in model.layers:
        fully_shard(block)
    fully_shard([model.norm, model.head], reshard_after_forward=False)
    fully_shard(model)
    for module in model.modules():  # torchtitan's: each rank's loss is its sum over the global token count
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
    model.layers[0].set_modules_to_backward_prefetch([model])
    model.layers[1].set_modules_to_backward_prefetch([model.layers[0]])
    model.head.set_modules_to_backward_prefetch([model.layers[1]])
    opt = torch.optim.SGD(model.parameters(), lr=0.3, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.3, momentum=0.9)
    mine, losses, ref_losses, chunk_gathers = rank_slice(), [], [], []
    for step in range(3):
        tokens, targets = batch(step, 8)
        recorder = Recorder()
        loss = chunked_loss(model, tokens[mine], targets[mine], targets.numel(), recorder=recorder)
        chunk_gathers.append(sum(recorder.by_ranks("all_gather").values()))
        assert chunk_gathers[-1] == 0, f"step {step}: the chunks' backwards gathered {recorder.calls}"
        total = loss.clone()
        dist.all_reduce(total)
        losses.append(total.item())
        ref_losses.append(chunked_loss(reference, tokens, targets, targets.numel()).item())
        assert_same_grads(model, reference, step, rtol=1e-5, atol=1e-6)
        for optimizer in (opt, ref_opt):
            optimizer.step()
            optimizer.zero_grad()
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=1e-6)
    assert_same_parameters(model, reference)
    return {"gathers per step": chunk_gathers}
