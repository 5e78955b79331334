"""Every relative link of every document (tests/docs/commands.py's markdown_documents: README.md
and each *.md under megalite/, tools/, scripts/, examples/, tests/) names a file or folder that
exists, and a link's #anchor into a markdown document names one of its headings (as GitHub makes
a heading's anchor)."""

import re
from pathlib import Path

from tests.docs.commands import REPO, markdown_documents

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # links and images
_EXTERNAL = ("http://", "https://", "mailto:")


def anchors(path: Path) -> set[str]:
    """The anchors GitHub gives `path`'s headings: lower case, punctuation dropped, blanks made
    hyphens, a repeated anchor numbered -1, -2, ..."""
    seen, found = {}, set()
    for line in _prose_lines(path.read_text(encoding="utf-8")):
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def _prose_lines(text: str):
    """The lines outside fenced code blocks, with inline code spans blanked."""
    fence = False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            fence = not fence
            continue
        if not fence:
            yield re.sub(r"`[^`]*`", "``", line)


def broken_links(path: Path) -> list[str]:
    """`path`'s relative links whose file, or whose anchor in a markdown file, does not exist."""
    broken = []
    for number, line in enumerate(_prose_lines(path.read_text(encoding="utf-8")), 1):
        for target in _LINK.findall(line):
            if target.startswith(_EXTERNAL):
                continue
            file, _, anchor = target.partition("#")
            resolved = (path.parent / file).resolve() if file else path
            if not resolved.exists():
                broken.append(f"{target}: no such file")
            elif anchor and resolved.suffix == ".md" and anchor not in anchors(resolved):
                broken.append(f"{target}: {resolved.name} has no heading with that anchor")
    return broken


def test_every_relative_link_resolves():
    broken = [f"{doc.relative_to(REPO)}: {b}" for doc in markdown_documents() for b in broken_links(doc)]
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_the_documents_link_to_each_other():
    """The README's links reach every other document, so none is an orphan (and the check above has
    links to check)."""
    readme = REPO / "README.md"
    linked = {(readme.parent / t.partition("#")[0]).resolve()
              for line in _prose_lines(readme.read_text(encoding="utf-8")) for t in _LINK.findall(line)}
    orphans = [str(d.relative_to(REPO)) for d in markdown_documents()[1:] if d.resolve() not in linked]
    assert not orphans, f"documents README.md does not link to: {orphans}"


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "README.md").write_text("# Sub\n\n## Data preparation (2026, quiet: load 1.5–1.8)\n")
    doc = tmp_path / "README.md"
    doc.write_text("[ok](sub/README.md) [ok](sub/README.md#data-preparation-2026-quiet-load-1518) "
                   "[web](https://example.com/x) `[code](missing.md)`\n"
                   "[gone](sub/missing.md) [bad anchor](sub/README.md#nothing) ![img](also-missing.png)\n"
                   "```\n[in a block](missing.md)\n```\n")
    assert broken_links(doc) == ["sub/missing.md: no such file",
                                 "sub/README.md#nothing: README.md has no heading with that anchor",
                                 "also-missing.png: no such file"]
