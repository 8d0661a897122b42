"""Every relative link in README.md and docs/*.md resolves: the file exists, and an ``#anchor`` names a
heading of the target page as GitHub spells its slug (or an explicit ``<a id=...>``/``name=``).

Links in fenced code blocks and inline code spans are not links; ``http(s):``, ``mailto:`` and other
scheme links are not checked (no network in the unit tests).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from clm_devtools.paths import REPO_ROOT

PAGES = [REPO_ROOT / "README.md", *sorted((REPO_ROOT / "docs").glob("*.md"))]

_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.DOTALL)
# [text](target) and ![alt](target); the text may hold one level of brackets ([`x`] or [a [b] c])
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REFERENCE = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_HEADING = re.compile(r"^\s{0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
_HTML_ANCHOR = re.compile(r"<a\s[^>]*(?:id|name)=\"([^\"]+)\"", re.IGNORECASE)
_SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def _prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def _prose_blocks(text: str):
    """(first line number, text) of each run of consecutive non-blank lines outside fenced code blocks, so a
    link or a code span that wraps onto the next line is still one."""
    block: list[str] = []
    first = previous = 0
    for number, line in _prose_lines(text):
        if block and (not line.strip() or number != previous + 1):
            yield first, "\n".join(block)
            block = []
        if line.strip():
            if not block:
                first = number
            block.append(line)
        previous = number
    if block:
        yield first, "\n".join(block)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: its text without markup, lower case, every character that is not
    a letter, digit, space, hyphen or underscore dropped, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = page.read_text(encoding="utf-8")
    found: set[str] = set()
    counts: dict[str, int] = {}
    for _, line in _prose_lines(text):
        match = _HEADING.match(line)
        if match:
            slug = github_slug(match.group(2))
            seen = counts.get(slug, 0)
            counts[slug] = seen + 1
            found.add(slug if seen == 0 else f"{slug}-{seen}")
        found.update(_HTML_ANCHOR.findall(line))
    return found


def links(page: Path) -> list[tuple[int, str]]:
    """(line number, target) of every link and reference definition outside code."""
    text = page.read_text(encoding="utf-8")
    out = []
    for first, block in _prose_blocks(text):
        # blank out code spans, keeping offsets (and so line numbers) where they were
        prose = _CODE_SPAN.sub(lambda span: re.sub(r"[^\n]", " ", span.group(0)), block)
        for match in _LINK.finditer(prose):
            out.append((first + prose.count("\n", 0, match.start()), match.group(1)))
        for offset, line in enumerate(prose.split("\n")):
            reference = _REFERENCE.match(line)
            if reference:
                out.append((first + offset, reference.group(1)))
    return out


def broken_links(page: Path, root: Path = REPO_ROOT) -> list[str]:
    problems = []
    for number, target in links(page):
        if _SCHEME.match(target) or target.startswith("//"):
            continue
        path_part, _, anchor = target.partition("#")
        where = f"{page.relative_to(root)}:{number}: {target}"
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.exists():
            problems.append(f"{where} (no such file)")
            continue
        if anchor:
            if resolved.suffix != ".md" or resolved.is_dir():
                problems.append(f"{where} (an anchor into a file that is not a markdown page)")
            elif anchor not in anchors(resolved):
                problems.append(f"{where} (no heading with the anchor #{anchor} in {resolved.name})")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(REPO_ROOT)))
def test_every_relative_link_resolves(page):
    assert broken_links(page) == []


def test_the_pages_are_found_and_the_readme_links_every_docs_page():
    readme = REPO_ROOT / "README.md"
    assert readme in PAGES and len(PAGES) > 1
    linked = {(readme.parent / target.partition("#")[0]).resolve() for _, target in links(readme)}
    assert [page.name for page in PAGES[1:] if page.resolve() not in linked] == []


def test_slugs_follow_github(tmp_path):
    assert github_slug("Replacing `contrastive-lm` in an environment") == "replacing-contrastive-lm-in-an-environment"
    assert github_slug("Checkpoint format (upstream contrastive-lm's, both ways)") == \
        "checkpoint-format-upstream-contrastive-lms-both-ways"
    assert github_slug("`make test-compose`") == "make-test-compose"
    assert github_slug("Operations: encoder identity, job retention, worker metrics, Redis") == \
        "operations-encoder-identity-job-retention-worker-metrics-redis"
    assert github_slug("3. The text contract (trainer and clm-serve must agree byte for byte)") == \
        "3-the-text-contract-trainer-and-clm-serve-must-agree-byte-for-byte"
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n## Same\n\n## Same\n\n```\n# not a heading\n```\n")
    assert anchors(page) == {"title", "same", "same-1"}


def test_a_broken_link_is_reported(tmp_path):
    """The check can fail: a missing file, a missing anchor, a missing anchor in the same page."""
    (tmp_path / "other.md").write_text("# Other\n\n## Real section\n")
    page = tmp_path / "README.md"
    page.write_text("# Top\n\n[ok](other.md#real-section) [gone](missing.md) [bad](other.md#nope) [self](#top)\n"
                    "[here](#elsewhere) `[code](missing-in-code.md)` a link whose text [wraps\nonto a line](gone.md)\n"
                    "`a code span that\nwraps [x](missing-in-span.md)`\n\n```\n[fenced](missing-in-fence.md)\n```\n"
                    "\n[ref]: missing-reference.md\n")
    problems = broken_links(page, root=tmp_path)
    assert [p.split(": ", 1)[0] for p in problems] == ["README.md:3", "README.md:3", "README.md:4", "README.md:4",
                                                       "README.md:13"]
    assert [p.split(": ", 1)[1].split(" (")[0] for p in problems] == [
        "missing.md", "other.md#nope", "#elsewhere", "gone.md", "missing-reference.md"]
