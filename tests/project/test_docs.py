"""The documents a clone carries stand on their own: every relative link in README.md, docs/ and
benchmarks/ resolves to a file (and heading) inside the repository, and none points outside it."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINK = re.compile(r"(?<!\!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").rglob("*.md"))]


def links(text: str) -> list[str]:
    prose = FENCE.sub("", text)  # a command inside a code block is not a link
    return [a or b for a, b in LINK.findall(prose)]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text())):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def broken(doc: Path, root: Path = ROOT) -> list[str]:
    problems = []
    for target in links(doc.read_text()):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not files
            continue
        path_part, _, anchor = target.partition("#")
        resolved = (doc.parent / path_part).resolve() if path_part else doc
        if not resolved.is_relative_to(root):
            problems.append(f"{target}: points outside the repository")
        elif not resolved.exists():
            problems.append(f"{target}: no such file")
        elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
            problems.append(f"{target}: no heading #{anchor} in {resolved.relative_to(root)}")
    return problems


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves_inside_the_repository(doc):
    assert links(doc.read_text()) or doc != ROOT / "README.md", "the README links nothing?"
    assert broken(doc) == []


def test_the_checker_catches_what_it_is_for(tmp_path):
    """The checker itself: a missing file, a missing heading and a path out of the repository are reported;
    a good link, a URL, an image and a link inside a code block are not."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "origin.md").write_text((ROOT / "docs" / "origin.md").read_text())
    (tmp_path / "docs" / "train-report.png").write_bytes(b"")
    assert "what-fullshard-does-instead" in anchors(tmp_path / "docs" / "origin.md")
    page = tmp_path / "docs" / "page.md"
    page.write_text("[a](missing.md) [b](origin.md#no-such-heading) [c](../../outside.md) [d](origin.md#the-aliasing) "
                    "[e](https://example.org) ![f](train-report.png)\n```\n[g](inside-a-fence.md)\n```\n")
    assert broken(page, root=tmp_path) == [
        "missing.md: no such file",
        "origin.md#no-such-heading: no heading #no-such-heading in docs/origin.md",
        "../../outside.md: points outside the repository"]


def test_nothing_tracked_names_a_path_outside_the_repository():
    """The project grew from a report kept beside it (../shared/seed); a clone has only docs/origin.md."""
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    offenders = [f for f in files if f.endswith((".md", ".py", ".toml", ".txt")) and "../shared" in (ROOT / f).read_text()
                 and f != "tests/project/test_docs.py"]
    assert offenders == []


def state_diagram(rows) -> str:
    """The mermaid lines of a lifecycle table: the first row's state is where a unit starts."""
    lines = [f"    [*] --> {rows[0][0].name}"]
    lines += [f"    {before.name} --> {after.name}: {event}" for before, event, after in rows]
    return "\n".join(lines)


def test_the_design_draws_the_lifecycle_from_the_code():
    """docs/design.md opens with the unit and gather-state diagrams; they are the code's own tables."""
    from fullshard.core.group import GATHER_TRANSITIONS
    from fullshard.core.unit import TRANSITIONS

    blocks = re.findall(r"```mermaid\nstateDiagram-v2\n(.*?)\n```", (ROOT / "docs" / "design.md").read_text(), re.S)
    assert blocks[:2] == [state_diagram(TRANSITIONS), state_diagram(GATHER_TRANSITIONS)]
