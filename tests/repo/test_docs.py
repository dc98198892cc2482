"""The docs stay readable in ten minutes: a short README that maps every page, links that resolve, and
no internal session labels ("stop N") in what users read. History belongs in git, not in the docs."""

from __future__ import annotations

import re

from tests.procs import REPO

README = REPO / "README.md"
BENCHMARKS = REPO / "benchmarks" / "README.md"
PAGES = sorted((REPO / "docs").glob("*.md"))
USER_DOCS = [README, BENCHMARKS, *PAGES]
LINK = re.compile(r"\]\(([^)\s]+)\)")
REPO_PATH = re.compile(r"`((?:kvcoord|tests|scripts|benchmarks|deploy|docs)/[\w./-]+\.(?:py|md|c|yml|sh))`")


def test_readme_is_short_and_opens_with_the_two_commands() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, len(lines)
    first_block = lines[lines.index("```sh") + 1 : lines.index("```")]
    commands = [line.split("#", 1)[0].strip() for line in first_block]
    assert commands == ["pip install . && kvcoord serve",
                        "pip install -e '.[test]' && python -m pytest -q tests"], commands
    assert lines.index("```sh") < 5


def test_readme_maps_every_docs_page() -> None:
    text = README.read_text()
    mapped = {m.group(1) for m in re.finditer(r"^\| \[(docs/[^\]]+\.md)\]", text, re.M)}
    assert mapped == {f"docs/{p.name}" for p in PAGES}, sorted(mapped ^ {f"docs/{p.name}" for p in PAGES})


def test_no_session_labels_in_docs() -> None:
    for doc in USER_DOCS:
        for lineno, line in enumerate(doc.read_text().splitlines(), 1):
            assert not re.search(r"\bstop \d+\b", line, re.I), f"{doc.relative_to(REPO)}:{lineno}: {line}"


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_relative_links_resolve() -> None:
    for doc in USER_DOCS:
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            assert dest.exists(), f"{doc.relative_to(REPO)}: {target}"
            if anchor and dest.suffix == ".md":
                anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", dest.read_text(), re.M)}
                assert anchor in anchors, f"{doc.relative_to(REPO)}: {target}"


def test_benchmarks_open_with_one_summary_table() -> None:
    text = BENCHMARKS.read_text()
    first_section = text.index("\n## ")
    assert text[first_section:].startswith("\n## Summary\n")
    summary = text[first_section : text.index("\n## ", first_section + 1)]
    assert "| benchmark | what it compares | latest ratio | target | met? |" in summary
    sections = re.findall(r"^## .*\(`benchmarks/(\w+\.py)`\)$", text, re.M)
    scripts = {p.name for p in (REPO / "benchmarks").glob("*.py")}
    described = set(sections) | set(re.findall(r"^### .*\(`benchmarks/(\w+\.py)`\)$", text, re.M))
    assert described == scripts, sorted(described ^ scripts)


def test_docs_quote_existing_files() -> None:
    """Backticked repository paths in the docs name files that exist (a moved module leaves no stale path)."""
    for doc in USER_DOCS:
        for path in REPO_PATH.findall(doc.read_text()):
            assert (REPO / path).exists(), f"{doc.relative_to(REPO)}: {path}"
