"""Parity (issue 2): fully_shard on 2 gloo ranks trains like a single-process reference (``tests/torch/parity.py``),
across wrappings, precisions, shapes and FSDP2's controls."""
from __future__ import annotations

import copy
import functools

import pytest

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.tensor import DTensor, Shard

import fullshard.torch.group as group_module
from fullshard import FSDPModule, MixedPrecisionPolicy, fully_shard
from tests.conftest import Launch, scenario
from tests.torch.parity import TorchLayersLM, build_gpt, mesh_1d, run_parity, shard_blocks_then_root

LAUNCH = Launch(world_sizes=(2,))


def _with_fusion(fuse_below: int):
    """Run a scenario with a given fusion threshold (0: one collective per parameter)."""

    def decorate(fn):
        @functools.wraps(fn)
        def wrapped():
            saved = group_module.DEFAULT_FUSE_BELOW_NUMEL
            group_module.DEFAULT_FUSE_BELOW_NUMEL = fuse_below
            try:
                return fn()
            finally:
                group_module.DEFAULT_FUSE_BELOW_NUMEL = saved

        return wrapped

    return decorate


@scenario
def default_gpt():
    mesh = mesh_1d()
    result = run_parity(build_gpt, lambda m: shard_blocks_then_root(m, mesh=mesh))
    assert result.losses[-1] < result.losses[0], f"the default run does not train: losses {result.losses}"
    # AdamW steps on DTensor shards too (its state is sharded like the parameters); see
    # parity.py for why its tolerance on final parameters is looser.
    adam = run_parity(
        build_gpt, lambda m: shard_blocks_then_root(m, mesh=mesh), param_atol=2e-4,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    )
    return {"losses": result.losses, "adam_losses": adam.losses, "max_param_diff": result.max_param_diff}


@scenario
@_with_fusion(0)
def default_gpt_unfused():
    mesh = mesh_1d()
    return run_parity(build_gpt, lambda m: shard_blocks_then_root(m, mesh=mesh)).losses


@scenario
@_with_fusion(1 << 30)
def default_gpt_all_fused():
    mesh = mesh_1d()
    return run_parity(build_gpt, lambda m: shard_blocks_then_root(m, mesh=mesh)).losses


@scenario
def no_reshard_after_forward():
    mesh = mesh_1d()
    return run_parity(build_gpt, lambda m: shard_blocks_then_root(m, mesh=mesh, reshard_after_forward=False)).losses


@scenario
def seed_config_fp32_reduce():
    """The seed's configuration: fp32 parameters, reduce_dtype=float32 (grad dtype == reduce dtype)."""
    mesh = mesh_1d()
    mp = MixedPrecisionPolicy(reduce_dtype=torch.float32)
    return run_parity(build_gpt, lambda m: shard_blocks_then_root(m, mesh=mesh, mp_policy=mp)).losses


@scenario
def bf16_compute_fp32_reduce():
    mesh = mesh_1d()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    result = run_parity(
        build_gpt, lambda m: shard_blocks_then_root(m, mesh=mesh, mp_policy=mp),
        rtol=2e-2, atol=2e-2, param_atol=3e-2,
    )
    return result.losses


@scenario
def torch_layers_model():
    mesh = mesh_1d()
    result = run_parity(TorchLayersLM, lambda m: shard_blocks_then_root(m, mesh=mesh))
    return result.losses


@scenario
def dim1_sharding():
    mesh = mesh_1d()

    def wrap(model):
        return shard_blocks_then_root(model, mesh=mesh, shard_placement_fn=lambda p: Shard(p.dim() - 1))

    run_parity(build_gpt, wrap)
    # Placement really is the requested one.
    model = build_gpt()
    wrap(model)
    placements = {name: p.placements[0] for name, p in model.named_parameters()}
    assert placements["layers.0.mlp.0.weight"] == Shard(1), placements
    return True


