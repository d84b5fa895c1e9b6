"""How a bucket's bytes travel between ranks: the backend's collective, or pairwise sends (pure).

Both exchanges move the theoretical minimum ((N-1)/N of the full buffer sent
per rank); they differ in who does the work:

* COLLECTIVE: the backend's all-gather / reduce-scatter. Right for NCCL (and
  any accelerator backend), whose kernels are bandwidth-optimal and run off the
  compute stream.
* LOCAL: a group of one rank. Nothing travels; the "exchange" is this rank's
  own copy (cast, padding dropped), and no collective is issued.
* PAIRWISE: every rank sends each peer the chunk it needs (point-to-point) and
  sums what it receives itself. On gloo (CPU) this is what pays: measured on 2
  processes, gloo's reduce-scatter of 28 MB costs ~43 ms of CPU per rank
  (staging copies on the calling thread plus its own algorithm) against ~15 ms
  for the same exchange done with sends; the all-gather wall time drops by a
  fifth. On a CPU the communication threads compete with compute for the same
  cores, so CPU time saved is step time saved (``docs/performance.md``).

A pairwise reduce-scatter receives every peer's chunk at once, so it needs
N-2 chunks of scratch per bucket in flight (:func:`reduce_scratch_chunks`);
above ``MAX_PAIRWISE_RANKS`` ranks that memory is not worth it and gloo's own
collectives are used.

Gradients travel in their own dtype when it is narrower than the reduce
dtype and converts to it exactly (bf16 into fp32): pairwise, no partial sums
ever travel, only each rank's own gradients, which the receiver sums in the
reduce dtype. The sum is the same as casting first; the bytes are half
(:func:`wire_dtype`). A ring's partial sums need the reduce dtype on the wire.

The torch runtime asks :func:`choose_exchange` once per group; ``FULLSHARD_EXCHANGE``
(``collective`` or ``pairwise``) overrides the choice for every group, e.g. to
compare the two.

What a backend can do is a capability row (:class:`Backend`), so that no runtime decides from a backend's
name what it lacks; the MindSpore runtime asks :func:`choose_collectives` with one:

======  =====================  ==============  =========  =====  ==========================
name    all-gather on          reduce-scatter  sums       bf16   handles
======  =====================  ==============  =========  =====  ==========================
torch   any group              yes             all        yes    async (gloo, NCCL)
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

import enum
import zlib
from dataclasses import dataclass
from typing import Hashable, Optional, Sequence

EXCHANGE_ENV = "FULLSHARD_EXCHANGE"
MAX_PAIRWISE_RANKS = 8


class Exchange(enum.Enum):
    COLLECTIVE = "collective"
    PAIRWISE = "pairwise"
    LOCAL = "local"
    # Emulations for backends that lack a collective (MindSpore's CPU backend, mccl: ``MCCL`` below). Each
    # carries more than the theoretical minimum, and is counted as what it is (an all-reduce), so the cost shows:
    # a reduce-scatter done as an all-reduce of the whole buffer, each rank keeping its own chunk;
    ALL_REDUCE_CHUNK = "all_reduce_chunk"
    # an all-gather within a sub-group done as an all-reduce of a buffer that is zero but for each
    # rank's own chunk.
    ZERO_FILLED_ALL_REDUCE = "zero_filled_all_reduce"
    # The user's own collective (FSDP2's set_custom_all_gather / set_custom_reduce_scatter), called
    # on buffers from its own allocator: fullshard writes them and lets them go by dropping them
    # (memory from a communication pool is not fullshard's to resize).
    CUSTOM = "custom"


def backend_for_device(backend: str, device_type: str) -> str:
    """The backend serving ``device_type`` in torch's backend string ("gloo", "cpu:gloo,cuda:nccl")."""
    if ":" not in backend:
        return backend
    for entry in backend.split(","):
        device, _, name = entry.partition(":")
        if device.strip() == device_type:
            return name.strip()
    return ""


# The backend torch.distributed uses for each device type when none is named (and the main job's choice).
DEFAULT_BACKENDS = {"cpu": "gloo", "cuda": "nccl"}


def choose_exchange(backend: str, device_type: str, group_size: int, override: Optional[str] = None) -> Exchange:
    """LOCAL for a group of one; PAIRWISE for CPU tensors on gloo groups of up to MAX_PAIRWISE_RANKS, else
    COLLECTIVE; ``override`` chooses between the last two.

    Pairwise needs gloo's point-to-point semantics (sends and receives posted
    in any order, matched by tag); NCCL runs a pair's messages in issue order
    and ignores tags, so forcing it there is refused rather than left to hang.
    With one rank there is nothing to exchange, whatever the override says.
    """
    on_gloo_cpu = device_type == "cpu" and backend_for_device(backend, device_type) == "gloo"
    if override:
        try:
            chosen = Exchange(override.strip().lower())
            if chosen not in (Exchange.COLLECTIVE, Exchange.PAIRWISE):
                raise ValueError(chosen)
        except ValueError:
            choices = " or ".join(repr(e.value) for e in (Exchange.COLLECTIVE, Exchange.PAIRWISE))
            raise ValueError(f"{EXCHANGE_ENV}={override!r} is not an exchange; set it to {choices}, or unset it") from None
        if chosen is Exchange.PAIRWISE and not on_gloo_cpu:
            raise ValueError(
                f"{EXCHANGE_ENV}=pairwise needs CPU tensors on a gloo process group (here: {device_type} tensors "
                f"on {backend!r}); unset it or set it to 'collective'"
            )
    if group_size == 1:
        return Exchange.LOCAL
    if override:
        return chosen
    return Exchange.PAIRWISE if on_gloo_cpu and group_size <= MAX_PAIRWISE_RANKS else Exchange.COLLECTIVE


