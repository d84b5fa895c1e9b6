"""The reduction schedules of fullshard.mindspore against a single-process reference, on 2 (and 4) msrun workers.

Every strategy that shards, with and without comm fusion, with reductions batched across units (the
default) and one unit at a time; on a model with tied weights and a frozen parameter, two micro-batches
per step (the first without gradient sync), in fp32 and in fp16 compute with fp32 reductions into fp32
main grads. Each scenario also counts the reduction collectives of a step: none in the backward without
sync; with comm fusion one per synced backward when batched and one per unit otherwise; without fusion
one per gradient (each travels alone, zero copy where the plan allows).
"""
from __future__ import annotations

import contextlib
import itertools

import numpy as np

import mindspore as ms
from mindspore import Tensor, nn

import fullshard.mindspore as fs
from fullshard.mindspore import collectives
from fullshard.mindspore.unit import StepRoot
from tests.ms_parity import (
    TinyLM, assert_close, init_numpy, lm_batch, lm_loss, local_rows, mean_over_ranks, shard_of, wrap_layers,
)

LAYERS = 3
STRATEGIES = ("optim", "optim_grads", "optim_grads_params")


def tied_and_frozen() -> TinyLM:
    """The head reads the embedding's table (tied), and the first block's norm is frozen."""
    net = TinyLM(tied=True, layers=LAYERS)
    for param in net.layers[0].norm.get_parameters():
        param.requires_grad = False
    return net


@contextlib.contextmanager
def counting_reductions(counts: list):
    """Count the calls of the runtime's reduction collectives (reduce-scatter, and all-reduce: HSDP's replica
    sum, no_shard) into ``counts[0]``; gathers are not counted, even where they travel as all-reduces."""
    originals = collectives.reduce_scatter, collectives.all_reduce

    def counted(function):
        def call(*args, **kwargs):
            counts[0] += 1
            return function(*args, **kwargs)
        return call
    collectives.reduce_scatter, collectives.all_reduce = (counted(f) for f in originals)
    try:
        yield
    finally:
        collectives.reduce_scatter, collectives.all_reduce = originals


