"""mindone's Qwen3-MoE wrapped with fullshard.mindspore in mindformers' pattern, on 2 msrun workers, against one
process, step by step (issue 30).

Set-up (not a dependency of the project, not in CI)::

    python3.11 -m venv .venv-mindone
    .venv-mindone/bin/pip install "numpy<2" mindspore==2.10.0 mindone==0.5.0 transformers==4.57.1

Run (from the repository root; msrun comes from the venv, which this script puts first on PATH)::

    PYTHONPATH=. .venv-mindone/bin/python tools/mindone_moe.py [--steps 3] [--micro 2]
    PYTHONPATH=. .venv-mindone/bin/python tools/mindone_moe.py --check-shims   # one process, no msrun

The model is mindone's ``Qwen3MoeForCausalLM`` (``mindone.transformers``), a tiny config (2 decoder layers, each a
sparse MoE block of 4 experts, top-2; vocab 32, hidden 8), fp32, random weights from a fixed numpy seed. Each rank
trains its half of every global batch; the reference trains the same weights on the whole batch in one process.
mindformers' ``apply_fsdp`` order: the embedding, then per decoder layer its experts (one unit on the expert mesh
``[dp_replicate, efsdp]``; mindone's experts are a ``CellList`` of per-expert MLPs, so the unit is the list of
them), the router and the two norms as nested units, then the layer; the head (kept after forward), the root.
``set_reduce_op_type("sum")`` with 1/world in each rank's loss, explicit forward and backward prefetch chains,
micro-batches each reducing into ``main_grad`` with ``set_requires_all_reduce(is_last)``, Adam stepping on
``main_grad``, then ``zero_grad()``. Configurations: ``seed`` (``strategy="optim_grads_params"``,
``comm_fusion=False``), ``fused`` (``comm_fusion=True``), ``hsdp`` (fused, the experts whole on each rank and
summed across ``dp_replicate=2``: there ``set_requires_all_reduce(False)`` keeps the first micro-batch's sums) and
``per_expert`` (fused, each expert a unit of its own with ``set_reduce_scatter_unused_params(True)``: an expert
with no token on a rank gets no gradient there, so it reduces at the end of backward on every rank; parity only,
its reductions are not counted).

Checked on every rank, the script exits non-zero otherwise: each step's loss (mean over ranks) against the
reference's, each step's ``main_grad`` against the reference's gradient (this rank's chunk), the final full
parameters (``full_state_dict``). The collectives of one backward are counted (fullshard's counters), attributed to
the unit whose gradient node issued them: each layer's experts are reduced by a collective of their own, on their
own mesh, with exactly the experts' bytes.

Shims. MindSpore 2.10's CPU backend lacks kernels for some ops mindone calls; each is replaced in this process by
CPU ops of the same meaning (the reference runs with the same shims, so the parity is fullshard's; fullshard
itself calls none of these):

* ``mint.arange`` (Arange: rotary frequencies, causal mask positions) -> numpy's arange (constants, no gradient);
* ``mint.topk`` (TopkExt: the router's top-k) -> ``ops.topk`` (differentiable in the values);
* ``mint.nn.functional.one_hot`` (OneHotExt: the expert mask) -> numpy (an integer mask, no gradient);
* one-argument ``mint.where`` (NonZeroExt: each expert's tokens) -> ``np.nonzero`` (indices, no gradient);
* ``Tensor.index_add_`` (InplaceIndexAddExt: scattering expert outputs back) -> ``copy_`` of the sum with
  ``ops.unsorted_segment_sum`` (differentiable in the source); an empty index adds nothing, so an expert with
  no token gets no gradient through it (fullshard's gradient node hands zeros for it);
* ``Tensor.normal_`` (InplaceNormal: mindone's init, overwritten here by the seeded weights) -> numpy normals;
* ``mint.nn.Embedding.construct`` (the Embedding kernel) -> ``ops.gather`` of the table rows.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

VOCAB, HIDDEN, LAYERS, EXPERTS, TOP_K, BATCH, SEQ = 32, 8, 2, 4, 2, 4, 6
CONFIGS = {
    "seed": dict(strategy="optim_grads_params", comm_fusion=False, expert_mesh="1x2"),
    "fused": dict(comm_fusion=True, expert_mesh="1x2"),
    "hsdp": dict(comm_fusion=True, expert_mesh="2x1"),
    "per_expert": dict(comm_fusion=True, expert_mesh="1x2", per_expert=True),
}
ATOL, RTOL = 1e-5, 1e-4


# ---------------------------------------------------------------------- shims (see the docstring)
def install_shims() -> None:
    import mindspore as ms
    from mindspore import Tensor, mint, ops

    where = mint.where
    rng = np.random.RandomState(1234)

    def arange(start=0, end=None, step=1, *, dtype=None):
        if end is None:
            start, end = 0, start
        values = np.arange(start, end, step)
        kind = {ms.int64: np.int64, ms.int32: np.int32, ms.float32: np.float32}.get(dtype)
        return Tensor(values.astype(kind or (np.int64 if values.dtype.kind == "i" else np.float32)))

    def topk(input, k, dim=-1, largest=True, sorted=True):
        return ops.topk(input, k, dim, largest, sorted)

    def one_hot(tensor, num_classes=-1):
        return Tensor(np.eye(num_classes, dtype=np.int64)[tensor.asnumpy()])

    def where_(*args, **kwargs):
        if len(args) == 1 and not kwargs:
            return tuple(Tensor(i.astype(np.int64)) for i in np.nonzero(args[0].asnumpy()))
        return where(*args, **kwargs)

    def index_add_(self, dim, index, source, alpha=1):
        assert dim == 0 and alpha == 1, "the shim covers mindone's use: dim 0, alpha 1"
        if index.shape[0] == 0:  # an expert without tokens: nothing to add (the CPU segment sum refuses it)
            return self
        self.copy_(self + ops.unsorted_segment_sum(source, index.astype(ms.int32), self.shape[0]))
        return self

    def normal_(self, mean=0.0, std=1.0, generator=None):
        self.copy_(Tensor((mean + std * rng.randn(*self.shape)).astype(np.float32)))
        return self

    def embedding(self, input):
        assert self.padding_idx is None and self.max_norm is None, "the shim covers a plain lookup"
        return ops.gather(self.weight, input, 0)

    mint.arange, mint.topk, mint.nn.functional.one_hot, mint.where = arange, topk, one_hot, where_
    Tensor.index_add_, Tensor.normal_ = index_add_, normal_
    mint.nn.Embedding.construct = embedding


# ---------------------------------------------------------------------- the model
def build(seed: int = 0):
    """mindone's Qwen3-MoE, tiny, fp32, every parameter drawn from numpy's RandomState(seed) in name order."""
    from mindspore import Tensor
    from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
    from mindone.transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=12, moe_intermediate_size=6,
        num_hidden_layers=LAYERS, num_attention_heads=2, num_key_value_heads=1, head_dim=4, num_experts=EXPERTS,
        num_experts_per_tok=TOP_K, max_position_embeddings=32, attn_implementation="eager", use_cache=False)
    net = Qwen3MoeForCausalLM(config)
    rng = np.random.RandomState(seed)
    for name, param in net.parameters_and_names():
        norm = name.endswith("norm.weight")
        value = (1.0 if norm else 0.0) + (0.1 if norm else 0.4) * rng.randn(*param.shape)
        param.set_data(Tensor(value.astype(np.float32)))
    return net


def batch(index: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.RandomState(1000 + index)
    return (rng.randint(0, VOCAB, (BATCH, SEQ)).astype(np.int32), rng.randint(0, VOCAB, (BATCH, SEQ)).astype(np.int32))


def loss_of(net, ids: np.ndarray, labels: np.ndarray):
    from mindspore import Tensor, ops

    logits = net(input_ids=Tensor(ids), use_cache=False).logits
    return ops.cross_entropy(logits.reshape(-1, VOCAB), Tensor(labels.reshape(-1)))


# ---------------------------------------------------------------------- mindformers' wrapping
def inner(layer) -> list:
    """The nested units of a decoder layer, in forward order (the experts' unit is named by its first cell)."""
    return [layer.input_layernorm, layer.post_attention_layernorm, layer.mlp.gate, layer.mlp.experts[0]]


def wrap(net, strategy=None, comm_fusion=True, expert_mesh="1x2", per_expert=False):
    import mindspore as ms
    import fullshard.mindspore as fs
    from mindspore.communication import get_group_size

    world = get_group_size()
    replicas, efsdp = (int(n) for n in expert_mesh.split("x"))
    dense = fs.init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    experts_mesh = fs.init_device_mesh("cpu", (replicas, efsdp), mesh_dim_names=("dp_replicate", "efsdp"))
    common = dict(mp_policy=fs.MixedPrecisionPolicy(reduce_dtype=ms.float32, apply_grad_on_fp32_main_grad=True),
                  strategy=strategy, comm_fusion=comm_fusion)
    model = net.model
    fs.fully_shard(model.embed_tokens, mesh=dense, **common)
    for layer in model.layers:
        if per_expert:  # each expert a unit; an idle one gets no gradient on some rank: reduce at the end
            for expert in layer.mlp.experts:
                fs.fully_shard(expert, mesh=experts_mesh, **common)
                expert.set_reduce_scatter_unused_params(True)
        else:
            fs.fully_shard(list(layer.mlp.experts), mesh=experts_mesh, **common)
        for cell in (layer.mlp.gate, layer.input_layernorm, layer.post_attention_layernorm):
            fs.fully_shard(cell, mesh=dense, **common)
        fs.fully_shard(layer, mesh=dense, **common)
    fs.fully_shard(net.lm_head, mesh=dense, reshard_after_forward=False, **common)
    fs.fully_shard(net, mesh=dense, **common)
    net.set_reduce_op_type("sum")  # each rank's loss carries 1/world instead (mindformers' backward sense)
    layers = list(model.layers)
    model.embed_tokens.set_modules_to_forward_prefetch([*inner(layers[0]), layers[0]])
    for i, layer in enumerate(layers):
        layer.set_modules_to_forward_prefetch([*inner(layers[i + 1]), layers[i + 1]] if i + 1 < len(layers)
                                              else [net.lm_head])
        layer.set_modules_to_backward_prefetch([*inner(layers[i - 1]), layers[i - 1]] if i else
                                               [model.embed_tokens])
    net.lm_head.set_modules_to_backward_prefetch([layers[-1]])
    return net


# ---------------------------------------------------------------------- counting, per gradient node
class Reductions:
    """The collectives fullshard counted between one unit's gradient node and the previous one (its reductions),
    by unit: each unit's node reports which units it reduced (``UnitGather``'s callback)."""

    def __init__(self, net) -> None:
        from fullshard.core.buffers import collective_calls, traffic_bytes
        from fullshard.core.unit import distinct_units

        self.calls, self.bytes = collective_calls, traffic_bytes
        self.units = distinct_units(c for _, c in net.cells_and_names())
        self.log: list[tuple[str, int, int]] = []
        self.before = None
        for unit in self.units:
            reported = unit.gather._on_reduced
            unit.gather._on_reduced = self._wrap(reported)

    def _wrap(self, reported):
        def on_reduced(units, held):
            now = (self.calls()["all_reduce"], self.bytes()["all_reduce"])
            names = ", ".join(u.name for u in units)
            self.log.append((names, now[0] - self.before[0], now[1] - self.before[1]))
            self.before = now
            return reported(units, held)
        return on_reduced

    def start(self) -> None:
        self.log = []
        self.before = (self.calls()["all_reduce"], self.bytes()["all_reduce"])


def expected_expert_reductions(net, comm_fusion: bool, layer: int) -> tuple[int, int]:
    """The experts' own reduction of one backward, from the model: every expert weight's gradient, fp32, over the
    expert mesh's shard group (CPU: an all-reduce of the whole padded buffer), or summed across the replicas."""
    unit = net.model.layers[layer].mlp.experts[0]._fullshard_unit
    (group,) = unit.groups
    params = list(net.model.layers[layer].mlp.experts.trainable_params())
    assert {id(p) for p in params} == {id(p.sharded) for p in group.params}, "the experts' unit holds the experts"
    if group.comm.size > 1:  # reduce-scatter over efsdp: each member padded to world chunks
        numel = sum(p.layout.padded_chunk_numel * group.comm.size for p in group.params)
    else:  # whole on each rank: the replica sum carries the gradients themselves
        numel = sum(int(np.prod(p.layout.shape)) for p in group.params)
    return (1 if comm_fusion else len(params)), 4 * numel


# ---------------------------------------------------------------------- one configuration, in a worker
def close(got, want, what: str) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape}, expected {want.shape}"
    error = float(np.abs(got - want).max()) if got.size else 0.0
    assert np.allclose(got, want, atol=ATOL, rtol=RTOL), f"{what}: max abs error {error:.3g}"
    return error


