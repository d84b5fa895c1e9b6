"""Bad input to fullshard.mindspore: a clear error naming the parameter, the cell and the fix, and nothing
half-applied (the cell keeps its class, its Parameter objects and no fullshard state); 2 msrun workers.
``error_graph_mode`` comes last: it switches MindSpore's mode (and back)."""
from __future__ import annotations

import time

import pytest

pytest.importorskip("mindspore")

import numpy as np  # noqa: E402

import mindspore as ms  # noqa: E402
from mindspore import Tensor, ops  # noqa: E402

import fullshard.mindspore as fs  # noqa: E402
from fullshard.core.checks import RanksDisagree  # noqa: E402
from tests.conftest import Launch, scenario  # noqa: E402
from tests.mindspore.parity import TinyLM, init_numpy, rank, world, wrap_layers  # noqa: E402

# The 2-worker MindSpore modules test_parity, test_ownership and test_errors share one msrun launch (group).
LAUNCH = Launch(world_sizes=(2,), runtime="mindspore", env={"FULLSHARD_CHECK_OWNERSHIP": "1"}, group="mindspore-2")


def _snapshot(net):
    return type(net), [(name, id(p)) for name, p in net.parameters_and_names()], [
        type(c) for _, c in net.cells_and_names()], any(hasattr(c, "_fullshard_unit") for _, c in net.cells_and_names())


def _refused(call, error_type, *fragments):
    try:
        call()
    except error_type as error:
        message = str(error)
    else:
        raise AssertionError(f"expected {error_type.__name__}")
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in: {message}"
    return message


def _refused_untouched(net, call, error_type, *fragments):
    before = _snapshot(net)
    message = _refused(call, error_type, *fragments)
    assert _snapshot(net) == before, "a refused fully_shard changed the cell"
    return message


@scenario
def error_mesh_world_mismatch():
    messages = [
        _refused(lambda: fs.init_device_mesh("cpu", (world() + 1,)), ValueError,
                 f"holds {world() + 1} ranks but the world has {world()}"),
        _refused(lambda: fs.init_device_mesh("cpu", (2, world())), ValueError,
                 f"holds {2 * world()} ranks but the world has {world()}"),
        _refused(lambda: fs.init_device_mesh("npu", (world(),)), ValueError, "MindSpore runs on CPU"),
    ]
    net = init_numpy(TinyLM())
    messages.append(_refused_untouched(net, lambda: fs.fully_shard(net, mesh="cpu"), TypeError, "init_device_mesh"))
    return messages


@scenario
def error_unknown_strategy():
    net = init_numpy(TinyLM())
    return _refused_untouched(net, lambda: fs.fully_shard(net, strategy="zero4"), ValueError,
                              "fully_shard(TinyLM)", "'zero4'", "'optim_grads_params'")


@scenario
def error_shard_dim_out_of_range():
    """Refused after other parameters were already checked: none of them may have been sharded."""
    net = init_numpy(TinyLM())

    def place(param):
        return fs.Shard(2) if param.name.endswith("fc2.weight") else fs.Shard(0)
    return _refused_untouched(net, lambda: fs.fully_shard(net, shard_placement_fn=place), ValueError,
                              "Shard(2)", "'layers.0.fc2.weight'", "(8, 16)", "[-2, 1]")


@scenario
def error_bad_placement():
    net = init_numpy(TinyLM())
    return _refused_untouched(net, lambda: fs.fully_shard(net, shard_placement_fn=lambda p: 0), ValueError,
                              "must return Shard(dim) or None")


@scenario
def error_ignored_params_not_in_cell():
    net, other = init_numpy(TinyLM()), TinyLM()
    return _refused_untouched(net, lambda: fs.fully_shard(net.layers[0], ignored_params=[other.norm.gamma]),
                              ValueError, "ignored_params", "not in the cell", other.norm.gamma.name)


@scenario
def error_fully_shard_twice():
    net = init_numpy(TinyLM())
    fs.fully_shard(net)
    before = [(n, id(p)) for n, p in net.parameters_and_names()]
    message = _refused(lambda: fs.fully_shard(net), ValueError, "already applied to TinyLM", "once per cell")
    assert [(n, id(p)) for n, p in net.parameters_and_names()] == before
    return message


@scenario
def error_tied_across_units():
    """A parameter tied between a wrapped child and its parent's own cell: refused, naming it."""
    net = init_numpy(TinyLM())
    net.layers[0].fc2.weight = net.layers[1].fc2.weight
    fs.fully_shard(net.layers[0])
    return _refused_untouched(net.layers[1], lambda: fs.fully_shard(net.layers[1]), ValueError,
                              "'fc2.weight'", "common parent")


