"""A DCP checkpoint's ``.metadata`` read as untrusted input: no code runs, every field is checked.

Stock DCP reads the ``.metadata`` file with plain ``pickle.load``, which
executes whatever a crafted file asks for, and then trusts every number in
it. Here (:func:`open_metadata`) the manifest is verified first (a stock DCP
checkpoint has none: ``require_manifest=False`` accepts one, with every
other check); the pickle's opcodes are scanned (no count in it may ask for
more memory than the file holds, :func:`~fullshard.checkpoint.untrusted.check_pickle`);
an unpickler that only builds DCP's own metadata classes, torch sizes,
dtypes and layouts, and paths reads it; and every field is then checked for
type and range (:func:`check_metadata`): storage file names are plain names
of regular files in the directory, every chunk lies inside its tensor's
shape and the chunks tile it, every stored byte range lies inside its file
and the ranges fill the file, key paths build one bounded nesting. Anything
wrong is a :class:`~fullshard.checkpoint.untrusted.CheckpointError` naming
the file, before DCP reads a byte of tensor data.

Kept apart from ``checkpoint.py`` (the save and load functions) because it
is one job of its own, and the largest.
"""
from __future__ import annotations

import collections
import dataclasses
import enum
import functools
import io
import pathlib
import pickle
from math import prod
from pathlib import Path, PurePath
from typing import Any, Optional, Union

import torch
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from fullshard.checkpoint import manifest
from fullshard.checkpoint.files import plain_file_name, read_whole, regular_file
from fullshard.checkpoint.publish import resolve
from fullshard.checkpoint.untrusted import (CheckpointError, check_key_paths, check_pickle, check_ranges, check_shape,
                                            check_tiling, is_int, show)

# DCP's name for the metadata file (``filesystem._metadata_fn``, private there).
METADATA_FILE = ".metadata"
FRAMEWORK = "torch"
_MAX_METADATA_BYTES = 2 << 30
# Tensor dtypes a checkpoint may declare: the plain ones (no quantized or sub-byte packed types).
_DTYPES = frozenset(d for d in (
    "float64", "float32", "float16", "bfloat16", "complex128", "complex64", "complex32",
    "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16", "uint8", "bool",
    "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz", "float8_e8m0fnu",
) if isinstance(getattr(torch, d, None), torch.dtype))
_MEMORY_FORMATS = (torch.contiguous_format, torch.channels_last, torch.preserve_format)
_MAX_TEXT = 4096
_NO_MANIFEST_FIX = (
    "it was not saved by fullshard (a stock DCP or FSDP2 checkpoint), or its save never finished. To load a "
    "stock checkpoint, pass require_manifest=False (fullshard export --without-manifest): every structural "
    "check still runs, only the digests are missing")


# ---------------------------------------------------------------------- reading it
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
            return collections.OrderedDict
        raise pickle.UnpicklingError(
            f"checkpoint metadata refers to {module}.{name}, which is not part of DCP metadata; "
            "refusing to load it (a crafted .metadata file could run code)"
        )


def checked_metadata(directory: Path, verified: Optional[manifest.Manifest]) -> Metadata:
    """The metadata of DCP directory ``directory``, every field checked (see :func:`_check_metadata`).

    ``verified``: the manifest the files were verified against, whose save id the metadata must carry.
    """
    data = read_whole(directory, METADATA_FILE, directory, _MAX_METADATA_BYTES)
    check_pickle(data, directory, METADATA_FILE)
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as error:  # a refused class, or classes built from arguments they do not take
        problem = str(error).splitlines()[0][:300] if str(error) else type(error).__name__
        raise CheckpointError.at(directory, f"cannot be unpickled as DCP metadata: {problem}", METADATA_FILE) from None
    check_metadata(metadata, directory)
    if verified is not None and getattr(metadata.storage_meta, "save_id", None) != verified.save_id:
        raise CheckpointError.at(directory, f"was written by save {show(getattr(metadata.storage_meta, 'save_id', None))}, "
                                 f"the manifest lists save {verified.save_id}: the files come from different saves",
                                 METADATA_FILE)
    return metadata


def open_metadata(path: Union[str, Path], *, require_manifest: bool = True) -> tuple[Path, Metadata]:
    """The directory checkpoint ``path`` is loaded from (:func:`~fullshard.checkpoint.publish.resolve`) and its
    metadata: the manifest verified (absent: CheckpointError unless ``require_manifest`` is False), every
    field checked. Reads nothing but the checkpoint's own files."""
    directory = resolve(path)
    if not directory.is_dir():
        raise CheckpointError.at(directory, "does not exist (no checkpoint directory there)")
    verified = None
    if manifest.present(directory) or require_manifest:
        if not manifest.present(directory):
            raise CheckpointError.at(directory, f"has no {manifest.MANIFEST_FILE}: {_NO_MANIFEST_FIX}")
        verified = manifest.verify(directory, FRAMEWORK)
    return directory, checked_metadata(directory, verified)


