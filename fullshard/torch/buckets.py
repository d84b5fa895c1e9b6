"""All-gather and reduce-scatter of one bucket, carrying out the ownership plan.

Each function issues its collective asynchronously and returns a pending
object whose ``finish()`` waits and completes the work (copy-out, gradient
installation, releasing transient buffers). No layout arithmetic lives here:
offsets and lengths come from ``fullshard.plan``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist

from fullshard.core.buffers import count
from fullshard.plan import (
    BucketLayout, Exchange, GatherPlan, Ownership, ReducePlan, ShardedGrad, Unsharded, grad_copy_may_be_async,
    reduce_scratch_chunks,
)
from fullshard.torch import collectives
from fullshard.torch.collectives import Borrowed, Owned
from fullshard.torch.param import ShardedParam


class CollectiveError(RuntimeError):
    """A collective failed or timed out (e.g. a peer died); names what it was doing and for whom."""


def wait(work, what: str) -> None:
    """Wait for a collective under the process group's timeout, naming it if it fails."""
    try:
        work.wait()
    except Exception as error:  # gloo/NCCL raise plain RuntimeErrors (peer gone, timeout)
        raise CollectiveError(f"{what} failed on rank {dist.get_rank()}: {error}") from error


def _rank_chunks(
    flat: torch.Tensor, bucket: BucketLayout, index: int, param: ShardedParam, ranks: Optional[range] = None
) -> list[torch.Tensor]:
    """The padded chunk of member ``index`` for each of ``ranks`` (default: all) in a rank-major buffer."""
    ranks = ranks if ranks is not None else range(bucket.world)
    start = bucket.offsets[index]
    per_rank = flat.view(len(ranks), bucket.chunk_numel)
    shape = param.layout.padded_chunk_shape
    return [per_rank[row, start : start + param.layout.padded_chunk_numel].view(shape) for row in range(len(ranks))]


def pack_rank_chunks(
    flat: torch.Tensor, bucket: BucketLayout, params: Sequence[ShardedParam],
    fulls: Sequence[Optional[torch.Tensor]], ranks: Optional[range] = None, solos_held: Sequence[bool] = (),
) -> None:
    """Write each full tensor's chunks for ``ranks`` into a rank-major buffer (padding zeroed; None: zeros), and,
    for a layout with presence counts, 1 for each member this rank holds a tensor for, else 0, then the same for
    the layout's ``solos`` (``solos_held``)."""
    ranks = ranks if ranks is not None else range(bucket.world)
    rows_of = flat.view(len(ranks), bucket.chunk_numel)
    if bucket.presence_offset is not None:
        flags = [full is not None for full in fulls] + list(solos_held)
        held = torch.tensor([float(flag) for flag in flags], dtype=flat.dtype, device=flat.device)
        rows_of[:, bucket.presence_offset:] = held
    if bucket.row_blocks and all(full is not None for full in fulls):
        rows = [full.reshape(bucket.world, -1)[ranks.start : ranks.stop] for full in fulls]
        end = bucket.presence_offset if bucket.presence_offset is not None else bucket.chunk_numel
        if end == bucket.chunk_numel:
            torch.cat(rows, dim=1, out=rows_of)  # casts to the buffer's dtype
        else:
            rows_of[:, :end] = torch.cat(rows, dim=1)
        return
    for index, (param, full) in enumerate(zip(params, fulls)):
        layout = param.layout
        for rank, chunk in zip(ranks, _rank_chunks(flat, bucket, index, param, ranks)):
            length = layout.local_length(rank)
            if full is None:
                chunk.zero_()
                continue
            chunk.narrow(layout.dim, 0, length).copy_(full.narrow(layout.dim, layout.local_offset(rank), length))
            chunk.narrow(layout.dim, length, layout.chunk - length).zero_()


def unpack_rank_chunks(flat: torch.Tensor, bucket: BucketLayout, params: Sequence[ShardedParam],
                       fulls: Sequence[torch.Tensor]) -> None:
    """The inverse of :func:`pack_rank_chunks` for all ranks: rebuild full tensors, padding dropped."""
    if bucket.row_blocks and all(full.dtype == flat.dtype for full in fulls):
        sizes = [p.layout.padded_chunk_numel for p in params]
        torch.split_with_sizes_copy(flat.view(bucket.world, bucket.chunk_numel), sizes, dim=1,
                                    out=[full.view(bucket.world, -1) for full in fulls])
        return
    for index, (param, full) in enumerate(zip(params, fulls)):
        layout = param.layout
        for rank, chunk in enumerate(_rank_chunks(flat, bucket, index, param)):
            length = layout.local_length(rank)
            full.narrow(layout.dim, layout.local_offset(rank), length).copy_(chunk.narrow(layout.dim, 0, length))


