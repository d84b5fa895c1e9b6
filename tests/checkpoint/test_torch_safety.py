"""torch checkpoints in one process: checked loading that names what does not fit, checkpoints whose metadata or
values would run code or read outside the checkpoint, damaged and stock DCP checkpoints, atomic saves. (Sharded
checkpoints saved by gloo ranks: tests/checkpoint/test_torch.py.)
"""
import os
import pickle
import signal
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from fullshard.checkpoint import CheckpointError, latest_step, manifest, step_dir
from fullshard.torch.checkpoint import (
    export_checkpoint,
    full_state_dict,
    load_checkpoint,
    load_full_state_dict,
    load_state_dict,
    read_metadata,
    save_checkpoint,
    save_state_dict,
)
from tests.checkpoint.states import assert_same

ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------- checked loading (one process)
def _mlp(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))


def _step(model, optim):
    model(torch.ones(5, 4)).square().sum().backward()
    optim.step()
    optim.zero_grad()


def test_a_module_and_its_optimizer_in_one_process(tmp_path):
    """save_checkpoint / load_checkpoint / full_state_dict on a plain module and no process group: the calls a
    sharded job makes (and fullshard.mindspore's); an optimizer that never stepped loads the saved state."""
    model = _mlp(0)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, optim)
    path = save_checkpoint(model, tmp_path / "step_1", optim)
    assert path == tmp_path / "step_1" and manifest.present(path)
    fresh = _mlp(1)
    fresh_optim = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    load_checkpoint(fresh, path, fresh_optim)
    assert_same(full_state_dict(fresh), full_state_dict(model))
    assert_same(fresh_optim.state_dict(), optim.state_dict())
    only_model = _mlp(2)
    load_checkpoint(only_model, path)  # no optimizer: its entries are not read
    assert_same(only_model.state_dict(), model.state_dict())
    _step(model, optim)
    _step(fresh, fresh_optim)  # trains on exactly as the saved one does
    assert_same(fresh.state_dict(), model.state_dict())


def test_a_module_that_does_not_fit_is_named(tmp_path):
    path = save_checkpoint(_mlp(0), tmp_path / "step_1")
    wider = torch.nn.Sequential(*_mlp(1), torch.nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match=r"missing in checkpoint: 'model.3.weight' \(state has tensor \(2, 2\)"):
        load_checkpoint(wider, path)
    narrower = _mlp(1)[:1]
    before = narrower.state_dict()["0.weight"].clone()
    with pytest.raises(CheckpointError, match=r"unexpected in checkpoint: 'model.2.weight' \(tensor \(2, 3\)"):
        load_checkpoint(narrower, path)
    assert torch.equal(narrower[0].weight, before), "a refused load changed the module"
    load_checkpoint(narrower, path, strict=False)
    assert torch.equal(narrower[0].weight, _mlp(0)[0].weight)


def _small_state():
    gen = torch.Generator().manual_seed(0)
    return {"model": {"w": torch.randn(3, 4, generator=gen), "b": torch.randn(4, generator=gen)}, "step": 3}


@pytest.fixture
def small_ckpt(tmp_path):
    save_state_dict(_small_state(), step_dir(tmp_path, 1))
    return tmp_path


def _target(**changes):
    model = {"w": torch.zeros(3, 4), "b": torch.zeros(4)}
    model.update(changes)
    return {"model": {k: v for k, v in model.items() if v is not None}, "step": 0}


def test_checked_load_succeeds(small_ckpt):
    state = _target()
    load_state_dict(state, step_dir(small_ckpt, 1))
    assert_same(state, _small_state())


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"c": torch.zeros(2)}, "missing in checkpoint: 'model.c' (state has tensor (2,) torch.float32)"),
        ({"b": None}, "unexpected in checkpoint: 'model.b' (tensor (4,) torch.float32)"),
        ({"w": torch.zeros(4, 3)}, "shape mismatch for 'model.w': checkpoint (3, 4) vs state (4, 3)"),
        ({"w": torch.zeros(3, 4, dtype=torch.bfloat16)},
         "dtype mismatch for 'model.w': checkpoint torch.float32 vs state torch.bfloat16"),
        ({"b": "text"}, "kind mismatch for 'model.b': checkpoint has tensor (4,) torch.float32, state has non-tensor"),
    ],
    ids=["missing", "unexpected", "shape", "dtype", "kind"],
)
def test_checked_load_names_key_and_both_sides(small_ckpt, changes, message):
    state = _target(**changes)
    with pytest.raises(ValueError) as caught:
        load_state_dict(state, step_dir(small_ckpt, 1))
    assert message in str(caught.value)
    assert str(step_dir(small_ckpt, 1)) in str(caught.value)
    untouched = [v for v in state["model"].values() if isinstance(v, torch.Tensor)]
    assert state["step"] == 0 and not any(v.any() for v in untouched), "a refused load changed the state"


