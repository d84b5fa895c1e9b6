"""Byte-level text data that needs no download.

By default the corpus is the Python standard library's own source files on
this machine (read as bytes, vocabulary 256); ``--data`` takes the user's own
files or folders. Batches are a pure function of (seed, step), drawn with
numpy's generator, so every rank, the single-process reference of
``--verify``, a resumed run and both frameworks draw exactly the same global
batches (int64 arrays; each worker hands them to its framework).
"""
from __future__ import annotations

import sysconfig
from pathlib import Path
from typing import Iterable, Optional

import numpy as np

DEFAULT_MAX_BYTES = 8 << 20
_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"}


def stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.rglob("*.py") if not _SKIP_DIRS.intersection(p.relative_to(root).parts))


def expand_paths(paths: Iterable[str]) -> list[Path]:
    """Files named directly, and every regular file under the folders named."""
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise FileNotFoundError(f"--data: {raw} does not exist")
        if path.is_dir():
            files.extend(sorted(p for p in path.rglob("*") if p.is_file()))
        else:
            files.append(path)
    if not files:
        raise FileNotFoundError(f"--data: no files found under {', '.join(map(str, paths))}")
    return files


class ByteCorpus:
    def __init__(self, files: list[Path], max_bytes: int = DEFAULT_MAX_BYTES, val_fraction: float = 0.05) -> None:
        chunks, total = [], 0
        for path in files:
            data = path.read_bytes()[: max_bytes - total]
            chunks.append(data)
            total += len(data)
            if total >= max_bytes:
                break
        raw = b"\n".join(chunks)
        tokens = np.frombuffer(raw, dtype=np.uint8)
        split = int(len(tokens) * (1 - val_fraction))
        self.train, self.val = tokens[:split], tokens[split:]
        self.files = len(chunks)

    @classmethod
    def load(cls, paths: Optional[list[str]], max_bytes: int = DEFAULT_MAX_BYTES) -> "ByteCorpus":
        return cls(expand_paths(paths) if paths else stdlib_files(), max_bytes)

    def batch(self, split: str, seed: int, step: int, batch_size: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
        """A global batch of (tokens, next tokens), int64 of shape (batch_size, seq_len), the same everywhere."""
        data = self.train if split == "train" else self.val
        if len(data) <= seq_len + 1:
            raise ValueError(f"the {split} split has {len(data)} bytes, fewer than seq_len+1={seq_len + 1}")
        rng = np.random.default_rng(seed * 1_000_003 + step * 2 + (split != "train"))
        starts = rng.integers(0, len(data) - seq_len - 1, size=batch_size)
        windows = np.stack([data[s : s + seq_len + 1] for s in starts.tolist()]).astype(np.int64)
        return np.ascontiguousarray(windows[:, :-1]), np.ascontiguousarray(windows[:, 1:])
