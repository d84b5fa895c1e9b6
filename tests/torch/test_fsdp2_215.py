"""FSDP2 2.15's API on fullshard, whatever torch >= 2.13 is installed (issue 31): manual and asynchronous backward
finalization, kept unsharded storage, ``param_dtype_override_fn``, and the reduce dtype the installed FSDP2
chooses, counted at the collective; each against a single-process reference, step by step. A guard fails when
the installed torch's ``FSDPModule`` or handles gain a public method fullshard does not define itself."""
from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import fields

import pytest

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed import fsdp as torch_fsdp
from torch.distributed.tensor import DTensor

import fullshard
from fullshard import FSDPModule, GradientReductionHandle, MixedPrecisionPolicy, UnshardHandle, fully_shard
from fullshard.plan.exchange import EXCHANGE_ENV
from fullshard.torch import collectives
from fullshard.torch.policies import TORCH_PROMOTES_REDUCE_DTYPE
from tests.conftest import Launch, scenario
from tests.torch.parity import build_gpt, gpt_batch, gpt_loss, mesh_1d, run_parity, shard_blocks_then_root

LAUNCH = Launch(world_sizes=(2,))
TORCH_215 = hasattr(torch_fsdp, "GradientReductionHandle")


# ---------------------------------------------------------------------------------------------- the guard
def _defined_by_fullshard(ours: type, theirs: type) -> set[str]:
    """Names defined by the classes of ``ours``'s MRO before ``theirs`` (torch's): not inherited from torch."""
    names: set[str] = set()
    for cls in ours.__mro__:
        if cls is theirs:
            break
        names |= set(vars(cls))
    return names


@pytest.mark.parametrize("name", ["FSDPModule", "UnshardHandle", "GradientReductionHandle"])
def test_every_public_method_of_torchs_class_is_defined_by_fullshard(name):
    """torch's methods would run on FSDP2 state that fullshard's modules do not have (2.15's three new methods
    crashed with AttributeError); the next torch release that adds one fails here first."""
    theirs = getattr(torch_fsdp, name, None)
    if theirs is None:
        pytest.skip(f"torch {torch.__version__} has no {name}")
    ours = {"FSDPModule": FSDPModule, "UnshardHandle": UnshardHandle,
            "GradientReductionHandle": GradientReductionHandle}[name]
    assert issubclass(ours, theirs), f"fullshard's {name} is not a subclass of torch's (isinstance checks fail)"
    public = {n for n, v in vars(theirs).items() if not n.startswith("_") and callable(v)}
    missing = sorted(public - _defined_by_fullshard(ours, theirs))
    assert not missing, f"torch {torch.__version__}'s {name} has public methods fullshard inherits: {missing}"


def test_every_public_name_of_torchs_fsdp2_is_exported_by_fullshard():
    """Switching the import needs every name of torch's FSDP2 (``share_comm_ctx`` was missing)."""
    from torch.distributed.fsdp import _fully_shard

    missing = sorted(n for n in _fully_shard.__all__ if not hasattr(fullshard, n))
    assert not missing, f"torch {torch.__version__}'s FSDP2 exports names fullshard does not: {missing}"


def test_gradient_reduction_handle_is_exported():
    assert fullshard.GradientReductionHandle is GradientReductionHandle
    GradientReductionHandle().wait()  # a handle of nothing waits for nothing, as torch's base class
    if TORCH_215:
        assert issubclass(GradientReductionHandle, torch_fsdp.GradientReductionHandle)


def test_param_dtype_override_fn_is_carried_over_from_torchs_policy():
    from fullshard.torch.api import as_mp_policy

    if "param_dtype_override_fn" not in {f.name for f in fields(torch_fsdp.MixedPrecisionPolicy)}:
        pytest.skip(f"torch {torch.__version__}'s MixedPrecisionPolicy has no param_dtype_override_fn")
    fn = lambda p: p.dtype  # noqa: E731
    converted = as_mp_policy(torch_fsdp.MixedPrecisionPolicy(param_dtype=torch.bfloat16, param_dtype_override_fn=fn),
                             "Linear")
    assert converted.param_dtype is torch.bfloat16 and converted.param_dtype_override_fn is fn


# ---------------------------------------------------------------------------------------------- finalization
def _manual(async_op: bool):
    def finish(model: nn.Module) -> None:
        handle = model.finalize_backward(async_op=async_op)
        if async_op:
            assert isinstance(handle, GradientReductionHandle)
            handle.wait()
        else:
            assert handle is None
    return finish


def _shard_manual(model: nn.Module, **kwargs) -> nn.Module:
    shard_blocks_then_root(model, mesh=mesh_1d(), **kwargs)
    model.set_manual_backward_finalization(True)
    return model


@scenario
def manual_and_async_finalization_match_the_reference():
    """Synced every backward, or accumulated without sync and reduced at finalize_backward: the same steps as
    one process (sync and async finalization, ZeRO-3 and ZeRO-2)."""
    losses = {}
    for async_op in (False, True):
        finish = _manual(async_op)
        losses[f"sync_async={async_op}"] = run_parity(build_gpt, _shard_manual, finish=finish).losses
        losses[f"accumulate_async={async_op}"] = run_parity(
            build_gpt, _shard_manual, finish=finish, micro_batches=2, global_batch=8).losses
    losses["zero2_accumulate"] = run_parity(
        build_gpt, lambda m: _shard_manual(m, reshard_after_forward=False), finish=_manual(True), micro_batches=2,
        global_batch=8).losses
    return losses


@scenario
def manual_finalization_defers_the_end_of_the_step():
    """A backward in manual mode leaves the root's gradients unreduced (its inputs need none: no post-backward)
    until finalize_backward; the blocks' reductions started during backward."""
    torch.manual_seed(0)
    model = _shard_manual(build_gpt())
    rank, world = dist.get_rank(), dist.get_world_size()
    gpt_loss(model, tuple(t.chunk(world)[rank] for t in gpt_batch(0, 4))).backward()
    # the last block reduced in backward (the first block's reduction may still be in flight)
    assert all(p.grad is not None for p in model.layers[-1].parameters())
    # the root shows its unsharded parameters, with autograd's gradients, until the step ends (as FSDP2 does)
    root = model._fullshard_unit.group.params
    assert all(p.sharded.grad is None for p in root), "the root reduced before finalize_backward"
    model.finalize_backward()
    assert all(isinstance(p, DTensor) and p.grad is not None for p in model.parameters())
    model.finalize_backward()  # again: nothing left, no error (FSDP2 allows it)
    return True


class _Fail(Exception):
    pass


def _expect(message: str):
    return pytest.raises(RuntimeError, match=message)


