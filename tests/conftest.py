"""The launch harness: distributed scenarios run inside real ranks, many scenarios per launch.

A distributed test module says on how many ranks it runs and what runs there::

    from tests.conftest import Launch, scenario, scenarios

    LAUNCH = Launch(world_sizes=(2, 4))       # gloo ranks; runtime="mindspore" for msrun workers

    @scenario                                 # runs on every rank, at every world size of LAUNCH
    def parity_with_one_process():
        ...                                   # asserts inside the ranks; returns JSON data (or None)

    @scenario(world_sizes=(4,), needs=[("save", 2)], check=compare)  # only at 4; after save[2ranks]; compare(ranks' data)
    def load_elsewhere():
        ...

    @scenarios                                # generated ones (a matrix): world size -> {name: callable}
    def matrix(world_size):
        ...

pytest collects one item per scenario and world size (``parity_with_one_process[2ranks]``). The first item
of a (module, runtime, world size) to run starts the ranks once for every item of that key still selected
(``-k``, node ids and ``--deselect`` narrow it) and for the scenarios those need; the ranks run them in the
module's order, each caught apart (one failure hides no other), with a barrier after each; every item then
reports its own scenario with every failing rank's traceback, and a ``check`` given to the decorator runs
here on the ranks' data. A launch runs under a wall-clock timeout that kills every process it started and
fails its items with the workers' logs; gloo collectives time out after ``COLLECTIVE_TIMEOUT_S``. Every
worker runs one op thread. A module's launches and its tests in this process share a directory
(``$FULLSHARD_TEST_DIR`` in the ranks, the ``scenario_dir`` fixture here); a test here reads what a
scenario returned through the ``scenario_data`` fixture, which launches it when it has not run yet.

This file is also the workers' entry point: ``python tests/conftest.py OUT`` (msrun runs a script).
"""
from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    # Run as a script, this file's folder leads sys.path, and its packages tests/torch and tests/mindspore
    # would shadow the frameworks: the repository root takes its place.
    _HERE = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [os.path.dirname(_HERE)] + [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import json
import re
import shutil
import subprocess
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKER = Path(__file__).resolve()
COLLECTIVE_TIMEOUT_S = 60
RUNTIMES = ("torch", "mindspore")
# Lines of MindSpore's own logging that every run prints (and one harmless error at every exit).
_NOISE = re.compile(r"^\[(WARNING|INFO)\]|CPU device is not supported|^\s*$")


# ---------------------------------------------------------------------- declaring scenarios
@dataclass(frozen=True)
class Launch:
    """How a module's scenarios are started: the world sizes a scenario runs at unless it names its own,
    the runtime (``torch``: gloo ranks, ``mindspore``: msrun workers), extra environment, the wall-clock
    limit of one launch in seconds, and a group: modules naming the same one (with the same environment)
    share their launches, one per runtime and world size, when starting ranks costs more than keeping
    subjects apart saves."""

    world_sizes: tuple[int, ...] = (2,)
    runtime: str = "torch"
    env: Mapping[str, str] = field(default_factory=dict)
    timeout_s: float = 600
    group: Optional[str] = None

    def __post_init__(self) -> None:
        assert self.runtime in RUNTIMES, f"runtime {self.runtime!r} is none of {RUNTIMES}"


@dataclass(frozen=True)
class Spec:
    """What a decorator said about a scenario (or, for ``@scenarios``, about every one it generates)."""

    world_sizes: Optional[tuple[int, ...]]
    runtime: Optional[str]
    needs: tuple[tuple[str, Optional[int]], ...]
    check: Optional[Callable[[list], None]]
    generated: bool


@dataclass(frozen=True)
class Scenario:
    name: str
    world_size: int
    runtime: str
    run: Callable[[], Any]
    spec: Spec
    source: Callable

    def needs(self) -> list[tuple[str, int]]:
        """(name, world size) of every scenario that must have run before this one (a bare name: this world size)."""
        return [(name, self.world_size if size is None else size) for name, size in self.spec.needs]


def _decorator(generated: bool, fn, world_sizes, runtime, needs, check):
    needs = tuple((n, None) if isinstance(n, str) else (n[0], n[1]) for n in needs)
    spec = Spec(tuple(world_sizes) if world_sizes else None, runtime, needs, check, generated)

    def mark(f):
        f.__scenario__ = spec
        return f

    return mark(fn) if fn is not None else mark


def scenario(fn=None, *, world_sizes: Iterable[int] = (), runtime: Optional[str] = None, needs=(), check=None):
    """Mark a module-level function as a scenario run inside the ranks (see the module docstring).

    ``world_sizes``: where it runs (default: its module's ``LAUNCH.world_sizes``); ``runtime``: overrides
    the module's; ``needs``: scenarios to run first, as names (same world size) or (name, world size);
    ``check``: called here with the list of every rank's returned data once the scenario passed on all."""
    return _decorator(False, fn, world_sizes, runtime, needs, check)


def scenarios(fn=None, *, world_sizes: Iterable[int] = (), runtime: Optional[str] = None, needs=(), check=None):
    """Mark ``fn(world_size) -> {name: callable}``: generated scenarios, each as if decorated with
    :func:`scenario` and these arguments, in ``fn``'s place in the module's order."""
    return _decorator(True, fn, world_sizes, runtime, needs, check)


def launch_of(module) -> Launch:
    launch = getattr(module, "LAUNCH", None)
    if not isinstance(launch, Launch):
        raise TypeError(f"{module.__name__} has scenarios but no LAUNCH = Launch(...) saying where they run")
    return launch


def _specs(module) -> list[tuple[str, Callable, Spec]]:
    """The module's own decorated functions, in definition order (imported ones belong to their module)."""
    return [(name, obj, obj.__scenario__) for name, obj in vars(module).items()
            if isinstance(getattr(obj, "__scenario__", None), Spec) and getattr(obj, "__module__", None) == module.__name__]


def _expand(module, name: str, fn: Callable, spec: Spec, world_size: int) -> list[Scenario]:
    launch = launch_of(module)
    if world_size not in (spec.world_sizes or launch.world_sizes):
        return []
    runtime = spec.runtime or launch.runtime
    found = fn(world_size).items() if spec.generated else [(name, fn)]
    return [Scenario(n, world_size, runtime, f, spec, fn) for n, f in found]


def world_sizes_of(module) -> list[int]:
    sizes = set(launch_of(module).world_sizes)
    for _, _, spec in _specs(module):
        sizes.update(spec.world_sizes or ())
    return sorted(sizes)


def module_scenarios(module, world_size: int) -> dict[str, Scenario]:
    """Every scenario ``module`` runs at ``world_size``, in the order the ranks run them."""
    found: dict[str, Scenario] = {}
    for name, fn, spec in _specs(module):
        for one in _expand(module, name, fn, spec, world_size):
            assert one.name not in found, f"{module.__name__}: two scenarios named {one.name!r} at {world_size} ranks"
            found[one.name] = one
    return found


def item_name(name: str, world_size: int) -> str:
    """The test id: the scenario's name, then its world size in brackets (``parity[2ranks]``, ``at[site][4ranks]``)."""
    return f"{name}[{world_size}ranks]"


# ---------------------------------------------------------------------- collection
class ScenarioFailed(Exception):
    """A scenario failed on some rank, its launch failed, or its check did: the message says all."""


class ScenarioItem(pytest.Item):
    def __init__(self, *, scenario: Scenario, **kwargs) -> None:
        super().__init__(**kwargs)
        self.scenario = scenario
        for mark in getattr(scenario.source, "pytestmark", []):  # the function's own marks (skipif, ...)
            self.add_marker(getattr(pytest.mark, mark.name)(*mark.args, **mark.kwargs))
        if scenario.runtime == "mindspore" and not _importable("mindspore"):
            self.add_marker(pytest.mark.skip(reason="needs mindspore"))

    @property
    def key(self) -> tuple[str, str, int]:
        return launch_key(self.parent.obj, self.scenario)

    def runtest(self) -> None:
        _harness(self.config).report(self.parent.obj, self.scenario)

    def repr_failure(self, excinfo, style=None):
        if isinstance(excinfo.value, ScenarioFailed):
            return str(excinfo.value)
        return super().repr_failure(excinfo, style)

    def reportinfo(self):
        code = getattr(self.scenario.source, "__code__", None)
        return self.path, (code.co_firstlineno - 1 if code else None), f"{self.name} (scenario on {self.scenario.world_size} ranks)"


def _importable(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


def pytest_pycollect_makeitem(collector, name, obj):
    spec = getattr(obj, "__scenario__", None)
    if not isinstance(spec, Spec) or not isinstance(collector, pytest.Module):
        return None
    module = collector.obj
    if getattr(obj, "__module__", None) != module.__name__:
        return []  # imported: its own module runs it
    items = []
    for world_size in world_sizes_of(module):
        for one in _expand(module, name, obj, spec, world_size):
            items.append(ScenarioItem.from_parent(collector, name=item_name(one.name, world_size), scenario=one))
    return items


# ---------------------------------------------------------------------- running
def _skipped(item) -> bool:
    from _pytest.skipping import evaluate_skip_marks

    return evaluate_skip_marks(item) is not None


class _Harness:
    """Per session: what every launch brought back, by launch key (group, runtime, world size) and then by
    ``module::scenario``."""

    def __init__(self, session) -> None:
        self.session = session
        self.results: dict[tuple, dict[str, list[dict]]] = {}
        self.failed: dict[tuple, dict[str, str]] = {}  # scenarios whose launch failed: why
        self.dirs: dict[str, Path] = {}
        self.launches: list[str] = []  # one line per launch, shown by -v

    def directory(self, module) -> Path:
        if module.__name__ not in self.dirs:
            self.dirs[module.__name__] = Path(tempfile.mkdtemp(prefix=f"fullshard-{module.__name__.split('.')[-1]}-"))
        return self.dirs[module.__name__]

    def cleanup(self) -> None:
        for path in self.dirs.values():
            shutil.rmtree(path, ignore_errors=True)

    def _done(self, key, run: str) -> bool:
        return run in self.results.get(key, {}) or run in self.failed.get(key, {})

    def _find(self, module, name: str, world_size: int) -> Scenario:
        found = module_scenarios(module, world_size).get(name)
        if found is None:
            raise ScenarioFailed(f"{module.__name__} has no scenario {name!r} at {world_size} ranks")
        return found

    def outcome(self, module, name: str, world_size: int) -> list:
        """Every rank's data from scenario ``name``, launching it (with the selected items of its key) if needed."""
        one = self._find(module, name, world_size)
        key = launch_key(module, one)
        if not self._done(key, run_id(module, name)):
            self._launch(key, [(module, name)])
        return self._passed(key, module, name, world_size)

    def _passed(self, key, module, name: str, world_size: int) -> list:
        title, run = item_name(name, world_size), run_id(module, name)
        if run in self.failed.get(key, {}):
            raise ScenarioFailed(f"scenario {title}: {self.failed[key][run]}")
        per_rank = self.results[key][run]
        errors = [f"--- rank {r} ---\n{res['error']}" for r, res in enumerate(per_rank) if not res["ok"]]
        if errors:
            raise ScenarioFailed(f"scenario {title} failed\n" + "\n".join(errors))
        return [res.get("data") for res in per_rank]

    def report(self, module, one: Scenario) -> None:
        key = launch_key(module, one)
        if not self._done(key, run_id(module, one.name)):
            self._launch(key, [(module, one.name)])
        problems = []
        for need, size in one.needs():
            try:
                self.outcome(module, need, size)
            except ScenarioFailed as failure:
                problems.append(f"it needs {item_name(need, size)}, which did not pass:\n{failure}")
        try:
            data = self._passed(key, module, one.name, one.world_size)
            if one.spec.check is not None:
                try:
                    one.spec.check(data)
                except AssertionError:
                    raise ScenarioFailed(f"scenario {item_name(one.name, one.world_size)} passed on every rank; "
                                         f"its check here failed:\n{traceback.format_exc()}") from None
        except ScenarioFailed as failure:
            problems.insert(0, str(failure))
        if problems:
            raise ScenarioFailed("\n".join(problems))

    def _selected(self, key) -> list[tuple[Any, str]]:
        """(module, scenario) that selected items of ``key`` run, or that selected items of other world sizes
        need from ``key``, in collection order."""
        found = []
        for item in self.session.items:
            if not isinstance(item, ScenarioItem) or _skipped(item):
                continue
            module, one = item.parent.obj, item.scenario
            if item.key == key:
                found.append((module, one.name))
            for need, size in one.needs():
                if launch_key(module, self._find(module, need, size)) == key:
                    found.append((module, need))
        return found

    def _launch(self, key, asked: list[tuple[Any, str]]) -> None:
        _, runtime, world_size = key
        wanted, modules, todo = set(), {}, [*self._selected(key), *asked]
        todo.reverse()
        while todo:  # with what they need, recursively; what is needed from another key runs first
            module, name = todo.pop()
            run = run_id(module, name)
            if run in wanted or self._done(key, run):
                continue
            wanted.add(run)
            modules.setdefault(module.__name__, module)
            for need, size in self._find(module, name, world_size).needs():
                if launch_key(module, self._find(module, need, size)) == key:
                    todo.append((module, need))
                else:
                    try:
                        self.outcome(module, need, size)
                    except ScenarioFailed:
                        pass  # the item that needs it says so
        runs = [(name, run_id(module, one)) for name, module in modules.items()
                for one in module_scenarios(module, world_size) if run_id(module, one) in wanted]
        if not runs:
            return
        launches = {name: launch_of(module) for name, module in modules.items()}
        envs = {tuple(sorted(launch.env.items())) for launch in launches.values()}
        assert len(envs) == 1, f"modules launched together need one environment: {launches}"
        plan = {"runtime": runtime, "world_size": world_size, "runs": [run for _, run in runs],
                "dirs": {name: str(self.directory(module)) for name, module in modules.items()}}
        began = time.monotonic()
        run = _run_gloo if runtime == "torch" else _run_msrun
        results, error = run(plan, dict(next(iter(launches.values())).env),
                             max(launch.timeout_s for launch in launches.values()))
        self.launches.append(f"{' + '.join(modules)} on {world_size} {runtime} ranks: {len(runs)} scenario"
                             f"{'s' if len(runs) > 1 else ''} in {time.monotonic() - began:.1f} s"
                             f"{' (failed)' if error else ''}")
        for _, run in runs:
            if run in results:
                self.results.setdefault(key, {})[run] = results[run]
            else:
                self.failed.setdefault(key, {})[run] = error or "the ranks ended without running it"


def run_id(module, name: str) -> str:
    return f"{module.__name__}::{name}"


def launch_key(module, one: Scenario) -> tuple[str, str, int]:
    """Scenarios of one key run in one launch: the module's (or its ``LAUNCH.group``'s), runtime, world size."""
    return (launch_of(module).group or module.__name__, one.runtime, one.world_size)


def _harness(config) -> _Harness:
    return config.stash[_HARNESS]


_HARNESS = pytest.StashKey[_Harness]()


def pytest_sessionstart(session) -> None:
    session.config.stash[_HARNESS] = _Harness(session)


def pytest_sessionfinish(session) -> None:
    if _HARNESS in session.config.stash:
        session.config.stash[_HARNESS].cleanup()


def pytest_terminal_summary(terminalreporter, config) -> None:
    launches = config.stash[_HARNESS].launches if _HARNESS in config.stash else []
    if launches and config.option.verbose > 0:
        terminalreporter.section("launches")
        for line in launches:
            terminalreporter.write_line(line)


@pytest.fixture(scope="module")
def scenario_data(request) -> Callable[..., list]:
    """``scenario_data(name, world_size=None)``: every rank's data from a scenario of this test's module,
    which passed (launched now if it has not run); ``world_size`` may be left out where it has one."""

    def get(name: str, world_size: Optional[int] = None) -> list:
        module = request.module
        if world_size is None:
            sizes = [n for n in world_sizes_of(module) if name in module_scenarios(module, n)]
            assert len(sizes) == 1, f"scenario {name!r} runs at {sizes} ranks: say which"
            world_size = sizes[0]
        try:
            return _harness(request.config).outcome(module, name, world_size)
        except ScenarioFailed as failure:
            pytest.fail(str(failure), pytrace=False)

    return get


@pytest.fixture(scope="module")
def scenario_dir(request) -> Path:
    """The directory this module's launches share (``$FULLSHARD_TEST_DIR`` in the ranks)."""
    return _harness(request.config).directory(request.module)


# ---------------------------------------------------------------------- launchers
def _write_plan(out: str, plan: dict) -> None:
    Path(out, "plan.json").write_text(json.dumps(plan))


def _read_results(out: str, world_size: int) -> dict[str, list[dict]]:
    """``{scenario: [per-rank result]}`` for the scenarios every rank finished (each writes as it goes)."""
    per_rank = []
    for rank in range(world_size):
        path = Path(out, f"rank{rank}.json")
        per_rank.append(json.loads(path.read_text()) if path.exists() else {})
    return {name: [results[name] for results in per_rank] for name in per_rank[0]
            if all(name in results for results in per_rank)}


def _failures(out: str, world_size: int) -> str:
    """The tracebacks of scenarios that failed before the launch did."""
    found = []
    for rank in range(world_size):
        path = Path(out, f"rank{rank}.json")
        if path.exists():
            for name, result in json.loads(path.read_text()).items():
                if not result["ok"]:
                    found.append(f"--- rank {rank}, scenario {name} ---\n{result['error'][-3000:]}")
    return "\n".join(found) + "\n" if found else ""


def _child_env(env: Mapping[str, str]) -> dict:
    proc_env = dict(os.environ)
    proc_env.update(env)
    proc_env.update(PYTHONPATH=f"{ROOT}{os.pathsep}{proc_env.get('PYTHONPATH', '')}", OMP_NUM_THREADS="1")
    return proc_env


def _run_gloo(plan: dict, env: Mapping[str, str], timeout: float) -> tuple[dict, Optional[str]]:
    """Run ``plan`` on gloo ranks: (every rank's results of the scenarios all finished, why the launch failed)."""
    from fullshard.train.procs import free_port

    port, world_size = free_port(), plan["world_size"]
    with tempfile.TemporaryDirectory() as out:
        _write_plan(out, plan)
        procs = []
        for rank in range(world_size):
            proc_env = _child_env(env)
            proc_env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                            LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            log = open(Path(out) / f"log{rank}.txt", "w")
            procs.append((subprocess.Popen([sys.executable, str(WORKER), out], env=proc_env, cwd=ROOT, stdout=log,
                                           stderr=subprocess.STDOUT), log))
        deadline = time.monotonic() + timeout
        timed_out = False
        for proc, _ in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                timed_out = True
                break
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
        logs = "\n".join(f"--- rank {r} ---\n{(Path(out) / f'log{r}.txt').read_text(errors='replace')[-4000:]}"
                         for r in range(world_size))
        error = None
        if timed_out:
            error = f"the launch on {world_size} ranks did not finish in {timeout}s\n{_failures(out, world_size)}{logs}"
        elif any(proc.returncode for proc, _ in procs):
            error = f"the ranks exited with {[proc.returncode for proc, _ in procs]}\n{_failures(out, world_size)}{logs}"
        return _read_results(out, world_size), error


def _ms_logs(log_dir: Path, world_size: int, tail: int = 6000) -> str:
    parts = []
    for rank in range(world_size):
        path = log_dir / f"worker_{rank}.log"
        text = path.read_text(errors="replace") if path.exists() else "(no log)"
        kept = "\n".join(line for line in text.splitlines() if not _NOISE.search(line))
        parts.append(f"--- rank {rank} ---\n{kept[-tail:]}")
    return "\n".join(parts)


def _run_msrun(plan: dict, env: Mapping[str, str], timeout: float) -> tuple[dict, Optional[str]]:
    """Run ``plan`` on msrun workers. msrun starts ``python`` from PATH, so this interpreter's folder goes
    first on it."""
    from fullshard.train.msrun import kill_launch
    from fullshard.train.procs import free_port

    world_size = plan["world_size"]
    with tempfile.TemporaryDirectory() as out:
        _write_plan(out, plan)
        log_dir = Path(out) / "logs"
        proc_env = _child_env(env)
        proc_env.update(PATH=f"{Path(sys.executable).parent}{os.pathsep}{proc_env.get('PATH', '')}", GLOG_v="3")
        command = ["msrun", f"--worker_num={world_size}", f"--local_worker_num={world_size}",
                   f"--master_port={free_port()}", f"--log_dir={log_dir}", "--join=True", str(WORKER), out]
        error = None
        with open(Path(out) / "msrun.txt", "w") as launcher_log:
            proc = subprocess.Popen(command, env=proc_env, cwd=ROOT, stdout=launcher_log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_launch(proc)
                error = (f"the launch on {world_size} msrun workers did not finish in {timeout}s\n"
                         f"{_failures(out, world_size)}{_ms_logs(log_dir, world_size)}")
            except BaseException:
                kill_launch(proc)
                raise
        if error is None and code:
            launcher = (Path(out) / "msrun.txt").read_text(errors="replace")[-2000:]
            error = (f"msrun exited with {code}\n{_failures(out, world_size)}{_ms_logs(log_dir, world_size)}"
                     f"\n--- msrun ---\n{launcher}")
        return _read_results(out, world_size), error


# ---------------------------------------------------------------------- the worker (inside each rank)
def _start_torch() -> tuple[int, Callable[[], None], Callable[[], None]]:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return dist.get_rank(), dist.barrier, dist.destroy_process_group


def _start_mindspore() -> tuple[int, Callable[[], None], Callable[[], None]]:
    import mindspore as ms
    import numpy as np
    from mindspore import Tensor, ops
    from mindspore.communication import get_rank, init

    from fullshard.mindspore.cpu import configure_cpu_worker

    ms.set_context(mode=ms.PYNATIVE_MODE)
    ms.set_device("CPU")
    configure_cpu_worker()  # what fullshard train and the benchmark run with
    init()

    def barrier() -> None:
        ops.AllReduce()(Tensor(np.ones(1, np.float32))).asnumpy()

    return get_rank(), barrier, lambda: None


def worker(out: str) -> None:
    """Run the scenarios ``out/plan.json`` lists, in order; write ``out/rank<r>.json`` after each."""
    import importlib

    plan = json.loads(Path(out, "plan.json").read_text())
    rank, barrier, finish = (_start_torch if plan["runtime"] == "torch" else _start_mindspore)()
    found: dict[str, dict[str, Scenario]] = {}
    path = Path(out, f"rank{rank}.json")
    results = {}
    for run in plan["runs"]:
        module, name = run.split("::", 1)
        os.environ["FULLSHARD_TEST_DIR"] = plan["dirs"][module]
        try:
            if module not in found:
                found[module] = module_scenarios(importlib.import_module(module), plan["world_size"])
            data = found[module][name].run()
            json.dumps(data)  # what a scenario returns travels as JSON
            results[run] = {"ok": True, "data": data}
        except Exception:  # one failing scenario must not hide the others
            results[run] = {"ok": False, "error": traceback.format_exc()}
        print(f"scenario {run}: {'ok' if results[run]['ok'] else 'FAILED'}", flush=True)
        path.write_text(json.dumps(results))
        barrier()
    finish()


if __name__ == "__main__":
    from tests.conftest import worker as _worker  # under its package name, as the test modules import it

    _worker(sys.argv[1])
