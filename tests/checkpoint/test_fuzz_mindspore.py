"""Fuzz: mutations of a small valid MindSpore checkpoint, each through load, resume and export (in process).

The checkpoint is a 2-rank one (a TinyLM and its Adam state, sharded along
dim 0), written with the format's own writers, the calls each rank makes in
``save_checkpoint``: no msrun. Every mutation must end in CheckpointError
naming the checkpoint, change nothing, open nothing outside, and stay under
the memory bound (``tests/checkpoint/fuzz.py``). The counts go to
docs/reliability.md.
"""
from __future__ import annotations

import contextlib
import io
import json
import random
import struct
import uuid
from pathlib import Path

import numpy as np
import pytest

ms = pytest.importorskip("mindspore")

from mindspore import nn  # noqa: E402

import fullshard.mindspore as fs  # noqa: E402
from fullshard import cli  # noqa: E402
from fullshard.checkpoint import manifest  # noqa: E402
from fullshard.checkpoint.formats import sharded_safetensors  # noqa: E402
from fullshard.checkpoint.formats.safetensors_file import Array  # noqa: E402
from fullshard.checkpoint.formats.sharded_safetensors import METADATA_FILE, Piece, rank_file  # noqa: E402
from fullshard.checkpoint.manifest import dumps_canonical  # noqa: E402
from fullshard.checkpoint.untrusted import CheckpointError  # noqa: E402
from fullshard.mindspore.checkpoint import _targets, _to_array  # noqa: E402
from fullshard.train import worker_mindspore  # noqa: E402
from fullshard.train.config import TrainConfig  # noqa: E402
from tests.checkpoint import fuzz  # noqa: E402
from tests.mindspore.parity import TinyLM, init_numpy, lm_batch, lm_loss  # noqa: E402

BUDGET = 560 * fuzz.SCALE


def _trained(seed: int):
    net = init_numpy(TinyLM(), seed)
    opt = nn.Adam(net.trainable_params(), learning_rate=1e-2)
    ids, labels = lm_batch(seed, 4)
    _, grads = ms.value_and_grad(lambda: lm_loss(net, ids, labels), None, opt.parameters)()
    opt(grads)
    return net, opt


def write_two_rank_checkpoint(net, opt, directory: Path) -> None:
    """What ``save_checkpoint`` writes on 2 ranks whose parameters are cut along dim 0 (whole when they are
    too small), then the metadata and the manifest rank 0 writes."""
    directory.mkdir(parents=True)
    ranks: list[list[Piece]] = [[], []]
    for piece, tensor in _targets(net, opt):
        array = _to_array(tensor)
        if array.data.ndim and array.data.shape[0] >= 2:
            half = -(-array.data.shape[0] // 2)
            for rank, (start, stop) in enumerate(((0, half), (half, array.data.shape[0]))):
                ranks[rank].append(Piece(piece.key, piece.shape, piece.dtype, 0, start, stop - start,
                                         Array(array.data[start:stop], array.dtype)))
        else:
            for rank in (0, 1):
                ranks[rank].append(Piece(piece.key, piece.shape, piece.dtype, None, 0, 0, array))
    for rank in (0, 1):
        sharded_safetensors.write_rank(directory, rank, ranks[rank])
    save_id = uuid.uuid4().hex
    sharded_safetensors.write_metadata(directory, 2, ranks[0], save_id)
    manifest.write(directory, sharded_safetensors.FRAMEWORK, save_id)


# ---------------------------------------------------------------------- the JSON inside the checkpoint
def _read_header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def _write_header(path: Path, header, data: bytes, canonical: bool = True) -> None:
    encoded = dumps_canonical(header) if canonical else json.dumps(header, indent=1).encode()
    encoded += b" " * (-len(encoded) % 8)
    path.write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)


def _header_site(rank: int) -> fuzz.JsonSite:
    name = rank_file(rank)
    return fuzz.JsonSite(name, lambda d: _read_header(d / name)[0],
                         lambda d, h: _write_header(d / name, h, _read_header(d / name)[1]))


def _slices_site(rank: int) -> fuzz.JsonSite:
    name = rank_file(rank)

    def write(directory: Path, slices) -> None:
        header, data = _read_header(directory / name)
        header["__metadata__"]["slices"] = dumps_canonical(slices).decode()
        _write_header(directory / name, header, data)

    return fuzz.JsonSite(f"{name}:slices", lambda d: json.loads(_read_header(d / name)[0]["__metadata__"]["slices"]),
                         write)


