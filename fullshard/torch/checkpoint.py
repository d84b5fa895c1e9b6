"""Sharded checkpoints of torch modules on torch.distributed.checkpoint (DCP): save, checked load, export.

The same functions as ``fullshard.mindspore``, with the same arguments:
:func:`save_checkpoint` ``(module, path, optimizer=None)``,
:func:`load_checkpoint` ``(module, path, optimizer=None)``,
:func:`export_checkpoint` ``(path, out_file)`` and :func:`full_state_dict`
``(module)``; the step directories a training job keeps are
:mod:`fullshard.checkpoint`'s (``step_dir``, ``latest_step``). A checkpoint
holds ``{"model": ..., "optim": ...}``: the module's and the optimizer's
state dicts as ``torch.distributed.checkpoint.state_dict.get_state_dict``
gives them (keys are parameter names; sharded parameters and their optimizer
state are DTensors, so each rank writes its own shards), which is what FSDP2
jobs save: checkpoints go both ways. It loads at any world size, mesh and
placement, or into a plain module in one process (DCP reshards).

The same machinery over any state dict, for DCP users:
:func:`save_state_dict`, :func:`load_state_dict` (fills it in place, like
``dcp.load``), :func:`load_full_state_dict` (one process, no process group),
:func:`read_metadata`, :func:`check_compatible`, and the reader and planner
to hand ``dcp.load`` yourself (:class:`SafeFileSystemReader`,
:class:`SafeLoadPlanner`). A stock DCP checkpoint (an FSDP2 job's, with no
fullshard manifest) loads with ``require_manifest=False``.

A save is written as ``<path>.partial`` by every rank; once all ranks
finished, rank 0 writes the manifest (size and SHA-256 of every file,
:mod:`fullshard.checkpoint.manifest`) and publishes the directory
(:mod:`fullshard.checkpoint.publish`), so a crash at any point leaves a
complete checkpoint that ``latest_step`` and every loader find.

A checkpoint is untrusted input. Loading first verifies the manifest and
checks every field of the metadata (:mod:`fullshard.torch.checkpoint_metadata`;
anything wrong is a :class:`~fullshard.checkpoint.untrusted.CheckpointError`,
a ``ValueError``, naming the file), then compares it with the state to fill
and raises one ``CheckpointError`` listing every missing or unexpected key
and every shape, dtype or kind mismatch, before any collective starts (every
rank reads the same metadata, so every rank raises and none hangs). Loading
never runs code from the checkpoint: the metadata goes through a restricted
unpickler, non-tensor values must pass ``torch.load(weights_only=True)``
(stock DCP uses ``torch.load(weights_only=False)``), and tensor data is read
by DCP with ``weights_only=True``.
"""
from __future__ import annotations

import io
import os
import warnings
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from fullshard.checkpoint import manifest
from fullshard.checkpoint.publish import save_together
from fullshard.checkpoint.untrusted import CheckpointError
from fullshard.core.checks import Ranks
from fullshard.torch.checkpoint_metadata import FRAMEWORK, METADATA_FILE, checked_metadata, open_metadata
from fullshard.torch.collectives import ranks_summing_over

# The top-level entries of a module checkpoint (the same sections as MindSpore's).
MODEL, OPTIM = "model", "optim"
# At most this many problems are spelled out in one mismatch error.
_MAX_REPORTED = 20


# ---------------------------------------------------------------------- modules
def save_checkpoint(module: torch.nn.Module, path: Union[str, Path],
                    optimizer: Optional[torch.optim.Optimizer] = None) -> Path:
    """Save ``module`` (and ``optimizer``'s state) as checkpoint directory ``path``; returns ``path``.

    Call it on every rank (every rank must see the same ``path``: a shared file system on several
    machines). Each rank writes its shards; the directory appears only when complete, and an
    interrupted save leaves the previous ``path`` (if any) as it was and a ``<path>.partial`` the next
    save clears. A failure on any rank raises :class:`~fullshard.checkpoint.publish.RanksFailed` on
    every rank, naming it; alone, the error itself.
    """
    return _save(_module_state(module, optimizer), path, "save_checkpoint")


