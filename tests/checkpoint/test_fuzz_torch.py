"""Fuzz: mutations of a small valid torch (DCP) checkpoint, each through load, resume and export (in process).

2 gloo ranks save the checkpoint once (:func:`save_fuzz_checkpoint`); the
test then loads each mutated copy in this process, into the same MLP sharded
on a 1-rank gloo group. Besides damaged files and crafted manifests, every
field of the unpickled DCP metadata is given a wrong type, an out-of-range
number, or is removed or joined by an extra one, and the pickle itself is
crafted (foreign globals, counts past its end). Every mutation must end in
CheckpointError naming the checkpoint, change nothing, open nothing outside,
and stay under the memory bound (``tests/checkpoint/fuzz.py``); crafted ones
run once more without a manifest (``require_manifest=False``), which only
the digests then miss. The counts go to docs/reliability.md.
"""
from __future__ import annotations

import contextlib
import copyreg
import datetime
import io
import math
import os
import pickle
import random
import shutil
import struct
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint import filesystem as dcp_filesystem
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from fullshard import cli, fully_shard
from fullshard.checkpoint import CheckpointError, manifest, step_dir
from fullshard.train.procs import free_port
from fullshard.torch.checkpoint import export_checkpoint, load_checkpoint, save_checkpoint
from fullshard.train import worker
from fullshard.train.config import TrainConfig
from tests.checkpoint import fuzz
from tests.checkpoint.states import assert_same
from tests.conftest import Launch, scenario

BUDGET = 560 * fuzz.SCALE
_StorageInfo = dcp_filesystem._StorageInfo
LAUNCH = Launch(world_sizes=(2,), timeout_s=300)


# ---------------------------------------------------------------------- the checkpoint, saved by 2 gloo ranks
def mlp(seed: int) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))