@scenario
def finalization_misuse_is_refused_with_fsdp2s_words():
    torch.manual_seed(0)
    model = shard_blocks_then_root(build_gpt(), mesh=mesh_1d())
    rank, world = dist.get_rank(), dist.get_world_size()
    batch = tuple(t.chunk(world)[rank] for t in gpt_batch(0, 4))
    assert model.finalize_backward() is None  # before the first forward: nothing to do
    model.finalize_backward(async_op=True).wait()
    gpt_loss(model, batch).backward()  # automatic mode
    with _expect("requires manual backward finalization"):
        model.finalize_backward()
    with _expect("must be called on the root"):
        model.layers[0].set_manual_backward_finalization(True)
    model.set_manual_backward_finalization(True)
    with _expect("finalize_backward must be called on the root"):
        model.layers[0].finalize_backward()

    seen = []

    def in_backward(module, grad_output):  # the head's and the last block's backward have begun
        for call in (lambda: model.set_manual_backward_finalization(False), model.finalize_backward):
            try:
                call()
            except RuntimeError as error:
                seen.append(str(error))

    hook = model.layers[0].register_full_backward_pre_hook(in_backward)
    gpt_loss(model, batch).backward()
    hook.remove()
    assert seen == ["set_manual_backward_finalization cannot change mode during backward",
                    "FSDP finalize_backward must be called after backward completes"], seen
    with _expect("cannot change mode after backward starts"):
        model.set_manual_backward_finalization(False)
    handle = model.finalize_backward(async_op=True)
    with _expect("previous gradient reduction must be waited on before finalizing backward again"):
        model.finalize_backward()
    with _expect("previous gradient reduction must be waited on before forward"):
        gpt_loss(model, batch)
    handle.wait()
    handle.wait()  # twice: nothing more

    gpt_loss(model, batch).backward()
    stale = model.finalize_backward(async_op=True)
    model.reset_iter_state()  # invalidates it
    with _expect("This gradient reduction handle was invalidated"):
        stale.wait()
    model.set_manual_backward_finalization(False)  # the reset ended the step: the mode may change again
    gpt_loss(model, batch).backward()  # automatic again
    assert all(p.grad is not None for p in model.parameters())
    return True


@scenario
def manual_mode_on_a_non_root_is_refused_at_the_first_forward():
    torch.manual_seed(0)
    model = build_gpt()
    for layer in model.layers:
        fully_shard(layer, mesh=mesh_1d())
    model.layers[0].set_manual_backward_finalization(True)  # not known to be a non-root yet
    fully_shard(model, mesh=mesh_1d())
    with _expect("set_manual_backward_finalization must be called on the root"):
        gpt_loss(model, gpt_batch(0, 2))
    return True


def _manual_without_sync(shard) -> tuple[list[bool], list]:
    """Manual finalization, two micro-batches without sync, then sync and finalize_backward (torchtitan's deferred
    reduction, resharding after each backward): whether the first layer (its input needs no gradient, so no
    post-backward runs for it) shows its shards after each backward; the gradients, checked against one process."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
    reference = copy.deepcopy(model)
    for module in (model[0], model[2], model):
        shard(module, mesh=mesh_1d())
    model.set_manual_backward_finalization(True)
    model.set_requires_gradient_sync(False)
    rank, world = dist.get_rank(), dist.get_world_size()
    gen, resharded = torch.Generator().manual_seed(5), []
    for _ in range(2):
        x = torch.randn(2 * world, 4, generator=gen)
        model(x.chunk(world)[rank]).pow(2).mean().backward()
        reference(x).pow(2).mean().backward()
        resharded.append(isinstance(model[0].weight, DTensor))
    model.set_requires_gradient_sync(True)
    model.finalize_backward()
    grads = [p.grad.full_tensor() for p in model.parameters()]
    for grad, ref in zip(grads, reference.parameters()):
        torch.testing.assert_close(grad, ref.grad, rtol=1e-5, atol=1e-6)
    return resharded, [g.tolist() for g in grads]


@scenario
def manual_finalization_without_sync_reshards_after_each_backward():
    """A unit without gradient sync ends each backward as in automatic mode, resharding (it stayed gathered
    until finalize_backward, across micro-batches); as FSDP2 2.15 does, with its gradients."""
    resharded, grads = _manual_without_sync(fully_shard)
    assert resharded == [True, True], resharded
    if TORCH_215:
        theirs = _manual_without_sync(torch_fsdp.fully_shard)
        assert theirs[0] == resharded
        torch.testing.assert_close(grads, theirs[1], rtol=0, atol=1e-6)
    return True


@scenario
def reset_iter_state_below_the_root_is_refused_and_keeps_the_gradients():
    """On a block it would abandon the root's whole step, gradients already reduced included: FSDP2's error,
    and nothing changes."""
    torch.manual_seed(0)
    model = shard_blocks_then_root(build_gpt(), mesh=mesh_1d())
    rank, world = dist.get_rank(), dist.get_world_size()
    gpt_loss(model, tuple(t.chunk(world)[rank] for t in gpt_batch(0, 4))).backward()
    before = [p.grad.to_local().clone() for p in model.parameters()]
    with _expect("reset_iter_state must be called on the root FSDP module"):
        model.layers[0].reset_iter_state()
    for grad, param in zip(before, model.parameters()):
        assert param.grad is not None and torch.equal(param.grad.to_local(), grad)
    return True


def _shared_context_story(shard, share) -> list[str]:
    """Two roots (pipeline stages) share one communication context; what each misuse raises, in order."""
    stages = []
    for seed in (0, 1):
        torch.manual_seed(seed)
        stage = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 4))
        shard(stage[0], mesh=mesh_1d())
        shard(stage, mesh=mesh_1d())
        stage.set_manual_backward_finalization(True)
        stages.append(stage)
    first, second = stages
    share(stages)
    assert first._get_fsdp_state()._comm_ctx is second._get_fsdp_state()._comm_ctx
    x = torch.randn(2, 4)
    seen = []

    def attempt(call) -> None:
        try:
            call()
            seen.append("ok")
        except RuntimeError as error:
            seen.append(str(error))

    for stage in stages:  # each a root that has finished a step
        stage(x).sum().backward()
        stage.finalize_backward()
    first(x).sum().backward()
    handle = first.finalize_backward(async_op=True)
    attempt(second.finalize_backward)
    attempt(lambda: second(x))
    attempt(second.reset_iter_state)
    handle.wait()
    attempt(second.finalize_backward)
    attempt(lambda: second(x).sum().backward())
    attempt(second.finalize_backward)
    try:
        share([first, nn.Linear(2, 2)])
    except ValueError as error:
        seen.append(str(error).split(" but got ")[0])
    return seen


@scenario
def roots_sharing_a_communication_context_wait_for_each_other():
    """``share_comm_ctx`` (pipeline stages): while one root's asynchronous finalization is outstanding, the
    others neither finalize, forward nor reset; the same errors as FSDP2 2.15, in the same order."""
    ours = _shared_context_story(fully_shard, fullshard.share_comm_ctx)
    assert ours == [
        "Another gradient reduction sharing this communication context must be waited on before finalizing "
        "backward",
        "The previous gradient reduction must be waited on before forward",
        "reset_iter_state cannot reset a gradient reduction owned by another FSDP root sharing the communication "
        "context",
        "ok", "ok", "ok", "Expects list of FSDPModules"], ours
    if TORCH_215:
        assert _shared_context_story(torch_fsdp.fully_shard, torch_fsdp.share_comm_ctx) == ours
    return True


def _pipeline_grads(shard, deferred: bool) -> list[list[float]]:
    """Two ranks, four stages (two per rank) of a 1-rank data-parallel mesh each, an interleaved 1F1B schedule
    that finalizes each stage's backward itself, its waits deferred or not; the stages' gradients per step."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("pp", "dp"))
    rank, stages, modules = dist.get_rank(), [], []
    for index in (rank, rank + 2):
        torch.manual_seed(index)
        module = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
        shard(module[0], mesh=mesh["dp"])
        shard(module, mesh=mesh["dp"])
        modules.append(module)
        stages.append(PipelineStage(module, index, 4, torch.device("cpu"), group=mesh.get_group("pp")))
    schedule = ScheduleInterleaved1F1B(stages, n_microbatches=4, loss_fn=lambda y, t: (y - t).pow(2).sum(),
                                       defer_reduce_grad_wait=deferred)
    gen, grads = torch.Generator().manual_seed(7), []
    for _ in range(2):
        x, target = torch.randn(8, 4, generator=gen), torch.randn(8, 4, generator=gen)
        schedule.step(x if rank == 0 else None, target=target if rank == 1 else None)
        grads.append([v for m in modules for p in m.parameters() for v in p.grad.full_tensor().flatten().tolist()])
        for m in modules:
            m.zero_grad()
    return grads


