"""The layout shows the architecture: one parameter's life runs through at most 14 fullshard files on each
runtime (traced inside 2 ranks, ``tests/project/layout_trace.py``), and no file in ``fullshard/`` is over 500
lines nor any function over 60."""
from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import Launch, scenario
from tests.project import layout_trace

PACKAGE = Path(__file__).resolve().parents[2] / "fullshard"
FILE_BUDGET, MAX_FILE_LINES, MAX_FUNCTION_LINES = 14, 500, 60
LAUNCH = Launch(world_sizes=(2,))  # torch on gloo; the MindSpore trace names its runtime


def _within_budget(files: list[str], runtime: str) -> None:
    assert len(files) <= FILE_BUDGET, (
        f"one parameter's life on {runtime} runs through {len(files)} fullshard files (budget {FILE_BUDGET}):\n"
        + "\n".join(files)
    )
    other = "mindspore/" if runtime == "torch" else "torch/"
    assert not [f for f in files if f.startswith(other)], f"{runtime}'s run reached the other runtime: {files}"
    # the trace is real: the shared planning, step machinery and this runtime's files all ran
    for expected in ("plan/group.py", "plan/ownership.py", "core/unit.py", "core/group.py", f"{runtime}/api.py",
                     f"{runtime}/group.py", f"{runtime}/collectives.py"):
        assert expected in files, f"{expected} did not run in the traced training on {runtime}: {files}"


@scenario(check=lambda ranks: _within_budget(ranks[0], "torch"))
def one_parameter_life_on_torch_runs_through_at_most_14_files():
    return layout_trace.torch_parameter_life()


@scenario(runtime="mindspore", check=lambda ranks: _within_budget(ranks[0], "mindspore"))
def one_parameter_life_on_mindspore_runs_through_at_most_14_files():
    return layout_trace.mindspore_parameter_life()


def _sizes() -> tuple[list[str], list[str]]:
    long_files, long_functions = [], []
    for path in sorted(PACKAGE.rglob("*.py")):
        source = path.read_text()
        name = path.relative_to(PACKAGE.parent)
        if source.count("\n") > MAX_FILE_LINES:
            long_files.append(f"{name}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    long_functions.append(f"{name}:{node.lineno} {node.name}: {length} lines")
    return long_files, long_functions


def test_no_file_over_500_lines_and_no_function_over_60():
    long_files, long_functions = _sizes()
    assert not long_files, f"files over {MAX_FILE_LINES} lines: {long_files}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {long_functions}"
