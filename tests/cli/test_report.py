"""The main job's report is framework-free: the same table, JSON and CSV for torch and MindSpore results,
and one line saying the plot was skipped (and how to get it) when matplotlib is missing."""
import json
import sys

import pytest

from fullshard.plan.group import Strategy

from fullshard.plan.formulas import per_rank_theory
from fullshard.train.config import TrainConfig
from fullshard.train.report import PLOT_SKIPPED, format_table, write_report

UNITS = {"num_params": 1000, "largest_unit": 400, "root_params": 200}


def _results(framework: str) -> list[dict]:
    theory = None
    if framework == "mindspore":  # what the MindSpore worker hands in: memory_report's theory
        figures = per_rank_theory(Strategy.OPTIM_GRADS_PARAMS, 2, 1000, 400, 200)
        carried = {"all_gather": figures["traffic"]["all_gather"], "reduce_scatter": 0.0,
                   "all_reduce": figures["traffic"]["reduce_scatter"]}
        theory = {"memory": figures["memory"], "traffic": figures["traffic"], "sent": figures["sent"],
                  "carried": carried, "carried_sent": figures["sent"] * 1.5}
    return [{"rank": r, "world": 2, "losses": {"0": 3.0, "1": 2.5}, "val_loss": 2.4, "tokens_per_s": 10.0,
             "peak_rss_bytes": 1 << 20, "param_bytes": 2000, "grad_bytes": 2000, "optim_bytes": 4000,
             "units": UNITS, "traffic": {"all_gather": 8000, "reduce_scatter": 0, "all_reduce": 4000},
             "theory": theory} for r in range(2)]


@pytest.mark.parametrize("framework", ["torch", "mindspore"])
def test_a_missing_matplotlib_is_said_in_one_line(framework, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    cfg = TrainConfig(model="tiny", framework=framework, out_dir=str(tmp_path))
    summary = write_report(cfg, _results(framework), tmp_path, {0: 3.0, 1: 2.5})
    table = format_table(summary)
    skipped = [line for line in table.splitlines() if "skipped" in line]
    assert skipped == [f"  plot         skipped: {PLOT_SKIPPED}"], table
    assert "pip install matplotlib" in PLOT_SKIPPED
    assert not (tmp_path / "report.png").exists()
    assert json.loads((tmp_path / "report.json").read_text())["framework"] == framework
    assert (tmp_path / "losses.csv").read_text().splitlines()[1] == "0,3.0,3.0"
    assert table.startswith("fullshard train: tiny GPT") and f"2 ranks ({framework})" in table
    assert ("CPU emulation carries" in table) == (framework == "mindspore")
