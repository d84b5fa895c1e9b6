"""All-gather extensions: a parameter whose local tensor defines ``fsdp_pre_all_gather`` and
``fsdp_post_all_gather`` decides what travels and what the module sees (FSDP2's extension points,
which Float8 and NF4 training build on).

The hooks may sit on a tensor subclass or on one local tensor object (monkey-patched). Per gather:

* ``fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)`` (or just ``(mesh)``,
  the older form) returns the tensors to gather, each this rank's padded chunk, and metadata;
* each is all-gathered along dim 0 into an output fullshard owns (kept for the next gather);
* ``fsdp_post_all_gather(outputs, metadata, param_dtype)`` builds the unsharded tensor the first
  time; later gathers refill that same tensor (``out=``), which autograd may have saved;
* optionally (FSDP2 2.15, honoured on every torch) ``fsdp_should_release_all_gather_outputs_after_post_all_gather()``,
  read once at fully_shard: True frees the outputs right after each post hook rather than at reshard.

Ownership of what the hooks hand back: the gather inputs are borrowed (they may be the shard
itself) and only read. On reshard fullshard reclaims its own outputs, which frees the unsharded
tensor whenever it views them (Float8, NF4). Tensors the post hook allocated itself (its
"tensors to free", e.g. an upcast copy) were not allocated by fullshard: they are released by
dropping them, never resized, so their memory stays with the unsharded tensor.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from fullshard.core.buffers import count
from fullshard.plan import Exchange, exchange_tag
from fullshard.torch import collectives
from fullshard.torch.collectives import Kind, Owned
from fullshard.torch.buckets import wait
from fullshard.torch.param import ShardedParam, contiguous_stride


@dataclass
class ExtensionState:
    """What one extended parameter keeps between gathers."""

    outputs: list[Owned] = field(default_factory=list)
    unsharded: Optional[torch.Tensor] = None  # what fsdp_post_all_gather built the first time

    def reclaim(self) -> None:
        for output in self.outputs:
            if not output.is_reclaimed:  # already freed right after the post hook (release_gather_outputs)
                output.reclaim()


@dataclass
class PendingExtensionGather:
    works: list
    param: ShardedParam
    state: ExtensionState
    metadata: Any
    input_sizes: list[torch.Size]
    inputs: list  # borrowed, kept alive until the transfer is done
    label: str

    def finish(self) -> Optional[torch.Tensor]:
        """Complete the gather; returns the unsharded tensor the first time (None when refilled)."""
        for work in self.works:
            wait(work, f"all-gather of {self.label}")
        collectives.release_all(self.inputs)
        outputs = tuple(o.tensor.view(-1, *size[1:]) for o, size in zip(self.state.outputs, self.input_sizes))
        local, dtype = self.param.sharded._local_tensor, self.param.compute_dtype
        with torch.no_grad():
            if self.state.unsharded is not None:
                # Refilled in place with the same values' new version: autograd saved this tensor in
                # forward, and a refill for backward must not look like an edit (as for every gather).
                target = self.param.unsharded_data
                with torch.autograd._unsafe_preserve_version_counter(target):
                    local.fsdp_post_all_gather(outputs, self.metadata, dtype, out=target)
                self._release_outputs()
                return None
            unsharded, _tensors_to_free = local.fsdp_post_all_gather(outputs, self.metadata, dtype)
        self._release_outputs()
        self.state.unsharded = unsharded
        shape = self.param.layout.shape
        return torch.as_strided(unsharded, shape, contiguous_stride(shape), storage_offset=0)

    def _release_outputs(self) -> None:
        """The tensor's ``fsdp_should_release_all_gather_outputs_after_post_all_gather`` said the unsharded tensor
        holds copies, not views, of the outputs: the outputs are fullshard's, so they are reclaimed now instead of
        at reshard (the unsharded tensor and the raw outputs are not both alive in forward and backward);
        the next gather regrows them."""
        if self.param.release_gather_outputs:
            self.state.reclaim()

    def abandon(self) -> None:
        collectives.release_all(self.inputs)


def _check_padded(param: ShardedParam, inputs: tuple, group: dist.ProcessGroup) -> None:
    """Every rank must send a padded chunk. Only ranks whose shard is short can see a wrong size, so the
    ranks agree first (once, at the first gather): all raise together instead of the others hanging."""
    chunk = param.layout.padded_chunk_shape
    short = param.layout.needs_padding and any(tuple(t.shape) != chunk for t in inputs)
    flags = torch.tensor([float(short)], device=param.device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    if flags.item():
        raise ValueError(
            f"fsdp_pre_all_gather of parameter '{param.fqn}' must return all-gather inputs with the padded "
            f"sharded size {chunk} (its dim 0 does not divide by the {param.layout.world} ranks); some rank's "
            f"inputs are not (here: {[tuple(t.shape) for t in inputs]}); pad each input on dim 0"
        )


def gather_extended(
    param: ShardedParam, state: ExtensionState, group: dist.ProcessGroup, shard_mesh, module: torch.nn.Module,
    mp_policy: Any, exchange: Exchange, label: str, mesh: Optional[str] = None,
) -> PendingExtensionGather:
    """Start the all-gathers of what ``param``'s pre hook returns (counted for ``mesh``)."""
    local = param.sharded._local_tensor
    if param.offloaded:
        local = local.to(param.device)
    pre = local.fsdp_pre_all_gather
    if len(inspect.signature(pre).parameters) == 1:
        inputs, metadata = pre(shard_mesh)
    else:
        inputs, metadata = pre(shard_mesh, param.spec.shape, contiguous_stride(tuple(param.spec.shape)), module,
                               mp_policy)
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    world = dist.get_world_size(group)
    if not state.outputs:
        _check_padded(param, inputs, group)
        state.outputs = [
            collectives.allocate(world * t.numel(), t.dtype, t.device, f"all-gather output {i} of {label}", Kind.WORKING,
                             sources=inputs)
            for i, t in enumerate(inputs)
        ]
    works, borrowed = [], []
    with torch.no_grad():
        for index, (tensor, output) in enumerate(zip(inputs, state.outputs)):
            output.regrow()
            borrowed.append(collectives.borrow(tensor.reshape(-1), f"all-gather input {index} of {label}"))
            out = output.writable("all-gather into")
            tag = exchange_tag(f"{label}#{index}", "all_gather")
            works.append(collectives.all_gather(exchange, out, borrowed[-1].tensor, group, tag))
            if exchange is not Exchange.LOCAL:
                count("all_gather", out.numel() * out.element_size(), mesh)
    return PendingExtensionGather(works, param, state, metadata, [t.shape for t in inputs], borrowed, label)
