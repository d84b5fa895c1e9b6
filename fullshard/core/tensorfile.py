"""Reading and writing ``.safetensors`` files with numpy alone, bfloat16 included.

The format: 8 bytes (little-endian length of the header), a JSON header
``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {str: str}}``
and the raw little-endian data. Reading parses JSON and copies bytes: nothing
in a file can run code. Every header entry is checked against the file
(known dtype, whole shape, offsets inside the data and of the right length)
before any data is read, and a file that breaks a rule is refused with the
entry it broke it in.

numpy has no bfloat16: such tensors go in and come out as ``uint16`` arrays
of their bits, with ``dtype="bfloat16"`` named alongside (see :class:`Array`).
"""
from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Optional, Union

import numpy as np

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


class TensorFileError(ValueError):
    """A file that is not a well-formed safetensors file (named, with what is wrong)."""


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
    encoded = json.dumps(header, separators=(",", ":")).encode()
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
    """One safetensors file, its header checked; tensors are read one at a time."""

    def __init__(self, path: Union[str, Path]) -> None:
        self.path = Path(path)
        size = self.path.stat().st_size
        with open(self.path, "rb") as handle:
            raw = handle.read(8)
            if len(raw) < 8:
                raise TensorFileError(f"{self.path}: too short for a safetensors file ({size} bytes)")
            (length,) = struct.unpack("<Q", raw)
            if length > min(_MAX_HEADER, size - 8):
                raise TensorFileError(f"{self.path}: header length {length} does not fit the file ({size} bytes)")
            try:
                header = json.loads(handle.read(length))
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                raise TensorFileError(f"{self.path}: the header is not JSON ({error})") from None
        if not isinstance(header, dict):
            raise TensorFileError(f"{self.path}: the header is not a JSON object")
        self._data_start = 8 + length
        data_size = size - self._data_start
        metadata = header.pop("__metadata__", {}) or {}
        if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
            raise TensorFileError(f"{self.path}: __metadata__ must map strings to strings")
        self.metadata: dict[str, str] = metadata
        self._entries: dict[str, _Entry] = {}
        for name, entry in header.items():
            self._entries[name] = self._check(name, entry, data_size)

    def _check(self, name: str, entry: object, data_size: int) -> _Entry:
        where = f"{self.path}: tensor '{name}'"
        if not isinstance(entry, dict):
            raise TensorFileError(f"{where}: its entry is not an object")
        code, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if code not in NAMES:
            raise TensorFileError(f"{where}: unknown dtype {code!r}")
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise TensorFileError(f"{where}: shape {shape!r} is not a list of sizes")
        if (not isinstance(offsets, list) or len(offsets) != 2 or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= data_size):
            raise TensorFileError(f"{where}: data_offsets {offsets!r} are not inside the data ({data_size} bytes)")
        dtype = NAMES[code]
        expected = prod(shape) * np.dtype(HOLDERS[dtype]).itemsize
        if offsets[1] - offsets[0] != expected:
            raise TensorFileError(f"{where}: {offsets[1] - offsets[0]} bytes of data for shape {shape} {dtype} "
                                  f"({expected} expected)")
        return _Entry(dtype, tuple(shape), offsets[0], offsets[1])

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
        with open(self.path, "rb") as handle:
            handle.seek(self._data_start + entry.begin)
            raw = handle.read(entry.end - entry.begin)
        if len(raw) != entry.end - entry.begin:
            raise TensorFileError(f"{self.path}: tensor '{name}' is cut short")
        holder = np.dtype(HOLDERS[entry.dtype]).newbyteorder("<")
        data = np.frombuffer(raw, dtype=holder).reshape(entry.shape).astype(HOLDERS[entry.dtype], copy=False)
        return Array(data.copy() if not data.flags.writeable else data, entry.dtype)
