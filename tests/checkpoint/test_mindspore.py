"""Sharded checkpoints of fullshard.mindspore: resume 2->2 at another placement and 2->1, export for plain
MindSpore, refused checkpoints that change nothing, and a save interrupted by a killed worker.

The scenarios run on 2 msrun workers (one launch; the sanitizer is on). Artifacts for the single-process half
(resume 2->1 and export, ``tests/checkpoint/ms_resume_alone.py``) go to ``$FULLSHARD_TEST_DIR``: the step-3
checkpoint, the full parameters saved in it and the uninterrupted run's losses.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("mindspore")

import numpy as np  # noqa: E402

import mindspore as ms  # noqa: E402
from mindspore import Tensor, nn, ops  # noqa: E402

import fullshard.mindspore as fs  # noqa: E402
from fullshard.checkpoint import manifest  # noqa: E402
from fullshard.checkpoint.formats import sharded_safetensors  # noqa: E402
from fullshard.checkpoint.formats.sharded_safetensors import METADATA_FILE  # noqa: E402
from fullshard.checkpoint.manifest import dumps_canonical  # noqa: E402
from fullshard.checkpoint.publish import RanksFailed, latest_step, partial_dir, step_dir  # noqa: E402
from fullshard.checkpoint.untrusted import CheckpointError  # noqa: E402
from fullshard.train.msrun import WorkerFailed, launch  # noqa: E402
from tests.conftest import Launch, scenario  # noqa: E402
from tests.mindspore.parity import (  # noqa: E402
    TinyLM, init_numpy, lm_batch, lm_loss, local_rows, rank, mean_over_ranks, wrap_layers,
)

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = Launch(world_sizes=(2,), runtime="mindspore", env={"FULLSHARD_CHECK_OWNERSHIP": "1"}, timeout_s=400)

STEPS, SAVE_AT, LR = 6, 3, 1e-2


def out_dir() -> Path:
    return Path(os.environ["FULLSHARD_TEST_DIR"])


def barrier() -> None:
    ops.AllReduce()(Tensor(np.ones(1, np.float32))).asnumpy()


def shard1(param):
    return fs.Shard(1) if param.ndim == 2 else fs.Shard(0)


def build(seed: int = 0, place=None, **model):
    net = init_numpy(TinyLM(**model), seed)
    wrap_layers(net, **({"shard_placement_fn": place} if place else {}))
    return net, nn.Adam(net.trainable_params(), learning_rate=LR)


def train(net, opt, steps) -> list[float]:
    losses = []
    for step in steps:
        ids, labels = lm_batch(step, 4)
        loss, grads = ms.value_and_grad(lambda: lm_loss(net, local_rows(ids), local_rows(labels)), None,
                                        opt.parameters)()
        opt(grads)
        losses.append(mean_over_ranks(float(loss.asnumpy())))
    return losses


def snapshot(net, opt) -> dict[str, np.ndarray]:
    """The whole model and this rank's optimizer state, to show a refused load changed nothing."""
    state = {f"model/{k}": v for k, v in fs.full_state_dict(net).items()}
    state.update({f"optim/{p.name}": p.asnumpy().copy() for p in opt.get_parameters()})
    return state


def _resumed_exactly(ranks: list) -> None:
    """Resumed at another placement, training continues exactly."""
    data = ranks[0]
    assert data["resumed"] == pytest.approx(data["losses"][SAVE_AT:], rel=1e-6, abs=1e-6)


@scenario(check=_resumed_exactly)
def resume_2_to_2_other_placement():
    """Save after step 3 with Shard(0); a fresh model sharded with Shard(1) and another init loads it and
    continues: its losses equal the uninterrupted run's."""
    root = out_dir()
    net, opt = build()
    losses = train(net, opt, range(SAVE_AT))
    fs.save_checkpoint(net, step_dir(root / "ckpt", SAVE_AT), opt)
    saved = fs.full_state_dict(net)
    losses += train(net, opt, range(SAVE_AT, STEPS))
    final = fs.full_state_dict(net)
    if rank() == 0:
        np.savez(root / "saved_params.npz", **saved)
        (root / "losses.json").write_text(json.dumps(losses))
    other, other_opt = build(seed=5, place=shard1)
    assert other.layers[0].fc1.weight.shape == (16, 4), other.layers[0].fc1.weight.shape  # cut along dim 1
    train(other, other_opt, range(1))  # an optimizer that has stepped already (its state is in its graph)
    fs.load_checkpoint(other, step_dir(root / "ckpt", SAVE_AT), other_opt)
    resumed = train(other, other_opt, range(SAVE_AT, STEPS))
    assert np.allclose(resumed, losses[SAVE_AT:], rtol=1e-6, atol=1e-6), (resumed, losses[SAVE_AT:])
    worst = 0.0
    for name, value in fs.full_state_dict(other).items():
        worst = max(worst, float(np.abs(value - final[name]).max()))
    assert worst < 1e-5, worst
    barrier()
    return {"losses": losses, "resumed": resumed, "max_param_error": worst}


