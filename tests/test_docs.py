"""The code examples in docs/ and README.md run, and the docs build's own checks can fail."""

from __future__ import annotations

import doctest
import importlib.util
import re
import textwrap
from pathlib import Path
from types import ModuleType

import attrs
import pytest

import kvspec.rules

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

# An opening or closing fence, with its indent (blocks inside admonitions and lists are indented).
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>`{3,}|~{3,})[ \t]*(?P<info>[^`]*)$")
# Put this HTML comment on the line before a fence to keep a block out of the run; only for
# blocks that genuinely cannot run here (they need a real engine, a GPU or another machine).
SKIP = "<!-- skip -->"


@attrs.frozen(kw_only=True)
class Block:
    """One fenced code block of a Markdown file."""

    path: Path
    line: int
    language: str
    source: str
    skipped: bool


def extract_blocks(path: Path) -> list[Block]:
    """Every fenced block of ``path``, in order, dedented to its fence's indent."""
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    i = 0
    previous = ""
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening or not opening["info"].strip():
            if lines[i].strip():
                previous = lines[i].strip()
            i += 1
            continue
        indent, fence = opening["indent"], opening["fence"]
        language = opening["info"].split()[0].strip("{}.").lower()
        body: list[str] = []
        start = i + 1
        i += 1
        while i < len(lines):
            closing = FENCE.match(lines[i])
            if closing and closing["fence"].startswith(fence) and not closing["info"].strip():
                break
            body.append(lines[i][len(indent) :] if lines[i].startswith(indent) else lines[i].lstrip())
            i += 1
        source = textwrap.dedent("\n".join(body)) + "\n"
        blocks.append(Block(path=path, line=start, language=language, source=source, skipped=previous == SKIP))
        previous = ""
        i += 1
    return blocks


def _documents() -> list[Path]:
    pages = [p for p in sorted(DOCS.rglob("*.md")) if not any(part.startswith("_") for part in p.parts)]
    return [ROOT / "README.md", *pages]


def _runnable(path: Path) -> bool:
    return any(b.language in {"python", "py", "pycon"} and not b.skipped for b in extract_blocks(path))


DOCUMENTS = [p for p in _documents() if p.exists() and _runnable(p)]


def run_blocks(blocks: list[Block]) -> None:
    """Run a page's Python blocks in order in one namespace, as a reader would paste them."""
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for block in blocks:
        if block.skipped:
            continue
        path = block.path.relative_to(ROOT) if block.path.is_relative_to(ROOT) else block.path
        where = f"{path}:{block.line}"
        if block.language in {"python", "py"}:
            exec(compile(block.source, where, "exec"), namespace)
        elif block.language == "pycon":
            test = doctest.DocTestParser().get_doctest(block.source, namespace, where, str(block.path), block.line)
            runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
            runner.run(test, clear_globs=False)
            assert not runner.failures, f"{where}: {runner.failures} doctest example(s) failed (output above)"


