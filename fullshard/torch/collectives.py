"""All-gather and reduce-scatter over a process group, the way ``fullshard.plan.exchange`` chose.

(A group of one rank exchanges nothing: LOCAL copies this rank's own data.)

Every function starts the exchange asynchronously and returns a handle whose
``wait()`` returns once the output is complete. Buffers are plain tensors
here: the caller passes only storage it may write (the outputs, scratch) and
keeps every input alive until the wait returns.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from fullshard.core.agreement import Ranks, alone
from fullshard.plan import Exchange


def _all_gather(*args, **kwargs):
    # torch 2.13 renamed the tensor-in/tensor-out collectives; older releases only have the old
    # names. Looked up at each call, so wrappers installed later (profilers, benchmarks) see them.
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def _reduce_scatter(*args, **kwargs):
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


class PairwiseWork:
    """The sends and receives of one pairwise exchange; ``wait()`` also runs its completion (the sum)."""

    def __init__(self, works: list, complete: Optional[Callable[[], None]] = None) -> None:
        self._works = works
        self._complete = complete

    def wait(self) -> bool:
        works, self._works = self._works, []
        for work in works:
            work.wait()
        if self._complete is not None:
            complete, self._complete = self._complete, None
            complete()
        return True


class _CustomWork:
    """What a user's collective returned: its work to wait on, or None when it ran synchronously."""

    def __init__(self, work: Any) -> None:
        self._work = work

    def wait(self) -> bool:
        if self._work is not None:
            self._work.wait()
        return True


def _peers(group: Optional[dist.ProcessGroup]) -> tuple[int, list[tuple[int, int]]]:
    """This rank's index in ``group`` and (index, global rank) of every other member."""
    me = dist.get_rank(group)
    others = [
        (index, dist.get_global_rank(group, index) if group is not None else index)
        for index in range(dist.get_world_size(group))
        if index != me
    ]
    return me, others


def all_gather(
    exchange: Exchange, output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup],
    tag: int, input_in_place: bool = False, comm: Any = None,
) -> Any:
    """``output`` (rank-major) receives every rank's ``input``.

    ``input_in_place``: the caller already wrote ``input`` as this rank's chunk
    of ``output`` (the plan says so, nothing is inferred here). ``comm``: the
    user's collective for ``Exchange.CUSTOM`` (FSDP2's ``AllGather``).
    """
    if exchange is Exchange.COLLECTIVE:
        return _all_gather(output, input, group=group, async_op=True)
    if exchange is Exchange.CUSTOM:
        return _CustomWork(comm(output, input, group, async_op=True))
    if exchange is Exchange.LOCAL:
        if not input_in_place:
            output.copy_(input)
        return PairwiseWork([])
    me, peers = _peers(group)
    slots = output.view(len(peers) + 1, -1)
    source = input.view(-1)
    works = [dist.irecv(slots[index], rank, group=group, tag=tag) for index, rank in peers]
    works += [dist.isend(source, rank, group=group, tag=tag) for _, rank in peers]
    if not input_in_place:
        slots[me].copy_(source)  # while the peers' chunks are in flight
    return PairwiseWork(works)


def all_reduce_sum(exchange: Exchange, buffer: torch.Tensor, group: Optional[dist.ProcessGroup]) -> Any:
    """Sum ``buffer`` in place across ``group`` (replicated parameters); a group of one has nothing to add."""
    if exchange is Exchange.LOCAL:
        return PairwiseWork([])
    return dist.all_reduce(buffer, op=dist.ReduceOp.SUM, group=group, async_op=True)


def reduce_scatter(
    exchange: Exchange, output: torch.Tensor, input: torch.Tensor, group: Optional[dist.ProcessGroup],
    tag: int, scratch: Sequence[torch.Tensor] = (), comm: Any = None,
) -> Any:
    """``output`` receives the sum over ranks of this rank's chunk of each rank's ``input`` (read only).

    Pairwise: the first peer's contribution is received into ``output`` (its
    last bytes, when the input travels in a narrower dtype than the output
    sums in), the others' into ``scratch`` (``plan.reduce_scratch_chunks`` of
    them, in the input's dtype); this rank's own chunk and the rest are added
    at the wait, in the output's dtype.
    """
    if exchange is Exchange.COLLECTIVE:
        return _reduce_scatter(output, input, op=dist.ReduceOp.SUM, group=group, async_op=True)
    if exchange is Exchange.CUSTOM:
        return _CustomWork(comm(output, input, group, dist.ReduceOp.SUM, async_op=True))
    if exchange is Exchange.LOCAL:  # a group of one: the sum is this rank's own chunk
        output.copy_(input.view(-1))
        return PairwiseWork([])
    me, peers = _peers(group)
    chunks = input.view(len(peers) + 1, -1)
    widen = output.dtype != input.dtype
    first = output.view(input.dtype)[-output.numel():] if widen else output
    targets = [first, *scratch]
    if len(targets) != len(peers):
        raise ValueError(f"pairwise reduce-scatter over {len(peers) + 1} ranks needs {len(peers) - 1} scratch chunks")
    works = [dist.irecv(target, rank, group=group, tag=tag) for target, (_, rank) in zip(targets, peers)]
    works += [dist.isend(chunks[index], rank, group=group, tag=tag) for index, rank in peers]

    def add_own_and_scratch() -> None:
        if widen:
            _widen_and_add(output, first, chunks[me])
        else:
            output.add_(chunks[me])
        for extra in scratch:
            output.add_(extra)

    return PairwiseWork(works, add_own_and_scratch)


# Elements widened per step by _widen_and_add (a 256 KiB fp32 temporary).
_WIDEN_BLOCK = 1 << 16


def _widen_and_add(output: torch.Tensor, received: torch.Tensor, own: torch.Tensor) -> None:
    """``output = received + own`` in the output's dtype, where ``received`` (narrower) lives in output's last bytes.

    Blocks go front to back, and each block of ``received`` is copied out
    before that block of the output is written. Writing output[:end] touches
    its first end*R bytes (R, W: the output's and the received dtype's sizes,
    R > W), while received[end:] starts at byte C*R - (C-end)*W >= end*R:
    nothing still to be read is ever overwritten.
    """
    for start in range(0, output.numel(), _WIDEN_BLOCK):
        end = min(output.numel(), start + _WIDEN_BLOCK)
        peer = received[start:end].to(output.dtype)  # a copy, taken before output[start:end] is written
        torch.add(peer, own[start:end], out=output[start:end])


def ranks_summing_over(groups: Sequence[Optional[dist.ProcessGroup]], device: torch.device) -> Ranks:
    """Every rank of the default group, summing a short float32 vector over ``groups`` in turn (None: the
    default group): control messages (agreement, shared failures), never counted as traffic. Alone without a
    process group."""
    if not dist.is_initialized():
        return alone()

    def sum_over_ranks(values: list[float]) -> list[float]:
        buffer = torch.tensor(values, dtype=torch.float32, device=device)
        for group in groups:
            dist.all_reduce(buffer, group=group)
        return buffer.tolist()

    return Ranks(sum_over_ranks, dist.get_rank(), dist.get_world_size())

