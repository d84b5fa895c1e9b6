"""One parameter: its shard (a plain ``Parameter``), what its cells show, and its gradients.

At rest a cell holds the shard: a new ``Parameter`` with the original's name
holding this rank's chunk, put into ``_params`` of every cell that held the
original (tied weights: several), so ``trainable_params()``, optimizers and
``ms.save_checkpoint`` see shards under the names from before. Around a
forward the cell's attribute shows the unsharded tensor instead: an instance
attribute (``object.__setattr__``) shadows ``_params``, because
``Cell.__getattr__`` serves ``_params`` only when normal lookup fails; hiding
it again shows the shard. (``Parameter.set_data`` to another shape is no way:
autograd keeps the shape the Parameter was created with.)
"""
from __future__ import annotations

from typing import Any, Optional

import mindspore as ms
from mindspore import Parameter, Tensor, nn, ops

from fullshard.mindspore import collectives
from fullshard.mindspore.autograd import no_grad
from fullshard.mindspore.collectives import Kind, Owned, dtype_name
from fullshard.plan import ShardLayout
from fullshard.plan.group import ParamFacts

# Set on the sharded Parameter: the ShardedParam behind it (clip_grad_norm, full_state_dict, memory reports).
SHARDED_ATTR = "_fullshard_param"
# Set on every Parameter some fully_shard call took over (the originals and their shards).
MANAGED_ATTR = "_fullshard_managed"


def sharded_param_of(param: Any) -> Optional["ShardedParam"]:
    return getattr(param, SHARDED_ATTR, None)