def train_schedule(strategy: str, fusion: bool, batched: bool, precision: str, mesh=None) -> dict:
    """Two steps of two micro-batches; ``mesh``: HSDP (the batch is split over every rank)."""
    fp16 = precision == "fp16"
    mp = fs.MixedPrecisionPolicy(param_dtype=ms.float16, reduce_dtype=ms.float32,
                                 apply_grad_on_fp32_main_grad=True) if fp16 else None
    atol, rtol = (3e-3, 3e-2) if fp16 else (1e-5, 1e-4)
    reference, sharded = init_numpy(tied_and_frozen()), init_numpy(tied_and_frozen())
    extra = {"mesh": mesh} if mesh is not None else {}
    wrap_layers(sharded, strategy=strategy, comm_fusion=fusion, mp_policy=mp, **extra)
    params, ref_params = sharded.trainable_params(), reference.trainable_params()
    assert [p.name for p in params] == [p.name for p in ref_params]
    # Adam moves a parameter by about lr whatever the gradient's size, so fp16's noise on near-zero gradients
    # would move parameters by lr; plain SGD keeps the parameters' error the gradients' times lr
    make = (lambda ps: nn.SGD(ps, 1e-1)) if fp16 else (lambda ps: nn.Adam(ps, 1e-2))
    opt, ref_opt = make(params), make(ref_params)
    previous = StepRoot.fuse_reductions_below
    StepRoot.fuse_reductions_below = previous if batched else 0
    worst, reductions, losses = 0.0, [], []
    try:
        for step in range(2):
            if fp16:
                sharded.zero_grad()
            total = None
            for micro in range(2):
                ids, labels = lm_batch(10 * step + micro, 8)
                sharded.set_requires_gradient_sync(micro == 1)
                counts = [0]
                with counting_reductions(counts):
                    loss, grads = ms.value_and_grad(
                        lambda: lm_loss(sharded, local_rows(ids), local_rows(labels)), None, params)()
                reductions.append(counts[0])
                ref_loss, ref_grads = ms.value_and_grad(lambda: lm_loss(reference, ids, labels), None, ref_params)()
                ref = [g.asnumpy() for g in ref_grads]
                total = ref if total is None else [a + b for a, b in zip(total, ref)]
            # the last micro-batch's loss, averaged over the ranks' rows, against the reference's
            losses.append((mean_over_ranks(float(loss.asnumpy())), float(ref_loss.asnumpy())))
            assert abs(losses[-1][0] - losses[-1][1]) <= atol + rtol * abs(losses[-1][1]), (step, losses[-1])
            for param, grad, want in zip(params, grads, total):
                got, want = (param.main_grad if fp16 else grad).astype(ms.float32).asnumpy(), shard_of(want, param)
                # fp16 compute against the fp32 reference: errors of 0.4-4% of a tensor's largest element were
                # measured (tied or not, main grads or not), so the tolerance is relative to that scale; a lost
                # or doubled micro-batch is off by 30% or more
                scale = float(np.abs(want).max()) if fp16 and want.size else 0.0
                worst = max(worst, assert_close(got, want, f"step {step}: accumulated gradient of {param.name}",
                                                atol + 0.06 * scale, rtol))
            opt(tuple(p.main_grad for p in params) if fp16 else grads)
            ref_opt(tuple(Tensor(t) for t in total))
    finally:
        StepRoot.fuse_reductions_below = previous
    full = fs.full_state_dict(sharded)
    for name, param in reference.parameters_and_names():
        worst = max(worst, assert_close(full[name], param.asnumpy(), f"final {name}", atol, rtol))
    frozen = sharded.layers[0].norm.gamma
    assert not frozen.requires_grad and np.array_equal(full[frozen.name], reference.layers[0].norm.gamma.asnumpy())
    assert reductions[0::2] == [0, 0], f"a backward without sync reduced: {reductions}"
    if not fusion:  # no fusion at all (the seed's configuration): each gradient alone, zero copy where it can
        batches = len(params)
    else:  # one batch for the whole backward, or one per unit (ZeRO-1's too: it reduces them at the end)
        batches = 1 if batched else LAYERS + 1
    per_batch = 1 if mesh is None else 2  # HSDP: the shard group's reduction, then the replicas' all-reduce
    assert reductions[1::2] == [batches * per_batch] * 2, (strategy, fusion, batched, reductions)
    return {"max_error": worst, "reductions_per_synced_backward": reductions[1::2], "losses": losses}


def schedule(strategy: str, fusion: bool, batched: bool, precision: str):
    return lambda: train_schedule(strategy, fusion, batched, precision)


def suite() -> dict:
    """The 2-worker matrix: every sharding strategy x comm fusion x batched or per-unit, in fp32; and each
    strategy in fp16 compute with fp32 main grads."""
    scenarios = {}
    for strategy, fusion, batched in itertools.product(STRATEGIES, (False, True), (True, False)):
        name = f"schedule_{strategy}_{'fused' if fusion else 'unfused'}_{'batched' if batched else 'per_unit'}_fp32"
        scenarios[name] = schedule(strategy, fusion, batched, "fp32")
    for strategy in STRATEGIES:
        scenarios[f"schedule_{strategy}_unfused_batched_fp16_main_grads"] = schedule(strategy, False, True, "fp16")
    return scenarios


def hsdp_schedule_scenarios() -> dict:
    """On 4 workers, a (2 replicate, 2 shard) mesh: each strategy, batched and per unit, in fp32."""
    def scenario(strategy, batched):
        def run():
            mesh = fs.init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
            return train_schedule(strategy, False, batched, "fp32", mesh=mesh)
        return run
    return {f"hsdp_schedule_{strategy}_{'batched' if batched else 'per_unit'}": scenario(strategy, batched)
            for strategy in STRATEGIES for batched in (True, False)}
