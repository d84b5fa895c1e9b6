"""The gradient every consumer sees, on fullshard.mindspore, against a single-process reference (2 and 4 workers).

One matrix: each case (what reads the gradient, which parameters get one) x every strategy x comm fusion on and
off, on a flat mesh of 2 workers and an HSDP mesh (2 replicas x 2 shards) of 4. A case trains a sharded copy
and a reference copy side by side for three steps and compares, at every step, the gradient the consumer saw
(``value_and_grad``'s, a hook's) with this rank's chunk of the reference's, then the final full parameters.

Each scenario also counts the reduction collectives of every backward and derives the count it must be from
the model: one per trainable parameter without fusion; with fusion one per gather node (one per unit with a
trainable parameter, the root's carrying every unit that reduces with it: all of them under ZeRO-1); twice that
under HSDP (the replicas' sum); none without gradient sync. Every rank returns its counts, and the test side
checks they are equal across ranks, so a rank that reduced something another did not is seen even where the
numbers happen to match.
"""
from __future__ import annotations

import contextlib
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import pytest

pytest.importorskip("mindspore")

import numpy as np  # noqa: E402

import mindspore as ms  # noqa: E402
from mindspore import Parameter, Tensor, mint, nn, ops  # noqa: E402

import fullshard.mindspore as fs  # noqa: E402
from fullshard.mindspore import collectives  # noqa: E402
from tests.conftest import Launch, scenarios  # noqa: E402
from tests.mindspore.parity import (  # noqa: E402
    TinyLM, assert_close, init_numpy, lm_batch, lm_loss, local_rows, mean_over_ranks, rank, shard_of, world, wrap_layers,
)

LAUNCH = Launch(world_sizes=(2, 4), runtime="mindspore", env={"FULLSHARD_CHECK_OWNERSHIP": "1"}, timeout_s=900)

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
STEPS, LR = 3, 0.1
EXPERTS = 3
IDLE_EXPERT = 2  # gets no token on the odd data-parallel ranks


@contextlib.contextmanager
def counting_reductions(counts: list):
    """Count the calls of the runtime's reduction collectives (reduce-scatter, and all-reduce: HSDP's replica sum,
    no_shard); gathers are not counted, even where they travel as all-reduces."""
    originals = collectives.reduce_scatter, collectives.all_reduce

    def counted(function):
        def call(*args, **kwargs):
            counts.append(1)
            return function(*args, **kwargs)
        return call
    collectives.reduce_scatter, collectives.all_reduce = (counted(f) for f in originals)
    try:
        yield
    finally:
        collectives.reduce_scatter, collectives.all_reduce = originals


# ---------------------------------------------------------------------------------------------------- models
class Expert(nn.Cell):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = Parameter(Tensor(np.zeros((d, d), np.float32)), name="weight")

    def construct(self, x: Tensor) -> Tensor:
        return mint.matmul(x, self.weight)  # exact zero gradients on an empty batch (Dense's CPU kernel has none)


