"""MkDocs hook: repository files the pages link to outside docs/ (bench/RESULTS.md and its plots,
deploy/README.md, source files) become part of the site under ``repo/``, so that one relative link
(``../bench/RESULTS.md``) works both on GitHub and in the built site. Markdown files brought in this way are
pages whose own relative links are followed the same way.
"""

from __future__ import annotations

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File

PREFIX = "repo"
LINK = re.compile(r"\]\(([^)\s#]+)(#[^)\s]*)?\)")


def _outside_links(page: Path, docs: Path, repo: Path) -> list[Path]:
    """The repository files outside ``docs`` that ``page`` links to relatively."""
    found = []
    for target, _ in LINK.findall(page.read_text()):
        if "://" in target or target.startswith(("/", "mailto:")):
            continue
        path = (page.parent / target).resolve()
        if path.is_file() and path.is_relative_to(repo) and not path.is_relative_to(docs):
            found.append(path)
    return found


def on_files(files, config):
    docs = Path(config.docs_dir).resolve()
    repo = Path(config.config_file_path).resolve().parent
    queue = sorted(docs.glob("*.md"))
    brought: set[Path] = set()
    while queue:
        for path in _outside_links(queue.pop(), docs, repo):
            if path not in brought:
                brought.add(path)
                if path.suffix == ".md":
                    queue.append(path)
    for path in sorted(brought):
        uri = f"{PREFIX}/{path.relative_to(repo).as_posix()}"
        files.append(File.generated(config, uri, abs_src_path=str(path)))
    return files


def on_page_markdown(markdown: str, page, config, files) -> str:
    """A docs page's ``../X`` link (X outside docs/) points at ``repo/X``, where on_files put it."""
    if page.file.src_uri.startswith(f"{PREFIX}/"):
        return _back_into_docs(markdown, page.file.src_uri)
    depth = page.file.src_uri.count("/")
    up = "../" * depth

    def rewrite(match: re.Match) -> str:
        target, anchor = match.group(1), match.group(2) or ""
        climbs = len(re.match(r"(\.\./)*", target).group(0)) // 3
        if climbs != depth + 1:
            return match.group(0)
        return f"]({up}{PREFIX}/{target[3 * climbs :]}{anchor})"

    return LINK.sub(rewrite, markdown)


def _back_into_docs(markdown: str, uri: str) -> str:
    """A brought-in page's link into docs/ (``../docs/X.md`` from bench/) points at the site's own page X."""
    folder = posixpath.dirname(uri[len(PREFIX) + 1 :])
    up = "../" * uri.count("/")

    def rewrite(match: re.Match) -> str:
        target, anchor = match.group(1), match.group(2) or ""
        resolved = posixpath.normpath(posixpath.join(folder, target))
        if "://" in target or not resolved.startswith("docs/"):
            return match.group(0)
        return f"]({up}{resolved[len('docs/') :]}{anchor})"

    return LINK.sub(rewrite, markdown)
