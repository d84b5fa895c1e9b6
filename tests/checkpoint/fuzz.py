"""Mutations of a small valid checkpoint, and what every load of one must do (framework-free).

Used by ``tests/checkpoint/test_fuzz_torch.py`` (torch DCP) and
``tests/checkpoint/test_fuzz_mindspore.py`` (MindSpore). A mutation damages
(``crafted=False``: the manifest stays as saved, so its digests must catch
it) or crafts (``crafted=True``: the manifest is rewritten to match, so the
field checks must catch it) one copy of the checkpoint. Each one then goes
through every leg (load into a model and optimizer, the train job's resume,
export; library and CLI), and each leg must

- end in a ``CheckpointError`` (the CLI: one ``error:`` line) whose message
  names the checkpoint,
- leave the model and optimizer bitwise as they were (compared once all
  legs of a mutation ran),
- open no file outside the directory holding the checkpoint (an audit hook
  on ``open`` records every path), and
- stay under a bound of traced memory (``tracemalloc``'s peak; and over the
  whole run the process's peak RSS may grow by at most RSS_LIMIT, which
  covers the frameworks' own allocations that tracemalloc does not see).

The mutations come from a fixed seed; ``FULLSHARD_FUZZ_SCALE=k`` draws k
times as many (CI runs scale 1).
"""
from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import json
import os
import random
import resource
import shutil
import sys
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from fullshard.checkpoint import manifest
from fullshard.checkpoint.manifest import dumps_canonical

SEED = 20
SCALE = max(1, int(os.environ.get("FULLSHARD_FUZZ_SCALE", "1")))
MEMORY_LIMIT = 32 << 20  # traced bytes one leg may peak at (the checkpoint itself is ~100 KiB)
RSS_LIMIT = 256 << 20  # growth of the process's peak RSS over the whole run (framework allocations are untraced)
STEP = "step_1"

# Values of the wrong type, and numbers out of any range, for JSON fields.
WRONG_TYPES = [None, True, "x", 1.5, [], {}]
BAD_NUMBERS = [-1, -(10**12), 10**12, 2**63, 10**30]


@dataclass(frozen=True)
class Mutation:
    kind: str  # what is done: "flipped byte", "wrong type", ...
    target: str  # to what: a file, a field
    apply: Callable[[Path], None]  # changes the checkpoint directory in place
    crafted: bool = False  # rewrite the manifest to match (a crafted checkpoint, not a damaged one)
    needs_manifest: bool = False  # only the manifest makes it invalid (not run without one)
    field: str = ""  # the field it changes, the same for every entry (groups mutations for select)

    @property
    def group(self) -> str:
        return f"{self.kind}: {self.field or self.target.split('[')[0]}"


