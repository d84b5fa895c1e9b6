"""Parity of fullshard.mindspore on 2 msrun workers with a single-process reference (the sanitizer is on).

Each scenario trains a tiny model sharded on the workers and a reference copy
in one process (``tests/mindspore/parity.py``), and returns what it measured.
"""
from __future__ import annotations

import pytest

pytest.importorskip("mindspore")

import numpy as np  # noqa: E402

import mindspore as ms  # noqa: E402
from mindspore import Parameter, Tensor, mint, nn, ops  # noqa: E402

import fullshard.mindspore as fs  # noqa: E402
from fullshard.core.buffers import reset_traffic, traffic_bytes  # noqa: E402
from fullshard.mindspore import buckets  # noqa: E402
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
    run_parity,
    shard_of,
    world,
    wrap_layers,
)

# The 2-worker MindSpore modules test_parity, test_ownership and test_errors share one msrun launch (group).
LAUNCH = Launch(world_sizes=(2,), runtime="mindspore", env={"FULLSHARD_CHECK_OWNERSHIP": "1"}, group="mindspore-2")


def _loss_falls(ranks: list) -> None:
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0], ranks[0]["losses"]


@scenario(check=_loss_falls)
def zero3_default():
    """The default (ZeRO-3, per-layer units), four steps on one batch: the loss must also fall."""
    return run_parity(steps=4, data=lambda step, batch: lm_batch(0, batch)).as_dict()


def strategy(name):
    def parity():
        result = run_parity(wrap=lambda net: wrap_layers(net, strategy=name)).as_dict()
        return result
    return parity


@scenarios
def strategies(world_size):
    return {f"strategy_{name}": strategy(name) for name in ("no_shard", "optim", "optim_grads", "optim_grads_params")}


@scenario
def reshard_after_forward_false():
    return run_parity(wrap=lambda net: wrap_layers(net, reshard_after_forward=False)).as_dict()


@scenario
def odd_embedding():
    """Vocabulary 9 on 2 ranks: 5 rows and 4 (uneven dim 0, padded for the collectives)."""
    def build():
        return TinyLM(vocab=9, d=4, h=4, layers=1)

    def wrap(net):
        wrap_layers(net)
        shapes = {p.name: tuple(p.shape) for p in net.trainable_params()}
        assert shapes["emb.embedding_table"] == ((5, 4) if fs_rank() == 0 else (4, 4)), shapes
    return run_parity(build, wrap, data=lambda step, batch: lm_batch(step, batch, vocab=9)).as_dict()


def fs_rank():
    from mindspore.communication import get_rank
    return get_rank()


@scenario
def shard_dim_1():
    """Shard(1) for every matrix, uneven where the width is odd (5 -> 3 + 2)."""
    def build():
        return TinyLM(vocab=7, d=5, h=6)

    def place(param):
        return fs.Shard(1) if param.ndim == 2 else None

    def wrap(net):
        wrap_layers(net, shard_placement_fn=place)
        shapes = {p.name: tuple(p.shape) for p in net.trainable_params()}
        want = (7, 3) if fs_rank() == 0 else (7, 2)
        assert shapes["emb.embedding_table"] == want and shapes["layers.0.fc2.weight"] == (5, 3), shapes
    return run_parity(build, wrap).as_dict()




@scenario
def tied_weights():
    results = {}
    for label, build in (("used through the other cell", lambda: TinyLM(tied=True)), ("registered twice", TiedTwice)):
        result = run_parity(build)
        results[label] = result.max_param_error
    net = TiedTwice()
    wrap_layers(net)
    assert net.head.weight is net.emb.embedding_table, "the tie must survive sharding"
    assert len(net.trainable_params()) == len(TiedTwice().trainable_params())
    return results




@scenario
def concatenated_params():
    def wrap(net):
        fs.fully_shard(net.mix)
        wrap_layers(net)
    return run_parity(ConcatLM, wrap).as_dict()


