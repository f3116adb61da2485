"""Check the relative links of the project's Markdown: README.md, docs/*.md and experiments/**/README.md.

    python docs/check_links.py            # prints each broken link as file:line: target (why); exit 1 if any

Every relative link and image (`[text](path)`, `![alt](path)`, `[label]: path`) must name an existing file or folder,
resolved from the linking file's folder. A `#anchor` (alone: the same file; `path.md#anchor`; `folder/#anchor`: the
folder's README.md) must name a heading of that Markdown file, slugged as GitHub does, or an HTML `id`/`name`.
Links with a scheme (https:, mailto:, ...) and links inside code (fenced blocks, `inline code`) are not checked.
"""

import re
import sys
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parent.parent

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
INLINE_CODE = re.compile(r"(`+)(.+?)\1")
# [text](target) and ![alt](target); the text may hold one level of brackets (e.g. an image inside a link).
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^()\s]*(?:\([^()\s]*\)[^()\s]*)*)(?:\s+[\"'(][^)]*)?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
ATX_HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)(?:\s+#+)?\s*$")
SETEXT_UNDERLINE = re.compile(r"^ {0,3}(=+|-+)\s*$")
HTML_ID = re.compile(r"<[^>]+\b(?:id|name)\s*=\s*[\"']([^\"']+)[\"']")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def markdown_files(root: Path = ROOT) -> list[Path]:
    files = [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted((root / "experiments").glob("**/README.md"))]
    return [path for path in files if path.is_file()]


def lines_outside_fences(text: str):
    """(line number, line) of the lines outside fenced code blocks."""
    fence = None
    for number, line in enumerate(text.splitlines(), 1):
        match = FENCE.match(line)
        if fence is None and match:
            fence = match.group(1)
        elif fence is not None and match and match.group(1)[0] == fence[0] and len(match.group(1)) >= len(fence):
            fence = None
        elif fence is None:
            yield number, line


def github_slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text, lowercased, with everything but letters, digits, spaces,
    hyphens and underscores removed and spaces turned into hyphens."""
    parts = []
    position = 0
    for match in INLINE_CODE.finditer(heading):  # code keeps its underscores and asterisks
        parts.append(("text", heading[position : match.start()]))
        parts.append(("code", match.group(2).strip()))
        position = match.end()
    parts.append(("text", heading[position:]))
    rendered = ""
    for kind, part in parts:
        if kind == "text":
            part = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", part)  # links and images: their text
            part = re.sub(r"<[^>]+>", "", part)  # HTML tags
            part = part.replace("*", "")
            part = re.sub(r"(?<![0-9A-Za-z])_+|_+(?![0-9A-Za-z])", "", part)  # emphasis, not snake_case
        rendered += part
    slug = "".join(c for c in rendered.strip().lower() if c.isalnum() or c in " -_")
    return slug.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors a Markdown file defines: its headings' slugs (duplicates numbered -1, -2, ... as GitHub does) and
    HTML ids and names."""
    found, counts = set(), {}
    previous = None
    for _, line in lines_outside_fences(path.read_text(encoding="utf-8")):
        heading = None
        match = ATX_HEADING.match(line)
        if match:
            heading = match.group(2)
        elif previous and previous.strip() and SETEXT_UNDERLINE.match(line) and not ATX_HEADING.match(previous):
            if not re.match(r"^\s*([-*_]\s*){3,}$", previous) and not previous.lstrip().startswith(("|", "-", "*", ">")):
                heading = previous.strip()
        if heading is not None:
            slug = github_slug(heading)
            count = counts.get(slug, 0)
            counts[slug] = count + 1
            found.add(slug if count == 0 else f"{slug}-{count}")
        found.update(HTML_ID.findall(line))
        previous = line
    return found


def link_targets(path: Path):
    """(line number, target) of every link and image in a Markdown file, outside code."""
    for number, line in lines_outside_fences(path.read_text(encoding="utf-8")):
        text = INLINE_CODE.sub(lambda m: " " * len(m.group(0)), line)
        definition = REFERENCE_DEFINITION.match(text)
        if definition:
            yield number, definition.group(1)
        for match in INLINE_LINK.finditer(text):
            yield number, match.group(1)


def check_link(source: Path, target: str, anchor_cache: dict) -> str | None:
    """Why `target`, linked from `source`, is broken; None if it resolves."""
    target = target.strip()
    if target.startswith("<") and target.endswith(">"):
        target = target[1:-1].strip()
    if not target:
        return "empty link"
    if SCHEME.match(target) or target.startswith("//"):
        return None  # not relative
    path_part, _, anchor = target.partition("#")
    path_part = unquote(path_part.split("?", 1)[0])
    if path_part.startswith("/"):
        resolved = ROOT / path_part.lstrip("/")
    else:
        resolved = (source.parent / path_part) if path_part else source
    if not resolved.exists():
        return "no such file or folder"
    if not anchor:
        return None
    markdown = resolved / "README.md" if resolved.is_dir() else resolved
    if markdown.suffix.lower() not in (".md", ".markdown") or not markdown.is_file():
        return f"anchor #{anchor} into a file without Markdown headings"
    key = markdown.resolve()
    if key not in anchor_cache:
        anchor_cache[key] = anchors(markdown)
    if unquote(anchor).lower() not in anchor_cache[key]:
        return f"no heading #{anchor} in {markdown.relative_to(ROOT)}"
    return None


def broken_links(files: list[Path] | None = None) -> list[str]:
    """'file:line: target (why)' for every broken relative link of `files` (default: the project's Markdown)."""
    anchor_cache, broken = {}, []
    for source in markdown_files() if files is None else files:
        for number, target in link_targets(source):
            reason = check_link(source, target, anchor_cache)
            if reason:
                broken.append(f"{source.relative_to(ROOT)}:{number}: {target} ({reason})")
    return broken


def main(argv: list[str] | None = None) -> int:
    files = [Path(name).resolve() for name in (sys.argv[1:] if argv is None else argv)] or None
    broken = broken_links(files)
    for line in broken:
        print(line)
    checked = markdown_files() if files is None else files
    print(f"{len(broken)} broken link(s) in {len(checked)} Markdown file(s)", file=sys.stderr)
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
