"""The side-by-side benchmark (python -m fullshard.bench) end to end, on the tiny model."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fullshard.bench import KINDS, POINT_TO_POINT, configurations

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 3


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    proc = subprocess.run(
        [sys.executable, "-m", "fullshard.bench", "--tiny", "--nproc", "2", "--rounds", str(ROUNDS), "--out-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [json_path] = out.glob("*.json")
    [md_path] = out.glob("*.md")
    return json.loads(json_path.read_text()), md_path.read_text(), proc.stdout


def _libraries(summary):
    for config in summary["configurations"]:
        for label, lib in config["libraries"].items():
            yield config, label, lib


def test_every_configuration_and_library_is_reported(bench):
    summary, _, _ = bench
    expected = {c.name: [x.label for x in c.contenders] for c in configurations()}
    assert {c["name"]: list(c["libraries"]) for c in summary["configurations"]} == expected
    for labels in expected.values():
        assert "fsdp2" in labels and "ddp" in labels and any(label.startswith("fullshard") for label in labels)


def test_step_times_are_positive_and_ratios_paired(bench):
    summary, _, _ = bench
    for config, label, lib in _libraries(summary):
        rounds = lib["step_s"]["rounds"]
        assert config["rounds"] == ROUNDS and len(rounds) == ROUNDS, (config["name"], label)
        assert all(t > 0 for t in rounds) and lib["step_s"]["median"] > 0
        if lib["library"] == "fullshard":
            for other in ("fsdp2", "ddp"):
                ratio = config["ratios"][f"{label}/{other}"]
                assert 0 < ratio["min"] <= ratio["median"] <= ratio["max"]


def test_fullshard_bytes_moved_equal_its_theoretical_figure(bench):
    summary, _, _ = bench
    for config, label, lib in _libraries(summary):
        if lib["library"] != "fullshard":
            continue
        assert lib["bytes_same_every_step_and_rank"], (config["name"], label)
        # on gloo every all-gather and reduce-scatter is a pairwise exchange of point-to-point sends
        assert all(lib["bytes_per_step"][kind] == 0 for kind in KINDS), (config["name"], label)
        assert lib["bytes_per_step"][POINT_TO_POINT] > 0, (config["name"], label)
        # what the sends carried is exactly the theoretical minimum a rank must send
        assert lib["sent_per_step"] == pytest.approx(lib["theory_sent_per_step"], rel=1e-12), (config["name"], label)
        for kind in KINDS:
            # fullshard's own logical count, by collective, is the formula's
            assert lib["fullshard_self_reported_bytes"][kind] == lib["theory_bytes_per_step"][kind], (config["name"], label, kind)


def test_other_libraries_collectives_are_counted_the_same_way(bench):
    summary, _, _ = bench
    for config, label, lib in _libraries(summary):
        moved = lib["bytes_per_step"]
        if lib["library"] == "fsdp2":
            assert moved["all_gather"] > 0 and moved["reduce_scatter"] > 0, config["name"]
        elif lib["library"] == "ddp":
            assert moved["all_reduce"] == lib["theory_bytes_per_step"]["all_reduce"], config["name"]
            assert lib["sent_per_step"] == pytest.approx(lib["theory_sent_per_step"]), config["name"]


def test_memory_is_measured_per_rank(bench):
    summary, _, _ = bench
    for config, label, lib in _libraries(summary):
        ranks = lib["memory_per_rank"]
        assert len(ranks) == 2
        for memory in ranks:
            assert memory["peak_bytes"] >= memory["held_bytes"] > 0, (config["name"], label)
            assert memory["comm_peak_bytes"] > 0 and memory["rss_peak_bytes"] > 0
            assert memory["state_bytes"]["params"] > 0 and memory["state_bytes"]["optim"] > 0


def test_libraries_start_from_the_same_model(bench):
    summary, _, _ = bench
    for config in summary["configurations"]:
        if config["precision"] == "fp32":
            losses = [lib["loss_step0_rank0"] for lib in config["libraries"].values()]
            assert max(losses) - min(losses) < 1e-4, (config["name"], losses)


def test_table_is_printed_and_written(bench):
    _, markdown, stdout = bench
    assert "## Step time" in markdown and "## Memory per rank" in markdown and "## Bytes moved" in markdown
    assert markdown.strip() in stdout


@pytest.mark.parametrize("script, args, expect", [
    ("exchange_cost.py", ["--mib", "0.5", "--repetitions", "2"], "reduce-scatter: pairwise sends (fullshard)"),
    ("phases.py", ["zero2-fp32", "--model", "tiny", "--steps", "1"], "rank 1 fullshard:optim_grads"),
])
def test_diagnostic_scripts_run(script, args, expect):
    torchrun = Path(sys.executable).with_name("torchrun")
    proc = subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node", "2", str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert expect in proc.stdout, proc.stdout
