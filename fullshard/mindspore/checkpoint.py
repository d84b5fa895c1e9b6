"""Sharded checkpoints of MindSpore cells: full parameters, save, checked load at any layout, export.

The same functions as the torch runtime's (``fullshard.torch.checkpoint``), with the same arguments:
``save_checkpoint(cell, path, optimizer=None)``, ``load_checkpoint(cell, path, optimizer=None, *,
strict=True)``, ``export_checkpoint(path, out_file)`` and ``full_state_dict(cell)``; the step
directories a training job keeps are :mod:`fullshard.checkpoint`'s (``step_dir``, ``latest_step``).

``save_checkpoint(cell, path, optimizer)`` writes every rank's shards of the
parameters and of the optimizer state per parameter (``nn.Adam``'s
``moment1``/``moment2``, ``nn.AdamWeightDecay``'s ``adam_m``/``adam_v``: any
optimizer Parameter named ``<state>.<parameter name>`` with the shard's
shape), plus the optimizer's other Parameters whole (step, beta powers,
learning rate). The format is :mod:`fullshard.checkpoint.formats.sharded_safetensors`: safetensors
files and JSON, nothing a load unpickles. The directory appears complete or
not at all (:mod:`fullshard.checkpoint.publish`): every rank writes into
``<path>.partial``, all ranks agree that every file is complete, and only
then rank 0 writes the metadata and the manifest (the size and SHA-256 of
every file, :mod:`fullshard.checkpoint.manifest`) and renames the directory.

``load_checkpoint(cell, path, optimizer)`` fills a cell sharded at any world
size, mesh and placement (or not sharded at all): each rank reads the pieces
its own chunks need. It first verifies the manifest and checks every field
of the checkpoint, then every name, global shape and dtype against the cell,
and reads every value; only then does it write anything, so a checkpoint
that is damaged or does not fit (a
:class:`~fullshard.checkpoint.untrusted.CheckpointError`) leaves the cell and the
optimizer as they were.
"""
from __future__ import annotations

import uuid
from pathlib import Path
from typing import Optional, Union

import mindspore as ms
import numpy as np
from mindspore import Parameter, Tensor, nn, ops

from fullshard.checkpoint import manifest
from fullshard.checkpoint.formats import sharded_safetensors
from fullshard.checkpoint.formats.safetensors_file import Array
from fullshard.checkpoint.formats.sharded_safetensors import MODEL, OPTIM, Piece, ShardedCheckpoint, key
from fullshard.checkpoint.publish import save_together
from fullshard.checkpoint.untrusted import CheckpointError
from fullshard.core.unit import distinct_units
from fullshard.mindspore.autograd import no_grad
from fullshard.mindspore.buckets import gather_full
from fullshard.mindspore.collectives import world_ranks, dtype_name, dtype_named
from fullshard.mindspore.param import sharded_param_of

def _numpy(tensor: Tensor) -> np.ndarray:
    # numpy has no bfloat16: those come out as float32 (every bf16 value is one)
    return (tensor.astype(ms.float32) if tensor.dtype == ms.bfloat16 else tensor).asnumpy()


def full_state_dict(cell: nn.Cell) -> dict[str, np.ndarray]:
    """Every parameter of ``cell`` whole, on every rank, under the names from before sharding.

    The names are the paths ``parameters_and_names()`` gives (tied parameters once). Sharded
    parameters are gathered from their shards (a collective: call it on every rank, in the same
    order); the others are copied as they are. bfloat16 values come back as float32 arrays.
    """
    full = {}
    with no_grad():
        for name, param in cell.parameters_and_names():
            sharded = sharded_param_of(param)
            if sharded is None:
                full[name] = _numpy(param)
                continue
            group = sharded.group
            full[name] = _numpy(gather_full(sharded, group.comm, group.plan.collectives.gather, group.plan.backend))
    return full


# ---------------------------------------------------------------------- what a rank holds
def _to_array(tensor: Tensor) -> Array:
    if tensor.dtype == ms.bfloat16:  # numpy has no bf16: keep its bits
        return Array(tensor.view(ms.float16).asnumpy().view(np.uint16), "bfloat16")
    return Array(tensor.asnumpy(), dtype_name(tensor.dtype))


def _to_tensor(array: Array) -> Tensor:
    if array.dtype == "bfloat16":
        return Tensor(array.data.view(np.float16)).view(ms.bfloat16)
    return Tensor(array.data, dtype=dtype_named(array.dtype))


def _placement(param: Parameter) -> tuple[tuple[int, ...], Optional[int], int, int]:
    """Global shape, the dim this rank's tensor is cut along (None: whole), offset and length on it."""
    sharded = sharded_param_of(param)
    if sharded is None or sharded.replicated:
        return tuple(param.shape), None, 0, 0
    layout = sharded.layout
    return tuple(layout.shape), layout.dim, layout.local_offset(sharded.rank), layout.local_length(sharded.rank)


