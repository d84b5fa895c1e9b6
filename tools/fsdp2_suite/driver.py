"""Runs upstream files, each in its own pytest process: the environment, the per-test and per-file
timeouts, resuming a file after a hang, rerunning the tests a failed MultiProcContinuousTest skipped."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from . import ENV_IMPL, ENV_MAX_RANKS, ENV_RESULTS, ENV_TIMEOUT, ENV_VGPUS
from .bootstrap import SITECUSTOMIZE
from .results import print_table, summary

# The folder that holds this package: on PYTHONPATH, it makes the bootstrap and the plugin importable.
PACKAGE_PARENT = Path(__file__).resolve().parent.parent


def run(args, files: list[Path]) -> None:
    """Run `files` one after the other; write <out>/<impl>[.tag].json after each and print the table."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    workdir = out / "work"
    workdir.mkdir(exist_ok=True)
    hook = _write_hook(out)
    name = args.impl + (f".{args.tag}" if args.tag else "")
    log_path = out / f"{name}.log"
    records: list[dict] = []
    started = time.time()
    with open(log_path, "w") as log:
        for file in files:
            t0 = time.time()
            file_records = run_file(args, file, hook, workdir, log)
            records += file_records
            counts = summary(file_records).get(file.name, {})
            print(f"[{time.time() - started:7.0f}s] {file.name}: {counts} ({time.time() - t0:.0f}s)", flush=True)
            _dump(out / f"{name}.json", args, records, started)
    _dump(out / f"{name}.json", args, records, started)
    print_table(records, f"impl={args.impl}  results: {out / (name + '.json')}  log: {log_path}")


def _write_hook(scratch: Path) -> Path:
    hook = scratch / "hook"
    hook.mkdir(parents=True, exist_ok=True)
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    (hook / "pytest.ini").write_text("[pytest]\naddopts =\n")
    return hook


def _env(args, hook: Path, results: Path) -> dict:
    env = dict(os.environ)
    paths = [str(hook), str(PACKAGE_PARENT)]
    if args.fullshard_path:
        paths.append(args.fullshard_path)
    if args.deps and Path(args.deps).is_dir():
        paths.append(args.deps)
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env.update(
        {
            "PYTHONPATH": os.pathsep.join(paths),
            ENV_IMPL: args.impl,
            ENV_VGPUS: str(args.vgpus),
            ENV_MAX_RANKS: str(args.max_ranks),
            ENV_RESULTS: str(results),
            ENV_TIMEOUT: str(args.timeout),
            "DISTRIBUTED_TESTS_DEFAULT_TIMEOUT": str(args.timeout),
            "OMP_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            "TORCH_SHOW_CPP_STACKTRACES": "0",
            "PYTORCH_TESTING_DEVICE_ONLY_FOR": "cpu",
        }
    )
    return env