# ---------------------------------------------------------------------- checking the metadata itself
@functools.cache
def _field_names(cls: type) -> frozenset:
    return frozenset(f.name for f in dataclasses.fields(cls))


def _fields(obj: Any, cls: type, directory: Path, what: str, optional: frozenset = frozenset()) -> None:
    """``obj`` is exactly a ``cls`` whose attributes are its dataclass fields (``optional`` ones may be absent)."""
    names = _field_names(cls)
    attributes = getattr(obj, "__dict__", None)
    if type(obj) is not cls or not isinstance(attributes, dict) or not (names - optional) <= set(attributes) <= names:
        raise CheckpointError.at(directory, f"{what} is {show(obj)}, not a {cls.__name__} with fields "
                                 f"{sorted(names)}", METADATA_FILE)


def _size(value: Any, directory: Path, what: str) -> tuple[int, ...]:
    if type(value) is not torch.Size:
        raise CheckpointError.at(directory, f"{what} is {show(value)}, not a torch.Size", METADATA_FILE)
    return check_shape(tuple(value), directory, f"{METADATA_FILE}: {what}")


def _text(value: Any, directory: Path, what: str, allow_none: bool = True) -> None:
    if not ((allow_none and value is None) or (isinstance(value, str) and len(value) <= _MAX_TEXT)):
        raise CheckpointError.at(directory, f"{what} is {show(value)}, not a string", METADATA_FILE)


def _tensor_entry(name: str, entry: Any, directory: Path) -> tuple[tuple[int, ...], int, list]:
    """Shape, element size and chunks of a tensor entry, each field checked."""
    what = f"the entry of '{name}'"
    _fields(entry, TensorStorageMetadata, directory, what)
    props = entry.properties
    _fields(props, TensorProperties, directory, f"{what}: its properties")
    if (not isinstance(props.dtype, torch.dtype) or str(props.dtype).removeprefix("torch.") not in _DTYPES
            or props.layout is not torch.strided or type(props.requires_grad) is not bool
            or type(props.pin_memory) is not bool or props.memory_format not in _MEMORY_FORMATS):
        raise CheckpointError.at(directory, f"{what}: properties {show(props)} are not those of a plain dense "
                                 "tensor", METADATA_FILE)
    shape = _size(entry.size, directory, f"{what}: its size")
    if type(entry.chunks) is not list:
        raise CheckpointError.at(directory, f"{what}: chunks {show(entry.chunks)} is not a list", METADATA_FILE)
    chunks = []
    for index, chunk in enumerate(entry.chunks):
        _fields(chunk, ChunkStorageMetadata, directory, f"{what}: chunk {index}")
        chunks.append((_size(chunk.offsets, directory, f"{what}: chunk {index} offsets"),
                       _size(chunk.sizes, directory, f"{what}: chunk {index} sizes")))
    check_tiling(shape, chunks, directory, f"{METADATA_FILE}: {what}")
    return shape, props.dtype.itemsize, chunks


def _storage(metadata: Metadata, directory: Path) -> dict[tuple, tuple[str, Any, Any, Any]]:
    """``(fqn, chunk offsets or None)`` -> (file, offset, length, chunk index) of every stored item; the
    names and kinds checked (the numbers are checked against the entries and files)."""
    if type(metadata.storage_data) is not dict:
        raise CheckpointError.at(directory, f"storage_data is {show(metadata.storage_data)}, not a dict", METADATA_FILE)
    storage = {}
    for index, info in metadata.storage_data.items():
        _fields(index, MetadataIndex, directory, "a storage_data key", frozenset({"offset", "index"}))
        _text(index.fqn, directory, "a storage_data key's fqn", allow_none=False)
        offsets = None if index.offset is None else _size(index.offset, directory, f"the storage key of '{index.fqn}'")
        what = f"the storage of '{index.fqn}'" + (f" at {offsets}" if offsets is not None else "")
        _fields(info, dcp_filesystem._StorageInfo, directory, what, frozenset({"transform_descriptors"}))
        name = plain_file_name(info.relative_path, directory, f"{what} names file")
        if name in (METADATA_FILE, manifest.MANIFEST_FILE):
            raise CheckpointError.at(directory, f"{what} points into {name}, which holds no data", METADATA_FILE)
        if getattr(info, "transform_descriptors", None) not in (None, [], ()):
            raise CheckpointError.at(directory, f"{what} is stored through transforms "
                                     f"{show(info.transform_descriptors)}, which fullshard's checked loads do not "
                                     "read", METADATA_FILE)
        storage[(index.fqn, offsets)] = (name, info.offset, info.length, index.index)
    return storage