def test_checked_load_reports_every_problem_at_once(small_ckpt):
    state = _target(w=torch.zeros(4, 3), c=torch.zeros(1))
    with pytest.raises(ValueError) as caught:
        load_state_dict(state, step_dir(small_ckpt, 1))
    assert "shape mismatch for 'model.w'" in str(caught.value) and "missing in checkpoint: 'model.c'" in str(caught.value)


def test_non_strict_ignores_unexpected_only(small_ckpt):
    state = {"model": {"w": torch.zeros(3, 4)}}
    load_state_dict(state, step_dir(small_ckpt, 1), strict=False)
    assert torch.equal(state["model"]["w"], _small_state()["model"]["w"])
    with pytest.raises(ValueError, match="missing in checkpoint: 'model.c'"):
        load_state_dict({"model": {"c": torch.zeros(1)}}, step_dir(small_ckpt, 1), strict=False)


# ---------------------------------------------------------------------- no code runs on load
class _WritesFile:
    """Unpickling it calls open(path, "w"): a harmless stand-in for arbitrary code."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


def _resign(directory):
    """Rewrite the manifest for the files as they are now: what a crafted (not merely damaged) checkpoint does."""
    manifest.write(directory, "torch", manifest.read(directory).save_id)


def test_crafted_metadata_is_refused(small_ckpt, tmp_path):
    marker = tmp_path / "ran"
    metadata_file = step_dir(small_ckpt, 1) / ".metadata"
    metadata_file.write_bytes(pickle.dumps(_WritesFile(marker)))
    _resign(step_dir(small_ckpt, 1))  # else the manifest refuses it first
    for attempt in (
        lambda: read_metadata(step_dir(small_ckpt, 1)),
        lambda: load_state_dict(_target(), step_dir(small_ckpt, 1)),
        lambda: load_full_state_dict(step_dir(small_ckpt, 1)),
    ):
        with pytest.raises(ValueError, match="not part of DCP metadata"):
            attempt()
    assert not marker.exists(), "loading the checkpoint ran code from its metadata"


def test_crafted_value_is_refused(tmp_path):
    marker = tmp_path / "ran"
    state = _small_state()
    state["extra"] = _WritesFile(marker)  # stored by DCP as pickled bytes
    save_state_dict(state, step_dir(tmp_path / "ckpt", 1))
    assert not marker.exists()
    target = _target()
    target["extra"] = None
    with pytest.raises(ValueError, match="checkpoint value 'extra' is not plain data"):
        load_state_dict(target, step_dir(tmp_path / "ckpt", 1))
    with pytest.raises(ValueError, match="checkpoint value 'extra' is not plain data"):
        load_full_state_dict(step_dir(tmp_path / "ckpt", 1))
    assert not marker.exists(), "loading the checkpoint ran code from a stored value"


# ---------------------------------------------------------------------- untrusted checkpoints
def _metadata_of(directory):
    with open(directory / ".metadata", "rb") as handle:
        return pickle.load(handle)  # the test's own file: plain pickle is fine here


def _write_metadata(directory, metadata, resign=True):
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    if resign:
        _resign(directory)


def test_storage_paths_outside_the_checkpoint_are_refused(tmp_path):
    """The issue's case: a .metadata whose relative_path leads to another checkpoint's data file."""
    save_state_dict(_small_state(), step_dir(tmp_path / "a", 1))
    other = _small_state()
    other["model"]["w"] += 100
    save_state_dict(other, step_dir(tmp_path / "b", 1))
    victim = step_dir(tmp_path / "a", 1)
    data_file = next(p.name for p in victim.iterdir() if p.suffix == ".distcp")
    for hostile in (f"../../b/step_1/{data_file}", str(step_dir(tmp_path / "b", 1) / data_file)):
        metadata = _metadata_of(victim)
        for info in metadata.storage_data.values():
            info.relative_path = hostile
        _write_metadata(victim, metadata)
        for attempt in (lambda: load_state_dict(_target(), step_dir(tmp_path / "a", 1)), lambda: load_full_state_dict(victim),
                        lambda: export_checkpoint(victim, tmp_path / "out.pt")):
            with pytest.raises(CheckpointError, match="is not a plain file name inside the checkpoint directory"):
                attempt()
    assert not (tmp_path / "out.pt").exists()


def test_planner_paths_cannot_grow_a_list(tmp_path):
    """The issue's case: an index near 10**12 in a key path; refused before any list is built."""
    save_state_dict(_small_state(), step_dir(tmp_path, 1))
    metadata = _metadata_of(step_dir(tmp_path, 1))
    metadata.planner_data["step"] = ("step", 10**12)
    _write_metadata(step_dir(tmp_path, 1), metadata)
    with pytest.raises(CheckpointError, match=r"the key path of 'step' is \('step', 1000000000000\)"):
        load_full_state_dict(step_dir(tmp_path, 1))