def _read_events(path: Path) -> list[dict]:
    if not path.exists():
        return []
    events = []
    for line in path.read_text().splitlines():
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return events


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_file(args, file: Path, hook: Path, workdir: Path, log) -> list[dict]:
    """Run one upstream file to completion (resuming after hangs); one record per test."""
    results: dict[str, dict] = {}
    collected: list[str] | None = None
    pending: list[str] | None = None  # None: the whole file (with -k)
    rerun_poisoned: list[str] = []
    attempt = 0
    while True:
        attempt += 1
        events_path = workdir / f"{file.stem}.{args.impl}.{attempt}.jsonl"
        events_path.unlink(missing_ok=True)
        cmd = [
            sys.executable, "-m", "pytest", "-p", "fsdp2_suite.plugin", "-p", "no:cacheprovider",
            "-c", str(hook / "pytest.ini"), "--rootdir", str(file.parent),
            "-q", "-rN", "--tb=long", "--color=no", "-W", "ignore::DeprecationWarning",
        ]
        if pending is None:
            cmd.append(str(file))
            if args.k:
                cmd += ["-k", args.k]
            for nodeid in _skipped_by_baseline(args, file):
                cmd += ["--deselect", nodeid]  # node ids are relative to --rootdir
        else:
            cmd += [str(file.parent / nodeid) for nodeid in pending]
        log.write(f"\n===== {file.name} attempt {attempt}: {' '.join(cmd[:3])} ... ({len(pending or [])} ids)\n")
        log.flush()
        proc = subprocess.Popen(
            cmd, cwd=file.parent, env=_env(args, hook, events_path), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        budget = args.file_timeout
        start = time.time()
        killed = False
        while proc.poll() is None:
            time.sleep(1)
            events = _read_events(events_path)
            # The per-test budget restarts with every test that starts.
            starts = [e for e in events if e["kind"] == "start"]
            last = max(start, _start_time_of(events_path, len(starts)))
            if time.time() - last > args.timeout + 90 or time.time() - start > budget:
                _kill_tree(proc)
                killed = True
                break
        events = _read_events(events_path)
        for event in events:
            if event["kind"] == "collected" and collected is None:
                collected = event["tests"]
            elif event["kind"] == "result":
                results[event["test"]] = event
        started = [e["test"] for e in events if e["kind"] == "start"]
        if killed and started and started[-1] not in results:
            results[started[-1]] = {
                "test": started[-1], "outcome": "timeout",
                "reason": f"killed by the driver: no result after {args.timeout + 90} s",
                "where": "", "details": "", "seconds": None,
            }
        if collected is None:
            # Import/collection error: report the file as one error record.
            text = _tail_of_log(log)
            return [{"file": file.name, "test": file.name, "outcome": "error",
                     "reason": "collection failed: " + _collection_error(text), "where": "",
                     "details": text, "seconds": None}]
        pending = [t for t in collected if t not in results and t not in rerun_poisoned]
        if not pending and not rerun_poisoned:
            # MultiProcContinuousTest skips the rest of a class once one test fails
            # ("Previous test failed"): rerun those one per fresh pytest process.
            rerun_poisoned = [t for t in collected if _POISONED in results[t].get("reason", "")]
            for t in rerun_poisoned:
                del results[t]
            pending = rerun_poisoned[:1]
        elif not pending and rerun_poisoned:
            rerun_poisoned = [t for t in rerun_poisoned if t not in results]
            pending = rerun_poisoned[:1]
        if not pending or attempt >= args.max_attempts:
            for t in pending:
                results[t] = {"test": t, "outcome": "error", "reason": "not run (pytest stopped)",
                              "where": "", "details": "", "seconds": None}
            break
        # Anything left unrun after a normal exit (e.g. shouldstop after a timeout) is resumed.
    for nodeid in _skipped_by_baseline(args, file):
        if nodeid not in results:
            collected.append(nodeid)
            results[nodeid] = {"test": nodeid, "outcome": "skip", "where": "", "details": "",
                               "reason": f"not run: outcome in {args.skip_from} was {args.skip_outcomes}",
                               "seconds": None}
    records = []
    for t in collected:
        record = dict(results[t])
        record["file"] = file.name
        record["test"] = t.split("::", 1)[1] if "::" in t else t
        records.append(record)
    return records


_POISONED = "Previous test failed, skipping"


def _skipped_by_baseline(args, file: Path) -> list[str]:
    """Node ids whose outcome in --skip-from is one of --skip-outcomes (e.g. torch timeouts)."""
    if not args.skip_from:
        return []
    data = json.loads(Path(args.skip_from).read_text())
    wanted = set(args.skip_outcomes.split(","))
    return [f"{file.name}::{r['test']}" for r in data["results"]
            if r["file"] == file.name and r["outcome"] in wanted]


def _start_time_of(events_path: Path, count: int) -> float:
    # The driver only needs "when did the latest test start": the file's mtime
    # changes with every start/result line.
    try:
        return events_path.stat().st_mtime if count else 0.0
    except FileNotFoundError:
        return 0.0


def _tail_of_log(log) -> str:
    log.flush()
    try:
        with open(log.name) as f:
            text = f.read()
    except OSError:
        return ""
    return text[-6000:]


def _collection_error(text: str) -> str:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("E ") and ("Error" in line or "error" in line):
            return line[1:].strip()[:300]
    return "see log"


def _dump(path: Path, args, records: list[dict], started: float) -> None:
    import platform

    try:
        import torch

        torch_version = f"{torch.__version__} ({torch.version.git_version})"
    except Exception:  # pragma: no cover
        torch_version = "?"
    meta = {
        "impl": args.impl,
        "torch": torch_version,
        "python": platform.python_version(),
        "upstream": str(Path(args.upstream).resolve()),
        "fullshard_path": args.fullshard_path,
        "timeout_s": args.timeout,
        "vgpus": args.vgpus,
        "max_ranks": args.max_ranks,
        "k": args.k,
        "wall_s": round(time.time() - started),
    }
    path.write_text(json.dumps({"meta": meta, "summary": summary(records), "results": records}, indent=1))