@dataclass
class PendingGather:
    """An issued all-gather; ``finish()`` waits, copies out where planned, releases its inputs."""

    work: Any
    version_guard: Any
    transient: list
    copy_out: Optional[Owned]  # the output to copy parameters out of (OWN_STORAGE plans), else None
    bucket: BucketLayout
    params: list
    label: str

    def finish(self) -> None:
        wait(self.work, f"all-gather of {self.label}")
        # The collective bumps the output's autograd version counter (from a
        # background thread, some time before the wait returns). Backward saved
        # the unsharded parameters that view this output; refilling them with
        # the same values must not look like an in-place edit, so the version
        # taken before the collective is restored now that it is done.
        with self.version_guard:
            pass
        self.version_guard = None
        if self.copy_out is not None:
            targets = [p.unsharded_storage.writable("copy out of the all-gather") for p in self.params]
            # as above: same values refilled into storage autograd saved
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(tuple(targets)):
                unpack_rank_chunks(self.copy_out.tensor, self.bucket, self.params, targets)
            self.transient.append(self.copy_out)
        collectives.release_all(self.transient)

    def abandon(self) -> None:
        """The gather failed: drop its buffers without freeing them (a transfer may still write)."""
        collectives.release_all(self.transient, idle=False)
        self.version_guard = None


def _pack_local_chunks(flat: torch.Tensor, bucket: BucketLayout, params: Sequence[ShardedParam]) -> None:
    """Write this rank's padded chunk of every member into ``flat`` (one rank's row of the bucket)."""
    if bucket.row_blocks and all(p.storage_device == flat.device for p in params):
        shards = [(p.padded_chunk if p.padded_chunk is not None else p.local_shard()).reshape(-1) for p in params]
        torch.cat(shards, out=flat)  # one copy (and cast to the compute dtype) for the whole row
        return
    for index, param in enumerate(params):
        start = bucket.offsets[index]
        region = flat[start : start + param.layout.padded_chunk_numel].view(param.layout.padded_chunk_shape)
        if param.padded_chunk is not None:
            region.copy_(param.padded_chunk, non_blocking=param.pin_memory)
        else:
            local = param.local_shard()
            length = local.shape[param.layout.dim]
            region.narrow(param.layout.dim, 0, length).copy_(local)
            region.narrow(param.layout.dim, length, param.layout.chunk - length).zero_()


def gather_bucket(
    bucket: BucketLayout,
    plan: GatherPlan,
    params: Sequence[ShardedParam],
    output: Owned,
    group: dist.ProcessGroup,
    label: str,
    exchange: Exchange,
    tag: int,
    kept: Optional[Owned] = None,
    comm: Any = None,
    mesh: Optional[str] = None,
) -> PendingGather:
    """Start the all-gather of one bucket into ``output`` (owned, already sized).

    ``kept``: the chunks this rank kept after a partial reshard (``reshard_after_forward=k``);
    gathered over the smaller ``group`` instead of packing the shards. ``comm``: the user's
    collective (``Exchange.CUSTOM``). ``mesh``: the group's key in the traffic meter.
    """
    dtype = params[0].compute_dtype
    with torch.no_grad():
        out = output.writable("all-gather into")
        # Taken before anything writes the output (packing, the exchange); see PendingGather.finish.
        version_guard = torch.autograd._unsafe_preserve_version_counter(out)
        transient: list = []
        in_place = kept is None and plan.packs_into_output
        if kept is not None:
            transient.append(kept)
            source = kept.tensor
        elif plan.input is Ownership.BORROWED:
            transient.append(collectives.borrow(params[0].padded_chunk.view(-1), f"sharded storage of {label}"))
            source = transient[-1].tensor
        elif in_place:
            # This rank's row of the owned output is the input: pack it there, no buffer of its own.
            source = out.view(bucket.world, -1)[dist.get_rank(group)]
            _pack_local_chunks(source, bucket, params)
        else:
            packed = collectives.allocate(bucket.chunk_numel, dtype, output.tensor.device, f"all-gather input of {label}",
                                      sources=[p.sharded._local_tensor for p in params])
            transient.append(packed)
            source = packed.writable("pack the all-gather input")
            _pack_local_chunks(source, bucket, params)
        work = collectives.all_gather(exchange, out, source, group, tag, input_in_place=in_place, comm=comm)
        if exchange is not Exchange.LOCAL:
            count("all_gather", out.numel() * out.element_size(), mesh)
    copy_out = output if plan.unsharded is Unsharded.OWN_STORAGE else None
    return PendingGather(work, version_guard, transient, copy_out, bucket, list(params), label)