class UnevenNet(nn.Module):
    """Shapes that do not divide by 2 or 4, and a parameter smaller than the world size."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(7, 5)
        self.b = nn.Linear(5, 3)
        self.tiny = nn.Parameter(torch.randn(1, 3))
        self.c = nn.Linear(3, 9)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))) * self.tiny)


def _uneven_batch(step, batch):
    gen = torch.Generator().manual_seed(step)
    return (torch.randn(batch, 7, generator=gen), torch.randn(batch, 9, generator=gen))


def _mse(model, batch):
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


@scenario
def uneven_shapes():
    mesh = mesh_1d()

    def wrap(model):
        fully_shard(model.a, mesh=mesh)
        fully_shard(model, mesh=mesh)

    run_parity(UnevenNet, wrap, make_batch=_uneven_batch, loss_fn=_mse)
    run_parity(
        UnevenNet,
        lambda m: fully_shard(m, mesh=mesh, shard_placement_fn=lambda p: Shard(p.dim() - 1)),
        make_batch=_uneven_batch, loss_fn=_mse,
    )
    return True


@scenario
def tied_weights():
    mesh = mesh_1d()
    model = build_gpt()
    assert model.lm_head.weight is model.wte.weight
    run_parity(build_gpt, lambda m: shard_blocks_then_root(m, mesh=mesh))
    shard_blocks_then_root(model, mesh=mesh)
    assert model.lm_head.weight is model.wte.weight, "tie broken by fully_shard"
    names = [n for n, _ in model.named_parameters()]
    assert "wte.weight" in names and "lm_head.weight" not in names  # deduplicated like the original
    return True


@scenario
def gradient_accumulation():
    mesh = mesh_1d()
    return run_parity(build_gpt, lambda m: shard_blocks_then_root(m, mesh=mesh), micro_batches=2, global_batch=8).losses


@scenario
def clip_grad_norm():
    mesh = mesh_1d()
    return run_parity(build_gpt, lambda m: shard_blocks_then_root(m, mesh=mesh), clip=0.05).losses


@scenario
def api_surface():
    """DTensor parameters and grads, FQNs, dynamic subclass, unshard/reshard handles."""
    mesh = mesh_1d()
    torch.manual_seed(0)
    model = build_gpt()
    names_before = [n for n, _ in model.named_parameters()]
    cls_before = type(model)
    shard_blocks_then_root(model, mesh=mesh, mp_policy=TorchMixedPrecisionPolicy())
    assert isinstance(model, FSDPModule) and isinstance(model, cls_before) and type(model) is not cls_before
    assert isinstance(model.layers[0], FSDPModule)
    assert [n for n, _ in model.named_parameters()] == names_before
    for name, param in model.named_parameters():
        assert isinstance(param, DTensor) and param.placements == (Shard(0),), name
    sd = model.state_dict()
    assert all(isinstance(v, DTensor) for k, v in sd.items() if k in names_before)
    tokens = torch.randint(0, 64, (2, 16))
    model(tokens).sum().backward()
    for name, param in model.named_parameters():
        assert isinstance(param.grad, DTensor) and param.grad.placements == param.placements, name
        assert param.grad.to_local().shape == param.to_local().shape, name
        assert param.grad._spec is param._spec, name  # wrapped without building a sharding spec per step
    handle = model.layers[0].unshard(async_op=True)
    handle.wait()
    weight = model.layers[0].attn.qkv.weight
    assert not isinstance(weight, DTensor) and weight.shape == (96, 32)
    torch.testing.assert_close(weight, model.layers[0].attn.qkv._parameters["weight"])
    model.layers[0].reshard()
    assert isinstance(model.layers[0].attn.qkv.weight, DTensor)
    return True


@scenario
def mixed_precision_casts_inputs_and_outputs():
    """param_dtype casts float inputs (cast_forward_inputs) and compute; output_dtype casts outputs."""
    mesh = mesh_1d()
    seen = {}

    class Probe(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(4, 4)

        def forward(self, x, scale):
            seen["input"], seen["weight"], seen["int"] = x.dtype, self.linear.weight.dtype, scale.dtype
            return self.linear(x), scale

    model = Probe()
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float16)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    out, scale = model(torch.randn(2, 4), torch.tensor([3]))
    assert seen == {"input": torch.bfloat16, "weight": torch.bfloat16, "int": torch.int64}, seen
    assert out.dtype == torch.float16 and scale.dtype == torch.int64
    out.float().sum().backward()
    assert model.linear.weight.grad.dtype == torch.float32  # reduced in fp32 into the fp32 shard
    no_cast = Probe()
    fully_shard(no_cast, mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False))
    no_cast(torch.randn(2, 4).bfloat16(), torch.tensor([1]))
    assert seen["input"] == torch.bfloat16
    with pytest.raises(RuntimeError):  # float32 input with bf16 weights and no cast: torch refuses
        no_cast(torch.randn(2, 4), torch.tensor([1]))
    return True


@scenario
def no_sync_and_reshard_after_backward_controls():
    """no_sync() accumulates locally; set_reshard_after_backward(False) keeps parameters for the next micro-batch."""
    from fullshard.torch.accounting import reset_traffic, traffic_bytes

    mesh = mesh_1d()
    model = shard_blocks_then_root(build_gpt(), mesh=mesh)
    tokens = torch.randint(0, 64, (2, 16))
    sharded = list(model.parameters())
    model.set_reshard_after_backward(False)
    reset_traffic()
    with model.no_sync():
        model(tokens).sum().backward()
    first = traffic_bytes()
    reset_traffic()
    with model.no_sync():
        model(tokens).sum().backward()
    second = traffic_bytes()
    assert first["reduce_scatter"] == second["reduce_scatter"] == 0, (first, second)
    # the second forward finds every unit still gathered; only backward re-gathers what forward resharded
    full_bytes = sum(p.numel() * 4 for p in sharded)
    assert second["all_gather"] == first["all_gather"] - full_bytes, (first, second)
    assert all(p.grad is None for p in sharded)
    # As in FSDP2, kept unsharded parameters are what the modules show, with the unreduced gradients.
    assert not any(isinstance(p, DTensor) for p in model.parameters())
    assert all(p.grad is not None for p in model.parameters())
    model.set_reshard_after_backward(True)
    model(tokens).sum().backward()  # synced: the sum of three micro-batches
    assert all(p.grad is not None for p in sharded)
    assert [id(p) for p in model.parameters()] == [id(p) for p in sharded]
    return {"first": first, "second": second}


@scenario
def implicit_prefetch_in_forward_and_backward():
    """From the second step on, the next unit's all-gather is issued before the current unit computes.

    Backward starts in the root (the head, after the last block in forward),
    so the root prefetches the last block, not the first.
    """
    from fullshard.core.group import GatherState

    mesh = mesh_1d()
    model = shard_blocks_then_root(build_gpt(), mesh=mesh)
    layers = model.layers
    seen = {}

    def during_forward(module, inputs):
        seen["forward"] = layers[1]._fullshard_unit.group.state

    def during_backward(grad):
        seen["backward"] = layers[0]._fullshard_unit.group.state

    def hook_attention_output(module, inputs, output):  # its gradient arrives inside layers[1]'s backward
        output.register_hook(during_backward)

    def during_head_backward(grad):
        seen["head_backward"] = layers[-1]._fullshard_unit.group.state

    def hook_final_norm_output(module, inputs, output):  # its gradient arrives between the head and the last block
        output.register_hook(during_head_backward)

    tokens = torch.randint(0, 64, (2, 16))
    model(tokens).sum().backward()  # the first step records the order
    layers[0].register_forward_pre_hook(during_forward)
    layers[1].attn.register_forward_hook(hook_attention_output)
    model.ln_f.register_forward_hook(hook_final_norm_output)
    model(tokens).sum().backward()
    prefetched = (GatherState.UNSHARDING, GatherState.UNSHARDED)  # issued, or already waited on
    assert seen["forward"] in prefetched and seen["backward"] in prefetched, seen
    assert seen["head_backward"] in prefetched, seen
    return {k: v.value for k, v in seen.items()}


class CheckpointedBlocks(nn.Module):
    """The GPT with activation checkpointing on every block (recomputed in backward)."""

    def __init__(self):
        super().__init__()
        self.gpt = build_gpt()
        self.layers = self.gpt.layers

    def forward(self, tokens):
        from torch.utils.checkpoint import checkpoint

        gpt = self.gpt
        x = gpt.wte(tokens) + gpt.wpe(torch.arange(tokens.shape[1]))
        for layer in gpt.layers:
            x = checkpoint(layer, x, use_reentrant=False)
        return gpt.lm_head(gpt.ln_f(x))


@scenario
def activation_checkpointing():
    mesh = mesh_1d()
    run_parity(CheckpointedBlocks, lambda m: shard_blocks_then_root(m, mesh=mesh))
    model = shard_blocks_then_root(CheckpointedBlocks(), mesh=mesh)
    model(torch.randint(0, 64, (2, 16))).sum().backward()
    assert model._fullshard_unit.is_root and not any(l._fullshard_unit.is_root for l in model.layers)
    return True


class SharedBlockTwice(nn.Module):
    """One wrapped block applied twice per forward (weight sharing across depth)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 32)
        self.block = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
        self.layers = [self.block]
        self.head = nn.Linear(32, 64)

    def forward(self, tokens):
        return self.head(self.block(self.block(self.embed(tokens))))


@scenario
def block_used_twice_per_forward():
    mesh = mesh_1d()
    return run_parity(SharedBlockTwice, lambda m: shard_blocks_then_root(m, mesh=mesh)).losses


@scenario
def forward_method_registration():
    """register_fsdp_forward_method: a method other than forward (generate) gathers like forward."""
    from fullshard import register_fsdp_forward_method

    class Generator(nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt = build_gpt()

        def forward(self, tokens):
            return self.gpt(tokens)

        @torch.no_grad()
        def generate(self, tokens, steps):
            for _ in range(steps):  # uses the root's own parameters outside forward
                logits = self.gpt.lm_head(self.gpt.ln_f(self.gpt.wte(tokens)))
                tokens = torch.cat([tokens, logits[:, -1:].argmax(-1)], dim=1)
            return tokens

    torch.manual_seed(0)
    reference = Generator()
    model = copy.deepcopy(reference)
    fully_shard(model, mesh=mesh_1d())
    register_fsdp_forward_method(model, "generate")
    start = torch.randint(0, 64, (1, 4))
    assert torch.equal(model.generate(start, 3), reference.generate(start, 3))
    assert isinstance(model.gpt.wte.weight, DTensor)  # no backward to come: sharded again afterwards
    return True
