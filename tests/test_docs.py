"""The README is a front page, and every relative link of README.md and docs/*.md resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from readme_blocks import README, ROOT, pages

#: ``[text](target)`` outside code: the target up to a space or the closing parenthesis.
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_CODE = re.compile(r"`[^`\n]*`")


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for the headings of ``page``: lower case, punctuation dropped, spaces to -."""
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    headings = re.findall(r"^#+\s+(.*?)\s*$", text, re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def _links(page: Path) -> list[str]:
    text = _CODE.sub("", _FENCE.sub("", page.read_text(encoding="utf-8")))
    return _LINK.findall(text)


def test_the_readme_is_a_front_page() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines; the manual belongs in docs/"
    assert "## Layout" not in lines, "link docs/ARCHITECTURE.md instead of a Layout section"


@pytest.mark.parametrize("page", [pytest.param(p, id=p.relative_to(ROOT).as_posix()) for p in pages()])
def test_every_relative_link_points_to_a_file(page: Path) -> None:
    missing = []
    for target in _links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue  # https:, mailto:
        if target.startswith("#"):
            target = page.name + target
        path, _, anchor = target.partition("#")
        file = page.parent / path
        if not file.exists():
            missing.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            missing.append(f"{target} (no such heading)")
    assert not missing, f"{page.relative_to(ROOT)} links to files that do not exist: {missing}"


def test_every_docs_page_is_listed_in_the_index() -> None:
    index = (ROOT / "docs" / "index.md").read_text(encoding="utf-8")
    for page in pages()[1:]:
        if page.name != "index.md":
            assert f"({page.name})" in index, f"docs/index.md does not link {page.name}"
