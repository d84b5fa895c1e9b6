"""The sharded checkpoint format of the MindSpore runtime: one safetensors file per rank plus JSON.

Framework-free (numpy): saving hands in each rank's pieces, loading reads the
pieces a rank needs, and :func:`export_full` turns a checkpoint into one full
``.safetensors`` file without any framework or process group.

A checkpoint directory holds

- ``rank_<r>.safetensors`` for every rank ``r``: that rank's piece of every
  sharded entry (a slice of the global tensor along one dim), and on rank 0
  the entries kept whole (replicated parameters, step counters). The file's
  ``__metadata__["slices"]`` says, per entry, ``[dim, offset, length]``
  (``dim`` null for a whole one);
- ``fullshard.json``, written last: the format, the world size, and per entry
  its global shape, dtype and the dim it was cut along.

Entry keys are ``model/<parameter name>`` and ``optim/<state name>``. Nothing
is unpickled: loading parses JSON and copies bytes.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Union

import numpy as np

from fullshard.core.atomic import fsync_dir, write_file_durably
from fullshard.core.tensorfile import Array, TensorFile, TensorFileError, save_file

FORMAT = "fullshard-sharded-safetensors"
VERSION = 1
METADATA_FILE = "fullshard.json"
MODEL, OPTIM = "model", "optim"
# At most this many problems are spelled out in one mismatch error.
_MAX_REPORTED = 20


def rank_file(rank: int) -> str:
    return f"rank_{rank}.safetensors"


def key(section: str, name: str) -> str:
    return f"{section}/{name}"


@dataclass(frozen=True)
class Piece:
    """What one rank holds of one entry: the slice ``[offset, offset + length)`` of ``shape`` along ``dim``
    (``dim=None``: the whole tensor), and, when saving, its data."""

    key: str
    shape: tuple[int, ...]
    dtype: str
    dim: Optional[int]
    offset: int = 0
    length: int = 0
    data: Optional[Array] = None

    @property
    def local_shape(self) -> tuple[int, ...]:
        if self.dim is None:
            return self.shape
        return self.shape[: self.dim] + (self.length,) + self.shape[self.dim + 1:]


def write_rank(directory: Path, rank: int, pieces: Iterable[Piece]) -> None:
    """This rank's file: its slices of the sharded entries, and (rank 0) the whole ones."""
    tensors, slices = {}, {}
    for piece in pieces:
        if piece.dim is None and rank != 0:
            continue
        if piece.dim is not None and piece.length == 0:
            continue  # an empty chunk adds nothing
        tensors[piece.key] = piece.data
        slices[piece.key] = [piece.dim, piece.offset, piece.length]
    save_file(tensors, Path(directory) / rank_file(rank), {"slices": json.dumps(slices)})


def write_metadata(directory: Path, world_size: int, framework: str, pieces: Iterable[Piece],
                   extra: Optional[dict] = None) -> None:
    """``fullshard.json``, by one rank, after every rank wrote its file: the checkpoint is then complete."""
    entries = {p.key: {"shape": list(p.shape), "dtype": p.dtype, "dim": p.dim} for p in pieces}
    document = {"format": FORMAT, "version": VERSION, "framework": framework, "world_size": world_size,
                "files": [rank_file(r) for r in range(world_size)], "entries": entries, **(extra or {})}
    write_file_durably(Path(directory) / METADATA_FILE, json.dumps(document, indent=1).encode())
    fsync_dir(Path(directory))


def is_sharded_checkpoint(path: Union[str, Path]) -> bool:
    return (Path(path) / METADATA_FILE).is_file()


@dataclass(frozen=True)
class Entry:
    shape: tuple[int, ...]
    dtype: str
    dim: Optional[int]