@scenario
def grad_accumulation_no_sync():
    """Two micro-batches without sync, the third with: the reduced gradient is the sum of three."""
    reference, sharded = init_numpy(TinyLM()), init_numpy(TinyLM())
    wrap_layers(sharded)
    params, ref_params = sharded.trainable_params(), reference.trainable_params()
    opt, ref_opt = nn.Adam(params, 1e-2), nn.Adam(ref_params, 1e-2)
    worst = 0.0
    for step in range(2):
        total = None
        for micro in range(3):
            ids, labels = lm_batch(10 * step + micro, 4)
            sharded.set_requires_gradient_sync(micro == 2)
            _, grads = ms.value_and_grad(lambda: lm_loss(sharded, local_rows(ids), local_rows(labels)), None, params)()
            _, ref_grads = ms.value_and_grad(lambda: lm_loss(reference, ids, labels), None, ref_params)()
            ref = [g.asnumpy() for g in ref_grads]
            total = ref if total is None else [a + b for a, b in zip(total, ref)]
            if micro < 2:
                assert all(not g.asnumpy().any() for g in grads), "a step without sync returns zeros"
        for param, grad, want in zip(params, grads, total):
            worst = max(worst, assert_close(grad.asnumpy(), shard_of(want, param), f"accumulated {param.name}"))
        opt(grads)
        ref_opt(tuple(Tensor(t) for t in total))
    assert not any(p.grad_accumulator for s in _states(sharded) for g in s.groups for p in g.params)
    return {"max_grad_error": worst}


def _states(net):
    return {id(s): s for _, c in net.cells_and_names() for s in [getattr(c, "_fullshard_unit", None)] if s}.values()


@scenario
def reduce_op_sum():
    def wrap(net):
        wrap_layers(net)
        net.set_reduce_op_type("sum")
    return run_parity(wrap=wrap, grad_scale=world()).as_dict()


@scenario
def divide_factor_per_cell():
    """set_gradient_divide_factor(1.0) on every sharded cell sums the gradients; as in FSDP2 it sets the cell's
    own groups only, so on the root alone the layers keep averaging."""
    def wrap(net):
        wrap_layers(net)
        for _, cell in net.cells_and_names():
            if isinstance(cell, fs.FSDPModule):
                cell.set_gradient_divide_factor(1.0)
    summed = run_parity(wrap=wrap, grad_scale=world()).as_dict()
    root_only = wrap_layers(init_numpy(TinyLM()))
    root_only.set_gradient_divide_factor(1.0)
    factors = {name or "root": [g.divide_factor for g in cell._fullshard_unit.groups]
               for name, cell in root_only.cells_and_names() if isinstance(cell, fs.FSDPModule)}
    assert factors.pop("root") == [1.0] and factors and all(f == [None] for f in factors.values()), factors
    return summed


@scenario
def fp16_compute_fp32_reduce():
    """fp16 gathers and compute, fp32 reductions: fp32 gradients, within fp16 rounding of the fp32 run."""
    mp = fs.MixedPrecisionPolicy(param_dtype=ms.float16, reduce_dtype=ms.float32)

    def wrap(net):
        wrap_layers(net, mp_policy=mp)
        group = net._fullshard_unit.groups[0]
        assert group.plan.members(0)[0].compute_dtype == ms.float16
    result = run_parity(wrap=wrap, atol=3e-3, rtol=3e-2)
    return result.as_dict()


@scenario
def main_grad():
    """fp32 main grads accumulate the reduced gradients over backward passes until zero_grad()."""
    mp = fs.MixedPrecisionPolicy(reduce_dtype=ms.float32, apply_grad_on_fp32_main_grad=True)
    net = init_numpy(TinyLM())
    wrap_layers(net, mp_policy=mp)
    params = net.trainable_params()
    returned = []
    for step in range(3):
        if step == 2:
            net.zero_grad()
            assert all(not p.main_grad.asnumpy().any() for p in params), "zero_grad zeroes main_grad"
        ids, labels = lm_batch(step, 4)
        _, grads = ms.value_and_grad(lambda: lm_loss(net, local_rows(ids), local_rows(labels)), None, params)()
        returned.append([g.asnumpy() for g in grads])
        for param, grad in zip(params, grads):
            assert param.main_grad.dtype == ms.float32 and param.main_grad.shape == param.shape
        if step == 1:
            for param, first, second in zip(params, returned[0], returned[1]):
                assert_close(param.main_grad.asnumpy(), first + second, f"main_grad of {param.name} after 2 passes")
    for param, last in zip(params, returned[2]):
        assert_close(param.main_grad.asnumpy(), last, f"main_grad of {param.name} after zero_grad and one pass")
    return {"params": len(params)}


