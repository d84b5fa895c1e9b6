"""Bad input gets a clear error and leaves the model unchanged (issue 7); 2 gloo ranks."""
from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

import fullshard.torch.group as group_module
from fullshard import FSDPModule, MixedPrecisionPolicy, fully_shard
from fullshard.core.checks import RanksDisagree
from fullshard.models.gpt import GPT, GPTConfig
from tests.conftest import Launch, scenario
from tests.torch.parity import build_gpt, mesh_1d, run_parity, shard_blocks_then_root

LAUNCH = Launch(world_sizes=(2,))


def _unchanged(model: nn.Module, cls: type) -> None:
    assert type(model) is cls and not isinstance(model, FSDPModule), "model class was changed"
    assert not any(isinstance(p, DTensor) for p in model.parameters()), "parameters were sharded"
    assert not hasattr(model, "_fullshard_unit")


def _raises(match: str, fn, *args, **kwargs):
    with pytest.raises((ValueError, TypeError)) as info:
        fn(*args, **kwargs)
    assert any(word in str(info.value) for word in match.split("|")), str(info.value)
    return str(info.value)


@scenario
def twice_on_one_module():
    model = nn.Linear(4, 4)
    fully_shard(model, mesh=mesh_1d())
    return _raises("already applied", fully_shard, model, mesh=mesh_1d())


@scenario
def child_after_parent():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(model, mesh=mesh_1d())
    message = _raises("children first", fully_shard, model[0], mesh=mesh_1d())
    assert not isinstance(model[0], FSDPModule)
    return message


@scenario
def module_without_parameters_is_allowed():
    model = nn.Sequential(nn.ReLU(), nn.Linear(4, 2))
    fully_shard(model[0], mesh=mesh_1d())  # a unit with nothing to shard: hooks only
    fully_shard(model, mesh=mesh_1d())
    model(torch.randn(3, 4)).sum().backward()
    assert isinstance(model[1].weight.grad, DTensor)
    return True


@scenario
def mesh_of_wrong_dimension():
    mesh3d = init_device_mesh("cpu", (1, 1, dist.get_world_size()))
    model = nn.Linear(4, 4)
    message = _raises("1-D|2-D", fully_shard, model, mesh=mesh3d)
    _unchanged(model, nn.Linear)
    mesh2d = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("replicate", "shard"))
    _raises("no_shard", fully_shard, model, mesh=mesh2d, strategy="no_shard")
    _unchanged(model, nn.Linear)
    return message


@scenario
def bad_shard_placement_fn():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    first = _raises("Shard(dim)", fully_shard, model, mesh=mesh_1d(), shard_placement_fn=lambda p: Replicate())
    assert "0.weight" in first
    second = _raises("out of range|must be in", fully_shard, model, mesh=mesh_1d(), shard_placement_fn=lambda p: Shard(5))
    _unchanged(model, nn.Sequential)
    return [first, second]


@scenario
def bad_policies():
    model = nn.Linear(4, 4)
    messages = [
        _raises("param_dtype", fully_shard, model, mesh=mesh_1d(), mp_policy=MixedPrecisionPolicy(param_dtype=torch.int32)),
        _raises("reduce_dtype", fully_shard, model, mesh=mesh_1d(), mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.int64)),
        _raises("mp_policy", fully_shard, model, mesh=mesh_1d(), mp_policy="bf16"),
        _raises("offload_policy", fully_shard, model, mesh=mesh_1d(), offload_policy=True),
        _raises("strategy", fully_shard, model, mesh=mesh_1d(), strategy="zero9"),
        _raises("reshard_after_forward", fully_shard, model, mesh=mesh_1d(), reshard_after_forward="yes"),
    ]
    _unchanged(model, nn.Linear)
    return messages


