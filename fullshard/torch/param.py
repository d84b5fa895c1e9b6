"""One parameter: its sharded DTensor, its unsharded compute tensor, and the swap between them.

A module sees its sharded parameter (an ``nn.Parameter`` wrapping a DTensor)
at rest, so ``parameters()``, optimizers, ``state_dict`` and checkpoints see
shards. Around its forward the module sees the unsharded parameter (a plain
``nn.Parameter`` in ``param_dtype``) whose storage the group fills by
all-gather and reclaims on reshard; autograd keeps references to that tensor,
which is why reshard frees its *storage* (owned by fullshard) rather than
dropping the tensor.

A parameter may already be a DTensor: tensor parallelism put it on a ``tp``
mesh (``parallelize_module``), or an SPMD program put it on a mesh that has
data-parallel dims too (``fully_shard(..., dp_mesh_dims=...)``). fullshard
then shards the parameter's *local* tensor across the data-parallel shard
dim with its usual layouts, and the sharded parameter is a DTensor on the
mesh of both, with placements ``(<data parallel>, <the parameter's own>)``,
as FSDP2 makes it. When both shard the same tensor dim, the data-parallel
shard is inside the parameter's own chunks: ``_StridedShard`` says so. The
module sees the parameter's own DTensor (``ShardedSpec.unsharded``), gathered
within the data-parallel shard dim only. ``sharded_spec`` validates all of it
before ``fully_shard`` changes anything; each error names the parameter, both
meshes and the fix.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor.placement_types import _StridedShard

from fullshard.torch.collectives import DataParallelMesh, Owned
from fullshard.torch.errors import check_replacement
from fullshard.torch.policies import RELEASE_HOOK, TORCH_PROMOTES_REDUCE_DTYPE, releases_gather_outputs
from fullshard.plan import ShardLayout, stores_padded_chunk
from fullshard.plan.group import ParamFacts


@dataclass(frozen=True)
class ShardedSpec:
    """Where a sharded parameter lives: its DTensor's mesh, placements and global shape, and what the
    module sees when it is unsharded (``unsharded``: the parameter's own DTensor spec; None: a plain tensor)."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    unsharded: Optional[DTensorSpec] = None
    # SPMD meshes: the data-parallel dims of ``unsharded``'s mesh. A gradient's placement there (a
    # Partial sum per rank) is kept for fullshard's reduction to sum, not redistributed by DTensor.
    data_parallel_dims: frozenset[int] = frozenset()

    def grad_placements(self, grad_placements: tuple[Placement, ...]) -> tuple[Placement, ...]:
        """Where an unsharded gradient must be placed before its local tensor is reduced."""
        own = self.unsharded.placements
        return tuple(grad_placements[i] if i in self.data_parallel_dims else own[i] for i in range(len(own)))

    def unsharded_spec(self, dtype: torch.dtype) -> DTensorSpec:
        """The unsharded DTensor's spec in the compute dtype."""
        spec = self.unsharded
        meta = TensorMeta(spec.tensor_meta.shape, spec.tensor_meta.stride, dtype)
        return DTensorSpec(spec.mesh, spec.placements, tensor_meta=meta)


def sharded_spec(param: torch.Tensor, fqn: str, name: str, dp: DataParallelMesh, dim: int,
                 replicated: bool) -> ShardedSpec:
    """How ``param`` is placed once sharded on tensor dim ``dim`` (``replicated``: kept whole, no_shard)."""
    if not isinstance(param, DTensor):
        if dp.spmd:
            raise ValueError(
                f"When dp_mesh_dims is provided, all parameters must be DTensors on the SPMD mesh: fully_shard({name}) "
                f"got a plain tensor for '{fqn}'; distribute it first (distribute_module / distribute_tensor)"
            )
        placements = tuple(
            Replicate() if index != dp.shard_dim or replicated else Shard(dim) for index in range(dp.mesh.ndim)
        )
        return ShardedSpec(dp.mesh, placements, param.shape)
    own = param._spec
    if dp.spmd:
        return _on_spmd_mesh(param, fqn, name, dp, dim, replicated)
    names = set(dp.mesh.mesh_dim_names or ()) & set(own.mesh.mesh_dim_names or ())
    if names or own.mesh == dp.mesh:
        raise ValueError(
            f"fully_shard({name}): parameter '{fqn}' is a DTensor placed {own.placements} on {own.mesh}, which "
            f"shares the data-parallel dims {sorted(names) or dp.mesh.mesh_dim_names} with the mesh given to "
            f"fully_shard ({dp.mesh}); keep the parameter's mesh to the model-parallel dims (mesh['tp']) and "
            "pass the data-parallel dims as mesh, or pass the whole mesh with dp_mesh_dims"
        )
    try:
        mesh = DeviceMesh._concatenate([dp.mesh, own.mesh])
    except Exception as error:  # torch says what is wrong in its own words; name ours
        raise ValueError(
            f"fully_shard({name}): parameter '{fqn}' is a DTensor on {own.mesh}, which is not a dimension of "
            f"the same mesh as the data-parallel mesh {dp.mesh} ({error}); build both from one "
            "init_device_mesh(..., mesh_dim_names=(...)) and pass mesh[<dp dims>] to fully_shard"
        ) from None
    inner = own.num_shards_map[dim]  # chunks the parameter's own placements already cut dim into
    shard: Placement = _StridedShard(dim, split_factor=inner) if inner > 1 else Shard(dim)
    placements = tuple(
        Replicate() if index != dp.shard_dim or replicated else shard for index in range(dp.mesh.ndim)
    ) + tuple(own.placements)
    return ShardedSpec(mesh, placements, param.shape, own)


def _on_spmd_mesh(param: DTensor, fqn: str, name: str, dp: DataParallelMesh, dim: int,
                  replicated: bool) -> ShardedSpec:
    own = param._spec
    if own.mesh is not dp.mesh:  # FSDP2 asks for the very mesh object: the dims' groups are its
        raise ValueError(
            f"Expected param's DTensor mesh to be the same mesh passed to fully_shard: parameter '{fqn}' is a "
            f"DTensor on {own.mesh}, but fully_shard({name}) was given {dp.mesh} with dp_mesh_dims; distribute "
            "every parameter on that mesh object"
        )
    placements = list(own.placements)
    names = dp.mesh.mesh_dim_names
    for index in (dp.shard_dim, dp.replicate_dim):
        if index is not None and not isinstance(placements[index], Replicate):
            raise ValueError(
                f"Expected Replicate() on the data-parallel dim '{names[index]}': fully_shard({name}) found parameter "
                f"'{fqn}' placed {placements[index]} there; it must be Replicate() (fully_shard shards it across "
                "that dim)"
            )
    if dp.shard_dim is not None and not replicated:
        # the data-parallel shard is inside every chunk that later mesh dims cut the same tensor dim into
        inner = 1
        for later in range(dp.shard_dim + 1, dp.mesh.ndim):
            placement = placements[later]
            if isinstance(placement, (Shard, _StridedShard)) and placement.dim == dim:
                inner *= dp.mesh.size(later)
        placements[dp.shard_dim] = _StridedShard(dim, split_factor=inner) if inner > 1 else Shard(dim)
    dims = frozenset(index for index in (dp.shard_dim, dp.replicate_dim) if index is not None)
    return ShardedSpec(dp.mesh, tuple(placements), param.shape, own, dims)


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, running = [], 1
    for size in reversed(shape):
        stride.append(running)
        running *= max(size, 1)
    return tuple(reversed(stride))


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16": how the planning code names dtypes."""
    return str(dtype).removeprefix("torch.")


def is_plain(tensor: torch.Tensor) -> bool:
    """A plain tensor, as collectives carry it (not a tensor subclass such as one with all-gather extensions)."""
    return type(tensor) in (torch.Tensor, nn.Parameter)


def _same_view(new: torch.Tensor, old: torch.Tensor) -> bool:
    """Whether ``new`` is ``old``, or a view of exactly the same bytes (a no-op conversion's re-wrap)."""
    if new is old:
        return True
    if not (is_plain(new) and is_plain(old)) or new.dtype != old.dtype or new.device != old.device \
            or new.device.type == "meta":
        return False
    return (new.untyped_storage().data_ptr() == old.untyped_storage().data_ptr()
            and new.storage_offset() == old.storage_offset() and new.shape == old.shape and new.stride() == old.stride())


class ShardedParam:
    """State of one managed parameter (possibly registered under several names: tied weights)."""

    def __init__(
        self,
        param: nn.Parameter,
        owners: list[tuple[nn.Module, str]],
        fqn: str,
        layout: ShardLayout,
        spec: ShardedSpec,
        rank: int,
        device: torch.device,
        compute_dtype: Optional[torch.dtype],
        offload_pin_memory: Optional[bool] = None,
        main_dtype: Optional[torch.dtype] = None,
    ) -> None:
        self.local_fqn = fqn  # relative to the module fully_shard was applied to
        self.fqn = fqn  # from the root, once the root is known (ParamGroup.rename)
        self.owners = owners  # (module, attribute) pairs: several for tied parameters
        # The layout is of the local tensor: the parameter itself, or a DTensor parameter's local
        # part (tensor parallelism), which is what data parallelism shards (see the module docstring).
        self.layout = layout
        self.spec = spec
        self.mesh, self.placements = spec.mesh, spec.placements
        self.rank = rank  # in the shard group; 0 for no_shard's replicas (a layout over a world of one)
        self.device = device  # where the unsharded parameter computes (the mesh's device)
        # CPU offload keeps shards (and so gradients and optimizer state) in CPU
        # memory, pinned for fast copies when asked and possible.
        self.offloaded = offload_pin_memory is not None
        self.storage_device = torch.device("cpu") if self.offloaded else device
        self.pin_memory = bool(offload_pin_memory) and device.type != "cpu"
        self.requires_grad = param.requires_grad
        # Shards are kept (and stepped on) in main_dtype; compute defaults to the model's own dtype.
        self.stored_dtype = main_dtype or param.dtype
        self.main_dtype = main_dtype
        self.param_dtype_policy = compute_dtype  # MixedPrecisionPolicy.param_dtype
        self.compute_dtype = compute_dtype or param.dtype
        # Tensor.grad_dtype set on the parameter before fully_shard (followed where FSDP2 follows it, 2.15 on):
        # its gradient accumulates, is reduced and kept in it; explicitly None: in whatever autograd gives.
        self.has_grad_dtype = TORCH_PROMOTES_REDUCE_DTYPE and bool(param._has_grad_dtype_override)
        self.grad_dtype: Optional[torch.dtype] = param.grad_dtype if self.has_grad_dtype else None
        self.sharded: nn.Parameter
        # Storage of the sharded parameter holding the whole padded chunk, when
        # the layout allows one (``stores_padded_chunk``); the local shard is a
        # prefix view of it, so a lone same-dtype all-gather can read it directly.
        self.padded_chunk: Optional[torch.Tensor] = None
        self.unsharded: Optional[nn.Parameter] = None
        self.unsharded_data: Optional[torch.Tensor] = None  # its plain local tensor (fullshard's storage)
        # Set when the unsharded parameter has storage of its own (copy-out path);
        # None when it is a view of its bucket's all-gather output.
        self.unsharded_storage: Optional[Owned] = None
        # Version of the local shard when it was last gathered (see ParamGroup._shards_changed).
        self.gathered_version: tuple[int, int] = (-1, -1)
        # Gradients summed across backward passes without sync, in the reduce dtype
        # when it differs from the compute dtype (owned; see accumulate_grad_in).
        self.grad_accumulator: Optional[Owned] = None
        # torch 2.15: the dtype the unsharded gradient is held in, and whether a reducing backward defers it
        # (the group sets both with its plan: ``hold_grad_dtype``, ``before_backward``)
        self.held_grad_dtype: Optional[torch.dtype] = None
        self.defers_widening = False
        self.carried_grad: Optional[torch.Tensor] = None  # pending across a replan (``carry_grad``)
        self._install_sharded(self._stored_local(param))

    # ------------------------------------------------------------------ sharded side
    @torch.no_grad()
    def _stored_local(self, param: nn.Parameter) -> torch.Tensor:
        """This rank's shard of the (full) parameter, in storage of fullshard's, on the storage device and dtype."""
        full = param._local_tensor.detach() if isinstance(param, DTensor) else param.detach()
        if full.device != self.storage_device and full.device.type != "meta":
            full = full.to(self.storage_device)
        return self._local_from_full(full.to(self.stored_dtype))

    def _local_from_full(self, full: torch.Tensor) -> torch.Tensor:
        layout, rank = self.layout, self.rank
        chunk = full.narrow(layout.dim, layout.local_offset(rank), layout.local_length(rank))
        return self._store_local(chunk)

    def _store_local(self, local: torch.Tensor) -> torch.Tensor:
        """Copy a local shard into storage fullshard keeps for the sharded parameter."""
        layout = self.layout
        if stores_padded_chunk(layout):
            if self.pin_memory and local.device.type == "cpu":
                self.padded_chunk = torch.zeros(layout.padded_chunk_shape, dtype=local.dtype, pin_memory=True)
            else:  # new_zeros keeps a tensor subclass the parameter is (e.g. one with all-gather extensions)
                self.padded_chunk = local.new_zeros(layout.padded_chunk_shape)
            stored = self.padded_chunk.narrow(layout.dim, 0, local.shape[layout.dim])
            stored.copy_(local)
            return stored
        self.padded_chunk = None
        return local.contiguous().clone()

    def _install_sharded(self, local: torch.Tensor) -> None:
        dtensor = DTensor.from_local(
            local,
            self.mesh,
            self.placements,
            run_check=False,
            shape=self.spec.shape,
            stride=contiguous_stride(self.spec.shape),
        )
        self.sharded = nn.Parameter(dtensor, requires_grad=self.requires_grad)
        self._apply_grad_dtype(self.sharded)
        # The parameter's own local tensor (from_local and Parameter each make a view of
        # ``local``): what refresh_from_module compares against to see a replacement.
        self._local = self.sharded._local_tensor
        self._adopt_extension()
        self.register_sharded()

    def _apply_grad_dtype(self, sharded: nn.Parameter) -> None:
        """The sharded parameter carries the gradient dtype asked for (a rebuilt one, without a policy of its
        own, gets it again), so its ``.grad`` may be in it."""
        if self.has_grad_dtype and not sharded._has_grad_dtype_override:
            sharded.grad_dtype = self.grad_dtype

    @property
    def sharded_grad_dtype(self) -> torch.dtype:
        """The dtype of the reduced, sharded gradient: the one asked for, or the shard's own."""
        return self.grad_dtype if self.grad_dtype is not None else self.stored_dtype

    @torch.inference_mode(False)  # new storage must be an ordinary tensor even under inference_mode
    def refresh_from_module(self) -> bool:
        """Re-adopt the sharded parameter if it was replaced or its data swapped; True if it was.

        ``to_empty``, ``.to(dtype)`` and ``load_state_dict(assign=True)`` give the
        module a new parameter, or give the registered one a new local tensor
        that is not backed by fullshard's padded storage. The new data is copied
        into fresh storage of fullshard's layout; the parameter object the user
        sees (possibly new) is kept, so references to it stay valid.
        """
        module, name = self.owners[0]
        current = module._parameters.get(name)
        if current is self.sharded and _same_view(current._local_tensor, self._local):
            # a conversion that changed nothing (``.to(device)`` to where it is) may still swap in a new tensor
            # over the same storage (without the grad_dtype policy): nothing to re-adopt, and the unsharded
            # parameter keeps its pending gradient (as in FSDP2)
            self._local = current._local_tensor
            self._apply_grad_dtype(current)
            extended = self.extension is not None
            if current.requires_grad == self.requires_grad and extended == self.extended:
                return False
            self._adopt_extension()  # extensions patched onto the local tensor after fully_shard
            # Frozen or unfrozen after fully_shard (fine-tuning): the buckets, which only join
            # parameters of one trainability, and the unsharded parameters follow.
            self.requires_grad = current.requires_grad
            return True
        if current is not None and current is self.unsharded:
            return False  # shown by an explicit unshard(); the sharded parameter is the one kept here
        check_replacement(current, self.fqn, self.spec.shape, self.placements)
        self.requires_grad = current.requires_grad
        self.stored_dtype = current.dtype
        if self.param_dtype_policy is not None:
            self.compute_dtype = self.param_dtype_policy
        elif self.main_dtype is None:  # e.g. model.to(bfloat16) after fully_shard: compute in it
            self.compute_dtype = current.dtype
        with torch.no_grad():
            # DTensor keeps no padding: re-create fullshard's padded storage around the new data
            current._local_tensor = self._store_local(current._local_tensor)
        self.sharded, self._local = current, current._local_tensor
        self._apply_grad_dtype(current)
        self._adopt_extension()
        self.register_sharded()
        return True

    def _adopt_extension(self) -> None:
        """Read the local tensor's hooks once per local tensor (at fully_shard, and again only when the
        parameter is rebuilt or gains or loses extensions), not at every gather: what to do with the gather outputs
        must not change between the gathers of one step."""
        self.extended = self.extension is not None
        local = self.sharded._local_tensor
        self.release_gather_outputs = hasattr(local, RELEASE_HOOK) and releases_gather_outputs(local)

    @property
    def extension(self) -> Optional[torch.Tensor]:
        """The local tensor, if it defines FSDP2's all-gather extensions (``fullshard.torch.extensions``)."""
        local = self.sharded._local_tensor
        pre, post = hasattr(local, "fsdp_pre_all_gather"), hasattr(local, "fsdp_post_all_gather")
        if pre != post:
            raise ValueError(
                f"parameter '{self.fqn}' defines only one of fsdp_pre_all_gather and fsdp_post_all_gather; "
                "all-gather extensions need both"
            )
        return local if pre else None

    @property
    def cast_needed(self) -> bool:
        """Computing needs another dtype or device than the shard is stored in."""
        return self.compute_dtype != self.stored_dtype or self.storage_device != self.device

    @property
    def converts_for_compute(self) -> bool:
        """The shard must be cast, moved or unwrapped (a tensor subclass, which collectives cannot carry
        as it is) before it can be gathered for compute."""
        return self.cast_needed or not is_plain(self.sharded._local_tensor)

    @property
    def facts(self) -> ParamFacts:
        """What the plan knows of this parameter (``fullshard.plan.group``); a replica computes with itself,
        whatever its tensor type, unless it needs another dtype or device."""
        if self.has_grad_dtype:  # explicitly None: whatever autograd gives, the compute dtype
            accumulation = self.grad_dtype or self.compute_dtype
        else:
            accumulation = self.stored_dtype
        return ParamFacts(self.layout, dtype_name(self.stored_dtype), dtype_name(self.compute_dtype),
                          self.requires_grad, self.converts_for_compute, replica_needs_copy=self.cast_needed,
                          travels_alone=self.extension is not None, accumulation_dtype=dtype_name(accumulation))

    def local_shard(self) -> torch.Tensor:
        return self.sharded.to_local()

    def shard_version(self) -> tuple[int, int]:
        # Writes through the DTensor (optimizer steps, load_state_dict's copy_) bump its
        # own counter, not the inner local tensor's; writes straight into the local
        # tensor (dcp.load) bump only the local one. Either means "changed".
        return self.sharded._version, self.sharded._local_tensor._version

    def full_to_sharded(self, full: torch.Tensor) -> DTensor:
        """This rank's DTensor shard of a full (plain) tensor of the parameter's global shape."""
        layout, own = self.layout, self.spec.unsharded
        if own is not None:  # the parameter's own part first (no communication: every rank has `full`)
            full = distribute_tensor(full, own.mesh, own.placements, src_data_rank=None).to_local()
        local = full.narrow(layout.dim, layout.local_offset(self.rank), layout.local_length(self.rank))
        return DTensor.from_local(
            local.to(self.storage_device), self.mesh, self.placements, run_check=False,
            shape=self.spec.shape, stride=contiguous_stride(self.spec.shape),
        )

    def make_unsharded(self, data: torch.Tensor) -> nn.Parameter:
        """The unsharded parameter over ``data`` (fullshard's storage): a plain tensor, or for a DTensor
        parameter its own DTensor (e.g. tensor parallel) whose local tensor is ``data``."""
        self.unsharded_data = data
        if self.spec.unsharded is not None:
            data = DTensor(data, self.spec.unsharded_spec(data.dtype), requires_grad=False)
        self.unsharded = nn.Parameter(data, requires_grad=self.requires_grad)
        self.hold_grad_dtype()
        return self.unsharded

    def local_grad(self, grad: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The local tensor of an unsharded gradient, placed like the parameter's own DTensor (what
        data parallelism reduces); a plain gradient as it is."""
        if not isinstance(grad, DTensor):
            return grad
        target = self.spec.grad_placements(grad.placements)
        if grad.placements != target:
            grad = grad.redistribute(grad.device_mesh, target)
        return grad._local_tensor

    def register_sharded(self) -> None:
        for module, name in self.owners:
            module._parameters[name] = self.sharded

    def register_unsharded(self) -> None:
        for module, name in self.owners:
            module._parameters[name] = self.unsharded

    # ------------------------------------------------------------------ gradients
    def to_sharded_grad(self, local_grad: torch.Tensor) -> None:
        """Install a reduced local gradient, summing with an existing one (out of place), then run the
        sharded parameter's post-accumulate-grad hooks (the optimizer-in-backward pattern), as FSDP2 does."""
        old = self.sharded.grad
        if old is not None:
            local_grad = old.to_local() + local_grad
        spec = self.sharded._spec
        if local_grad.dtype == spec.tensor_meta.dtype and local_grad.device == self.sharded.device:
            # Every step wraps every gradient: share the parameter's (immutable)
            # sharding spec instead of building and validating a new one.
            self.sharded.grad = DTensor(local_grad, spec, requires_grad=False)
        else:
            self.sharded.grad = DTensor.from_local(
                local_grad,
                self.mesh,
                self.placements,
                run_check=False,
                shape=self.spec.shape,
                stride=contiguous_stride(self.spec.shape),
            )
        # Autograd never accumulates into the sharded parameter (modules compute with the
        # unsharded one), so the hooks registered on it are fullshard's to run.
        hooks = getattr(self.sharded, "_post_accumulate_grad_hooks", None)
        for hook in list(hooks.values()) if hooks else ():
            hook(self.sharded)

    def has_unreduced_grad(self) -> bool:
        return (self.unsharded is not None and self.unsharded.grad is not None) or self.grad_accumulator is not None \
            or self.carried_grad is not None

    def drop_grads(self, reduced: bool = True) -> None:
        """Forget every gradient of this step: unreduced, accumulated and (``reduced``) reduced."""
        if self.unsharded is not None:
            self.unsharded.grad = None
        self.carried_grad = None
        self.hold_grad_dtype()
        if self.grad_accumulator is not None:
            self.grad_accumulator.reclaim()
            self.grad_accumulator = None
        if reduced:
            self.sharded.grad = None

    def take_unsharded_grad(self) -> Optional[torch.Tensor]:
        """Take the unsharded gradient: autograd's, summed into the accumulator if there is one."""
        grad = None
        if self.unsharded is not None:
            grad, self.unsharded.grad = self.local_grad(self.unsharded.grad), None
        if self.carried_grad is not None:  # planned afresh, and not gathered since
            grad, self.carried_grad = self.local_grad(self.carried_grad), None
        self.hold_grad_dtype()
        if self.grad_accumulator is not None:
            if grad is not None:
                with torch.no_grad():
                    self.grad_accumulator.writable("accumulate a gradient").add_(grad)
            # From here on it is just a gradient: fullshard drops it once reduced.
            grad, self.grad_accumulator = self.grad_accumulator.hand_off(), None
        return grad

    # ------------------------------------------------------------------ gradients held in another dtype (2.15)
    def hold_grad_dtype(self) -> None:
        """The unsharded parameter's gradient is held in ``held_grad_dtype`` (set when it is made, once its gradient
        was taken or dropped, and after each backward, as FSDP2 2.15 does): autograd casts each gradient to it
        before summing. A gradient still in autograd's dtype (its reduction comes at the end of backward) keeps
        the parameter as it is until then."""
        if self.held_grad_dtype is None or self.unsharded is None:
            return
        grad = self.unsharded.grad
        if grad is None or grad.dtype == self.held_grad_dtype:
            self.unsharded.grad_dtype = self.held_grad_dtype

    def before_backward(self, reducing: bool) -> None:
        """A backward reaches the parameter: one that reduces, or that sums into a held gradient, lets autograd
        give its own dtype (summed in place into a wider held one, or cast when packed for the reduction)."""
        if self.defers_widening and self.unsharded is not None and (reducing or self.unsharded.grad is not None):
            self.unsharded.grad_dtype = None

    def __repr__(self) -> str:
        return f"ShardedParam({self.fqn}, shape={self.layout.shape}, dim={self.layout.dim})"