@scenario
def error_containers_and_policies():
    net = init_numpy(TinyLM())
    return [
        _refused_untouched(net, lambda: fs.fully_shard(net.layers), ValueError, "CellList", "fully_shard(list("),
        _refused_untouched(net, lambda: fs.fully_shard(net, mp_policy=fs.MixedPrecisionPolicy(param_dtype=ms.int32)),
                           ValueError, "param_dtype"),
        _refused_untouched(net, lambda: fs.fully_shard(net, offload_policy="cpu"), ValueError, "offload_policy"),
    ]


@scenario
def error_dtype_cannot_travel():
    """mccl sums only fp16/fp32: a float64 parameter is refused at fully_shard, not in a bprop."""
    net = init_numpy(TinyLM())
    net.norm.gamma.set_dtype(ms.float64)
    return _refused_untouched(net, lambda: fs.fully_shard(net), ValueError, "'norm.gamma'", "cannot sum float64",
                              "reduce_dtype")


def _rank_1_differs(setting, build):
    """``build(odd)`` wraps a TinyLM, differently where ``odd`` (on rank 1). At the first forward every rank
    raises one RanksDisagree naming ``setting``, instead of exchanging mismatched buffers later (or failing in a
    kernel); the world group still works after it. Returns the message and the seconds to the error."""
    net = build(rank() == 1)
    start = time.perf_counter()
    message = _refused(lambda: net(Tensor(np.zeros((1, 5), np.int32))), RanksDisagree,
                       f"ranks disagree on {setting} of ", " on rank 1;")
    seconds = time.perf_counter() - start
    assert seconds < 10, seconds  # a hang would last until the launch times out
    assert ops.AllReduce()(Tensor(np.ones(1, np.float32))).asnumpy()[0] == world()
    return {"message": message, "seconds": seconds}


def _layers_then_root(**odd_settings):
    """``build(odd)`` for _rank_1_differs: TinyLM's layers, then the root, wrapped with ``odd_settings`` on
    rank 1 and the defaults elsewhere."""
    return lambda odd: wrap_layers(init_numpy(TinyLM()), **(odd_settings if odd else {}))


@scenario
def error_ranks_disagree():
    """Ranks that shard a parameter on different dims."""
    def build(odd):
        def place(param):
            return fs.Shard(1) if odd and param.name == "head.weight" else None
        return fs.fully_shard(init_numpy(TinyLM()), shard_placement_fn=place)
    result = _rank_1_differs("shard dim", build)
    assert "'head.weight'" in result["message"], result
    return result


@scenario
def error_disagree_on_strategy():
    return _rank_1_differs("strategy", _layers_then_root(strategy="optim"))


@scenario
def error_disagree_on_resharding():
    """Only the layers differ (the root keeps its parameters after forward either way)."""
    def build(odd):
        net = init_numpy(TinyLM())
        for layer in net.layers:
            fs.fully_shard(layer, reshard_after_forward=not odd)
        return fs.fully_shard(net)
    return _rank_1_differs("reshard_after_forward", build)


@scenario
def error_disagree_on_reduce_dtype():
    policy = fs.MixedPrecisionPolicy(reduce_dtype=ms.float16)
    return _rank_1_differs("reduce_dtype", _layers_then_root(mp_policy=policy))


@scenario
def error_disagree_on_param_dtype():
    policy = fs.MixedPrecisionPolicy(param_dtype=ms.float16)
    return _rank_1_differs("param_dtype", _layers_then_root(mp_policy=policy))


@scenario
def error_disagree_on_comm_fusion():
    return _rank_1_differs("comm_fusion", _layers_then_root(comm_fusion=False))


@scenario
def error_disagree_on_mesh():
    """Rank 1 replicates over the ranks rank 0 shards over (both meshes are made on every rank)."""
    meshes = [fs.init_device_mesh("cpu", (world(),)), fs.init_device_mesh("cpu", (world(), 1))]
    return _rank_1_differs("mesh", lambda odd: wrap_layers(init_numpy(TinyLM()), mesh=meshes[odd]))


@scenario
def error_disagree_on_requires_grad():
    def build(odd):
        net = init_numpy(TinyLM())
        net.layers[0].fc1.weight.requires_grad = not odd
        return fs.fully_shard(net)
    return _rank_1_differs("requires_grad", build)


@scenario
def error_graph_mode():
    """GRAPH_MODE: fully_shard refuses, and a cell sharded in PyNative refuses to run (not a compile error)."""
    net, sharded = init_numpy(TinyLM()), init_numpy(TinyLM())
    fs.fully_shard(sharded)
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        first = _refused_untouched(net, lambda: fs.fully_shard(net), RuntimeError, "PyNative mode only")
        second = _refused(lambda: sharded(Tensor(np.zeros((1, 5), np.int32))), RuntimeError,
                          "FSDPTinyLM was wrapped by fully_shard", "PyNative mode only")
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    return [first, second]