def test_a_flipped_byte_in_tensor_data_is_refused(small_ckpt):
    """DCP has no checksums; the manifest's SHA-256 catches what would otherwise load as other weights."""
    data_file = next(p for p in step_dir(small_ckpt, 1).iterdir() if p.suffix == ".distcp")
    raw = bytearray(data_file.read_bytes())
    raw[-100] ^= 0x10
    data_file.write_bytes(bytes(raw))
    state = _target()
    with pytest.raises(CheckpointError, match=f"file {data_file.name}: does not match the SHA-256"):
        load_state_dict(state, step_dir(small_ckpt, 1))
    assert not state["model"]["w"].any()


def test_a_stock_dcp_checkpoint_loads_only_when_asked(tmp_path):
    """No manifest (saved by plain dcp.save, as FSDP2 jobs do): refused naming the fix, then loaded with
    require_manifest=False, still under every structural check."""
    path = tmp_path / "stock"
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (load|save) in a single process")
        dcp.save(_small_state(), checkpoint_id=str(path))
        with pytest.raises(CheckpointError, match="has no fullshard.manifest.json: .* pass require_manifest=False"):
            load_state_dict(_target(), path)
        state = _target()
        load_state_dict(state, path, require_manifest=False)
        assert_same(state, _small_state())
        assert_same(load_full_state_dict(path, require_manifest=False), _small_state())
        metadata = _metadata_of(path)
        next(iter(metadata.storage_data.values())).offset = 10**12
        _write_metadata(path, metadata, resign=False)
        with pytest.raises(CheckpointError, match="not inside the file"):
            load_state_dict(_target(), path, require_manifest=False)


# ---------------------------------------------------------------------- atomic saves
_KILLED_SAVER = r"""
import os, sys, time
from pathlib import Path
import torch
from fullshard.torch.checkpoint import save_state_dict

# 64 MiB; DCP fsyncs each data file before it writes the metadata: stop there, mid-save.
state = {f"t{i}": torch.full((1 << 21,), float(i)) for i in range(8)}
def stall(fd):
    print("saving", flush=True)
    time.sleep(600)
os.fsync = stall
save_state_dict(state, Path(sys.argv[1]) / "step_2")
print("finished", flush=True)
"""


def test_killed_save_leaves_previous_checkpoint(tmp_path):
    root = tmp_path / "ckpt"
    save_state_dict(_small_state(), step_dir(root, 1))
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    log = tmp_path / "saver.log"
    with open(log, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-c", _KILLED_SAVER, str(root)], stdout=subprocess.PIPE, stderr=stderr,
            text=True, env=env, cwd=ROOT,
        )
    watchdog = threading.Timer(180, proc.kill)
    watchdog.start()
    try:
        line = proc.stdout.readline().strip()
        assert line == "saving", f"the saver did not reach the middle of its save:\n{log.read_text()[-3000:]}"
        partial = root / "step_2.partial"
        assert partial.is_dir() and not (partial / ".metadata").exists()
        assert any(p.suffix == ".distcp" for p in partial.iterdir())
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert latest_step(root) == 1
    state = _target()
    load_state_dict(state, step_dir(root, 1))
    assert_same(state, _small_state())
    # The next save of that step sweeps the leftover away.
    save_state_dict(_small_state(), step_dir(root, 2))
    assert latest_step(root) == 2
    assert sorted(p.name for p in root.iterdir()) == ["step_1", "step_2"]


def test_a_save_overwrites_a_step(tmp_path):
    save_state_dict(_small_state(), step_dir(tmp_path, 1))
    newer = _small_state()
    newer["model"]["w"] += 1
    save_state_dict(newer, step_dir(tmp_path, 1))
    state = _target()
    load_state_dict(state, step_dir(tmp_path, 1))
    assert_same(state, newer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]
    assert latest_step(tmp_path / "absent") is None
