"""What a communication backend can do, and which exchange carries each bucket's bytes on it (pure).

The torch runtime asks :func:`fullshard.plan.exchange.choose_exchange` (gloo, NCCL). The MindSpore
runtime asks :func:`choose_collectives` with one of the capability rows below, so that no runtime
decides from a backend's name what it lacks:

======  =====================  ==============  =========  =====  ==========================
name    all-gather on          reduce-scatter  sums       bf16   handles
======  =====================  ==============  =========  =====  ==========================
mccl    the world group only   no              fp16/fp32  no     none (every call blocks)
hccl    any group              yes             all        yes    async
======  =====================  ==============  =========  =====  ==========================

``mccl`` is MindSpore's CPU backend (measured with MindSpore 2.10: AllReduce sums only float16
and float32 and refuses integers and float64; AllGather moves any dtype but bfloat16, and only on
the world group). ``hccl`` (Ascend) is as its documentation says; it was not run here.

Where a collective is missing, an emulation carries the bytes (``Exchange.ALL_REDUCE_CHUNK``,
``Exchange.ZERO_FILLED_ALL_REDUCE``); :func:`carried_traffic` says what it really moves, for the
byte reports to show next to the theoretical minimum.
"""
from __future__ import annotations

from dataclasses import dataclass

from fullshard.plan.exchange import Exchange


@dataclass(frozen=True)
class Backend:
    name: str
    all_gather_on_sub_groups: bool
    reduce_scatter: bool
    summed_dtypes: frozenset  # dtypes an all-reduce sums ("float32", ...)
    moved_dtypes: frozenset  # dtypes an all-gather moves
    async_handles: bool


_FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})

MCCL = Backend(
    "mccl", all_gather_on_sub_groups=False, reduce_scatter=False,
    summed_dtypes=frozenset({"float16", "float32"}),
    moved_dtypes=frozenset({"float16", "float32", "float64", "int16", "int32", "int64"}),
    async_handles=False,
)
HCCL = Backend("hccl", True, True, _FLOATS, _FLOATS, True)

BACKENDS = {backend.name: backend for backend in (MCCL, HCCL)}


def backend_named(name: str) -> Backend:
    try:
        return BACKENDS[name]
    except KeyError:
        known = ", ".join(sorted(BACKENDS))
        raise ValueError(f"no capability table for communication backend {name!r} (known: {known})") from None


@dataclass(frozen=True)
class Collectives:
    """How one group's buckets travel: the gather's exchange and the gradient reduction's."""

    gather: Exchange
    reduce: Exchange

    @property
    def emulated(self) -> bool:
        return Exchange.ALL_REDUCE_CHUNK in (self.gather, self.reduce) or self.gather is Exchange.ZERO_FILLED_ALL_REDUCE


def choose_collectives(backend: Backend, group_size: int, group_is_world: bool) -> Collectives:
    """The backend's own collectives where it has them, an emulation where not; nothing for one rank.

    ``group_is_world``: the group holds every rank (mccl gathers only there). A sub-group (HSDP's
    shard groups) gathers by an all-reduce of a zero-filled buffer on such a backend.
    """
    if group_size == 1:
        return Collectives(Exchange.LOCAL, Exchange.LOCAL)
    gather = (
        Exchange.COLLECTIVE if group_is_world or backend.all_gather_on_sub_groups else Exchange.ZERO_FILLED_ALL_REDUCE
    )
    reduce = Exchange.COLLECTIVE if backend.reduce_scatter else Exchange.ALL_REDUCE_CHUNK
    return Collectives(gather, reduce)


def carrier_dtype(backend: Backend, dtype: str, summed: bool) -> str:
    """The dtype a buffer of ``dtype`` travels as, by its exchange: moved only (an all-gather), or summed.

    A dtype the backend handles travels as itself. bfloat16 without bf16 collectives travels as the
    bits of a float16 buffer of the same size when it is only moved (a bit cast: exact, no copy),
    and widened to float32 when it is summed (exact; the sum is then narrowed back). A zero-filled
    all-reduce sums, so it takes the summed carrier: adding zeros to every value keeps it (a -0.0
    becomes +0.0), which float16 bits standing for bfloat16 values would not.
    """
    table = backend.summed_dtypes if summed else backend.moved_dtypes
    if dtype in table:
        return dtype
    if dtype == "bfloat16" and not summed and "float16" in table:
        return "float16"
    if dtype in ("bfloat16", "float16") and "float32" in table:
        return "float32"
    raise ValueError(
        f"the {backend.name} backend cannot {'sum' if summed else 'move'} {dtype} buffers "
        f"(it {'sums' if summed else 'moves'} {', '.join(sorted(table))}); use one of those dtypes"
    )


def is_bit_cast(dtype: str, carrier: str) -> bool:
    """The carrier reinterprets the buffer's bytes (same width, no copy) rather than converting values."""
    return dtype != carrier and dtype == "bfloat16" and carrier == "float16"


def carried_traffic(payload: dict[str, float], collectives: Collectives, replica_payload: float = 0.0) -> dict[str, float]:
    """What the collectives of ``collectives`` really carry for the theoretical ``payload``, by the kind
    of collective that carries it (each buffer at its full size, as the traffic meter counts them).

    An emulated reduce-scatter is an all-reduce of the same buffer, and so is an emulated sub-group
    gather; ``replica_payload`` (HSDP: each reduced chunk summed across replicas) is an all-reduce too.
    Passing the result to :func:`fullshard.plan.strategy.bytes_sent_per_rank` gives what the
    emulation sends, next to what the payload needs.
    """
    carried = {"all_gather": 0.0, "reduce_scatter": 0.0, "all_reduce": replica_payload}
    if collectives.gather is Exchange.LOCAL:  # a group of one moves nothing; replicas may still sum
        return carried
    carried["all_reduce"] += payload.get("all_reduce", 0.0)
    gather, reduce = payload.get("all_gather", 0.0), payload.get("reduce_scatter", 0.0)
    carried["all_reduce" if collectives.gather is Exchange.ZERO_FILLED_ALL_REDUCE else "all_gather"] += gather
    carried["all_reduce" if collectives.reduce is Exchange.ALL_REDUCE_CHUNK else "reduce_scatter"] += reduce
    return carried
