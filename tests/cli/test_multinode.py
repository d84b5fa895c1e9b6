"""Past one machine (issue 23): two launcher agents on this host stand for two nodes of 2 ranks each.

torch: two torchrun agents (c10d rendezvous) train with HSDP, the default across nodes, and with plain FSDP
over all 4 ranks, both against the single-process reference; the 2 x 2 checkpoint resumes on one node of 2
ranks and of 4. MindSpore: two `fullshard train --nnodes 2 --node-rank R` (each one msrun with
--worker_num 4 --local_worker_num 2 --node_rank R) do the same. On both, killing every process of node 1
mid-step fails node 0 within 60 s, naming ranks 2 and 3, with the last checkpoint complete. Each node has an
--out of its own, as on two machines, and they share --checkpoint-dir (a shared file system). Every process
a test starts carries a tag in its environment, so the test can tell that none was left behind.
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from fullshard.checkpoint import latest_step
from fullshard.train.procs import descendants, free_port

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TINY = ["--model", "tiny", "--batch-size", "4"]
TAG = "FULLSHARD_MULTINODE_TEST"
HELD_PER_PARAM = 16  # fp32 AdamW: 4 bytes of parameter, 4 of gradient, 8 of moments


def _tagged(tag: str) -> list[int]:
    """The processes still alive whose environment carries ``tag``."""
    found = []
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and f"{TAG}={tag}".encode() in Path(f"/proc/{entry}/environ").read_bytes():
                found.append(int(entry))
        except OSError:
            continue
    return found


class Nodes:
    """One command per node, started node 0 first (it hosts the rendezvous), each in a session of its own."""

    def __init__(self, commands: list[list[str]], out: Path) -> None:
        self.out, self.tag = out, uuid.uuid4().hex
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
        env[TAG] = self.tag
        out.mkdir(parents=True, exist_ok=True)
        self.procs = []
        for node, command in enumerate(commands):
            self.procs.append(subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=open(out / f"node{node}.out", "w"),
                stderr=open(out / f"node{node}.err", "w"), start_new_session=True))
            time.sleep(0.5)

    def wait(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        return [proc.wait(timeout=max(1.0, deadline - time.monotonic())) for proc in self.procs]

    def kill_node(self, node: int) -> None:
        """SIGKILL every process of ``node``: its launcher and everything below it, at once."""
        tree = [self.procs[node].pid] + descendants(self.procs[node].pid)
        for pid in tree:
            os.kill(pid, signal.SIGKILL)

    def stop(self) -> None:
        """Whatever is still running (after a failure) goes; then nothing tagged may remain."""
        for pid in _tagged(self.tag):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def left_behind(self) -> list[int]:
        time.sleep(1.0)  # a process that is on its way out
        return _tagged(self.tag)

    def text(self, node: int, stream: str = "out") -> str:
        return (self.out / f"node{node}.{stream}").read_text()


def torchrun_nodes(out: Path, *args: str) -> Nodes:
    endpoint = f"127.0.0.1:{free_port()}"
    command = [str(BIN / "torchrun"), "--nnodes", "2", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", endpoint, "-m", "fullshard", "train", *TINY, *args]
    return Nodes([command + ["--out", str(out / f"n{node}")] for node in (0, 1)], out)


def fullshard_nodes(out: Path, *args: str) -> Nodes:
    port = str(free_port())
    return Nodes([[sys.executable, "-m", "fullshard", "train", "--nnodes", "2", "--node-rank", str(node),
                   "--master-addr", "127.0.0.1", "--master-port", port, "--nproc", "2", *TINY, *args,
                   "--out", str(out / f"n{node}")] for node in (0, 1)], out)


def fullshard(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "fullshard", "train", *TINY, *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def finished(nodes: Nodes, timeout: float) -> dict:
    """Both nodes succeeded and left nothing behind; node 0's report (in the --out of the one that was node 0)."""
    try:
        codes = nodes.wait(timeout)
        left = nodes.left_behind()
    finally:
        nodes.stop()
    assert codes == [0, 0], nodes.text(0, "err")[-3000:] + nodes.text(1, "err")[-3000:]
    assert left == []
    (report,) = [p for p in (nodes.out / "n0" / "report.json", nodes.out / "n1" / "report.json") if p.exists()]
    return json.loads(report.read_text())


