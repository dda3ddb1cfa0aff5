"""Guards on the docs and the sources that cite them, so the published tree stands on its own:
markdown links and anchors resolve, nothing points at files outside the repository, every
spec section the code cites exists in docs/protocol.md, and no module grows past reading size.

The docs are found on disk, not listed here: new pages are checked as they land.
"""

from __future__ import annotations

import re
import subprocess
import urllib.parse
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PROTOCOL = REPO / "docs" / "protocol.md"
CITING_DIRS = ("agent", "operator", "router", "testkit", "demo", "tests", "bench")
SIZE_DIRS = ("agent", "operator", "router", "testkit", "demo")
MAX_LINES = 450

FENCE = re.compile(r"^\s{0,3}(```|~~~)")
HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)")
HTML_ID = re.compile(r"<a\s[^>]*(?:name|id)=\"([^\"]+)\"", re.IGNORECASE)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")
REPO_URL = re.compile(r"github\.com/[^/]+/kvbridge/(?:blob|tree|raw)/")
LINE_ANCHOR = re.compile(r"^L\d+(-L\d+)?$")
# Written so that this file does not match itself.
OUTSIDE = re.compile(r"\.\./shared\b|\bshared/(?:spec|notes)\b|\bnotes/[\w.-]+\.md\b")
NUM = r"\d+(?:\.\d+)*"
CITATION = re.compile(
    rf"(?P<before>\S*)\s*§+\s?{NUM}(?:\s*(?:,|–|—|-|/|\band\b|\bor\b)\s*§+\s?{NUM})*")
SETEXT = re.compile(r"^\s{0,3}(=+|-+)\s*$")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
ORDERED_ITEM = re.compile(r"^\s{0,3}(\d+)[.)]\s")


def repo_files(*dirs: str) -> list[str]:
    """Tracked and new (not ignored) files, relative to the repository."""
    out = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "--", *dirs],
                         cwd=REPO, capture_output=True, text=True, check=True).stdout
    return sorted({p for p in out.splitlines() if (REPO / p).is_file()})


def text_of(rel: str) -> str | None:
    """The file's text, or None for a binary one."""
    data = (REPO / rel).read_bytes()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode()
    except UnicodeDecodeError:
        return None


def markdown_files() -> list[Path]:
    """README.md, docs/**/*.md and every other markdown file of the checkout."""
    files = {REPO / "README.md", *(REPO / "docs").glob("**/*.md")}
    files.update(REPO / p for p in repo_files() if p.lower().endswith(".md"))
    return sorted(f for f in files if f.is_file())


def prose_lines(text: str, *, blank_code: bool = True) -> Iterator[tuple[int, str]]:
    """(line number, line) outside fenced code blocks, inline code spans blanked by default."""
    fence: str | None = None
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line)
        if m:
            fence = None if fence == m.group(1) else (fence or m.group(1))
            continue
        if fence is None:
            yield n, CODE_SPAN.sub(lambda c: " " * len(c.group()), line) if blank_code else line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: the text as shown, lowercased, punctuation other than
    '-' and '_' dropped, each space a '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)     # links show their text
    text = re.sub(r"<[^>]+>", "", text).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def headings(text: str) -> Iterator[str]:
    """Each heading's text as written: ATX (``## Title``) and setext (a line over ===/---)."""
    lines = list(prose_lines(text, blank_code=False))
    for i, (n, line) in enumerate(lines):
        m = HEADING.match(line)
        if m:
            yield m.group(2)
        elif (i + 1 < len(lines) and lines[i + 1][0] == n + 1 and SETEXT.match(lines[i + 1][1])
              and line.strip() and line.lstrip()[0] not in "|-*>"):
            yield line.strip()


def anchors(text: str) -> set[str]:
    """Every anchor a page has: its headings' slugs (repeats get -1, -2, ...) and HTML ids."""
    seen: dict[str, int] = {}
    out = set(HTML_ID.findall(text))
    for title in headings(text):
        base = slug(title)
        count = seen.get(base, 0)
        out.add(base if count == 0 else f"{base}-{count}")
        seen[base] = count + 1
    return out


def link_targets(text: str) -> Iterator[tuple[int, str]]:
    for n, line in prose_lines(text):
        for m in LINK.finditer(line):
            yield n, m.group(1)
        m = REF_DEF.match(line)
        if m:
            yield n, m.group(1)


def link_problem(source: Path, target: str) -> str | None:
    """Why the link from ``source`` is broken, or None."""
    if target.startswith("/") or target.startswith("file:") or REPO_URL.search(target):
        return "absolute link into the repository: use a relative path"
    if SCHEME.match(target):
        return None                                                       # http(s), mailto
    path_part, _, anchor = target.partition("#")
    dest = (source.parent / urllib.parse.unquote(path_part)).resolve() if path_part else source
    if not dest.is_relative_to(REPO):
        return "points outside the repository"
    if not dest.exists():
        return "no such file"
    if not anchor:
        return None
    if dest.suffix.lower() == ".md":
        if urllib.parse.unquote(anchor).lower() not in anchors(dest.read_text()):
            return f"no heading #{anchor} in {dest.relative_to(REPO)}"
        return None
    return None if LINE_ANCHOR.match(anchor) else f"#{anchor} on a file that has no headings"