def sharded_and_trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The MLP sharded by layer and at the root, after one AdamW step (on any world size)."""
    model = mlp(seed)
    for layer in (model[0], model[2]):
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    batch = torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))
    model(batch).square().sum().backward()
    optim.step()
    optim.zero_grad()
    return model, optim


@scenario
def save_fuzz_checkpoint():
    """A two-layer MLP sharded with fullshard (Shard(0), uneven: 5 rows on 2 ranks) and its AdamW state after one
    step, saved with ``save_checkpoint`` under ``$FULLSHARD_TEST_DIR/fuzz/step_1``; rank 0 also writes the full
    state (``expected_fuzz.pt``) the fuzz test's positive control compares with."""
    root = Path(os.environ["FULLSHARD_TEST_DIR"])
    model, optim = sharded_and_trained(0)
    path = save_checkpoint(model, step_dir(root / "fuzz", 1), optim)
    model_sd, optim_sd = get_state_dict(model, optim, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        torch.save({"model": model_sd, "optim": optim_sd}, root / "expected_fuzz.pt")
    dist.barrier()
    assert path.name == fuzz.STEP
    return sorted(p.name for p in path.iterdir())


@pytest.fixture
def saved(scenario_data, scenario_dir):
    scenario_data("save_fuzz_checkpoint")
    return scenario_dir


@pytest.fixture(scope="module")
def one_rank():
    """A 1-rank gloo group in this process (fully_shard needs one), gone again after the module."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=60))
    yield
    dist.destroy_process_group()


# ---------------------------------------------------------------------- crafting DCP metadata
class Crafted:
    """Pickles as an instance of ``cls`` that the unpickler builds from ``state`` (NEWOBJ, then BUILD), as DCP's
    own objects pickle, but with whatever state a crafted file may hold."""

    def __init__(self, cls, state):
        self._cls, self._state = cls, state

    @property
    def __class__(self):  # pickle checks that NEWOBJ's class is the object's
        return self._cls

    def __reduce_ex__(self, protocol):
        return copyreg.__newobj__, (self._cls,), self._state


def _read(directory: Path) -> Metadata:
    with open(directory / ".metadata", "rb") as handle:
        return pickle.load(handle)  # the test's own copy of a checkpoint it saved


def _write(directory: Path, metadata) -> None:
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))


def _sites(metadata: Metadata) -> list[tuple[str, object, object]]:
    """(label, object, put) for every DCP object in ``metadata``; ``put(m, new)`` puts ``new`` in its place."""
    sites = [("Metadata", metadata, None)]
    for name, entry in metadata.state_dict_metadata.items():
        sites.append((f"entry '{name}'", entry, lambda m, v, n=name: m.state_dict_metadata.__setitem__(n, v)))
        if isinstance(entry, TensorStorageMetadata):
            sites.append((f"properties of '{name}'", entry.properties,
                          lambda m, v, n=name: setattr(m.state_dict_metadata[n], "properties", v)))
            for index, chunk in enumerate(entry.chunks):
                sites.append((f"chunk {index} of '{name}'", chunk,
                              lambda m, v, n=name, i=index: m.state_dict_metadata[n].chunks.__setitem__(i, v)))
    for position, (key, info) in enumerate(metadata.storage_data.items()):
        where = f"'{key.fqn}'" + ("" if key.offset is None else f" at {tuple(key.offset)}")
        sites.append((f"storage key of {where}", key, lambda m, v, p=position: _replace_key(m, p, v)))
        sites.append((f"storage of {where}", info,
                      lambda m, v, p=position: m.storage_data.__setitem__(list(m.storage_data)[p], v)))
    sites.append(("storage_meta", metadata.storage_meta, lambda m, v: setattr(m, "storage_meta", v)))
    return sites


def _object_at(metadata: Metadata, label: str):
    return next(obj for site, obj, _ in _sites(metadata) if site == label)


def _replace_key(metadata: Metadata, position: int, key) -> None:
    items = list(metadata.storage_data.items())
    items[position] = (key, items[position][1])
    metadata.storage_data = dict(items)


def _bad_sizes(size: torch.Size) -> list:
    ndim = len(size)
    bad = [None, list(size), torch.Size([10**12] * ndim), torch.Size([-1] * ndim), torch.Size(list(size) + [1]),
           torch.Size([s + 1 for s in size])]
    return [b for b in bad if type(b) is not torch.Size or b != size]


def _bad_values(obj, field: str, directory: Path, bait: Path) -> list:
    """Values ``field`` of ``obj`` may not take (each one makes the checkpoint invalid, never just different)."""
    value = getattr(obj, field, None)
    if isinstance(value, torch.Size):
        return _bad_sizes(value)
    if type(obj) is MetadataIndex and field == "offset":
        return [torch.Size([0])]  # a non-tensor value's key has none
    if type(obj) is _StorageInfo and field in ("offset", "length"):
        return [None, "0", 1.5, -1, 10**12, 2**63, value + 1] + [value - 1] * (value > 0)
    if type(obj) is _StorageInfo and field == "relative_path":
        data_files = sorted(p.name for p in directory.iterdir() if p.suffix == ".distcp")
        return [None, 5, str(bait / data_files[0]), f"../../{bait.name}/{data_files[0]}", f"sub/{data_files[0]}", "",
                ".", "..", ".metadata", manifest.MANIFEST_FILE, "missing.distcp", f"{data_files[0]}/",
                *(n for n in data_files if n != value)]
    table = {
        (Metadata, "state_dict_metadata"): [None, [], "x"],
        (Metadata, "planner_data"): [[], "x", 5],
        (Metadata, "storage_data"): [None, [], "x"],
        (Metadata, "storage_meta"): ["x", 5, BytesStorageMetadata()],
        (Metadata, "version"): [5, [], 1.5],
        (TensorStorageMetadata, "properties"): [None, "x", BytesStorageMetadata()],
        (TensorStorageMetadata, "chunks"): [None, (), "x"],
        (MetadataIndex, "fqn"): [None, 5, "no such key"],
        (MetadataIndex, "index"): [10**12, -1, "x", 1.5] if getattr(obj, "offset", None) is not None else [0, 5],
        (_StorageInfo, "transform_descriptors"): [["zstd"], "x", 5],
        (StorageMeta, "checkpoint_id"): [5, [], b"x"],
        (StorageMeta, "save_id"): [5, []],
        (StorageMeta, "load_id"): [5, []],
        (StorageMeta, "modules"): [None, "x", [5], {}],
    }
    return [v for v in table.get((type(obj), field), []) if type(v) is not type(value) or v != value]


# Fields a checkpoint may lack (older DCP versions, or defaults DCP fills in): removing them is no mutation.
_OPTIONAL = {(Metadata, "version"), (Metadata, "storage_meta"), (StorageMeta, "checkpoint_id"),
             (StorageMeta, "load_id"), (StorageMeta, "modules"), (_StorageInfo, "transform_descriptors"),
             (MetadataIndex, "index")}


def _object_mutations(directory: Path, bait: Path) -> list[fuzz.Mutation]:
    """Each field of each DCP object with each bad value, missing, and an extra field beside it."""
    found = []
    for label, obj, put in _sites(_read(directory)):
        cls = type(obj)
        if cls is TensorProperties:
            found += _properties_mutations(label, put)
            continue
        for field in sorted(vars(obj)):
            name = f"{cls.__name__}.{field}"
            for value in _bad_values(obj, field, directory, bait):
                found.append(_craft(_kind(obj, field, value), f"{label}.{field} = {value!r}", name, label, put, cls,
                                    field, value))
            if (cls, field) not in _OPTIONAL and not (cls is MetadataIndex and field == "offset" and obj.offset is None):
                found.append(_craft("missing key", f"{label}.{field}", name, label, put, cls, field, _MISSING,
                                    needs_manifest=cls is StorageMeta))
        found.append(_craft("extra key", f"{label}.extra", f"{cls.__name__}.extra", label, put, cls, "extra", 1))
    found += [
        _craft("wrong value", "storage_meta = None", "Metadata.storage_meta", "Metadata", None, Metadata,
               "storage_meta", None, needs_manifest=True),
        _craft("wrong value", "storage_meta.save_id = other", "StorageMeta.save_id", "storage_meta",
               lambda m, v: setattr(m, "storage_meta", v), StorageMeta, "save_id", "other", needs_manifest=True),
    ]
    return found


_MISSING = object()


def _kind(obj, field: str, value) -> str:
    if field == "relative_path" and isinstance(value, str):
        return "hostile file name"
    numbers = [value] if type(value) is int else list(value) if type(value) is torch.Size else []
    if any(n < 0 or n >= 10**12 for n in numbers):
        return "huge or negative number"
    if type(value) is type(getattr(obj, field, None)):
        return "number off by one" if type(value) is int else "wrong value"
    return "wrong type"


def _craft(kind, target, field_name, label, put, cls, field, value, needs_manifest=False) -> fuzz.Mutation:
    def apply(directory: Path) -> None:
        metadata = _read(directory)
        obj = _object_at(metadata, label) if put else metadata
        state = dict(vars(obj))
        if value is _MISSING:
            state.pop(field)
        else:
            state[field] = value
        crafted = Crafted(cls, state)
        if put is None:
            metadata = crafted
        else:
            put(metadata, crafted)
        _write(directory, metadata)

    return fuzz.Mutation(kind, target, apply, crafted=True, needs_manifest=needs_manifest, field=field_name)


def _properties_mutations(label: str, put) -> list[fuzz.Mutation]:
    """TensorProperties pickles as a 5-tuple (dtype, layout, requires_grad, memory format code, pin_memory)."""
    bad = {0: [None, "float32", torch.qint8, torch.int4], 1: [torch.sparse_coo, None], 2: [1, None],
           3: [7, None], 4: [1, None]}
    found = []
    for position, values in bad.items():
        for value in values:
            found.append(_tuple_state("wrong type", f"{label}[{position}] = {value!r}", f"TensorProperties[{position}]",
                                      label, put, lambda s, p=position, v=value: s[:p] + (v,) + s[p + 1:]))
    found.append(_tuple_state("missing key", f"{label}: 4 fields", "TensorProperties", label, put, lambda s: s[:4]))
    found.append(_tuple_state("extra key", f"{label}: 6 fields", "TensorProperties", label, put, lambda s: s + (1,)))
    return found


def _tuple_state(kind, target, field_name, label, put, change) -> fuzz.Mutation:
    def apply(directory: Path) -> None:
        metadata = _read(directory)
        obj = _object_at(metadata, label)
        put(metadata, Crafted(TensorProperties, change(obj.__getstate__())))
        _write(directory, metadata)

    return fuzz.Mutation(kind, target, apply, crafted=True, field=field_name)


def _container_mutations() -> list[fuzz.Mutation]:
    """Entries, storage items, chunks and key paths missing, extra, or out of bounds."""
    def edit(kind, target, field_name, change, needs_manifest=False):
        def apply(directory: Path) -> None:
            metadata = _read(directory)
            change(metadata)
            _write(directory, metadata)
        return fuzz.Mutation(kind, target, apply, crafted=True, field=field_name, needs_manifest=needs_manifest)

    first_tensor = lambda m: next(n for n, e in m.state_dict_metadata.items()  # noqa: E731
                                  if isinstance(e, TensorStorageMetadata))
    found = [
        edit("missing key", "an entry of state_dict_metadata", "state_dict_metadata",
             lambda m: m.state_dict_metadata.pop(first_tensor(m))),
        edit("extra key", "state_dict_metadata['extra']", "state_dict_metadata",
             lambda m: m.state_dict_metadata.__setitem__("extra", BytesStorageMetadata())),
        edit("missing key", "an item of storage_data", "storage_data", lambda m: m.storage_data.popitem()),
        edit("extra key", "storage_data[extra]", "storage_data",
             lambda m: m.storage_data.__setitem__(MetadataIndex("extra"), next(iter(m.storage_data.values())))),
        edit("missing list item", "a chunk", "chunks", lambda m: m.state_dict_metadata[first_tensor(m)].chunks.pop()),
        edit("extra list item", "a chunk twice", "chunks", lambda m: m.state_dict_metadata[first_tensor(m)].chunks.append(
            m.state_dict_metadata[first_tensor(m)].chunks[0])),
        edit("missing key", "a key path", "planner_data", lambda m: m.planner_data.popitem()),
        edit("extra key", "planner_data['extra']", "planner_data", lambda m: m.planner_data.__setitem__("extra", ("x",))),
    ]
    paths = {"index 10**12": ("optim", "param_groups", 10**12, "lr"), "index -1": ("optim", "param_groups", -1, "lr"),
             "empty": (), "a list": ["model", "x"], "too deep": ("x",) * 65, "an int first": (5,),
             "a float": ("model", 1.5), "a bool": ("model", True), "None": None}
    for label, path in paths.items():
        kind = "huge or negative number" if "index" in label else "bad key path"
        found.append(edit(kind, f"a key path = {label}", "planner_data[key]",
                          lambda m, p=path: m.planner_data.__setitem__(next(iter(m.planner_data)), p)))
    found.append(edit("bad key path", "two keys with one path", "planner_data[key]",
                      lambda m: m.planner_data.__setitem__(list(m.planner_data)[1], m.planner_data[next(iter(m.planner_data))])))
    found.append(edit("bad key path", "a path through a leaf", "planner_data[key]",
                      lambda m: m.planner_data.__setitem__(list(m.planner_data)[1],
                                                           m.planner_data[next(iter(m.planner_data))] + ("x",))))
    return found


class _RunsCode:
    def __reduce__(self):
        import os

        return os.system, ("echo crafted",)


def _pickle_mutations() -> list[fuzz.Mutation]:
    """Pickles that a plain unpickler would run, or that announce more than they hold."""
    def replace(kind, target, data_of):
        def apply(directory: Path) -> None:
            path = directory / ".metadata"
            path.write_bytes(data_of(path.read_bytes()))
        return fuzz.Mutation(kind, target, apply, crafted=True, field=target.split(" (")[0])

    p4 = pickle.PROTO + b"\x04"
    return [
        replace("foreign pickle", "a global (os.system)", lambda d: pickle.dumps(_RunsCode())),
        replace("foreign pickle", "metadata inside a list", lambda d: pickle.dumps([pickle.loads(d)])),
        replace("foreign pickle", "a dict", lambda d: pickle.dumps({"state_dict_metadata": {}})),
        replace("foreign pickle", "a persistent id", lambda d: p4 + pickle.BINPERSID + pickle.STOP),
        replace("truncated file", "pickle (half)", lambda d: d[:len(d) // 2]),
        replace("truncated file", "pickle (last byte)", lambda d: d[:-1]),
        replace("extended file", "pickle (junk after STOP)", lambda d: d + b"junk"),
        replace("huge or negative number", "pickle (BINBYTES8 of 2**40)",
                lambda d: p4 + pickle.BINBYTES8 + struct.pack("<Q", 1 << 40) + pickle.STOP),
        replace("huge or negative number", "pickle (memo index 2**32-1)",
                lambda d: p4 + pickle.NONE + pickle.LONG_BINPUT + struct.pack("<I", 0xFFFFFFFF) + pickle.STOP),
        replace("huge or negative number", "pickle (frame of 2**40)",
                lambda d: p4 + pickle.FRAME + struct.pack("<Q", 1 << 40) + d[11:]),
    ]


def mutations(directory: Path, bait: Path) -> list[fuzz.Mutation]:
    rng = random.Random(fuzz.SEED)
    found = fuzz.file_mutations(directory, bait, rng, flips=24 * fuzz.SCALE)
    found += _object_mutations(directory, bait) + _container_mutations() + _pickle_mutations()
    return fuzz.select(found, BUDGET, rng)


# ---------------------------------------------------------------------- the legs
LARGEST_TENSOR = [0]  # bytes of the largest tensor a leg asked torch.empty for (tracemalloc does not see them)


@contextlib.contextmanager
def _tensor_requests_bounded():
    """``torch.empty`` (what load_full_state_dict allocates from the metadata) refuses, before allocating, any tensor over
    the fuzz's memory bound, and records the largest asked for."""
    real = torch.empty

    def empty(*size, **kwargs):
        shape = size[0] if len(size) == 1 and not isinstance(size[0], int) else size
        wanted = math.prod(shape) * (kwargs.get("dtype") or torch.get_default_dtype()).itemsize
        assert wanted < fuzz.MEMORY_LIMIT, f"a leg asked for a tensor of {wanted} bytes"
        LARGEST_TENSOR[0] = max(LARGEST_TENSOR[0], wanted)
        return real(*size, **kwargs)

    torch.empty = empty
    try:
        yield
    finally:
        torch.empty = real


def _refusal(fn) -> str | None:
    try:
        with warnings.catch_warnings(), _tensor_requests_bounded():
            warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
            fn()
    except CheckpointError as error:
        return str(error)
    return None


def _cli_line(argv: list[str]) -> str:
    with _tensor_requests_bounded():
        return fuzz.cli_line(cli.main, argv)


def _load(model, optim, path: Path, **options) -> None:
    load_checkpoint(model, path, optim, **options)


def make_legs(model, optim, out: Path) -> tuple[dict, dict]:
    step = lambda root: root / fuzz.STEP  # noqa: E731

    def resume_cli(root: Path):
        try:
            cli._check_resumable(str(root), "torch")
        except cli.UsageError as error:
            assert "\n" not in str(error), str(error)
            return str(error)
        return None

    legs = {
        "load": lambda root: _refusal(lambda: _load(model, optim, step(root))),
        "resume (train job)": lambda root: _refusal(lambda: worker.load_checkpoint(
            TrainConfig(checkpoint_dir=str(root), resume=True), model, optim)),
        "resume (CLI check)": resume_cli,
        "export": lambda root: _refusal(lambda: export_checkpoint(step(root), out, key="model")),
        "export (CLI)": lambda root: _cli_line(["export", str(step(root)), str(out)]),
    }
    unverified = {
        "load without manifest": lambda root: _refusal(lambda: _load(model, optim, step(root), require_manifest=False)),
        "export without manifest (CLI)": lambda root: _cli_line(
            ["export", str(step(root)), str(out), "--without-manifest"]),
    }
    return legs, unverified


def _snapshot(model, optim):
    def take() -> bytes:
        tensors = [p.to_local() for p in model.parameters()]
        tensors += [v.to_local() if hasattr(v, "to_local") else v
                    for s in optim.state.values() for v in s.values() if torch.is_tensor(v)]
        return b"".join(t.detach().numpy().tobytes() for t in tensors) + repr(optim.param_groups).encode()

    return take


def test_every_mutation_is_refused_and_changes_nothing(saved, one_rank, tmp_path):
    pristine, work, bait, out = (tmp_path / n for n in ("pristine", "work", "bait", "out"))
    for folder in (pristine, bait, out):
        folder.mkdir()
    shutil.copytree(saved / "fuzz" / fuzz.STEP, pristine / fuzz.STEP)
    model, optim = sharded_and_trained(5)  # other values, stepped: a load would change both
    # the pristine checkpoint loads, resumes and exports (every leg warmed up, its lazy imports done)
    assert _refusal(lambda: _load(model, optim, pristine / fuzz.STEP)) is None
    expected = torch.load(saved / "expected_fuzz.pt", weights_only=True)
    assert_same({n: p.full_tensor() for n, p in model.named_parameters()}, expected["model"])
    assert worker.load_checkpoint(TrainConfig(checkpoint_dir=str(pristine), resume=True), model, optim) == 1
    assert _refusal(lambda: export_checkpoint(pristine / fuzz.STEP, out / "model.pt", key="model")) is None
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["export", str(pristine / fuzz.STEP), str(out / "model.pt")]) == 0
    cli._check_resumable(str(pristine), "torch")
    (out / "model.pt").unlink()
    model, optim = sharded_and_trained(5)  # a fresh one: the one above now holds the checkpoint's values
    legs, unverified = make_legs(model, optim, out / "model.pt")
    chosen = mutations(pristine / fuzz.STEP, bait)
    assert len(chosen) >= 500
    report = fuzz.run(chosen, pristine, work, legs, _snapshot(model, optim), "torch", unverified_legs=unverified)
    assert not list(out.iterdir()), "an export wrote a file"
    fuzz.write_report(report, "torch", largest_tensor_requested_bytes=LARGEST_TENSOR[0])
    assert report.legs["load"] == len(chosen) and report.legs["load without manifest"] > 200