def held(rank: dict) -> int:
    return rank["param_bytes"] + rank["grad_bytes"] + rank["optim_bytes"]


def assert_two_nodes(report: dict, nodes: Nodes, node_1: int = 1) -> None:
    """Ranks 0-1 ran on node 0 and 2-3 on node 1, each node's pair started by an agent of its own; the
    command started ``node_1``-th printed node 1's own summary."""
    assert {k: v["ranks"] for k, v in report["nodes"].items()} == {"0": [0, 1], "1": [2, 3]}
    agents = [v["launcher_pids"] for _, v in sorted(report["nodes"].items())]
    assert len(agents[0]) == len(agents[1]) == 1 and agents[0] != agents[1], agents
    assert "node 1 of 2 finished: ranks 2, 3" in nodes.text(node_1)


def torchrun_node_1(report: dict, nodes: Nodes) -> int:
    """Which agent c10d made node 1 (it numbers them by sorting their ids, not by start order): the
    workers' parent, each of the two torchrun processes."""
    agents = [v["launcher_pids"] for _, v in sorted(report["nodes"].items())]
    assert sorted(agents) == sorted([p.pid] for p in nodes.procs), agents
    return [p.pid for p in nodes.procs].index(agents[1][0])


# ---------------------------------------------------------------------- torch
@pytest.fixture(scope="module")
def torch_hsdp(tmp_path_factory):
    out = tmp_path_factory.mktemp("torch_hsdp")
    nodes = torchrun_nodes(out, "--steps", "6", "--verify", "--checkpoint-dir", str(out / "ckpt"),
                           "--checkpoint-every", "3")
    return nodes, finished(nodes, 300)


def test_torchrun_agents_train_hsdp_by_default_like_the_reference(torch_hsdp):
    nodes, report = torch_hsdp
    node_1 = torchrun_node_1(report, nodes)
    assert_two_nodes(report, nodes, node_1)
    assert report["mesh"]["kind"] == "hsdp" and "chosen by default for 2 nodes" in nodes.text(1 - node_1)
    for rank in report["ranks"]:  # what the parameters really are, on every rank
        assert rank["mesh_shape"] == [2, 2] and rank["placements"] == "(Replicate(), Shard(dim=0))", rank
        assert abs(held(rank) - HELD_PER_PARAM * report["theory"]["num_params"] / 2) < 0.01 * held(rank)
    traffic, theory = report["ranks"][0]["traffic"], report["theory"]["traffic"]
    assert traffic["all_reduce"] > 0 and abs(traffic["all_reduce"] - theory["all_reduce"]) < 0.02 * theory["all_reduce"]
    assert report["max_loss_deviation"] < 1e-4 and "verify passed" in nodes.text(0)


def test_torchrun_agents_train_plain_fsdp_over_all_four_ranks(tmp_path):
    nodes = torchrun_nodes(tmp_path, "--mesh", "fsdp", "--steps", "4", "--verify")
    report = finished(nodes, 300)
    assert_two_nodes(report, nodes, torchrun_node_1(report, nodes))
    for rank in report["ranks"]:
        assert rank["mesh_shape"] == [4] and rank["placements"] == "(Shard(dim=0),)", rank
        assert abs(held(rank) - HELD_PER_PARAM * report["theory"]["num_params"] / 4) < 0.02 * held(rank)
    assert report["ranks"][0]["traffic"].get("all_reduce", 0) == 0  # no replicas to all-reduce across
    assert report["max_loss_deviation"] < 1e-4


