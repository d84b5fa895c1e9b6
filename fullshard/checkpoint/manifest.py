"""The manifest: what a complete fullshard checkpoint holds, byte for byte, on either runtime.

Every fullshard save writes ``fullshard.manifest.json`` into its ``.partial``
directory once every rank's files are complete, and only then publishes the
directory, so the manifest is also the completion marker. It names the
framework, the save's id, and the size and SHA-256 of every other file of
the directory, and ends with the SHA-256 of its own canonical JSON. A load
verifies it before it parses or unpickles anything else: the directory holds
exactly the listed files, each a regular file of the listed size and digest.
A flipped byte, a truncated, deleted, added or swapped-in file then is a
:class:`~fullshard.checkpoint.untrusted.CheckpointError`, never different weights.

The manifest, like every JSON document fullshard writes into a checkpoint
(MindSpore's ``fullshard.json``, each safetensors header and its slices), is
in canonical form (:func:`dumps_canonical`: sorted keys, no spaces, ASCII),
and a reader refuses one whose bytes are not exactly the canonical form of
what they parse to (:func:`loads_canonical`). So no byte of such a file can
change without being noticed: not a space, not a duplicated key, not ``1.0``
written as ``1e0``. The manifest's own digest covers that form.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Union

from fullshard.checkpoint.files import (fsync_dir, open_regular, plain_file_name, read_whole, regular_file,
                                        write_file_durably)
from fullshard.checkpoint.untrusted import CheckpointError, is_int, show

MANIFEST_FILE = "fullshard.manifest.json"
FORMAT = "fullshard-checkpoint-manifest"
VERSION = 1
FRAMEWORKS = ("mindspore", "torch")
_KEYS = {"digest", "files", "format", "framework", "save_id", "version"}
_MAX_FILES = 1 << 16
_MAX_MANIFEST_BYTES = 64 << 20
_MAX_FILE_BYTES = 1 << 60
_SHA256 = re.compile(r"[0-9a-f]{64}")
_SAVE_ID = re.compile(r"[0-9A-Za-z_-]{1,128}")
_BLOCK = 1 << 20


# ---------------------------------------------------------------------- canonical JSON
def dumps_canonical(document: Any) -> bytes:
    """The canonical bytes of ``document`` (plain JSON data: no NaN or infinity)."""
    return json.dumps(document, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("ascii")


def loads_canonical(data: bytes, checkpoint: Union[str, Path], file: str) -> Any:
    """The document ``data`` holds; CheckpointError unless ``data`` is valid JSON in canonical form."""
    try:
        document = json.loads(data.decode("ascii"))
    except (UnicodeDecodeError, ValueError, RecursionError) as error:
        raise CheckpointError.at(checkpoint, f"is not valid JSON ({_first_line(error)})", file) from None
    try:
        canonical = dumps_canonical(document)
    except (ValueError, TypeError, RecursionError):
        canonical = None  # NaN, infinity or nesting past what fullshard writes
    if canonical != data:
        raise CheckpointError.at(checkpoint, "is not in the canonical JSON form fullshard writes (sorted keys, no "
                                 "spaces): it was changed or damaged after it was saved", file)
    return document


def _first_line(error: BaseException) -> str:
    return (str(error).splitlines() or [type(error).__name__])[0][:200]


# ---------------------------------------------------------------------- the manifest
@dataclass(frozen=True)
class Manifest:
    framework: str
    save_id: str
    files: dict[str, tuple[int, str]]  # name -> (size in bytes, SHA-256 in hex)


def present(directory: Union[str, Path]) -> bool:
    return os.path.lexists(Path(directory) / MANIFEST_FILE)


def write(directory: Union[str, Path], framework: str, save_id: str) -> Manifest:
    """List every file of ``directory`` (fsynced): the checkpoint there is complete. One rank calls it."""
    directory = Path(directory)
    files = {}
    for name in sorted(e.name for e in os.scandir(directory) if e.name != MANIFEST_FILE):
        size = regular_file(directory, name, directory).st_size
        files[name] = (size, _sha256(directory, name, directory, size))
    body = {"files": {n: {"bytes": s, "sha256": d} for n, (s, d) in files.items()}, "format": FORMAT,
            "framework": framework, "save_id": save_id, "version": VERSION}
    body["digest"] = hashlib.sha256(dumps_canonical(body)).hexdigest()
    write_file_durably(directory / MANIFEST_FILE, dumps_canonical(body))
    fsync_dir(directory)
    return Manifest(framework, save_id, files)


def read(directory: Union[str, Path], checkpoint: Optional[Union[str, Path]] = None) -> Manifest:
    """The manifest of ``directory``, its form and own digest checked (the files are not looked at)."""
    directory = Path(directory)
    checkpoint = checkpoint or directory
    document = loads_canonical(read_whole(directory, MANIFEST_FILE, checkpoint, _MAX_MANIFEST_BYTES),
                                    checkpoint, MANIFEST_FILE)

    def bad(problem: str) -> CheckpointError:
        return CheckpointError.at(checkpoint, problem, MANIFEST_FILE)

    if not isinstance(document, dict) or set(document) != _KEYS:
        keys = sorted(document) if isinstance(document, dict) else type(document).__name__
        raise bad(f"is not a fullshard manifest (keys {show(keys)}, expected {sorted(_KEYS)})")
    body = {k: v for k, v in document.items() if k != "digest"}
    if document["digest"] != hashlib.sha256(dumps_canonical(body)).hexdigest():
        raise bad("does not match its own digest: it was changed or damaged after the save")
    if document["format"] != FORMAT or not is_int(document["version"]) or document["version"] != VERSION:
        raise bad(f"format {show(document['format'])} version {show(document['version'])}; this fullshard reads "
                  f"{FORMAT} version {VERSION}")
    if document["framework"] not in FRAMEWORKS:
        raise bad(f"framework {show(document['framework'])} is not one of {', '.join(FRAMEWORKS)}")
    if not isinstance(document["save_id"], str) or not _SAVE_ID.fullmatch(document["save_id"]):
        raise bad(f"save_id {show(document['save_id'])} is not a save id")
    return Manifest(document["framework"], document["save_id"], _files(document["files"], checkpoint, bad))


def _files(listed, checkpoint, bad) -> dict[str, tuple[int, str]]:
    if not isinstance(listed, dict) or len(listed) > _MAX_FILES:
        raise bad(f"'files' must map at most {_MAX_FILES} file names to sizes and digests, not {show(listed)}")
    files = {}
    for name, entry in listed.items():
        plain_file_name(name, checkpoint, f"{MANIFEST_FILE} lists a file")
        if name == MANIFEST_FILE:
            raise bad("lists itself")
        if not isinstance(entry, dict) or set(entry) != {"bytes", "sha256"}:
            raise bad(f"the entry of {show(name)} must hold exactly 'bytes' and 'sha256', not {show(entry)}")
        size, digest = entry["bytes"], entry["sha256"]
        if not is_int(size) or not 0 <= size <= _MAX_FILE_BYTES:
            raise bad(f"the size of {show(name)} is {show(size)}, not a byte count")
        if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
            raise bad(f"the sha256 of {show(name)} is {show(digest)}, not a SHA-256 in hex")
        files[name] = (size, digest)
    return files


def verify(directory: Union[str, Path], framework: Optional[str] = None,
           checkpoint: Optional[Union[str, Path]] = None) -> Manifest:
    """The manifest of ``directory`` once every file there is exactly the one it lists; else CheckpointError."""
    directory = Path(directory)
    checkpoint = checkpoint or directory
    manifest = read(directory, checkpoint)
    if framework is not None and manifest.framework != framework:
        raise CheckpointError.at(checkpoint, f"is a {manifest.framework} checkpoint, not a {framework} one",
                                 MANIFEST_FILE)
    try:
        present_names = {entry.name for entry in os.scandir(directory)} - {MANIFEST_FILE}
    except OSError as error:
        raise CheckpointError.at(checkpoint, f"cannot be listed ({error.strerror})") from None
    unlisted = sorted(present_names - set(manifest.files))
    if unlisted:
        raise CheckpointError.at(checkpoint, "is not listed in the manifest: the directory was changed after the "
                                 "save (remove the file, or use another checkpoint)", unlisted[0])
    for name, (size, _) in sorted(manifest.files.items()):
        actual = regular_file(directory, name, checkpoint).st_size
        if actual != size:
            raise CheckpointError.at(checkpoint, f"is {actual} bytes, the manifest says {size}: the file was cut "
                                     "short or changed after the save", name)
    for name, (size, digest) in sorted(manifest.files.items()):
        if _sha256(directory, name, checkpoint, size) != digest:
            raise CheckpointError.at(checkpoint, "does not match the SHA-256 in the manifest: its bytes were "
                                     "changed or damaged after the save", name)
    return manifest


def _sha256(directory: Path, name: str, checkpoint: Union[str, Path], size: int) -> str:
    digest = hashlib.sha256()
    read = 0
    with open_regular(directory, name, checkpoint) as handle:
        while read <= size:
            block = handle.read(min(_BLOCK, size + 1 - read))
            if not block:
                break
            digest.update(block)
            read += len(block)
    if read != size:
        raise CheckpointError.at(checkpoint, f"changed size while it was read ({read} bytes, expected {size})", name)
    return digest.hexdigest()
