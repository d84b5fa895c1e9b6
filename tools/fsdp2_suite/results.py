"""What the records say: failures classified from pytest's reports, the per-file table, --compare, --merge."""
from __future__ import annotations

import json
import re
from pathlib import Path

_EXC_TYPE = re.compile(r"^([A-Za-z_][\w.]*)(?::\s?(.*))?$")
_FRAME_LINE = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)')


def _child_tracebacks(text: str) -> list[str]:
    """The tracebacks FSDPTest ranks sent back ('Process i exited ... exception:')."""
    parts = re.split(r"Process \d+ exited with error code \d+ and exception:\n", text)
    return parts[1:]


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _first_exception(block: str) -> tuple[str, str, str]:
    """(type, message, deepest frame) of the exception a traceback in `block` ends with.

    With chained exceptions the last one (the one that propagated) is taken.
    pytest prefixes the lines with 'E' and an indent, which is removed.
    """
    lines = [line[1:] if line.startswith("E ") or line == "E" else line for line in block.splitlines()]
    found = ("", "", "")
    index = 0
    while index < len(lines):
        line = lines[index]
        if not line.lstrip().startswith("Traceback (most recent call last)"):
            index += 1
            continue
        base = _indent(line)
        frame = test_frame = ""
        index += 1
        while index < len(lines):
            line = lines[index]
            m = _FRAME_LINE.match(line)
            if m and _indent(line) > base:
                frame = f"{Path(m.group(1)).name}:{m.group(2)} in {m.group(3)}"
                if Path(m.group(1)).name.startswith("test_"):
                    test_frame = frame
                index += 1
                continue
            if line.strip() and _indent(line) == base:
                break
            index += 1
        if index >= len(lines):
            break
        head = lines[index].strip()
        m = _EXC_TYPE.match(head)
        if m and ("Error" in m.group(1) or "Exception" in m.group(1) or m.group(1) in (
                "KeyError", "StopIteration", "SystemExit", "KeyboardInterrupt", "SkipTest")):
            exc_type, message = m.group(1), (m.group(2) or "").strip()
        else:
            exc_type, message = "", head
        extra = []
        for follow in lines[index + 1 : index + 10]:
            text = follow.strip()
            if not text:
                continue  # assertEqual separates its details by blank lines
            if _indent(follow) < base or text.startswith(
                ("Traceback", "To execute", "The above exception", "During handling", "This message")
            ):
                break
            extra.append(text)
        if extra:
            message = (message + " | " + " | ".join(extra[:5])).strip(" |")
        where = frame if not test_frame or test_frame == frame else f"{test_frame} -> {frame}"
        found = (exc_type, message, where)
        index += 1
    return found


def classify(phases: dict) -> tuple[str, str, str, str]:
    for when in ("setup", "call", "teardown"):
        phase = phases.get(when)
        if phase is None:
            continue
        if phase["outcome"] == "skipped":
            return "skip", phase["text"].strip()[:300], "", ""
        if phase["outcome"] == "failed":
            text = phase["text"]
            if "SuiteTimeout" in text or re.search(r"Timing out after \d+ seconds", text) or re.search(
                r"(?:Process|Thread) \d+ terminated or timed out", text
            ):
                return "timeout", _timeout_reason(text), "", _tail(text)
            children = _child_tracebacks(text)
            block = children[0] if children else text
            exc_type, message, frame = _first_exception(block)
            if not exc_type:
                exc_type, message, frame = _first_exception(text)
            if not exc_type:
                m = re.search(r"^E\s+(.+)$", text, re.M)
                message = m.group(1) if m else text.strip().splitlines()[-1] if text.strip() else ""
            outcome = "fail" if exc_type.endswith("AssertionError") and when == "call" else "error"
            reason = f"{exc_type}: {message}" if exc_type else message
            return outcome, reason[:600], frame, _tail(block)
    call = phases.get("call")
    if call is None and phases.get("setup", {}).get("outcome") == "passed":
        return "error", "no call phase", "", ""
    return "pass", "", "", ""


