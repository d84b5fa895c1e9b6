"""One ``.safetensors`` file: written by fullshard, read through the ``safetensors`` package's own parser.

The MindSpore runtime's checkpoints and every export of one are safetensors
files (:mod:`~fullshard.checkpoint.formats.sharded_safetensors`). Reading
one goes through ``safetensors.safe_open(framework="numpy")`` and
``get_slice``: its header parser is the one the project's threat model
anchors on (the one Hugging Face and MindSpore load models with, fuzzed
upstream), and it reads only the slice a rank needs. Nothing in a file can
run code. What it checks before any data is read (safetensors 0.8): the
header's length (at most 100 MB, inside the file), that the header is UTF-8
JSON of the format's shape (each entry a known dtype, a shape and two
offsets, ``__metadata__`` strings to strings), that each entry's bytes are
its shape times its dtype's size (without overflow), and that the entries'
data lie one after the other from byte 0, without gaps or overlaps, filling
the file exactly. Its refusal (``SafetensorError``) is a
:class:`TensorFileError` here, a
:class:`~fullshard.checkpoint.untrusted.CheckpointError` naming the file.

What this module adds, because safetensors does not do it:

- the header must be canonical JSON padded with at most 7 spaces, as
  :func:`save_file` writes it (safetensors takes any JSON spelling,
  duplicated keys and unknown fields in an entry), so no byte of it can
  change unnoticed, and each entry must hold exactly dtype, shape and
  data_offsets;
- only the dtypes fullshard writes (:data:`CODES`; safetensors knows 22);
- no symlink: ``safe_open`` takes a path and follows symlinks, so it is
  handed the descriptor opened here without following one (``O_NOFOLLOW``,
  through ``/proc/self/fd``);
- bfloat16: numpy has none, and safetensors' numpy reader raises
  ``TypeError`` for it; such tensors are read as their bits (``uint16``)
  at the offsets safetensors has checked, and go in and come out as
  :class:`Array` ``(bits, "bfloat16")``;
- writing: safetensors' writer orders an entry's keys its own way (not
  canonical JSON) and cannot take bfloat16 from numpy, so :func:`save_file`
  writes the format itself.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from math import prod
from pathlib import Path
from typing import Callable, Optional, Sequence, TypeVar, Union

import numpy as np
from safetensors import SafetensorError, safe_open

from fullshard.checkpoint.files import open_regular
from fullshard.checkpoint.manifest import dumps_canonical, loads_canonical
from fullshard.checkpoint.untrusted import CheckpointError, is_int, show

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
_MAX_HEADER = 100_000_000  # safetensors' own bound
# Where this process's open descriptors can be opened again by path (Linux; macOS and the BSDs).
_DESCRIPTORS = ("/proc/self/fd", "/dev/fd")
Region = Sequence[tuple[int, int]]  # per dim, [start, stop)
T = TypeVar("T")


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
    """Write ``tensors`` to ``path`` (fsynced), in name order, the header canonical JSON padded to 8 bytes."""
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
    begin: int  # the data offsets safetensors checked, from the data's start
    end: int


class TensorFile:
    """One safetensors file written by fullshard, its header checked by safetensors and here; tensors (or
    slices of them) are read one at a time through safetensors, from the file as it was opened and
    checked (bfloat16 ones from the file itself)."""

    def __init__(self, path: Union[str, Path], checkpoint: Optional[Union[str, Path]] = None) -> None:
        self.path = Path(path)
        self._checkpoint = checkpoint or self.path.parent
        with open_regular(self.path.parent, self.path.name, self._checkpoint) as handle:
            self._reader = self._parsed(lambda: safe_open(_reopenable(handle.fileno(), self.path), framework="numpy"))
            header, self._data_start = self._header(handle)
        self.metadata: dict[str, str] = self._reader.metadata() or {}
        self._entries = {name: self._entry(name, header) for name in self._reader.keys()}

    def _error(self, problem: str) -> TensorFileError:
        return TensorFileError.at(self._checkpoint, problem, self.path.name)

    def _parsed(self, call: Callable[[], T]) -> T:
        """``call()``, a call into safetensors; its refusal named as this file's."""
        try:
            return call()
        except (SafetensorError, OSError, ValueError, TypeError) as error:
            problem = (str(error).splitlines() or [type(error).__name__])[0][:300]
            raise self._error(f"is refused by the safetensors parser: {problem}") from None

    def _header(self, handle) -> tuple[dict, int]:
        """The header as canonical JSON padded to 8 bytes (read here: safetensors takes any JSON spelling)."""
        raw = handle.read(8)
        (length,) = struct.unpack("<Q", raw) if len(raw) == 8 else (-1,)
        encoded = handle.read(min(max(length, 0), _MAX_HEADER))
        if len(encoded) != length:  # the file changed after safetensors had checked it
            raise self._error("changed while it was read")
        text = encoded.rstrip(b" ")
        if len(encoded) - len(text) != -len(text) % 8:
            raise self._error("has a header that is not padded as fullshard pads it")
        header = loads_canonical(text, self._checkpoint, self.path.name)
        if not isinstance(header, dict):  # what safetensors read was one (the file changed since)
            raise self._error("changed while it was read")
        return header, 8 + length

    def _entry(self, name: str, header: dict) -> _Entry:
        """What safetensors took from the header, and what it does not check: exact keys, fullshard's dtypes."""
        where = f"tensor {show(name)}"
        entry = header.get(name)
        if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
            raise self._error(f"{where}: its entry must hold exactly dtype, shape and data_offsets, not {show(entry)}")
        found = self._parsed(lambda: self._reader.get_slice(name))
        code, shape = found.get_dtype(), tuple(found.get_shape())
        if code not in NAMES:
            raise self._error(f"{where}: dtype {show(code)} is not one fullshard writes ({', '.join(CODES.values())})")
        offsets = entry["data_offsets"]
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(is_int(o) for o in offsets)):
            raise self._error("changed while it was read")  # safetensors had read two offsets there
        return _Entry(NAMES[code], shape, offsets[0], offsets[1])

    def names(self) -> list[str]:
        return sorted(self._entries)

    def __contains__(self, name: str) -> bool:
        return name in self._entries

    def dtype(self, name: str) -> str:
        return self._entries[name].dtype

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name].shape

    def read(self, name: str, region: Optional[Region] = None) -> Array:
        """Tensor ``name``, or its ``region`` (per dim ``[start, stop)``, inside its shape)."""
        entry = self._entries[name]
        region = [(0, n) for n in entry.shape] if region is None else list(region)
        shape = tuple(stop - start for start, stop in region)
        if not prod(shape):  # nothing to read (and safetensors cannot slice an empty tensor)
            return Array(np.zeros(shape, HOLDERS[entry.dtype]), entry.dtype)
        index = tuple(slice(start, stop) for start, stop in region)
        if entry.dtype == "bfloat16":
            data = self._bits(name, entry)
            data = data if shape == entry.shape else data[index]
        elif shape == entry.shape:
            data = self._parsed(lambda: self._reader.get_tensor(name))
        else:
            data = self._parsed(lambda: self._reader.get_slice(name)[index])
        if not (data.flags.c_contiguous and data.flags.writeable):
            data = np.array(data, order="C")  # a 0-dim one stays 0-dim
        return Array(data, entry.dtype)

    def _bits(self, name: str, entry: _Entry) -> np.ndarray:
        """A bfloat16 tensor's bits: safetensors' numpy reader has no bfloat16 (numpy has none)."""
        with open_regular(self.path.parent, self.path.name, self._checkpoint) as handle:
            raw = os.pread(handle.fileno(), entry.end - entry.begin, self._data_start + entry.begin)
        if len(raw) != entry.end - entry.begin:
            raise self._error(f"tensor {show(name)} is cut short")
        return np.frombuffer(raw, dtype=np.dtype(np.uint16).newbyteorder("<")).astype(np.uint16).reshape(entry.shape)


def _reopenable(fd: int, path: Path) -> str:
    """A path that opens the file behind ``fd`` again, even if a symlink replaced ``path`` since (else ``path``)."""
    for folder in _DESCRIPTORS:
        if os.path.isdir(folder):
            return f"{folder}/{fd}"
    return str(path)
