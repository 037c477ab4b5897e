"""Code cites the facts it relies on in docs/facts.md, by section; every cited section exists and
nothing cites a file outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTSIDE = "FACTS" + ".md"  # the notes file that is not in the repository (spelled so this file does not cite it)


def _sources() -> list[Path]:
    skip = {".git", ".venv", "build", "node_modules"}
    return [p for p in ROOT.rglob("*") if p.suffix in (".py", ".md") and p.is_file()
            and not skip & set(p.relative_to(ROOT).parts) and ".egg-info" not in str(p)]


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_cited_facts_section_exists_and_nothing_cites_an_outside_file():
    text = (ROOT / "docs" / "facts.md").read_text()
    anchors = {_slug(m[1]) for m in re.finditer(r"^#+ (.+)$", text, re.M)}
    cited, outside = {}, []
    for path in _sources():
        body = path.read_text(errors="replace")
        if OUTSIDE in body:
            outside.append(str(path.relative_to(ROOT)))
        for m in re.finditer(r"docs/facts\.md#([\w-]+)((?:, #[\w-]+)*)", body):
            for anchor in [m[1], *re.findall(r"#([\w-]+)", m[2])]:
                cited.setdefault(anchor, []).append(str(path.relative_to(ROOT)))
    assert outside == []
    assert len(cited) >= 5  # the kernels, the cast, the plugin and bench cite it
    missing = {a: files for a, files in cited.items() if a not in anchors}
    assert missing == {}, f"sections cited but not in docs/facts.md: {missing}"
