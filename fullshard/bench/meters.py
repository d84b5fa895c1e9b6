"""What the torch benchmark measures of its contenders: the payload of every ``torch.distributed`` collective,
live tensor bytes on CPU (profiler replay) or CUDA, the training state by storage, and the sampled
communication storage of libraries without a meter."""
from __future__ import annotations

import contextlib
import os
import sys
import time
import weakref
from collections import Counter
from typing import Callable, Iterable, Iterator, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from fullshard.bench.report import POINT_TO_POINT


# Name -> (kind, the argument whose full size is the payload). The deprecated
# names forward to the new ones inside distributed_c10d, not through these
# module attributes, so every call is counted exactly once.
_COLLECTIVES = {
    "all_gather_single": ("all_gather", "output_tensor"),
    "all_gather_into_tensor": ("all_gather", "output_tensor"),
    "_all_gather_base": ("all_gather", "output_tensor"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "_reduce_scatter_base": ("reduce_scatter", "input"),
    "all_reduce": ("all_reduce", "tensor"),
    # Point-to-point: a send counts the bytes it sends; receives are only watched (memory phase).
    "isend": (POINT_TO_POINT, "tensor"),
    "send": (POINT_TO_POINT, "tensor"),
    "irecv": (None, "tensor"),
    "recv": (None, "tensor"),
}


class CollectiveMeter:
    """Payload bytes of every ``torch.distributed`` collective (and bytes sent point to point) while counting.

    Install it before any library runs: fullshard, FSDP2 and DDP's comm hook
    all look these functions up in ``torch.distributed`` at each call.
    """

    def __init__(self) -> None:
        self._counts: Optional[Counter] = None  # the step being counted, if any
        # Called with every collective's tensors (the memory phase's trackers).
        self.watchers: list[Callable[[list[torch.Tensor]], None]] = []

    def install(self) -> None:
        import inspect

        for name, (kind, arg) in _COLLECTIVES.items():
            original = getattr(dist, name, None)
            if original is not None:
                position = list(inspect.signature(original).parameters).index(arg)
                setattr(dist, name, self._wrap(original, kind, arg, position))

    def _wrap(self, original: Callable, kind: str, arg: str, position: int) -> Callable:
        def counted(*args, **kwargs):
            result = original(*args, **kwargs)
            if self._counts is not None and kind is not None:
                payload = args[position] if len(args) > position else kwargs[arg]
                self._counts[kind] += payload.numel() * payload.element_size()
            if self.watchers:
                tensors = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor)]
                for watch in self.watchers:
                    watch(tensors)
            return result

        counted.__wrapped__ = original
        return counted

    @contextlib.contextmanager
    def counting(self) -> Iterator[Counter]:
        """Count the bytes of the collectives issued inside the block, by kind, into the yielded Counter."""
        self._counts = counts = Counter()
        try:
            yield counts
        finally:
            self._counts = None


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def training_state(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> dict[str, list[torch.Tensor]]:
    """This rank's parameters, gradients and optimizer state (local shards).

    ``params`` must be taken at rest: inside a forward, a sharded module shows
    its unsharded parameters instead.
    """
    return {
        "params": [_local(p) for p in params],
        "grads": [_local(p.grad) for p in params if p.grad is not None],
        "optim": [_local(v) for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)],
    }


def storage_bytes(tensors: Iterable[torch.Tensor], seen: set[int]) -> int:
    """Bytes of the storages behind ``tensors`` not in ``seen`` (which grows)."""
    total = 0
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() and storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            total += storage.nbytes()
    return total


# ---------------------------------------------------------------------- memory
class CommSampler:
    """Peak live bytes of communication storage, sampled (FSDP2 and DDP have no meter).

    Live communication storage is the union of the buffers passed to a
    collective during the step (held weakly: once the library drops them, they
    are gone) and ``extra()`` (FSDP2's unsharded parameters), minus the
    storages of the training state (a reduce-scatter output that became the
    sharded gradient is state). It is sampled after every collective and at
    every forward boundary of a block, so the figure is a lower bound of the
    true peak, taken at the moments new buffers appear.
    """

    def __init__(self, trainer, extra: Callable[[], list[torch.Tensor]]) -> None:
        self._params = list(trainer.model.parameters())  # at rest: the sharded ones
        self._optimizer = trainer.optimizer
        self._extra = extra
        self._buffers: list[weakref.ref] = []
        self._hooks: list = []
        self.peak = 0
        self.transient_peak = 0  # the collectives' own buffers only, without extra()

    def see(self, tensors: list[torch.Tensor]) -> None:
        self._buffers.extend(weakref.ref(t) for t in tensors)
        self.sample()

    def sample(self, *_ignored) -> None:
        state: set[int] = set()
        for tensors in training_state(self._params, self._optimizer).values():
            storage_bytes(tensors, state)
        self._buffers = [ref for ref in self._buffers if ref() is not None]
        staging = [ref() for ref in self._buffers]
        self.transient_peak = max(self.transient_peak, storage_bytes(staging, set(state)))
        self.peak = max(self.peak, storage_bytes(staging + self._extra(), state))

    def hook_blocks(self, model: nn.Module) -> None:
        """Also sample inside each block's forward, while its parameters are unsharded."""
        for module in (*model.layers, model):
            self._hooks.append(module.register_forward_pre_hook(self.sample))
            self._hooks.append(module.register_forward_hook(self.sample, prepend=True))

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()