def all_reduce_in_place(buffer: Owned, group: dist.ProcessGroup, mesh: Optional[str] = None) -> None:
    """Sum an owned buffer across ``group`` (HSDP's replica all-reduce), waiting for it; counted for ``mesh``."""
    work = dist.all_reduce(buffer.writable("all-reduce in place"), op=dist.ReduceOp.SUM, group=group, async_op=True)
    count("all_reduce", buffer.nbytes, mesh)
    wait(work, f"replica all-reduce of {buffer.what}")


@dataclass
class SoloCounts:
    """One reduction pass's presence counts of a group's single-member buckets (``plan.group.plan_presence``):
    whether this rank holds each one's gradient, and, once the reduction carrying them is complete, how many
    ranks did (read only where this rank lacks one: on a GPU, a read waits for the device)."""

    params: list  # the single buckets' parameters, in the layout's order of ``solos``
    held: list[bool]
    counts: Optional[list[float]] = None

    def any_rank_had(self, param: ShardedParam) -> bool:
        slot = next(i for i, p in enumerate(self.params) if p is param)
        if self.held[slot]:
            return True
        # The carrying reduction finishes before the single buckets (ParamGroup._start_reduce orders them).
        assert self.counts is not None, "a single bucket finished before the reduction carrying its counts"
        return self.counts[slot] > 0


@dataclass
class PendingReduce:
    """An issued gradient reduction; ``finish()`` waits, divides, installs the sharded gradients."""

    work: Any
    transient: list
    output: Owned
    bucket: BucketLayout
    plan: ReducePlan
    params: list
    held_here: list[bool]  # per member: this rank had a gradient for it
    divide_factor: float
    label: str
    # Set for HSDP: called with the reduce-scatter output once it is complete;
    # returns False when the gradient is kept as a partial sum instead of installed.
    combine: Optional[Callable[[Owned], bool]] = None
    # FSDPModule.set_all_reduce_hook: called on the summed output, in place, before the division.
    hook: Optional[Callable[[torch.Tensor], None]] = None
    hook_stream: Any = None  # set_all_reduce_hook(stream=...)
    # The group's single buckets' counts: carried by this reduction (it fills them in), or read by this single
    # bucket's.
    solo_counts: Optional[SoloCounts] = None

    def finish(self) -> None:
        wait(self.work, f"gradient reduction of {self.label} (if a module runs on some ranks only in a step, e.g. "
                        "an expert of its own, call set_reduce_scatter_unused_params(True) on it)")
        collectives.release_all(self.transient)
        if self.combine is not None and not self.combine(self.output):
            self.output = None  # now a partial sum owned by the group
            return
        with torch.no_grad():
            out = self.output.writable("divide the reduced gradient")
            if self.hook is not None:
                _run_hook(self.hook, out, self.hook_stream)  # it may write: the buffer is fullshard's to lend
            if self.divide_factor != 1:
                out.div_(self.divide_factor)
            self._read_solo_counts(out)
            had_grad = self._had_grad(out)
            for index, param in enumerate(self.params):
                if not param.requires_grad or not had_grad[index]:
                    continue  # frozen since the plan was made; or no rank had a gradient: none, as a reference
                layout = param.layout
                start = self.bucket.offsets[index]
                if self.plan.sharded_grad is ShardedGrad.VIEW_OF_OUTPUT:
                    local = out[start : start + layout.local_numel(param.rank)].view(layout.local_shape(param.rank))
                else:
                    chunk = out[start : start + layout.padded_chunk_numel].view(layout.padded_chunk_shape)
                    # An existing gradient is summed with the copy right away: it must have landed.
                    non_blocking = grad_copy_may_be_async(param.pin_memory, param.sharded.grad is not None)
                    # out of the reduced buffer, which is reclaimed below
                    local = collectives.copy_out(
                        chunk.narrow(layout.dim, 0, layout.local_length(param.rank)), param.sharded_grad_dtype,
                        param.storage_device, f"sharded gradient of '{param.fqn}' (copied out of {self.label})",
                        non_blocking,
                    )
                param.to_sharded_grad(local)
        if self.plan.sharded_grad is ShardedGrad.VIEW_OF_OUTPUT:
            self.output.hand_off()  # the sharded grads are views of it now; never freed by fullshard
        else:
            self.output.reclaim()
        self.output = None

    def _read_solo_counts(self, out: torch.Tensor) -> None:
        """A reduction carrying the single buckets' counts keeps them for those buckets, where this rank lacks
        some of their gradients (divided, as the rest: only whether a count is 0 matters)."""
        counts = self.solo_counts
        if self.bucket.solos and not all(counts.held):
            start = self.bucket.presence_offset + len(self.params)
            counts.counts = out[start:start + len(self.bucket.solos)].tolist()

    def _had_grad(self, out: torch.Tensor) -> list[bool]:
        """Per member: whether any rank had a gradient for it. A member this rank had one for, yes; one it had
        none for, what the presence counts say (read only then: on a GPU, a read waits for the device)."""
        if all(self.held_here):
            return list(self.held_here)
        if self.bucket.is_single and self.solo_counts is not None:
            return [self.solo_counts.any_rank_had(self.params[0])]
        if self.bucket.presence_offset is None:
            return list(self.held_here)
        counts = out[self.bucket.presence_offset:self.bucket.presence_offset + len(self.params)].tolist()
        return [held or count > 0 for held, count in zip(self.held_here, counts)]

    def abandon(self) -> None:
        """The step is abandoned: let the transfer end, then let go of the buffers. If it failed it
        may still be writing into them, so they are only dropped, never resized."""
        try:
            self.work.wait()
            idle = True
        except Exception:  # the step is lost either way; only the buffers' lifetime matters
            idle = False
        if self.output is not None:
            self.transient.append(self.output)
            self.output = None
        collectives.release_all(self.transient, idle=idle)


