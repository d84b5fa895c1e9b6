"""When gradients are complete, hooks on the shards, writes below version counters, phases, labels.

Each behaviour is checked against a single-process reference in ZeRO-3, in
ZeRO-2 (``strategy="optim_grads"``) and in FSDP2's ZeRO-2
(``reshard_after_forward=False``), on 2 gloo ranks; the labels also reach a real profiler trace (one process).
"""
from __future__ import annotations

import copy
import functools
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.utils.checkpoint import checkpoint

from fullshard.core.unit import TrainingPhase
from fullshard.plan.group import Strategy
from tests.conftest import Launch, scenario
from tests.torch.parity import build_gpt, gpt_batch, mesh_1d, run_parity, shard_blocks_then_root

LAUNCH = Launch(world_sizes=(2,))
ROOT = Path(__file__).resolve().parents[2]

MODES = {
    "zero3": dict(strategy="optim_grads_params"),
    "zero2": dict(strategy="optim_grads"),
    "fsdp2_zero2": dict(reshard_after_forward=False),
}
WIDTH = 8


class SharedAcrossSegments(nn.Module):
    """One Linear used by two checkpointed segments of one unit (and once more, nested, when ``nested``)."""

    def __init__(self, reentrant: bool, nested: bool = False) -> None:
        super().__init__()
        self.shared = nn.Linear(WIDTH, WIDTH)
        self.other = nn.Linear(WIDTH, WIDTH)
        self.reentrant, self.nested = reentrant, nested

    def _first(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.shared(x))

    def _second(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.other(self.shared(x)))
        if self.nested:  # a checkpoint inside a checkpoint, of the other kind, using the shared weight again
            y = y + checkpoint(self._first, y, use_reentrant=not self.reentrant)
        return y

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = checkpoint(self._first, x, use_reentrant=self.reentrant)
        return checkpoint(self._second, x, use_reentrant=self.reentrant)