class MoEBlock(nn.Cell):
    """A router and top-1 experts chosen by token id, so a test decides which rank leaves which expert idle.
    Tokens are dispatched by index selection and combined by a scatter-add, as HF-style MoE layers do. An expert
    without a token on a rank is still called, so its unit's gather (a collective) runs on every rank, but on an
    empty constant whose output is dropped: MindSpore's CPU backward of an index selection fails on an empty
    index, so this is how an idle expert looks on CPU; no gradient reaches its weight on that rank."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.router = nn.Dense(d, EXPERTS, has_bias=False)
        self.experts = nn.CellList([Expert(d) for _ in range(EXPERTS)])
        self.rows: list = []  # per expert, the token rows routed to it (set per batch by MoELM)

    def construct(self, x: Tensor) -> Tensor:
        flat = x.reshape(-1, x.shape[-1])
        probs = ops.softmax(self.router(flat), -1)
        out = ops.zeros(flat.shape, flat.dtype)
        for index, expert in enumerate(self.experts):
            if not len(self.rows[index]):
                expert(ops.zeros((0, flat.shape[-1]), flat.dtype))
                continue
            chosen = Tensor(self.rows[index])
            gate = ops.gather(probs[:, index], chosen, 0).reshape(-1, 1)
            out = ops.tensor_scatter_add(out, chosen.reshape(-1, 1), expert(ops.gather(flat, chosen, 0)) * gate)
        return (flat + out).reshape(x.shape)


class MoELM(TinyLM):
    def __init__(self) -> None:
        super().__init__(layers=0)
        self.layers = nn.CellList([MoEBlock(8)])

    def construct(self, ids: Tensor) -> Tensor:
        choice = ids.asnumpy().reshape(-1) % EXPERTS
        self.layers[0].rows = [np.nonzero(choice == e)[0].astype(np.int32) for e in range(EXPERTS)]
        return super().construct(ids)


def moe_batch(step: int, batch: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows of the odd data-parallel ranks hold no token of IDLE_EXPERT; the others hold every expert's."""
    ids, labels = lm_batch(step, batch)
    rows = batch // world()
    allowed = np.array([t for t in range(7) if t % EXPERTS != IDLE_EXPERT])
    for dp_rank in range(1, world(), 2):
        block = ids[dp_rank * rows:(dp_rank + 1) * rows]
        ids[dp_rank * rows:(dp_rank + 1) * rows] = allowed[block % len(allowed)]
    return ids, labels


# ---------------------------------------------------------------------------------------------------- cases
@dataclass
class Case:
    """How one case builds, wraps, feeds and reads a model; every hook gets the model and whether it is the
    sharded copy."""

    build: Callable[[], nn.Cell] = TinyLM
    data: Callable[[int, int], tuple] = lm_batch
    wrap: Callable[[nn.Cell, dict], None] = lambda net, kwargs: wrap_layers(net, **kwargs)
    # extra loss terms read after the forward: (net, sharded, held) -> Tensor or None
    penalty: Optional[Callable[[nn.Cell, bool, dict], Tensor]] = None
    prepare: Optional[Callable[[nn.Cell, bool, dict], None]] = None  # before the first step
    before_step: Optional[Callable[[nn.Cell, int], None]] = None
    asks: Callable[[nn.Cell], list] = lambda net: list(net.get_parameters())  # what value_and_grad is asked for
    micro_batches: int = 1
    losses_comparable: bool = True  # False where a penalty on a shard makes each rank's loss its own share
    # MixedPrecisionPolicy(param_dtype=this, reduce_dtype=fp32, apply_grad_on_fp32_main_grad=True): the fp32
    # main grads are what the optimizer reads (the seed's configuration, in fp32 compute)
    main_grads: Optional[Any] = None


def _penalty_on_shard(net, sharded, held):
    """An L2 term in the loss on a layer's weight, as the Parameter the caller holds: the shard."""
    return 0.5 * (held["fc1"] * held["fc1"]).sum()


def _hold_fc1(net, sharded, held):
    held["fc1"] = next(p for p in net.get_parameters() if p.name == "layers.0.fc1.weight")


def _penalty_on_root_after_forward(net, sharded, held):
    """A use outside its unit's forward: the head's weight as the root shows it after forward (unsharded: the
    root keeps it gathered for backward), as a tied projection in the loss would read it."""
    return 0.5 * (net.head.weight * net.head.weight).sum()


def _hooks(replace: bool):
    def prepare(net, sharded, held):
        held["seen"] = []
        for name in ("layers.1.fc2.weight", "head.weight"):
            param = next(p for p in net.get_parameters() if p.name == name)

            def hook(grad, name=name, param=param):
                held["seen"].append((name, param, grad.asnumpy().copy()))
                return grad * 0.5 if replace else None
            param.register_hook(hook)
    return prepare


def _freeze_from_step_1(net, step):
    if step == 1:
        net.layers[1].fc1.weight.requires_grad = False


