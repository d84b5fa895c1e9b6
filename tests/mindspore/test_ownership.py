"""Ownership, byte-meter and zero-copy scenarios for fullshard.mindspore on 2 msrun workers (the HSDP sites: 4
workers, tests/mindspore/test_hsdp.py).

The runtime is observed from outside: which tensors it borrows and adopts
(wrapping ``fullshard.mindspore.collectives``), which gradients autograd handed a
unit's gather (wrapping ``group.reduce_in_bprop``), and the byte meter. Run with
``FULLSHARD_CHECK_OWNERSHIP=1`` (``./run test`` sets it), so every scenario
also runs under the sanitizer.
"""
from __future__ import annotations

import contextlib
import gc

import pytest

pytest.importorskip("mindspore")

import numpy as np  # noqa: E402

import mindspore as ms  # noqa: E402
from mindspore import Tensor, nn, ops  # noqa: E402

import fullshard.mindspore as fs  # noqa: E402
from fullshard.core.buffers import live_owned_buffers, reset_traffic, traffic_bytes  # noqa: E402
from fullshard.mindspore import collectives, group as group_module  # noqa: E402
from fullshard.mindspore.collectives import dtype_bytes  # noqa: E402
from fullshard.plan import DEFAULT_FUSE_BELOW_NUMEL, Unsharded  # noqa: E402
from fullshard.plan.formulas import carried_traffic, bytes_sent_per_rank, per_rank_theory  # noqa: E402
from fullshard.plan.group import Strategy  # noqa: E402
from tests.conftest import Launch, scenario, scenarios  # noqa: E402
from tests.mindspore.parity import (  # noqa: E402
    ConcatLM,
    TiedTwice,
    TinyLM,
    assert_close,
    gathered_bytes,
    init_numpy,
    lm_batch,
    lm_loss,
    local_rows,
    shard_of,
    world,
    wrap_layers,
)

# The 2-worker MindSpore modules test_parity, test_ownership and test_errors share one msrun launch (group).
LAUNCH = Launch(world_sizes=(2,), runtime="mindspore", env={"FULLSHARD_CHECK_OWNERSHIP": "1"}, group="mindspore-2")


@contextlib.contextmanager
def observe():
    """Record what fullshard borrows and adopts, and every gradient a unit's gather was handed."""
    seen = {"borrowed": [], "adopted": [], "grads": []}
    borrow, adopt, reduce_in_bprop = collectives.borrow, collectives.adopt, group_module.reduce_in_bprop

    def borrow_and_record(tensor, what):
        seen["borrowed"].append(what)
        return borrow(tensor, what)

    def adopt_and_record(tensor, what, sources, kind=collectives.Kind.TRANSIENT):
        owned = adopt(tensor, what, sources, kind)
        seen["adopted"].append(owned)
        return owned

    def reduce_and_record(groups, grads):
        for param, grad in zip([p for g in groups for p in g.in_bucket_order], grads):
            storage = grad.untyped_storage()
            seen["grads"].append((param.fqn, grad, grad.copy(), storage.nbytes(), storage.data_ptr()))
        return reduce_in_bprop(groups, grads)

    collectives.borrow, collectives.adopt, group_module.reduce_in_bprop = borrow_and_record, adopt_and_record, reduce_and_record
    try:
        yield seen
    finally:
        collectives.borrow, collectives.adopt, group_module.reduce_in_bprop = borrow, adopt, reduce_in_bprop


def _assert_caller_grads_intact(seen):
    assert seen["grads"], "no gradient reached fullshard"
    for fqn, grad, snapshot, nbytes, _ in seen["grads"]:
        assert grad.untyped_storage().nbytes() == nbytes, f"{fqn}: the caller's gradient storage was freed"
        assert np.array_equal(grad.asnumpy(), snapshot.asnumpy()), f"{fqn}: the caller's gradient was written"


def _step(net, step=0, batch=4):
    ids, labels = lm_batch(step, batch)
    return ms.value_and_grad(lambda: lm_loss(net, local_rows(ids), local_rows(labels)), None, net.trainable_params())()