@scenario
def pipeline_schedules_that_defer_reduction_waits_match_fsdp2():
    """torch.distributed.pipelining 2.15's ``defer_reduce_grad_wait=True`` tells stages apart by their
    communication context (``_get_fsdp_state()._comm_ctx``; it raised AttributeError on fullshard's): the
    stages' gradients are FSDP2's, and the same as without deferring."""
    if not TORCH_215:
        return "skipped: the installed torch's pipelining has no defer_reduce_grad_wait"
    ours = _pipeline_grads(fully_shard, deferred=True)
    assert ours == _pipeline_grads(fully_shard, deferred=False)
    torch.testing.assert_close(ours, _pipeline_grads(torch_fsdp.fully_shard, deferred=True), rtol=0, atol=1e-6)
    return True


# ---------------------------------------------------------------------------------------------- kept storage
@contextlib.contextmanager
def _counting_unsharded_storage():
    """Owned unsharded storages fullshard allocates, and all-gathers it issues."""
    counts = {"storages": 0, "gathers": 0}
    original_allocate, original_gather = collectives.allocate, collectives.all_gather

    def allocate(*args, **kwargs):
        owned = original_allocate(*args, **kwargs)
        counts["storages"] += owned.what.startswith(("unsharded parameter", "unsharded ["))
        return owned

    def all_gather(*args, **kwargs):
        counts["gathers"] += 1
        return original_gather(*args, **kwargs)

    collectives.allocate, collectives.all_gather = allocate, all_gather
    try:
        yield counts
    finally:
        collectives.allocate, collectives.all_gather = original_allocate, original_gather


def _unsharded_bytes(model: nn.Module) -> int:
    """Bytes of unsharded parameter storage allocated now (views of gather outputs count their storage)."""
    storages = {}
    for module in model.modules():
        group = getattr(module, "_fullshard_unit", None) and module._fullshard_unit.group
        for param in group.params if group else ():
            if param.unsharded_data is not None:
                storage = param.unsharded_data.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def _steps(model: nn.Module, steps: int) -> list[dict[str, int]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pointers = []
    for step in range(steps):
        gpt_loss(model, tuple(t.chunk(world)[rank] for t in gpt_batch(step, 4))).backward()
        optimizer.step()
        optimizer.zero_grad()
        assert all(isinstance(p, DTensor) for p in model.parameters()), "the modules must show the shards"
        model.layers[0].unshard()
        pointers.append({n: p.data_ptr() for n, p in model.layers[0].named_parameters()})
        model.layers[0].reshard()
    return pointers


@scenario
def kept_unsharded_storage_keeps_its_addresses():
    """set_keep_unsharded_storage(True): resharding shows the shards but keeps the storage; every later gather
    fills the same storage (stable data pointers, no new allocation), and training still matches."""
    torch.manual_seed(0)
    kept = shard_blocks_then_root(build_gpt(), mesh=mesh_1d())
    kept.set_keep_unsharded_storage(True)
    torch.manual_seed(0)
    freed = shard_blocks_then_root(build_gpt(), mesh=mesh_1d())
    first = _steps(kept, 1) + _steps(freed, 1)  # every storage is allocated in the first step
    with _counting_unsharded_storage() as kept_counts:
        pointers = _steps(kept, 3)
    with _counting_unsharded_storage() as freed_counts:
        _steps(freed, 3)
    assert pointers[0] == pointers[1] == pointers[2] == first[0], pointers
    assert kept_counts["gathers"] == freed_counts["gathers"] > 0, (kept_counts, freed_counts)
    assert kept_counts["storages"] == freed_counts["storages"] == 0, (kept_counts, freed_counts)  # reused or regrown
    assert _unsharded_bytes(kept) > 0 and _unsharded_bytes(freed) == 0, (_unsharded_bytes(kept), _unsharded_bytes(freed))
    units = [m._fullshard_unit for m in kept.modules() if hasattr(m, "_fullshard_unit")]
    assert all(str(g.state) == "stale" for u in units for g in u.groups), [str(g.state) for u in units for g in u.groups]
    kept.set_keep_unsharded_storage(False, recurse=False)  # the root only
    assert not kept._fullshard_unit.group.keep_unsharded_storage
    assert kept.layers[0]._fullshard_unit.group.keep_unsharded_storage
    run_parity(build_gpt, lambda m: shard_blocks_then_root(m, mesh=mesh_1d()).set_keep_unsharded_storage(True))
    return kept_counts


# ---------------------------------------------------------------------------------------------- dtypes
class _Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.norm, self.out = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.norm(torch.relu(self.fc(x))))


def _normed_batch(step: int, batch: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch, 8, generator=g), torch.randn(batch, 4, generator=g)


def _mse(model, batch):
    x, y = batch
    return (model(x).float() - y).pow(2).mean()


