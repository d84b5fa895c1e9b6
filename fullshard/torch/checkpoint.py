"""Sharded checkpoints on torch.distributed.checkpoint (DCP): atomic saves, checked and safe loads, export.

A checkpoint is a DCP directory ``step_<N>``. It is written as
``step_<N>.partial`` by every rank and renamed by rank 0 only after all ranks
finished, so an interrupted save never replaces or corrupts the last
complete checkpoint: :func:`latest_step` only ever sees complete ones.

Loading (:func:`load_into`, :func:`load_checkpoint`) first compares the
checkpoint's metadata with the state to fill and raises one ``ValueError``
listing every missing or unexpected key and every shape, dtype or kind
mismatch, before any collective starts (every rank reads the same metadata, so
every rank raises and none hangs). DCP resharding does the rest: a checkpoint
saved at any world size and placement loads into any other.

Loading never runs code from the checkpoint. Stock DCP unpickles the
``.metadata`` file with ``pickle.load`` and non-tensor values with
``torch.load(weights_only=False)``, both of which execute whatever a crafted
file asks for; here the metadata goes through an unpickler that only builds
DCP's own metadata classes and torch sizes/dtypes, and non-tensor values must
pass ``torch.load(weights_only=True)``. Tensor data is already read with
``weights_only=True`` by DCP.

:func:`load_full` and :func:`export_full` turn a checkpoint into a full,
unsharded state dict in one process, without any process group.
"""
from __future__ import annotations

import dataclasses
import enum
import io
import os
import pathlib
import pickle
import warnings
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta, TensorStorageMetadata

from fullshard.core.atomic import latest_step, partial_dir, publish, start_partial, step_dir  # noqa: F401 (latest_step: public here)

# DCP's name for the metadata file (``filesystem._metadata_fn``, private there).
_METADATA_FILE = ".metadata"
# At most this many problems are spelled out in one mismatch error.
_MAX_REPORTED = 20


def save_atomic(state: dict[str, Any], root: Path, step: int) -> Path:
    """Save ``state`` (DTensor state dicts) collectively; the directory appears only when complete.

    Every rank must see the same ``root`` (a shared file system on several
    machines). DCP fsyncs its files; the final rename is fsynced too, so after
    a crash ``step_<N>`` is either absent or complete.
    """
    final = step_dir(root, step)
    rank = dist.get_rank() if dist.is_initialized() else 0
    partial = partial_dir(final)
    if rank == 0:
        start_partial(final)  # what an interrupted save left there is removed
    if dist.is_initialized():
        dist.barrier()
    dcp.save(state, checkpoint_id=str(partial))
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:
        publish(final)
    if dist.is_initialized():
        dist.barrier()
    return final


# ---------------------------------------------------------------------- safe reading
def _is_metadata_class(obj: Any) -> bool:
    return isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum))


class _MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata and nothing else: no callable outside this list is reachable."""

    _PATH_CLASSES = {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath", "Path"}
    # DCP's metadata dataclasses and enums live in these modules (the filesystem
    # one holds ``_StorageInfo``, where each tensor chunk lies in which file).
    _DCP_MODULES = {dcp_metadata.__name__: dcp_metadata, dcp_filesystem.__name__: dcp_filesystem}

    def find_class(self, module: str, name: str) -> Any:
        if module in self._DCP_MODULES:
            obj = getattr(self._DCP_MODULES[module], name, None)
            # Defined there, not merely imported (that module also sees enum.Enum itself).
            if _is_metadata_class(obj) and obj.__module__ == module:
                return obj
        elif module == "torch":
            obj = getattr(torch, name, None)
            if obj is torch.Size or isinstance(obj, torch.dtype):
                return obj
        elif module == "torch.serialization" and name == "_get_layout":
            return torch.serialization._get_layout  # looks a layout up by name in a fixed table
        elif module == "pathlib" and name in self._PATH_CLASSES:
            return getattr(pathlib, name)  # StorageMeta.checkpoint_id
        elif module == "collections" and name == "OrderedDict":
            import collections

            return collections.OrderedDict
        raise pickle.UnpicklingError(
            f"checkpoint metadata refers to {module}.{name}, which is not part of DCP metadata; "
            "refusing to load it (a crafted .metadata file could run code)"
        )


class SafeFileSystemReader(dcp.FileSystemReader):
    """``FileSystemReader`` whose metadata cannot execute code (see :class:`_MetadataUnpickler`)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = _METADATA_FILE if rank is None else f"__{rank}{_METADATA_FILE}"
        path = self.fs.concat_path(self.path, name)
        with self.fs.create_stream(path, "rb") as stream:
            try:
                metadata = _MetadataUnpickler(stream).load()
            except pickle.UnpicklingError as error:
                raise ValueError(f"checkpoint {self.path}: {error}") from None
        if not isinstance(metadata, Metadata):
            raise ValueError(f"checkpoint {self.path}: {name} holds a {type(metadata).__name__}, not DCP Metadata")
        # As the stock reader does: older checkpoints have no storage_meta.
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class UnsafeCheckpointError(ValueError):
    """A checkpoint value that could only be loaded by running code from the checkpoint."""