@scenario
def seed_path():
    """The seed's path: fp32 gradients, reduce_dtype fp32, no fusion, ZeRO-3, main grads. Where the plan
    borrows the gradient (even dim 0), autograd's storage is the reduction's input and is never freed or
    written; where it must pack (padding), the packed buffer is owned and reclaimed."""
    mp = fs.MixedPrecisionPolicy(reduce_dtype=ms.float32, apply_grad_on_fp32_main_grad=True)
    gc.collect()
    before = fs.comm_bytes()
    net = init_numpy(TinyLM())
    wrap_layers(net, mp_policy=mp, strategy="optim_grads_params", comm_fusion=False)
    reference = init_numpy(TinyLM())
    with observe() as seen:
        _, grads = _step(net)
    _assert_caller_grads_intact(seen)
    # Between steps only the fp32 main grads stay, counted as such: no communication memory, no unsharded copy.
    after = fs.comm_bytes()
    main_grads = sum(4 * p.size for p in net.trainable_params())
    assert after["main_grad_live"] - before["main_grad_live"] == main_grads, (after, before, main_grads)
    assert after["transient_live"] == before["transient_live"] and after["working_live"] == before["working_live"]
    assert fs.memory_report(net)["measured"]["main_grad"] - before["main_grad_live"] == main_grads
    _, ref_grads = ms.value_and_grad(lambda: lm_loss(reference, *lm_batch(0, 4)), None, reference.trainable_params())()
    for param, grad, ref in zip(net.trainable_params(), grads, ref_grads):
        assert_close(grad.asnumpy(), shard_of(ref.asnumpy(), param), param.name)
    borrowed = sorted({w for w in seen["borrowed"] if w.startswith("reduce-scatter input")})
    packed = [o for o in seen["adopted"] if o.what.startswith("reduce-scatter input")]
    assert borrowed and packed, "both paths must be exercised"
    assert all(o.is_reclaimed for o in packed if o.tensor is not None), "packed reduction inputs are reclaimed"
    return {"borrowed_reduce_inputs": len(borrowed), "packed_reduce_inputs": len(packed)}


def _adoption_error(tensor, what, sources) -> str:
    try:
        collectives.adopt(tensor, what, sources)
    except fs.OwnershipError as error:
        return str(error)
    raise AssertionError(f"adopting {what} must raise")


@scenario
def seed_bug_outside_bprop():
    """The seed's bug as an adoption: a same-dtype cast-and-reshape of a gradient is not owned. Caught twice
    over: it is storage fullshard borrows, and it shares storage with the source the site names."""
    grad = ops.ones((8, 4), ms.float32) * 3
    aliased = grad.astype(ms.float32).reshape(-1)  # a new object over the caller's storage
    assert aliased.untyped_storage().data_ptr() == grad.untyped_storage().data_ptr(), "MindSpore aliases here"
    what = "reduce-scatter input of [w] of cell 'm'"
    from_source = _adoption_error(aliased, what, (grad,))  # nothing registered: the source alone catches it
    assert what in from_source and "shares storage with what it was made from" in from_source, from_source
    lent = collectives.borrow(grad, "gradient of [w] of cell 'm'")
    message = _adoption_error(aliased, what, ())  # no source named: the borrowed registry catches it
    assert "gradient of [w] of cell 'm'" in message and "reduce-scatter input of [w]" in message, message
    assert grad.untyped_storage().nbytes() == 8 * 4 * 4 and float(grad.asnumpy().sum()) == 96.0
    real = collectives.adopt(grad.astype(ms.float16), "fp16 copy", (grad,))  # another dtype allocates: owned
    real.reclaim()
    lent.release()
    assert grad.untyped_storage().nbytes() == 128
    return {"error": message, "from_source": from_source}


@scenario
def concatenated_ownership():
    """Two parameters concatenated in construct: the gradients their gathers get are views of ONE storage.
    Neither is freed or written while the other is still to be reduced, fused (the default) or not: autograd
    hands them as non-contiguous views, which the plan packs into owned storage, never borrows."""
    for fusion in (False, True):
        net = init_numpy(ConcatLM())
        fs.fully_shard(net.mix, comm_fusion=fusion)
        wrap_layers(net, comm_fusion=fusion)
        with observe() as seen:
            _step(net)
        _assert_caller_grads_intact(seen)
        mix = {fqn: ptr for fqn, _, _, _, ptr in seen["grads"] if fqn in ("mix.top", "mix.bottom")}
        assert mix["mix.top"] == mix["mix.bottom"], "the case under test: both gradients share one storage"
        assert not any(g.is_contiguous() for fqn, g, *_ in seen["grads"] if fqn.startswith("mix.")), fusion
        borrowed = [w for w in seen["borrowed"] if w.startswith("reduce-scatter input") and "mix." in w]
        assert not borrowed, (fusion, borrowed)
    return {"shared_storage": True}


