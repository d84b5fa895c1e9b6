"""HSDP on 4 msrun workers: a (2 replicate, 2 shard) mesh against a single-process reference (one launch, the
sanitizer on), and the aliasing sites only this mesh reaches (their table: tests/mindspore/test_ownership.py).

On CPU the shard groups are sub-groups, where mccl has no all-gather: the plan
gathers by an all-reduce of a zero-filled buffer there, and reduces by an
all-reduce over the shard group, then across the replicas.
"""
from __future__ import annotations

import pytest

pytest.importorskip("mindspore")

import numpy as np  # noqa: E402

import mindspore as ms  # noqa: E402

import fullshard.mindspore as fs  # noqa: E402
from fullshard.core.buffers import reset_traffic, traffic_bytes  # noqa: E402
from fullshard.plan.formulas import bytes_sent_per_rank  # noqa: E402
from fullshard.plan import Exchange  # noqa: E402
from tests.conftest import Launch, scenario, scenarios  # noqa: E402
from tests.mindspore.parity import (  # noqa: E402
    TinyLM, assert_close, init_numpy, lm_batch, lm_loss, local_rows, run_parity, shard_of,
)
from tests.mindspore.test_ownership import hsdp_aliasing_scenarios  # noqa: E402

LAUNCH = Launch(world_sizes=(4,), runtime="mindspore", env={"FULLSHARD_CHECK_OWNERSHIP": "1"})


def _mesh():
    return fs.init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


@scenario
def hsdp_parity():
    mesh = _mesh()

    def wrap(net):
        for layer in net.layers:
            fs.fully_shard(layer, mesh=mesh)
        fs.fully_shard(net, mesh=mesh, replicate_params=[net.norm.gamma, net.norm.beta])
        collectives = net.layers[0]._fullshard_unit.groups[0].plan.collectives
        assert (collectives.gather, collectives.reduce) == (Exchange.ZERO_FILLED_ALL_REDUCE, Exchange.ALL_REDUCE_CHUNK)
        assert net.norm.gamma.shape == (8,) and net.layers[0].fc1.weight.shape == (8, 8)
    reset_traffic()
    result = run_parity(wrap=wrap, batch=8, steps=2)
    return {**result.as_dict(), "traffic": traffic_bytes()}


@scenario
def hsdp_partial_sums():
    """set_requires_all_reduce(False): reduced chunks wait, owned, without the replica all-reduce; the
    next backward with True sums both micro-batches across replicas."""
    mesh = _mesh()
    reference, sharded = init_numpy(TinyLM()), init_numpy(TinyLM())
    for layer in sharded.layers:
        fs.fully_shard(layer, mesh=mesh)
    fs.fully_shard(sharded, mesh=mesh)
    params, ref_params = sharded.trainable_params(), reference.trainable_params()
    total = None
    for micro in range(2):
        ids, labels = lm_batch(micro, 8)
        sharded.set_requires_all_reduce(micro == 1)
        _, grads = ms.value_and_grad(lambda: lm_loss(sharded, local_rows(ids), local_rows(labels)), None, params)()
        _, ref_grads = ms.value_and_grad(lambda: lm_loss(reference, ids, labels), None, ref_params)()
        ref = [g.asnumpy() for g in ref_grads]
        total = ref if total is None else [a + b for a, b in zip(total, ref)]
        if micro == 0:
            assert all(not g.asnumpy().any() for g in grads), "gradients kept as partial sums return zeros"
            assert sharded._fullshard_unit.groups[0].has_pending_grads()
    worst = 0.0
    for param, grad, want in zip(params, grads, total):
        worst = max(worst, assert_close(grad.asnumpy(), shard_of(want, param), f"summed {param.name}"))
    assert not sharded._fullshard_unit.groups[0].has_pending_grads()
    return {"max_grad_error": worst}


@scenario
def hsdp_clip_grad_norm():
    """The global norm counts every shard once: shard groups are summed, replicas are not."""
    import numpy as np

    mesh = _mesh()
    reference, sharded = init_numpy(TinyLM()), init_numpy(TinyLM())
    for layer in sharded.layers:
        fs.fully_shard(layer, mesh=mesh)
    fs.fully_shard(sharded, mesh=mesh)
    ids, labels = lm_batch(0, 8)
    _, grads = ms.value_and_grad(lambda: lm_loss(sharded, local_rows(ids), local_rows(labels)), None,
                                 sharded.trainable_params())()
    _, ref_grads = ms.value_and_grad(lambda: lm_loss(reference, ids, labels), None, reference.trainable_params())()
    want = float(np.sqrt(sum((g.asnumpy().astype(np.float64) ** 2).sum() for g in ref_grads)))
    _, total = fs.clip_grad_norm(sharded.trainable_params(), grads, 1.0)
    assert_close(float(total.asnumpy()), want, "HSDP total norm", atol=1e-5, rtol=1e-5)
    return {"norm": want}


@scenario
def hsdp_traffic_is_the_formula():
    """memory_report's theory counts the replicas' all-reduce of each reduced chunk: what the collectives
    carried in a step equals what the CPU emulation carries for the formula's traffic (TinyLM(vocab=8): no
    padding on 2 shards), the replicas' part exactly each rank's gradient shard."""
    mesh = _mesh()
    net = init_numpy(TinyLM(vocab=8))
    for layer in net.layers:
        fs.fully_shard(layer, mesh=mesh)
    fs.fully_shard(net, mesh=mesh)
    optimizer = ms.nn.Adam(net.trainable_params(), learning_rate=1e-3)
    ids, labels = lm_batch(0, 8, vocab=8)
    for _ in range(2):  # the second step is the steady state
        reset_traffic()
        _, grads = ms.value_and_grad(lambda: lm_loss(net, local_rows(ids), local_rows(labels)), None,
                                     net.trainable_params())()
        report = fs.memory_report(net, optimizer)
        optimizer(grads)
    theory = report["theory"]
    assert report["traffic"] == {k: int(v) for k, v in theory["carried"].items()}, report
    num_params = sum(int(np.prod(p.shape)) for p in TinyLM(vocab=8).trainable_params())
    replica_payload = num_params * 4 / 2  # fp32 shards of 2 ranks, summed by 2 replicas
    traffic = theory["traffic"]
    assert traffic["all_reduce"] == replica_payload, theory  # ZeRO-3's only all-reduce
    # on the sub-groups the gathers and the reduce-scatters travel as all-reduces too (over 2 shards), the
    # replicas' all-reduce over 2 replicas
    in_group = traffic["all_gather"] + traffic["reduce_scatter"]
    assert theory["carried"]["all_reduce"] == in_group + replica_payload, theory
    assert theory["carried_sent"] == bytes_sent_per_rank({"all_reduce": in_group + replica_payload}, 2), theory
    return {"measured": report["traffic"], "carried": theory["carried"]}


@scenarios
def aliasing_caught_at(world_size):
    return hsdp_aliasing_scenarios()
