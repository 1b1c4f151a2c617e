"""The documentation: the MkDocs site builds with no warning (no page links to nothing, every registered model
and algorithm has its place), the README stays a short guide, and every relative link of README.md and docs/*.md
(anchors included) points at something that is there."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)


def _mkdocs() -> list[str]:
    """The venv's mkdocs (beside this interpreter), else the module through this interpreter."""
    script = Path(sys.executable).with_name("mkdocs")
    return [str(script)] if script.exists() else [sys.executable, "-m", "mkdocs"]


def test_the_site_builds_strict_with_its_generated_pages(tmp_path):
    site = tmp_path / "site"
    built = subprocess.run(
        [*_mkdocs(), "build", "--strict", "--config-file", str(REPO / "mkdocs.yml"), "--site-dir", str(site)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert built.returncode == 0, built.stdout + built.stderr
    assert "WARNING" not in built.stderr, built.stderr
    reference = (site / "configuration" / "index.html").read_text()
    from trainer.algorithms import ALGORITHMS
    from trainer.models import MODELS

    for section in ("model", "algorithm", "warmup", "data", "reward", "parallel", "train", "eval", "logging"):
        assert f'id="{section}"' in reference, section
    for name in [*MODELS, *ALGORITHMS]:
        assert re.search(rf'id="(model|algorithm)-{name}"', reference), name
    assert "train.max_skipped_steps" in reference  # a field's row, with its description below
    algorithms = (site / "algorithms" / "index.html").read_text()
    assert "clamp(ratio, 1 - eps, 1 + eps)" in algorithms  # grpo's docstring formula, read at build time
    assert (site / "repo" / "bench" / "RESULTS" / "index.html").exists()


def test_the_readme_is_a_short_guide_whose_make_targets_exist():
    readme = (REPO / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^\s*make ([\w-]+)", readme, re.MULTILINE))
    assert {"demo", "test"} <= targets
    for target in targets:
        assert re.search(rf"^{re.escape(target)}:", makefile, re.MULTILINE), target


def _slug(heading: str) -> str:
    """GitHub's (and MkDocs') anchor of a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    anchors = set(re.findall(r"\{#([\w-]+)\}", text))
    for heading in re.findall(r"^#+ (.+?)(?: \{#[\w-]+\})?$", text, re.MULTILINE):
        anchors.add(_slug(heading))
    return anchors


def test_every_relative_link_of_the_readme_and_docs_resolves():
    broken = []
    for page in PAGES:
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{page.relative_to(REPO)}: {target}")
            elif anchor and resolved.suffix == ".md" and "<!-- generated:" not in resolved.read_text():
                if anchor not in _anchors(resolved):
                    broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, broken