def _write_manifest(directory: Path, document) -> None:
    """The manifest as given, its self-digest recomputed (a consistent, crafted manifest)."""
    import hashlib

    if isinstance(document, dict) and "digest" in document:
        body = {k: v for k, v in document.items() if k != "digest"}
        document["digest"] = hashlib.sha256(dumps_canonical(body)).hexdigest()
    (directory / manifest.MANIFEST_FILE).write_bytes(dumps_canonical(document))


METADATA_SITE = fuzz.JsonSite(METADATA_FILE, lambda d: json.loads((d / METADATA_FILE).read_bytes()),
                              lambda d, doc: (d / METADATA_FILE).write_bytes(dumps_canonical(doc)))
MANIFEST_SITE = fuzz.JsonSite(manifest.MANIFEST_FILE, lambda d: json.loads((d / manifest.MANIFEST_FILE).read_bytes()),
                              _write_manifest)


def _hostile_names(directory: Path, bait: Path) -> list[fuzz.Mutation]:
    """Names that point outside the checkpoint, at a valid rank file copied there, in each list that names files."""
    names = [str(bait / rank_file(0)), f"../../{bait.name}/{rank_file(0)}", f"./{rank_file(0)}", f"{rank_file(0)}/",
             f"sub/{rank_file(0)}", "", "..", "rank_00.safetensors", "RANK_0.safetensors"]
    found = []
    for name in names:
        def in_files(d: Path, n=name) -> None:
            document = METADATA_SITE.read(d)
            document["files"][0] = n
            METADATA_SITE.write(d, document)

        def in_manifest(d: Path, n=name) -> None:
            document = MANIFEST_SITE.read(d)
            document["files"][n] = document["files"].pop(rank_file(0))
            MANIFEST_SITE.write(d, document)

        found.append(fuzz.Mutation("hostile file name", f"{METADATA_FILE}.files[0] = {name!r}", in_files, crafted=True,
                                   field="files"))
        found.append(fuzz.Mutation("hostile file name", f"{manifest.MANIFEST_FILE}.files {name!r}", in_manifest,
                                   field="manifest files"))
    found.append(fuzz.Mutation("symlink", f"{rank_file(1)} -> copy outside, manifest matching",
                               lambda d: fuzz._link(d / rank_file(1), bait / rank_file(1)), crafted=True))
    return found


def _not_canonical() -> list[fuzz.Mutation]:
    def pretty(d: Path, name: str) -> None:
        (d / name).write_bytes(json.dumps(json.loads((d / name).read_bytes()), indent=1).encode())

    def header(d: Path, rank: int) -> None:
        h, data = _read_header(d / rank_file(rank))
        _write_header(d / rank_file(rank), h, data, canonical=False)

    return [fuzz.Mutation("not canonical JSON", METADATA_FILE, lambda d: pretty(d, METADATA_FILE), crafted=True),
            fuzz.Mutation("not canonical JSON", manifest.MANIFEST_FILE, lambda d: pretty(d, manifest.MANIFEST_FILE)),
            *(fuzz.Mutation("not canonical JSON", f"{rank_file(r)} header", lambda d, r=r: header(d, r), crafted=True)
              for r in (0, 1))]


def mutations(directory: Path, bait: Path) -> list[fuzz.Mutation]:
    rng = random.Random(fuzz.SEED)
    found = fuzz.file_mutations(directory, bait, rng, flips=24 * fuzz.SCALE)
    found += fuzz.json_mutations(METADATA_SITE, METADATA_SITE.read(directory))
    found += fuzz.json_mutations(MANIFEST_SITE, MANIFEST_SITE.read(directory), fixed=[("digest",)], crafted=False)
    for rank in (0, 1):
        for site in (_header_site(rank), _slices_site(rank)):
            found += fuzz.json_mutations(site, site.read(directory))
    found += _hostile_names(directory, bait) + _not_canonical()
    return fuzz.select(found, BUDGET, rng)


# ---------------------------------------------------------------------- the legs
def _refusal(fn) -> str | None:
    try:
        fn()
    except CheckpointError as error:
        return str(error)
    return None


def make_legs(net, opt, out: Path) -> dict:
    cfg = lambda root: TrainConfig(checkpoint_dir=str(root), resume=True, framework="mindspore")  # noqa: E731

    def resume_cli(root: Path):
        try:
            cli._check_resumable(str(root), "mindspore")
        except cli.UsageError as error:
            assert "\n" not in str(error), str(error)
            return str(error)
        return None

    return {
        "load": lambda root: _refusal(lambda: fs.load_checkpoint(net, root / fuzz.STEP, opt)),
        "resume (train job)": lambda root: _refusal(lambda: worker_mindspore.resume(cfg(root), net, opt)),
        "resume (CLI check)": resume_cli,
        "export": lambda root: _refusal(lambda: sharded_safetensors.export_full(root / fuzz.STEP, out)),
        "export (CLI)": lambda root: fuzz.cli_line(cli.main, ["export", str(root / fuzz.STEP), str(out)]),
    }


