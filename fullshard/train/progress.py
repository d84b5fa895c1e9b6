"""One progress line on rank 0: a redrawn bar on a terminal, plain periodic lines in a log."""
from __future__ import annotations

import sys
import time


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.0f} MiB"


class Progress:
    def __init__(self, total: int, start: int = 0, enabled: bool = True, stream=None) -> None:
        self.total, self.start, self.enabled = total, start, enabled
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty()
        self.every = max(1, (total - start) // 20)  # about 20 lines when not a terminal
        self.began = time.monotonic()

    def update(self, step: int, loss: float, tokens_per_s: float, peak_bytes: int) -> None:
        if not self.enabled:
            return
        done = step + 1
        text = f"step {done:>5}/{self.total}  loss {loss:7.4f}  {tokens_per_s:8.0f} tok/s  peak {_gib(peak_bytes)}"
        if self.tty:
            width = 24
            filled = int(width * (done - self.start) / max(1, self.total - self.start))
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {text}")
        elif done == self.total or (done - self.start) % self.every == 0 or done == self.start + 1:
            self.stream.write(f"{text}  ({time.monotonic() - self.began:.0f}s)\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()
