"""Reading and writing ``.safetensors`` files with numpy alone, bfloat16 included.

The format: 8 bytes (little-endian length of the header), a JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``
and the raw little-endian data. Reading parses JSON and copies bytes: nothing
in a file can run code. Every header entry is checked against the file
(known dtype, whole shape, offsets inside the data and of the right length,
the data filled exactly) before any data is read, and a file that breaks a
rule is refused (:class:`TensorFileError`, a
:class:`~fullshard.checkpoint.untrusted.CheckpointError`) with the entry it broke
it in. The header is canonical JSON, so no byte of it can change unnoticed.

numpy has no bfloat16: such tensors go in and come out as ``uint16`` arrays
of their bits, with ``dtype="bfloat16"`` named alongside (see :class:`Array`).
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Optional, Union

import numpy as np

from fullshard.checkpoint.files import open_regular
from fullshard.checkpoint.manifest import dumps_canonical, loads_canonical
from fullshard.checkpoint.untrusted import CheckpointError, check_shape, is_int, show

# safetensors' dtype codes, by the names fullshard's planning code uses.
CODES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
}
NAMES = {code: name for name, code in CODES.items()}
# The numpy dtype that holds each one's bytes (bfloat16: its bits).
HOLDERS = {
    "float64": np.float64, "float32": np.float32, "float16": np.float16, "bfloat16": np.uint16,
    "int64": np.int64, "int32": np.int32, "int16": np.int16, "int8": np.int8, "uint8": np.uint8, "bool": np.bool_,
}
_MAX_HEADER = 100 << 20


class TensorFileError(CheckpointError):
    """A file that is not a well-formed safetensors file as fullshard writes it (named, with what is wrong)."""


@dataclass(frozen=True)
class Array:
    """A tensor as numpy holds it: ``data`` in :data:`HOLDERS` ``[dtype]``, ``dtype`` the real dtype's name."""

    data: np.ndarray
    dtype: str

    @classmethod
    def of(cls, data: np.ndarray) -> "Array":
        name = np.dtype(data.dtype).name
        if name not in CODES:
            raise TypeError(f"no safetensors dtype for numpy {data.dtype}")
        return cls(data, name)


def save_file(tensors: dict[str, Array], path: Union[str, Path], metadata: Optional[dict[str, str]] = None) -> None:
    """Write ``tensors`` to ``path`` (fsynced), in name order."""
    header: dict = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blobs, offset = [], 0
    for name in sorted(tensors):
        array = tensors[name]
        data = np.asarray(array.data, dtype=np.dtype(HOLDERS[array.dtype]).newbyteorder("<"))
        blob = data.tobytes(order="C")  # 0-dim arrays keep their shape ()
        header[name] = {"dtype": CODES[array.dtype], "shape": list(data.shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    encoded = dumps_canonical(header)
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as handle:
        handle.write(struct.pack("<Q", len(encoded)))
        handle.write(encoded)
        for blob in blobs:
            handle.write(blob)
        handle.flush()
        os.fsync(handle.fileno())


@dataclass(frozen=True)
class _Entry:
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


class TensorFile:
    """One safetensors file written by fullshard, its header checked; tensors are read one at a time.

    The header must be canonical JSON (:func:`~fullshard.checkpoint.manifest.loads_canonical`)
    padded with at most 7 spaces to 8 bytes, as :func:`save_file` writes it,
    and its tensors' data must fill the rest of the file exactly, in order,
    without gaps or overlaps.
    """

    def __init__(self, path: Union[str, Path], checkpoint: Optional[Union[str, Path]] = None) -> None:
        self.path = Path(path)
        self._checkpoint = checkpoint or self.path.parent
        with open_regular(self.path.parent, self.path.name, self._checkpoint) as handle:
            size = os.fstat(handle.fileno()).st_size
            raw = handle.read(8)
            if len(raw) < 8:
                raise self._error(f"is too short for a safetensors file ({size} bytes)")
            (length,) = struct.unpack("<Q", raw)
            if length > min(_MAX_HEADER, size - 8) or length % 8:
                raise self._error(f"announces a header of {length} bytes, which does not fit the file ({size} bytes)")
            encoded = handle.read(length)
        text = encoded.rstrip(b" ")
        if len(encoded) != length or len(encoded) - len(text) != -len(text) % 8:
            raise self._error("has a header that is not padded as fullshard pads it")
        header = loads_canonical(text, self._checkpoint, self.path.name)
        if not isinstance(header, dict):
            raise self._error("has a header that is not a JSON object")
        self._data_start = 8 + length
        metadata = header.pop("__metadata__", {})
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise self._error("has a __metadata__ that does not map strings to strings")
        self.metadata: dict[str, str] = metadata
        data_size = size - self._data_start
        self._entries = {name: self._check(name, entry, data_size) for name, entry in header.items()}
        self._check_filled(data_size)

    def _error(self, problem: str) -> TensorFileError:
        return TensorFileError.at(self._checkpoint, problem, self.path.name)

    def _check(self, name: str, entry: object, data_size: int) -> _Entry:
        where = f"tensor {show(name)}"
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise self._error(f"{where}: its entry must hold exactly dtype, shape and data_offsets, not {show(entry)}")
        code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(code, str) or code not in NAMES:
            raise self._error(f"{where}: unknown dtype {show(code)}")
        shape = check_shape(shape, self._checkpoint, f"{self.path.name}: {where}")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(is_int(o) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data_size):
            raise self._error(f"{where}: data_offsets {show(offsets)} are not inside the data ({data_size} bytes)")
        dtype = NAMES[code]
        expected = prod(shape) * np.dtype(HOLDERS[dtype]).itemsize
        if offsets[1] - offsets[0] != expected:
            raise self._error(f"{where}: {offsets[1] - offsets[0]} bytes of data for shape {list(shape)} {dtype} "
                              f"({expected} expected)")
        return _Entry(dtype, shape, offsets[0], offsets[1])

    def _check_filled(self, data_size: int) -> None:
        """The tensors' data lie one after the other and fill the data exactly (as the format requires)."""
        end = 0
        for name, entry in sorted(self._entries.items(), key=lambda item: (item[1].begin, item[1].end)):
            if entry.begin != end:
                raise self._error(f"tensor {show(name)} starts at byte {entry.begin} of the data, not at {end} "
                                  "(a gap or an overlap)")
            end = entry.end
        if end != data_size:
            raise self._error(f"its tensors hold {end} bytes of data, the file has {data_size}")

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def dtype(self, name: str) -> str:
        return self._entries[name].dtype

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name].shape

    def read(self, name: str) -> Array:
        entry = self._entries[name]
        with open_regular(self.path.parent, self.path.name, self._checkpoint) as handle:
            handle.seek(self._data_start + entry.begin)
            raw = handle.read(entry.end - entry.begin)
        if len(raw) != entry.end - entry.begin:
            raise self._error(f"tensor {show(name)} is cut short")
        holder = np.dtype(HOLDERS[entry.dtype]).newbyteorder("<")
        data = np.frombuffer(raw, dtype=holder).reshape(entry.shape).astype(HOLDERS[entry.dtype], copy=False)
        return Array(data.copy() if not data.flags.writeable else data, entry.dtype)
