"""``fullshard bench --framework mindspore`` end to end on the tiny GPT (the CI smoke configuration)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("mindspore")

from fullshard.bench.mindspore_runner import CONTENDERS  # noqa: E402
from fullshard.models.config import GPTConfig  # noqa: E402
from fullshard.models.gpt_mindspore import GPT  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
ROUNDS = 3


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    out = tmp_path_factory.mktemp("ms_bench")
    proc = subprocess.run(
        [sys.executable, "-m", "fullshard", "bench", "--framework", "mindspore", "--tiny", "--rounds", str(ROUNDS),
         "--batch-size", "2", "--out-dir", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=400,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [json_path] = out.glob("*-mindspore.json")
    [md_path] = out.glob("*-mindspore.md")
    return json.loads(json_path.read_text()), md_path.read_text(), proc.stdout


def test_every_contender_is_timed_in_paired_rounds(bench):
    summary, _, _ = bench
    [config] = summary["configurations"]
    assert list(config["libraries"]) == [label for label, _ in CONTENDERS]
    for lib in config["libraries"].values():
        assert len(lib["step_s"]["rounds"]) == ROUNDS and all(t > 0 for t in lib["step_s"]["rounds"])
    for pair in ("fullshard:zero3/dp", "fullshard:zero2/dp", "fullshard:zero1/dp"):
        ratio = config["ratios"][pair]
        assert 0 < ratio["min"] <= ratio["median"] <= ratio["max"]


def test_model_state_per_rank_is_the_formula(bench):
    summary, _, _ = bench
    libraries = summary["configurations"][0]["libraries"]
    for label, lib in libraries.items():
        for rank in lib["memory_per_rank"]:  # the tiny GPT's dims are even: exact
            for key in ("params", "grads", "optim"):
                assert rank["state_bytes"][key] == lib["theory_memory"][key], (label, key)
    held = {label: sum(lib["memory_per_rank"][0]["state_bytes"].values()) for label, lib in libraries.items()}
    assert held["fullshard:zero3"] * 2 == held["dp"]  # ZeRO-3 holds 1/N of data parallel's state


def test_bytes_next_to_the_minimum_and_the_cpu_emulation(bench):
    summary, _, _ = bench
    libraries = summary["configurations"][0]["libraries"]
    for label, lib in libraries.items():
        moved = lib["bytes_per_step"]
        assert moved["reduce_scatter"] == 0  # none on CPU
        assert moved == {k: int(v) for k, v in lib["carried_bytes_per_step"].items()}, label
        assert lib["sent_per_step"] == pytest.approx(lib["carried_sent_per_step"])
        assert lib["sent_per_step"] >= lib["theory_sent_per_step"]
    assert libraries["fullshard:zero3"]["carried_sent_per_step"] > libraries["fullshard:zero3"]["theory_sent_per_step"]


def test_collectives_per_step_and_the_time_waiting_in_them(bench):
    """With comm fusion (the default) each unit gathers once per pass (ZeRO-3 again in backward, the root
    only once). Every gradient of the tiny model is below the fusion threshold: ZeRO-2/3 reduce a unit's in
    one collective in its gather's bprop, ZeRO-1 the whole model's in one, in the root's (far below the batch
    limit); data parallel's reducer all-reduces every gradient alone."""
    summary, markdown, _ = bench
    [config] = summary["configurations"]
    model_config = summary["meta"]["model_config"]
    assert summary["meta"]["comm_fusion"] is True
    units = model_config["n_layers"] + 1  # every block, then the root
    libraries = config["libraries"]
    calls = {label: lib["collectives_per_step"] for label, lib in libraries.items()}
    assert calls["dp"]["all_reduce"] == len(GPT(GPTConfig(**model_config)).trainable_params())
    assert calls["dp"]["all_gather"] == 0
    assert calls["fullshard:zero3"]["all_reduce"] == calls["fullshard:zero2"]["all_reduce"] == units, calls
    assert calls["fullshard:zero1"]["all_reduce"] == 1, calls
    assert calls["fullshard:zero1"]["all_gather"] == calls["fullshard:zero2"]["all_gather"] == units, calls
    assert calls["fullshard:zero3"]["all_gather"] == 2 * units - 1, calls
    for lib in libraries.values():
        wait = lib["collective_wait_s_rank0"]
        assert 0 < wait["median"] < lib["step_s"]["max"]
    assert "collectives/step" in markdown


def test_same_model_and_batches_for_every_contender(bench):
    summary, _, _ = bench
    losses = [lib["loss_step0_rank0"] for lib in summary["configurations"][0]["libraries"].values()]
    assert max(losses) - min(losses) < 1e-4, losses


def test_report_is_printed_and_written(bench):
    _, markdown, stdout = bench
    for title in ("## Step time", "## Model state per rank", "## Memory per rank", "## Bytes per step"):
        assert title in markdown
    assert markdown.strip() in stdout
