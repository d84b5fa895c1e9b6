"""Checkpoints: state dicts and DCP on 2 and 4 gloo ranks, then single-process loading, export and safety.

The 2-rank suite saves a model + AdamW checkpoint and its full state
(``expected_ws2.pt``); the 4-rank suite reloads it at another world size and
saves again; the tests below load both in this process, with no process group,
and compare bit for bit.
"""
import os
import pickle
import signal
import subprocess
import sys
import threading
import warnings

import pytest
import torch
import torch.distributed as dist
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
from fullshard.models.gpt import GPT
from tests.harness import ROOT, assert_scenario, run_suite
from tests.suite_checkpoint import CFG, assert_same
from tests.suite_checkpoint import suite as suite2
from tests.suite_checkpoint4 import suite as suite4



@pytest.fixture(scope="module")
def ckpt_root(tmp_path_factory):
    return tmp_path_factory.mktemp("checkpoints")


@pytest.fixture(scope="module")
def results(ckpt_root):
    return run_suite("tests.suite_checkpoint:suite", 2, timeout=900, env={"FULLSHARD_TEST_CKPT": str(ckpt_root)})


@pytest.fixture(scope="module")
def results4(results, ckpt_root):
    assert_scenario(results, "dcp_save_world_size_2")  # the checkpoint the 4-rank suite loads
    return run_suite("tests.suite_checkpoint4:suite", 4, timeout=900, env={"FULLSHARD_TEST_CKPT": str(ckpt_root)})


@pytest.mark.parametrize("name", list(suite2()))
def test_two_ranks(results, name):
    assert_scenario(results, name)


@pytest.mark.parametrize("name", list(suite4()))
def test_four_ranks(results4, name):
    assert_scenario(results4, name)


# ---------------------------------------------------------------------- world size 1, export
def _expected(ckpt_root, name):
    return torch.load(ckpt_root / name, weights_only=True)


@pytest.mark.parametrize("saved", [("ws2", 2, "expected_ws2.pt"), ("ws4", 3, "expected_ws4.pt")], ids=["ws2", "ws4"])
def test_load_at_world_size_1(results, results4, ckpt_root, saved):
    """A plain, unsharded GPT in this process (no process group) loads the sharded checkpoint exactly."""
    folder, step, expected_file = saved
    assert_scenario(results4, "save_world_size_4")
    assert not dist.is_initialized()
    torch.manual_seed(9)
    model = GPT(CFG)
    load_checkpoint(model, step_dir(ckpt_root / folder, step))  # no optimizer: its entries are not read
    expected = _expected(ckpt_root, expected_file)["model"]
    for name, param in model.named_parameters(remove_duplicate=False):
        assert torch.equal(param, expected[name]), name
    assert not dist.is_initialized()


def test_load_full_state_dict_nested(results, ckpt_root):
    """load_full_state_dict rebuilds the saved nesting, optimizer state and param_groups included."""
    assert_scenario(results, "dcp_save_world_size_2")
    assert_same(load_full_state_dict(step_dir(ckpt_root / "ws2", 2)), _expected(ckpt_root, "expected_ws2.pt"))


def test_export_checkpoint_pt(results, ckpt_root, tmp_path):
    assert_scenario(results, "dcp_save_world_size_2")
    expected = _expected(ckpt_root, "expected_ws2.pt")
    path = step_dir(ckpt_root / "ws2", 2)
    everything = export_checkpoint(path, tmp_path / "full.pt", key=None)
    assert_same(torch.load(everything, weights_only=True), expected)
    model_file = export_checkpoint(path, tmp_path / "model.pt")  # the model, by default
    exported = torch.load(model_file, weights_only=True)
    assert_same(exported, expected["model"])
    model = GPT(CFG)
    model.load_state_dict(exported)  # a plain model takes it as is (strict)
    assert not dist.is_initialized(), "export must not start a process group"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["full.pt", "model.pt"]  # no partial files left


def test_export_checkpoint_safetensors(results, ckpt_root, tmp_path):
    safetensors_torch = pytest.importorskip("safetensors.torch")
    assert_scenario(results, "dcp_save_world_size_2")
    path = step_dir(ckpt_root / "ws2", 2)
    out = export_checkpoint(path, tmp_path / "model.safetensors")
    loaded = safetensors_torch.load_file(str(out))
    assert_same(loaded, _expected(ckpt_root, "expected_ws2.pt")["model"])
    with pytest.raises(ValueError, match="safetensors holds tensors only"):
        export_checkpoint(path, tmp_path / "all.safetensors", key=None)  # param_groups are not tensors


def test_export_checkpoint_rejects_unknown_format_and_key(results, ckpt_root, tmp_path):
    assert_scenario(results, "dcp_save_world_size_2")
    with pytest.raises(ValueError, match="unknown format"):
        export_checkpoint(step_dir(ckpt_root / "ws2", 2), tmp_path / "model.bin")
    with pytest.raises(ValueError, match="has no entry 'weights'; it has \\['model', 'optim'\\]"):
        export_checkpoint(step_dir(ckpt_root / "ws2", 2), tmp_path / "model.pt", key="weights")


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
