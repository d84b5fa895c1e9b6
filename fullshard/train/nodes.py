"""Where the ranks of a run live, and the mesh the training job builds over them.

Framework-free: the CLI, the torch job and the MindSpore job share it. A run
has ``nnodes`` nodes (machines, or launcher agents on one host); node ``k``
holds ranks ``k * per_node ... (k + 1) * per_node - 1``, the way torchrun
and msrun number them. The nodes come from ``fullshard train``'s own flags
(``--nnodes --node-rank --master-addr --master-port``) or, when torchrun
started the process, from the environment it sets.

The default mesh follows the network: with more than one node, HSDP
(replicate across nodes, shard within a node), so the all-gathers and
reduce-scatters of every step stay on a node's fast links and only the
gradient shards' all-reduce crosses machines; on one node, plain FSDP over
every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

MESHES = ("auto", "fsdp", "hsdp")
DEFAULT_MASTER_PORT = 29500


class NodesError(ValueError):
    """A combination of nodes, ranks and mesh that cannot run: one line naming the option and the fix."""


@dataclass(frozen=True)
class Nodes:
    nnodes: int = 1
    node_rank: int = 0
    per_node: int = 1  # ranks on this node (torchrun's LOCAL_WORLD_SIZE, msrun's --local_worker_num)
    world: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = DEFAULT_MASTER_PORT

    @property
    def uniform(self) -> bool:
        """Every node holds ``per_node`` ranks (what the rank arithmetic and HSDP need)."""
        return self.world == self.nnodes * self.per_node

    def node_of(self, rank: int) -> int:
        return rank // self.per_node

    def ranks_on(self, node: int) -> range:
        return range(node * self.per_node, (node + 1) * self.per_node)


def nodes_of(cfg, world: int) -> Nodes:
    """The nodes a worker's config names (one node of ``world`` ranks when it names none)."""
    return Nodes(**cfg.nodes) if cfg.nodes else Nodes(1, 0, world, world)


def nodes_from_flags(nnodes: Optional[int], node_rank: Optional[int], nproc: int, master_addr: Optional[str],
                     master_port: Optional[int]) -> Nodes:
    """The nodes ``fullshard train --nnodes N --node-rank R --nproc P ...`` describes (checked)."""
    nnodes = 1 if nnodes is None else nnodes
    node_rank = 0 if node_rank is None else node_rank
    if nnodes < 1:
        raise NodesError(f"--nnodes must be at least 1, got {nnodes}")
    if not 0 <= node_rank < nnodes:
        raise NodesError(f"--node-rank {node_rank} is out of range for --nnodes {nnodes}: give 0 to {nnodes - 1}")
    port = DEFAULT_MASTER_PORT if master_port is None else master_port
    if not 1 <= port <= 65535:
        raise NodesError(f"--master-port {port} is not a TCP port (1 to 65535)")
    return Nodes(nnodes, node_rank, nproc, nnodes * nproc, master_addr or "127.0.0.1", port)


def nodes_from_torchrun(env: Mapping[str, str], flags: dict[str, Optional[int]]) -> Nodes:
    """The nodes torchrun set up for this worker; ``flags`` given as well must agree with it."""
    world, per_node = int(env["WORLD_SIZE"]), int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"]))
    nnodes, node_rank = int(env.get("GROUP_WORLD_SIZE", 1)), int(env.get("GROUP_RANK", 0))
    started = {"nnodes": nnodes, "node_rank": node_rank, "nproc": per_node}
    for name, value in flags.items():
        if value is not None and value != started[name]:
            option = "--" + name.replace("_", "-")
            raise NodesError(f"{option} {value} but torchrun started this process with {option} {started[name]}: "
                             f"under torchrun give the sizes to torchrun only (or drop {option})")
    return Nodes(nnodes, node_rank, per_node, world, env.get("MASTER_ADDR", "127.0.0.1"),
                 int(env.get("MASTER_PORT", DEFAULT_MASTER_PORT)))


@dataclass(frozen=True)
class MeshChoice:
    kind: str  # "fsdp" or "hsdp"
    shape: tuple[int, ...]
    by_default: bool

    @property
    def dim_names(self) -> tuple[str, ...]:
        return ("replicate", "shard") if self.kind == "hsdp" else ("shard",)

    def describe(self) -> str:
        if self.kind == "fsdp":
            return f"fsdp {self.shape[0]}: shard across all {self.shape[0]} ranks"
        replicas, shards = self.shape
        chosen = f" (chosen by default for {replicas} nodes; --mesh fsdp shards across all)" if self.by_default else ""
        return (f"hsdp {replicas}x{shards}: replicate across {replicas} nodes, shard within each node's "
                f"{shards} ranks{chosen}")


def choose_mesh(option: str, nodes: Nodes, strategy: str) -> MeshChoice:
    """``--mesh auto`` is HSDP across nodes when there is more than one (and something to shard), else FSDP."""
    if option not in MESHES:
        raise NodesError(f"unknown --mesh {option!r}; choose one of {', '.join(MESHES)}")
    kind = option
    if option == "auto":
        kind = "hsdp" if nodes.nnodes > 1 and strategy != "no_shard" else "fsdp"
    if kind == "fsdp":
        return MeshChoice("fsdp", (nodes.world,), option == "auto")
    if strategy == "no_shard":
        raise NodesError("--mesh hsdp with --strategy no_shard: no_shard replicates over every rank; "
                         "use --mesh fsdp (or another strategy)")
    if nodes.nnodes == 1:
        raise NodesError("--mesh hsdp replicates across nodes, and this run has one: use --mesh fsdp "
                         "(or start more nodes with --nnodes)")
    if nodes.world % nodes.per_node:
        raise NodesError(f"--mesh hsdp: the world size {nodes.world} is not divisible by this node's "
                         f"{nodes.per_node} ranks; HSDP needs the same number of ranks on every node "
                         "(--nproc-per-node), or use --mesh fsdp")
    if not nodes.uniform:
        raise NodesError(f"--mesh hsdp: the world size {nodes.world} is not {nodes.nnodes} nodes x "
                         f"{nodes.per_node} ranks; HSDP needs the same number of ranks on every node "
                         "(--nproc-per-node), or use --mesh fsdp")
    return MeshChoice("hsdp", (nodes.nnodes, nodes.per_node), option == "auto")


def describe_ranks(lost: Mapping[int, int]) -> str:
    """``{rank: node}`` as words: "ranks 2, 3 (node 1)", "rank 0 (node 0) and rank 5 (node 2)"."""
    by_node: dict[int, list[int]] = {}
    for rank, node in sorted(lost.items()):
        by_node.setdefault(node, []).append(rank)
    parts = [f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} (node {node})"
             for node, ranks in sorted(by_node.items())]
    return " and ".join(parts)