def _load_fails(net, opt, path, *expected) -> str:
    before = snapshot(net, opt)
    try:
        fs.load_checkpoint(net, path, opt)
    except CheckpointError as error:
        message = str(error)
    else:
        raise AssertionError(f"loading {path} did not fail")
    for text in expected:
        assert text in message, (text, message)
    after = snapshot(net, opt)
    for name, value in before.items():
        assert np.array_equal(value, after[name]), f"{name} changed although the load was refused"
    lines = message.splitlines()
    return lines[min(1, len(lines) - 1)].strip()  # the first problem


def _every_refusal_names_the_parameter(ranks: list) -> None:
    messages = ranks[0]
    assert set(messages) == {"shape", "missing", "unexpected", "edited", "crafted", "no optimizer state", "truncated"}


@scenario(check=_every_refusal_names_the_parameter)
def bad_checkpoints_are_refused_and_change_nothing():
    root = out_dir() / "bad"
    net, opt = build()
    train(net, opt, range(1))
    good = root / "good"
    fs.save_checkpoint(net, good, opt)
    fs.save_checkpoint(net, root / "model_only", None)
    if rank() == 0:  # damaged and crafted copies
        for name in ("edited", "crafted", "truncated"):
            shutil.copytree(good, root / name)
        for name in ("edited", "crafted"):
            meta = json.loads((root / name / METADATA_FILE).read_text())
            meta["entries"]["model/norm.gamma"]["dtype"] = "float16"
            (root / name / METADATA_FILE).write_bytes(dumps_canonical(meta))
        save_id = manifest.read(root / "crafted").save_id
        manifest.write(root / "crafted", sharded_safetensors.FRAMEWORK, save_id)  # as a crafted checkpoint would
        with open(root / "truncated" / sharded_safetensors.rank_file(1), "r+b") as handle:
            handle.truncate(200)
    barrier()
    messages = {}
    wider, wider_opt = build(h=12)
    train(wider, wider_opt, range(1))
    messages["shape"] = _load_fails(wider, wider_opt, good, "shape mismatch for parameter 'layers.0.fc1.weight'",
                                    "checkpoint (16, 8)")
    deeper, deeper_opt = build(layers=3)
    messages["missing"] = _load_fails(deeper, deeper_opt, good, "missing in checkpoint: parameter 'layers.2.fc1.weight'")
    shallower, shallower_opt = build(layers=1)
    messages["unexpected"] = _load_fails(shallower, shallower_opt, good,
                                         "unexpected in checkpoint: parameter 'layers.1.fc1.weight'")
    messages["edited"] = _load_fails(net, opt, root / "edited", f"file {METADATA_FILE}: ",
                                     "changed or damaged after the save")
    messages["crafted"] = _load_fails(net, opt, root / "crafted", f"file {sharded_safetensors.rank_file(0)}: holds "
                                      "'model/norm.gamma' as float32", f"{METADATA_FILE} makes it float16")
    messages["no optimizer state"] = _load_fails(net, opt, root / "model_only",
                                                 "missing in checkpoint: optimizer state 'moment1.emb.embedding_table'")
    messages["truncated"] = _load_fails(net, opt, root / "truncated", sharded_safetensors.rank_file(1))
    fs.load_checkpoint(net, good, opt)  # the good one still loads into the model it came from
    barrier()
    return messages