# Every value of the key dtype is exactly a value of each listed dtype, which is at least twice as wide.
_CONVERTS_EXACTLY_INTO = {
    "bfloat16": ("float32", "float64"),
    "float16": ("float32", "float64"),
    "float32": ("float64",),
}


def wire_dtype(exchange: Exchange, grad_dtype: str, reduce_dtype: str) -> str:
    """The dtype gradients travel in for a reduce-scatter summed in ``reduce_dtype`` (dtype names, "bfloat16").

    Pairwise (and local): the gradient's own dtype when it converts exactly
    into the reduce dtype (the receiver widens and sums); otherwise, and for
    every exchange that sums on the wire (the backend's collective, its
    emulations, a user's), the reduce dtype (cast before sending).
    """
    if exchange in (Exchange.PAIRWISE, Exchange.LOCAL) and reduce_dtype in _CONVERTS_EXACTLY_INTO.get(grad_dtype, ()):
        return grad_dtype
    return reduce_dtype


def reduce_scratch_chunks(exchange: Exchange, group_size: int) -> int:
    """Owned receive buffers (each one chunk, in the wire dtype) a reduce-scatter needs besides its output.

    Pairwise: the first peer's contribution lands in the output itself (in its
    upper half when it travels in a dtype half as wide), each other peer's in a
    scratch chunk, all received at once and then summed. The backend's
    collective stages its own buffers, outside fullshard's count.
    """
    if exchange is Exchange.PAIRWISE:
        return max(group_size - 2, 0)
    return 0


def exchange_tag(label: str, kind: str) -> int:
    """A tag for the point-to-point messages of one bucket's all-gather or reduce-scatter.

    The same on every rank (a stable hash of the bucket's name, not Python's
    salted ``hash``), and different between buckets and between the two kinds,
    so the messages of two buckets of one model never match each other,
    whatever order the ranks issue exchanges in. (Two models with the same
    module names share tags; their exchanges, like any collectives, must then
    be issued in the same order on every rank, and gloo matches in order.)
    """
    return zlib.crc32(f"{kind}:{label}".encode()) & 0x7FFFFFFF


@dataclass(frozen=True)
class Backend:
    name: str
    all_gather_on_sub_groups: bool
    reduce_scatter: bool
    summed_dtypes: Optional[frozenset]  # dtypes an all-reduce sums ("float32", ...); None: every dtype
    moved_dtypes: Optional[frozenset]  # dtypes an all-gather moves; None: every dtype
    async_handles: bool


_FLOATS = frozenset({"float16", "bfloat16", "float32", "float64"})

MCCL = Backend(
    "mccl", all_gather_on_sub_groups=False, reduce_scatter=False,
    summed_dtypes=frozenset({"float16", "float32"}),
    moved_dtypes=frozenset({"float16", "float32", "float64", "int16", "int32", "int64"}),
    async_handles=False,
)
HCCL = Backend("hccl", True, True, _FLOATS, _FLOATS, True)
# torch.distributed's backends (gloo, NCCL) gather and sum every dtype fullshard sends.
TORCH = Backend("torch", True, True, None, None, True)

BACKENDS = {backend.name: backend for backend in (MCCL, HCCL, TORCH)}


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
    if table is None or dtype in table:
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


# ---------------------------------------------------------------------------------------------- meshes of one call
# A call's parameters may sit on several meshes (FSDP2's ShardPlacementResult: experts on an expert mesh); each
# mesh's parameters gather and reduce over their own ranks.
@dataclass(frozen=True)
class MeshFacts:
    """What the plan knows of the data-parallel mesh one parameter of a call is sharded over.

    ``key`` names its process groups (shard, replicate): parameters with equal keys gather and reduce together.
    """

    key: Hashable
    shard_size: int
    replicas: int = 1

    @property
    def data_parallel_size(self) -> int:
        return self.shard_size * self.replicas


@dataclass(frozen=True)
class MeshGroups:
    """A call's parameters split by mesh: ``members[g]`` are the parameter indices of group ``g`` (groups in order
    of first appearance, parameters in order), and the factor every group's gradients are divided by."""

    members: tuple[tuple[int, ...], ...]
    divide_factor: int


def plan_mesh_groups(call_mesh: MeshFacts, param_meshes: Sequence[MeshFacts]) -> MeshGroups:
    """One group per mesh (expert parallelism puts experts on an expert mesh, the rest on the call's).

    Every group divides by the data-parallel size of the whole call, the widest of its meshes, not by its own
    mesh's: under expert parallelism an expert's local gradient already sums what the tokens of every rank of
    its ``ep`` group sent it, so its own (expert data-parallel) mesh is ``ep`` times too small a divisor, and a
    mean over the global batch needs the division by every data-parallel rank. A parameter on a mesh that
    replicates it (HSDP) counts its replicas: shard x replicate covers the same ranks.
    """
    order: dict[Hashable, list[int]] = {}
    for index, mesh in enumerate(param_meshes):
        order.setdefault(mesh.key, []).append(index)
    widest = max([call_mesh.data_parallel_size] + [m.data_parallel_size for m in param_meshes])
    return MeshGroups(tuple(tuple(members) for members in order.values()), widest)