def shard_of(full: np.ndarray, param) -> np.ndarray:
    sharded = getattr(param, "_fullshard_param", None)
    if sharded is None or sharded.replicated:
        return full
    start, length = sharded.layout.local_offset(sharded.rank), sharded.layout.local_length(sharded.rank)
    return np.take(full, range(start, start + length), axis=sharded.layout.dim)


def idle_experts(net) -> list:
    """(layer, expert) pairs each time an expert ran on no token in this process (mindone calls it anyway)."""
    seen = []
    for li, layer in enumerate(net.model.layers):
        for e, expert in enumerate(layer.mlp.experts):
            expert.register_forward_pre_hook(
                lambda cell, args, li=li, e=e: seen.append((li, e)) if args[0].shape[0] == 0 else None)
    return seen


def train(name: str, steps: int, micro: int, lr: float = 1e-2) -> dict:
    import mindspore as ms
    from mindspore import Tensor, nn, ops
    from mindspore.communication import get_group_size, get_rank
    import fullshard.mindspore as fs

    settings = CONFIGS[name]
    world, rank = get_group_size(), get_rank()
    net, reference = wrap(build(), **settings), build()
    params, ref_params = net.trainable_params(), reference.trainable_params()
    opt, ref_opt = nn.Adam(params, learning_rate=lr), nn.Adam(ref_params, learning_rate=lr)
    counter, idle = Reductions(net), idle_experts(net)
    out = {"losses": [], "reference_losses": [], "max_grad_error": 0.0, "max_param_error": 0.0, "experts": []}
    for step in range(steps):
        total, ref_total, ref_grads = 0.0, 0.0, None
        for m in range(micro):
            ids, labels = batch(step * micro + m)
            last = m == micro - 1
            net.set_requires_all_reduce(last)
            rows = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
            counter.start()
            loss, _ = ms.value_and_grad(lambda: loss_of(net, ids[rows], labels[rows]) / micro / world, None, params)()
            if step == 0 and not settings.get("per_expert"):
                out["experts"].append(expert_lines(net, counter.log, settings, m, last))
            total += float(loss.asnumpy()) * world
            ref_loss, grads = ms.value_and_grad(lambda: loss_of(reference, ids, labels) / micro, None, ref_params)()
            ref_total += float(ref_loss.asnumpy())
            grads = [g.asnumpy() for g in grads]
            ref_grads = grads if ref_grads is None else [a + b for a, b in zip(ref_grads, grads)]
        mean = float(ops.AllReduce()(Tensor(np.array([total], np.float32))).asnumpy()[0]) / world
        out["losses"].append(mean)
        out["reference_losses"].append(ref_total)
        close(mean, ref_total, f"{name}: step {step} loss")
        for param, ref_param, want in zip(params, ref_params, ref_grads):
            assert param.name == ref_param.name, (param.name, ref_param.name)
            out["max_grad_error"] = max(out["max_grad_error"], close(
                param.main_grad.asnumpy(), shard_of(want, param), f"{name}: step {step} main_grad of {param.name}"))
        opt(tuple(p.main_grad for p in params))
        ref_opt(tuple(Tensor(g) for g in ref_grads))
        net.zero_grad()
    full = fs.full_state_dict(net)
    assert set(full) == {n for n, _ in reference.parameters_and_names()}
    for pname, param in reference.parameters_and_names():
        out["max_param_error"] = max(out["max_param_error"], close(full[pname], param.asnumpy(), f"{name}: {pname}"))
    out["idle_experts"] = sorted(set(idle))
    return out