def check_metadata(metadata: Any, directory: Path) -> None:
    """Every field of unpickled DCP metadata, for type and range, against the files it points into.

    Tensor chunks tile their shapes, each stored at a byte range of a
    regular file of the directory, the ranges inside their files and
    disjoint, each at least as long as its chunk's raw bytes (so no tensor
    claims more than the files hold). Every entry is stored, nothing else
    is; key paths (``planner_data``) are bounded and consistent.
    """
    # storage_meta and version are newer than the format: older checkpoints lack them
    _fields(metadata, Metadata, directory, "the metadata", frozenset({"storage_meta", "version"}))
    entries = metadata.state_dict_metadata
    if type(entries) is not dict:
        raise CheckpointError.at(directory, f"state_dict_metadata is {show(entries)}, not a dict", METADATA_FILE)
    storage = _storage(metadata, directory)
    claimed, per_file = set(), collections.defaultdict(list)
    for name, entry in entries.items():
        _text(name, directory, "a state_dict_metadata key", allow_none=False)
        if type(entry) is BytesStorageMetadata:
            _fields(entry, BytesStorageMetadata, directory, f"the entry of '{name}'")
            items = [((name, None), 0, None, f"value '{name}'")]
        else:
            _, itemsize, chunks = _tensor_entry(name, entry, directory)
            items = [((name, offsets), prod(sizes) * itemsize, position, f"'{name}' chunk at {offsets}")
                     for position, (offsets, sizes) in enumerate(chunks)]
        for item, least, position, what in items:
            if item not in storage:
                raise CheckpointError.at(directory, f"{what} is not stored anywhere (no storage_data entry)",
                                         METADATA_FILE)
            file, offset, length, hint = storage[item]
            if not (hint is None or (position is not None and is_int(hint) and hint == position)):
                raise CheckpointError.at(directory, f"the storage key of {what} gives chunk index {show(hint)}, "
                                         f"it is chunk {position}", METADATA_FILE)
            if is_int(length) and length < least:
                raise CheckpointError.at(directory, f"{what} is stored in {length} bytes, fewer than its {least} "
                                         "bytes of data", METADATA_FILE)
            claimed.add(item)
            per_file[file].append((offset, length, what))
    unclaimed = sorted(map(str, set(storage) - claimed))
    if unclaimed:
        raise CheckpointError.at(directory, f"storage_data holds {unclaimed[0]}, which no entry uses", METADATA_FILE)
    for file, ranges in sorted(per_file.items()):
        check_ranges(file, regular_file(directory, file, directory).st_size, ranges, directory)
    _check_extras(metadata, directory)


def _check_extras(metadata: Metadata, directory: Path) -> None:
    """``planner_data`` (key paths), ``storage_meta`` and ``version``: types, bounds and consistency."""
    paths = metadata.planner_data
    if paths is not None:
        if type(paths) is not dict or set(paths) != set(metadata.state_dict_metadata):
            raise CheckpointError.at(directory, "planner_data does not map exactly the checkpoint's keys to key "
                                     f"paths: {show(paths)}", METADATA_FILE)
    check_key_paths(paths if paths is not None else {k: (k,) for k in metadata.state_dict_metadata},
                    directory, METADATA_FILE)
    meta = metadata.storage_meta
    if meta is not None:
        _fields(meta, StorageMeta, directory, "storage_meta", frozenset({"checkpoint_id", "save_id", "load_id", "modules"}))
        checkpoint_id = getattr(meta, "checkpoint_id", None)
        if isinstance(checkpoint_id, PurePath):
            checkpoint_id = str(checkpoint_id)  # where it was saved; never used to read
        _text(checkpoint_id, directory, "storage_meta.checkpoint_id")
        _text(getattr(meta, "save_id", None), directory, "storage_meta.save_id")
        _text(getattr(meta, "load_id", None), directory, "storage_meta.load_id")
        modules = getattr(meta, "modules", [])
        if type(modules) is not list or len(modules) > _MAX_TEXT:
            raise CheckpointError.at(directory, f"storage_meta.modules is {show(modules)}, not a list", METADATA_FILE)
        for module in modules:
            _text(module, directory, "a storage_meta module", allow_none=False)
    _text(getattr(metadata, "version", None), directory, "version")
