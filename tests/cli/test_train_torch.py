"""The main job end to end (issue 6): fullshard train / estimate as a user runs them."""
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fullshard.checkpoint import latest_step
from fullshard.usage import format_bytes
from fullshard.models.gpt import GPT, MODEL_SIZES
from fullshard.plan.group import Strategy
from fullshard.plan.formulas import peak_state_bytes
from fullshard.train.models import count_units

ROOT = Path(__file__).resolve().parents[2]
TINY = ["--model", "tiny", "--batch-size", "4", "--nproc", "2"]


def fullshard(*args, timeout=300):
    return subprocess.run(
        [sys.executable, "-m", "fullshard", *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )


@pytest.fixture(scope="module")
def checkpointed_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    proc = fullshard("train", *TINY, "--steps", "20", "--verify", "--checkpoint-dir", str(out / "ckpt"),
                     "--checkpoint-every", "10", "--out", str(out / "report"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc


def test_train_writes_report_plot_and_data(checkpointed_run):
    out, proc = checkpointed_run
    report = json.loads((out / "report" / "report.json").read_text())
    assert report["steps"] == list(range(20)) and len(report["train_loss"]) == 20
    assert report["train_loss"][-1] < report["train_loss"][0]
    png = (out / "report" / "report.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    csv_lines = (out / "report" / "losses.csv").read_text().splitlines()
    assert csv_lines[0] == "step,train_loss,reference_loss" and len(csv_lines) == 21
    assert "report.png" in proc.stdout and "verify passed" in proc.stdout


def test_verify_matches_single_process_reference(checkpointed_run):
    out, _ = checkpointed_run
    report = json.loads((out / "report" / "report.json").read_text())
    assert report["max_loss_deviation"] < 1e-4


def test_report_memory_and_traffic_match_the_planning_code(checkpointed_run):
    out, _ = checkpointed_run
    report = json.loads((out / "report" / "report.json").read_text())
    theory = report["theory"]
    expected = peak_state_bytes(Strategy.OPTIM_GRADS_PARAMS, 2, theory["num_params"], 1)
    held = sum(r["param_bytes"] + r["grad_bytes"] + r["optim_bytes"] for r in report["ranks"]) / 2
    formula = expected["params"] + expected["grads"] + expected["optim"]
    assert abs(held - formula) / formula < 0.05  # measured within 5% of the formula
    for kind in ("all_gather", "reduce_scatter"):
        measured = report["ranks"][0]["traffic"][kind]
        assert abs(measured - theory["traffic"][kind]) / theory["traffic"][kind] < 0.05, kind


def test_export_writes_a_full_state_dict_without_processes(checkpointed_run, tmp_path):
    out, _ = checkpointed_run
    proc = fullshard("export", str(out / "ckpt" / "step_20"), str(tmp_path / "model.pt"), timeout=120)
    assert proc.returncode == 0, proc.stderr
    state = torch.load(tmp_path / "model.pt", weights_only=True)
    reference = GPT(MODEL_SIZES["tiny"]).state_dict()
    assert set(state) == set(reference) and all(state[k].shape == reference[k].shape for k in state)
    bad = fullshard("export", str(out / "report"), str(tmp_path / "x.pt"), timeout=60)
    assert bad.returncode == 2 and "not a complete checkpoint" in bad.stderr


def test_resume_reproduces_the_uninterrupted_run(checkpointed_run, tmp_path):
    out, _ = checkpointed_run
    full = json.loads((out / "report" / "report.json").read_text())
    # keep only the step-10 checkpoint, as if the run had stopped there
    ckpt = tmp_path / "ckpt"
    shutil.copytree(out / "ckpt" / "step_10", ckpt / "step_10")
    proc = fullshard("train", *TINY, "--steps", "20", "--resume", "--checkpoint-dir", str(ckpt),
                     "--out", str(tmp_path / "report"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    resumed = json.loads((tmp_path / "report" / "report.json").read_text())
    assert resumed["steps"] == list(range(10, 20))
    assert resumed["train_loss"] == full["train_loss"][10:]  # bit for bit


def test_resume_into_another_model_stops_before_the_workers(checkpointed_run, tmp_path):
    """The checkpoint directory records what shaped its model; resuming it with another --model is one line
    from the launcher, naming both, instead of a worker's traceback."""
    out, _ = checkpointed_run
    record = json.loads((out / "ckpt" / "fullshard.train.json").read_text())
    assert record == {"framework": "torch", "model": "tiny", "hf_config": None}
    proc = fullshard("train", "--model", "small", *TINY[2:], "--steps", "20", "--resume", "--checkpoint-dir",
                     str(out / "ckpt"), "--out", str(tmp_path / "report"), timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "trained with --model tiny" in lines[0] and "builds one with --model small" in lines[0]
    assert not (tmp_path / "report").exists(), "the job started"


def test_resume_at_the_last_step_has_nothing_to_train(checkpointed_run):
    """--resume of a finished run with its --steps: one line, exit 0, no worker, and the run's report byte for
    byte as it was (the workers used to overwrite it, then fail on the empty range of steps)."""
    out, _ = checkpointed_run
    report = out / "report"
    before = {name: (report / name).read_bytes() for name in ("report.json", "losses.csv", "report.png")}
    proc = fullshard("train", *TINY, "--steps", "20", "--resume", "--checkpoint-dir", str(out / "ckpt"),
                     "--out", str(report), timeout=60)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        f"fullshard train: the checkpoint under {out / 'ckpt'} is at step 20 and --steps is 20: nothing to train; "
        f"{report} is left as it was (pass a larger --steps to train on)"]
    assert {name: (report / name).read_bytes() for name in before} == before


@pytest.mark.parametrize("args, message", [
    (["train", "--strategy", "zero9"], "unknown --strategy 'zero9'"),
    (["train", "--nproc", "0"], "--nproc must be at least 1"),
    (["train", "--data", "/no/such/path"], "/no/such/path does not exist"),
    (["train", "--batch-size", "6", "--grad-accum", "4"], "must divide evenly"),
    (["estimate", "--nproc", "8", "--strategy", "zero9", "--params", "1e9"], "unknown --strategy"),
    (["train", "--model", "moe", "--ep", "3", "--batch-size", "4"], "--ep 3 must divide the 2 processes"),
    (["train", "--model", "tiny", "--ep", "2", "--batch-size", "4"], "expert parallelism needs --model moe"),
    (["train", "--model", "moe", "--ep", "2", "--strategy", "no_shard"], "shards over a 1-D mesh"),
    (["estimate", "--model", "moe", "--ep", "8", "--nproc", "8"], "--ep 8 must divide --nproc 8 and the model's 4"),
    (["estimate", "--model", "moe", "--ep", "2", "--nproc", "4", "--strategy", "no_shard"], "a sharding --strategy"),
])
def test_bad_arguments_give_one_clear_line(args, message):
    proc = fullshard(*args, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in proc.stderr


def test_estimate_prints_the_planning_formulas():
    proc = fullshard("estimate", "--params", "7e9", "--nproc", "64", "--strategy", "optim_grads_params",
                     "--mixed-precision", "bf16", "--optimizer", "adamw", timeout=60)
    assert proc.returncode == 0, proc.stderr
    expected = peak_state_bytes(Strategy.OPTIM_GRADS_PARAMS, 64, 7_000_000_000, 7_000_000_000 // 32, compute_bytes=2)
    assert format_bytes(expected["optim"]) in proc.stdout and format_bytes(expected["total"]) in proc.stdout


def test_estimate_counts_a_model_class_and_a_gpt_size():
    proc = fullshard("estimate", "--model", "medium", "--nproc", "2", timeout=60)
    assert proc.returncode == 0, proc.stderr
    units = count_units(GPT(MODEL_SIZES["medium"]))
    expected = peak_state_bytes(Strategy.OPTIM_GRADS_PARAMS, 2, units["num_params"], units["largest_unit"])
    assert format_bytes(expected["total"]) in proc.stdout
    bad = fullshard("estimate", "--model-class", "fullshard.models.gpt:GPT", "--nproc", "2", timeout=60)
    assert bad.returncode == 2 and "no arguments" in bad.stderr


@pytest.mark.parametrize("ep, nproc, verify", [(2, 4, True), (1, 2, False), (2, 2, False)])
def test_train_an_moe_with_expert_parallelism(tmp_path, ep, nproc, verify):
    """--model moe --ep 2 on 4 ranks (experts split over ep pairs, sharded over efsdp pairs, tokens by
    all-to-all) matches the single-process reference. The report shows the dense weights and the experts on
    their own meshes (--ep 1: all ranks, a group of their own; --ep 2 on 2 ranks: efsdp has one rank, so the
    experts are neither gathered nor reduced), measured as the formulas say, and so does estimate --ep."""
    proc = fullshard("train", "--model", "moe", "--ep", str(ep), "--nproc", str(nproc), "--batch-size", "8",
                     "--steps", "4" if verify else "2", *(["--verify"] if verify else []),
                     "--out", str(tmp_path / "report"), timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert report["config"]["ep"] == ep and (not verify or report["max_loss_deviation"] < 1e-4)
    if ep > 1:
        assert f"split over ep groups of {ep} (all-to-all tokens), sharded over efsdp {nproc // ep}" in proc.stdout
    from fullshard.models.moe import MoEGPT

    units = count_units(MoEGPT(MODEL_SIZES["moe"]))
    assert report["theory"]["num_params"] == units["num_params"]
    _measured_per_mesh_is_the_formula(report, proc.stdout, ep, nproc)
    estimate = fullshard("estimate", "--model", "moe", "--nproc", str(nproc), "--ep", str(ep), timeout=60)
    assert estimate.returncode == 0, estimate.stderr
    for row in report["meshes"]:  # the estimate's figures per mesh are what this run measured
        line = next(line for line in estimate.stdout.splitlines() if line.strip().startswith(row["roles"][0]))
        assert f"sharded over {row['shards']} ranks" in line, line
        assert f"params+grads+optim {format_bytes(row['held']).strip()}" in line, line
        if row["traffic"]["all_gather"]:
            assert f"all_gather {format_bytes(row['traffic']['all_gather']).strip()}" in line, line
    total = report["theory"]["memory"]["total"]
    assert format_bytes(total) in estimate.stdout


def _measured_per_mesh_is_the_formula(report: dict, stdout: str, ep: int, nproc: int) -> None:
    """Each mesh's bytes held and moved (rank 0) within 0.5% of its formula (beyond it: Adam's step counters,
    the counts of which parameters had gradients that a fused reduction carries), the meshes adding up to the rank's totals, the token exchange
    exactly as stated."""
    rows = report["meshes"]
    assert [row["roles"] for row in rows] == [["dense"], ["experts"]]
    assert [row["shards"] for row in rows] == [nproc, nproc // ep]
    rank0 = report["ranks"][0]
    for row in rows:
        assert row["held"] == pytest.approx(row["formula"]["held"], rel=5e-3), row
        for kind, formula in row["formula"]["traffic"].items():
            assert row["traffic"][kind] == pytest.approx(formula, rel=5e-3), (row["roles"], kind)
        assert f"{row['roles'][0]} sharded over {row['shards']} ranks" in stdout
    assert sum(row["held"] for row in rows) == rank0["param_bytes"] + rank0["grad_bytes"] + rank0["optim_bytes"]
    for kind in ("all_gather", "reduce_scatter", "all_reduce"):
        measured = rank0["traffic"].get(kind, 0)
        assert sum(row["traffic"][kind] for row in rows) == measured, kind
        assert measured == pytest.approx(report["theory"]["traffic"][kind], rel=5e-3), kind
    experts = rows[1]["traffic"]
    assert (experts["all_gather"] == 0) == (nproc == ep)  # a one-rank expert mesh moves nothing
    assert rank0["token_bytes"] == report["theory"].get("token_exchange", 0.0) and (rank0["token_bytes"] > 0) == (ep > 1)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="transformers is not installed")
def test_train_a_hugging_face_llama_from_config(tmp_path):
    proc = fullshard("train", "--hf-config", "llama", "--nproc", "2", "--batch-size", "4", "--steps", "6",
                     "--verify", "--out", str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["config"]["hf_config"] == "llama" and report["max_loss_deviation"] < 1e-4
    assert report["train_loss"][-1] < report["train_loss"][0]


def test_a_torchrun_rank_ends_without_finalizing_the_interpreter():
    """Under torchrun the command is the rank: it ends with os._exit, as a spawned worker does, so gloo threads
    still releasing the last collective's tensors cannot abort it during finalization (cli._end_torchrun_rank).
    An atexit handler would run at finalization: it must not."""
    script = ("import atexit, os, sys; atexit.register(lambda: print('finalized', flush=True)); "
              "os.environ.update(RANK='0', WORLD_SIZE='1'); from fullshard.cli import main; "
              "sys.exit(main(['train', '--strategy', 'zero9']))")
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown --strategy 'zero9'" in proc.stderr, proc.stderr
    assert "finalized" not in proc.stdout
    plain = subprocess.run([sys.executable, "-c", script.replace("os.environ.update(RANK='0', WORLD_SIZE='1'); ", "")],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 2 and "finalized" in plain.stdout  # outside torchrun the interpreter ends as usual


def test_runs_unchanged_under_torchrun_on_user_data(tmp_path):
    data = tmp_path / "texts"
    data.mkdir()
    for index in range(3):
        (data / f"part{index}.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 200)
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "fullshard", "train",
         "--model", "tiny", "--batch-size", "4", "--steps", "8", "--data", str(data), "--out", str(tmp_path / "out")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["world_size"] == 2 and report["train_loss"][-1] < report["train_loss"][0]
    assert proc.stdout.count("fullshard train:") == 1  # one report, from rank 0


@pytest.mark.parametrize("signal_number", [signal.SIGINT, signal.SIGTERM])
def test_interrupt_keeps_the_last_checkpoint_and_resume_continues(tmp_path, signal_number):
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [sys.executable, "-m", "fullshard", "train", *TINY, "--steps", "500", "--checkpoint-dir", str(ckpt),
         "--checkpoint-every", "2", "--out", str(tmp_path / "run")],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while latest_step(ckpt) is None:
            assert proc.poll() is None and time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.2)
        os.killpg(proc.pid, signal_number)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode != 0 and "interrupted" in err and "Traceback" not in err.splitlines()[-1]
    last = latest_step(ckpt)  # a save cut short stays ".partial" and is never taken as the latest
    assert last >= 2
    resumed = fullshard("train", *TINY, "--steps", str(last + 2), "--resume", "--checkpoint-dir", str(ckpt),
                        "--out", str(tmp_path / "resumed"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    report = json.loads((tmp_path / "resumed" / "report.json").read_text())
    assert report["steps"] == [last, last + 1]


def _training_workers(launcher_pid: int) -> list[int]:
    """PIDs of the processes the launcher spawned to train (children of any of its threads)."""
    children = []
    for task in Path(f"/proc/{launcher_pid}/task").iterdir():
        children += (task / "children").read_text().split()
    workers = []
    for child in set(children):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            workers.append(int(child))
    return workers


def test_a_dead_worker_is_reported_by_rank(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "fullshard", "train", *TINY, "--steps", "2000", "--out", str(tmp_path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        workers = []
        while len(workers) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "workers did not start"
            time.sleep(0.5)
            workers = _training_workers(proc.pid)
        time.sleep(5)  # let them reach the training loop
        os.kill(workers[0], signal.SIGKILL)
        _, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, err[-2000:]
    # the one killed (exit code -9) is named, not the survivors that stopped because of it
    assert re.search(r"rank \d failed first \(exit code -9\)", err.splitlines()[-1]), err[-2000:]