@scenario
def param_dtype_override_fn_chooses_per_parameter():
    """An fp32 LayerNorm in a bf16 unit computes with fp32 weights (inputs still cast to bf16); overriding
    every parameter back to its own dtype trains exactly like the fp32 reference; other answers are refused."""
    seen, plain = {}, _Normed()
    norm = {id(p) for p in plain.norm.parameters()}
    keep_norm = lambda p: p.dtype if id(p) in norm else None  # noqa: E731
    model = fully_shard(plain, mesh=mesh_1d(),
                        mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, param_dtype_override_fn=keep_norm))
    model.norm.register_forward_pre_hook(lambda m, args: seen.update(norm=m.weight.dtype, input=args[0].dtype))
    model.out.register_forward_pre_hook(lambda m, args: seen.update(out=m.weight.dtype))
    _mse(model, _normed_batch(0, 2)).backward()
    assert seen == {"norm": torch.float32, "input": torch.bfloat16, "out": torch.bfloat16}, seen
    assert all(p.grad.dtype == torch.float32 for p in model.parameters())
    own = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False,
                               param_dtype_override_fn=lambda p: p.dtype)
    run_parity(_Normed, lambda m: fully_shard(m, mesh=mesh_1d(), mp_policy=own), make_batch=_normed_batch,
               loss_fn=_mse)
    for answer, message in ((torch.float16, "must return None, param_dtype, or the parameter's original dtype"),
                            ("bf16", "must return a torch.dtype or None")):
        plain = _Normed()
        with pytest.raises(ValueError, match=message):
            fully_shard(plain, mesh=mesh_1d(), mp_policy=MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, param_dtype_override_fn=lambda p, a=answer: a))
        assert not isinstance(plain, FSDPModule)  # refused before anything changed
    return True


@contextlib.contextmanager
def _reduce_scatter_dtypes():
    """The dtypes the backend's reduce-scatter carries (FULLSHARD_EXCHANGE=collective: gloo's own collective)."""
    saved = os.environ.get(EXCHANGE_ENV)
    os.environ[EXCHANGE_ENV] = "collective"
    names = [n for n in ("reduce_scatter_single", "reduce_scatter_tensor") if hasattr(dist, n)]
    originals = {n: getattr(dist, n) for n in names}
    dtypes: list[torch.dtype] = []

    def recording(name):
        def call(output, input, *args, **kwargs):
            dtypes.append(input.dtype)
            return originals[name](output, input, *args, **kwargs)
        return call

    for name in names:
        setattr(dist, name, recording(name))
    try:
        yield dtypes
    finally:
        for name, original in originals.items():
            setattr(dist, name, original)
        if saved is None:
            del os.environ[EXCHANGE_ENV]
        else:
            os.environ[EXCHANGE_ENV] = saved


def _one_backward(model: nn.Module) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    _mse(model, tuple(t.chunk(world)[rank] for t in _normed_batch(0, 4))).backward()


@scenario
def reduce_dtype_follows_the_installed_fsdp2():
    """param_dtype=bf16 and no reduce_dtype: fp32 parameters' gradients are reduced in fp32 from torch 2.15 on
    (the dtype they accumulate in), in bf16 on 2.13/2.14; an explicit reduce_dtype wins on every version. The
    values match the fp32 reference within bf16 compute either way."""
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    with _reduce_scatter_dtypes() as dtypes:
        _one_backward(fully_shard(_Normed(), mesh=mesh_1d(), mp_policy=bf16))
    expected = torch.float32 if TORCH_PROMOTES_REDUCE_DTYPE else torch.bfloat16
    assert dtypes and set(dtypes) == {expected}, dtypes
    with _reduce_scatter_dtypes() as explicit:
        _one_backward(fully_shard(_Normed(), mesh=mesh_1d(),
                                  mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)))
    assert set(explicit) == {torch.bfloat16}, explicit
    with _reduce_scatter_dtypes():
        run_parity(_Normed, lambda m: fully_shard(m, mesh=mesh_1d(), mp_policy=bf16), make_batch=_normed_batch,
                   loss_fn=_mse, micro_batches=2, global_batch=8, rtol=2e-2, atol=2e-2, param_atol=3e-2)
    return [str(d) for d in dtypes]


