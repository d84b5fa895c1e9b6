"""The sharded checkpoint format of the MindSpore runtime: one safetensors file per rank plus JSON.

MindSpore has no DCP, so fullshard writes this format itself, framework-free
(numpy and the ``safetensors`` package, no MindSpore): saving hands in each
rank's pieces, loading reads the part of each piece a rank needs, and
:func:`export_full` turns a checkpoint into one full ``.safetensors`` file
without any framework or process group (what ``fullshard export`` runs).

A checkpoint directory holds

- ``rank_<r>.safetensors`` for every rank ``r``: that rank's piece of every
  sharded entry (a slice of the global tensor along one dim), and on rank 0
  the entries kept whole (replicated parameters, step counters). The file's
  ``__metadata__["slices"]`` says, per entry, ``[dim, offset, length]``
  (``dim`` null for a whole one);
- ``fullshard.json``: the format, the world size, the save's id, the rank
  files, and per entry its global shape, dtype and the dim it was cut along;
- ``fullshard.manifest.json``, written last (:mod:`fullshard.checkpoint.manifest`):
  the size and SHA-256 of each of the others.

Entry keys are ``model/<parameter name>`` and ``optim/<state name>``. Nothing
is unpickled: loading parses JSON (canonical,
:func:`~fullshard.checkpoint.manifest.loads_canonical`; the rank files
through safetensors' parser, :mod:`~fullshard.checkpoint.formats.safetensors_file`)
and copies bytes. Opening a checkpoint verifies the manifest, then checks
every field of ``fullshard.json`` and of every rank file's header and slices
against each other (the pieces of each entry must tile its shape), before a
single tensor is read; anything wrong is a
:class:`~fullshard.checkpoint.untrusted.CheckpointError` naming the file.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Optional, Union

import numpy as np

from fullshard.checkpoint import manifest
from fullshard.checkpoint.files import fsync_dir, read_whole, write_file_durably
from fullshard.checkpoint.formats.safetensors_file import CODES, HOLDERS, Array, TensorFile, save_file
from fullshard.checkpoint.manifest import dumps_canonical, loads_canonical
from fullshard.checkpoint.publish import resolve
from fullshard.checkpoint.untrusted import CheckpointError, check_shape, check_tiling, is_int, show

FORMAT = "fullshard-sharded-safetensors"
VERSION = 2
FRAMEWORK = "mindspore"
METADATA_FILE = "fullshard.json"
MODEL, OPTIM = "model", "optim"
_KEYS = {"entries", "files", "format", "framework", "save_id", "version", "world_size"}
_MAX_METADATA_BYTES = 256 << 20
_MAX_WORLD_SIZE = 1 << 16
_MAX_NAME = 4096
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
    save_file(tensors, Path(directory) / rank_file(rank), {"slices": dumps_canonical(slices).decode()})


def write_metadata(directory: Path, world_size: int, pieces: Iterable[Piece], save_id: str) -> None:
    """``fullshard.json``, by one rank, after every rank wrote its file (the manifest comes after it)."""
    entries = {p.key: {"shape": list(p.shape), "dtype": p.dtype, "dim": p.dim} for p in pieces}
    document = {"format": FORMAT, "version": VERSION, "framework": FRAMEWORK, "world_size": world_size,
                "save_id": save_id, "files": [rank_file(r) for r in range(world_size)], "entries": entries}
    write_file_durably(Path(directory) / METADATA_FILE, dumps_canonical(document))
    fsync_dir(Path(directory))


def is_sharded_checkpoint(path: Union[str, Path]) -> bool:
    return (Path(path) / METADATA_FILE).is_file()


@dataclass(frozen=True)
class Entry:
    shape: tuple[int, ...]
    dtype: str
    dim: Optional[int]


class ShardedCheckpoint:
    """A checkpoint directory, verified and every field of it checked; tensors are read on demand.

    ``path`` is resolved as every loader resolves it (:func:`fullshard.checkpoint.publish.resolve`).
    """

    def __init__(self, path: Union[str, Path]) -> None:
        self.path = resolve(path)
        if not self.path.is_dir():
            raise CheckpointError.at(self.path, "does not exist (no checkpoint directory there)")
        self.manifest = manifest.verify(self.path, FRAMEWORK)
        document = loads_canonical(read_whole(self.path, METADATA_FILE, self.path, _MAX_METADATA_BYTES),
                                        self.path, METADATA_FILE)
        self.world_size, self.entries = self._check_document(document)
        self._files = [self._open_rank(rank) for rank in range(self.world_size)]
        self._whole: dict[str, TensorFile] = {}
        self._pieces: dict[str, list[tuple[int, int, TensorFile]]] = {}
        self._check_pieces()

    def _bad(self, problem: str, file: str = METADATA_FILE) -> CheckpointError:
        return CheckpointError.at(self.path, problem, file)

    # ------------------------------------------------------------------ checking what the files say
    def _check_document(self, document: Any) -> tuple[int, dict[str, Entry]]:
        if not isinstance(document, dict) or set(document) != _KEYS:
            keys = sorted(document) if isinstance(document, dict) else type(document).__name__
            raise self._bad(f"is not a {FORMAT} document (keys {show(keys)}, expected {sorted(_KEYS)})")
        if document["format"] != FORMAT or not is_int(document["version"]) or document["version"] != VERSION:
            raise self._bad(f"format {show(document['format'])} version {show(document['version'])}; this "
                            f"fullshard reads {FORMAT} version {VERSION}")
        if document["framework"] != FRAMEWORK:
            raise self._bad(f"framework {show(document['framework'])}, expected {FRAMEWORK!r}")
        if document["save_id"] != self.manifest.save_id:
            raise self._bad(f"save_id {show(document['save_id'])} is not the manifest's "
                            f"{self.manifest.save_id!r}: the files come from different saves")
        world = document["world_size"]
        if not is_int(world) or not 1 <= world <= _MAX_WORLD_SIZE:
            raise self._bad(f"world_size {show(world)} is not a number of ranks")
        if document["files"] != [rank_file(r) for r in range(world)]:
            raise self._bad(f"files {show(document['files'])} are not exactly rank_<r>.safetensors for each of "
                            f"the {world} ranks")
        entries = document["entries"]
        if not isinstance(entries, dict):
            raise self._bad(f"entries {show(entries)} is not an object")
        return world, {name: self._check_entry(name, entry) for name, entry in entries.items()}

    def _check_entry(self, name: str, entry: Any) -> Entry:
        section, _, rest = name.partition("/")
        if section not in (MODEL, OPTIM) or not rest or len(name) > _MAX_NAME:
            raise self._bad(f"entry {show(name)} is not named model/<parameter> or optim/<state>")
        if not isinstance(entry, dict) or set(entry) != {"dim", "dtype", "shape"}:
            raise self._bad(f"entry '{name}' must hold exactly dim, dtype and shape, not {show(entry)}")
        shape = check_shape(entry["shape"], self.path, f"{METADATA_FILE}: entry '{name}'")
        dtype, dim = entry["dtype"], entry["dim"]
        if not isinstance(dtype, str) or dtype not in CODES:
            raise self._bad(f"entry '{name}' has dtype {show(dtype)}, not one of {', '.join(CODES)}")
        if dim is not None and not (is_int(dim) and 0 <= dim < len(shape)):
            raise self._bad(f"entry '{name}' is cut along dim {show(dim)}, not a dim of its shape {list(shape)}")
        return Entry(shape, dtype, dim)

    def _open_rank(self, rank: int) -> tuple[TensorFile, dict]:
        name = rank_file(rank)
        handle = TensorFile(self.path / name, self.path)
        if set(handle.metadata) != {"slices"}:
            raise self._bad(f"has __metadata__ keys {show(sorted(handle.metadata))}, expected ['slices']", name)
        slices = loads_canonical(handle.metadata["slices"].encode("utf-8", "replace"), self.path,
                                      f"{name} (its slices)")
        if not isinstance(slices, dict) or set(slices) != set(handle.names()):
            raise self._bad("its slices do not name exactly the tensors it holds", name)
        return handle, slices

    def _check_pieces(self) -> None:
        """Every tensor of every rank file is a slice of its entry, and each entry's slices tile it."""
        cuts: dict[str, set[tuple[int, int, int]]] = {name: set() for name in self.entries}
        for rank, (handle, slices) in enumerate(self._files):
            for name, where in slices.items():
                entry = self.entries.get(name)
                if entry is None:
                    raise self._bad(f"holds {show(name)}, which {METADATA_FILE} does not list", handle.path.name)
                if not (isinstance(where, list) and len(where) == 3 and (where[0] is None or is_int(where[0]))
                        and is_int(where[1]) and is_int(where[2])):
                    raise self._bad(f"the slice of '{name}' is {show(where)}, not [dim, offset, length]",
                                    handle.path.name)
                dim, offset, length = where
                self._check_piece(name, entry, rank, handle, dim, offset, length)
                if dim is None:
                    self._whole[name] = handle
                else:
                    cuts[name].add((offset, length, rank))
        for name, entry in self.entries.items():
            if entry.dim is None:
                if name not in self._whole:
                    raise self._bad(f"entry '{name}' is held whole by no rank file ({rank_file(0)} should)")
                continue
            distinct = {(offset, length): rank for offset, length, rank in sorted(cuts[name])}  # replicas once
            chunks = [(_along(entry, offset), _sizes(entry, length)) for offset, length in distinct]
            check_tiling(entry.shape, chunks, self.path, f"entry '{name}' (its slices in the rank files)")
            self._pieces[name] = [(offset, length, self._files[rank][0])
                                  for (offset, length), rank in sorted(distinct.items())]

    def _check_piece(self, name: str, entry: Entry, rank: int, handle: TensorFile, dim, offset, length) -> None:
        file = handle.path.name
        if dim != entry.dim:
            raise self._bad(f"holds '{name}' cut along {show(dim)}, {METADATA_FILE} says {entry.dim}", file)
        if dim is None:
            if rank != 0 or offset != 0 or length != 0:
                raise self._bad(f"holds the whole entry '{name}' as [null, {offset}, {length}]; only "
                                f"{rank_file(0)} holds whole entries, as [null, 0, 0]", file)
            expected = entry.shape
        else:
            if not (0 <= offset and 0 < length and offset + length <= entry.shape[dim]):
                raise self._bad(f"holds rows {offset}+{length} of '{name}' along dim {dim}, outside its shape "
                                f"{list(entry.shape)}", file)
            expected = entry.shape[:dim] + (length,) + entry.shape[dim + 1:]
        if handle.shape(name) != expected or handle.dtype(name) != entry.dtype:
            raise self._bad(f"holds '{name}' as {handle.dtype(name)} {list(handle.shape(name))}, {METADATA_FILE} "
                            f"makes it {entry.dtype} {list(expected)}", file)

    def names(self, section: str) -> list[str]:
        prefix = f"{section}/"
        return sorted(k[len(prefix):] for k in self.entries if k.startswith(prefix))

    # ------------------------------------------------------------------ checking against a model
    def check(self, wanted: dict[str, tuple[tuple[int, ...], str]], sections: Iterable[str], what: str,
              strict: bool = True) -> None:
        """Raise CheckpointError unless the entries of ``sections`` are exactly ``wanted`` (key -> global shape,
        dtype), naming every missing, unexpected or different entry (``strict=False``: unexpected ones are
        allowed)."""
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
        for name in sorted(self.entries) if strict else ():
            if name.startswith(sections) and name not in wanted:
                entry = self.entries[name]
                problems.append(f"unexpected in checkpoint: {_describe(name)} ({entry.dtype} {entry.shape})")
        if problems:
            shown = problems[:_MAX_REPORTED]
            if len(problems) > _MAX_REPORTED:
                shown.append(f"... and {len(problems) - _MAX_REPORTED} more")
            raise CheckpointError(f"checkpoint {self.path} does not match the {what} to load into (nothing was "
                                  "loaded):\n  " + "\n  ".join(shown), str(self.path))

    # ------------------------------------------------------------------ reading
    def full(self, name: str) -> Array:
        """The whole tensor of entry ``name``, put together from the ranks' pieces."""
        return self.read(name, None, 0, 0)

    def read(self, name: str, dim: Optional[int], offset: int, length: int) -> Array:
        """The slice ``[offset, offset + length)`` of entry ``name`` along ``dim`` (``None``: all of it).

        Each piece that overlaps it gives only its part (safetensors reads a slice of a tensor), so a
        rank's load holds its own chunk, not the whole entry.
        """
        entry = self.entries[name]
        want = [(0, size) for size in entry.shape]
        if dim is not None:
            want[dim] = (offset, offset + length)
        if entry.dim is None:
            return self._whole[name].read(name, want)
        start, stop = want[entry.dim]
        parts = []
        for piece_offset, piece_length, handle in self._pieces[name]:
            low, high = max(start, piece_offset), min(stop, piece_offset + piece_length)
            if low < high:
                region = list(want)
                region[entry.dim] = (low - piece_offset, high - piece_offset)
                parts.append(handle.read(name, region).data)
        if not parts:  # nothing along the dim the entry is cut along
            return Array(np.zeros([b - a for a, b in want], HOLDERS[entry.dtype]), entry.dtype)
        return Array(np.concatenate(parts, axis=entry.dim), entry.dtype)


def _along(entry: Entry, offset: int) -> tuple[int, ...]:
    return tuple(offset if d == entry.dim else 0 for d in range(len(entry.shape)))


def _sizes(entry: Entry, length: int) -> tuple[int, ...]:
    return entry.shape[:entry.dim] + (length,) + entry.shape[entry.dim + 1:]


def _describe(name: str) -> str:
    section, _, rest = name.partition("/")
    return f"parameter '{rest}'" if section == MODEL else f"optimizer state '{rest}'"


def export_full(path: Union[str, Path], out_file: Union[str, Path]) -> Path:
    """Write the model of checkpoint ``path`` as one full ``.safetensors`` file under the parameter names.

    One process, no framework, no process group. The whole checkpoint is
    checked before anything is written; the file appears atomically.
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