class SafeLoadPlanner(DefaultLoadPlanner):
    """``DefaultLoadPlanner`` that only accepts non-tensor values ``torch.load(weights_only=True)`` can build."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        try:
            torch.load(value, weights_only=True)
        except Exception as error:
            raise UnsafeCheckpointError(
                f"checkpoint value '{read_item.dest_index.fqn}' is not plain data (weights_only load failed: "
                f"{str(error).splitlines()[0]}); refusing to unpickle it"
            ) from None
        # It only holds plain data, so the stock (unrestricted) load builds the
        # same objects; it also knows where nested values go.
        value.seek(0)
        super().load_bytes(read_item, value)


def _safe_dcp_load(state: dict[str, Any], reader: SafeFileSystemReader, no_dist: bool = False) -> None:
    """``dcp.load`` with the safe planner; a refused value surfaces as itself, not inside DCP's wrapper.

    DCP gathers every rank's failure into one ``CheckpointException`` (a
    ``BaseException``, which ``except Exception`` would not even catch); every
    rank gets it, so every rank raises the same refusal.
    """
    try:
        dcp.load(state, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=no_dist)
    except CheckpointException as error:
        for failure, _trace in error.failures.values():
            if isinstance(failure, UnsafeCheckpointError):
                raise failure from None
        raise


def read_metadata(path: Union[str, Path]) -> Metadata:
    """The metadata of the DCP checkpoint directory ``path`` (keys, global shapes, dtypes), read safely."""
    return SafeFileSystemReader(str(path)).read_metadata()


# ---------------------------------------------------------------------- checking
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


def check_compatible(state: dict[str, Any], metadata: Metadata, *, strict: bool = True, where: str = "") -> None:
    """Raise ``ValueError`` unless ``metadata`` can fill ``state`` exactly.

    Every key of ``state`` must be in the checkpoint with the same global
    shape (a DTensor's full shape), dtype and kind (tensor or not). With
    ``strict`` the checkpoint may hold no other keys either.
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
        # A whole top-level entry the state lacks (say the optimizer's, when
        # loading only a model) is one problem, not one per tensor.
        paths = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
        by_top: dict[str, list[str]] = {}
        for key in sorted(set(saved) - set(flat)):
            by_top.setdefault(str(paths.get(key, (key,))[0]), []).append(key)
        for top, keys in by_top.items():
            if top not in state and len(keys) > 1:
                problems.append(
                    f"unexpected in checkpoint: '{top}' ({len(keys)} entries, e.g. '{keys[0]}'); "
                    "pass strict=False to load only what the state holds"
                )
            else:
                problems.extend(f"unexpected in checkpoint: '{key}' ({_describe(saved[key])})" for key in keys)
    if problems:
        shown = problems[:_MAX_REPORTED]
        if len(problems) > _MAX_REPORTED:
            shown.append(f"... and {len(problems) - _MAX_REPORTED} more")
        target = f"checkpoint {where}" if where else "checkpoint"
        raise ValueError(f"{target} does not match the state to load into:\n  " + "\n  ".join(shown))


# ---------------------------------------------------------------------- loading
def load_checkpoint(state: dict[str, Any], path: Union[str, Path], *, strict: bool = True) -> None:
    """Load the DCP directory ``path`` into ``state`` in place, checked and safely (see the module doc).

    ``state`` holds what to fill: DTensors (resharded from whatever layout was
    saved), plain tensors (a single process gets full tensors) and non-tensor
    values (replaced). Collective when a process group is initialized.
    """
    reader = SafeFileSystemReader(str(path))
    check_compatible(state, reader.read_metadata(), strict=strict, where=str(path))
    _safe_dcp_load(state, reader)


def load_into(state: dict[str, Any], root: Path, step: int, *, strict: bool = True) -> None:
    """Load checkpoint ``step`` under ``root`` into ``state`` in place (DCP resharding to the current layout)."""
    load_checkpoint(state, step_dir(root, step), strict=strict)


def _set_path(root: dict, path: tuple, value: Any) -> None:
    """``root[path[0]][path[1]]... = value``, creating dicts (str keys) and lists (int keys) on the way."""
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


def load_full(path: Union[str, Path]) -> dict[str, Any]:
    """The whole checkpoint as a full, unsharded (nested) state dict of CPU tensors, in this process only.

    Starts no process group (and uses none that exists). Nesting is rebuilt
    from the key paths DCP records when saving, so a fullshard training
    checkpoint comes back as ``{"model": {...}, "optim": {...}}``.
    """
    reader = SafeFileSystemReader(str(path))
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


def export_full(
    checkpoint_dir: Union[str, Path], out_file: Union[str, Path], *, key: Optional[str] = None
) -> Path:
    """Write the checkpoint as one full, unsharded state dict file; one process, no process group.

    ``out_file`` ending in ``.pt``/``.pth`` gets ``torch.save`` of the nested
    state dict; ``.safetensors`` (needs the ``safetensors`` package) gets its
    tensors under dotted names, so it only takes tensors (pick ``key="model"``
    for a training checkpoint). ``key`` selects one top-level entry, e.g. the
    model's state dict without the optimizer's. The file appears atomically.
    """
    out = Path(out_file)
    suffix = out.suffix.lower()
    if suffix not in (".pt", ".pth", ".safetensors"):
        raise ValueError(f"export_full: unknown format for {out.name!r}; use .pt, .pth or .safetensors")
    if suffix == ".safetensors":
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise ImportError("export_full: writing .safetensors needs the 'safetensors' package") from None
    state: Any = load_full(checkpoint_dir)
    if key is not None:
        if key not in state:
            raise ValueError(f"export_full: checkpoint {checkpoint_dir} has no entry {key!r}; it has {sorted(state)}")
        state = state[key]
    partial = out.with_name(out.name + ".partial")
    if suffix == ".safetensors":
        flat = _flatten_nested(state)
        others = sorted(name for name, value in flat.items() if not isinstance(value, torch.Tensor))
        if others:
            raise ValueError(
                f"export_full: safetensors holds tensors only, but {len(others)} value(s) are not tensors "
                f"(e.g. {others[:3]}); export one entry with key=..., e.g. key='model'"
            )
        save_file({name: value.contiguous() for name, value in flat.items()}, str(partial))
    else:
        torch.save(state, partial)
    os.replace(partial, out)
    return out