def test_slugs_follow_github() -> None:
    text = "# Title\n\n## Metrics: `kvbridge_x_total` (agent)\n\n## Title\n\n```\n# not\n```\n"
    assert anchors(text) == {"title", "metrics-kvbridge_x_total-agent", "title-1"}
    assert slug("1. Handshake & wire format") == "1-handshake--wire-format"
    assert slug("[KVTransfer](x.md) fields") == "kvtransfer-fields"


def test_link_checker_catches_broken_links(tmp_path: Path) -> None:
    page = REPO / "README.md"
    assert link_problem(page, "docs/nope.md") == "no such file"
    assert link_problem(page, "/docs/gateway.md") is not None
    assert link_problem(page, "#no-such-heading-here") is not None
    assert link_problem(page, "../outside.md") == "points outside the repository"
    assert link_problem(page, "https://example.com/x") is None


def test_markdown_links_resolve() -> None:
    files = markdown_files()
    assert REPO / "README.md" in files
    broken = [f"{f.relative_to(REPO)}:{n}: ({target}) {problem}"
              for f in files for n, target in link_targets(f.read_text())
              if (problem := link_problem(f, target))]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_no_paths_outside_the_repository() -> None:
    """Notes and specs that live outside the repository are not there for a reader."""
    hits = []
    files = repo_files()
    for rel in files:
        text = text_of(rel)
        for n, line in enumerate((text or "").splitlines(), 1):
            for m in OUTSIDE.finditer(line):
                found = m.group()
                if found.endswith(".md") and any(
                        p == found or p.endswith("/" + found) for p in files):
                    continue                                              # a file we ship
                hits.append(f"{rel}:{n}: {found}")
    assert not hits, "references to files outside the repository:\n" + "\n".join(hits)


def protocol_index(text: str) -> tuple[set[str], dict[str, set[str]]]:
    """Section numbers of the numbered headings ("## 1. Title", "### 1.1 Title"), and under
    each, the numbers of the ordered list items before the next heading."""
    numbers: set[str] = set()
    items: dict[str, set[str]] = {}
    current: str | None = None
    for _n, line in prose_lines(text):
        m = HEADING.match(line)
        if m:
            num = re.match(rf"({NUM})\.?(?:\s|$)", m.group(2))
            current = num.group(1) if num else None
            if current:
                numbers.add(current)
                items.setdefault(current, set())
            continue
        item = ORDERED_ITEM.match(line)
        if current and item:
            items[current].add(item.group(1))
    return numbers, items


def citations(text: str) -> Iterator[tuple[int, str]]:
    """(line, section) of each `§` citation of the spec; a run after a markdown file's name
    (`other.md §2, §3`) cites that file and is left out."""
    for m in CITATION.finditer(text):
        before = m.group("before").rstrip("(,:;")
        if before.endswith(".md") and not before.endswith("protocol.md"):
            continue
        line = text.count("\n", 0, m.start()) + 1
        for num in re.findall(rf"§+\s?({NUM})", m.group()):
            yield line, num


def resolves(num: str, numbers: set[str], items: dict[str, set[str]]) -> bool:
    if num in numbers:
        return True
    parent, _, last = num.rpartition(".")
    return bool(parent) and last in items.get(parent, set())


def test_citation_parsing() -> None:
    text = "spec §1.6, §1.7; (other/x.md §5, §2.4) and §4.3–§4.4. Spec §10.11 (§6.3 (3))"
    assert [c for _, c in citations(text)] == ["1.6", "1.7", "4.3", "4.4", "10.11", "6.3"]
    numbers, items = protocol_index("## 10. Rules\n\n1. a\n11. b\n\n### 10.1 X\n\n12. c\n")
    assert resolves("10.11", numbers, items) and resolves("10.1", numbers, items)
    assert not resolves("10.12", numbers, items) and not resolves("9", numbers, items)


def test_spec_citations_resolve() -> None:
    assert PROTOCOL.exists(), "docs/protocol.md is missing: the code's spec § citations need it"
    numbers, items = protocol_index(PROTOCOL.read_text())
    this = str(Path(__file__).resolve().relative_to(REPO))          # its examples cite nothing
    missing = [f"{rel}:{n}: §{num}" for rel in repo_files(*CITING_DIRS) if rel != this
               for n, num in citations(text_of(rel) or "")
               if not resolves(num, numbers, items)]
    assert not missing, "spec citations with no section in docs/protocol.md:\n" + "\n".join(
        missing)


def long_files(files: Iterable[str]) -> list[str]:
    return [f"{rel}: {n} lines" for rel in files if rel.endswith(".py")
            and (n := len((REPO / rel).read_text().splitlines())) > MAX_LINES]


@pytest.mark.parametrize("top", SIZE_DIRS)
def test_modules_stay_readable(top: str) -> None:
    """A module over MAX_LINES has more than one job: split it."""
    too_long = long_files(repo_files(top))
    assert not too_long, f"over {MAX_LINES} lines:\n" + "\n".join(too_long)
