"""The pytest plugin of the suite (``-p fsdp2_suite.plugin`` in each pytest process): it appends one
event per line to the file ``FSDP2_SUITE_RESULTS`` names (collected, start, result), which the driver reads."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

from . import ENV_RESULTS, ENV_TIMEOUT
from .results import classify


class SuiteTimeout(Exception):
    """Raised in the pytest process when one test runs past its timeout."""


_state: dict = {"records": {}, "timed_out": False}


def _results_path() -> Path | None:
    value = os.environ.get(ENV_RESULTS)
    return Path(value) if value else None


def _append(kind: str, payload: dict) -> None:
    path = _results_path()
    if path is None:
        return
    with open(path, "a") as f:
        f.write(json.dumps({"kind": kind, **payload}) + "\n")
        f.flush()


def pytest_collection_finish(session):
    _append("collected", {"tests": [item.nodeid for item in session.items]})


def pytest_runtest_logstart(nodeid, location):
    _state["records"][nodeid] = {"phases": {}, "start": time.time()}
    _append("start", {"test": nodeid})


def _on_alarm(signum, frame):
    raise SuiteTimeout(
        f"fsdp2_suite: test exceeded {os.environ.get(ENV_TIMEOUT)} s (SIGALRM in the pytest process)"
    )


def pytest_runtest_call(item):
    timeout = int(os.environ.get(ENV_TIMEOUT, "0"))
    if timeout > 0:
        signal.signal(signal.SIGALRM, _on_alarm)
        # FSDPTest enforces DISTRIBUTED_TESTS_DEFAULT_TIMEOUT itself; this is the backstop.
        signal.alarm(timeout + 30)


def pytest_runtest_teardown(item):
    signal.alarm(0)


def pytest_runtest_logreport(report):
    record = _state["records"].setdefault(report.nodeid, {"phases": {}, "start": time.time()})
    text = ""
    if report.longrepr is not None:
        if isinstance(report.longrepr, tuple):  # skip: (path, lineno, reason)
            text = str(report.longrepr[2])
        else:
            text = str(report.longrepr)
    record["phases"][report.when] = {"outcome": report.outcome, "text": text}


def pytest_runtest_logfinish(nodeid, location):
    record = _state["records"].get(nodeid, {"phases": {}, "start": time.time()})
    outcome, reason, where, details = classify(record["phases"])
    if outcome == "timeout":
        _state["timed_out"] = True
    _append(
        "result",
        {
            "test": nodeid,
            "outcome": outcome,
            "reason": reason,
            "where": where,
            "details": details,
            "seconds": round(time.time() - record["start"], 1),
        },
    )


def pytest_runtest_protocol(item, nextitem):
    # After a timeout hung threads or ranks may linger: stop, the driver resumes the file.
    if _state["timed_out"]:
        item.session.shouldstop = "fsdp2_suite: restarting after a timeout"
    return None