@scenario
def explicit_grad_dtype_is_reduced_and_kept_in_it():
    """Tensor.grad_dtype set before fully_shard (torch 2.15): fp64 for one parameter makes its group reduce in
    fp64 and its sharded gradient fp64; the others stay fp32."""
    if not TORCH_PROMOTES_REDUCE_DTYPE:
        return "skipped: the installed torch has no gradient dtype policies"
    torch.manual_seed(0)
    plain = _Normed()
    reference = copy.deepcopy(plain)
    plain.out.weight.grad_dtype = torch.float64
    with _reduce_scatter_dtypes() as dtypes:  # the exchange is chosen at fully_shard
        model = fully_shard(plain, mesh=mesh_1d(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        _one_backward(model)
    assert set(dtypes) == {torch.float64}, dtypes
    assert model.out.weight.grad.dtype == torch.float64
    assert model.fc.weight.grad.dtype == torch.float32
    _mse(reference, _normed_batch(0, 4)).backward()
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad.full_tensor().float(), ref.grad, rtol=2e-2, atol=2e-2, msg=name)
    return [str(d) for d in dtypes]


def _bf16_pair() -> nn.Module:
    """bf16 parameters; the last layer's weight asks for fp32 gradients (Tensor.grad_dtype, torch 2.15)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)).bfloat16()
    model[2].weight.grad_dtype = torch.float32
    return model


@scenario
def explicit_grad_dtype_on_a_bucket_member_leaves_the_others_in_theirs():
    """One parameter of a fused bucket with grad_dtype=fp32 (its layer's weight, the bucket's first member), the
    bias beside it without one, reduced in fp32: the reduced buffer is the weight's gradient as it is, but the
    bias's is cast to bf16. (Before, the bucket's first member alone decided, so the bias was handed the fp32
    buffer and backward failed: "attempting to assign a gradient with dtype 'float' to a tensor with grad_dtype
    'BFloat16'"; upstream's test_nested_device_conversion_with_grad found it.) Three SGD steps match one
    process, with and without an explicit reduce_dtype."""
    if not TORCH_PROMOTES_REDUCE_DTYPE:
        return "skipped: the installed torch has no gradient dtype policies"
    rank, world = dist.get_rank(), dist.get_world_size()
    expected = {"0.weight": torch.bfloat16, "0.bias": torch.bfloat16, "2.weight": torch.float32,
                "2.bias": torch.bfloat16}
    for reduce_dtype in (torch.float32, None):
        reference, model = _bf16_pair(), _bf16_pair()
        policy = MixedPrecisionPolicy(reduce_dtype=reduce_dtype)
        for layer in (model[0], model[2], model):
            fully_shard(layer, mesh=mesh_1d(), mp_policy=policy)
        buckets = model[2]._fullshard_unit.groups[0].plan.buckets
        assert [b.members for b in buckets] == [(0, 1)], buckets  # weight first, the bias beside it
        for step in range(3):
            batch = tuple(t.bfloat16() for t in _normed_batch(step, 4))
            _mse(model, tuple(t.chunk(world)[rank] for t in batch)).backward()
            _mse(reference, batch).backward()
            for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
                assert p.grad.dtype == ref.grad.dtype == expected[name], (name, p.grad.dtype, ref.grad.dtype)
                torch.testing.assert_close(p.grad.full_tensor().float(), ref.grad.float(), rtol=2e-2, atol=2e-2,
                                           msg=f"{name} at step {step}, reduce_dtype={reduce_dtype}")
            with torch.no_grad():
                for p, ref in zip(model.parameters(), reference.parameters()):
                    p.add_(p.grad.to(p.dtype), alpha=-0.1)
                    ref.add_(ref.grad.to(ref.dtype), alpha=-0.1)
                    p.grad = ref.grad = None
        for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
            torch.testing.assert_close(p.full_tensor().float(), ref.float(), rtol=2e-2, atol=2e-2, msg=name)
    return {name: str(dtype) for name, dtype in expected.items()}


@scenario(world_sizes=(4,))
def int_reshard_after_forward_on_an_unflattened_mesh_matches_the_reference():
    """A 1-D mesh made by ``_unflatten`` of the world mesh (its dim name, "fsdp", is not one of its root's), with
    reshard_after_forward=2 on 4 ranks (an int: backward gathers in blocks of 2): trains like one process. (On torch 2.15 the
    blocks were looked up by dim name in the root mesh and fully_shard raised "tuple.index(x): x not in tuple";
    upstream's test_shard_placement_fn_tp_ep found it.)"""
    from torch.distributed.device_mesh import init_device_mesh

    world = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("world",))
    mesh = world._unflatten(0, (dist.get_world_size(),), ("fsdp",))["fsdp"]
    from fullshard.torch import api

    result = run_parity(build_gpt, lambda m: shard_blocks_then_root(m, mesh=mesh, reshard_after_forward=2))
    assert any(key[-1] == 2 for key in api._POST_FORWARD_MESHES), "no block groups of 2 ranks were made"
    return result.losses


@scenario
def reset_iter_state_keeps_or_drops_reduced_gradients_as_the_installed_fsdp2():
    """torch 2.15's reset_iter_state drops the reduced sharded gradients; 2.13/2.14 keep them."""
    torch.manual_seed(0)
    model = fully_shard(_Normed(), mesh=mesh_1d())
    _one_backward(model)
    model.reset_iter_state()
    kept = [p.grad is not None for p in model.parameters()]
    assert kept == [not TORCH_PROMOTES_REDUCE_DTYPE] * len(kept), kept
    return kept


# ---------------------------------------------------------------------------------------------- released gather outputs
@contextlib.contextmanager
def _two_tensor_extensions(release=None, extensions=True):
    """torch's TwoTensor (two inner tensors, gathered separately) given the extension hooks for the test; the post
    hook copies out of the outputs, so releasing them after it is safe. ``release``: the value the 2.15 hook
    returns (None: no such hook); ``extensions=False``: neither pre nor post hook."""
    from torch.testing._internal.two_tensor import TwoTensor

    calls = {"post": 0, "refill": 0}

    def pre(self, mesh):
        return (self.a, self.b), None

    def post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        a, b = outputs
        if out is not None:
            calls["refill"] += 1
            out.a.copy_(a)
            out.b.copy_(b)
            return None
        calls["post"] += 1
        return TwoTensor(a.to(param_dtype, copy=True), b.to(param_dtype, copy=True)), ()

    hooks = {"fsdp_pre_all_gather": pre, "fsdp_post_all_gather": post_all_gather} if extensions else {}
    if release is not None:
        hooks["fsdp_should_release_all_gather_outputs_after_post_all_gather"] = lambda self: release
    for name, hook in hooks.items():
        setattr(TwoTensor, name, hook)
    try:
        yield calls
    finally:
        for name in hooks:
            delattr(TwoTensor, name)


def _two_tensor_stack():
    from torch.testing._internal.two_tensor import TwoTensor

    # no bias: see test_fsdp2's TwoTensor test
    model = nn.Sequential(*(nn.Linear(8, 8, bias=False) for _ in range(3)))
    for layer in model:
        layer.weight = nn.Parameter(TwoTensor(layer.weight.detach(), layer.weight.detach().clone()))
    return model


@contextlib.contextmanager
def _output_bytes_after_each_post_hook():
    """Right after each extended parameter's gather finished (post hook run): whether it was the first (the post hook
    built the tensor), the bytes of its raw gather outputs, and fullshard's meter of owned working bytes."""
    from fullshard.core.buffers import comm_bytes
    from fullshard.torch import extensions

    seen: list[tuple[bool, int, int]] = []
    original = extensions.PendingExtensionGather.finish

    def finish(self):
        unsharded = original(self)
        outputs = sum(o.tensor.untyped_storage().nbytes() for o in self.state.outputs)
        seen.append((unsharded is not None, outputs, comm_bytes()["working_live"]))
        return unsharded

    extensions.PendingExtensionGather.finish = finish
    try:
        yield seen
    finally:
        extensions.PendingExtensionGather.finish = original


def _train_released(release, steps: int = 3) -> tuple[list, list]:
    """Train the sharded TwoTensor stack against the unsharded one, gradient by gradient; the losses, and what
    ``_output_bytes_after_each_post_hook`` saw."""
    from torch.distributed.tensor import distribute_tensor

    with _two_tensor_extensions(release), _output_bytes_after_each_post_hook() as seen:
        torch.manual_seed(0)
        reference = _two_tensor_stack()
        model = copy.deepcopy(reference)
        for layer in model:
            fully_shard(layer, mesh=mesh_1d())
        fully_shard(model, mesh=mesh_1d())
        torch.manual_seed(42 + dist.get_rank())
        x, losses = torch.randn(2, 8), []
        for _ in range(steps):
            ref_loss, loss = reference(x).sum(), model(x).sum()
            torch.testing.assert_close(loss, ref_loss)
            ref_loss.backward()
            loss.backward()
            with torch.no_grad():
                for ref_param, param in zip(reference.parameters(), model.parameters()):
                    dist.all_reduce(ref_param.grad)
                    ref_param.grad.div_(dist.get_world_size())
                    expected = distribute_tensor(ref_param.grad, param.device_mesh, param.placements).to_local()
                    torch.testing.assert_close(param.grad.to_local(), expected)
                    ref_param -= 0.1 * ref_param.grad
                    param -= 0.1 * param.grad
                    ref_param.grad = param.grad = None
            losses.append(float(loss))
    return losses, seen


@scenario
def released_gather_outputs_are_freed_after_the_post_hook():
    """fsdp_should_release_all_gather_outputs_after_post_all_gather() True (FSDP2 2.15; honoured on every torch):
    the raw gather outputs fullshard owns are freed right after the post hook, the first time and on every
    refill (backward's regather), while the unsharded tensor lives; training matches the unsharded model. False
    or no hook keeps them until reshard."""
    released_losses, released = _train_released(True)
    kept_losses, kept = _train_released(False)
    assert released_losses == kept_losses == _train_released(None)[0], (released_losses, kept_losses)
    # 3 layers: built once each, then refilled in every later forward and every backward (reshard after forward)
    assert [first for first, _, _ in released].count(True) == 3 and len(released) == 3 * 2 * 3, released
    assert all(nbytes == 0 for _, nbytes, _ in released), released
    assert all(nbytes > 0 for _, nbytes, _ in kept), kept
    # the meter no longer counts them: each gather's working bytes are lower by exactly its outputs
    assert [r[2] + k[1] for r, k in zip(released, kept)] == [k[2] for k in kept], (released, kept)
    return released_losses


@scenario
def release_hook_misuse_is_refused_at_fully_shard():
    for kwargs, error, words in (
        ({"release": True, "extensions": False}, AssertionError,
         "requires fsdp_pre_all_gather and fsdp_post_all_gather"),
        ({"release": 1}, AssertionError, "must return a bool, got <class 'int'>"),
    ):
        with _two_tensor_extensions(**kwargs):
            model = _two_tensor_stack()
            with pytest.raises(error, match=words):
                fully_shard(model[0], mesh=mesh_1d())
    with _two_tensor_extensions(release=False):
        fully_shard(_two_tensor_stack()[0], mesh=mesh_1d())  # False is a bool: accepted


def test_released_gather_outputs_are_refused_with_an_int_reshard_after_forward():
    """reshard_after_forward=k (1 < k < the shard size) keeps the gather outputs' chunks after forward: with released
    outputs that is FSDP2 2.15's NotImplementedError at fully_shard. (Checked on the group's parameters directly:
    the 2-rank tests have no shard size above 2.)"""
    from types import SimpleNamespace

    from fullshard.torch.api import refuse_released_outputs_for_partial_reshard

    refuse_released_outputs_for_partial_reshard([SimpleNamespace(release_gather_outputs=False)])
    with pytest.raises(NotImplementedError, match="reshard_after_forward is an int"):
        refuse_released_outputs_for_partial_reshard([SimpleNamespace(release_gather_outputs=False),
                                                     SimpleNamespace(release_gather_outputs=True)])


# ---------------------------------------------------------------------------------------------- grad_dtype kept
def _grad_dtypes(model: nn.Module) -> dict[str, tuple]:
    """Each parameter's (dtype, explicit grad_dtype or 'unset', gradient dtype or None)."""
    return {name: (p.dtype, p.grad_dtype if p._has_grad_dtype_override else "unset",
                   None if p.grad is None else p.grad.dtype) for name, p in model.named_parameters()}


@scenario
def grad_dtype_survives_module_conversions():
    """Tensor.grad_dtype (torch 2.15): ``.bfloat16()`` converts the parameters, but a gradient whose dtype an explicit
    grad_dtype chose keeps it (and its values), and the policy stays on the rebuilt parameters; unset ones follow
    the new dtype. A grad_dtype set on a sharded parameter after fully_shard is adopted at the conversion. (Stock
    FSDP2 2.15 shows the same dtypes and values through the conversion; its next forward fails in its all-gather,
    "Expected out tensor to have dtype BFloat16", so the step after it is fullshard's own.)"""
    if not TORCH_PROMOTES_REDUCE_DTYPE:
        return "skipped: the installed torch has no gradient dtype policies"
    torch.manual_seed(0)
    plain = _Normed()
    plain.out.weight.grad_dtype = torch.float32  # explicit, equal to the parameter's dtype
    model = fully_shard(plain, mesh=mesh_1d())
    _one_backward(model)
    grad = model.out.weight.grad.to_local().clone()
    model.norm.weight.grad = None
    model.norm.weight.grad_dtype = torch.float64  # after fully_shard: adopted by the next conversion
    model.bfloat16()
    dtypes = _grad_dtypes(model)
    assert dtypes["out.weight"] == (torch.bfloat16, torch.float32, torch.float32), dtypes
    assert dtypes["fc.weight"] == (torch.bfloat16, "unset", torch.bfloat16), dtypes  # converted with its parameter
    assert dtypes["norm.weight"][1] == torch.float64, dtypes
    torch.testing.assert_close(model.out.weight.grad.to_local(), grad, rtol=0, atol=0)
    model.zero_grad()
    rank, world = dist.get_rank(), dist.get_world_size()
    _mse(model, tuple(t.chunk(world)[rank].bfloat16() for t in _normed_batch(0, 4))).backward()
    dtypes = _grad_dtypes(model)
    assert [dtypes[n][2] for n in ("out.weight", "fc.weight", "norm.weight")] == \
        [torch.float32, torch.bfloat16, torch.float64], dtypes
    return {name: str(d[2]) for name, d in dtypes.items()}


@scenario
def grad_dtype_survives_load_state_dict_with_assign():
    """load_state_dict(assign=True) puts new parameters in, without a grad_dtype: they show the policy at once, and
    their gradients are in it."""
    if not TORCH_PROMOTES_REDUCE_DTYPE:
        return "skipped: the installed torch has no gradient dtype policies"
    torch.manual_seed(0)
    plain = _Normed()
    plain.out.weight.grad_dtype = torch.float64
    model = fully_shard(plain, mesh=mesh_1d())
    before = model.out.weight
    model.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()}, assign=True)
    assert model.out.weight is not before and model.out.weight.grad_dtype == torch.float64, _grad_dtypes(model)
    assert _grad_dtypes(model)["fc.weight"][1] == "unset"
    _one_backward(model)
    dtypes = _grad_dtypes(model)
    assert dtypes["out.weight"][2] == torch.float64 and dtypes["fc.weight"][2] == torch.float32, dtypes
    return {name: str(d[2]) for name, d in dtypes.items()}