@scenario
def ignored_params_of_other_modules_are_accepted():
    """One ignored set for a whole model (DDP on A and C, fully_shard on B), as FSDP2 accepts it."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    others = set(model[0].parameters()) | set(model[2].parameters())
    fully_shard(model[1], mesh=mesh_1d(), ignored_params=others)
    assert all(isinstance(p, DTensor) for p in model[1].parameters())
    assert not any(isinstance(p, DTensor) for p in others)
    return True


@scenario
def ignored_params_stay_local():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(model, mesh=mesh_1d(), ignored_params={model[1].bias})
    assert isinstance(model[0].weight, DTensor) and not isinstance(model[1].bias, DTensor)
    model(torch.randn(2, 4)).sum().backward()
    assert model[1].bias.grad is not None and not isinstance(model[1].bias.grad, DTensor)
    return True


@scenario
def frozen_mixed_with_trainable_works():
    def build():
        model = build_gpt()
        model.wpe.weight.requires_grad_(False)
        for layer in model.layers:
            layer.ln1.weight.requires_grad_(False)
            layer.attn.qkv.weight.requires_grad_(False)
        return model

    mesh = mesh_1d()
    saved = group_module.DEFAULT_FUSE_BELOW_NUMEL
    try:
        for fuse_below in (saved, 0):  # frozen and trainable in separate buckets, fused or not
            group_module.DEFAULT_FUSE_BELOW_NUMEL = fuse_below
            run_parity(build, lambda m: shard_blocks_then_root(m, mesh=mesh))
    finally:
        group_module.DEFAULT_FUSE_BELOW_NUMEL = saved
    return True


def _rank_1_differs(setting: str, build) -> dict:
    """``build(odd)`` wraps a small GPT, differently where ``odd`` (on rank 1). At the first forward every rank
    raises one RanksDisagree naming ``setting`` before any collective the setting changes; the process group
    still works after it. Returns the message and the seconds to the error."""
    model = build(dist.get_rank() == 1)
    start = time.perf_counter()
    with pytest.raises(RanksDisagree) as info:
        model(torch.randint(0, 64, (2, 16)))
    seconds = time.perf_counter() - start
    assert seconds < 10, seconds  # a hang would wait out the 60 s collective timeout
    message = str(info.value)
    assert f"ranks disagree on {setting} of " in message and " on rank 1;" in message, message
    total = torch.ones(1)
    dist.all_reduce(total)
    assert total.item() == dist.get_world_size()
    return {"message": message, "seconds": seconds}


def _small_gpt(width: int = 32) -> nn.Module:
    return GPT(GPTConfig(vocab_size=64, seq_len=16, d_model=width, n_layers=2, n_heads=4))


@scenario
def ranks_with_different_models_fail_at_first_step():
    return _rank_1_differs("shape", lambda odd: shard_blocks_then_root(_small_gpt(40 if odd else 32), mesh=mesh_1d()))


@scenario
def ranks_with_different_exchanges_fail_at_first_step():
    """FULLSHARD_EXCHANGE set on one rank only: a clear error on every rank, not a hang."""
    import os

    from fullshard.plan.exchange import EXCHANGE_ENV

    def build(odd):
        if odd:
            os.environ[EXCHANGE_ENV] = "collective"
        try:
            return shard_blocks_then_root(_small_gpt(), mesh=mesh_1d())
        finally:
            os.environ.pop(EXCHANGE_ENV, None)
    result = _rank_1_differs("exchange", build)
    assert "FULLSHARD_EXCHANGE alike" in result["message"]
    return result


@scenario
def ranks_with_different_strategies_fail_at_first_step():
    return _rank_1_differs("strategy", lambda odd: shard_blocks_then_root(
        _small_gpt(), mesh=mesh_1d(), strategy="optim" if odd else "optim_grads_params"))


@scenario
def ranks_with_different_resharding_fail_at_first_step():
    """Only the blocks differ (the root keeps its parameters after forward either way)."""
    def build(odd):
        model = _small_gpt()
        for layer in model.layers:
            fully_shard(layer, mesh=mesh_1d(), reshard_after_forward=not odd)
        return fully_shard(model, mesh=mesh_1d())
    return _rank_1_differs("reshard_after_forward", build)


@scenario
def ranks_with_different_reduce_dtypes_fail_at_first_step():
    policy = MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)
    return _rank_1_differs("reduce_dtype", lambda odd: shard_blocks_then_root(
        _small_gpt(), mesh=mesh_1d(), mp_policy=policy if odd else MixedPrecisionPolicy()))


@scenario
def ranks_with_different_param_dtypes_fail_at_first_step():
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    return _rank_1_differs("param_dtype", lambda odd: shard_blocks_then_root(
        _small_gpt(), mesh=mesh_1d(), mp_policy=policy if odd else MixedPrecisionPolicy()))


@scenario
def ranks_with_different_fusion_fail_at_first_step():
    def build(odd):
        saved = group_module.DEFAULT_FUSE_BELOW_NUMEL
        group_module.DEFAULT_FUSE_BELOW_NUMEL = 0 if odd else saved
        try:
            return shard_blocks_then_root(_small_gpt(), mesh=mesh_1d())
        finally:
            group_module.DEFAULT_FUSE_BELOW_NUMEL = saved
    return _rank_1_differs("fuse_below_numel", build)


@scenario
def ranks_with_different_meshes_fail_at_first_step():
    """Rank 1 shards over a 2-D (replicate, shard) mesh of the same ranks: the check meets on the world group,
    which no mesh changes. Both meshes are made on every rank, as making a mesh's groups needs."""
    meshes = [mesh_1d(), init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("replicate", "shard"))]
    return _rank_1_differs("mesh", lambda odd: shard_blocks_then_root(_small_gpt(), mesh=meshes[odd]))