def expert_lines(net, log: list, settings: dict, micro: int, last: bool) -> dict:
    """Check and describe the reductions of one backward: every unit's gradient node reduced that unit alone, once,
    and each layer's experts with their own collectives (none while the replica sum waits: the hsdp
    configuration's first micro-batch)."""
    from fullshard.core.unit import distinct_units

    units = [u.name for u in distinct_units(c for _, c in net.cells_and_names())]
    assert sorted(n for n, _, _ in log) == sorted(units), f"one node per unit, each reducing it alone: {log}"
    dense = [(n, c) for n, c, _ in log if ".mlp.experts." not in n]
    line = {"micro": micro, "dense": sum(c for _, c in dense), "dense_units": len(dense)}
    for li, layer in enumerate(net.model.layers):
        name = layer.mlp.experts[0]._fullshard_unit.name
        ((calls, nbytes),) = [(c, b) for n, c, b in log if n == name]
        want = expected_expert_reductions(net, settings["comm_fusion"], li)
        if settings["expert_mesh"] != "1x2" and not last:
            want = (0, 0)  # set_requires_all_reduce(False): the replica sums wait, nothing is sent
        assert (calls, nbytes) == want, f"layer {li} micro {micro}: experts reduced by {(calls, nbytes)}, want {want}"
        line[f"layer{li}"] = [calls, nbytes]
    return line