# ---------------------------------------------------------------------------------------------- unused parameters
class _Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.expert, self.out = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x, use_expert: bool):
        h = torch.relu(self.fc(x))
        return self.out(h + self.expert(h) if use_expert else h)


@scenario
def unused_parameters_with_grad_dtype_none_reduce_without_a_reduce_dtype():
    """FSDP2 2.15 refuses set_reduce_scatter_unused_params(True) for a parameter with grad_dtype=None and no
    reduce_dtype (ValueError at backward): its ranks could make zero gradients in another dtype than the real
    ones. fullshard's reduction dtype is planned from the configuration, the same on every rank, and a missing
    gradient is a zero cast into it like any other, so fullshard reduces it (docs/fsdp2-compatibility.md): rank 0
    uses the expert, rank 1 does not, and the gradients match the single-process reference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    reference = _Branchy()
    plain = copy.deepcopy(reference)
    if TORCH_PROMOTES_REDUCE_DTYPE:
        plain.expert.weight.grad_dtype = None  # any dtype autograd gives
    # one unit: it runs forward on every rank; the expert's parameters get no gradient on rank 1
    model = fully_shard(plain, mesh=mesh_1d(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    model.set_reduce_scatter_unused_params(True)
    batches = [_normed_batch(step, 2) for step in range(world)]
    _mse(lambda x: model(x, rank == 0), batches[rank]).backward()
    sum(_mse(lambda x: reference(x, r == 0), batches[r]) for r in range(world)).div(world).backward()
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        assert param.grad is not None, name
        torch.testing.assert_close(param.grad.full_tensor().float(), ref.grad, rtol=2e-2, atol=2e-2, msg=name)
    return {name: str(p.grad.dtype) for name, p in model.named_parameters()}


@scenario(world_sizes=(4,))
def manual_finalization_after_hsdp_partial_sums_matches_the_reference():
    """HSDP (2 replicas x 2 shards), manual finalization, micro-batches whose replica all-reduce is skipped but for
    the last (torchtitan's pattern): finalize_backward completes the step like one process; without the last
    all-reduce it is refused with FSDP2's words."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    model = copy.deepcopy(reference)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.set_manual_backward_finalization(True)
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(3)
    for step in range(2):
        batches = [torch.randn(2 * world, 8, generator=gen) for _ in range(2)]
        for micro, x in enumerate(batches):
            model.set_requires_all_reduce(micro == len(batches) - 1)
            model(x.chunk(world)[rank]).pow(2).mean().div(len(batches)).backward()
            reference(x).pow(2).mean().div(len(batches)).backward()
        model.finalize_backward()
        for p, r in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p.grad.full_tensor(), r.grad, rtol=1e-5, atol=1e-6)
        for m in (model, reference):
            with torch.no_grad():
                for p in m.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
    model.set_requires_all_reduce(False)
    model(torch.randn(2, 8)).sum().backward()
    with _expect("requires all-reduce|does not support partial gradient reductions"):
        model.finalize_backward()
    return True