def _unit_frozen_from_step_1(net, step):
    if step == 1:
        for param in net.layers[1].get_parameters():
            param.requires_grad = False  # a whole unit, e.g. after a warm-up


def _frozen_until_step_1(net, step):
    net.layers[0].norm.gamma.requires_grad = step >= 1


def _frozen_at_build(net):
    net.layers[0].norm.gamma.requires_grad = False
    return net


def _expert_units(net, kwargs):
    for expert in net.layers[0].experts:
        fs.fully_shard(expert, **kwargs)
        expert.set_reduce_scatter_unused_params(True)
    wrap_layers(net, **kwargs)


CASES = {
    "optimizer": Case(),
    "penalty_on_shard": Case(prepare=_hold_fc1, penalty=_penalty_on_shard, losses_comparable=False),
    "penalty_on_root_after_forward": Case(penalty=_penalty_on_root_after_forward),
    "hook_observes": Case(prepare=_hooks(replace=False)),
    "hook_replaces": Case(prepare=_hooks(replace=True)),
    "frozen_after_wrap": Case(before_step=_freeze_from_step_1),
    "unit_frozen_after_wrap": Case(before_step=_unit_frozen_from_step_1),
    "unfrozen_after_wrap": Case(build=lambda: _frozen_at_build(TinyLM()), before_step=_frozen_until_step_1),
    "subset_asked": Case(asks=lambda net: [p for p in net.get_parameters() if p.name.startswith("layers.")]),
    "accumulation_without_sync": Case(micro_batches=2),
    "moe_idle_expert_in_unit": Case(build=MoELM, data=moe_batch),
    "moe_idle_expert_units": Case(build=MoELM, data=moe_batch, wrap=_expert_units),
    "main_grads_fp16_accumulation": Case(build=lambda: _frozen_at_build(TinyLM(tied=True)), micro_batches=2,
                                         main_grads=ms.float16, asks=lambda net: net.trainable_params()),
    "moe_seed_configuration": Case(build=MoELM, data=moe_batch, main_grads=ms.float32),
}


# ---------------------------------------------------------------------------------------------------- runner
def _units(net) -> list:
    seen, units = set(), []
    for _, cell in net.cells_and_names():
        unit = getattr(cell, "_fullshard_unit", None)
        if unit is not None and id(unit) not in seen:
            seen.add(id(unit))
            units.append(unit)
    return units


def expected_reductions(net, strategy: str, fusion: bool, hsdp: bool, asked: list) -> int:
    """What one synced backward must reduce, from the model as wrapped. Each gather node carries its unit (the
    root's also every unit that reduces with it: ZeRO-1's, and those set to reduce unused parameters); a node
    runs its bprop when ``value_and_grad`` asked for one of its parameters, and reduces every trainable one:
    in one collective with fusion, one per parameter without."""
    units = _units(net)
    root = next(u for u in units if u.is_root)
    nodes: dict[int, list] = {}
    for unit in units:
        with_root = unit is not root and (strategy == "optim" or any(g.reduce_unused_params for g in unit.groups))
        nodes.setdefault(id(root if with_root else unit), []).extend(p for g in unit.groups for p in g.params)
    asked_ids = {id(p) for p in asked}
    count = 0
    for params in nodes.values():
        trainable = sum(p.requires_grad for p in params)
        if trainable and any(id(p.sharded) in asked_ids for p in params):
            count += 1 if fusion else trainable
    return count * (2 if hsdp else 1)


@dataclass
class Observed:
    reductions: list = field(default_factory=list)  # per backward
    expected: list = field(default_factory=list)
    max_error: float = 0.0