@scenario
def main_grad_low_precision_storage():
    """fp16- and bf16-stored parameters with fp32 main grads (the seed library's issue #692 fails here)."""
    errors = {}
    for dtype in (ms.float16, ms.bfloat16):
        def build():
            net = init_numpy(TinyLM())
            for param in net.get_parameters():
                param.set_dtype(dtype)
            return net
        mp = fs.MixedPrecisionPolicy(param_dtype=ms.float32, reduce_dtype=ms.float32, apply_grad_on_fp32_main_grad=True)
        net = build()
        reference = build()
        for param in reference.get_parameters():  # the same (rounded) values, in fp32
            param.set_dtype(ms.float32)
        wrap_layers(net, mp_policy=mp)
        params, ref_params = net.trainable_params(), reference.trainable_params()
        ids, labels = lm_batch(0, 4)
        _, grads = ms.value_and_grad(lambda: lm_loss(net, local_rows(ids), local_rows(labels)), None, params)()
        _, ref_grads = ms.value_and_grad(lambda: lm_loss(reference, ids, labels), None, ref_params)()
        worst = 0.0
        for param, grad, ref in zip(params, grads, ref_grads):
            assert grad.dtype == dtype and param.dtype == dtype, (grad.dtype, param.dtype)
            worst = max(worst, assert_close(param.main_grad.asnumpy(), shard_of(ref.asnumpy(), param),
                                            f"{dtype} main_grad of {param.name}"))
        errors[str(dtype)] = worst
    return errors


@scenario
def seed_configuration():
    """The seed's: fp32 params, reduce_dtype fp32, fp32 main grads, no fusion, ZeRO-3, per-layer wrapping;
    the optimizer steps on main_grad (zeroed every step), the returned gradients match too."""
    mp = fs.MixedPrecisionPolicy(reduce_dtype=ms.float32, apply_grad_on_fp32_main_grad=True)

    def wrap(net):
        wrap_layers(net, mp_policy=mp, strategy="optim_grads_params", comm_fusion=False)

    def before(net, step):
        net.zero_grad()

    def on_main_grads(params, grads):
        for param, grad in zip(params, grads):
            assert_close(param.main_grad.asnumpy(), grad.asnumpy(), f"main_grad of {param.name}")
        return tuple(p.main_grad for p in params)
    return run_parity(wrap=wrap, before_step=before, step_on=on_main_grads).as_dict()


@scenario
def clip_grad_norm():
    """The global norm over every shard (replicated norms counted once), and the clipped gradients."""
    reference, sharded = init_numpy(TinyLM()), init_numpy(TinyLM())
    for layer in sharded.layers:
        fs.fully_shard(layer)
    fs.fully_shard(sharded, replicate_params=[sharded.norm.gamma, sharded.norm.beta])
    assert sharded.norm.gamma.shape == (8,), "replicated: whole on every rank"
    params, ref_params = sharded.trainable_params(), reference.trainable_params()
    opt, ref_opt = nn.Adam(params, 1e-2), nn.Adam(ref_params, 1e-2)
    norms = []
    for step in range(2):
        ids, labels = lm_batch(step, 4)
        _, grads = ms.value_and_grad(lambda: lm_loss(sharded, local_rows(ids), local_rows(labels)), None, params)()
        _, ref_grads = ms.value_and_grad(lambda: lm_loss(reference, ids, labels), None, ref_params)()
        full = [g.asnumpy().astype(np.float64) for g in ref_grads]
        want_norm = float(np.sqrt(sum((g ** 2).sum() for g in full)))
        max_norm = 0.5 * want_norm
        clipped, total = fs.clip_grad_norm(params, grads, max_norm)
        assert_close(float(total.asnumpy()), want_norm, "total norm", atol=1e-5, rtol=1e-5)
        scale = max_norm / (want_norm + 1e-6)
        for param, grad, ref in zip(params, clipped, full):
            assert_close(grad.asnumpy(), shard_of(ref * scale, param), f"clipped {param.name}")
        unclipped, total2 = fs.clip_grad_norm(params, grads, 10 * want_norm)
        assert all(a is b for a, b in zip(unclipped, grads)), "no clipping below max_norm"
        norms.append(want_norm)
        opt(clipped)
        ref_opt(tuple(Tensor((g * scale).astype(np.float32)) for g in full))
    full_params = fs.full_state_dict(sharded)
    for name, param in reference.parameters_and_names():
        assert_close(full_params[name], param.asnumpy(), f"final {name}")
    return {"norms": norms}


