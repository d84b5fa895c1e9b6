"""Sharded MindSpore checkpoints: resume 2->2 at another placement and 2->1, export for plain MindSpore,
refused checkpoints that change nothing, and a save interrupted by a killed worker."""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("mindspore")

from fullshard.checkpoint.formats import sharded_safetensors  # noqa: E402
from fullshard.checkpoint.publish import partial_dir  # noqa: E402
from fullshard.train.msrun import WorkerFailed, launch  # noqa: E402
from tests.harness import assert_scenario, suite_tests  # noqa: E402
from tests.ms_harness import run_ms_suite  # noqa: E402
from tests.ms_suite_checkpoint import SAVE_AT  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(tempfile.mkdtemp(prefix="fullshard-ms-ckpt-"))
results, test_scenario = suite_tests("tests.ms_suite_checkpoint:suite", world_sizes=(2,), runner=run_ms_suite,
                                     env={"FULLSHARD_CHECK_OWNERSHIP": "1", "FULLSHARD_TEST_OUT": str(OUT)},
                                     timeout=400)


@pytest.fixture(scope="module")
def single(results):
    assert_scenario(results, "resume_2_to_2_other_placement")
    proc = subprocess.run([sys.executable, "-m", "tests.ms_single", str(OUT)], cwd=ROOT, capture_output=True,
                          text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1", GLOG_v="3"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_resume_at_another_placement_continues_exactly(results):
    (data, _) = assert_scenario(results, "resume_2_to_2_other_placement")
    assert data["resumed"] == pytest.approx(data["losses"][SAVE_AT:], rel=1e-6, abs=1e-6)


def test_resume_on_one_process_matches_to_rounding(single):
    losses = json.loads((OUT / "losses.json").read_text())
    assert single["losses"] == pytest.approx(losses[SAVE_AT:], rel=1e-5, abs=1e-6)


def test_export_is_loaded_by_plain_mindspore_bit_for_bit(single):
    assert set(single["identical"]) == set(single["names"])
    assert all(single["identical"].values()), single["identical"]


def test_refusals_name_the_parameter(results):
    (messages, _) = assert_scenario(results, "bad_checkpoints_are_refused_and_change_nothing")
    assert set(messages) == {"shape", "missing", "unexpected", "edited", "crafted", "no optimizer state", "truncated"}


def test_a_worker_killed_mid_save_leaves_the_previous_checkpoint(tmp_path):
    with pytest.raises(WorkerFailed) as failure:
        launch("tests.ms_kill_save", [str(tmp_path)], 2, tmp_path / "run", timeout=240,
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
    """The checkpoint format, the MindSpore job, its GPT, the benchmark and the CLI work without torch."""
    subprocess.run([sys.executable, "-c",
                    "import sys; sys.modules['torch'] = None\n"
                    "import fullshard.mindspore.checkpoint, fullshard.checkpoint.formats.sharded_safetensors, fullshard.train.msrun\n"
                    "import fullshard.train.worker_mindspore, fullshard.train.report, fullshard.models.gpt_mindspore\n"
                    "import fullshard.bench, fullshard.bench.mindspore_runner, fullshard.cli\n"
                    "assert sys.modules['torch'] is None"], check=True, cwd=ROOT)