class ShardedCheckpoint:
    """A checkpoint directory, its metadata read and checked; pieces are read on demand."""

    def __init__(self, path: Union[str, Path]) -> None:
        self.path = Path(path)
        meta_path = self.path / METADATA_FILE
        if not meta_path.is_file():
            raise FileNotFoundError(f"{self.path} is not a complete fullshard checkpoint (no {METADATA_FILE})")
        try:
            document = json.loads(meta_path.read_text())
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise ValueError(f"checkpoint {self.path}: {METADATA_FILE} is not JSON ({error})") from None
        if not isinstance(document, dict) or document.get("format") != FORMAT:
            raise ValueError(f"checkpoint {self.path}: {METADATA_FILE} is not a {FORMAT} document")
        if document.get("version") != VERSION:
            raise ValueError(f"checkpoint {self.path}: format version {document.get('version')!r}, "
                             f"this fullshard reads version {VERSION}")
        self.metadata = document
        self.world_size = int(document["world_size"])
        self.entries: dict[str, Entry] = {}
        for name, entry in document.get("entries", {}).items():
            shape, dim = tuple(entry["shape"]), entry["dim"]
            if not all(isinstance(s, int) and s >= 0 for s in shape) or not (
                    dim is None or (isinstance(dim, int) and 0 <= dim < len(shape))):
                raise ValueError(f"checkpoint {self.path}: entry '{name}' has shape {shape} and dim {dim}")
            self.entries[name] = Entry(shape, str(entry["dtype"]), dim)
        self._files: Optional[list[tuple[TensorFile, dict]]] = None

    def names(self, section: str) -> list[str]:
        prefix = f"{section}/"
        return sorted(k[len(prefix):] for k in self.entries if k.startswith(prefix))

    # ------------------------------------------------------------------ checking
    def check(self, wanted: dict[str, tuple[tuple[int, ...], str]], sections: Iterable[str], what: str) -> None:
        """Raise ``ValueError`` unless the entries of ``sections`` are exactly ``wanted`` (key -> global shape,
        dtype), naming every missing, unexpected or different entry."""
        problems = []
        for name, (shape, dtype) in wanted.items():
            entry = self.entries.get(name)
            if entry is None:
                problems.append(f"missing in checkpoint: {_describe(name)} ({dtype} {shape} in the {what})")
                continue
            if entry.shape != tuple(shape):
                problems.append(f"shape mismatch for {_describe(name)}: checkpoint {entry.shape} vs {what} {tuple(shape)}")
            if entry.dtype != dtype:
                problems.append(f"dtype mismatch for {_describe(name)}: checkpoint {entry.dtype} vs {what} {dtype}")
        sections = tuple(f"{s}/" for s in sections)
        for name in sorted(self.entries):
            if name.startswith(sections) and name not in wanted:
                entry = self.entries[name]
                problems.append(f"unexpected in checkpoint: {_describe(name)} ({entry.dtype} {entry.shape})")
        if problems:
            shown = problems[:_MAX_REPORTED]
            if len(problems) > _MAX_REPORTED:
                shown.append(f"... and {len(problems) - _MAX_REPORTED} more")
            raise ValueError(f"checkpoint {self.path} does not match the {what} to load into (nothing was "
                             "loaded):\n  " + "\n  ".join(shown))

    # ------------------------------------------------------------------ reading
    def _rank_files(self) -> list[tuple[TensorFile, dict]]:
        if self._files is None:
            files = []
            for name in self.metadata.get("files", []):
                path = self.path / name
                if not path.is_file():
                    raise ValueError(f"checkpoint {self.path}: {name} is missing")
                handle = TensorFile(path)
                try:
                    slices = json.loads(handle.metadata.get("slices", "{}"))
                except json.JSONDecodeError:
                    raise TensorFileError(f"{path}: its slices metadata is not JSON") from None
                files.append((handle, slices))
            self._files = files
        return self._files

    def full(self, name: str) -> Array:
        """The whole tensor of entry ``name``, put together from the ranks' pieces."""
        entry = self.entries[name]
        pieces = []
        for handle, slices in self._rank_files():
            if name not in slices:
                continue
            dim, offset, length = slices[name]
            if dim != entry.dim:
                raise ValueError(f"checkpoint {self.path}: {handle.path.name} holds '{name}' cut along {dim}, "
                                 f"the metadata says {entry.dim}")
            want = entry.shape if dim is None else entry.shape[:dim] + (length,) + entry.shape[dim + 1:]
            if name not in handle or handle.shape(name) != want or handle.dtype(name) != entry.dtype:
                raise ValueError(f"checkpoint {self.path}: {handle.path.name} holds '{name}' as "
                                 f"{handle.dtype(name) if name in handle else 'nothing'} "
                                 f"{handle.shape(name) if name in handle else ''}, expected {entry.dtype} {want}")
            if dim is None:
                return handle.read(name)
            pieces.append((offset, length, handle))
        if entry.dim is None or (not pieces and entry.shape[entry.dim] != 0):
            raise ValueError(f"checkpoint {self.path}: no rank file holds '{name}'")
        parts, covered = [], 0
        for offset, length, handle in sorted(pieces, key=lambda p: p[0]):
            if offset < covered:
                continue  # the same slice from another replica
            if offset != covered:
                break
            parts.append(handle.read(name).data)
            covered += length
        if covered != entry.shape[entry.dim]:
            raise ValueError(f"checkpoint {self.path}: the pieces of '{name}' cover {covered} of "
                             f"{entry.shape[entry.dim]} along dim {entry.dim}")
        if not parts:
            return Array(np.zeros(entry.shape, _holder(entry.dtype)), entry.dtype)
        return Array(np.concatenate(parts, axis=entry.dim), entry.dtype)

    def read(self, name: str, dim: Optional[int], offset: int, length: int) -> Array:
        """The slice ``[offset, offset + length)`` of entry ``name`` along ``dim`` (``None``: all of it)."""
        whole = self.full(name)
        if dim is None:
            return whole
        index = [slice(None)] * whole.data.ndim
        index[dim] = slice(offset, offset + length)
        return Array(np.ascontiguousarray(whole.data[tuple(index)]), whole.dtype)


def _holder(dtype: str):
    from fullshard.core.tensorfile import HOLDERS

    return HOLDERS[dtype]


def _describe(name: str) -> str:
    section, _, rest = name.partition("/")
    return f"parameter '{rest}'" if section == MODEL else f"optimizer state '{rest}'"


def export_full(path: Union[str, Path], out_file: Union[str, Path]) -> Path:
    """Write the model of checkpoint ``path`` as one full ``.safetensors`` file under the parameter names.

    One process, no framework, no process group. The file appears atomically.
    """
    out = Path(out_file)
    if out.suffix.lower() != ".safetensors":
        raise ValueError(f"export: a MindSpore checkpoint exports to .safetensors, not {out.name!r}")
    checkpoint = ShardedCheckpoint(path)
    tensors = {name: checkpoint.full(key(MODEL, name)) for name in checkpoint.names(MODEL)}
    partial = out.with_name(out.name + ".partial")
    save_file(tensors, partial)
    os.replace(partial, out)
    return out