def worker(args) -> None:
    import mindspore as ms
    from mindspore.communication import get_rank, init

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    init()
    from fullshard.train.msrun import register_worker, run_dir

    register_worker(get_rank())
    install_shims()
    results = {name: train(name, args.steps, args.micro) for name in args.configs}
    Path(run_dir(), f"result_{get_rank()}.json").write_text(json.dumps(results))


# ---------------------------------------------------------------------- the shims' gradients, in one process
def check_shims(eps: float = 1e-3) -> int:
    """Autograd through the shims against central differences, along a random direction per parameter (the
    reference shares the shims, so parity alone would not see a wrong gradient in them). A step much larger than
    ``eps`` can flip a token's top-k choice and disagree for that reason alone."""
    import mindspore as ms
    from mindspore import Tensor

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    install_shims()
    net, (ids, labels) = build(), batch(0)
    params = net.trainable_params()
    _, grads = ms.value_and_grad(lambda: loss_of(net, ids, labels), None, params)()
    rng, failed = np.random.RandomState(5), 0
    for param, grad in zip(params, grads):
        direction, base = rng.randn(*param.shape).astype(np.float32), param.asnumpy().copy()
        ends = []
        for sign in (1, -1):
            param.set_data(Tensor(base + sign * eps * direction))
            ends.append(float(loss_of(net, ids, labels).asnumpy()))
        param.set_data(Tensor(base))
        numeric, analytic = (ends[0] - ends[1]) / (2 * eps), float((grad.asnumpy() * direction).sum())
        bad = abs(numeric - analytic) > 1e-3 + 1e-2 * abs(analytic)
        failed += bad
        print(f"{param.name:<48} {numeric:+.5f} {analytic:+.5f}{'  MISMATCH' if bad else ''}")
    print(f"{len(params) - failed} of {len(params)} directional derivatives agree (eps {eps:g})")
    return 1 if failed else 0