@scenario
def tied_ownership():
    net = init_numpy(TiedTwice())
    wrap_layers(net)
    with observe() as seen:
        for step in range(2):
            _step(net, step)
    _assert_caller_grads_intact(seen)
    tied = [fqn for fqn, *_ in seen["grads"] if "embedding_table" in fqn or "head.weight" in fqn]
    assert len(tied) == 2, f"one reduction per step for the tied weight, got {tied}"
    return {"tied_reductions": tied}


class Padded(nn.Cell):
    """Every parameter padded on 2 ranks (5 rows -> 3 + 2)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Dense(3, 5)

    def construct(self, x):
        return self.fc(x)


def _baseline() -> tuple[int, int]:
    """Owned bytes and buffers alive before a scenario (earlier scenarios' models may await the collector)."""
    gc.collect()
    return fs.comm_bytes()["live"], live_owned_buffers()


@scenario
def padding_path_no_leak():
    """100 steps on the padding path: every owned buffer is reclaimed; nothing accumulates."""
    base_bytes, base_buffers = _baseline()
    net = Padded()
    inner = nn.SequentialCell([net])
    fs.fully_shard(net)
    fs.fully_shard(inner)
    params = inner.trainable_params()
    x = Tensor(np.ones((2, 3), np.float32))
    grad_fn = ms.value_and_grad(lambda: (inner(x) ** 2).sum(), None, params)
    live, owned, adopted = [], [], []
    with observe() as seen:
        for _ in range(100):
            grad_fn()
            live.append(fs.comm_bytes()["live"])
            owned.append(live_owned_buffers())
            adopted.append(len(seen["adopted"]))
    assert set(live) == {base_bytes}, f"owned bytes left after a step: {sorted(set(live))} (before: {base_bytes})"
    if collectives.check_ownership_enabled():
        assert set(owned) == {base_buffers}, f"owned buffers left registered: {sorted(set(owned))}"
    per_step = {b - a for a, b in zip(adopted, adopted[1:])}
    assert len(per_step) == 1, f"the same buffers every step, got {per_step}"
    padded = [o for o in seen["adopted"] if "input" in o.what]
    assert padded and all(o.is_reclaimed for o in padded if o.tensor is not None)
    return {"owned_buffers_per_step": per_step.pop(), "steps": 100}


def _unsharded_bytes(state) -> int:
    """Bytes of owned storage behind a unit's unsharded parameters, from its plan (padding included)."""
    total = 0
    for group in state.groups:
        plan = group.plan
        for index, bucket in enumerate(plan.buckets):
            members = plan.members(index)
            size = dtype_bytes(members[0].compute_dtype)
            assert plan.gather_plans[index].unsharded is not Unsharded.VIEW_OF_OUTPUT  # never a view on MindSpore
            total += sum(p.layout.numel for p in members) * size
    return total


LAYERS = 4  # enough that ZeRO-3, holding a unit and the one it prefetches, holds less than keeping all


def _zero3_holds_two_units_at_a_time_and_nothing_between_steps(ranks: list) -> None:
    """The byte meter next to the formula: ZeRO-3's peak stays below keeping every layer gathered; it is the
    root, the unit computing and the one backward prefetches, with the reduction buffers of one unit (the
    formula's unsharded figure counts one unit's parameters and gradients); between steps it holds nothing."""
    data = ranks[0]
    zero3, kept = data["measured"]["zero3"], data["measured"]["reshard_after_forward=False"]
    assert zero3["between_steps"] == 0
    assert zero3["after_forward"] == data["root_unsharded"]
    assert data["formula"]["unsharded"] == data["report_theory"]["unsharded"]
    two_units = data["root_unsharded"] + 2 * data["layer_unsharded"]
    assert zero3["peak"] <= two_units + data["layer_unsharded"], (zero3, data)
    assert kept["peak"] > zero3["peak"]


@scenario(check=_zero3_holds_two_units_at_a_time_and_nothing_between_steps)
def byte_meter_zero3():
    """ZeRO-3 frees each unit's unsharded parameters after forward and gathers them again for its backward,
    prefetching the unit backward reaches next: bytes held after forward, at each unit's backward, between
    steps. A unit's gradients are reduced in its gather's bprop, before backward reaches the unit before it, so
    nothing of a unit whose backward is done stays. With fusion (the default) the parameters' residency is the
    same, and a unit's reduction packs its gradients into one buffer (reduced into another as large on CPU): its
    peak is higher by at most twice one unit's gradients."""
    figures, nets = {}, {}
    base, _ = _baseline()
    for label, reshard, fusion in (("zero3", None, False), ("reshard_after_forward=False", False, False),
                                   ("zero3, fused", None, True)):
        net = init_numpy(TinyLM(layers=LAYERS))
        wrap_layers(net, reshard_after_forward=reshard, comm_fusion=fusion)
        samples = {}
        net.register_forward_hook(
            lambda cell, args, out: samples.__setitem__("after_forward", fs.comm_bytes()["live"] - base))
        for i, layer in enumerate(net.layers):
            layer.register_backward_pre_hook(
                lambda cell, grad, i=i: samples.__setitem__(f"backward_layer{i}", fs.comm_bytes()["live"] - base))
        _step(net)  # the first step builds the root context
        fs.reset_peak_comm_bytes()
        reset_traffic()
        _step(net, 1)
        samples["between_steps"] = fs.comm_bytes()["live"] - base
        samples["peak"] = fs.comm_bytes()["peak"] - base
        samples["gathered"] = traffic_bytes()["all_gather"]
        figures[label], nets[label] = samples, net
    net = nets["zero3"]  # the sizes below are the unfused units'
    root = net._fullshard_unit
    units = [layer._fullshard_unit for layer in net.layers]
    root_bytes, layer_bytes = _unsharded_bytes(root), _unsharded_bytes(units[0])
    zero3, kept = figures["zero3"], figures["reshard_after_forward=False"]
    assert zero3["after_forward"] == root_bytes, (zero3, root_bytes)  # only the root stays gathered
    for i in range(LAYERS):
        # layer i gathered again, and layer i - 1 with it (backward prefetches the unit it reaches next); the
        # layers after it reduced and freed
        gathered = 2 if i > 0 else 1
        assert zero3[f"backward_layer{i}"] == root_bytes + gathered * layer_bytes, (i, zero3)
    assert zero3["between_steps"] == 0 and kept["between_steps"] == 0
    assert kept["after_forward"] == root_bytes + LAYERS * layer_bytes, kept
    assert zero3["peak"] < kept["peak"], (zero3, kept)
    fused = figures["zero3, fused"]
    residency = ("after_forward", "between_steps", *(f"backward_layer{i}" for i in range(LAYERS)))
    assert {k: fused[k] for k in residency} == {k: zero3[k] for k in residency}, (fused, zero3)
    # a fused reduction packs the gradients of the unit it reduces (fp32: a unit's gradients take its parameters'
    # bytes) into one owned buffer, and on CPU its reduce-scatter is an all-reduce whose result is as large:
    # that is what fusion costs at its peak, and all it costs
    assert zero3["peak"] < fused["peak"] <= zero3["peak"] + 2 * max(root_bytes, layer_bytes), (fused, zero3)
    assert fused["gathered"] == zero3["gathered"], (fused, zero3)  # padding is per member, fused or not
    # the root gathered once, each layer twice (forward, backward); without resharding once
    root_wire, layer_wire = gathered_bytes(root), gathered_bytes(units[0])
    assert zero3["gathered"] == root_wire + 2 * LAYERS * layer_wire, zero3
    assert kept["gathered"] == root_wire + LAYERS * layer_wire, kept
    num_params = sum(p.layout.numel for s in [root, *units] for g in s.groups for p in g.params)
    theory = per_rank_theory(Strategy.OPTIM_GRADS_PARAMS, world(), num_params,
                             max(sum(p.layout.numel for g in s.groups for p in g.params) for s in [root, *units]),
                             sum(p.layout.numel for g in root.groups for p in g.params))
    report = fs.memory_report(net)
    return {"measured": figures, "root_unsharded": root_bytes, "layer_unsharded": layer_bytes, "layers": LAYERS,
            "formula": theory["memory"], "report_theory": report["theory"]["memory"]}


class SkipsLayer1(TinyLM):
    def construct(self, ids):
        return self.head(self.norm(self.layers[0](self.emb(ids))))


@scenario
def prefetched_but_not_run():
    """A unit prefetched by its neighbour whose forward then never runs is freed at the root's post-forward,
    not held until the next step."""
    base, _ = _baseline()
    net = init_numpy(SkipsLayer1())
    wrap_layers(net)
    net.layers[0].set_modules_to_forward_prefetch([net.layers[1]])
    samples = {}
    net.register_forward_hook(lambda cell, args, out: samples.__setitem__("after_forward", fs.comm_bytes()["live"] - base))
    _step(net)
    root = _unsharded_bytes(net._fullshard_unit)
    assert samples["after_forward"] == root, (samples, root)
    assert fs.comm_bytes()["live"] == base
    return samples


@scenario
def strategy_memory():
    """What each strategy holds per rank, measured, next to the ZeRO formulas (fp32 Adam, 2 ranks, no padding):
    shards, Adam's moments, the gradients value_and_grad returns, and the unsharded copies kept between steps."""
    table = {}
    for name in ("no_shard", "optim", "optim_grads", "optim_grads_params"):
        base, _ = _baseline()
        net = init_numpy(TinyLM(vocab=8))
        wrap_layers(net, strategy=name)
        opt = nn.Adam(net.trainable_params(), 1e-2)
        for step in range(2):
            ids, labels = lm_batch(step, 4, vocab=8)
            _, grads = ms.value_and_grad(lambda: lm_loss(net, local_rows(ids), local_rows(labels)), None,
                                         net.trainable_params())()
            opt(grads)
        report = fs.memory_report(net, opt)
        returned = sum(g.nbytes for g in grads)
        held = report["measured"]["grads_in_backward"]
        measured = {
            # ZeRO-1 holds the unsharded gradients until the end of backward (DP's gradient memory), the others
            # hand out sharded ones (and hold a batch of unsharded ones on the way)
            "params": report["measured"]["params"], "grads": held if name == "optim" else returned,
            "optim": report["measured"]["optim"], "kept_unsharded": fs.comm_bytes()["live"] - base,
        }
        theory = report["theory"]["memory"]
        for key in ("params", "grads", "optim"):
            assert measured[key] == theory[key], (name, key, measured, theory)
        kept = theory["unsharded"] if name in ("optim", "optim_grads") else 0  # ZeRO-1/2 keep the whole model
        assert measured["kept_unsharded"] == kept, (name, measured, theory)
        table[name] = {"measured": measured, "returned_grads": returned, "grads_in_backward": held, "formula": theory}
    return table


@scenario
def zero_copy_count():
    """The plan's zero-copy cases, counted: exactly the unpadded, same-dtype parameters that travel alone
    gather from the shard itself and reduce straight from autograd's gradient. Without fusion that is
    every even-dim-0 parameter; with fusion (the default) only those of at least the fusion threshold per
    rank, the small ones sharing a packed buffer; a cast leaves no zero-copy gather."""
    wide = DEFAULT_FUSE_BELOW_NUMEL * world() // 8  # fc1/fc2 weights (h x 8): one threshold's worth per rank
    cases = {
        "no fusion": (TinyLM, {"comm_fusion": False}, 0),
        "default (fusion)": (TinyLM, {}, DEFAULT_FUSE_BELOW_NUMEL),
        "default (fusion), wide layers": (lambda: TinyLM(h=wide), {}, DEFAULT_FUSE_BELOW_NUMEL),
        "fp16 compute": (TinyLM, {"mp_policy": fs.MixedPrecisionPolicy(param_dtype=ms.float16)}, None),
    }
    counts = {}
    for label, (build, kwargs, fuse_below) in cases.items():
        net = init_numpy(build())
        wrap_layers(net, **kwargs)
        with observe() as seen:
            _step(net)
        found = {
            "gather": sorted(w for w in seen["borrowed"] if w.startswith("all-gather input")),
            "reduce": sorted(w for w in seen["borrowed"] if w.startswith("reduce-scatter input")),
        }
        counts[label] = {k: len(v) for k, v in found.items()}
        if fuse_below is None:
            assert not found["gather"], "a cast allocates: no zero-copy gather"
            continue
        # What the plan promises, derived here from the shapes alone: dim 0 divisible by the world size, and
        # the parameter's shard at least the fusion threshold (it travels alone)
        alone = sorted(name for name, p in build().parameters_and_names()
                       if p.shape[0] % world() == 0 and int(np.prod(p.shape)) // world() >= fuse_below)
        layer_names = [n for n in alone if n.startswith("layers.")]
        root_names = [n for n in alone if not n.startswith("layers.")]
        assert _param_names(found["reduce"]) == alone, (label, found["reduce"], alone)
        assert _param_names(found["gather"]) == alone, (label, found["gather"], alone)
        # ZeRO-3 gathers layers twice (forward, backward) and the root once; every gradient reduces once
        assert len(found["gather"]) == 2 * len(layer_names) + len(root_names), (label, found)
        assert len(found["reduce"]) == len(alone), (label, found)
        counts[label]["alone"] = len(alone)
    assert counts["no fusion"]["reduce"] > 0 and counts["default (fusion)"]["reduce"] == 0
    assert counts["default (fusion), wide layers"]["reduce"] == 2 * len(TinyLM().layers)  # fc1, fc2 weights
    return counts


def _param_names(whats: list[str]) -> list[str]:
    return sorted({w.split("[", 1)[1].split("]", 1)[0] for w in whats})


def _cpu_emulation_costs_are_shown(ranks: list) -> None:
    data = ranks[0]
    assert data["counted"]["reduce_scatter"] == 0 and data["counted"]["all_reduce"] > 0
    assert data["emulated_sent_per_rank"] > data["min_sent_per_rank"]


@scenario(check=_cpu_emulation_costs_are_shown)
def traffic_vs_theory():
    """Bytes the collectives really carried in one ZeRO-3 step, next to the theoretical minimum."""
    net = init_numpy(TinyLM(vocab=8))  # no padding anywhere: the count is exact
    wrap_layers(net)
    _step(net)
    reset_traffic()
    ids, labels = lm_batch(1, 4, vocab=8)
    ms.value_and_grad(lambda: lm_loss(net, local_rows(ids), local_rows(labels)), None, net.trainable_params())()
    counted = traffic_bytes()
    root = net._fullshard_unit
    units = [root] + [layer._fullshard_unit for layer in net.layers]
    num = sum(p.layout.numel for s in units for g in s.groups for p in g.params)
    largest = max(sum(p.layout.numel for g in s.groups for p in g.params) for s in units)
    root_params = sum(p.layout.numel for g in root.groups for p in g.params)
    theory = per_rank_theory(Strategy.OPTIM_GRADS_PARAMS, world(), num, largest, root_params)
    carried = carried_traffic(theory["traffic"], root.groups[0].plan.collectives)
    assert counted == {k: int(v) for k, v in carried.items()}, (counted, carried)
    minimum, emulated = theory["sent"], bytes_sent_per_rank(carried, world())
    assert emulated > minimum
    return {"counted": counted, "theory": theory["traffic"], "min_sent_per_rank": minimum,
            "emulated_sent_per_rank": emulated}


@contextlib.contextmanager
def aliasing_at(site: str):
    """Re-introduce the seed's bug at one site: what it adopts as owned (``what`` starting with ``site``) is the
    storage it was made from; or, for the copies it hands out, the copy is left out. The site's own ``what``
    and ``sources`` reach the real ownership check."""
    from fullshard.mindspore import buckets, group

    adopt, copy, unpack = collectives.adopt, group.sharded_copy, buckets.unpack_member
    hits = []

    def aliasing_adopt(tensor, what, sources, kind=collectives.Kind.TRANSIENT):
        victims = [t for t in sources if t is not None and t.size]
        if what.startswith(site) and victims:
            hits.append(what)
            tensor = victims[0]
        return adopt(tensor, what, sources, kind)

    def uncopied_grad(local, stored_dtype):
        hits.append(site)
        return local  # the view of the reduced buffer itself

    def uncopied_member(flat, bucket, index, param):
        hits.append(site)
        return flat

    collectives.adopt = aliasing_adopt
    if site == "sharded gradient of":
        group.sharded_copy = uncopied_grad
    if site == "full '":
        buckets.unpack_member = uncopied_member
    try:
        yield hits
    finally:
        collectives.adopt, group.sharded_copy, buckets.unpack_member = adopt, copy, unpack


def drive_gathers(net):
    for state in _states(net):
        for group in state.groups:
            group.unshard_now()


def drive_reductions(net, sync: bool = True, across_replicas: bool = True, divide_factor=None):
    """Every unit's gather bprop code, called directly (outside autograd: an exception raised inside a MindSpore
    bprop may leave the process unusable), with gradients of ones."""
    for state in _states(net):
        for group in state.groups:
            group.reduce_grads, group.all_reduce_grads = sync, sync and across_replicas
            group.divide_factor = divide_factor
        group_module.reduce_in_bprop(state.groups, tuple(ops.ones(p.layout.shape, p.compute_dtype)
                                                         for g in state.groups for p in g.in_bucket_order))


def _states(net):
    seen, states = set(), []
    for _, cell in net.cells_and_names():
        state = getattr(cell, "_fullshard_unit", None)
        if state is not None and id(state) not in seen:
            seen.add(id(state))
            states.append(state)
    return states


# site (the start of what the buffer is called) -> (fully_shard arguments, what to drive)
SITES = {
    "all-gather input of": ({}, drive_gathers),  # fused buckets (and the embedding's padded 7 rows): packed
    "all-gather output of": ({}, drive_gathers),  # fused or padded: copied out of it
    # a lone even dim 0 (no fusion): the output itself is the unsharded parameter
    "unsharded parameter '": ({"comm_fusion": False}, drive_gathers),
    "float16 copy of replica": ({"strategy": "no_shard", "mp_policy": "fp16"}, drive_gathers),
    "full '": ({}, fs.full_state_dict),
    "reduce-scatter input of": ({}, drive_reductions),  # fused (and padded) gradients are packed
    "reduced gradient of": ({}, drive_reductions),
    # copied out of the reduced buffer, which is freed (undivided: the copy is the only step that allocates)
    "sharded gradient of": ({}, lambda net: drive_reductions(net, divide_factor=1.0)),
    "gradient accumulator of": ({}, lambda net: drive_reductions(net, sync=False)),
}
HSDP_SITES = {
    "zero-filled all-gather buffer of": ({}, drive_gathers),  # a sub-group gather on mccl
    "widened all-gather input of": ({"bf16": True}, drive_gathers),  # bf16 summed as fp32 on the wire
    "partial gradient sum of": ({}, lambda net: drive_reductions(net, across_replicas=False)),
    "replica-summed gradient of": ({}, drive_reductions),
}


def _caught_at(site: str, kwargs: dict, drive, mesh=None):
    def caught():
        kwargs_ = dict(kwargs)
        net = init_numpy(TinyLM())
        if kwargs_.pop("bf16", False):
            for param in net.get_parameters():
                param.set_dtype(ms.bfloat16)
        if kwargs_.get("mp_policy") == "fp16":
            kwargs_["mp_policy"] = fs.MixedPrecisionPolicy(param_dtype=ms.float16)
        if mesh is not None:
            kwargs_["mesh"] = mesh()
        wrap_layers(net, **kwargs_)
        names = {p.name for p in net.get_parameters()}
        with aliasing_at(site) as hits:
            try:
                drive(net)
            except fs.OwnershipError as error:
                message = str(error)
            else:
                raise AssertionError(f"an aliasing {site!r} was not caught (reached {len(hits)} times)")
        assert hits and site in message, message
        assert any(name in message for name in names), f"no parameter named: {message}"
        net.reset_iter_state()
        return message.split(":")[0]

    return caught


@scenarios
def aliasing_caught_at(world_size) -> dict:
    """An aliasing adoption re-introduced at each site that makes an owned buffer is caught, naming the parameter."""
    return {f"aliasing_caught_at[{site}]": _caught_at(site, *how) for site, how in SITES.items()}


def hsdp_aliasing_scenarios() -> dict:
    """The same at the sites only a (2 replicate, 2 shard) mesh reaches (run by tests/mindspore/test_hsdp.py)."""
    mesh = lambda: fs.init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))  # noqa: E731
    return {f"aliasing_caught_at[{site}]": _caught_at(site, *how, mesh=mesh) for site, how in HSDP_SITES.items()}