@pytest.mark.parametrize("nproc", [2, 4])
def test_the_2x2_checkpoint_resumes_on_one_node(torch_hsdp, tmp_path, nproc):
    nodes, hsdp = torch_hsdp
    shutil.copytree(nodes.out / "ckpt" / "step_3", tmp_path / "ckpt" / "step_3")
    proc = fullshard("--nproc", str(nproc), "--steps", "6", "--resume", "--checkpoint-dir", str(tmp_path / "ckpt"),
                     "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["steps"] == [3, 4, 5] and report["ranks"][0]["mesh_shape"] == [nproc]
    assert max(abs(a - b) for a, b in zip(report["train_loss"], hsdp["reference_loss"][3:])) < 1e-4


def test_a_killed_node_fails_the_other_fast_naming_its_ranks(tmp_path):
    from fullshard.torch.checkpoint import load_full_state_dict

    nodes = fullshard_nodes(tmp_path, "--steps", "40", "--checkpoint-dir", str(tmp_path / "ckpt"),
                            "--checkpoint-every", "1")
    try:
        elapsed, err = _kill_node_1_after_a_checkpoint(nodes, tmp_path / "ckpt")
        left = nodes.left_behind()
    finally:
        nodes.stop()
    _assert_lost_node_1(nodes, elapsed, err, left, tmp_path / "ckpt")
    state = load_full_state_dict(tmp_path / "ckpt" / f"step_{latest_step(tmp_path / 'ckpt')}")  # complete: it loads
    assert state["model"]["wte.weight"].shape == (256, 64)


def _kill_node_1_after_a_checkpoint(nodes: Nodes, ckpt: Path) -> tuple[float, str]:
    deadline = time.monotonic() + 300
    while latest_step(ckpt) is None:
        assert time.monotonic() < deadline and all(p.poll() is None for p in nodes.procs), nodes.text(0, "err")[-3000:]
        time.sleep(0.1)
    nodes.kill_node(1)
    killed = time.monotonic()
    nodes.procs[0].wait(timeout=120)
    return time.monotonic() - killed, nodes.text(0, "err")


def _assert_lost_node_1(nodes: Nodes, elapsed: float, err: str, left: list[int], ckpt: Path) -> None:
    assert nodes.procs[0].returncode == 1, err[-3000:]
    last = err.strip().splitlines()[-1]
    assert re.fullmatch(r"fullshard train: lost ranks 2, 3 \(node 1\) during step \d+: .* the last complete "
                        r"checkpoint is step \d+: continue with --resume", last), err[-3000:]
    print(f"node 0 stopped {elapsed:.1f} s after node 1 was killed: {last}")
    assert elapsed < 60, elapsed
    assert left == []
    assert int(re.search(r"checkpoint is step (\d+)", last).group(1)) == latest_step(ckpt)


# ---------------------------------------------------------------------- MindSpore
@pytest.fixture(scope="module")
def ms_hsdp(tmp_path_factory):
    pytest.importorskip("mindspore")
    out = tmp_path_factory.mktemp("ms_hsdp")
    nodes = fullshard_nodes(out, "--framework", "mindspore", "--steps", "3", "--verify",
                            "--checkpoint-dir", str(out / "ckpt"), "--checkpoint-every", "2")
    return nodes, finished(nodes, 400)


def _msrun_started(nodes: Nodes, node: int) -> list[int]:
    """The ranks the msrun of ``node`` says it started."""
    text = (nodes.out / f"n{node}" / "msrun" / "msrun.txt").read_text()
    return sorted(int(r) for r in re.findall(r"Start worker process with rank id:(\d+)", text))


def test_two_msruns_train_hsdp_by_default_like_the_reference(ms_hsdp):
    nodes, report = ms_hsdp
    assert_two_nodes(report, nodes)
    assert _msrun_started(nodes, 0) == [0, 1] and _msrun_started(nodes, 1) == [2, 3]
    assert report["mesh"]["kind"] == "hsdp" and "chosen by default for 2 nodes" in nodes.text(0)
    theory = report["theory"]
    for rank in report["ranks"]:  # the tiny GPT's dims are even: every rank holds exactly 1/2
        assert rank["mesh_shape"] == [2, 2] and "replicated over 2" in rank["placements"], rank
        assert held(rank) == theory["memory"]["params"] + theory["memory"]["grads"] + theory["memory"]["optim"]
        assert held(rank) * 2 == HELD_PER_PARAM * theory["num_params"]
    # everything travels as all-reduces on CPU: the shard groups' emulated gathers and reductions, the
    # replicas' all-reduce of the gradient shards, and clip_grad_norm's one fp32 norm
    assert report["ranks"][0]["traffic"]["all_reduce"] == theory["carried"]["all_reduce"] + 4
    assert report["max_loss_deviation"] < 1e-4 and "verify passed" in nodes.text(0)


def test_two_msruns_train_plain_fsdp_over_all_four_ranks(tmp_path):
    pytest.importorskip("mindspore")
    nodes = fullshard_nodes(tmp_path, "--framework", "mindspore", "--mesh", "fsdp", "--steps", "2", "--verify")
    report = finished(nodes, 400)
    assert_two_nodes(report, nodes)
    for rank in report["ranks"]:
        assert rank["mesh_shape"] == [4] and "replicated" not in rank["placements"], rank
        assert held(rank) * 4 == HELD_PER_PARAM * report["theory"]["num_params"]
    assert report["max_loss_deviation"] < 1e-4


def test_the_mindspore_2x2_checkpoint_resumes_on_one_node_of_2(ms_hsdp, tmp_path):
    nodes, hsdp = ms_hsdp
    shutil.copytree(nodes.out / "ckpt" / "step_2", tmp_path / "ckpt" / "step_2")
    proc = fullshard("--framework", "mindspore", "--nproc", "2", "--steps", "3", "--resume",
                     "--checkpoint-dir", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["steps"] == [2] and report["ranks"][0]["mesh_shape"] == [2]
    assert abs(report["train_loss"][0] - hsdp["reference_loss"][2]) < 1e-4


def test_a_killed_mindspore_node_fails_the_other_fast_naming_its_ranks(tmp_path):
    pytest.importorskip("mindspore")
    from fullshard.checkpoint.formats import sharded_safetensors
    from fullshard.checkpoint.formats.safetensors_file import TensorFile

    nodes = fullshard_nodes(tmp_path, "--framework", "mindspore", "--steps", "20",
                            "--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "1")
    try:
        elapsed, err = _kill_node_1_after_a_checkpoint(nodes, tmp_path / "ckpt")
        left = nodes.left_behind()
    finally:
        nodes.stop()
    _assert_lost_node_1(nodes, elapsed, err, left, tmp_path / "ckpt")
    last = tmp_path / "ckpt" / f"step_{latest_step(tmp_path / 'ckpt')}"
    sharded_safetensors.export_full(last, tmp_path / "gpt.safetensors")  # every shard of it reads back
    assert "wte.embedding_table" in TensorFile(tmp_path / "gpt.safetensors").names()


# ---------------------------------------------------------------------- bad combinations
TORCHRUN_3_ON_2_NODES = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "3", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "0",
                         "GROUP_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}


@pytest.mark.parametrize("args, env, message", [
    (["--nnodes", "2", "--node-rank", "2"], {}, "--node-rank 2 is out of range for --nnodes 2: give 0 to 1"),
    (["--framework", "mindspore", "--nnodes", "2", "--node-rank", "-1"], {}, "--node-rank -1 is out of range"),
    (["--mesh", "hsdp"], {}, "--mesh hsdp replicates across nodes, and this run has one"),
    (["--mesh", "hsdp", "--batch-size", "6"], TORCHRUN_3_ON_2_NODES,
     "--mesh hsdp: the world size 3 is not divisible by this node's 2 ranks"),
    (["--nnodes", "3"], TORCHRUN_3_ON_2_NODES, "--nnodes 3 but torchrun started this process with --nnodes 2"),
])
def test_impossible_node_combinations_get_one_line(args, env, message):
    proc = subprocess.run([sys.executable, "-m", "fullshard", "train", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env=dict(os.environ, PYTHONPATH=str(ROOT), **env))
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and message in lines[0], proc.stderr