class SegmentNet(nn.Module):
    def __init__(self, reentrant: bool, nested: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.layers = nn.ModuleList(SharedAcrossSegments(reentrant, nested) for _ in range(2))
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def float_batch(step: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    return torch.randn(batch, WIDTH, generator=gen), torch.randn(batch, 1, generator=gen)


def mse(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.mse_loss(model(x), y)


@scenario
def checkpoint_segments_share_a_parameter():
    """Gradients are complete only after the unit's whole backward, however many times autograd
    accumulates into a parameter (two reentrant segments: two accumulations)."""
    mesh = mesh_1d()
    losses = {}
    for mode, kwargs in MODES.items():
        for reentrant in (True, False):
            for nested in (False, True):
                wrap = functools.partial(shard_blocks_then_root, mesh=mesh, **kwargs)
                result = run_parity(functools.partial(SegmentNet, reentrant, nested), wrap,
                                    make_batch=float_batch, loss_fn=mse, steps=3)
                losses[f"{mode} reentrant={reentrant} nested={nested}"] = result.losses
    return losses


class InBackwardSGD:
    """The optimizer-in-backward pattern: one optimizer per parameter, stepped from its
    post-accumulate-grad hook; ``step`` and ``zero_grad`` have nothing left to do."""

    def __init__(self, params) -> None:
        self.fired: dict[int, int] = {}
        self.optimizers = {}
        for param in params:
            self.optimizers[id(param)] = torch.optim.SGD([param], lr=0.5, momentum=0.9)
            param.register_post_accumulate_grad_hook(self._step)

    def _step(self, param: torch.Tensor) -> None:
        self.fired[id(param)] = self.fired.get(id(param), 0) + 1
        self.optimizers[id(param)].step()
        self.optimizers[id(param)].zero_grad()

    def step(self) -> None:
        pass

    def zero_grad(self) -> None:
        pass


@scenario
def post_accumulate_grad_hooks_on_shards():
    """Hooks on the sharded parameters fire once per parameter per backward that reduces, with
    the reduced sharded gradient; under set_requires_gradient_sync(False) nothing is reduced and
    none fires. The optimizer-in-backward pattern trains like the reference."""
    mesh = mesh_1d()
    for mode, kwargs in MODES.items():
        model = shard_blocks_then_root(build_gpt(), mesh=mesh, **kwargs)
        params = list(model.parameters())
        seen: list[tuple[int, bool, tuple]] = []

        def record(param: torch.Tensor) -> None:
            grad = param.grad
            seen.append((id(param), isinstance(grad, DTensor) and grad.placements == param.placements,
                         tuple(grad.to_local().shape) == tuple(param.to_local().shape)))

        for param in params:
            param.register_post_accumulate_grad_hook(record)
        tokens = gpt_batch(0, 2)[0]
        model.set_requires_gradient_sync(False)
        model(tokens).sum().backward()
        assert seen == [], f"{mode}: hooks fired without a reduction"
        model.set_requires_gradient_sync(True)
        model(tokens).sum().backward()
        assert sorted(i for i, _, _ in seen) == sorted(id(p) for p in params), f"{mode}: not once per parameter"
        assert all(placed and shaped for _, placed, shaped in seen), f"{mode}: hook saw {seen}"
    results = {}
    for mode, kwargs in MODES.items():
        holder = {}

        def optimizer(params, holder=holder):
            holder["opt"] = InBackwardSGD(params)
            return holder["opt"]

        wrap = functools.partial(shard_blocks_then_root, mesh=mesh, **kwargs)
        results[mode] = run_parity(build_gpt, wrap, optimizer=optimizer, steps=3).losses
    return results


def _zero_every_parameter(model: nn.Module) -> None:
    with torch.no_grad():
        for param in model.parameters():
            param.data.copy_(torch.zeros_like(param))


@scenario
def writes_below_version_counters_are_seen():
    """``p.data.copy_``, an EMA swap through ``.data`` and a manual load reach the next forward in
    every strategy: after an eval forward, after a training step, and between two forwards."""
    mesh = mesh_1d()
    tokens = gpt_batch(0, 2)[0]
    cases = {**MODES, **{s.value: dict(strategy=s.value) for s in (Strategy.NO_SHARD, Strategy.OPTIM)}}
    checked = []
    for mode, kwargs in cases.items():
        torch.manual_seed(0)
        reference = build_gpt()
        model = shard_blocks_then_root(copy.deepcopy(reference), mesh=mesh, **kwargs)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with torch.no_grad():
            model(tokens)  # an eval forward first: the root (and ZeRO-2's units) would keep copies
        _zero_every_parameter(model)
        with torch.no_grad():
            assert model(tokens).abs().max().item() == 0, f"{mode}: write after an eval forward missed"
        # an EMA swap: the live weights and a shadow copy (the reference's shards) trade places
        ema = [_shard_of(full, param) for param, full in zip(model.parameters(), reference.parameters())]
        with torch.no_grad():
            for param, shadow in zip(model.parameters(), ema):
                live = param.detach().clone()
                param.data.copy_(shadow)
                shadow.copy_(live)
        torch.testing.assert_close(model(tokens), reference(tokens), msg=lambda m: f"{mode}: EMA swap\n{m}")
        # a training step, then a manual load of new weights
        model(tokens).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        for param, full in zip(model.parameters(), reference.parameters()):
            param.data.copy_(_shard_of(full * 2, param))
        with torch.no_grad():
            for full in reference.parameters():
                full.mul_(2)
        torch.testing.assert_close(model(tokens), reference(tokens), msg=lambda m: f"{mode}: manual load\n{m}")
        checked.append(mode)
    return checked


def _shard_of(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's local part of ``full``, placed like the DTensor ``like``."""
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full.detach().clone(), like.device_mesh, like.placements, src_data_rank=None)


@scenario
def phases_and_profiler_labels():
    """Each unit moves through the phases; every gather, reduce and reshard runs inside a
    ``torch.profiler.record_function`` label naming the phase and the module, which is what a profiler
    trace shows. (The labels are recorded through a stand-in for ``record_function``: kineto's profiler
    itself sometimes aborts a multi-process worker at exit.)"""
    import fullshard.torch.unit as unit_module

    names = set()
    real = unit_module.record_function

    def recording(name):
        names.add(name)
        return real(name)

    mesh = mesh_1d()
    model = shard_blocks_then_root(build_gpt(), mesh=mesh)
    block = model.layers[0]._fullshard_unit
    seen = []
    block.modules[0].register_forward_pre_hook(lambda *_: seen.append(block.phase))  # runs after fullshard's
    tokens = gpt_batch(0, 2)[0]
    unit_module.record_function = recording
    try:
        model(tokens).sum().backward()
    finally:
        unit_module.record_function = real
    assert seen == [TrainingPhase.FORWARD], seen
    assert block.phase is TrainingPhase.IDLE
    for expected in ("fullshard::pre-forward all-gather (layers.0)", "fullshard::forward reshard (layers.0)",
                     "fullshard::pre-backward all-gather (layers.0)", "fullshard::post-backward reduce-scatter (layers.0)",
                     "fullshard::post-backward reshard (layers.0)"):
        assert expected in names, (expected, sorted(names))
    return sorted(names)


@scenario
def one_rank_mesh_exchanges_nothing():
    """A mesh of one rank issues no collective (FSDP2 issues none either) and trains like the reference."""
    from torch.distributed.device_mesh import DeviceMesh

    solo = [dist.new_group([rank]) for rank in range(dist.get_world_size())][dist.get_rank()]
    mesh = DeviceMesh.from_group(solo, "cpu")
    calls = []
    names = ("all_gather_into_tensor", "all_gather_single", "reduce_scatter_tensor", "reduce_scatter_single",
             "all_reduce", "isend", "irecv")
    saved = {name: getattr(dist, name) for name in names if hasattr(dist, name)}
    for name, fn in saved.items():
        setattr(dist, name, functools.partial(_count, calls, name, fn))
    checked = []
    try:
        for kwargs in ({}, dict(strategy="no_shard"), dict(reshard_after_forward=False)):
            torch.manual_seed(0)
            reference = build_gpt()
            model = shard_blocks_then_root(copy.deepcopy(reference), mesh=mesh, **kwargs)
            for m in (model, reference):
                m(gpt_batch(0, 2)[0]).sum().backward()
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=lambda m: f"{name} {kwargs}\n{m}")
            checked.append(kwargs)
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
    assert calls == [], calls
    return len(checked)


def _count(calls: list, name: str, fn, *args, **kwargs):
    calls.append(name)
    return fn(*args, **kwargs)


@scenario
def offloaded_grads_accumulate_after_the_copy_lands():
    """CPU offload: a reduced gradient summed into an existing one (two backward passes without
    zero_grad) is copied to the host before the sum. On a GPU the copy goes to pinned memory and
    may not block, and the sum must wait for it; on the CPU the same path runs synchronously."""
    from fullshard import CPUOffloadPolicy

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    torch.manual_seed(0)
    reference = build_gpt().to(device)
    model = shard_blocks_then_root(copy.deepcopy(reference), mesh=_mesh_on(device),
                                   offload_policy=CPUOffloadPolicy(pin_memory=True))
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(2):  # no zero_grad in between: the second reduction is summed into the first
        tokens = gpt_batch(step, 2 * world)[0].to(device)
        model(tokens.chunk(world)[rank]).sum().backward()
        reference(tokens).sum().backward()
    for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
        assert param.grad.to_local().device.type == "cpu", name
        torch.testing.assert_close(param.grad.full_tensor(), (ref.grad / world).cpu(), msg=lambda m: f"{name}\n{m}")
    return str(device)


def _mesh_on(device: torch.device):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size(),))


def test_profiler_trace_names_fullshard_phases():
    """The labels reach a real torch.profiler trace (one process, world of one: no collective)."""
    code = (
        "import os, torch, torch.distributed as dist\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(__import__('fullshard.train.procs', "
        "fromlist=['x']).free_port()), RANK='0', WORLD_SIZE='1')\n"
        "dist.init_process_group('gloo')\n"
        "from torch.distributed.device_mesh import init_device_mesh\n"
        "from fullshard import fully_shard\n"
        "model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))\n"
        "fully_shard(model[0], mesh=init_device_mesh('cpu', (1,))); fully_shard(model, mesh=init_device_mesh('cpu', (1,)))\n"
        "with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:\n"
        "    model(torch.randn(2, 4)).sum().backward()\n"
        "print(sorted({e.name for e in prof.events() if e.name.startswith('fullshard::')}))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert "fullshard::pre-forward all-gather (0)" in done.stdout, done.stdout + done.stderr
    assert "fullshard::post-backward reduce-scatter (0)" in done.stdout, done.stdout + done.stderr
