"""Bad input to fullshard.mindspore: a clear error naming the parameter, the cell and the fix, and nothing
half-applied (the cell keeps its class, its Parameter objects and no fullshard state)."""
from __future__ import annotations

import mindspore as ms

import fullshard.mindspore as fs
from tests.ms_parity import TinyLM, init_numpy, world


def _snapshot(net):
    return type(net), [(name, id(p)) for name, p in net.parameters_and_names()], [
        type(c) for _, c in net.cells_and_names()], any(hasattr(c, "_fullshard_state") for _, c in net.cells_and_names())


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


def mesh_world_mismatch():
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


def unknown_strategy():
    net = init_numpy(TinyLM())
    return _refused_untouched(net, lambda: fs.fully_shard(net, strategy="zero4"), ValueError,
                              "fully_shard(TinyLM)", "'zero4'", "'optim_grads_params'")


def shard_dim_out_of_range():
    """Refused after other parameters were already checked: none of them may have been sharded."""
    net = init_numpy(TinyLM())

    def place(param):
        return fs.Shard(2) if param.name.endswith("fc2.weight") else fs.Shard(0)
    return _refused_untouched(net, lambda: fs.fully_shard(net, shard_placement_fn=place), ValueError,
                              "Shard(2)", "'layers.0.fc2.weight'", "(8, 16)", "[-2, 1]")


def bad_placement():
    net = init_numpy(TinyLM())
    return _refused_untouched(net, lambda: fs.fully_shard(net, shard_placement_fn=lambda p: 0), ValueError,
                              "must return Shard(dim) or None")


def ignored_params_not_in_cell():
    net, other = init_numpy(TinyLM()), TinyLM()
    return _refused_untouched(net, lambda: fs.fully_shard(net.layers[0], ignored_params=[other.norm.gamma]),
                              ValueError, "ignored_params", "not in the cell", other.norm.gamma.name)


def fully_shard_twice():
    net = init_numpy(TinyLM())
    fs.fully_shard(net)
    before = [(n, id(p)) for n, p in net.parameters_and_names()]
    message = _refused(lambda: fs.fully_shard(net), ValueError, "already applied to TinyLM", "once per cell")
    assert [(n, id(p)) for n, p in net.parameters_and_names()] == before
    return message


def parent_after_tied_child():
    """A parameter tied between a wrapped child and its parent's own cell: refused, naming it."""
    net = init_numpy(TinyLM())
    net.layers[0].fc2.weight = net.layers[1].fc2.weight
    fs.fully_shard(net.layers[0])
    return _refused_untouched(net.layers[1], lambda: fs.fully_shard(net.layers[1]), ValueError,
                              "'fc2.weight'", "common parent")


def containers_and_policies():
    net = init_numpy(TinyLM())
    return [
        _refused_untouched(net, lambda: fs.fully_shard(net.layers), ValueError, "CellList", "fully_shard(list("),
        _refused_untouched(net, lambda: fs.fully_shard(net, mp_policy=fs.MixedPrecisionPolicy(param_dtype=ms.int32)),
                           ValueError, "param_dtype"),
        _refused_untouched(net, lambda: fs.fully_shard(net, offload_policy="cpu"), ValueError, "offload_policy"),
    ]


def dtype_cannot_travel():
    """mccl sums only fp16/fp32: a float64 parameter is refused at fully_shard, not in a bprop."""
    net = init_numpy(TinyLM())
    net.norm.gamma.set_dtype(ms.float64)
    return _refused_untouched(net, lambda: fs.fully_shard(net), ValueError, "'norm.gamma'", "cannot sum float64",
                              "reduce_dtype")


def ranks_disagree():
    """Ranks that wrapped different models fail at the first forward, naming the parameter, instead of
    exchanging mismatched buffers later."""
    from mindspore import Tensor
    import numpy as np
    from tests.ms_parity import rank

    net = init_numpy(TinyLM())
    odd = rank() == 1
    fs.fully_shard(net, shard_placement_fn=lambda p: fs.Shard(1) if odd and p.name == "head.weight" else None)
    message = _refused(lambda: net(Tensor(np.zeros((1, 5), np.int32))), RuntimeError, "wrapped different models")
    assert "head.weight" in message, message
    return message


def graph_mode():
    """GRAPH_MODE: fully_shard refuses, and a cell sharded in PyNative refuses to run (not a compile error)."""
    net, sharded = init_numpy(TinyLM()), init_numpy(TinyLM())
    fs.fully_shard(sharded)
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        first = _refused_untouched(net, lambda: fs.fully_shard(net), RuntimeError, "PyNative mode only")
        from mindspore import Tensor
        import numpy as np
        second = _refused(lambda: sharded(Tensor(np.zeros((1, 5), np.int32))), RuntimeError,
                          "FSDPTinyLM was wrapped by fully_shard", "PyNative mode only")
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    return [first, second]


def suite():
    return {
        "error_mesh_world_mismatch": mesh_world_mismatch,
        "error_unknown_strategy": unknown_strategy,
        "error_shard_dim_out_of_range": shard_dim_out_of_range,
        "error_bad_placement": bad_placement,
        "error_ignored_params_not_in_cell": ignored_params_not_in_cell,
        "error_fully_shard_twice": fully_shard_twice,
        "error_tied_across_units": parent_after_tied_child,
        "error_containers_and_policies": containers_and_policies,
        "error_dtype_cannot_travel": dtype_cannot_travel,
        "error_ranks_disagree": ranks_disagree,
        "error_graph_mode": graph_mode,  # last: it switches the mode
    }