@pytest.mark.parametrize("path", DOCUMENTS, ids=[str(p.relative_to(ROOT)) for p in DOCUMENTS])
def test_examples_run(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Examples may write files (reports, plots); keep them out of the checkout.
    monkeypatch.chdir(tmp_path)
    run_blocks(extract_blocks(path))


def test_readme_has_a_runnable_example() -> None:
    blocks = [b for b in extract_blocks(ROOT / "README.md") if b.language == "python" and not b.skipped]
    assert blocks, "README.md should show a Python example that runs"


# --------------------------------------------------------------------------- the extractor itself


def test_extractor_finds_indented_blocks_and_honours_skip(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# T\n\n```python\nx = 1\n```\n\n!!! note\n    ```python\n    y = x + 1\n    ```\n\n"
        f"{SKIP}\n```python\nraise SystemExit\n```\n\n```bash\nexit 1\n```\n",
        encoding="utf-8",
    )
    blocks = extract_blocks(page)
    assert [(b.language, b.skipped) for b in blocks] == [
        ("python", False),
        ("python", False),
        ("python", True),
        ("bash", False),
    ]
    assert blocks[1].source == "y = x + 1\n"
    run_blocks(blocks)  # the skipped block would raise


def test_a_failing_example_fails(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("```python\nassert 1 + 1 == 3\n```\n", encoding="utf-8")
    with pytest.raises(AssertionError, match=r"^$"):  # a bare assert in a page has no message
        run_blocks(extract_blocks(page))
    page.write_text("```pycon\n>>> 1 + 1\n3\n```\n", encoding="utf-8")
    with pytest.raises(AssertionError, match="doctest"):
        run_blocks(extract_blocks(page))


# --------------------------------------------------------------------------- the build hook


def _load_hooks() -> ModuleType:
    pytest.importorskip("mkdocs")
    spec = importlib.util.spec_from_file_location("kvspec_docs_hooks", DOCS / "hooks.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_nav_gains_unlisted_pages(tmp_path: Path) -> None:
    hooks = _load_hooks()
    for rel in ["index.md", "spec/index.md", "spec/new-rule.md", "backends/x.md", "misc/other.md"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("# t\n", encoding="utf-8")
    spec = ["spec/index.md", {"Rule catalogue": "spec/catalogue.md"}]
    nav = hooks.complete_nav([{"Home": "index.md"}, {"Spec": spec}, {"Changelog": "c.md"}], tmp_path)
    assert nav == [
        {"Home": "index.md"},
        {"Spec": ["spec/index.md", "spec/new-rule.md", {"Rule catalogue": "spec/catalogue.md"}]},
        {"Backends": ["backends/x.md"]},
        {"Changelog": "c.md"},
    ]


def test_docstring_indexing_is_not_read_as_links() -> None:
    spec = importlib.util.spec_from_file_location("griffe_brackets", DOCS / "_gen" / "griffe_brackets.py")
    assert spec is not None
    assert spec.loader is not None
    pytest.importorskip("griffe")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text = "pair (producer[g][i], c[g][i]); see [kvspec.X][] or [a][kvspec.Y]; ``a[b]`` stays"
    assert module.escape_indexing(text) == (
        r"pair (producer\[g\]\[i\], c\[g\]\[i\]); see [kvspec.X][] or [a][kvspec.Y]; ``a[b]`` stays"
    )


@attrs.frozen(kw_only=True)
class _Rule:
    id: str
    title: str = "t"
    level: str = "MUST"
    summary: str = "s"


@attrs.frozen(kw_only=True)
class _Case:
    id: str
    rule: str
    title: str = "t"
    level: str = "MUST"
    requires: frozenset[str] = frozenset()


def test_catalogue_fails_on_a_rule_without_a_case() -> None:
    hooks = _load_hooks()
    rules = [_Rule(id="CLIP-1"), _Rule(id="NEW-1")]
    with pytest.raises(hooks.CatalogueError, match="rule NEW-1 has no conformance case"):
        hooks.check_catalogue(rules, [_Case(id="CLIP-1/a", rule="CLIP-1")])


def test_catalogue_fails_on_a_case_citing_an_unknown_rule() -> None:
    hooks = _load_hooks()
    cases = [_Case(id="CLIP-1/a", rule="CLIP-1"), _Case(id="CLIP-9/b", rule="CLIP-9")]
    with pytest.raises(hooks.CatalogueError, match="case CLIP-9/b cites unknown rule 'CLIP-9'"):
        hooks.check_catalogue([_Rule(id="CLIP-1")], cases)


def test_catalogue_of_this_checkout_is_complete() -> None:
    hooks = _load_hooks()
    rules, cases = hooks.load_catalogue()
    by_rule = hooks.check_catalogue(rules, cases)
    assert set(by_rule) == {rule.id for rule in rules}


def test_spec_headings_gain_their_cases_and_the_catalogue_links_back() -> None:
    hooks = _load_hooks()
    rules = [_Rule(id="CLIP-1"), _Rule(id="SW-1")]
    by_rule = hooks.check_catalogue(rules, [_Case(id="CLIP-1/a", rule="CLIP-1"), _Case(id="SW-1/b", rule="SW-1")])
    page = "# Clipping\n\n## CLIP-1: keep the tail\n\nText.\n\n```text\n## SW-1 inside a fence\n```\n"
    linked = hooks.link_rule_sections(page, "spec/reference.md", by_rule)
    assert "*Conformance cases* ([catalogue](catalogue.md#clip-1)): `CLIP-1/a`" in linked
    assert "{: #cases-clip-1 .kvspec-cases }" in linked
    assert "SW-1/b" not in linked  # a heading inside a code fence is not a heading
    hooks.check_spec_headings({"spec/reference.md": page}, by_rule)
    with pytest.raises(hooks.CatalogueError, match=r"spec/x\.md: DRAIN-1"):
        hooks.check_spec_headings({"spec/x.md": "## DRAIN-1: drain\n"}, by_rule)
    sections = hooks.find_rule_sections({"spec/reference.md": page})
    assert sections == {"CLIP-1": ("spec/reference.md", "cases-clip-1")}
    rendered = hooks.render_catalogue(rules, by_rule, sections)
    assert "[CLIP-1 in the spec](reference.md#cases-clip-1)" in rendered
    assert "| `SW-1/b` | MUST | - | t |" in rendered


def test_errors_page_finds_raises_through_helpers_and_validators(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("kvspec_docs_errors", DOCS / "_gen" / "errors.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "mod.py").write_text(
        textwrap.dedent(
            """
            import attrs
            class KVSpecError(Exception): ...
            class BadError(KVSpecError, ValueError): ...
            class WorseError(BadError): ...
            def _helper(x):
                raise WorseError(x)
            def api(x):
                return _helper(x)
            def clean(x):
                return x
            def _check(inst, attribute, value):
                if value < 0:
                    raise BadError(value)
            @attrs.frozen
            class Model:
                x: int = attrs.field(validator=_check)
            """
        ),
        encoding="utf-8",
    )
    public = {"api()": ("pkg.mod", "api"), "clean()": ("pkg.mod", "clean"), "Model(...)": ("pkg.mod", "Model.__init__")}
    table = module.raised_by(package, public)
    assert table["WorseError"] == ["api()"]
    assert table["BadError"] == ["Model(...)", "api()"]  # a subclass counts for its base
    assert "clean()" not in table["KVSpecError"]


def test_changelog_states_both_versions() -> None:
    import kvspec

    text = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8")
    major, minor = kvspec.PROTOCOL_VERSION
    section = re.search(
        rf"^## {re.escape(kvspec.__version__)}\n(?P<body>.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL
    )
    assert section, f"CHANGELOG.md has no section for package version {kvspec.__version__}"
    # The newest section speaks for the code: "Unreleased" once the protocol moved ahead of the last release.
    newest = re.search(r"^## (?P<name>[^\n]+)\n(?P<body>.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert newest is not None
    body = newest["body"] if newest["name"] == "Unreleased" and "Protocol: **" in newest["body"] else section["body"]
    assert f"Protocol: **{major}.{minor}**" in body, "the release must say which protocol version it speaks"


def _build_config() -> object:
    pytest.importorskip("mkdocs")
    from mkdocs.config import load_config

    return load_config(str(ROOT / "mkdocs.yml"))


def test_the_build_stops_on_a_rule_without_a_case(monkeypatch: pytest.MonkeyPatch) -> None:
    from mkdocs.structure.files import Files

    import kvspec.core._rules

    hooks = _load_hooks()
    config = _build_config()
    new = kvspec.core._rules.Rule(id="NEW-9", title="a new rule", level=kvspec.core._rules.Level.MUST, summary="s")
    monkeypatch.setattr(kvspec.core._rules, "RULES", (*kvspec.core._rules.RULES, new))
    with pytest.raises(hooks.CatalogueError, match="rule NEW-9 has no conformance case"):
        hooks.on_files(Files([]), config)


def test_the_build_stops_on_a_case_citing_an_unknown_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvspec_conformance
    from mkdocs.structure.files import Files

    hooks = _load_hooks()
    config = _build_config()
    real = kvspec_conformance.catalogue()
    stray = _Case(id="CLIP-9/stray", rule="CLIP-9")
    monkeypatch.setattr(kvspec_conformance, "catalogue", lambda: {**real, "CLIP-1": [*real["CLIP-1"], stray]})
    with pytest.raises(hooks.CatalogueError, match="case CLIP-9/stray cites unknown rule 'CLIP-9'"):
        hooks.on_files(Files([]), config)


@attrs.frozen(kw_only=True)
class _WaitingRule:
    id: str
    checked_by: str | None
    title: str = "t"
    summary: str = "s"
    level: str = "MUST"


def test_catalogue_lets_a_rule_wait_only_when_it_names_its_tests() -> None:
    hooks = _load_hooks()
    cases = [_Case(id="CLIP-1/a", rule="CLIP-1")]
    by_rule = hooks.check_catalogue([_Rule(id="CLIP-1"), _WaitingRule(id="OFF-1", checked_by="tests/x.py")], cases)
    assert by_rule["OFF-1"] == []
    with pytest.raises(hooks.CatalogueError, match="rule OFF-2 has no conformance case"):
        hooks.check_catalogue([_Rule(id="CLIP-1"), _WaitingRule(id="OFF-2", checked_by=None)], cases)


# --------------------------------------------------------------------------- the spec pages render kvspec/spec


def _load_spec_pages() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvspec_docs_spec_pages", DOCS / "_gen" / "spec_pages.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_RULE_MODULE = '''"""Window budgets: SW-1, CLIP-1."""

BUDGET = 3
"""The budget (SW-1)."""


def _helper() -> None:
    pass


def get_budget() -> int:
    """The budget (SW-1)."""
    return BUDGET


def clip() -> None:
    """Clip (CLIP-1)."""


def check_count() -> None:
    """A count, checked."""
'''

_RULE_PAGE = """# Window

## SW-1 Budgets

<!-- kvspec:spec:window.BUDGET -->

<!-- kvspec:spec:window._helper -->

<!-- kvspec:spec:window.get_budget -->

### Boundaries

<!-- kvspec:spec:window.check_count -->

## CLIP-1 Clipping

<!-- kvspec:spec:window.clip -->
"""


def test_spec_pages_fail_on_a_definition_missing_misplaced_or_twice(tmp_path: Path) -> None:
    literate = _load_spec_pages()
    (tmp_path / "window.py").write_text(_RULE_MODULE, encoding="utf-8")
    (tmp_path / "pins.py").write_text('"""Pinned rows (SW-1)."""\n\nPINS = ()\n', encoding="utf-8")
    definitions = literate.find_definitions(tmp_path)
    assert [(d.name, sorted(d.rules)) for d in definitions] == [
        ("BUDGET", ["SW-1"]),
        ("get_budget", ["SW-1"]),
        ("clip", ["CLIP-1"]),
        ("check_count", ["CLIP-1", "SW-1"]),  # names no rule: its module's
    ]
    assert literate.check_spec_pages({"spec/window.md": _RULE_PAGE}, definitions) == []

    missing = _RULE_PAGE.replace("<!-- kvspec:spec:window.get_budget -->", "")
    assert literate.check_spec_pages({"spec/window.md": missing}, definitions) == [
        "kvspec.spec.window.get_budget is on no spec page: "
        "put <!-- kvspec:spec:window.get_budget --> under its rule's heading (SW-1)"
    ]
    twice = {
        "spec/window.md": _RULE_PAGE,
        "spec/example.md": "## SW-1 again\n\n<!-- kvspec:spec:window.get_budget -->\n",
    }
    assert literate.check_spec_pages(twice, definitions) == [
        "kvspec.spec.window.get_budget is rendered 2 times (spec/example.md:3, spec/window.md:9); expected exactly once"
    ]
    moved = _RULE_PAGE.replace("<!-- kvspec:spec:window.clip -->", "").replace(
        "### Boundaries", "<!-- kvspec:spec:window.clip -->\n\n### Boundaries"
    )
    assert literate.check_spec_pages({"spec/window.md": moved}, definitions) == [
        "spec/window.md:11: kvspec.spec.window.clip sits under the SW-1 heading; its docstring names CLIP-1"
    ]
    outside = "## Words\n\n<!-- kvspec:spec:window.clip -->\n" + _RULE_PAGE.replace(
        "<!-- kvspec:spec:window.clip -->", ""
    )
    assert literate.check_spec_pages({"spec/window.md": outside}, definitions) == [
        "spec/window.md:3: kvspec.spec.window.clip sits under no rule heading; its docstring names CLIP-1"
    ]


def test_spec_pages_fail_on_a_registry_rule_without_a_definition(tmp_path: Path) -> None:
    """Every rule of the registry has a kvspec/spec definition rendered under its heading (issue 36)."""
    literate = _load_spec_pages()
    (tmp_path / "window.py").write_text(_RULE_MODULE, encoding="utf-8")
    definitions = literate.find_definitions(tmp_path)
    assert literate.check_spec_pages({"spec/window.md": _RULE_PAGE}, definitions, ["SW-1", "CLIP-1"]) == []
    # A rule with a heading but only prose under it: its definition is still elsewhere.
    page = _RULE_PAGE + "\n## TOK-1 Tokens\n\nThe count is explicit.\n"
    assert literate.check_spec_pages({"spec/window.md": page}, definitions, ["SW-1", "CLIP-1", "TOK-1"]) == [
        "TOK-1 has no definition in kvspec/spec: write it there, its docstring naming TOK-1, "
        "and put its marker under the TOK-1 heading"
    ]
    # A private helper rendered under a heading does not define its rule.
    helper_only = "## TOK-1 Tokens\n\n<!-- kvspec:spec:window._helper -->\n"
    problems = literate.check_spec_pages(
        {"spec/window.md": _RULE_PAGE, "spec/t.md": helper_only}, definitions, ["TOK-1"]
    )
    assert problems == [
        "TOK-1 has no definition in kvspec/spec: write it there, its docstring naming TOK-1, "
        "and put its marker under the TOK-1 heading"
    ]


def test_spec_pages_fail_on_a_private_module_and_over_budget() -> None:
    literate = _load_spec_pages()
    page = "# P\n\nSee `kvspec.protocol._session` and kvspec/drivers/_driver.py; kvspec.spec is public.\n"
    assert literate.check_spec_pages({"spec/p.md": page}, []) == [
        "spec/p.md:3: names the private module kvspec.protocol._session; name the public definition instead",
        "spec/p.md:3: names the private module kvspec/drivers/_driver.py; name the public definition instead",
    ]
    pages = {"spec/a.md": "x" * literate.SPEC_BUDGET, "spec/b.md": "é"}
    assert literate.check_spec_pages(pages, []) == [
        "docs/spec/*.md: 90,002 characters of markdown source, over the budget of 90,000"
    ]


def test_spec_pages_of_this_checkout_render_kvspec_spec() -> None:
    literate = _load_spec_pages()
    pages = {f"spec/{path.name}": path.read_text(encoding="utf-8") for path in (DOCS / "spec").glob("*.md")}
    definitions = literate.find_definitions(ROOT / "kvspec" / "spec")
    assert "compute_transfer_pairs" in {d.name for d in definitions}
    rule_ids = [rule.id for rule in kvspec.rules.RULES]
    assert {"HS-1", "VER-1", "INT-1"} <= set(rule_ids)
    assert literate.check_spec_pages(pages, definitions, rule_ids) == []