# ---------------------------------------------------------------------- the driver
def report(results: dict) -> None:
    print(f"{'config':<10} {'step':>4} {'loss (2 ranks)':>15} {'loss (1 process)':>17} {'|diff|':>9}")
    for name, r in results.items():
        for step, (a, b) in enumerate(zip(r["losses"], r["reference_losses"])):
            print(f"{name:<10} {step:>4} {a:>15.7f} {b:>17.7f} {abs(a - b):>9.2e}")
    print(f"\n{'config':<10} {'max main_grad err':>17} {'max final param err':>20}  idle (layer, expert) on rank 0")
    for name, r in results.items():
        print(f"{name:<10} {r['max_grad_error']:>17.2e} {r['max_param_error']:>20.2e}  {r['idle_experts']}")
    print("\nreductions of step 0, by gradient node (fullshard's counters; all-reduce calls, bytes):")
    print(f"{'config':<10} {'micro':>5} {'layer 0 experts':>16} {'layer 1 experts':>16} {'other units':>19}")
    for name, r in results.items():
        for e in r["experts"]:
            experts = [f"{c} x, {b} B" for c, b in (e["layer0"], e["layer1"])]
            dense = f"{e['dense']} x ({e['dense_units']} units)"
            print(f"{name:<10} {e['micro']:>5} {experts[0]:>16} {experts[1]:>16} {dense:>19}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--micro", type=int, default=2)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--check-shims", action="store_true",
                        help="instead: the shims' gradients against central differences, in this process")
    args = parser.parse_args()
    if args.check_shims:
        return check_shims()
    from fullshard.train.msrun import WorkerFailed, launch, run_dir

    if run_dir() is not None:  # a worker started by launch() below
        worker(args)
        return 0

    directory = Path(tempfile.mkdtemp(prefix="mindone_moe_"))
    argv = ["--steps", str(args.steps), "--micro", str(args.micro), "--configs", *args.configs]
    try:
        launch("tools.mindone_moe", argv, 2, directory, timeout=1500)
    except WorkerFailed as failure:
        print(f"FAILED (rank {failure.rank}): {failure}\n{failure.log}", file=sys.stderr)
        return 1
    results = json.loads((directory / "result_0.json").read_text())
    report(results)
    print(f"\nOK: 2 ranks match one process ({', '.join(results)}); logs in {directory}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
