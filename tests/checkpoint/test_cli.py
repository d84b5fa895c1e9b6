"""``fullshard export`` and ``fullshard train --resume`` on bad checkpoints: one line, exit status 2, no
traceback, and (for --resume) before any worker starts; on both frameworks' formats."""
import importlib.util
import json
import os
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from fullshard.checkpoint import manifest
from fullshard.checkpoint.formats import sharded_safetensors
from fullshard.checkpoint.formats.safetensors_file import Array
from fullshard.checkpoint.formats.sharded_safetensors import Piece
from fullshard.checkpoint import step_dir
from fullshard.torch.checkpoint import save_state_dict
from fullshard.train.config import RUN_RECORD

ROOT = Path(__file__).resolve().parents[2]
RESUME = ["train", "--model", "tiny", "--batch-size", "4", "--nproc", "2", "--steps", "6", "--resume"]


def fullshard(*args, timeout=120):
    env = dict(os.environ, PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    return subprocess.run([sys.executable, "-m", "fullshard", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)


def one_error_line(proc, command: str) -> str:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert lines[0].startswith(f"fullshard {command}: error: "), lines[0]
    return lines[0]


def _state():
    return {"model": {"w": torch.arange(12.0).reshape(3, 4)}, "step": 3}


@pytest.fixture
def torch_root(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        save_state_dict(_state(), step_dir(tmp_path / "ckpt", 3))
    return tmp_path / "ckpt"


def _flip_a_data_byte(directory: Path) -> str:
    victim = next(p for p in sorted(directory.iterdir()) if p.suffix in (".distcp", ".safetensors"))
    data = bytearray(victim.read_bytes())
    data[-5] ^= 0x01
    victim.write_bytes(bytes(data))
    return victim.name


def test_export_of_a_damaged_torch_checkpoint_is_one_line(torch_root, tmp_path):
    name = _flip_a_data_byte(step_dir(torch_root, 3))
    line = one_error_line(fullshard("export", step_dir(torch_root, 3), tmp_path / "out.pt"), "export")
    assert f"checkpoint {step_dir(torch_root, 3)}, file {name}: does not match the SHA-256" in line
    assert not (tmp_path / "out.pt").exists()


def test_export_of_a_stock_dcp_checkpoint_needs_the_flag(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(_state(), checkpoint_id=str(tmp_path / "stock"))
    line = one_error_line(fullshard("export", tmp_path / "stock", tmp_path / "out.pt"), "export")
    assert "has no fullshard.manifest.json" in line and "--without-manifest" in line
    proc = fullshard("export", tmp_path / "stock", tmp_path / "out.pt", "--without-manifest")
    assert proc.returncode == 0, proc.stderr
    assert torch.equal(torch.load(tmp_path / "out.pt", weights_only=True)["w"], _state()["model"]["w"])


def test_resume_from_a_damaged_checkpoint_is_one_line_before_any_worker_starts(torch_root, tmp_path):
    name = _flip_a_data_byte(step_dir(torch_root, 3))
    began = time.monotonic()
    proc = fullshard(*RESUME, "--checkpoint-dir", torch_root, "--out", tmp_path / "run")
    line = one_error_line(proc, "train")
    assert f"--resume: checkpoint {step_dir(torch_root, 3)}, file {name}: does not match the SHA-256" in line
    assert not (tmp_path / "run").exists(), "the job started"
    assert time.monotonic() - began < 60


def test_resume_with_no_checkpoint_is_one_line(tmp_path):
    line = one_error_line(fullshard(*RESUME, "--checkpoint-dir", tmp_path / "none", "--out", tmp_path / "run"), "train")
    assert f"--resume: no complete checkpoint under {tmp_path / 'none'}" in line


def _record(root: Path, **options) -> None:
    (root / RUN_RECORD).write_text(json.dumps({"framework": "torch", "model": "tiny", "hf_config": None, **options}))


@pytest.mark.parametrize("recorded, recorded_says, asked_says", [
    ({"model": "small"}, "--model small", "--model tiny"),
    ({"framework": "mindspore"}, "--framework mindspore", "--framework torch"),
    ({"model": "small", "framework": "mindspore"}, "--framework mindspore, --model small",
     "--framework torch, --model tiny"),
])
def test_resume_into_another_model_is_one_line_naming_the_options(torch_root, tmp_path, recorded, recorded_says,
                                                                  asked_says):
    _record(torch_root, **recorded)
    line = one_error_line(fullshard(*RESUME, "--checkpoint-dir", torch_root, "--out", tmp_path / "run"), "train")
    assert f"--resume: the checkpoints under {torch_root} hold a model trained with {recorded_says} (" in line, line
    assert f"this run builds one with {asked_says}: pass the former" in line and "another --checkpoint-dir" in line
    assert not (tmp_path / "run").exists(), "the job started"


def test_a_damaged_run_record_is_refused_in_one_line(torch_root, tmp_path):
    (torch_root / RUN_RECORD).write_text("[not, json")
    line = one_error_line(fullshard(*RESUME, "--checkpoint-dir", torch_root, "--out", tmp_path / "run"), "train")
    assert f"--resume: {torch_root / RUN_RECORD} is not a fullshard run record" in line
    (torch_root / RUN_RECORD).write_text("[1, 2]")
    line = one_error_line(fullshard(*RESUME, "--checkpoint-dir", torch_root, "--out", tmp_path / "run"), "train")
    assert "not a JSON object" in line
    (torch_root / RUN_RECORD).write_text("[" * 60_000)  # under the size limit, deeper than the parser goes
    line = one_error_line(fullshard(*RESUME, "--checkpoint-dir", torch_root, "--out", tmp_path / "run"), "train")
    assert "is not a fullshard run record" in line
    (torch_root / RUN_RECORD).write_text(" " * 70_000)
    line = one_error_line(fullshard(*RESUME, "--checkpoint-dir", torch_root, "--out", tmp_path / "run"), "train")
    assert "larger than 65536 bytes" in line


def test_the_same_model_passes_the_record_and_reaches_the_checkpoint_check(torch_root, tmp_path):
    _record(torch_root)  # the same options: the record says nothing, the damaged checkpoint does
    name = _flip_a_data_byte(step_dir(torch_root, 3))
    line = one_error_line(fullshard(*RESUME, "--checkpoint-dir", torch_root, "--out", tmp_path / "run"), "train")
    assert f"file {name}: does not match the SHA-256" in line


# ---------------------------------------------------------------------- the MindSpore format (numpy only)
def _mindspore_checkpoint(directory: Path) -> None:
    """A 2-rank checkpoint of one (4, 3) parameter cut along dim 0, as save_checkpoint writes it."""
    directory.mkdir(parents=True)
    full = np.arange(12, dtype=np.float32).reshape(4, 3)
    pieces = [Piece("model/w", (4, 3), "float32", 0, 2 * r, 2, Array(full[2 * r:2 * r + 2], "float32")) for r in (0, 1)]
    for rank, piece in enumerate(pieces):
        sharded_safetensors.write_rank(directory, rank, [piece])
    save_id = uuid.uuid4().hex
    sharded_safetensors.write_metadata(directory, 2, pieces[:1], save_id)
    manifest.write(directory, sharded_safetensors.FRAMEWORK, save_id)


def test_export_of_a_damaged_mindspore_checkpoint_is_one_line(tmp_path):
    _mindspore_checkpoint(tmp_path / "ckpt" / "step_3")
    proc = fullshard("export", tmp_path / "ckpt" / "step_3", tmp_path / "ok.safetensors")
    assert proc.returncode == 0, proc.stderr
    name = _flip_a_data_byte(tmp_path / "ckpt" / "step_3")
    line = one_error_line(fullshard("export", tmp_path / "ckpt" / "step_3", tmp_path / "out.safetensors"), "export")
    assert f"file {name}: does not match the SHA-256" in line and not (tmp_path / "out.safetensors").exists()


@pytest.mark.skipif(importlib.util.find_spec("mindspore") is None, reason="MindSpore is not installed")
def test_mindspore_resume_from_a_damaged_checkpoint_is_one_line(tmp_path):
    _mindspore_checkpoint(tmp_path / "ckpt" / "step_3")
    (tmp_path / "ckpt" / "step_3" / sharded_safetensors.METADATA_FILE).write_bytes(b"{}")
    proc = fullshard(*RESUME, "--framework", "mindspore", "--checkpoint-dir", tmp_path / "ckpt",
                     "--out", tmp_path / "run")
    line = one_error_line(proc, "train")
    assert f"--resume: checkpoint {tmp_path / 'ckpt' / 'step_3'}, file {sharded_safetensors.METADATA_FILE}: is 2 bytes" in line
    assert not (tmp_path / "run").exists(), "the job started"