def _snapshot(net, opt):
    def take() -> bytes:
        params = list(net.get_parameters()) + list(opt.get_parameters())
        return b"".join(p.asnumpy().tobytes() for p in params)

    return take


def test_every_mutation_is_refused_and_changes_nothing(tmp_path):
    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    pristine, work, bait, out = (tmp_path / n for n in ("pristine", "work", "bait", "out"))
    bait.mkdir()
    out.mkdir()
    saved_net, saved_opt = _trained(0)
    write_two_rank_checkpoint(saved_net, saved_opt, pristine / fuzz.STEP)
    net, opt = _trained(5)  # other values, an optimizer that has stepped: a load would change both
    # the pristine checkpoint loads, resumes and exports (every leg warmed up, its imports done)
    fs.load_checkpoint(net, pristine / fuzz.STEP, opt)
    loaded = {n: p.asnumpy() for n, p in net.parameters_and_names()}
    assert all(np.array_equal(loaded[n], p.asnumpy()) for n, p in saved_net.parameters_and_names())
    assert worker_mindspore.resume(TrainConfig(checkpoint_dir=str(pristine), framework="mindspore"), net, opt) == 1
    sharded_safetensors.export_full(pristine / fuzz.STEP, out / "model.safetensors")
    with contextlib.redirect_stdout(io.StringIO()):
        assert cli.main(["export", str(pristine / fuzz.STEP), str(out / "model.safetensors")]) == 0
    cli._check_resumable(str(pristine), "mindspore")
    (out / "model.safetensors").unlink()
    net, opt = _trained(5)  # a fresh one: the one above now holds the checkpoint's values
    legs = make_legs(net, opt, out / "model.safetensors")
    chosen = mutations(pristine / fuzz.STEP, bait)
    assert len(chosen) >= 500
    report = fuzz.run(chosen, pristine, work, legs, _snapshot(net, opt), sharded_safetensors.FRAMEWORK)
    assert not list(out.iterdir()), "an export wrote a file"
    fuzz.write_report(report, "mindspore")
    assert sum(report.legs.values()) == len(chosen) * len(legs)


def test_the_reported_cases(tmp_path):
    """The issue's MindSpore case: an absolute or ../ name in fullshard.json's files no longer reads (or exports)
    another checkpoint's file, even with a manifest that matches."""
    saved_net, saved_opt = _trained(0)
    other = tmp_path / "other" / fuzz.STEP
    write_two_rank_checkpoint(*_trained(3), other)
    victim = tmp_path / "ckpt" / fuzz.STEP
    write_two_rank_checkpoint(saved_net, saved_opt, victim)
    for hostile in (str(other / rank_file(0)), f"../../other/{fuzz.STEP}/{rank_file(0)}"):
        document = METADATA_SITE.read(victim)
        document["files"][0] = hostile
        METADATA_SITE.write(victim, document)
        fuzz.craft_manifest(victim, sharded_safetensors.FRAMEWORK)
        with pytest.raises(CheckpointError, match=r"files .* are not exactly rank_<r>.safetensors"):
            sharded_safetensors.export_full(victim, tmp_path / "out.safetensors")
    assert not (tmp_path / "out.safetensors").exists()


def test_a_cell_that_does_not_fit_is_named(tmp_path):
    """A checkpoint that is fine but not this cell's: CheckpointError naming the parameter, the cell untouched."""
    saved = nn.Dense(4, 3)
    fs.save_checkpoint(saved, tmp_path / "ckpt")
    target = nn.Dense(4, 3)
    target.weight.set_dtype(ms.float16)
    before = target.weight.asnumpy().copy()
    with pytest.raises(CheckpointError, match="dtype mismatch for parameter 'weight': checkpoint float32 vs cell "
                                              "float16"):
        fs.load_checkpoint(target, tmp_path / "ckpt")
    assert np.array_equal(target.weight.asnumpy(), before)


def test_strict_false_ignores_what_the_cell_does_not_have(tmp_path):
    """As on torch: strict (the default) names a checkpoint entry the cell lacks; strict=False loads the rest."""
    saved = nn.Dense(4, 3)
    fs.save_checkpoint(saved, tmp_path / "ckpt")
    target = nn.Dense(4, 3, has_bias=False)
    with pytest.raises(CheckpointError, match="unexpected in checkpoint: parameter 'bias'"):
        fs.load_checkpoint(target, tmp_path / "ckpt")
    fs.load_checkpoint(target, tmp_path / "ckpt", strict=False)
    assert np.array_equal(target.weight.asnumpy(), saved.weight.asnumpy())