@scenario
def ranks_with_different_trainability_fail_at_first_step():
    """Frozen after fully_shard (as fine-tuning does), on rank 1 only."""
    def build(odd):
        model = shard_blocks_then_root(_small_gpt(), mesh=mesh_1d())
        model.layers[0].ln1.weight.requires_grad_(not odd)
        return model
    return _rank_1_differs("requires_grad", build)


@scenario
def ranks_with_different_shard_dims_fail_at_first_step():
    return _rank_1_differs("shard dim", lambda odd: shard_blocks_then_root(
        _small_gpt(), mesh=mesh_1d(), shard_placement_fn=lambda p: Shard(1) if odd and p.ndim == 2 else None))


DISAGREEMENTS = [
    ranks_with_different_models_fail_at_first_step, ranks_with_different_exchanges_fail_at_first_step,
    ranks_with_different_strategies_fail_at_first_step, ranks_with_different_resharding_fail_at_first_step,
    ranks_with_different_reduce_dtypes_fail_at_first_step, ranks_with_different_param_dtypes_fail_at_first_step,
    ranks_with_different_fusion_fail_at_first_step, ranks_with_different_meshes_fail_at_first_step,
    ranks_with_different_trainability_fail_at_first_step, ranks_with_different_shard_dims_fail_at_first_step,
]


@scenario
def misuse_raises_the_types_fsdp2_raises():
    """Clients catch FSDP2's exception types; fullshard's errors are instances of those (and of its own)."""
    import copy

    model = nn.Linear(4, 4)
    fully_shard(model, mesh=mesh_1d())
    checks = []
    for kind, call in (
        (AssertionError, lambda: fully_shard(model, mesh=mesh_1d())),
        (AssertionError, lambda: copy.deepcopy(model)),
        (AssertionError, lambda: fully_shard(nn.Linear(4, 4), mesh=mesh_1d(), shard_placement_fn=lambda p: Shard(2))),
        (AssertionError, lambda: fully_shard(nn.Linear(4, 4), mesh=init_device_mesh("cpu", (1, dist.get_world_size())))),
        (ValueError, lambda: fully_shard(_with_scalar(), mesh=mesh_1d())),
        (TypeError, lambda: model.set_reduce_scatter_max_input_buffers(2.5)),
        (TypeError, lambda: model.set_reduce_scatter_max_input_buffers(True)),
        (ValueError, lambda: model.set_reduce_scatter_max_input_buffers(0)),
    ):
        with pytest.raises(kind) as info:
            call()
        checks.append(f"{type(info.value).__name__}: {str(info.value)[:60]}")
    with pytest.warns(UserWarning, match="ignores it"):
        model.set_reduce_scatter_max_input_buffers(2)
    hsdp = init_device_mesh("cpu", (1, dist.get_world_size()), mesh_dim_names=("replicate", "shard"))
    replicated = fully_shard(nn.Linear(4, 4), mesh=hsdp)
    with pytest.raises(ValueError, match="^stream cannot be set when using native HSDP$"):
        replicated.set_all_reduce_hook(lambda out: None, stream=torch.cpu.Stream())
    return checks