@scenario
def a_failed_write_fails_every_rank_and_keeps_the_old_checkpoint():
    """Rank 1 cannot write: both ranks raise at once, naming rank 1 and why, and the previous checkpoint stays."""
    root = out_dir() / "failed_write"
    net, opt = build()
    fs.save_checkpoint(net, step_dir(root, 1), opt)
    saved = fs.full_state_dict(net)
    train(net, opt, range(1))
    original = sharded_safetensors.write_rank

    def refuse(directory, rank_index, pieces):
        if rank_index == 1:
            raise OSError(28, "No space left on device (simulated)")
        return original(directory, rank_index, pieces)

    sharded_safetensors.write_rank = refuse
    began = time.monotonic()
    try:
        fs.save_checkpoint(net, step_dir(root, 1), opt)
    except RanksFailed as error:
        message = str(error)
    else:
        raise AssertionError("the save did not fail")
    finally:
        sharded_safetensors.write_rank = original
    assert time.monotonic() - began < 10, "a rank waited for the failed one"
    assert "writing the files of" in message and "failed on rank 1: OSError: [Errno 28] No space left on device " \
        "(simulated)" in message and "the process group is still usable" in message, message
    assert latest_step(root) == 1 and partial_dir(step_dir(root, 1)).exists()
    check = sharded_safetensors.ShardedCheckpoint(step_dir(root, 1))
    for name, value in saved.items():
        assert np.array_equal(check.full(f"model/{name}").data, value), name
    train(net, opt, range(1, 2))  # the ranks are still in step: they train on and save again
    fs.save_checkpoint(net, step_dir(root, 2), opt)
    assert latest_step(root) == 2
    return message


# ---------------------------------------------------------------------- one process; a killed worker
@pytest.fixture(scope="module")
def single(scenario_data, scenario_dir):
    """The 2-worker checkpoint resumed (2 -> 1) and exported in one process, without distributed init."""
    scenario_data("resume_2_to_2_other_placement")
    proc = subprocess.run([sys.executable, "-m", "tests.checkpoint.ms_resume_alone", str(scenario_dir)], cwd=ROOT,
                          capture_output=True, text=True, timeout=240,
                          env=dict(os.environ, OMP_NUM_THREADS="1", GLOG_v="3"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_resume_on_one_process_matches_to_rounding(single, scenario_dir):
    losses = json.loads((scenario_dir / "losses.json").read_text())
    assert single["losses"] == pytest.approx(losses[SAVE_AT:], rel=1e-5, abs=1e-6)


def test_export_is_loaded_by_plain_mindspore_bit_for_bit(single):
    assert set(single["identical"]) == set(single["names"])
    assert all(single["identical"].values()), single["identical"]


def test_a_worker_killed_mid_save_leaves_the_previous_checkpoint(tmp_path):
    with pytest.raises(WorkerFailed) as failure:
        launch("tests.checkpoint.ms_killed_save", [str(tmp_path)], 2, tmp_path / "run", timeout=240,
               env={"PYTHONPATH": str(ROOT)})
    assert failure.value.rank == 1 and failure.value.exit_code == -9, str(failure.value)
    target = tmp_path / "ckpt"
    assert partial_dir(target).is_dir() and not (partial_dir(target) / sharded_safetensors.METADATA_FILE).exists()
    checkpoint = sharded_safetensors.ShardedCheckpoint(target)  # the complete one, untouched
    expected = np.load(tmp_path / "expected.npz")
    for name in expected.files:
        assert np.array_equal(checkpoint.full(f"model/{name}").data, expected[name]), name
    assert len(checkpoint.names("optim")) > 0
    sharded_safetensors.export_full(target, tmp_path / "model.safetensors")


def test_mindspore_paths_import_no_torch():
    """The checkpoint format, the MindSpore job, its GPT and MoE, the benchmark and the CLI work without torch."""
    subprocess.run([sys.executable, "-c",
                    "import sys; sys.modules['torch'] = None\n"
                    "import fullshard.mindspore.checkpoint, fullshard.checkpoint.formats.sharded_safetensors, fullshard.train.msrun\n"
                    "import fullshard.train.worker_mindspore, fullshard.train.report, fullshard.models.gpt_mindspore\n"
                    "import fullshard.models.moe_mindspore\n"
                    "import fullshard.bench, fullshard.bench.mindspore_runner, fullshard.cli\n"
                    "assert sys.modules['torch'] is None"], check=True, cwd=ROOT)

