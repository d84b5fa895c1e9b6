"""A small MoE on fullshard.mindspore, wrapped as mindformers wraps its GPT (``apply_fsdp``), on 2 msrun workers
against one process (the sanitizer on).

MindSpore's CPU backend has no all-to-all, so there is no token exchange: each rank routes its own tokens to its
own copy of every expert, and the experts' weights are sharded over the expert mesh. One expert gets no token on
rank 1 (a blocked route), so that rank skips it.
"""
from __future__ import annotations

import pytest

pytest.importorskip("mindspore")

import numpy as np  # noqa: E402

import mindspore as ms  # noqa: E402
from mindspore import Parameter, Tensor, mint, nn, ops  # noqa: E402

import fullshard.mindspore as fs  # noqa: E402
from fullshard.mindspore import collectives  # noqa: E402
from fullshard.mindspore.collectives import default_mesh  # noqa: E402
from tests.conftest import Launch, scenario  # noqa: E402
from tests.mindspore.parity import assert_close, lm_batch, local_rows, mean_over_ranks, rank, shard_of, world  # noqa: E402

LAUNCH = Launch(world_sizes=(2, 4), runtime="mindspore", env={"FULLSHARD_CHECK_OWNERSHIP": "1"})

VOCAB, D, H, EXPERTS, TOP_K, BATCH, SEQ = 8, 4, 6, 3, 2, 4, 3
IDLE_EXPERT = EXPERTS - 1  # never chosen by the tokens of the second half of each global batch (the last rank's rows)
SKIPPED: list = []  # (expert, tokens) each time an expert ran on no token here


class Experts(nn.Cell):
    """A grouped weight per projection ([expert, in, out]); an expert with no token is skipped."""

    def __init__(self) -> None:
        super().__init__()
        self.w1 = Parameter(Tensor(np.zeros((EXPERTS, D, H), np.float32)), name="w1")
        self.w2 = Parameter(Tensor(np.zeros((EXPERTS, H, D), np.float32)), name="w2")

    def construct(self, x: Tensor, weights: Tensor, mask: Tensor) -> Tensor:
        chosen = mask.asnumpy()
        out = ops.zeros_like(x)
        for e in range(EXPERTS):
            rows = np.nonzero(chosen[:, e])[0]
            if rows.size == 0:
                SKIPPED.append(e)
                continue
            index = Tensor(rows.astype(np.int32))
            hidden = ops.relu(mint.matmul(ops.gather(x, index, 0), self.w1[e]))
            y = mint.matmul(hidden, self.w2[e]) * ops.gather(weights[:, e:e + 1], index, 0)
            out = out + ops.unsorted_segment_sum(y, index, x.shape[0])
        return out