def _run_hook(hook: Callable[[torch.Tensor], None], out: torch.Tensor, stream: Any) -> None:
    if stream is None:
        hook(out)
        return
    device = torch.get_device_module(out.device.type)
    stream.wait_stream(device.current_stream())  # the reduction is done on the current stream
    with device.stream(stream):
        hook(out)
    device.current_stream().wait_stream(stream)  # what follows (the division) sees the hook's writes


def reduce_bucket(
    bucket: BucketLayout,
    plan: ReducePlan,
    params: Sequence[ShardedParam],
    grads: Sequence[Optional[torch.Tensor]],
    reduce_dtype: torch.dtype,
    wire_dtype: torch.dtype,
    group: dist.ProcessGroup,
    divide_factor: float,
    label: str,
    exchange: Exchange,
    tag: int,
    all_reduce: bool = False,
    comm: Any = None,
    solo_counts: Optional[SoloCounts] = None,
    device: Optional[torch.device] = None, mesh: Optional[str] = None,  # for no members; the meter's key
) -> PendingReduce:
    """Start the reduce-scatter (sum) of one bucket's unsharded gradients.

    ``grads`` were taken from autograd; on the BORROWED path the lone gradient itself is the collective's
    input and is only ever read (sent, summed), never freed or written; otherwise an owned input is packed
    (cast, padded, fused; zeros for a missing gradient). The input is in ``wire_dtype``, the output in
    ``reduce_dtype`` (they differ only for the pairwise exchange of gradients narrower than the reduce dtype,
    summed after widening). With ``all_reduce`` (replicated parameters) the packed, owned buffer is
    all-reduced in place and becomes the output. ``solo_counts``: the group's single buckets' counts, packed
    into this bucket (its layout's ``solos``) or read by this single one.
    """
    device, held = params[0].device if params else device, [g is not None for g in grads]
    with torch.no_grad():
        if plan.input is Ownership.BORROWED:
            source: Owned | Borrowed = collectives.borrow(grads[0].view(-1), f"gradient of {label}")
        else:
            what = f"reduce-scatter input of {label}"
            source = (collectives.allocate_pooled(comm, bucket.total_numel, wire_dtype, device, what, grads)
                      if plan.input_pooled else collectives.allocate(bucket.total_numel, wire_dtype, device, what,
                                                                 sources=grads))
            pack_rank_chunks(source.writable("pack the reduce-scatter input"), bucket, params, grads,
                             solos_held=solo_counts.held if bucket.solos else ())
        if all_reduce:
            work = collectives.all_reduce_sum(exchange, source.writable("all-reduce in place"), group)
            if exchange is not Exchange.LOCAL:
                count("all_reduce", source.nbytes, mesh)
            return PendingReduce(work, [], source, bucket, plan, list(params), held, divide_factor, label,
                                 solo_counts=solo_counts)
        read = (*grads, source.tensor)  # what the reduction reads on this rank
        output = collectives.allocate(bucket.chunk_numel, reduce_dtype, device, f"reduce-scatter output of {label}",
                                  sources=read)
        scratch = [
            collectives.allocate(bucket.chunk_numel, wire_dtype, device, f"reduce-scatter receive buffer of {label}",
                             sources=read)
            for _ in range(reduce_scratch_chunks(exchange, dist.get_world_size(group)))
        ]
        work = collectives.reduce_scatter(
            exchange, output.writable("reduce-scatter into"), source.tensor, group, tag,
            [buffer.writable("receive a peer's gradient chunk") for buffer in scratch], comm=comm,
        )
        if exchange is not Exchange.LOCAL:
            count("reduce_scatter", source.tensor.numel() * source.tensor.element_size(), mesh)
    return PendingReduce(work, [source, *scratch], output, bucket, plan, list(params), held, divide_factor,
                         label, solo_counts=solo_counts)
