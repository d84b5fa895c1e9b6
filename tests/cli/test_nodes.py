"""The framework-free parts of multi-node runs (issue 23), without processes: node and rank arithmetic, the mesh
``--mesh auto`` chooses, the lines for combinations that cannot run, and the roll call that names lost ranks
(its ranks are threads here; tests/cli/test_multinode.py kills real processes)."""
import socket
import threading
import time

import pytest

from fullshard.train.nodes import (
    MeshChoice, Nodes, NodesError, choose_mesh, describe_ranks, nodes_from_flags, nodes_from_torchrun,
)
from fullshard.train.rollcall import RollCall

TORCHRUN_2X2 = {"RANK": "2", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "GROUP_WORLD_SIZE": "2",
                "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}


def test_nodes_number_ranks_node_by_node():
    nodes = nodes_from_flags(3, 1, 4, "10.0.0.1", 1234)
    assert (nodes.world, nodes.uniform) == (12, True)
    assert list(nodes.ranks_on(1)) == [4, 5, 6, 7] and nodes.node_of(9) == 2
    assert nodes_from_torchrun(TORCHRUN_2X2, {"nnodes": None, "node_rank": None}) == Nodes(2, 1, 2, 4, "10.0.0.1", 29400)


def test_auto_mesh_is_hsdp_across_nodes_and_fsdp_on_one():
    two = nodes_from_flags(2, 0, 2, None, None)
    assert choose_mesh("auto", two, "optim_grads_params") == MeshChoice("hsdp", (2, 2), True)
    assert "chosen by default" in choose_mesh("auto", two, "optim_grads").describe()
    assert choose_mesh("fsdp", two, "optim_grads_params") == MeshChoice("fsdp", (4,), False)
    assert choose_mesh("auto", two, "no_shard").kind == "fsdp"  # nothing to shard within a node
    assert choose_mesh("auto", nodes_from_flags(1, 0, 4, None, None), "optim").shape == (4,)


@pytest.mark.parametrize("make, message", [
    (lambda: nodes_from_flags(2, 2, 2, None, None), "--node-rank 2 is out of range for --nnodes 2: give 0 to 1"),
    (lambda: nodes_from_flags(2, -1, 2, None, None), "--node-rank -1 is out of range"),
    (lambda: nodes_from_flags(0, 0, 2, None, None), "--nnodes must be at least 1"),
    (lambda: nodes_from_flags(2, 0, 2, None, 70000), "--master-port 70000 is not a TCP port"),
    (lambda: choose_mesh("hsdp", Nodes(2, 0, 2, 5), "optim"), "world size 5 is not divisible by this node's 2 ranks"),
    (lambda: choose_mesh("hsdp", Nodes(2, 0, 2, 6), "optim"), "world size 6 is not 2 nodes x 2 ranks"),
    (lambda: choose_mesh("hsdp", Nodes(1, 0, 4, 4), "optim"), "--mesh hsdp replicates across nodes"),
    (lambda: choose_mesh("hsdp", Nodes(2, 0, 2, 4), "no_shard"), "--mesh hsdp with --strategy no_shard"),
    (lambda: choose_mesh("2d", Nodes(), "optim"), "unknown --mesh '2d'"),
    (lambda: nodes_from_torchrun(TORCHRUN_2X2, {"nnodes": 3, "node_rank": None}),
     "--nnodes 3 but torchrun started this process with --nnodes 2"),
])
def test_impossible_combinations_name_the_option(make, message):
    with pytest.raises(NodesError, match=message.replace("(", r"\(")) as caught:
        make()
    assert "\n" not in str(caught.value)


def test_lost_ranks_read_as_words():
    assert describe_ranks({3: 1, 2: 1}) == "ranks 2, 3 (node 1)"
    assert describe_ranks({0: 0, 5: 2}) == "rank 0 (node 0) and rank 5 (node 2)"


def _roll_call(world: int, node_of) -> tuple[dict[int, RollCall], dict[int, dict]]:
    """``world`` ranks as threads, each with its roll call; what each one's on_lost was told."""
    shared, barrier = {}, threading.Barrier(world)
    calls, told = {}, {}

    def rank_main(rank: int) -> None:
        def share(text: str) -> str:  # the frameworks' broadcast from rank 0
            if rank == 0:
                shared["address"] = text
            barrier.wait()
            return shared["address"]

        calls[rank] = RollCall.start(rank, node_of(rank), world, share, "127.0.0.1",
                                     lambda lost: told.setdefault(rank, lost), timeout=30)

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    return calls, told


def _vanish(call: RollCall) -> None:
    """What the kernel does to a killed process's socket: it closes, without a goodbye."""
    call._finished.set()  # this thread-rank is "dead": it reports nothing itself
    for conn in [call._hub] if call._hub else call._peers:
        conn.shutdown(socket.SHUT_RDWR)


def test_a_lost_node_is_named_to_every_surviving_rank():
    calls, told = _roll_call(6, lambda r: r // 2)
    began = time.monotonic()
    for rank in (4, 5):
        _vanish(calls[rank])
    assert all(calls[rank].settle(10) for rank in range(4))
    assert time.monotonic() - began < 5
    assert told == {r: {4: 2, 5: 2} for r in (0, 1, 2, 3)}  # the hub waited for the node's second rank


def test_a_finished_run_reports_nothing_and_losing_the_hub_names_rank_0():
    calls, told = _roll_call(3, lambda r: r)
    for call in calls.values():
        call.finish()
    time.sleep(0.5)
    assert told == {} and not calls[1].settle(0.5)
    calls, told = _roll_call(3, lambda r: r)
    _vanish(calls[0])
    assert calls[1].settle(10) and calls[2].settle(10)
    assert told == {1: {0: 0}, 2: {0: 0}}