def load_checkpoint(module: torch.nn.Module, path: Union[str, Path], optimizer: Optional[torch.optim.Optimizer] = None,
                    *, strict: bool = True, require_manifest: bool = True) -> None:
    """Fill ``module`` (and ``optimizer``) from checkpoint directory ``path``, whatever layout saved it.

    Collective when a process group is initialized; a plain module in one process loads too. The
    checkpoint is checked as untrusted input, then against the module (and optimizer): a
    :class:`~fullshard.checkpoint.untrusted.CheckpointError` names every missing, unexpected or
    different entry before anything is read into them. Without an optimizer the checkpoint's
    optimizer state is not read. ``strict=False`` ignores entries the module does not have;
    ``require_manifest=False`` also loads a stock DCP checkpoint (an FSDP2 job's: every check but the
    digests). A ``path`` that a crash during its save left missing is loaded from the complete copy
    beside it, with a warning.
    """
    state = _module_state(module, optimizer)
    _load(state, path, strict=strict, require_manifest=require_manifest, sections=tuple(state))
    if optimizer is None:
        set_model_state_dict(module, state[MODEL])
    else:
        set_state_dict(module, optimizer, model_state_dict=state[MODEL], optim_state_dict=state[OPTIM])


def full_state_dict(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``module``'s state dict with every entry whole, on every rank, under the names from before sharding.

    Sharded parameters are gathered from their shards (a collective: call it on every rank); the others
    come as ``module.state_dict()`` gives them.
    """
    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True))


def _module_state(module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> dict[str, Any]:
    """What a checkpoint of ``module`` (and ``optimizer``) holds: DCP's state dicts of them (DTensors where sharded).

    ``get_state_dict`` creates the state of an optimizer that has not stepped yet, so a fresh one can load.
    """
    if optimizer is None:
        return {MODEL: get_model_state_dict(module)}
    model_state, optim_state = get_state_dict(module, optimizer)
    return {MODEL: model_state, OPTIM: optim_state}


# ---------------------------------------------------------------------- state dicts: saving
def save_state_dict(state_dict: dict[str, Any], path: Union[str, Path]) -> Path:
    """Save any DCP state dict (DTensors, tensors, plain values, nested) as checkpoint directory ``path``.

    What :func:`save_checkpoint` does with a module's state: collective, atomic, with a manifest.
    """
    return _save(state_dict, path, "save_state_dict")


def _save(state: dict[str, Any], path: Union[str, Path], caller: str) -> Path:
    """DCP fsyncs its files; rank 0 then reads every file once to write the manifest, and publishes the
    directory (:func:`~fullshard.checkpoint.publish.save_together`)."""
    ranks = _ranks()
    return save_together(path, ranks, lambda partial: _dcp_save(state, partial, ranks.slot), _write_manifest, caller)


def _ranks() -> Ranks:
    """The default process group, summing on the device its backend communicates from."""
    nccl = dist.is_initialized() and dist.get_backend() == "nccl"
    return ranks_summing_over([None], torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu"))


def _dcp_save(state: dict[str, Any], partial: Path, rank: int) -> None:
    """``dcp.save`` into ``partial``, raising only this rank's own failure.

    DCP hands every rank the same ``CheckpointException`` (a ``BaseException``, which a training loop's
    ``except Exception`` would not catch) listing every rank that failed; each rank reports its own, and
    the others learn of it when the ranks share how the part went.
    """
    try:
        dcp.save(state, checkpoint_id=str(partial))
    except CheckpointException as error:
        own = error.failures.get(rank)
        if own is not None:
            raise own[0] from None


def _write_manifest(partial: Path) -> None:
    """The manifest of a finished DCP save, under the save id DCP recorded (which loads compare)."""
    metadata = checked_metadata(partial, None)  # what was just written passes every check a load makes
    save_id = getattr(metadata.storage_meta, "save_id", None)
    if not isinstance(save_id, str):
        raise RuntimeError(f"save: DCP recorded no save id in {partial / METADATA_FILE}")
    manifest.write(partial, FRAMEWORK, save_id)


# ---------------------------------------------------------------------- state dicts: loading
class SafeFileSystemReader(dcp.FileSystemReader):
    """``FileSystemReader`` over a checkpoint checked as untrusted input before DCP sees any of it.

    Construction resolves and verifies ``path``
    (:func:`~fullshard.torch.checkpoint_metadata.open_metadata`); the metadata DCP then asks for is
    that checked one, read by an unpickler that cannot execute code.
    """

    def __init__(self, path: Union[str, Path], *, require_manifest: bool = True) -> None:
        directory, self._metadata = open_metadata(path, require_manifest=require_manifest)
        super().__init__(str(directory))

    def read_metadata(self) -> Metadata:  # no rank-local variant: only the checked metadata is ever used
        if self._metadata.storage_meta is None:  # as the stock reader does: older checkpoints have none
            self._metadata.storage_meta = StorageMeta()
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata


class UnsafeCheckpointError(CheckpointError):
    """A checkpoint value that could only be loaded by running code from the checkpoint."""


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that only accepts non-tensor values ``torch.load(weights_only=True)`` can build."""

    def __init__(self, *args: Any, checkpoint: Union[str, Path] = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.checkpoint = checkpoint  # named in a refusal

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except Exception as error:
            raise UnsafeCheckpointError(
                f"checkpoint value '{read_item.dest_index.fqn}' is not plain data (weights_only load failed: "
                f"{str(error).splitlines()[0]}); refusing to unpickle it (checkpoint {self.checkpoint})",
                str(self.checkpoint),
            ) from None
        # It only holds plain data, so the stock (unrestricted) load builds the
        # same objects; it also knows where nested values go.
        value.seek(0)
        super().load_bytes(read_item, value)


def read_metadata(path: Union[str, Path], *, require_manifest: bool = True) -> Metadata:
    """The metadata of the DCP checkpoint directory ``path`` (keys, global shapes, dtypes), verified and checked."""
    return open_metadata(path, require_manifest=require_manifest)[1]


def load_state_dict(state_dict: dict[str, Any], path: Union[str, Path], *, strict: bool = True,
                    require_manifest: bool = True) -> None:
    """Load checkpoint directory ``path`` into ``state_dict`` in place, checked and safely (see the module doc).

    ``state_dict`` holds what to fill, as for ``dcp.load``: DTensors (resharded from whatever layout
    was saved), plain tensors (a single process gets full tensors) and non-tensor values (replaced).
    Collective when a process group is initialized. A bad or unfitting checkpoint is a
    CheckpointError before anything is read into ``state_dict``; ``strict=False`` allows checkpoint
    entries the state dict does not have. ``require_manifest=False`` also loads a stock DCP
    checkpoint (no fullshard manifest: every check but the digests).
    """
    _load(state_dict, path, strict=strict, require_manifest=require_manifest)


def _load(state: dict[str, Any], path: Union[str, Path], *, strict: bool, require_manifest: bool,
          sections: Optional[Iterable[str]] = None) -> None:
    reader = SafeFileSystemReader(path, require_manifest=require_manifest)
    check_compatible(state, reader.read_metadata(), strict=strict, where=str(reader.path), sections=sections)
    _safe_dcp_load(state, reader)


def _safe_dcp_load(state: dict[str, Any], reader: SafeFileSystemReader, no_dist: bool = False) -> None:
    """``dcp.load`` with the safe planner; any failure surfaces as one CheckpointError, not DCP's wrapper.

    DCP gathers every rank's failure into one ``CheckpointException`` (a
    ``BaseException``, which ``except Exception`` would not even catch); every
    rank gets it, so every rank raises the same refusal.
    """
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(checkpoint=reader.path), no_dist=no_dist)
    except CheckpointException as error:
        failures = [failure for failure, _trace in error.failures.values()]
        for failure in failures:
            if isinstance(failure, CheckpointError):
                raise failure from None
        first = str(failures[0]).splitlines()[0] if failures and str(failures[0]) else str(error)
        raise CheckpointError.at(reader.path, f"could not be read: {first[:300]}") from None


# ---------------------------------------------------------------------- checking a checkpoint against a state
def _describe(value: Any) -> str:
    if isinstance(value, TensorStorageMetadata):
        return f"tensor {tuple(value.size)} {value.properties.dtype}"
    if isinstance(value, BytesStorageMetadata):
        return "non-tensor value"
    if isinstance(value, torch.Tensor):
        return f"tensor {tuple(value.shape)} {value.dtype}"
    return f"non-tensor value ({type(value).__name__})"


def _flat_state(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` flattened the way DCP names its keys (``model.layers.0.ln1.weight``, ``optim.state...``)."""
    planner = DefaultLoadPlanner()
    planner.set_up_planner(state)
    return planner.state_dict


def check_compatible(state: dict[str, Any], metadata: Metadata, *, strict: bool = True, where: str = "",
                     sections: Optional[Iterable[str]] = None) -> None:
    """Raise CheckpointError (a ``ValueError``) unless ``metadata`` can fill ``state`` exactly.

    Every key of ``state`` must be in the checkpoint with the same global
    shape (a DTensor's full shape), dtype and kind (tensor or not). With
    ``strict`` the checkpoint may hold no other keys either; ``sections``
    (top-level entries) limits that to the checkpoint's keys under them.
    """
    flat = _flat_state(state)
    saved = metadata.state_dict_metadata
    problems = []
    for key, value in flat.items():
        if key not in saved:
            problems.append(f"missing in checkpoint: '{key}' (state has {_describe(value)})")
            continue
        entry = saved[key]
        is_tensor = isinstance(value, torch.Tensor)
        if is_tensor != isinstance(entry, TensorStorageMetadata):
            problems.append(f"kind mismatch for '{key}': checkpoint has {_describe(entry)}, state has {_describe(value)}")
        elif is_tensor:
            if tuple(entry.size) != tuple(value.shape):
                problems.append(
                    f"shape mismatch for '{key}': checkpoint {tuple(entry.size)} vs state {tuple(value.shape)}"
                )
            if entry.properties.dtype != value.dtype:
                problems.append(
                    f"dtype mismatch for '{key}': checkpoint {entry.properties.dtype} vs state {value.dtype}"
                )
    if strict:
        problems.extend(_unexpected(state, metadata, set(flat), sections))
    if problems:
        shown = problems[:_MAX_REPORTED]
        if len(problems) > _MAX_REPORTED:
            shown.append(f"... and {len(problems) - _MAX_REPORTED} more")
        target = f"checkpoint {where}" if where else "checkpoint"
        raise CheckpointError(f"{target} does not match the state to load into (nothing was loaded):\n  "
                              + "\n  ".join(shown), where or None)


def _unexpected(state: dict[str, Any], metadata: Metadata, wanted: set[str],
                sections: Optional[Iterable[str]]) -> list[str]:
    """The checkpoint's keys the state does not want (under ``sections``, if given), as problems.

    A whole top-level entry the state lacks (say the optimizer's, when loading only a model) is one
    problem, not one per tensor.
    """
    saved = metadata.state_dict_metadata
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    sections = None if sections is None else set(sections)
    by_top: dict[str, list[str]] = {}
    for key in sorted(set(saved) - wanted):
        top = str(paths.get(key, (key,))[0])
        if sections is None or top in sections:
            by_top.setdefault(top, []).append(key)
    problems = []
    for top, keys in by_top.items():
        if top not in state and len(keys) > 1:
            problems.append(f"unexpected in checkpoint: '{top}' ({len(keys)} entries, e.g. '{keys[0]}'); "
                            "pass strict=False to load only what the state holds")
        else:
            problems.extend(f"unexpected in checkpoint: '{key}' ({_describe(saved[key])})" for key in keys)
    return problems


# ---------------------------------------------------------------------- one process: the whole checkpoint
def _set_path(root: dict, path: tuple, value: Any) -> None:
    """``root[path[0]][path[1]]... = value``, creating dicts (str keys) and lists (int keys) on the way.

    The paths come from checked metadata (:func:`~fullshard.checkpoint.untrusted.check_key_paths`): bounded
    indices, no path through another's leaf, one kind of key per container.
    """
    container: Any = root
    for key, next_key in zip(path, path[1:]):
        empty: Any = [] if isinstance(next_key, int) else {}
        if isinstance(container, list):
            container.extend([None] * (key + 1 - len(container)))
            if container[key] is None:
                container[key] = empty
        else:
            container.setdefault(key, empty)
        container = container[key]
    if isinstance(container, list):
        container.extend([None] * (path[-1] + 1 - len(container)))
    container[path[-1]] = value


def load_full_state_dict(path: Union[str, Path], *, require_manifest: bool = True) -> dict[str, Any]:
    """The whole checkpoint as a full, unsharded (nested) state dict of CPU tensors, in this process only.

    Starts no process group (and uses none that exists). Nesting is rebuilt
    from the key paths DCP records when saving, so a module checkpoint
    comes back as ``{"model": {...}, "optim": {...}}``. Every tensor is
    allocated at a size the checked metadata bounds by the bytes its files
    hold.
    """
    reader = SafeFileSystemReader(path, require_manifest=require_manifest)
    metadata = reader.read_metadata()
    flat: dict[str, Any] = {}
    for key, entry in metadata.state_dict_metadata.items():
        if isinstance(entry, TensorStorageMetadata):
            flat[key] = torch.empty(entry.size, dtype=entry.properties.dtype)
        else:
            flat[key] = None  # a placeholder DCP replaces with the loaded value
    with warnings.catch_warnings():  # one process is the point here, not a fallback worth a warning
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        _safe_dcp_load(flat, reader, no_dist=True)
    paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
    nested: dict[str, Any] = {}
    for key, value in flat.items():
        _set_path(nested, tuple(paths.get(key, (key,))), value)
    return nested


def _flatten_nested(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, list):
        items = enumerate(tree)
    else:
        return {prefix: tree}
    flat = {}
    for key, value in items:
        flat.update(_flatten_nested(value, f"{prefix}.{key}" if prefix else str(key)))
    return flat


def export_checkpoint(path: Union[str, Path], out_file: Union[str, Path], *, key: Optional[str] = MODEL,
                      require_manifest: bool = True) -> Path:
    """Write checkpoint ``path`` as one full, unsharded file; one process, no process group.

    ``key`` is the top-level entry to write: the model's state dict by default (as on MindSpore), under
    its parameter names; ``key=None`` writes the whole nested checkpoint (model and optimizer).
    ``out_file`` ending in ``.pt``/``.pth`` gets ``torch.save`` of it (load it with
    ``torch.load(f, weights_only=True)``); ``.safetensors`` (needs the ``safetensors`` package) gets its
    tensors under dotted names, so it only takes tensors. The file appears atomically, and only once
    the whole checkpoint was checked and read.
    """
    out = Path(out_file)
    suffix = out.suffix.lower()
    if suffix not in (".pt", ".pth", ".safetensors"):
        raise ValueError(f"export: unknown format for {out.name!r}; use .pt, .pth or .safetensors")
    if suffix == ".safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise ImportError("export: writing .safetensors needs the 'safetensors' package") from None
    state: Any = load_full_state_dict(path, require_manifest=require_manifest)
    if key is not None:
        if key not in state:
            raise ValueError(f"export: checkpoint {path} has no entry {key!r}; it has {sorted(state)}")
        state = state[key]
    partial = out.with_name(out.name + ".partial")
    if suffix == ".safetensors":
        flat = _flatten_nested(state)
        others = sorted(name for name, value in flat.items() if not isinstance(value, torch.Tensor))
        if others:
            raise ValueError(f"export: safetensors holds tensors only, but {len(others)} value(s) are not tensors "
                             f"(e.g. {others[:3]}); export one entry with key=..., e.g. key='model'")
        save_file({name: value.contiguous() for name, value in flat.items()}, str(partial))
    else:
        torch.save(state, partial)
    os.replace(partial, out)
    return out


__all__ = [
    "SafeFileSystemReader", "SafeLoadPlanner", "UnsafeCheckpointError", "check_compatible", "export_checkpoint",
    "full_state_dict", "load_checkpoint", "load_full_state_dict", "load_state_dict", "read_metadata",
    "save_checkpoint", "save_state_dict",
]