def _targets(cell: nn.Cell, optimizer: Optional[nn.Optimizer]) -> list[tuple[Piece, Parameter]]:
    """Every tensor a checkpoint of ``cell`` (and ``optimizer``) holds, with where this rank's part lies."""
    targets, by_name = [], {}
    for param in cell.get_parameters():  # tied parameters once
        shape, dim, offset, length = _placement(param)
        targets.append((Piece(key(MODEL, param.name), shape, dtype_name(param.dtype), dim, offset, length), param))
        by_name[param.name] = param
    if optimizer is not None:
        own = {id(p) for p in by_name.values()}
        for state in optimizer.get_parameters():
            if id(state) in own:
                continue
            owner = by_name.get(state.name.partition(".")[2])
            if owner is not None and tuple(state.shape) == tuple(owner.shape):
                shape, dim, offset, length = _placement(owner)  # sharded like its parameter
            else:
                shape, dim, offset, length = tuple(state.shape), None, 0, 0  # step counters, beta powers, lr
            targets.append((Piece(key(OPTIM, state.name), shape, dtype_name(state.dtype), dim, offset, length), state))
    return targets


# ---------------------------------------------------------------------- saving
def save_checkpoint(cell: nn.Cell, path: Union[str, Path], optimizer: Optional[nn.Optimizer] = None) -> Path:
    """Write this rank's shards of ``cell`` (and ``optimizer``'s state) into checkpoint directory ``path``.

    Call it on every rank (every rank must see the same ``path``). The
    directory appears only when complete; an interrupted save leaves the
    previous ``path`` (if any) as it was and a ``<path>.partial`` the next save clears.
    A failure on any rank raises :class:`~fullshard.checkpoint.publish.RanksFailed` on every rank,
    naming it (:func:`~fullshard.checkpoint.publish.save_together`); alone, the error itself.
    """
    ranks = world_ranks()
    with no_grad():
        pieces = [Piece(p.key, p.shape, p.dtype, p.dim, p.offset, p.length, _to_array(t))
                  for p, t in _targets(cell, optimizer)]

    def write_manifest(partial: Path) -> None:
        save_id = uuid.uuid4().hex
        sharded_safetensors.write_metadata(partial, ranks.slots, pieces, save_id)
        manifest.write(partial, sharded_safetensors.FRAMEWORK, save_id)

    return save_together(path, ranks, lambda partial: sharded_safetensors.write_rank(partial, ranks.slot, pieces),
                         write_manifest, "save_checkpoint")


# ---------------------------------------------------------------------- loading
def load_checkpoint(cell: nn.Cell, path: Union[str, Path], optimizer: Optional[nn.Optimizer] = None, *,
                    strict: bool = True) -> None:
    """Fill ``cell`` (and ``optimizer``) from checkpoint directory ``path``, whatever layout saved it.

    Raises :class:`~fullshard.checkpoint.untrusted.CheckpointError` (a
    ``ValueError``) for a damaged or crafted checkpoint, naming the file, and
    for one that does not fit, naming every missing, unexpected or different
    parameter (name, global shape, dtype), before anything is written: the
    cell and optimizer are then untouched. Without an optimizer the
    checkpoint's optimizer state is not read; ``strict=False`` ignores entries
    the cell (and optimizer) do not have. Every rank reads the files itself
    (no collective). A ``path`` that a crash during its save left missing is
    loaded from the complete copy beside it, with a warning.
    """
    checkpoint = ShardedCheckpoint(path)
    targets = _targets(cell, optimizer)
    sections = (MODEL, OPTIM) if optimizer is not None else (MODEL,)
    what = "cell and optimizer" if optimizer is not None else "cell"
    checkpoint.check({p.key: (p.shape, p.dtype) for p, _ in targets}, sections, what, strict)
    values = []
    for piece, target in targets:  # read everything first: a file that fails to read changes nothing
        try:
            array = checkpoint.read(piece.key, piece.dim, piece.offset, piece.length)
        except OSError as error:
            raise CheckpointError.at(checkpoint.path, f"cannot be read ({error})") from None
        if tuple(array.data.shape) != tuple(target.shape):
            raise CheckpointError.at(checkpoint.path, f"'{piece.key}' gives this rank shape {array.data.shape}, "
                                     f"the cell holds {tuple(target.shape)}")
        values.append((target, _to_tensor(array)))
    with no_grad():
        for target, value in values:
            # Into the Parameter's own storage: an optimizer that has stepped holds that storage in its
            # compiled graph, and would go on updating it after a set_data (which swaps in new storage).
            ops.assign(target, value)
    _forget_unsharded_copies(cell)


def _forget_unsharded_copies(cell: nn.Cell) -> None:
    """Unsharded copies kept between steps (ZeRO-1/2) now hold old values: gather again before use."""
    for unit in distinct_units(sub for _, sub in cell.cells_and_names()):
        for group in unit.groups:
            group.mark_stale()


def export_checkpoint(path: Union[str, Path], out_file: Union[str, Path]) -> Path:
    """Write checkpoint ``path`` as one full ``.safetensors`` file, in this process (no distributed init).

    A plain MindSpore model loads it with ``ms.load_checkpoint(out_file, net=model, format="safetensors")``.
    """
    return sharded_safetensors.export_full(path, out_file)


__all__ = ["export_checkpoint", "full_state_dict", "load_checkpoint", "save_checkpoint"]