def _step(case: Case, net, sharded: bool, held: dict, params: list, step: int, dp: tuple, counts: list):
    """One step's backward(s) on one copy: the summed gradients value_and_grad returned, and the last loss."""
    total, loss = None, None
    for micro in range(case.micro_batches):
        ids, labels = case.data(10 * step + micro, 8)
        if sharded:
            ids, labels = local_rows(ids, *dp), local_rows(labels, *dp)
            net.set_requires_gradient_sync(micro == case.micro_batches - 1)

        def forward():
            value = lm_loss(net, ids, labels)
            return value + case.penalty(net, sharded, held) if case.penalty is not None else value
        with counting_reductions(counts) if sharded else contextlib.nullcontext():
            loss, grads = ms.value_and_grad(forward, None, params)()
        grads = [g.asnumpy() for g in grads]
        total = grads if total is None else [a + b for a, b in zip(total, grads)]
    return total, float(loss.asnumpy())


def run_case(case: Case, strategy: str, fusion: bool, mesh=None) -> dict:
    reference, sharded = init_numpy(case.build()), init_numpy(case.build())
    kwargs = {"strategy": strategy, "comm_fusion": fusion, **({"mesh": mesh} if mesh is not None else {})}
    if case.main_grads is not None:
        kwargs["mp_policy"] = fs.MixedPrecisionPolicy(param_dtype=case.main_grads, reduce_dtype=ms.float32,
                                                      apply_grad_on_fp32_main_grad=True)
    case.wrap(sharded, kwargs)
    held = {False: {}, True: {}}
    for net, is_sharded in ((reference, False), (sharded, True)):
        if case.prepare is not None:
            case.prepare(net, is_sharded, held[is_sharded])
    ref_params, params = case.asks(reference), case.asks(sharded)
    assert [p.name for p in params] == [p.name for p in ref_params]
    dp = (rank(), world())
    observed = Observed()
    for step in range(STEPS):
        for net in (reference, sharded):
            if case.before_step is not None:
                case.before_step(net, step)
        counts: list = []
        if case.main_grads is not None:
            sharded.zero_grad()
        grads, loss = _step(case, sharded, True, held[True], params, step, dp, counts)
        ref_grads, ref_loss = _step(case, reference, False, held[False], ref_params, step, dp, [])
        if case.main_grads is not None:
            grads = [p.main_grad.asnumpy() for p in params]
        observed.reductions.append(len(counts))
        observed.expected.append(expected_reductions(sharded, strategy, fusion, mesh is not None, params))
        for param, grad, want in zip(params, grads, ref_grads):
            observed.max_error = max(observed.max_error, assert_close(
                grad, shard_of(want, param), f"step {step}: gradient of {param.name}", *_tolerance(case, want)))
        if case.losses_comparable:
            assert_close(mean_over_ranks(loss), ref_loss, f"step {step}: loss", *_tolerance(case, ref_loss))
        _compare_hooks(held, observed)
        for net_params, net_grads in ((params, grads), (ref_params, ref_grads)):
            for param, grad in zip(net_params, net_grads):
                if param.requires_grad:
                    ops.assign(param, param - LR * Tensor(grad))
    full = fs.full_state_dict(sharded)
    for name, param in reference.parameters_and_names():
        observed.max_error = max(observed.max_error, assert_close(full[name], param.asnumpy(), f"final {name}",
                                                                  *_tolerance(case, param.asnumpy() * 0)))
    assert observed.reductions == observed.expected, (observed.reductions, observed.expected)
    return {"reductions": observed.reductions, "max_error": observed.max_error}


def _tolerance(case: Case, want) -> tuple[float, float]:
    """(atol, rtol). fp16 compute against the fp32 reference: errors of 0.4-4% of a tensor's largest element
    were measured, so the tolerance is relative to that scale; a lost or doubled micro-batch is off by 30%."""
    if case.main_grads != ms.float16:
        return 1e-5, 1e-4
    scale = float(np.abs(want).max()) if np.size(want) else 0.0
    return 3e-3 + 0.06 * scale, 3e-2


def _compare_hooks(held: dict, observed: Observed) -> None:
    """Each hook fired once per backward, and saw on the shard this rank's chunk of what the reference's saw on
    the whole (the order hooks of different parameters fire in is MindSpore's, and differs)."""
    seen, ref_seen = held[True].get("seen"), held[False].get("seen")
    if seen is None:
        return
    by_name = {name: (param, grad) for name, param, grad in seen}
    assert sorted(by_name) == sorted(n for n, *_ in ref_seen) and len(seen) == len(ref_seen), (seen, ref_seen)
    for name, _, want in ref_seen:
        param, grad = by_name[name]
        observed.max_error = max(observed.max_error, assert_close(grad, shard_of(want, param), f"hook on {name}"))
    seen.clear()
    ref_seen.clear()