def _with_scalar() -> nn.Module:
    model = nn.Linear(4, 4)
    model.register_parameter("scale", nn.Parameter(torch.tensor(1.0)))
    return model


@scenario
def meta_parameters_are_named_at_the_first_forward():
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    for unit in (model[0], model[1], model):
        fully_shard(unit, mesh=mesh_1d())
    with pytest.raises(RuntimeError, match=r"still on meta device: \['0.weight', '0.bias'\];"):  # the first unit's
        model(torch.randn(2, 4))
    model.to_empty(device="cpu")
    with torch.no_grad():
        for param in model.parameters():
            param.fill_(0.5)
    assert model(torch.ones(2, 4)).shape == (2, 2)  # materialized: the next forward checks again and runs
    return True


@scenario
def all_reduce_hook_runs_on_the_given_stream():
    stream, seen = torch.cpu.Stream(), []
    model = fully_shard(nn.Linear(4, 4), mesh=mesh_1d())
    model.set_all_reduce_hook(lambda out: seen.append(torch.cpu.current_stream() == stream), stream=stream)
    model(torch.randn(2, 4)).sum().backward()
    assert seen and all(seen), seen
    return len(seen)


@scenario
def nonfinite_gradient_is_reported_by_name():
    from fullshard import set_check_finite

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    fully_shard(model[0], mesh=mesh_1d())
    fully_shard(model, mesh=mesh_1d())
    set_check_finite(True)
    try:
        x = torch.randn(2, 4)
        if dist.get_rank() == 1:
            x[0, 0] = float("nan")
        with pytest.raises(FloatingPointError, match=r"'1\.(weight|bias)' on group rank 1"):
            model(x).sum().backward()
        model.zero_grad()
        model(torch.randn(2, 4)).sum().backward()  # clean steps pass
    finally:
        set_check_finite(False)
    return True


SUITE_EXTRA = [nonfinite_gradient_is_reported_by_name]


@scenario
def second_thread_during_backward_is_detected():
    import threading

    model = shard_blocks_then_root(build_gpt(), mesh=mesh_1d())
    tokens = torch.randint(0, 64, (2, 16))
    caught = []

    def intruder():
        try:
            model(tokens)
        except RuntimeError as error:
            caught.append(str(error))

    def during_backward(grad):
        thread = threading.Thread(target=intruder)
        thread.start()
        thread.join()
        return grad

    def hook_block_output(module, inputs, output):  # a point deep inside backward: this output's gradient
        output.register_hook(during_backward)

    handle = model.layers[0].register_forward_hook(hook_block_output)
    model(tokens).sum().backward()
    handle.remove()
    assert caught and "another thread" in caught[0], caught
    model(tokens).sum().backward()  # the owning thread carries on
    return caught[0]


SUITE_EXTRA.append(second_thread_during_backward_is_detected)


@scenario
def unequal_batches_are_reported_when_checked():
    from fullshard import set_check_inputs

    model = shard_blocks_then_root(build_gpt(), mesh=mesh_1d())
    set_check_inputs(True)
    try:
        model(torch.randint(0, 64, (2, 16))).sum().backward()  # equal: fine
        batch = 2 if dist.get_rank() == 0 else 3
        with pytest.raises(ValueError, match="same size") as info:
            model(torch.randint(0, 64, (batch, 16)))
    finally:
        set_check_inputs(False)
    return str(info.value)


SUITE_EXTRA.append(unequal_batches_are_reported_when_checked)