class MoELayer(nn.Cell):
    """Norm, top-k router (with a per-expert bias and a fixed temperature), grouped experts, a shared dense part."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm((D,))
        self.router = nn.Dense(D, EXPERTS, has_bias=False)
        self.experts = Experts()
        self.shared = nn.Dense(D, D)
        self.expert_bias = Parameter(Tensor(np.zeros(EXPERTS, np.float32)), name="expert_bias")
        self.temperature = Parameter(Tensor(np.ones(1, np.float32)), name="temperature", requires_grad=False)

    def construct(self, x: Tensor, blocked: Tensor) -> Tensor:
        b, s, d = x.shape
        t = self.norm(x).reshape(-1, d)
        gates = ops.softmax((self.router(t) + self.expert_bias) / self.temperature, -1)
        score = gates.asnumpy() - 1e9 * blocked.asnumpy().reshape(-1, EXPERTS)
        chosen = np.zeros(score.shape, np.float32)
        np.put_along_axis(chosen, np.argsort(-score, axis=1)[:, :TOP_K], 1.0, 1)
        mask = Tensor(chosen)
        return x + (self.shared(t) + self.experts(t, gates * mask, mask)).reshape(b, s, d)


class MoENet(nn.Cell):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, D)
        self.layers = nn.CellList([MoELayer() for _ in range(layers)])
        self.head = nn.Dense(D, VOCAB)

    def construct(self, ids: Tensor, blocked: Tensor) -> Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x, blocked)
        return self.head(x)


def build(seed: int = 0) -> MoENet:
    net = MoENet()
    rng = np.random.RandomState(seed)
    for name, param in net.parameters_and_names():
        if name.endswith("temperature"):
            continue
        value = (1.0 if name.endswith("gamma") else 0.0) + (0.5 if param.ndim > 1 else 0.1) * rng.randn(*param.shape)
        param.set_data(Tensor(value.astype(np.float32)))
    return net


def batch(index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    ids, labels = lm_batch(index, BATCH, vocab=VOCAB, seq=SEQ)
    blocked = np.zeros((BATCH, SEQ, EXPERTS), np.float32)
    blocked[BATCH // 2:, :, IDLE_EXPERT] = 1.0
    return ids, labels, blocked


def loss_of(net: nn.Cell, ids: np.ndarray, labels: np.ndarray, blocked: np.ndarray) -> Tensor:
    logits = net(Tensor(ids), Tensor(blocked))
    return ops.cross_entropy(logits.reshape(-1, VOCAB), Tensor(labels.reshape(-1)))


# ---------------------------------------------------------------------- mindformers' wrapping
def meshes(replicas: int = 1) -> tuple[fs.DeviceMesh, fs.DeviceMesh]:
    """The dense mesh [fsdp] and the experts' [dp_replicate, efsdp] (no ep dim: no token exchange on CPU)."""
    dense = fs.init_device_mesh("cpu", (world(),), mesh_dim_names=("fsdp",))
    return dense, fs.init_device_mesh("cpu", (replicas, world() // replicas), mesh_dim_names=("dp_replicate", "efsdp"))


def expert_placement(efsdp: int):
    """Experts on dim 0 if it divides over efsdp, else dim 1; None for what neither divides (replicated)."""
    def placement(param: Parameter):
        for dim in range(min(param.ndim, 2)):
            if param.shape[dim] % efsdp == 0:
                return fs.Shard(dim)
        return None
    return placement


def inner(layer: MoELayer) -> list:
    return [layer.experts, layer.router, layer.norm]


def wrap_mindformers(net: MoENet, expert_mesh: fs.DeviceMesh, dense: fs.DeviceMesh, **common) -> MoENet:
    """mindformers' ``apply_fsdp`` order: embedding, per layer the experts (expert mesh), router and norm as nested
    units then the layer, the head, the root; reductions summed ("sum"), explicit prefetch chains."""
    common.setdefault("mp_policy", fs.MixedPrecisionPolicy(reduce_dtype=ms.float32, apply_grad_on_fp32_main_grad=True))
    efsdp = expert_mesh.size(expert_mesh.ndim - 1)
    fs.fully_shard(net.emb, mesh=dense, **common)
    for layer in net.layers:
        placement = expert_placement(efsdp)
        whole = [p for p in layer.experts.trainable_params() if placement(p) is None]
        fs.fully_shard(layer.experts, mesh=expert_mesh, shard_placement_fn=placement, replicate_params=whole, **common)
        fs.fully_shard(layer.router, mesh=dense, **common)
        fs.fully_shard(layer.norm, mesh=dense, **common)
        fs.fully_shard(layer, mesh=dense, ignored_params=[layer.temperature], replicate_params=[layer.expert_bias],
                       **common)
    fs.fully_shard(net.head, mesh=dense, reshard_after_forward=False, **common)
    fs.fully_shard(net, mesh=dense, **common)
    net.set_reduce_op_type("sum")  # the loss carries 1/world instead (mindformers' backward sense)
    layers = list(net.layers)
    net.emb.set_modules_to_forward_prefetch([*inner(layers[0]), layers[0]])
    for i, layer in enumerate(layers):
        ahead = [*inner(layers[i + 1]), layers[i + 1]] if i + 1 < len(layers) else [net.head]
        layer.set_modules_to_forward_prefetch(ahead)
        layer.set_modules_to_backward_prefetch([*inner(layers[i - 1]), layers[i - 1]] if i else [net.emb])
    net.head.set_modules_to_backward_prefetch([layers[-1]])
    return net


def train(net: MoENet, steps: int = 2, micro: int = 2, sync: str = "always", lr: float = 1e-2,
          summed: bool = True) -> dict:
    """Train ``net`` (wrapped) and a reference in this process, step on ``main_grad``, then ``zero_grad()``; compare
    each step's loss and summed gradients and the final parameters. ``sync``: "always" (mindformers: every
    micro-batch reduces into main_grad), "gradient_sync" (``set_requires_gradient_sync(is_last)``) or "all_reduce"
    (``set_requires_all_reduce(is_last)``, torchtitan's HSDP). ``summed``: the reductions sum, so each rank's loss
    carries 1/world; otherwise fullshard's default division does it."""
    sense = 1.0 / world() if summed else 1.0
    reference = build()
    params, ref_params = net.trainable_params(), reference.trainable_params()
    # On 4 ranks the router's 3 rows leave the last rank an empty shard, which MindSpore's optimizers refuse
    # (fully_shard warns): that rank steps only what it holds, as a mindformers user does
    held = [p for p in params if p.size]
    opt, ref_opt = nn.Adam(held, learning_rate=lr), nn.Adam(ref_params, learning_rate=lr)
    result = {"losses": [], "reference_losses": [], "max_grad_error": 0.0, "max_param_error": 0.0}
    SKIPPED.clear()
    for step in range(steps):
        total, ref_total, ref_grads = 0.0, 0.0, None
        for m in range(micro):
            ids, labels, blocked = batch(step * micro + m)
            last = m == micro - 1
            if sync == "gradient_sync":
                net.set_requires_gradient_sync(last)
            elif sync == "all_reduce":
                net.set_requires_all_reduce(last)
            rows = [local_rows(a) for a in (ids, labels, blocked)]
            loss, _ = ms.value_and_grad(lambda: loss_of(net, *rows) / micro * sense, None, params)()
            total += float(loss.asnumpy()) / sense
            ref_loss, grads = ms.value_and_grad(lambda: loss_of(reference, ids, labels, blocked) / micro, None,
                                                ref_params)()
            ref_total += float(ref_loss.asnumpy())
            grads = [g.asnumpy() for g in grads]
            ref_grads = grads if ref_grads is None else [a + b for a, b in zip(ref_grads, grads)]
        result["losses"].append(mean_over_ranks(total))
        result["reference_losses"].append(ref_total)
        assert abs(result["losses"][-1] - ref_total) < 1e-5 + 1e-4 * abs(ref_total), (step, result)
        for param, ref_param, want in zip(params, ref_params, ref_grads):
            assert param.name == ref_param.name, (param.name, ref_param.name)
            result["max_grad_error"] = max(result["max_grad_error"], assert_close(
                param.main_grad.asnumpy(), shard_of(want, param), f"step {step} main_grad of {param.name}"))
        opt(tuple(p.main_grad for p in held))
        ref_opt(tuple(Tensor(g) for g in ref_grads))
        net.zero_grad()
        assert all(not p.main_grad.asnumpy().any() for p in params), "zero_grad() zeroes every main_grad"
    full = fs.full_state_dict(net)
    for name, param in reference.parameters_and_names():
        result["max_param_error"] = max(result["max_param_error"], assert_close(full[name], param.asnumpy(),
                                                                              f"final {name}"))
    assert set(full) == {n for n, _ in reference.parameters_and_names()}
    if rank() == world() - 1:
        assert IDLE_EXPERT in SKIPPED, "the last rank must have skipped the blocked expert"
    return result


def _experts_unit_layout(net: MoENet, shard: int, dims: tuple) -> None:
    experts = net.layers[0].experts
    group = experts._fullshard_unit.groups[0]
    assert group.comm.size == shard, (group.comm, shard)
    assert tuple(p.layout.dim for p in group.params) == dims, [p.layout for p in group.params]


@scenario
def mindformers_seed_configuration():
    """The seed's configuration (ZeRO-3 ``optim_grads_params``, every parameter alone: comm_fusion=False)."""
    dense, expert = meshes()
    net = wrap_mindformers(build(), expert, dense, strategy="optim_grads_params", comm_fusion=False)
    # 3 experts divide over neither 2 nor 4 ranks: dim 1 (4 wide) where it divides, w2's (6 wide) not over 4
    _experts_unit_layout(net, world(), (1, 1) if world() == 2 else (1,))
    return train(net)


@scenario
def mindformers_fused():
    """The same with comm_fusion=True (small parameters share a unit's gather and reduction)."""
    dense, expert = meshes()
    return train(wrap_mindformers(build(), expert, dense))


@scenario
def mindformers_gradient_sync_per_micro_batch():
    """``set_requires_gradient_sync(is_last_micro)``: the first micro-batch's gradients wait unreduced."""
    dense, expert = meshes()
    return train(wrap_mindformers(build(), expert, dense), sync="gradient_sync")


@scenario
def experts_replicated_over_dp_replicate():
    """Experts on [dp_replicate=2, efsdp=world/2] (on 2 ranks whole on each, summed across the replicas) with
    ``set_requires_all_reduce(is_last_micro)`` (torchtitan's HSDP pattern): the first micro-batch's sums wait."""
    dense, expert = meshes(replicas=2)
    net = wrap_mindformers(build(), expert, dense, comm_fusion=False)
    group = net.layers[0].experts._fullshard_unit.groups[0]
    assert group.comm.size == world() // 2 and group.replica.size == 2 and group.divisor == 1.0  # "sum"
    return train(net, sync="all_reduce")


@scenario
def per_parameter_mesh():
    """One call per layer, the experts sent to their own mesh by ``shard_placement_fn`` returning (placement,
    mesh): one group per mesh, every group divided by the call's data-parallel size (the default division)."""
    dense, expert = meshes(replicas=2)
    same_groups = fs.init_device_mesh("cpu", (1, world()), mesh_dim_names=("dp_replicate", "efsdp"))
    net = build()
    with pytest.raises(ValueError, match="shard_placement_fn returned .* for '[a-z_.0-9]+'; a tuple must be"):
        fs.fully_shard(net.layers[0], mesh=dense, shard_placement_fn=lambda p: (fs.Shard(0), "efsdp"))
    with pytest.raises(ValueError, match="gave '[a-z_.0-9]+' a mesh of its own, but strategy 'no_shard'"):
        fs.fully_shard(net.layers[0], mesh=dense, strategy="no_shard", shard_placement_fn=lambda p: (None, expert))
    assert not isinstance(net.layers[0], fs.FSDPModule)
    mp = fs.MixedPrecisionPolicy(reduce_dtype=ms.float32, apply_grad_on_fp32_main_grad=True)
    for layer in net.layers:
        experts = {id(p) for p in layer.experts.trainable_params()}
        norm = {id(p) for p in layer.norm.trainable_params()}
        fs.fully_shard(layer, mesh=dense, mp_policy=mp, replicate_params=[layer.expert_bias],
                       ignored_params=[layer.temperature],
                       shard_placement_fn=lambda p: (None, expert) if id(p) in experts else
                       (fs.Shard(0), same_groups) if id(p) in norm else None)
    fs.fully_shard(net, mesh=dense, mp_policy=mp)
    groups = net.layers[0]._fullshard_unit.groups
    # dense + norm (equal groups on two mesh objects: one group), the experts, the replicated expert_bias
    assert [(g.comm.size, g.replica.size if g.replica else 1, g.replicated) for g in groups] == [
        (world(), 1, False), (world(), 1, True), (world() // 2, 2, False)], groups
    assert all(g.divisor == world() for g in groups)
    return train(net, summed=False)


@scenario
def meta_device_init():
    """mindformers' meta init: build and wrap inside ``ms.DeviceCtx("meta")``, then ``to_empty`` (fullshard's own
    buffers too), then fill the shards; training matches the reference. Outside the context: a clear error."""
    dense, expert = meshes()
    with ms.DeviceCtx("meta"):
        net = MoENet()
    assert net.head.weight.is_meta
    with pytest.raises(RuntimeError, match="'weight' is on the meta device.*to_empty"):
        fs.fully_shard(net.head, mesh=dense)
    assert not isinstance(net.head, fs.FSDPModule)
    with ms.DeviceCtx("meta"):
        # meshes made inside the context are on the real device (the target reads "meta" there)
        assert default_mesh().shape == (world(),)
        wrap_mindformers(net, expert, dense)
    net.to_empty(device="CPU")
    values = {name: p.asnumpy() for name, p in build().parameters_and_names()}
    for name, param in net.parameters_and_names():
        param.set_data(Tensor(shard_of(values[name], param)))
    # MindSpore 2.10's storage copy writes nothing once a meta context came before its first use in a process (this
    # scenario alone); fullshard's gathers then refill host to host. Forced here, whatever ran before in the launch.
    storage_copy = collectives.storage_copy_works()
    collectives._STORAGE_COPY["works"] = False
    try:
        return {**train(net), "storage_copy_works": storage_copy}
    finally:
        collectives._STORAGE_COPY["works"] = storage_copy