class ShardedParam:
    """State of one managed parameter (possibly registered in several cells: tied weights)."""

    def __init__(
        self,
        param: Parameter,
        owners: list[tuple[nn.Cell, str]],
        fqn: str,
        layout: ShardLayout,
        rank: int,
        compute_dtype: Optional[Any],
        main_grad: bool,
        replicated: bool = False,
    ) -> None:
        self.group: Any = None  # the ParamGroup it belongs to (set by the group)
        self.local_fqn = fqn  # relative to the cell fully_shard was applied to
        self.fqn = fqn  # from the root, once the root is known (GroupPlan.rename)
        self.owners = owners  # (cell, attribute) pairs: several for tied parameters
        self.layout = layout
        # Replicated parameters (no_shard, replicate_params) keep the whole tensor: a layout over a world of one.
        self.replicated = replicated
        self.rank = 0 if replicated else rank
        self.stored_dtype = param.dtype
        self.compute_dtype = compute_dtype or param.dtype
        # Gradients summed across backward passes without sync, full shape, in the reduce dtype (owned).
        self.grad_accumulator: Optional[Owned] = None
        # HSDP without the replica all-reduce: this rank's reduced padded chunk, summed across backward passes.
        self.partial: Optional[Owned] = None
        self._original = param
        with no_grad():
            local = self.local_chunk(param).copy()  # storage of its own: the full tensor can go
        self.sharded = Parameter(local, name=param.name, requires_grad=param.requires_grad)
        setattr(self.sharded, SHARDED_ATTR, self)
        self.main_grad: Optional[Owned] = None
        self._main_grad = main_grad  # MixedPrecisionPolicy(apply_grad_on_fp32_main_grad=True)

    @property
    def requires_grad(self) -> bool:
        """The shard's own flag, read when it matters: it may change after ``fully_shard`` (freeze, unfreeze)."""
        return self.sharded.requires_grad

    def install(self) -> None:
        """Put the shard in place of the original in every owner cell (the only step that changes them)."""
        if self._main_grad and self.requires_grad:
            self._make_main_grad()
        setattr(self.sharded, MANAGED_ATTR, True)
        setattr(self._original, MANAGED_ATTR, True)
        self._original = None
        for cell, attr in self.owners:
            cell._params[attr] = self.sharded

    @property
    def converts_for_compute(self) -> bool:
        """The shard must be cast before it can be gathered for compute."""
        return self.compute_dtype != self.stored_dtype

    @property
    def facts(self) -> ParamFacts:
        """What the plan knows of this parameter (``fullshard.plan.group``)."""
        return ParamFacts(self.layout, dtype_name(self.stored_dtype), dtype_name(self.compute_dtype),
                          self.requires_grad, self.converts_for_compute, replica_needs_copy=self.converts_for_compute)

    # ------------------------------------------------------------------ what the cells show
    def show(self, tensor: Tensor) -> None:
        """The owner cells' attribute is ``tensor`` (the unsharded parameter) until :meth:`hide`."""
        for cell, attr in self.owners:
            object.__setattr__(cell, attr, tensor)

    def hide(self) -> None:
        """The owner cells' attribute is the shard again."""
        for cell, attr in self.owners:
            cell.__dict__.pop(attr, None)

    def local_chunk(self, full: Tensor) -> Tensor:
        """This rank's chunk of a full tensor of the parameter's shape (a view; empty zeros when it holds none)."""
        layout = self.layout
        length = layout.local_length(self.rank)
        if not length:  # narrow refuses to start at the end
            return ops.zeros(layout.local_shape(self.rank), full.dtype)
        return full.narrow(layout.dim, layout.local_offset(self.rank), length)

    # ------------------------------------------------------------------ gradients
    def accumulate_grad(self, grad: Tensor, dtype: Any) -> None:
        """Keep a gradient for a later synced backward (accumulation without sync): an owned sum in ``dtype``
        (``plan_accumulation``: MindSpore's autograd keeps nothing between calls)."""
        if self.grad_accumulator is None:
            # a cast to another dtype or a copy: both allocate
            first = grad.astype(dtype) if grad.dtype != dtype else grad.copy()
            self.grad_accumulator = collectives.adopt(first, f"gradient accumulator of '{self.fqn}'", (grad,), Kind.MAIN_GRAD)
        else:
            collectives.accumulate(self.grad_accumulator, grad.astype(dtype) if grad.dtype != dtype else grad,
                               "accumulate a gradient")

    def take_grad(self, grad: Tensor) -> Tensor:
        """The unsharded gradient to reduce: autograd's, summed into the accumulator if there is one."""
        if self.grad_accumulator is None:
            return grad
        self.accumulate_grad(grad, self.grad_accumulator.tensor.dtype)
        # From here on it is just a gradient: the plan decides whether the reduction borrows it.
        accumulated, self.grad_accumulator = self.grad_accumulator.hand_off(), None
        return accumulated

    def _make_main_grad(self) -> None:
        shape = self.layout.local_shape(self.rank)
        self.main_grad = collectives.zeros(shape, ms.float32, f"main_grad of '{self.fqn}'", Kind.MAIN_GRAD)
        self.sharded.main_grad = self.main_grad.tensor

    def materialize(self) -> None:
        """A fresh ``main_grad`` after ``to_empty`` (the one made under ``ms.DeviceCtx("meta")`` is meta)."""
        if self.main_grad is not None:
            self.main_grad.drop()
            self._make_main_grad()

    def add_to_main_grad(self, reduced: Tensor) -> None:
        if self._main_grad and self.main_grad is None:  # frozen when fully_shard ran, trained now
            self._make_main_grad()
        if self.main_grad is not None:
            collectives.accumulate(self.main_grad, reduced.astype(ms.float32) if reduced.dtype != ms.float32 else reduced,
                               "accumulate into main_grad")

    def zero_main_grad(self) -> None:
        if self.main_grad is not None:
            collectives.assign(self.main_grad, ops.zeros(self.main_grad.tensor.shape, ms.float32), "zero main_grad")

    def keep_partial(self, value: Tensor) -> None:
        """Keep this rank's reduced chunk (summed with the partial sum before, when there was one) for a later
        backward that sums across replicas."""
        kept = collectives.adopt(value.copy(), f"partial gradient sum of '{self.fqn}'", (value,), Kind.MAIN_GRAD)
        self.drop_partial()
        self.partial = kept

    def drop_partial(self) -> None:
        if self.partial is not None:
            self.partial.reclaim()
            self.partial = None

    def drop_grads(self) -> None:
        """Forget gradients kept for a later synced backward."""
        if self.grad_accumulator is not None:
            self.grad_accumulator.reclaim()
            self.grad_accumulator = None
        self.drop_partial()

    def __repr__(self) -> str:
        return f"ShardedParam({self.fqn}, shape={self.layout.shape}, dim={self.layout.dim})"