@scenario
def manual_finalization_refuses_a_partial_sum_still_being_reduced():
    """One unit on a 2-replica HSDP mesh, its replica all-reduce off: the partial sum comes from the reduction the
    backward started, still in flight at finalize_backward, which FSDP2 refuses (fullshard let it through once,
    leaving no gradients)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = fully_shard(nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2)), mesh=mesh)
    model.set_manual_backward_finalization(True)
    model.set_requires_all_reduce(False)
    model(torch.randn(3, 4, requires_grad=True)).sum().backward()
    for _ in range(2):
        with _expect("does not support partial gradient reductions for parameter group '<root>'"):
            model.finalize_backward()
    model.reset_iter_state()  # gives the partial sums back: later scenarios count the bytes fullshard holds
    return True


# ---------------------------------------------------------------------------------------------- pending gradients
class _TwoLinear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.first(x) + self.second(x)


def _pending_grads(shard_api, mp_policy) -> tuple[list, list, int]:
    """Two backwards without sync (the first block's pending gradient cleared by the user after the first), then
    one with: after each, what the modules show (the gradients, while not synced, and on torch 2.15 the dtype the
    shown parameters hold gradients in); the reduced gradients; the most bytes fullshard held in accumulators of
    its own meanwhile."""
    torch.manual_seed(0)
    model = _TwoLinear()
    mesh, rank = mesh_1d(), dist.get_rank()
    shard_api.fully_shard([model.first, model.second], mesh=mesh, reshard_after_forward=False, mp_policy=mp_policy)
    shard_api.fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    model.set_reshard_after_backward(False)
    shown, held, kept = [], 0, []
    for step, (sync, value) in enumerate(((False, 2.0), (False, 3.0), (True, 1.0))):
        model.set_requires_gradient_sync(sync)
        model(torch.full((1, 4), value * (rank + 1))).sum().backward()
        held = max(held, collectives.comm_bytes()["main_grad_live"])
        grads = [p.grad for p in model.parameters()]
        shown.append({"grad_dtype": [str(getattr(p, "grad_dtype", "-")) for p in model.parameters()]})
        if not sync:
            shown[-1]["grads"] = [None if g is None else (str(g.dtype), g.float().tolist()) for g in grads]
            kept.append(grads)
        if step == 0:
            model.first.zero_grad(set_to_none=True)
    if kept[0][1] is not None:  # the later backward summed into the gradient the module showed: the same tensor
        assert kept[1][1] is kept[0][1], "the second backward replaced the pending gradient instead of summing into it"
    model.first.reshard()
    return shown, [p.grad.full_tensor().float().tolist() for p in model.parameters()], held


@scenario
def pending_gradients_are_where_the_installed_fsdp2_leaves_them():
    """Between backwards without sync, each module shows the pending (unreduced) gradient where torch's own FSDP2
    does, in the same dtype, and a user clearing it clears it from the reduction: on torch 2.15 always (in the
    reduce dtype, summed by autograd: fullshard holds no accumulator), on 2.13/2.14 only where it is already in
    the reduce dtype (otherwise both keep it apart, and the clearing misses it). FSDP2 side by side, and the
    values worked out by hand: x = value * (rank + 1), the mean over 2 ranks."""
    rank = dist.get_rank()
    cases = {
        "compute bf16, reduce fp32": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        "compute fp32, reduce bf16": MixedPrecisionPolicy(reduce_dtype=torch.bfloat16),
        "compute bf16, reduce default": MixedPrecisionPolicy(param_dtype=torch.bfloat16),
    }
    shown_by = {}
    for case, policy in cases.items():
        theirs = torch_fsdp.MixedPrecisionPolicy(param_dtype=policy.param_dtype, reduce_dtype=policy.reduce_dtype)
        expected_shown, expected_reduced, _ = _pending_grads(torch_fsdp, theirs)
        shown, reduced, held = _pending_grads(fullshard, policy)
        assert shown == expected_shown, (case, shown, expected_shown)
        assert reduced == expected_reduced, (case, reduced, expected_reduced)
        visible = shown[1]["grads"][1] is not None
        # on 2.15 every case shows it; before, only a gradient already in the reduce dtype (bf16 by default)
        assert visible == (TORCH_PROMOTES_REDUCE_DTYPE or case == "compute bf16, reduce default"), case
        first_value = 4.0 if visible else 6.0  # 3 + 1 where the user could clear step 0's pending 2, or 2 + 3 + 1
        assert reduced == [[[first_value * 1.5] * 4] * 4, [[6.0 * 1.5] * 4] * 4], (case, reduced)
        if visible:
            pending = shown[1]["grads"]
            assert [values for _, values in pending] == [[[3.0 * (rank + 1)] * 4] * 4, [[5.0 * (rank + 1)] * 4] * 4]
            reduce_dtype = policy.reduce_dtype or (torch.float32 if TORCH_PROMOTES_REDUCE_DTYPE else torch.bfloat16)
            assert {dtype for dtype, _ in pending} == {str(reduce_dtype)}, (case, pending)
            assert held == 0, (case, "autograd sums the pending gradients: fullshard holds no accumulator")
        else:
            assert held > 0, (case, "an accumulator of fullshard's own holds the hidden pending gradients")
        shown_by[case] = visible
    return shown_by


@scenario
def a_synced_backward_gives_gradients_in_the_compute_dtype():
    """torch 2.15, bf16 compute reducing in fp32: a backward that reduces hands fullshard autograd's bf16
    gradients (packed into the fp32 reduction, with no fp32 copy of each first), and the shown parameters hold
    fp32 between backwards, as FSDP2 2.15; a backward that only accumulates sums in fp32."""
    if not TORCH_PROMOTES_REDUCE_DTYPE:
        return "skipped: the installed torch has no gradient dtype policies"
    torch.manual_seed(0)
    model = _TwoLinear()
    fully_shard(model, mesh=mesh_1d(), reshard_after_forward=False,
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    model.set_reshard_after_backward(False)
    arrived = []
    model(torch.ones(1, 4))  # leaves the modules showing the unsharded parameters, which autograd sums into
    hooks = [p.register_post_accumulate_grad_hook(lambda p: arrived.append(p.grad.dtype)) for p in model.parameters()]
    for sync in (True, False, False, True):
        model.set_requires_gradient_sync(sync)
        model(torch.ones(1, 4)).sum().backward()
        assert {p.grad_dtype for p in model.parameters()} == {torch.float32}
    for hook in hooks:
        hook.remove()
    assert arrived == [torch.bfloat16] * 2 + [torch.float32] * 6, arrived
    return [str(d) for d in arrived]


@scenario
def a_no_op_conversion_keeps_the_pending_gradient():
    """``model.to(device)`` to where the model already is, between backwards without sync, re-wraps the shards'
    storage without changing it: nothing is re-adopted (the shard keeps its bytes), the pending gradient stays
    the one the module showed, and the next synced backward reduces both backwards' sum (by hand: 2 + 1 times
    rank + 1, the mean over 2 ranks)."""
    rank = dist.get_rank()
    model = nn.Linear(4, 4, bias=False)
    fully_shard(model, mesh=mesh_1d(),
                mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16))
    sharded, address = model.weight, model.weight.to_local().data_ptr()
    model.set_requires_gradient_sync(False)
    model(torch.full((1, 4), 2.0 * (rank + 1))).sum().backward()
    model.unshard()
    pending = model.weight.grad
    model.reshard()
    model.to(device="cpu")
    assert model.weight is sharded and sharded.to_local().data_ptr() == address, "the shard was re-adopted"
    model.unshard()
    assert model.weight.grad is pending, "the no-op conversion lost the pending gradient"
    model.reshard()
    model.set_requires_gradient_sync(True)
    model(torch.full((1, 4), 1.0 * (rank + 1))).sum().backward()
    reduced = model.weight.grad.full_tensor()
    assert torch.equal(reduced, torch.full((4, 4), 3.0 * 1.5)), reduced
    return reduced.tolist()


class _Chain(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x))


def _frozen_between_micro_batches(shard_api, mp_policy, clear: bool) -> dict:
    """No sync, freeze ``a``, no sync (the user may clear everything pending), unfreeze, sync: what the module
    shows after each backward without sync, and the reduced gradients."""
    torch.manual_seed(0)
    model, rank = _Chain(), dist.get_rank()
    shard_api.fully_shard(model, mesh=mesh_1d(), mp_policy=mp_policy)
    record: dict = {"shown": []}
    for step, (sync, frozen) in enumerate(((False, False), (False, True), (True, False))):
        model.a.weight.requires_grad_(not frozen)
        model.set_requires_gradient_sync(sync)
        model(torch.full((1, 4), (step + 1.0) * (rank + 1))).sum().backward()
        if not sync:
            model.unshard()
            record["shown"].append([(None if p.grad is None else (str(p.grad.dtype), p.grad.float().tolist()),
                                     str(getattr(p, "grad_dtype", "-"))) for p in model.parameters()])
            if clear and step == 1:
                model.zero_grad(set_to_none=True)
            model.reshard()
    record["reduced"] = [p.grad.full_tensor().float().tolist() for p in model.parameters()]
    return record


@scenario
def a_parameter_frozen_between_micro_batches_keeps_the_pending_gradients():
    """Freezing a parameter between backwards without sync plans its unit afresh (the buckets split by
    trainability) and rebuilds the unsharded parameters: their pending gradients go to the new ones, so the module
    shows them and a user's zero_grad clears them as in FSDP2, side by side (they went into an accumulator of
    fullshard's own, out of the user's reach, and a cleared step was still reduced). The frozen parameter's
    unsharded grad_dtype is the reduce dtype again after the backward that gave it no gradient (torch 2.15)."""
    cases = {"bf16 compute, fp32 reduce": (torch.bfloat16, torch.float32),
             "bf16 compute, bf16 reduce": (torch.bfloat16, torch.bfloat16), "fp32": (None, None)}
    cleared = {}
    for case, (param_dtype, reduce_dtype) in cases.items():
        for clear in (False, True):
            theirs = _frozen_between_micro_batches(
                torch_fsdp, torch_fsdp.MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype), clear)
            ours = _frozen_between_micro_batches(
                fullshard, MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype), clear)
            assert ours == theirs, (case, clear, ours, theirs)
        visible = ours["shown"][1][0][0] is not None
        assert visible == (TORCH_PROMOTES_REDUCE_DTYPE or param_dtype == reduce_dtype), (case, ours["shown"])
        cleared[case] = visible
    return cleared


def _grad_dtype_after_fully_shard(shard_api) -> list:
    torch.manual_seed(0)
    model, rank = _Chain().to(torch.bfloat16), dist.get_rank()
    shard_api.fully_shard(model, mesh=mesh_1d())
    for p in model.parameters():
        p.grad_dtype = torch.float32
    for step, sync in enumerate((False, True)):
        model.set_requires_gradient_sync(sync)
        model(torch.full((1, 4), step + 1.0 + rank, dtype=torch.bfloat16)).float().pow(2).mean().backward()
    return [(str(p.grad.dtype), p.grad.full_tensor().tolist()) for p in model.parameters()]


@scenario
def grad_dtype_set_after_fully_shard_counts_from_the_first_forward():
    """torch 2.15: a grad_dtype set on the sharded parameters after fully_shard, before the first forward, is their
    policy from then on, as FSDP2 2.15 reads it at its lazy init (fullshard read it only at a conversion, and the
    reduced bf16 gradient met a parameter wanting fp32: a RuntimeError at the synced backward)."""
    if not TORCH_PROMOTES_REDUCE_DTYPE:
        return "skipped: the installed torch has no gradient dtype policies"
    ours, theirs = _grad_dtype_after_fully_shard(fullshard), _grad_dtype_after_fully_shard(torch_fsdp)
    assert ours == theirs, (ours, theirs)
    assert {dtype for dtype, _ in ours} == {"torch.float32"}, ours
    return ours