@scenario
def unshard_reshard():
    """unshard(): the attributes show full tensors, and the next forward runs on them without gathering (FSDP2's
    meaning); ZeRO-3 reshards after that forward and gathers again for backward, as for any unit. reshard()
    frees them and shows the shards."""
    reference, sharded = init_numpy(TinyLM()), init_numpy(TinyLM())
    wrap_layers(sharded)
    layer = sharded.layers[1]
    layer.unshard()
    assert tuple(layer.fc1.weight.shape) == (16, 8), "unshard shows the full tensor"
    assert isinstance(layer.fc1._params["weight"], Parameter) and layer.fc1._params["weight"].shape == (8, 8)
    held = fs.comm_bytes()["live"]
    assert held > 0
    params, ref_params = sharded.trainable_params(), reference.trainable_params()
    ids, labels = lm_batch(0, 4)
    reset_traffic()
    _, grads = ms.value_and_grad(lambda: lm_loss(sharded, local_rows(ids), local_rows(labels)), None, params)()
    _, ref_grads = ms.value_and_grad(lambda: lm_loss(reference, ids, labels), None, ref_params)()
    for param, grad, ref in zip(params, grads, ref_grads):
        assert_close(grad.asnumpy(), shard_of(ref.asnumpy(), param), f"gradient of {param.name}")
    # the unsharded layer was not gathered in forward, only for backward; the others as usual
    root, first = sharded._fullshard_unit, sharded.layers[0]._fullshard_unit
    expected = gathered_bytes(root) + 2 * gathered_bytes(first) + gathered_bytes(layer._fullshard_unit)
    assert traffic_bytes()["all_gather"] == expected, traffic_bytes()
    layer.unshard()
    assert tuple(layer.fc1.weight.shape) == (16, 8)
    layer.reshard()
    assert tuple(layer.fc1.weight.shape) == (8, 8), "reshard shows the shard"
    assert layer.fc1.weight is layer.fc1._params["weight"]
    return {"held_while_unsharded": held}


@scenario
def prefetch():
    """Explicit prefetch: layer 1 is gathered in layer 0's pre-forward, layer 0 again in layer 1's backward."""
    events = []
    original = buckets.gather_bucket

    def recording(plan, index, comm):
        events.append(plan.module_name)
        return original(plan, index, comm)

    def wrap(net):
        wrap_layers(net)
        net.layers[0].set_modules_to_forward_prefetch([net.layers[1]])
        net.layers[1].set_modules_to_backward_prefetch([net.layers[0]])
        for layer in net.layers:
            layer.register_forward_pre_hook(lambda cell, args: events.append(f"forward {id(cell)}"))
            layer.register_backward_pre_hook(lambda cell, grad: events.append(f"backward {id(cell)}"))
        net.order = [id(layer) for layer in net.layers]

    from fullshard.mindspore import group as group_module
    group_module.gather_bucket = recording
    holder = {}

    def before(net, step):
        holder["order"] = net.order
        events.append(f"step {step}")
    try:
        result = run_parity(wrap=wrap, steps=2, before_step=before)
    finally:
        group_module.gather_bucket = original
    first, second = holder["order"]
    step = events[events.index("step 1"):]
    forward0, forward1 = step.index(f"forward {first}"), step.index(f"forward {second}")
    backward1, backward0 = step.index(f"backward {second}"), step.index(f"backward {first}")
    assert "layers.1" in step[:forward0], "layer 1 is gathered in layer 0's pre-forward"
    assert "layers.1" not in step[forward0:forward1], "and not again at its own forward"
    assert "layers.0" in step[forward1:backward1], "layer 0 is gathered again in layer 1's backward pre-hook"
    assert "layers.0" not in step[backward1:backward0], "and not again at its own"
    return {"losses": result.losses, "step_events": step}


@scenario
def comm_fusion():
    """Fusion (the default) against none: one gather bucket per unit with it, one per parameter without;
    both match the reference."""
    results = {}
    for fusion in (True, False):
        def wrap(net, fusion=fusion):
            wrap_layers(net, comm_fusion=fusion)
            for layer in net.layers:
                buckets, params = layer._fullshard_unit.groups[0].plan.buckets, layer.trainable_params()
                assert len(buckets) == (1 if fusion else len(params)), (fusion, len(buckets))
        results["fused" if fusion else "unfused"] = run_parity(wrap=wrap).as_dict()
    return results


