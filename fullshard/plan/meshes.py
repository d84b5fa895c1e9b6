"""The memory and traffic formulas for a model whose parameters sit on several meshes (pure).

A mixture-of-experts model under expert parallelism (docs/moe.md) shards its dense weights over every
data-parallel rank (``world``) and its experts over the expert-FSDP mesh: each of ``ep`` ranks of an ``ep``
group holds ``1/ep`` of the experts, and those are sharded over the ``world / ep`` ranks that hold the same
experts. Each mesh is then a model of its own for ZeRO's formulas (:func:`fullshard.plan.formulas.per_rank_theory`):
its parameters, its ranks, its collectives. What a rank holds and moves is the sum over the meshes.

:func:`token_exchange_bytes` is what expert parallelism adds: the all-to-all of the routed tokens.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Union

from fullshard.plan.formulas import per_rank_theory
from fullshard.plan.group import Strategy


@dataclass(frozen=True)
class MeshShare:
    """The parameters of one role (``dense``, ``experts``) that shard over one mesh, counted in the full model:
    per wrapped unit (a layer) and the root's own. ``split`` ranks divide them before sharding (expert
    parallelism: each rank of an ``ep`` group holds ``1/ep`` of the experts), so their mesh has
    ``world / split`` ranks."""

    role: str
    units: tuple[int, ...]
    root: int = 0
    split: int = 1

    def __post_init__(self) -> None:
        for count in (*self.units, self.root):
            if count % self.split:
                raise ValueError(f"MeshShare {self.role!r}: {count} parameters do not split over {self.split} "
                                 f"expert-parallel ranks; every unit's experts must divide by ep")

    @property
    def num_params(self) -> int:
        """What one rank's mesh holds (before sharding): the role's parameters over ``split``."""
        return (sum(self.units) + self.root) // self.split


def moe_shares(dense_units: Sequence[int], dense_root: int, expert_units: Sequence[int], ep: int) -> list[MeshShare]:
    """The dense weights (per layer, and the root's) on the dense mesh; the experts (per layer) split over ``ep``."""
    shares = [MeshShare("dense", tuple(dense_units), dense_root)]
    if any(expert_units):
        shares.append(MeshShare("experts", tuple(expert_units), 0, ep))
    return shares


def mesh_theory(
    strategy: Strategy,
    world: int,
    shares: Sequence[MeshShare],
    *,
    replicas: int = 1,
    param_bytes: int = 4,
    optim_bytes: int = 8,
    compute_bytes: Optional[int] = None,
    reduce_bytes: Union[int, Callable[[int], int]] = 4,
    micro_batches: int = 1,
    replica_reduce_bytes: Optional[int] = None,
) -> dict:
    """Per mesh and in total, what a rank holds and moves per step (:func:`per_rank_theory` per mesh).

    ``world``: the ranks the dense weights shard over (HSDP: within one of ``replicas`` copies); a share with
    ``split`` s shards over ``world / s`` of them. ``reduce_bytes``: bytes per gradient element, or a function
    of the mesh's size (the exchange a group of that size uses may carry another dtype,
    ``formulas.gradient_wire_bytes``). ``total``'s ``unsharded`` adds the meshes' largest units: a unit
    gathers its parameters on every mesh before it runs, so its groups are in flight together.
    """
    meshes = []
    for share in shares:
        if world % share.split:
            raise ValueError(f"{share.role}: {world} ranks do not divide into expert-parallel groups of "
                             f"{share.split}; pick an ep that divides the world size")
        shards = world // share.split
        units = [count // share.split for count in (*share.units, share.root)]
        wire = reduce_bytes(shards) if callable(reduce_bytes) else reduce_bytes
        theory = per_rank_theory(
            strategy, shards, share.num_params, max(units), share.root // share.split, param_bytes=param_bytes,
            optim_bytes=optim_bytes, compute_bytes=compute_bytes, reduce_bytes=wire, micro_batches=micro_batches,
            replicas=replicas, replica_reduce_bytes=replica_reduce_bytes,
        )
        meshes.append({"role": share.role, "shards": shards, "replicas": replicas, "num_params": share.num_params,
                       **theory})
    return {"meshes": meshes, "total": sum_meshes(meshes)}


def sum_meshes(meshes: Sequence[dict]) -> dict:
    """The figures of several meshes added up (memory and traffic by key, bytes sent, the replicas' share)."""
    total: dict = {"num_params": 0, "memory": {}, "traffic": {}, "sent": 0.0, "replica": {}}
    for mesh in meshes:
        total["num_params"] += mesh["num_params"]
        total["sent"] += mesh["sent"]
        for part in ("memory", "traffic", "replica"):
            for key, value in mesh[part].items():
                total[part][key] = total[part].get(key, 0.0) + value
    return total


def token_exchange_bytes(
    ep: int, moe_layers: int, tokens: int, top_k: int, width: int, act_bytes: int, n_experts: int,
    micro_batches: int = 1, count_bytes: int = 8,
) -> float:
    """Expert parallelism's all-to-all payload per rank per step for ``tokens`` tokens per rank per step,
    each all-to-all counted by its buffer of this rank's own tokens.

    Per MoE layer, forward dispatches each token's ``top_k`` copies (``width`` activations each) to their
    experts' ranks and gets the experts' outputs back; backward sends both gradients the other way: four
    all-to-alls whose buffer of this rank's tokens has ``tokens * top_k * width`` elements. Before each
    dispatch the ranks exchange how many tokens go to each expert (``n_experts`` counts of ``count_bytes``),
    once per micro-batch. These sizes do not depend on the routing; how much of them leaves the rank does (the
    tokens routed to its own experts stay, and the other side of each exchange is what the router sent it), so
    no bytes-sent figure is given. Nothing without expert parallelism (``ep`` 1).
    """
    if ep == 1:
        return 0.0
    return float(moe_layers * (4 * tokens * top_k * width * act_bytes + micro_batches * n_experts * count_bytes))