# ---------------------------------------------------------------------- damaging files
def file_mutations(directory: Path, bait: Path, rng: random.Random, flips: int) -> list[Mutation]:
    """Deleted, truncated, extended, flipped, swapped for symlinks or directories: every file of ``directory``."""
    found = []
    for name in sorted(os.listdir(directory)):
        size = (directory / name).stat().st_size
        found.append(Mutation("deleted file", name, lambda d, n=name: (d / n).unlink()))
        for cut in sorted({0, 1, 7, size // 2, size - 1} - {size}):
            if 0 <= cut < size:
                found.append(Mutation("truncated file", f"{name}[{cut}]", lambda d, n=name, c=cut: _truncate(d / n, c)))
        found.append(Mutation("extended file", name, lambda d, n=name: _append(d / n, b"\0")))
        found.append(Mutation("extended file", f"{name}[4096]", lambda d, n=name: _append(d / n, os.urandom(4096))))
        for position in sorted({0, size - 1, *(rng.randrange(size) for _ in range(flips))}):
            bit = rng.randrange(8)
            found.append(Mutation("flipped byte", f"{name}[{position}]",
                                  lambda d, n=name, p=position, b=bit: _flip(d / n, p, b)))
        copy = bait / name
        shutil.copyfile(directory / name, copy)  # identical bytes outside: only the symlink policy refuses it
        found.append(Mutation("symlink", f"{name} -> identical copy outside", lambda d, n=name, c=copy: _link(d / n, c)))
        others = [o for o in sorted(os.listdir(directory)) if o != name]
        if others:
            found.append(Mutation("symlink", f"{name} -> {others[0]}",
                                  lambda d, n=name, o=others[0]: _link(d / n, d / o)))
        found.append(Mutation("replaced by a directory", name, lambda d, n=name: _to_directory(d / n)))
        found.append(Mutation("renamed file", name, lambda d, n=name: (d / n).rename(d / (n + ".bak"))))
    found += [
        Mutation("extra file", "junk.bin", lambda d: (d / "junk.bin").write_bytes(b"junk")),
        Mutation("extra file", "sub/", lambda d: (d / "sub").mkdir()),
        Mutation("symlink", "extra link to outside", lambda d: (d / "link").symlink_to(bait)),
        Mutation("deleted file", "every file", lambda d: [p.unlink() for p in d.iterdir()]),
    ]
    return found


def _truncate(path: Path, size: int) -> None:
    with open(path, "r+b") as handle:
        handle.truncate(size)


def _append(path: Path, data: bytes) -> None:
    with open(path, "ab") as handle:
        handle.write(data)


def _flip(path: Path, position: int, bit: int) -> None:
    data = bytearray(path.read_bytes())
    data[position] ^= 1 << bit
    path.write_bytes(bytes(data))


def _link(path: Path, target: Path) -> None:
    path.unlink()
    path.symlink_to(target)


def _to_directory(path: Path) -> None:
    path.unlink()
    path.mkdir()


def craft_manifest(directory: Path, framework: str) -> None:
    """A manifest for the directory as it now is (following symlinks): what a crafted checkpoint carries."""
    old = json.loads((directory / manifest.MANIFEST_FILE).read_bytes()) if (
        directory / manifest.MANIFEST_FILE).is_file() else {"save_id": "crafted"}
    files = {}
    for name in sorted(os.listdir(directory)):
        path = directory / name
        if name != manifest.MANIFEST_FILE and path.is_file():
            data = path.read_bytes()
            files[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    body = {"files": files, "format": manifest.FORMAT, "framework": framework,
            "save_id": old.get("save_id", "crafted"), "version": manifest.VERSION}
    body["digest"] = hashlib.sha256(dumps_canonical(body)).hexdigest()
    (directory / manifest.MANIFEST_FILE).write_bytes(dumps_canonical(body))


# ---------------------------------------------------------------------- crafting JSON documents
@dataclass(frozen=True)
class JsonSite:
    """A JSON document inside a checkpoint: how to read it and write it back (canonically)."""

    label: str
    read: Callable[[Path], Any]
    write: Callable[[Path, Any], None]


def json_mutations(site: JsonSite, document: Any, fixed: Iterable[tuple] = (), crafted: bool = True) -> list[Mutation]:
    """Each field of ``document`` with a wrong type, a huge or negative number; each object missing each key
    and with an extra one; each list one shorter and one longer.

    ``fixed``: paths left alone (a self-digest the site's writer recomputes). ``crafted``: the manifest is
    rewritten after the change (False for the manifest itself, whose writer keeps it consistent).
    """
    found = []
    fixed = set(fixed)  # paths whose change the writer undoes (a self-digest it recomputes)
    for path, value in _walk(document):
        if path in fixed:
            continue
        where, name = f"{site.label}{_show_path(path)}", _field(site, path)
        for other in WRONG_TYPES:
            if type(other) is not type(value):
                found.append(_set(site, "wrong type", where, path, other, crafted, name))
        if type(value) is int:
            for number in BAD_NUMBERS:
                if number != value:
                    found.append(_set(site, "huge or negative number", where, path, number, crafted, name))
        if isinstance(value, dict):
            for key in sorted(value):
                found.append(_edit(site, "missing key", f"{where}.{key}", path, lambda v, k=key: v.pop(k), crafted,
                                   f"{name}.{key if key in FIELD_NAMES else '<name>'}"))
            found.append(_edit(site, "extra key", f"{where}.extra", path, lambda v: v.__setitem__("extra", 0), crafted,
                               name))
        if isinstance(value, list) and value:
            found.append(_edit(site, "missing list item", where, path, lambda v: v.pop(), crafted, name))
            found.append(_edit(site, "extra list item", where, path, lambda v: v.append(v[-1]), crafted, name))
    return found


# Keys that name a field of a format; any other key names an entry or a file (the same field for each).
FIELD_NAMES = {"format", "version", "framework", "world_size", "save_id", "files", "entries", "dim", "dtype",
               "shape", "bytes", "sha256", "digest", "data_offsets", "__metadata__", "slices"}


def _field(site: JsonSite, path: tuple) -> str:
    keys = [k if k in FIELD_NAMES else "<name>" for k in path if isinstance(k, str)]
    return ".".join([site.label, *keys])


def _walk(value: Any, path: tuple = ()):
    yield path, value
    if isinstance(value, dict):
        for key in sorted(value):
            yield from _walk(value[key], path + (key,))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _walk(item, path + (index,))


def _show_path(path: tuple) -> str:
    return "".join(f"[{k}]" if isinstance(k, int) else f".{k}" for k in path)


def _set(site: JsonSite, kind: str, where: str, path: tuple, value: Any, crafted: bool, name: str) -> Mutation:
    def apply(directory: Path) -> None:
        document = site.read(directory)
        if not path:
            document = value
        else:
            _container(document, path)[path[-1]] = value
        site.write(directory, document)

    return Mutation(kind, where, apply, crafted=crafted, field=name)


def _edit(site: JsonSite, kind: str, where: str, path: tuple, change: Callable[[Any], None],
          crafted: bool, name: str) -> Mutation:
    def apply(directory: Path) -> None:
        document = site.read(directory)
        change(_container(document, path + (None,)))  # the value at path itself
        site.write(directory, document)

    return Mutation(kind, where, apply, crafted=crafted, field=name)


def _container(document: Any, path: tuple) -> Any:
    for key in path[:-1]:
        document = document[key]
    return document


def select(mutations: list[Mutation], budget: int, rng: random.Random) -> list[Mutation]:
    """One mutation of every group (kind and field), then more taken in turn from each kind up to ``budget``,
    so that no kind crowds out the others (there are far more fields to mistype than files to cut)."""
    by_group = collections.defaultdict(list)
    for mutation in mutations:
        by_group[mutation.group].append(mutation)
    chosen = [rng.choice(group) for _, group in sorted(by_group.items())]
    taken = set(map(id, chosen))
    by_kind = collections.defaultdict(list)
    for mutation in mutations:
        if id(mutation) not in taken:
            by_kind[mutation.kind].append(mutation)
    for group in by_kind.values():
        rng.shuffle(group)
    while len(chosen) < budget and any(by_kind.values()):
        for kind in sorted(by_kind):
            if by_kind[kind] and len(chosen) < budget:
                chosen.append(by_kind[kind].pop())
    return chosen


# ---------------------------------------------------------------------- watching a leg
_WATCH: list = []  # [root, paths opened outside it] while a leg runs


def _audit(event: str, args: tuple) -> None:
    if event != "open" or not _WATCH:
        return
    path = args[0]
    if path is None or isinstance(path, int):
        return
    real = os.path.realpath(os.fsdecode(path))
    if not (real == _WATCH[0] or real.startswith(_WATCH[0] + os.sep)):
        _WATCH[1].append(real)


sys.addaudithook(_audit)  # for the life of the process; idle unless a leg is watched


@contextlib.contextmanager
def watched(root: Path):
    """Record every file opened outside ``root``, and the peak of traced memory, while the block runs."""
    outside: list[str] = []
    _WATCH[:] = [os.path.realpath(root), outside]
    tracemalloc.start()
    result = {"outside": outside}
    try:
        yield result
    finally:
        result["peak"] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        _WATCH.clear()


@dataclass
class Report:
    """What the fuzz did: mutations by kind, and which check refused each leg."""

    by_kind: collections.Counter = field(default_factory=collections.Counter)
    refused_by: collections.Counter = field(default_factory=collections.Counter)
    legs: collections.Counter = field(default_factory=collections.Counter)
    max_peak: int = 0
    rss_growth: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict:
        return {"mutations": sum(self.by_kind.values()), "by_kind": dict(sorted(self.by_kind.items())),
                "refused_by": dict(sorted(self.refused_by.items())), "legs": dict(sorted(self.legs.items())),
                "max_traced_peak_bytes": self.max_peak, "peak_rss_growth_bytes": self.rss_growth,
                "seconds": round(self.seconds, 1), "scale": SCALE}


def refused_by(message: str) -> str:
    """Which check a refusal came from, by its message (the first rule that matches)."""
    rules = [("manifest: listing, sizes, digests", ("manifest", "SHA-256")),
             ("symlink policy", ("symlink",)),
             ("plain file names", ("not a plain file name",)),
             ("canonical JSON", ("canonical JSON", "not valid JSON")),
             ("the safetensors parser", ("safetensors parser",)),
             ("pickle scan and restricted unpickler", ("its pickle", "unpickled")),
             ("missing files", ("is missing", "not a regular file", "does not exist")),
             ("chunks tile, byte ranges fill", ("chunk", "overlap", "not inside", "gap", "is stored", "elements",
                                                "data_offsets", "bytes of data", "starts at byte")),
             ("model mismatch", ("does not match the",))]
    for name, needles in rules:
        if any(needle in message for needle in needles):
            return name
    return "types, keys and cross-checks of fields"


Leg = Callable[[Path], Optional[str]]  # the checkpoint root -> the refusal's message (None: it loaded)


def run(mutations: list[Mutation], pristine: Path, work: Path, legs: dict[str, Leg], snapshot: Callable[[], bytes],
        framework: str, unverified_legs: Optional[dict[str, Leg]] = None) -> Report:
    """Apply each mutation to a fresh copy of ``pristine`` (a root holding ``step_1``) and check every leg.

    ``unverified_legs`` also run each crafted mutation with the manifest deleted (a stock checkpoint).
    """
    report, began, rss = Report(), time.monotonic(), _peak_rss()
    before = snapshot()
    for mutation in mutations:
        report.by_kind[mutation.kind] += 1
        _prepare(mutation, pristine, work, framework, keep_manifest=True)
        for name, leg in legs.items():
            _check_leg(mutation, name, leg, work, report)
        if unverified_legs and mutation.crafted and not mutation.needs_manifest:
            _prepare(mutation, pristine, work, framework, keep_manifest=False)
            for name, leg in unverified_legs.items():
                _check_leg(mutation, name, leg, work, report)
        # once per mutation (every leg failed, so none may have written anything): the costliest check
        assert snapshot() == before, f"{mutation.kind} of {mutation.target}: the model or optimizer changed"
    report.seconds = time.monotonic() - began
    report.rss_growth = _peak_rss() - rss
    assert report.rss_growth < RSS_LIMIT, f"the process's peak RSS grew by {report.rss_growth} bytes"
    return report


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _prepare(mutation: Mutation, pristine: Path, work: Path, framework: str, keep_manifest: bool) -> None:
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(pristine, work, symlinks=True)
    directory = work / STEP
    mutation.apply(directory)
    if mutation.crafted and directory.is_dir():
        craft_manifest(directory, framework)
    if not keep_manifest:
        (directory / manifest.MANIFEST_FILE).unlink(missing_ok=True)


def _check_leg(mutation, name, leg, work, report) -> None:
    where = f"{mutation.kind} of {mutation.target} (crafted={mutation.crafted}), leg {name}"
    with watched(work) as seen:
        message = leg(work)
    assert message, f"{where}: the checkpoint was accepted"
    assert str(work) in message, f"{where}: the message does not name the checkpoint: {message}"
    assert not seen["outside"], f"{where}: opened {seen['outside']} outside the checkpoint"
    assert seen["peak"] < MEMORY_LIMIT, f"{where}: traced memory peaked at {seen['peak']} bytes"
    report.legs[name] += 1
    report.refused_by[refused_by(message)] += 1
    report.max_peak = max(report.max_peak, seen["peak"])


def cli_line(main: Callable[[list[str]], int], argv: list[str]) -> str:
    """Run the CLI in this process; it must fail with exit status 2 and exactly one ``error:`` line."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(argv)
    lines = err.getvalue().splitlines()
    assert code == 2 and len(lines) == 1 and ": error: " in lines[0], (code, err.getvalue())
    return lines[0]


def write_report(report: Report, name: str, **extra) -> None:
    """Print the counts; with ``FULLSHARD_FUZZ_REPORT=DIR`` also write them as ``DIR/<name>.json``."""
    counts = {**report.as_dict(), **extra}
    print(json.dumps({name: counts}, indent=1))
    folder = os.environ.get("FULLSHARD_FUZZ_REPORT")
    if folder:
        Path(folder).mkdir(parents=True, exist_ok=True)
        (Path(folder) / f"{name}.json").write_text(json.dumps(counts, indent=1))
