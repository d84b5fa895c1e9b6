"""The seed's bug re-created inside the runtime's bprop, on 2 msrun workers with the sanitizer on.

Kept in a launch of its own, as the only scenario: an exception raised inside
a MindSpore bprop comes out of ``value_and_grad``, but a second one in the
same process has crashed it (SIGSEGV) later on.
"""
from __future__ import annotations

import pytest

pytest.importorskip("mindspore")

import mindspore as ms  # noqa: E402

import fullshard.mindspore as fs  # noqa: E402
from fullshard.mindspore import buckets, collectives  # noqa: E402
from fullshard.plan import Ownership, ReducePlan  # noqa: E402
from tests.conftest import Launch, scenario  # noqa: E402
from tests.mindspore.parity import (  # noqa: E402
    TinyLM, assert_close, init_numpy, lm_batch, lm_loss, local_rows, shard_of, wrap_layers,
)

LAUNCH = Launch(world_sizes=(2,), runtime="mindspore", env={"FULLSHARD_CHECK_OWNERSHIP": "1"})


@scenario
def seed_bug_in_bprop():
    """The seed's code: believe that a "cast" to the reduce dtype allocates, so pack every gradient with
    ``grad.astype(reduce_dtype).reshape(-1)`` and own (later free) the result. With fp32 gradients and
    reduce_dtype fp32 that is the caller's storage: the sanitizer stops it, naming the parameter."""
    assert collectives.check_ownership_enabled(), "run with FULLSHARD_CHECK_OWNERSHIP=1"
    mp = fs.MixedPrecisionPolicy(reduce_dtype=ms.float32, apply_grad_on_fp32_main_grad=True)
    net, reference = init_numpy(TinyLM()), init_numpy(TinyLM())
    wrap_layers(net, mp_policy=mp, strategy="optim_grads_params", comm_fusion=False)
    params = net.trainable_params()
    ids, labels = lm_batch(0, 4)
    plan_reduce, pack_grads = buckets.plan_reduce, buckets.pack_grads

    def always_pack(*args, **kwargs):
        plan = plan_reduce(*args, **kwargs)
        return ReducePlan(Ownership.OWNED, plan.output, plan.sharded_grad)

    def seed_pack(bucket, members, gradients, dtype):
        if len(gradients) == 1 and gradients[0].dtype == dtype and not members[0].layout.needs_padding:
            return gradients[0].astype(dtype).reshape(-1)  # the seed's "copy": the same storage
        return pack_grads(bucket, members, gradients, dtype)

    buckets.plan_reduce, buckets.pack_grads = always_pack, seed_pack
    try:
        ms.value_and_grad(lambda: lm_loss(net, local_rows(ids), local_rows(labels)), None, params)()
    except fs.OwnershipError as error:
        message = str(error)
    else:
        raise AssertionError("the sanitizer let the seed's bug through")
    finally:
        buckets.plan_reduce, buckets.pack_grads = plan_reduce, pack_grads
    assert "reduce-scatter input of [" in message and "incoming gradient of '" in message, message
    named = message.split("incoming gradient of '", 1)[1].split("'", 1)[0]
    assert named in {p.name for p in params}, (named, message)
    # The step is abandoned; the next one starts clean by itself (its forward finds the backward that never
    # ended) and is right.
    _, got = ms.value_and_grad(lambda: lm_loss(net, local_rows(ids), local_rows(labels)), None, params)()
    _, want = ms.value_and_grad(lambda: lm_loss(reference, ids, labels), None, reference.trainable_params())()
    for param, grad, ref in zip(params, got, want):
        assert_close(grad.asnumpy(), shard_of(ref.asnumpy(), param), f"gradient of {param.name} after the error")
    return {"error": message, "parameter": named}
