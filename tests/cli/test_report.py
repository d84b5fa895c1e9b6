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


def test_a_model_on_several_meshes_is_reported_per_mesh(tmp_path, monkeypatch):
    """What a worker records per mesh (the roles of its parameters) is put next to those roles' formulas
    (plan.meshes): the experts on their own mesh are a row of their own; roles sharing a mesh (the experts
    in the dense weights' groups) are one row, against the sum of their formulas; a dense run has no rows."""
    from fullshard.plan.meshes import mesh_theory, moe_shares

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    roles = {"dense": {"units": [300, 300], "root": 400, "split": 1}, "experts": {"units": [800, 800], "root": 0,
                                                                                 "split": 2}}
    units = {**UNITS, "num_params": 2600, "roles": roles}
    formulas = mesh_theory(Strategy.OPTIM_GRADS_PARAMS, 4, moe_shares([300, 300], 400, [800, 800], 2))["meshes"]

    def mesh(roles, shards, held, gathered):
        return {"key": "k", "roles": roles, "shards": shards, "replicas": 1, "param_bytes": held, "grad_bytes": 0,
                "optim_bytes": 0, "traffic": {"all_gather": gathered, "reduce_scatter": 0, "all_reduce": 0}}

    for split, expected in (
        ([mesh(["dense"], 4, 1000, 8000), mesh(["experts"], 2, 2000, 6400)], [["dense"], ["experts"]]),
        ([mesh(["dense", "experts"], 4, 3000, 14400)], [["dense", "experts"]]),
    ):
        results = [{**r, "world": 4, "units": units, "meshes": split, "token_bytes": 0} for r in _results("torch")]
        cfg = TrainConfig(model="moe", ep=2, out_dir=str(tmp_path))
        summary = write_report(cfg, results, tmp_path)
        rows = summary["meshes"]
        assert [row["roles"] for row in rows] == expected
        for row in rows:
            mine = [f for f in formulas if f["role"] in row["roles"]]
            assert row["formula"]["traffic"]["all_gather"] == sum(f["traffic"]["all_gather"] for f in mine)
            assert row["formula"]["held"] == sum(f["memory"][k] for f in mine for k in ("params", "grads", "optim"))
        table = format_table(summary)
        assert f"    {' + '.join(expected[0])} sharded over 4 ranks" in table.splitlines()
        assert summary["theory"]["memory"] == mesh_theory(Strategy.OPTIM_GRADS_PARAMS, 4, moe_shares(
            [300, 300], 400, [800, 800], 2))["total"]["memory"]
    dense = write_report(TrainConfig(model="tiny", out_dir=str(tmp_path)), _results("torch"), tmp_path)
    assert dense["meshes"] == [] and "per mesh" not in format_table(dense)
