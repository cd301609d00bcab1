"""MkDocs hooks: complete the nav and generate the rule catalogue, diagrams and figures from kvspec's code."""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

log = logging.getLogger("mkdocs.hooks.kvspec")

ROOT = Path(__file__).resolve().parent.parent

# Top-level folders of docs/ and the nav section their unlisted pages join.
SECTIONS = {
    "tutorial": "Tutorial",
    "how-to": "How-to",
    "backends": "Backends",
    "spec": "Spec",
    "reference": "Reference",
    "explanation": "Explanation",
}

# A rule id as DESIGN.md writes them: capitals, a dash, a number (CLIP-1, SM-2).
RULE_ID = re.compile(r"\b([A-Z]{2,5}-\d+)\b")
# A spec heading that opens a rule's section: "## CLIP-1 ..." or "### Rule CLIP-1: ...".
RULE_HEADING = re.compile(r"^(#{2,4})\s+(?:Rule\s+)?\**`?([A-Z]{2,5}-\d+)\b(.*)$")


class CatalogueError(PluginError):
    """The rule list and the conformance catalogue disagree; the build must stop."""


# --------------------------------------------------------------------------- nav


def _nav_paths(nav: Any) -> set[str]:
    """Every page path a nav tree already lists."""
    found: set[str] = set()
    if isinstance(nav, str):
        found.add(nav)
    elif isinstance(nav, dict):
        for value in nav.values():
            found |= _nav_paths(value)
    elif isinstance(nav, list):
        for item in nav:
            found |= _nav_paths(item)
    return found


def complete_nav(nav: list[Any], docs_dir: Path) -> list[Any]:
    """Append every page under a known folder that the nav does not list yet to that folder's section."""
    listed = _nav_paths(nav)
    pending: dict[str, list[str]] = {}
    for path in sorted(docs_dir.rglob("*.md")):
        rel = path.relative_to(docs_dir).as_posix()
        top = rel.split("/", 1)[0]
        if rel in listed or top not in SECTIONS or "/_" in f"/{rel}":
            continue
        pending.setdefault(SECTIONS[top], []).append(rel)
    for title, pages in pending.items():
        section = next((item for item in nav if isinstance(item, dict) and title in item), None)
        if section is None:
            # A new section goes before Changelog, the last entry.
            nav.insert(len(nav) - 1, {title: pages})
            continue
        if isinstance(section[title], str):
            section[title] = [section[title]]
        section[title].extend(pages)
    return nav


def on_config(config: Any) -> Any:
    config["nav"] = complete_nav(config["nav"], Path(config["docs_dir"]))
    return config


# --------------------------------------------------------------------------- generated files


def _add(files: Files, config: Any, src_uri: str, content: str | bytes) -> None:
    existing = files.get_file_from_path(src_uri)
    if existing is not None:
        files.remove(existing)
    files.append(File.generated(config, src_uri, content=content))


def on_files(files: Files, config: Any) -> Files:
    spec_pages = {
        f.src_uri: Path(f.abs_src_path).read_text(encoding="utf-8")
        for f in files
        if f.src_uri.startswith("spec/") and f.src_uri.endswith(".md") and f.abs_src_path
    }
    _add(files, config, "spec/catalogue.md", render_catalogue_page(spec_pages))
    _add(files, config, "spec/diagrams.md", render_diagrams_page())
    for name, content in render_figures().items():
        _add(files, config, f"img/{name}", content)
    # CHANGELOG.md links into docs/ so that it reads right on a forge; on the site those links are relative.
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8").replace("](docs/", "](")
    _add(files, config, "changelog.md", changelog)
    return files


# --------------------------------------------------------------------------- rule catalogue


def render_catalogue_page(spec_pages: dict[str, str]) -> str:
    """The rule catalogue page; a placeholder until the rule list lands."""
    return "# Rule catalogue\n\nThe catalogue is generated from `kvspec._rules` and `kvspec_conformance`.\n"


# --------------------------------------------------------------------------- diagrams


def render_diagrams_page() -> str:
    """State and sequence diagrams; a placeholder until the sessions land."""
    return "# Diagrams\n\nState diagrams are generated from the session transition tables.\n"


# --------------------------------------------------------------------------- figures


def render_figures() -> dict[str, bytes]:
    """SVG figures keyed by file name."""
    return {}