def _timeout_reason(text: str) -> str:
    m = re.search(r"(Timing out after \d+ seconds[^\n]*|(?:Process|Thread) \d+ terminated or timed out[^\n]*)", text)
    if m:
        return m.group(1)
    m = re.search(r"fsdp2_suite: test exceeded[^\n]*", text)
    return m.group(0) if m else "timeout"


def _tail(text: str, lines: int = 40) -> str:
    kept = [line for line in text.splitlines() if line.strip()]
    return "\n".join(kept[-lines:])[-6000:]


def summary(records: list[dict]) -> dict[str, dict[str, int]]:
    table: dict[str, dict[str, int]] = {}
    for r in records:
        row = table.setdefault(r["file"], {k: 0 for k in ("tests", "pass", "fail", "error", "skip", "timeout")})
        row["tests"] += 1
        row[r["outcome"]] = row.get(r["outcome"], 0) + 1
    return table


def print_table(records: list[dict], title: str) -> None:
    table = summary(records)
    cols = ("tests", "pass", "fail", "error", "skip", "timeout")
    width = max([len(f) for f in table] + [4])
    print(f"\n{title}")
    print(f"{'file':<{width}}  " + "  ".join(f"{c:>7}" for c in cols))
    total = {c: 0 for c in cols}
    for f in sorted(table):
        print(f"{f:<{width}}  " + "  ".join(f"{table[f][c]:>7}" for c in cols))
        for c in cols:
            total[c] += table[f][c]
    print(f"{'TOTAL':<{width}}  " + "  ".join(f"{total[c]:>7}" for c in cols))


def compare(torch_json: Path, fullshard_json: Path) -> None:
    base = {(r["file"], r["test"]): r for r in json.loads(torch_json.read_text())["results"]}
    ours = {(r["file"], r["test"]): r for r in json.loads(fullshard_json.read_text())["results"]}
    files = sorted({k[0] for k in base} | {k[0] for k in ours})
    print(f"{'file':<44} {'ran':>5} {'torch':>6} {'fullshard':>9} {'regressed':>9}")
    regressions = []
    for f in files:
        keys = [k for k in base if k[0] == f]
        ran = [k for k in keys if base[k]["outcome"] != "skip"]
        tp = [k for k in keys if base[k]["outcome"] == "pass"]
        fp = [k for k in keys if ours.get(k, {}).get("outcome") == "pass"]
        reg = [k for k in tp if ours.get(k, {}).get("outcome") != "pass"]
        regressions += reg
        print(f"{f:<44} {len(ran):>5} {len(tp):>6} {len(fp):>9} {len(reg):>9}")
    print(f"\npass with torch, not with fullshard: {len(regressions)}")
    for k in regressions:
        r = ours.get(k, {"outcome": "missing", "reason": ""})
        print(f"- {k[0]}::{k[1]} [{r['outcome']}] {r.get('reason', '')[:300]}  ({r.get('where', '')})")
    gained = [k for k in ours if ours[k]["outcome"] == "pass" and base.get(k, {}).get("outcome") != "pass"]
    if gained:
        print(f"\npass with fullshard, not with torch: {len(gained)}")
        for k in gained:
            print(f"- {k[0]}::{k[1]} [torch: {base.get(k, {}).get('outcome')}]")


def merge(out_path: Path, inputs: list[Path]) -> None:
    """Merge result files into `out_path`; later inputs win, test by test."""
    by_test: dict[tuple, dict] = {}
    metas = []
    for path in inputs:
        data = json.loads(path.read_text())
        metas.append(data["meta"])
        for r in data["results"]:
            by_test[(r["file"], r["test"])] = r
    records = [by_test[k] for k in sorted(by_test)]
    out_path.write_text(json.dumps(
        {"meta": {"merged_from": [str(p) for p in inputs], "parts": metas},
         "summary": summary(records), "results": records}, indent=1))
    print_table(records, f"merged: {out_path}")