@scenario
def replicate_params():
    def wrap(net):
        for layer in net.layers:
            fs.fully_shard(layer, replicate_params=[layer.norm.gamma, layer.norm.beta])
        fs.fully_shard(net)
        assert net.layers[0].norm.gamma.shape == (8,) and net.layers[0].fc1.weight.shape == (8, 8)
    return run_parity(wrap=wrap).as_dict()


@scenario
def ignored_params():
    """An ignored parameter stays whole and is not reduced: its gradient is this rank's own."""
    net, reference = init_numpy(TinyLM()), init_numpy(TinyLM())
    ignored = net.norm.gamma
    for layer in net.layers:
        fs.fully_shard(layer)
    fs.fully_shard(net, ignored_params=[ignored])
    assert net.norm.gamma is ignored and ignored.shape == (8,)
    params = net.trainable_params()
    ids, labels = lm_batch(0, 4)
    _, grads = ms.value_and_grad(lambda: lm_loss(net, local_rows(ids), local_rows(labels)), None, params)()
    _, local_ref = ms.value_and_grad(lambda: lm_loss(reference, local_rows(ids), local_rows(labels)), None,
                                     reference.trainable_params())()
    index = [p.name for p in params].index("norm.gamma")
    assert_close(grads[index].asnumpy(), local_ref[index].asnumpy(), "ignored parameter's local gradient")
    return {}


class CastDense(nn.Cell):
    """A matrix stored in bf16 and used in fp32 (CPU MindSpore has no bf16 matmul)."""

    def __init__(self, rows, cols):
        super().__init__()
        self.weight = Parameter(Tensor(np.zeros((rows, cols), np.float32), dtype=ms.bfloat16), name="weight")

    def construct(self, x):
        return mint.matmul(x, self.weight.astype(ms.float32).swapaxes(0, 1))


class Bf16LM(nn.Cell):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 8)
        self.proj = CastDense(8, 8)
        self.out = CastDense(7, 8)

    def construct(self, ids):
        return self.out(ops.gelu(self.proj(self.emb(ids))))


@scenario
def bf16_travels_as_fp16_bits():
    """bf16 shards gather as float16 bits (exact, the same bytes) and their gradients are summed in fp32."""
    def build():
        net = init_numpy(Bf16LM())
        return net

    def wrap(net):
        fs.fully_shard(net.proj)
        fs.fully_shard(net)
        plan = net.proj._fullshard_unit.groups[0].plan
        assert plan.gather_carrier(0) == ("float16", True)
        assert plan.wire_dtype(0) == "float32"  # bf16 gradients, summed by a backend without bf16
    reset_traffic()
    result = run_parity(build, wrap, steps=1, atol=2e-2, rtol=2e-2, optimize=False)
    # gathered bytes: bf16 shards, 2 bytes per element (bit cast), never widened
    return {**result.as_dict(), "traffic": traffic_bytes()}


class Reused(TinyLM):
    """One block applied twice in a forward: its unit is gathered and reduced once per use."""

    def construct(self, ids):
        x = self.emb(ids)
        x = self.layers[0](self.layers[0](x))
        return self.head(self.norm(self.layers[1](x)))


@scenario
def unit_used_twice():
    return run_parity(Reused).as_dict()


class Narrow(nn.Cell):
    """A (1, 8) matrix on 2 ranks: rank 1's shard is empty."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 8)
        self.score = nn.Dense(8, 1)
        self.out = nn.Dense(1, 7)

    def construct(self, ids):
        return self.out(ops.tanh(self.score(self.emb(ids))))


@scenario
def empty_shard():
    """torch.chunk semantics: the last rank may hold nothing. fully_shard says what that means for
    MindSpore's optimizers; the gradients (empty on that rank) are still right."""
    import warnings

    def wrap(net):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fs.fully_shard(net)
        texts = [str(w.message) for w in caught]
        assert any("'score.weight'" in t and "rank(s) [1] hold none" in t for t in texts), texts
        assert net.score.weight.shape == ((1, 8) if fs_rank() == 0 else (0, 8))
    return run_parity(Narrow, wrap, steps=1, optimize=False).as_dict()
