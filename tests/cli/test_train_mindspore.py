"""``fullshard train --framework mindspore`` end to end: 2 msrun workers, --verify, checkpoints, --resume bit
for bit, the report next to the formulas (with the CPU emulation's bytes), export, a killed worker named by
rank, and one line for what MindSpore cannot do."""
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

pytest.importorskip("mindspore")

import numpy as np  # noqa: E402

from fullshard.checkpoint.formats import sharded_safetensors  # noqa: E402
from fullshard.checkpoint.formats.safetensors_file import TensorFile  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TINY = ["train", "--framework", "mindspore", "--model", "tiny", "--batch-size", "4", "--nproc", "2"]
STEPS, EVERY = 6, 3


def fullshard(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "fullshard", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)


def verified_run(out, args: list[str], steps: int, every: int):
    """One --verify run with checkpoints every ``every`` steps: (its folder, the process, report.json)."""
    proc = fullshard(*args, "--steps", str(steps), "--verify", "--checkpoint-dir", str(out / "ckpt"),
                     "--checkpoint-every", str(every), "--out", str(out / "report"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return out, proc, json.loads((out / "report" / "report.json").read_text())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return verified_run(tmp_path_factory.mktemp("ms_run"), TINY, STEPS, EVERY)


def test_trains_verifies_and_writes_the_report(run):
    out, proc, report = run
    assert report["framework"] == "mindspore" and report["world_size"] == 2
    assert report["steps"] == list(range(STEPS)) and report["train_loss"][-1] < report["train_loss"][0]
    assert report["max_loss_deviation"] < 1e-4 and "verify passed" in proc.stdout
    assert (out / "report" / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "report" / "losses.csv").read_text().splitlines()[0] == "step,train_loss,reference_loss"
    assert proc.stdout.count("step ") >= STEPS  # the progress lines of rank 0, as they came
    assert "CPU emulation carries" in proc.stdout


def test_memory_and_traffic_next_to_the_formulas(run):
    _, _, report = run
    theory = report["theory"]
    formula = theory["memory"]["params"] + theory["memory"]["grads"] + theory["memory"]["optim"]
    for rank in report["ranks"]:  # the tiny GPT's dims are even: every rank holds exactly 1/2
        assert rank["param_bytes"] + rank["grad_bytes"] + rank["optim_bytes"] == formula, rank
    measured = report["ranks"][0]["traffic"]
    # CPU: the reduce-scatter travels as an all-reduce; what travelled is what the emulation carries
    assert measured["reduce_scatter"] == 0 and theory["traffic"]["reduce_scatter"] > 0
    carried = theory["carried"]
    assert measured["all_gather"] == carried["all_gather"]
    assert measured["all_reduce"] == carried["all_reduce"] + 4  # + clip_grad_norm's one fp32 norm
    assert theory["carried_sent"] > theory["sent"]


def resume_matches(verified, args: list[str], steps: int, every: int, tmp_path) -> None:
    """--resume from a copy of the verified run's checkpoint at ``every`` retrains the last steps bit for bit."""
    out, _, full = verified
    shutil.copytree(out / "ckpt" / f"step_{every}", tmp_path / "ckpt" / f"step_{every}")
    proc = fullshard(*args, "--steps", str(steps), "--resume", "--checkpoint-dir", str(tmp_path / "ckpt"),
                     "--out", str(tmp_path / "report"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    resumed = json.loads((tmp_path / "report" / "report.json").read_text())
    assert resumed["steps"] == list(range(every, steps))
    assert resumed["train_loss"] == full["train_loss"][every:]


def test_resume_continues_bit_for_bit(run, tmp_path):
    resume_matches(run, TINY, STEPS, EVERY, tmp_path)


def test_resume_into_another_model_stops_before_the_workers(run, tmp_path):
    """The checkpoint directory records what shaped its model; resuming it with another --model is one line
    from the launcher, naming both, instead of a worker's traceback."""
    out, _, _ = run
    record = json.loads((out / "ckpt" / "fullshard.train.json").read_text())
    assert record == {"framework": "mindspore", "model": "tiny", "hf_config": None}
    proc = fullshard(*TINY[:4], "small", *TINY[5:], "--steps", str(STEPS), "--resume", "--checkpoint-dir",
                     str(out / "ckpt"), "--out", str(tmp_path / "report"), timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "trained with --model tiny" in lines[0] and "builds one with --model small" in lines[0]
    assert not (tmp_path / "report").exists(), "the job started"


def test_resume_at_the_last_step_has_nothing_to_train(run):
    """The launcher's check (tests/cli/test_train_torch.py has the torch run's): one line, exit 0, the report as
    it was."""
    out, _, _ = run
    report = out / "report"
    before = {name: (report / name).read_bytes() for name in ("report.json", "losses.csv", "report.png")}
    proc = fullshard(*TINY, "--steps", str(STEPS), "--resume", "--checkpoint-dir", str(out / "ckpt"),
                     "--out", str(report), timeout=60)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        f"fullshard train: the checkpoint under {out / 'ckpt'} is at step {STEPS} and --steps is {STEPS}: nothing "
        f"to train; {report} is left as it was (pass a larger --steps to train on)"]
    assert {name: (report / name).read_bytes() for name in before} == before


def test_export_of_a_training_checkpoint(run, tmp_path):
    out, _, _ = run
    proc = fullshard("export", str(out / "ckpt" / f"step_{STEPS}"), str(tmp_path / "gpt.safetensors"), timeout=60)
    assert proc.returncode == 0, proc.stderr
    exported = TensorFile(tmp_path / "gpt.safetensors")
    checkpoint = sharded_safetensors.ShardedCheckpoint(out / "ckpt" / f"step_{STEPS}")
    assert exported.names() == checkpoint.names("model") and "wte.embedding_table" in exported.names()
    assert exported.shape("layers.0.attn.qkv.weight") == (192, 64)
    bad = fullshard("export", str(out / "report"), str(tmp_path / "x.safetensors"), "--framework", "mindspore",
                    timeout=60)
    assert bad.returncode == 2 and "not a complete MindSpore checkpoint" in bad.stderr


def test_a_killed_worker_fails_the_job_fast_naming_its_rank(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "fullshard", *TINY, "--steps", "2000", "--out", str(tmp_path)],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        pid_file, progress = tmp_path / "msrun" / "rank_1.pid", tmp_path / "msrun" / "progress.log"
        deadline = time.monotonic() + 180
        while not (pid_file.exists() and progress.exists() and progress.read_text().count("\n") >= 1):  # step 1 done
            assert proc.poll() is None and time.monotonic() < deadline, "training did not start"
            time.sleep(0.5)
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
        killed = time.monotonic()
        _, err = proc.communicate(timeout=120)
        elapsed = time.monotonic() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 1, err[-2000:]
    assert re.search(r"rank 1 failed first \(exit code -9\)", err.strip().splitlines()[-1]), err[-2000:]
    assert elapsed < 20, elapsed  # not msrun's heartbeat timeout


@pytest.mark.parametrize("args, message", [
    (["--mixed-precision", "bf16"], "no bf16 kernels on CPU; use fp16"),
    (["--hf-config", "llama"], "--hf-config builds a Hugging Face torch model"),
    (["--device", "cuda"], "--device cuda with --framework mindspore"),
    (["--strategy", "zero9"], "unknown --strategy 'zero9'"),
    (["--model", "moe", "--ep", "2"], "--ep 2 with --framework mindspore: MindSpore 2.10's CPU backend has no "
                                      "all-to-all"),
    (["--model", "moe", "--nproc", "3"], "shards its 4 experts over 3 ranks, leaving a rank an empty shard"),
])
def test_unsupported_combinations_get_one_line(args, message):
    proc = fullshard("train", "--framework", "mindspore", *args, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr


# ---------------------------------------------------------------------------------------------- --model moe
MOE = ["train", "--framework", "mindspore", "--model", "moe", "--batch-size", "4", "--nproc", "2"]
MOE_STEPS, MOE_EVERY = 3, 2


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    return verified_run(tmp_path_factory.mktemp("ms_moe"), MOE, MOE_STEPS, MOE_EVERY)


def test_moe_experts_are_units_of_their_own_and_training_matches_one_process(moe_run):
    """--model moe on 2 msrun workers: every block's experts are a unit of their own (mindformers' wrapping) on the
    same 2-rank mesh as the rest, and the losses match one process step by step."""
    from fullshard.models.config import MODEL_SIZES

    _, proc, report = moe_run
    cfg = MODEL_SIZES["moe"]
    assert report["max_loss_deviation"] < 1e-4 and "verify passed" in proc.stdout
    assert report["steps"] == list(range(MOE_STEPS)) and report["train_loss"][-1] < report["train_loss"][0]
    units = 2 * cfg.n_layers + 1  # per block its experts and the rest of it, and the root
    assert report["experts"] == {"experts": cfg.n_experts, "top_k": cfg.top_k, "units": cfg.n_layers,
                                 "units_in_all": units}
    assert f"a unit of their own in {cfg.n_layers} blocks ({units} units in all)" in proc.stdout
    # ZeRO-3, every unit's parameters in one fused gather: each unit gathers for forward and all but the root again
    # for backward; each reduces once (an all-reduce on CPU), and clipping sums one norm
    assert report["ranks"][0]["calls"] == {"all_gather": 2 * units - 1, "reduce_scatter": 0, "all_reduce": units + 1}
    theory = report["theory"]
    assert report["ranks"][0]["traffic"]["all_gather"] == theory["carried"]["all_gather"]
    formula = theory["memory"]["params"] + theory["memory"]["grads"] + theory["memory"]["optim"]
    for rank in report["ranks"]:  # every dim 0 (4 experts included) is even: each rank holds exactly half
        assert rank["param_bytes"] + rank["grad_bytes"] + rank["optim_bytes"] == formula, rank


def test_moe_resumes_bit_for_bit_and_exports(moe_run, tmp_path):
    resume_matches(moe_run, MOE, MOE_STEPS, MOE_EVERY, tmp_path)
    out = moe_run[0]
    proc = fullshard("export", str(out / "ckpt" / f"step_{MOE_EVERY}"), str(tmp_path / "moe.safetensors"), timeout=60)
    assert proc.returncode == 0, proc.stderr
    exported = TensorFile(tmp_path / "moe.safetensors")
    assert exported.shape("layers.1.moe.experts.w_in") == (4, 64, 128)
    assert exported.shape("layers.1.moe.experts.w_out") == (4, 128, 64)


def test_moe_is_the_torch_moe():
    """``--model moe`` is one model on both frameworks: the same parameters (MindSpore's names for them), and with
    the MindSpore Cell's weights the torch module computes the same logits."""
    torch = pytest.importorskip("torch")
    import mindspore as ms

    from fullshard.models.config import MODEL_SIZES
    from fullshard.models.moe import MoEGPT as TorchMoEGPT
    from fullshard.models.moe_mindspore import MoEGPT

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    cell, module = MoEGPT(MODEL_SIZES["moe"], seed=1), TorchMoEGPT(MODEL_SIZES["moe"])
    torch_names = {"embedding_table": "weight", "gamma": "weight", "beta": "bias"}
    weights = {}
    for name, param in cell.parameters_and_names():
        head, _, leaf = name.rpartition(".")
        weights[f"{head}.{torch_names.get(leaf, leaf)}"] = torch.from_numpy(param.asnumpy())
    assert set(weights) == {name for name, _ in module.named_parameters()}
    module.load_state_dict({**weights, "lm_head.weight": weights["wte.weight"]})
    tokens = np.random.default_rng(0).integers(0, 256, (2, MODEL_SIZES["moe"].seq_len))
    with torch.no_grad():
        want = module(torch.from_numpy(tokens)).numpy()
    got = cell(ms.Tensor(tokens.astype(np.int32))).asnumpy()
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