def fsdp2_unsharded(model: nn.Module) -> list[torch.Tensor]:
    """The storages FSDP2 all-gathers each parameter into (its unsharded parameter's data)."""
    from torch.distributed.fsdp import FSDPModule

    tensors = []
    for module in model.modules():
        if isinstance(module, FSDPModule):
            for group in module._get_fsdp_state()._fsdp_param_groups:
                for param in group.fsdp_params:
                    tensors.extend(param.all_gather_outputs)
    return tensors


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Kineto prints a line to fd 2 whenever the profiler starts and stops."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(os.devnull, "w") as devnull:
        os.dup2(devnull.fileno(), 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


class CpuAllocations:
    """Live tensor bytes on the CPU, replayed from the PyTorch profiler's allocator events.

    The profiler reports every allocation and free made while it runs, with
    the op that made it. Replaying them in time order gives the bytes
    allocated since entry and still alive (frees of older blocks are not
    reported, so older memory never counts). ``held``: live at the start of
    the measured step; ``peak``: the maximum during it.

    Two gaps are closed by hand. A collective's work object keeps its tensors
    alive, and when the backend's thread drops the last reference the free
    happens where the profiler does not look: so the storage of every tensor
    passed to a collective is watched (``watch``) and its death, timed by the
    same clock, frees its block. And blocks the backend allocates itself
    inside a collective (gloo copies a reduce-scatter's input) are left out:
    they are the backend's, as NCCL's buffers are outside CUDA's counters.
    """

    MARK = "fullshard.bench.measured_step"

    def __enter__(self) -> "CpuAllocations":
        self._deaths: list[tuple[int, int, int]] = []  # (time of death, address, time first seen)
        self._watched: "weakref.WeakKeyDictionary[torch.UntypedStorage, set[int]]" = weakref.WeakKeyDictionary()
        self._finalizers: list[weakref.finalize] = []
        self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        with _quiet_stderr():
            self._profiler.start()
        return self

    def watch(self, tensors: list[torch.Tensor]) -> None:
        """Note when the storages behind ``tensors`` (a collective's) die, on whatever thread."""
        for tensor in tensors:
            storage = tensor.untyped_storage()
            address = storage.data_ptr()
            addresses = self._watched.setdefault(storage, set())
            if address and address not in addresses:
                addresses.add(address)
                self._finalizers.append(weakref.finalize(storage, self._on_death, address, time.time_ns()))

    def _on_death(self, address: int, seen_ns: int) -> None:
        self._deaths.append((time.time_ns(), address, seen_ns))

    def measured_step(self):
        return torch.profiler.record_function(self.MARK)

    def __exit__(self, *exc) -> None:
        with _quiet_stderr():
            self._profiler.stop()
        for finalizer in self._finalizers:
            finalizer.detach()
        if exc[0] is None:
            self._replay(self._profiler.profiler.kineto_results.experimental_event_tree())

    def _replay(self, roots) -> None:
        from torch._C._profiler import _EventType

        nodes, stack = [], list(roots)
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children)
        mark = next(n for n in nodes if n.name == self.MARK)
        events = [
            (n.start_time_ns, n.extra_fields.ptr, n.extra_fields.alloc_size, _inside_collective(n))
            for n in nodes if n.tag == _EventType.Allocation
        ]
        events += [(when, address, 0, seen) for when, address, seen in self._deaths]
        live: dict[int, tuple[int, int]] = {}  # address -> (bytes, time allocated) of the blocks counted
        backend: set[int] = set()  # addresses of the backend's blocks
        total, self.held, self.peak = 0, None, None
        for when, address, nbytes, extra in sorted(events, key=lambda e: e[0]):
            if when > mark.end_time_ns:
                break
            if self.held is None and when >= mark.start_time_ns:
                self.held = self.peak = total
            if nbytes > 0:  # an allocation; a reused address means the block there was freed unseen
                backend.discard(address)
                total -= live.pop(address, (0, 0))[0]
                if extra:
                    backend.add(address)
                else:
                    live[address] = (nbytes, when)
                    total += nbytes
            elif nbytes < 0:  # a free the profiler saw
                if address in backend:
                    backend.discard(address)
                else:
                    total -= live.pop(address, (0, 0))[0]
            elif address in live and live[address][1] <= extra:
                # A watched storage died: its block goes, unless the address was
                # freed and reused after the storage was seen there.
                total -= live.pop(address)[0]
            if self.held is not None:
                self.peak = max(self.peak, total)
        if self.held is None:  # nothing allocated or freed during the step
            self.held = self.peak = total


def _inside_collective(event) -> bool:
    node = event.parent
    while node is not None:
        if node.name.startswith(("c10d::", "gloo:")):
            return True
        node = node.parent
    return False


class CudaAllocations:
    """The caching allocator's counters, relative to what was allocated before entry."""

    def __init__(self, device: torch.device) -> None:
        self._device = device

    def __enter__(self) -> "CudaAllocations":
        torch.cuda.synchronize(self._device)
        self._base = torch.cuda.memory_allocated(self._device)
        return self

    @contextlib.contextmanager
    def measured_step(self) -> Iterator[None]:
        torch.cuda.synchronize(self._device)
        self.held = torch.cuda.memory_allocated(self._device) - self._base
        torch.cuda.reset_peak_memory_stats(self._device)
        yield
        torch.cuda.synchronize(self._device)
        self.peak = torch.cuda.max_memory_allocated(self._device) - self._base

    def watch(self, tensors: list[torch.Tensor]) -> None:
        """Nothing to do: the caching allocator sees every free, whichever thread makes it."""

    def __exit__(self, *exc) -> None:
        pass