class FailOnce:
    """A hook that raises the first time it runs."""

    def __init__(self) -> None:
        self.armed = True

    def __call__(self, *args: Any) -> None:
        if self.armed:
            self.armed = False
            raise RuntimeError("injected failure")


def step_after_a_raise(strategy: str, where: str) -> dict:
    """A step that raises (in forward, inside a block; or in backward, at the first block) and is run again,
    with no ``reset_iter_state()``: every step's gradients are the reference's, as on torch."""
    net, reference = init_numpy(TinyLM(layers=3)), init_numpy(TinyLM(layers=3))
    wrap_layers(net, strategy=strategy)
    params, ref_params = net.trainable_params(), reference.trainable_params()
    worst = 0.0
    for step in range(3):
        ids, labels = lm_batch(step, 8)

        def forward():
            return lm_loss(net, local_rows(ids), local_rows(labels))
        if step == 1:
            layer = net.layers[1 if where == "forward" else 0]
            hook = FailOnce()
            handle = layer.register_forward_pre_hook(hook) if where == "forward" else \
                layer.register_backward_pre_hook(hook)
            try:
                ms.value_and_grad(forward, None, params)()
            except RuntimeError as error:
                assert "injected failure" in str(error), error
            else:
                raise AssertionError("the injected failure did not raise")
            handle.remove()
            # a forward that raised is abandoned at once: the cells show their shards (a backward that raised is
            # found out at the next forward)
            assert where == "backward" or all(net.layers[i].fc1.weight is p for i, p in
                       enumerate(p for p in params if p.name.endswith("fc1.weight"))), "a cell shows a stale tensor"
        _, grads = ms.value_and_grad(forward, None, params)()
        _, ref_grads = ms.value_and_grad(lambda: lm_loss(reference, ids, labels), None, ref_params)()
        for param, grad, want in zip(params, grads, ref_grads):
            worst = max(worst, assert_close(grad.asnumpy(), shard_of(want.asnumpy(), param),
                                            f"step {step}: gradient of {param.name}"))
        for net_params, net_grads in ((params, grads), (ref_params, ref_grads)):
            for param, grad in zip(net_params, net_grads):
                ops.assign(param, param - LR * grad)
    return {"max_error": worst, "reductions": []}


def matrix(mesh: Optional[Callable[[], Any]] = None) -> dict:
    strategies = STRATEGIES if mesh is None else STRATEGIES[1:]  # no_shard replicates over the whole mesh
    prefix = "hsdp_" if mesh is not None else ""
    return {
        f"{prefix}{name}[{strategy},{'fused' if fusion else 'unfused'}]":
            (lambda case=case, strategy=strategy, fusion=fusion: run_case(
                case, strategy, fusion, mesh() if mesh is not None else None))
        for name, case in CASES.items() for strategy, fusion in itertools.product(strategies, (True, False))
    }


def _same_reductions_on_every_rank(ranks: list) -> None:
    counts = [data["reductions"] for data in ranks]
    assert all(c == counts[0] for c in counts), f"ranks issued different reductions: {counts}"


@scenarios(check=_same_reductions_on_every_rank)
def gradients(world_size: int) -> dict:
    """The matrix on a flat mesh of 2 workers with the steps after a raise; on 4, the matrix on the HSDP mesh."""
    if world_size == 4:
        return matrix(lambda: fs.init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")))
    raises = {f"step_after_a_raise[{strategy},{where}]": (lambda s=strategy, w=where: step_after_a_raise(s, w))
              for strategy in ("optim", "optim_grads_params") for where in ("forward", "backward")}
    return {**matrix(), **raises}
