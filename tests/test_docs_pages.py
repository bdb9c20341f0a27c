"""README.md stays a five-minute read, and every relative link of README.md and docs/ resolves: the file
exists, and an anchor names a heading of it (as a code host renders headings to anchors)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, markup and punctuation but '-' and '_' dropped, spaces to '-'."""
    text = re.sub(r"`([^`]*)`", r"\1", heading).strip().lower()
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found, seen, fenced = set(), {}, False
    for line in page.read_text().split("\n"):
        fenced ^= line.lstrip().startswith("```")
        if not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            base = anchor(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            found.add(base if n == 0 else f"{base}-{n}")
    return found


def broken_links(pages=PAGES) -> list[str]:
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # links inside code are not links
        for target in LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:: not this repository's
            path, _, frag = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}: no such file")
            elif frag and (dest.is_dir() or dest.suffix != ".md" or frag not in anchors(dest)):
                broken.append(f"{page.relative_to(ROOT)}: {target}: no heading '#{frag}' there")
    return broken


def test_readme_is_a_five_minute_read():
    assert (ROOT / "README.md").stat().st_size <= 15 * 1024


def test_every_relative_link_and_anchor_resolves():
    assert not broken_links(), "\n".join(broken_links())


def test_a_broken_link_or_anchor_is_found(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## The rollout\u2013trainer gap and `its` correction\n")
    page = tmp_path / "page.md"
    page.write_text("[ok](other.md#the-rollouttrainer-gap-and-its-correction) [self](#a-heading)\n# A heading\n"
                    "```\n[in code](nowhere.md)\n```\n[gone](missing.md) [bad](other.md#no-such) [web](https://x.y)\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert broken_links([page]) == ["page.md: missing.md: no such file",
                                        "page.md: other.md#no-such: no heading '#no-such' there"]
    finally:
        ROOT = saved
