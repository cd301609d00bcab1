"""MkDocs hooks: complete the nav and generate the rule catalogue, diagrams and figures from kvspec's code."""

from __future__ import annotations

import ast
import json
import posixpath
import re
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from markdown.extensions.toc import slugify
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import File, Files

from kvspec import TransferMode

ROOT = Path(__file__).resolve().parent.parent
GEN = Path(__file__).resolve().parent / "_gen"

# Top-level folders of docs/ and the nav section their unlisted pages join.
SECTIONS = {
    "tutorial": "Tutorial",
    "how-to": "How-to",
    "backends": "Backends",
    "spec": "Spec",
    "reference": "Reference",
    "explanation": "Explanation",
}

CATALOGUE = "spec/catalogue.md"
DIAGRAMS = "spec/diagrams.md"
GENERATED_PAGES = frozenset({CATALOGUE, DIAGRAMS})

# A spec heading that opens a rule's section: "## CLIP-1 ...", "### Rule `CLIP-1`: ...", "## **SW-1**".
RULE_HEADING = re.compile(r"^(?P<hashes>#{2,4})\s+(?:Rule\s+)?[*`]*(?P<id>[A-Z]{2,5}-\d+)\b(?P<rest>.*)$")
# <!-- kvspec:NAME --> in any page is replaced by a generated snippet (a diagram, a table).
MARKER = re.compile(r"^[ \t]*<!--\s*kvspec:(?P<name>[\w:.-]+)\s*-->[ \t]*$", re.MULTILINE)
# Fenced code: rule headings inside it are not headings.
FENCE = re.compile(r"^\s*(```|~~~)")


class CatalogueError(PluginError):
    """The rule list and the conformance catalogue disagree; the build must stop."""


class RuleLike(Protocol):
    """What the catalogue needs of a rule (``kvspec.core._rules.Rule``)."""

    @property
    def id(self) -> str: ...

    @property
    def title(self) -> str: ...

    @property
    def summary(self) -> str: ...

    @property
    def level(self) -> Any: ...


class CaseLike(Protocol):
    """What the catalogue needs of a conformance case (``kvspec_conformance`` ``Case``)."""

    @property
    def id(self) -> str: ...

    @property
    def rule(self) -> str: ...

    @property
    def title(self) -> str: ...

    @property
    def level(self) -> Any: ...

    @property
    def requires(self) -> Iterable[str]: ...


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
        entries = section[title]
        # New pages go before the generated pages (catalogue, diagrams), which close their section.
        tail = next((i for i, item in enumerate(entries) if _nav_paths(item) & GENERATED_PAGES), len(entries))
        entries[tail:tail] = pages
    return nav


def on_config(config: Any) -> Any:
    config["nav"] = complete_nav(config["nav"], Path(config["docs_dir"]))
    return config


# --------------------------------------------------------------------------- rule catalogue


def _level(value: Any) -> str:
    return str(getattr(value, "value", value))


def check_catalogue(rules: Sequence[RuleLike], cases: Sequence[CaseLike]) -> dict[str, list[CaseLike]]:
    """Rule id -> its cases; raises :class:`CatalogueError` listing every rule without a case and every
    case that cites an unknown rule, so that neither can reach the published spec."""
    by_rule: dict[str, list[CaseLike]] = {rule.id: [] for rule in rules}
    problems = []
    if len(by_rule) != len(rules):
        problems.append("a rule id is listed twice in kvspec.core._rules.RULES")
    for case in cases:
        if case.rule not in by_rule:
            problems.append(f"case {case.id} cites unknown rule {case.rule!r}")
        else:
            by_rule[case.rule].append(case)
    # A rule may wait for its suite cases only when it names the tests that check it meanwhile (OFF-*).
    waiting = {rule.id for rule in rules if getattr(rule, "checked_by", None)}
    problems += [
        f"rule {rule_id} has no conformance case"
        for rule_id, found in by_rule.items()
        if not found and rule_id not in waiting
    ]
    if problems:
        raise CatalogueError("rule catalogue: " + "; ".join(problems))
    return by_rule


def load_catalogue() -> tuple[Sequence[RuleLike], Sequence[CaseLike]]:
    """The rules from kvspec and every registered case from the installed suite."""
    from kvspec.core._rules import RULES

    try:
        import kvspec_conformance
    except Exception as error:  # the build must say why it cannot list the cases
        raise CatalogueError(f"rule catalogue: kvspec_conformance does not import: {error!r}") from error
    source = getattr(kvspec_conformance, "catalogue", None)
    if source is None:
        from kvspec_conformance import _cases

        source = _cases.catalogue
    try:
        table: Mapping[str, Sequence[CaseLike]] = source()
    except Exception as error:  # e.g. a case registered for an unknown rule
        raise CatalogueError(f"rule catalogue: the suite's catalogue fails: {error}") from error
    cases = [case for found in table.values() for case in found]
    return RULES, cases


def find_rule_sections(spec_pages: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """Rule id -> (spec page, anchor) of the first heading that opens the rule's section."""
    sections: dict[str, tuple[str, str]] = {}
    for page, text in sorted(spec_pages.items()):
        if page == CATALOGUE:
            continue
        for rule_id in _rule_headings(text):
            sections.setdefault(rule_id, (page, _cases_anchor(rule_id)))
    return sections


def check_spec_headings(spec_pages: Mapping[str, str], by_rule: Mapping[str, object]) -> None:
    """A spec section may open only for a rule the rule list knows (add it to kvspec.core._rules first)."""
    unknown = sorted(
        f"{page}: {rule_id}"
        for page, text in spec_pages.items()
        for rule_id in _rule_headings(text)
        if rule_id not in by_rule
    )
    if unknown:
        raise CatalogueError(f"spec headings name rules missing from kvspec.core._rules.RULES: {'; '.join(unknown)}")


def _rule_headings(text: str) -> list[str]:
    found = []
    in_fence = False
    for line in text.splitlines():
        if FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and (match := RULE_HEADING.match(line)):
            found.append(match["id"])
    return found


def _cases_anchor(rule_id: str) -> str:
    return f"cases-{slugify(rule_id, '-')}"


def _rel(from_page: str, to_page: str) -> str:
    """A link from one docs page to another, relative to the first's folder."""
    return posixpath.relpath(to_page, posixpath.dirname(from_page) or ".")


def render_catalogue(
    rules: Sequence[RuleLike], by_rule: Mapping[str, Sequence[CaseLike]], sections: Mapping[str, tuple[str, str]]
) -> str:
    """The catalogue page: every rule with its level, summary, spec section and conformance cases."""
    total = sum(len(found) for found in by_rule.values())
    out = [
        "# Rule catalogue",
        "",
        "Generated at build time from the rule list (`kvspec.core._rules.RULES`) and the conformance",
        "suite's registry (`kvspec_conformance.catalogue()`). **The docs build fails** when a rule",
        "has no conformance case or a case cites an unknown rule, so this page cannot list a rule",
        "that nothing checks. The offload (OFF-*) and parallelism (PAR-*) rules have no suite case yet; each names the",
        "tests that check the reference meanwhile.",
        "",
        f"{len(rules)} rules, {total} cases. Run one rule's cases with",
        "`kvspec conform BACKEND --rule CLIP-1`.",
        "",
        "| Rule | Level | Title | Cases |",
        "|---|---|---|---|",
    ]
    for rule in rules:
        anchor = slugify(rule.id, "-")
        out.append(f"| [{rule.id}](#{anchor}) | {_level(rule.level)} | {rule.title} | {len(by_rule[rule.id])} |")
    for rule in rules:
        out += ["", f"## {rule.id}: {rule.title} {{#{slugify(rule.id, '-')}}}", ""]
        out.append(f"**{_level(rule.level)}.** {rule.summary}")
        if rule.id in sections:
            page, anchor = sections[rule.id]
            out += ["", f"Normative text: [{rule.id} in the spec]({_rel(CATALOGUE, page)}#{anchor})."]
        checked_by = getattr(rule, "checked_by", None)
        if checked_by and not by_rule[rule.id]:
            out += ["", f"No conformance case yet; checked by `{checked_by}`."]
            continue
        out += ["", "| Case | Level | Needs | Checks |", "|---|---|---|---|"]
        for case in by_rule[rule.id]:
            needs = ", ".join(sorted(case.requires)) or "-"
            out.append(f"| `{case.id}` | {_level(case.level)} | {needs} | {case.title} |")
    return "\n".join(out) + "\n"


def _waiting_note(rule_id: str) -> str:
    """What a spec section says of a rule that has no conformance case yet."""
    from kvspec.core._rules import RULES

    checked_by = next((getattr(r, "checked_by", None) for r in RULES if r.id == rule_id), None)
    return f"none yet; `{checked_by}` checks the reference meanwhile" if checked_by else "none yet"


def link_rule_sections(markdown: str, page: str, by_rule: Mapping[str, Sequence[CaseLike]]) -> str:
    """Below each rule heading of a spec page, list the rule's conformance cases, linked to the catalogue."""
    out = []
    in_fence = False
    seen: set[str] = set()
    for line in markdown.splitlines():
        out.append(line)
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        match = None if in_fence else RULE_HEADING.match(line)
        if match is None or match["id"] not in by_rule or match["id"] in seen:
            continue
        rule_id = match["id"]
        seen.add(rule_id)
        target = _rel(page, CATALOGUE)
        cases = ", ".join(f"`{case.id}`" for case in by_rule[rule_id]) or _waiting_note(rule_id)
        out += [
            "",
            f"*Conformance cases* ([catalogue]({target}#{slugify(rule_id, '-')})): {cases}",
            f"{{: #{_cases_anchor(rule_id)} .kvspec-cases }}",
            "",
        ]
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- generated files and snippets


def _add(files: Files, config: Any, src_uri: str, content: str | bytes) -> None:
    existing = files.get_file_from_path(src_uri)
    if existing is not None:
        files.remove(existing)
    files.append(File.generated(config, src_uri, content=content))


def _fence(kind: str, body: str) -> str:
    return f"```{kind}\n{body.rstrip()}\n```\n"


def _import_generators() -> tuple[Any, Any, Any]:
    if str(GEN) not in sys.path:
        sys.path.insert(0, str(GEN))
    import diagrams
    import errors
    import figures

    return diagrams, errors, figures


SPEC_PACKAGE = ROOT / "kvspec" / "spec"


def spec_source_snippets() -> dict[str, str]:
    """``spec:MODULE.NAME`` for every top-level definition in kvspec/spec/: its source, as a Python block.

    Spec pages include the normative code through these markers, never a copy (docs/explanation/layers.md).
    """
    _import_generators()  # docs/_gen on sys.path
    import spec_pages

    return {
        f"spec:{name}": _fence("python", f"# kvspec/spec/{name.split('.')[0]}.py\n{source}")
        for name, source in spec_pages.definition_sources(SPEC_PACKAGE).items()
    }


def _pin_cell(value: object) -> str:
    from kvspec.spec.pins import Raises

    if isinstance(value, Raises):
        return f"raises `{value.error}`"
    return f"`{json.dumps(value)}`"


def pins_snippets() -> dict[str, str]:
    """``pins:RULE`` for every rule in kvspec/spec/pins.py: its pinned inputs, outputs and sources as a table.

    The spec pages show the pins through these markers, never a copy; the tests and the vectors read the same table.
    """
    from kvspec.spec.pins import PINS

    snippets = {}
    for rule in dict.fromkeys(p.rule for p in PINS):
        rows = [p for p in PINS if p.rule == rule]
        inputs = list(dict.fromkeys(k for p in rows for k in p.inputs))
        functions = list(dict.fromkeys(f for p in rows for f in p.expected))
        head = ["case", *(f"`{k}`" for k in inputs), *(f"`{f}(...)`" for f in functions), "what it pins; source"]
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for p in rows:
            cells = [f"`{p.name}`", *(_pin_cell(p.inputs[k]) if k in p.inputs else "" for k in inputs)]
            cells += [_pin_cell(p.expected[f]) if f in p.expected else "" for f in functions]
            lines.append("| " + " | ".join([*cells, p.description]) + " |")
        snippets[f"pins:{rule}"] = "\n".join(lines) + "\n"
    return snippets


ERRORS_PAGE = "reference/errors.md"
READ_MODE, WRITE_MODE = TransferMode.READ, TransferMode.WRITE
# Modules whose exported calls the errors page lists.
ERROR_SOURCES = ("kvspec", "kvspec.transport", "kvspec.transport.loopback")


def _raised_by_snippets(errors: Any) -> dict[str, str]:
    table = errors.raised_by(ROOT / "kvspec", errors.public_calls(ERROR_SOURCES))
    snippets = {}
    for error, calls in table.items():
        if calls:
            listed = ", ".join(f"`{call}`" for call in calls)
            snippets[f"raised-by:{error}"] = f"**Raised by:** {listed}.\n"
        else:
            snippets[f"raised-by:{error}"] = "**Raised by:** no exported call raises it directly.\n"
    return snippets


def check_errors_page(markdown: str) -> None:
    """Every error kvspec exports has its own section (a raised-by marker) on the errors page."""
    import kvspec

    exported = [
        name
        for name in kvspec.__all__
        if isinstance(getattr(kvspec, name), type)
        and issubclass(getattr(kvspec, name), kvspec.KVSpecError)
        and name != "KVSpecError"
    ]
    missing = [name for name in exported if f"kvspec:raised-by:{name} " not in markdown.replace("-->", " -->")]
    if missing:
        raise PluginError(
            f"{ERRORS_PAGE}: no section for exported error(s) {missing}; add one with its raised-by marker"
        )


_STATE: dict[str, Any] = {"snippets": {}, "by_rule": {}}


def render_diagrams_page(diagrams: Any) -> str:
    """State diagrams from the transition tables and sequences from running the sessions."""
    out = [
        "# Diagrams",
        "",
        "Generated at build time. The state diagrams are drawn from the transition tables the",
        "sessions execute (`kvspec.spec.lifecycle.PRODUCER_TRANSITIONS`, `CONSUMER_TRANSITIONS`); the",
        "sequence diagrams are recorded by running a `ProducerSession` and a `ConsumerSession`",
        "through each scenario, so every arrow is a message or an action the code really produced.",
        "Labels read `events / actions`; `|` separates events with different actions.",
        "",
    ]
    for role, rule in (("producer", "SM-1"), ("consumer", "SM-2")):
        out += [f"## {role.capitalize()} states ({rule})", ""]
        for mode in (READ_MODE, WRITE_MODE):
            out += [f"### {mode.value.upper()} mode", "", _fence("mermaid", diagrams.state_diagram(role, mode))]
        out += ['??? note "The transition table, both modes"', ""]
        out += ["    " + line for line in diagrams.transition_table(role).splitlines()]
        out.append("")
    out += ["## Sequences", ""]
    for name, (title, _) in diagrams.SEQUENCES.items():
        out += [f"### {title}", "", _fence("mermaid", diagrams.sequence_diagram(name))]
    return "\n".join(out) + "\n"


VLLM_AUDIT_JSON = ROOT / "docs" / "explanation" / "vllm-audit.json"
VLLM_FINDINGS_PAGE = "explanation/vllm-findings.md"


def vllm_audit_snippets(audit: Mapping[str, Any]) -> dict[str, str]:
    """Tables for the findings page from the committed ``kvspec vllm-audit --json`` output.

    ``vllm-audit:summary`` is the per-connector table; ``vllm-audit:class:NAME``
    is one deviation class: counts per connector and the smallest reproducer.
    """
    requests, pairs, closed = audit["requests"], audit["pairs"], audit["failed_closed"]
    by_class: dict[str, list[Mapping[str, Any]]] = {}
    for item in audit["classes"]:
        by_class.setdefault(item["class"], []).append(item)
    summary = [
        "| Connector | Requests | Pairs posted | Failed closed | Deviation classes (requests) |",
        "|---|---:|---:|---:|---|",
    ]
    for connector, count in requests.items():
        mine = [c for c in audit["classes"] if c["connector"] == connector]
        listed = ", ".join(f"[{c['class']}](#{c['class']}) ({c['requests']})" for c in mine) or "none"
        summary.append(f"| `{connector}` | {count:,} | {pairs[connector]:,} | {closed[connector]:,} | {listed} |")
    snippets = {"vllm-audit:summary": "\n".join(summary) + "\n"}
    for name, items in by_class.items():
        out = [
            f"Rule **{items[0]['rule']}**. Found at seed {audit['seed']} in vLLM {audit['vllm_version']}:",
            "",
            "| Connector | Requests | Findings | Smallest reproducer |",
            "|---|---:|---:|---|",
        ]
        for item in items:
            r = item["reproducer"]
            where = f"group {r['group']}: {r['detail']}" + (f"; pair `{r['pair']}`" if r.get("pair") else "")
            case = (
                f"`{' + '.join(r['groups'])}`, N={r['num_tokens']}, H={r['prefix_hit_tokens']}, "
                + (f"speculation {r['speculation']}" if r.get("speculation") else f"lookahead={r['lookahead']}")
                + f"; {where}"
            ).replace("|", "\\|")
            out.append(f"| `{item['connector']}` | {item['requests']} | {item['findings']} | {case} |")
        first = items[0]["reproducer"]
        out += [
            "",
            f"Lists of the first reproducer (`{items[0]['connector']}`), one per group, long ones shortened:",
            "",
            "```text",
            f"producer {first['producer_list']}",
            f"consumer {first['consumer_list']}",
            "```",
        ]
        snippets[f"vllm-audit:class:{name}"] = "\n".join(out) + "\n"
    return snippets


VLLM_EXPECTED = ROOT / "kvspec" / "integrations" / "expected"


def vllm_expected_failures() -> dict[str, dict[str, str]]:
    """Connector name -> {case id: reason}, from the committed ``--expect-fail-file`` lists."""
    from kvspec_conformance._runner import parse_expected_failures

    return {
        path.stem.removeprefix("vllm-"): parse_expected_failures(path.read_text(encoding="utf-8").splitlines())
        for path in sorted(VLLM_EXPECTED.glob("vllm-*.txt"))
        if not path.stem.startswith("vllm-audit")
    }


def vllm_expected_table(expected: Mapping[str, Mapping[str, str]]) -> str:
    """One table of every failing case per connector, with its reason and a link to the section explaining it."""
    out = ["| Connector | Failing case | Reason |", "|---|---|---|"]
    for connector, cases in expected.items():
        # A later release's list (nixl-0.34) shows only where it differs from 0.33.0's (nixl).
        base = expected.get(connector.rpartition("-")[0], {}) if connector.rpartition("-")[2][:1].isdigit() else {}
        for case_id, reason in cases.items():
            if base.get(case_id) == reason:
                continue
            text, _, anchor = reason.rpartition(" (#")
            link = f"[{text}](#{anchor.rstrip(')')})" if anchor else reason
            out.append(f"| `vllm:{connector}` | `{case_id}` | {link} |")
    return "\n".join(out) + "\n"


def check_vllm_findings_page(markdown: str, audit: Mapping[str, Any]) -> None:
    """Every audit class and every expected failure has its section on the findings page, and nothing stale stays."""
    headings = {slugify(m.group(1).strip(), "-") for m in re.finditer(r"^#{2,4}\s+(.+)$", markdown, re.MULTILINE)}
    for connector, cases in vllm_expected_failures().items():
        for case_id, reason in cases.items():
            anchor = reason.rpartition(" (#")[2].rstrip(")")
            if anchor not in headings:
                raise PluginError(
                    f"{VLLM_FINDINGS_PAGE}: kvspec/integrations/expected/vllm-{connector}.txt explains {case_id} with #{anchor}, "
                    f"which is no section of the page"
                )
    documented = set(re.findall(r"<!--\s*kvspec:vllm-audit:class:([\w-]+)\s*-->", markdown))
    found = {c["class"] for c in audit["classes"]}
    if documented != found:
        raise PluginError(
            f"{VLLM_FINDINGS_PAGE}: deviation classes differ from {VLLM_AUDIT_JSON.name}: "
            f"undocumented {sorted(found - documented)}, no longer found {sorted(documented - found)}"
        )


SGLANG_AUDIT_JSON = ROOT / "docs" / "explanation" / "sglang-audit.json"
SGLANG_FINDINGS_PAGE = "explanation/sglang-findings.md"


def sglang_audit_snippets(audit: Mapping[str, Any]) -> dict[str, str]:
    """Tables for the SGLang findings page from the committed ``kvspec sglang-audit --json`` output.

    ``sglang-audit:summary`` is the per-backend table; ``sglang-audit:class:NAME``
    is one deviation class: counts per backend and the smallest reproducer.
    """
    requests, pairs, closed = audit["requests"], audit["pairs"], audit["failed_closed"]
    summary = [
        "| Backend | Requests | Pairs posted | Refused by SGLang (probe) | Deviation classes (requests) |",
        "|---|---:|---:|---:|---|",
    ]
    by_class: dict[str, list[Mapping[str, Any]]] = {}
    for item in audit["classes"]:
        by_class.setdefault(item["class"], []).append(item)
    for backend, count in requests.items():
        mine = [c for c in audit["classes"] if c["backend"] == backend]
        listed = ", ".join(f"[{c['class']}](#{c['class']}) ({c['requests']})" for c in mine) or "none"
        summary.append(f"| `{backend}` | {count:,} | {pairs[backend]:,} | {closed[backend]:,} | {listed} |")
    snippets = {"sglang-audit:summary": "\n".join(summary) + "\n"}
    for name, items in by_class.items():
        probe = " (a probe: the audit made the lists unequal)" if items[0]["probe"] else ""
        out = [
            f"Rule **{items[0]['rule']}**{probe}. Found at seed {audit['seed']} in SGLang {audit['sglang_version']}:",
            "",
            "| Backend | Requests | Findings | Smallest reproducer |",
            "|---|---:|---:|---|",
        ]
        for item in items:
            r = item["reproducer"]
            where = f"pool {r['group']}: {r['detail']}" + (f"; pair `{r['pair']}`" if r.get("pair") else "")
            case = (
                f"B={r['page_size']}, W={r['window']}, N={r['num_tokens']}, H={r['prefix_tokens']}; {where}"
            ).replace("|", "\\|")
            out.append(f"| `{item['backend']}` | {item['requests']} | {item['findings']} | {case} |")
        first = items[0]["reproducer"]
        out += [
            "",
            f"Pages of the first reproducer (`{items[0]['backend']}`), as paired, long ones shortened:",
            "",
            "```text",
            f"producer {first['producer_list']}",
            f"consumer {first['consumer_list']}",
            "```",
        ]
        snippets[f"sglang-audit:class:{name}"] = "\n".join(out) + "\n"
    return snippets


def sglang_expected_failures() -> dict[str, dict[str, str]]:
    """Backend name -> {case id: reason}, from the committed ``sglang-*.txt`` lists."""
    from kvspec_conformance._runner import parse_expected_failures

    return {
        path.stem.removeprefix("sglang-"): parse_expected_failures(path.read_text(encoding="utf-8").splitlines())
        for path in sorted(VLLM_EXPECTED.glob("sglang-*.txt"))
        if path.stem != "sglang-audit"
    }


def sglang_expected_table(expected: Mapping[str, Mapping[str, str]]) -> str:
    """One table of every failing case per SGLang backend, with its reason and a link to its section."""
    out = ["| Connector | Failing case | Reason |", "|---|---|---|"]
    for backend, cases in expected.items():
        for case_id, reason in cases.items():
            text, _, anchor = reason.rpartition(" (#")
            link = f"[{text}](#{anchor.rstrip(')')})" if anchor else reason
            out.append(f"| `sglang:{backend}` | `{case_id}` | {link} |")
    return "\n".join(out) + "\n"


def check_sglang_findings_page(markdown: str, audit: Mapping[str, Any]) -> None:
    """Every SGLang audit class and expected failure has its section on the page, and nothing stale stays."""
    headings = {slugify(m.group(1).strip(), "-") for m in re.finditer(r"^#{2,4}\s+(.+)$", markdown, re.MULTILINE)}
    for backend, cases in sglang_expected_failures().items():
        for case_id, reason in cases.items():
            anchor = reason.rpartition(" (#")[2].rstrip(")")
            if anchor not in headings:
                raise PluginError(
                    f"{SGLANG_FINDINGS_PAGE}: kvspec/integrations/expected/sglang-{backend}.txt explains {case_id} "
                    f"with #{anchor}, which is no section of the page"
                )
    documented = set(re.findall(r"<!--\s*kvspec:sglang-audit:class:([\w-]+)\s*-->", markdown))
    found = {c["class"] for c in audit["classes"]}
    if documented != found:
        raise PluginError(
            f"{SGLANG_FINDINGS_PAGE}: deviation classes differ from {SGLANG_AUDIT_JSON.name}: "
            f"undocumented {sorted(found - documented)}, no longer found {sorted(documented - found)}"
        )


def _bytes_table(rows: Sequence[tuple[str, int, int, int]]) -> str:
    out = ["| Model | Tokens | Unclipped | Clipped | Saved |", "|---|---:|---:|---:|---:|"]
    for model, tokens, unclipped, clipped in rows:
        saved = 1 - clipped / unclipped if unclipped else 0.0
        out.append(
            f"| {model} | {tokens:,} | {unclipped / 2**20:,.0f} MiB | {clipped / 2**20:,.0f} MiB | {saved:.0%} |"
        )
    return "\n".join(out) + "\n"


ENGINE_BENCH = Path(__file__).resolve().parent / "_data" / "engine_bench.json"


def load_engine_bench() -> dict[str, Any]:
    """The rows benchmarks/bench_engine.py wrote (committed, so the docs build never runs the benchmark)."""
    import json

    data: dict[str, Any] = json.loads(ENGINE_BENCH.read_text(encoding="utf-8"))
    return data


def _engine_bench_table(data: Mapping[str, Any]) -> str:
    with_vllm = all("vllm_clip_pair_us" in r for r in data["rows"])
    head = "| Model | Tokens | Ids | Kept | Pairs | Copies | Clip + coverage + pairs | per id | Plan | per page |"
    rule = "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
    if with_vllm:
        head += " vLLM clip + pairs | kvspec / vLLM | vLLM desc ids | plan + descriptors / vLLM |"
        rule += "---:|---:|---:|---:|"
    out = [head, rule]
    for r in data["rows"]:
        line = (
            f"| {r['model']} | {r['tokens'] // 1024}k {r['allocation']} | {r['ids_in']:,} | {r['ids_kept']:,} "
            f"| {r['pairs']:,} | {r['descriptors']:,} | {r['reference_us']:,.0f} us "
            f"| {r['reference_us'] * 1e3 / r['ids_in']:.0f} ns | {r['plan_ms']:.2f} ms "
            f"| {r['plan_ms'] * 1e6 / max(r['pages'], 1):.0f} ns |"
        )
        if with_vllm:
            plan = r["plan_ms"] + r["descriptors_ms"]
            line += (
                f" {r['vllm_clip_pair_us']:,.0f} us | {r['reference_us'] / r['vllm_clip_pair_us']:.0f}x "
                f"| {r['vllm_desc_ids_ms']:.2f} ms | {plan / r['vllm_desc_ids_ms']:.1f}x |"
            )
        out.append(line)
    env = (
        f"Python {data['python']} on {data['machine']}, kvspec {data['kvspec']}, vLLM {data['vllm'] or 'not installed'}"
    )
    out += ["", f"*{env}; {data.get('note', '')}*"]
    return "\n".join(out) + "\n"


def _engine_bench_goals(data: Mapping[str, Any]) -> str:
    """Issue 19's goals against the committed run: 128k-token Gemma 3 27B."""
    goals = data["goals"]
    rows = {r["allocation"]: r for r in data["rows"] if r["model"] == "gemma-3-27b" and r["tokens"] == 128 * 1024}
    if set(rows) != {"contiguous", "shuffled"}:
        raise PluginError(f"{ENGINE_BENCH}: no 128k-token gemma-3-27b rows; rerun benchmarks/bench_engine.py --json")

    def verdict(value: float, goal: float) -> str:
        return f"{'met' if value < goal else 'missed'}, {value / goal:.0%} of the goal"

    shuffled, contiguous = rows["shuffled"], rows["contiguous"]
    lines = [
        f"- clip both sides + coverage + pairs, shuffled ids: **{shuffled['reference_us']:,.0f} us** against "
        f"{goals['reference_us']:,.0f} us ({verdict(shuffled['reference_us'], goals['reference_us'])}; "
        "about 19 ms before);",
        f"- `plan_transfer`, all layers, shuffled ids: **{shuffled['plan_ms']:.1f} ms** against "
        f"{goals['plan_ms_shuffled']:g} ms ({verdict(shuffled['plan_ms'], goals['plan_ms_shuffled'])}; "
        f"the page-by-page planner took {shuffled['plan_page_by_page_ms']:,.0f} ms in the same run);",
        f"- `plan_transfer`, all layers, contiguous ids: **{contiguous['plan_ms']:.2f} ms** against "
        f"{goals['plan_ms_contiguous']:g} ms ({verdict(contiguous['plan_ms'], goals['plan_ms_contiguous'])}; "
        f"page by page: {contiguous['plan_page_by_page_ms']:,.0f} ms).",
    ]
    return "\n".join(lines) + "\n"


def _clipping_lists(example: Mapping[str, Any]) -> str:
    pairs = example["pairs"]
    rows = [
        ("`get_blocks_per_sw(config)`", [example["budgets"][0]], [example["budgets"][1]]),
        ("P's block table", example["table"][0], example["table"][1]),
        ("P advertises (clipped)", example["advertised"][0], example["advertised"][1]),
        ("C offers (uncached suffix, clipped)", example["offered"][0], example["offered"][1]),
        ("pairs: producer ids", pairs.producer_block_ids[0], pairs.producer_block_ids[1]),
        ("pairs: consumer ids", pairs.consumer_block_ids[0], pairs.consumer_block_ids[1]),
    ]
    out = ["| | full attention (group 0) | sliding window W=32 (group 1) |", "|---|---|---|"]
    out += [f"| {label} | `{list(first)}` | `{list(second)}` |" for label, first, second in rows]
    return "\n".join(out) + "\n"


API_PAGE = "reference/api.md"
# The order of the API page's sections: the layers, from pure data up (docs/explanation/layers.md).
API_ORDER = {
    "kvspec.core._enums": "Enums",
    "kvspec.core._models": "Models",
    "kvspec.reference._reference": "Reference functions",
    "kvspec.protocol._plan": "Planner",
    "kvspec.spec.offload": "Offload rules",
    "kvspec.reference._offload": "Offload hit, fast",
    "kvspec.reference._messages": "Messages",
    "kvspec.protocol._codec": "Codec",
    "kvspec.protocol._handshake": "Handshake",
    "kvspec.spec.lifecycle": "Lifecycle",
    "kvspec.protocol._session": "Sessions",
    "kvspec.core._errors": "Errors",
}


def render_api_page() -> str:
    """``kvspec``'s exports, one section per private module that defines them, in layer order."""
    import importlib

    import kvspec

    sections: dict[str, list[str]] = {}
    for name in kvspec.__all__:
        if name.startswith("__"):
            continue
        obj = getattr(kvspec, name)
        origin = getattr(obj, "__module__", None) if isinstance(obj, type) or callable(obj) else None
        sections.setdefault(origin if isinstance(origin, str) and origin.startswith("kvspec") else "", []).append(name)
    order = {module: index for index, module in enumerate(API_ORDER)}
    out = [
        "# `kvspec`",
        "",
        "Everything below is imported from the top-level package (`import kvspec`); the private",
        "modules named in each section are where it is defined, not how to import it. Generated",
        "from `kvspec.__all__` and the docstrings.",
        "",
    ]
    for module in sorted(sections, key=lambda m: (m == "", order.get(m, len(order)), m)):
        if module:
            summary = (importlib.import_module(module).__doc__ or module).strip().splitlines()[0]
            title = API_ORDER.get(module, module)
            out += [f"## {title}", "", f"{summary} Defined in `{module}`.", ""]
        else:
            out += ["## Constants and type aliases", ""]
        for name in sections[module]:
            out += [f"::: kvspec.{name}", "    options:", "      heading_level: 3", ""]
    return "\n".join(out) + "\n"


CLI_PAGE = "reference/cli.md"
CLI_EXAMPLE = ["plan", "gemma-3-27b", "--tokens", "32768", "--prefix-hit", "4096"]


def render_cli_page() -> str:
    """Every command's ``--help``, and one real ``kvspec plan`` run, captured at build time."""
    import argparse
    import io

    from kvspec_conformance import cli as suite_cli

    from kvspec import cli

    parser = cli.build_parser()
    conform = argparse.ArgumentParser(prog="kvspec conform", description=suite_cli.__doc__)
    suite_cli.add_arguments(conform)
    commands = [("kvspec", parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            commands += [(f"kvspec {name}", sub) for name, sub in action.choices.items() if name != "conform"]
    for name, sub in list(commands[1:]):  # one level deeper: `kvspec vectors write`, ...
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                commands += [(f"{name} {child}", grandchild) for child, grandchild in action.choices.items()]
    commands.append(("kvspec conform", conform))
    out = [
        "# Command line",
        "",
        "`kvspec` is installed with the package (also `python -m kvspec`). The help texts below are",
        "captured from the installed code when these pages are built.",
        "",
    ]
    for name, sub in commands:
        out += [f"## `{name}`", "", _fence("text", sub.format_help())]
    captured = io.StringIO()
    status = cli.main(CLI_EXAMPLE, out=captured)
    if status != 0:
        raise PluginError(f"{CLI_PAGE}: `kvspec {' '.join(CLI_EXAMPLE)}` exited with {status}")
    out += [
        "## Example",
        "",
        "What one 32k-token request of Gemma 3 27B moves, when the consumer already holds 4096 tokens:",
        "",
        _fence("console", f"$ kvspec {' '.join(CLI_EXAMPLE)}\n{captured.getvalue()}"),
    ]
    return "\n".join(out) + "\n"


VECTORS_ARCHIVE = "vectors/kvspec-vectors.tar.gz"


def render_vector_functions() -> str:
    """The vector registry as a table: each function, the rules whose vectors call it, its input fields."""
    from kvspec.tools._vector_cases import CASE_SETS
    from kvspec.tools._vectors import FUNCTIONS

    rules: dict[str, list[str]] = {}
    for case_set in CASE_SETS:
        rules.setdefault(case_set.function, []).append(case_set.rule)
    out = ["| function | rules | input fields |", "|---|---|---|"]
    for name, entry in FUNCTIONS.items():
        fields = ", ".join(f"`{field}`" for field in entry.inputs)
        out.append(f"| `{name}` | {', '.join(rules.get(name, []))} | {fields} |")
    return "\n".join(out) + "\n"


OLD_DECISIONS_LINK = re.compile(r"\]\(spec/decisions\.md(?:#(?P<anchor>[\w-]+))?\)")


def moved_decisions_links(markdown: str, explanation: Path) -> str:
    """Point links at the decisions log's old place (spec/decisions.md#SECTION) to the topic page holding SECTION.

    The changelog keeps its history as written; the log itself moved to explanation/decisions-*.md.
    """
    home: dict[str, tuple[str, int]] = {}
    for path in sorted(explanation.glob("decisions-*.md")):
        text = path.read_text(encoding="utf-8")
        for section in re.split(r"(?m)^## ", text)[1:]:
            title, _, body = section.partition("\n")
            entries = body.count("### Decision ")
            slug = slugify(title.strip(), "-")
            if entries > home.get(slug, ("", -1))[1]:
                home[slug] = (f"explanation/{path.name}", entries)

    def relink(match: re.Match[str]) -> str:
        anchor = match["anchor"]
        if anchor and anchor in home:
            return f"]({home[anchor][0]}#{anchor})"
        return "](explanation/decisions.md)"

    return OLD_DECISIONS_LINK.sub(relink, markdown)


def on_files(files: Files, config: Any) -> Files:
    spec_pages = {
        f.src_uri: Path(f.abs_src_path).read_text(encoding="utf-8")
        for f in files
        if f.src_uri.startswith("spec/") and f.src_uri.endswith(".md") and f.abs_src_path
    }
    # A rule without a case, or a case citing an unknown rule, stops the build here.
    rules, cases = load_catalogue()
    by_rule = check_catalogue(rules, cases)
    check_spec_headings(spec_pages, by_rule)
    # A definition of kvspec/spec on no page, on two, or under another rule's heading stops the build here.
    _import_generators()
    import spec_pages as literate

    # So does a rule of the registry with no definition of kvspec/spec rendered under its heading.
    definitions = literate.find_definitions(SPEC_PACKAGE)
    if problems := literate.check_spec_pages(spec_pages, definitions, [rule.id for rule in rules]):
        raise CatalogueError("spec pages and kvspec/spec part ways:\n" + "\n".join(problems))
    _STATE["by_rule"] = by_rule
    _add(files, config, CATALOGUE, render_catalogue(rules, by_rule, find_rule_sections(spec_pages)))

    _add(files, config, API_PAGE, render_api_page())
    _add(files, config, CLI_PAGE, render_cli_page())
    diagrams, errors, figures = _import_generators()
    _add(files, config, DIAGRAMS, render_diagrams_page(diagrams))
    rows = figures.bytes_rows()
    _add(files, config, "img/clipping.svg", figures.clipping_svg())
    _add(files, config, "img/bytes.svg", figures.bytes_svg(rows))
    engine_bench = load_engine_bench()
    _add(files, config, "img/engine_bench.svg", figures.engine_bench_svg(engine_bench))
    import offload_figure  # docs/_gen is on sys.path once the generators are imported

    _add(files, config, "img/offload.svg", offload_figure.offload_svg())

    snippets: dict[str, str] = {
        "bytes-table": _bytes_table(rows),
        "clipping-lists": _clipping_lists(figures.clipping_example()),
        "engine-bench-table": _engine_bench_table(engine_bench),
        "engine-bench-goals": _engine_bench_goals(engine_bench),
    }
    for role in ("producer", "consumer"):
        snippets[f"state-diagram:{role}"] = _fence("mermaid", diagrams.state_diagram(role))
        for mode in (READ_MODE, WRITE_MODE):
            snippets[f"state-diagram:{role}:{mode.value}"] = _fence("mermaid", diagrams.state_diagram(role, mode))
        snippets[f"state-table:{role}"] = diagrams.transition_table(role)
    for name in diagrams.SEQUENCES:
        snippets[f"sequence:{name}"] = _fence("mermaid", diagrams.sequence_diagram(name))
    snippets.update(_raised_by_snippets(errors))
    snippets.update(spec_source_snippets())
    snippets.update(pins_snippets())
    _STATE["vllm_audit"] = json.loads(VLLM_AUDIT_JSON.read_text(encoding="utf-8"))
    snippets.update(vllm_audit_snippets(_STATE["vllm_audit"]))
    snippets["vllm-expected:tables"] = vllm_expected_table(vllm_expected_failures())
    _STATE["sglang_audit"] = json.loads(SGLANG_AUDIT_JSON.read_text(encoding="utf-8"))
    snippets.update(sglang_audit_snippets(_STATE["sglang_audit"]))
    snippets["sglang-expected:tables"] = sglang_expected_table(sglang_expected_failures())
    snippets["vector-functions"] = render_vector_functions()
    _STATE["snippets"] = snippets

    # The release's test vectors, downloadable from the site (docs/how-to/implement-in-another-language.md).
    from kvspec.tools._vector_cases import build_archive

    _add(files, config, VECTORS_ARCHIVE, build_archive())

    # CHANGELOG.md links into docs/ so that it reads right on a forge; on the site those links are relative.
    changelog = (ROOT / "CHANGELOG.md").read_text(encoding="utf-8").replace("](docs/", "](")
    changelog = moved_decisions_links(changelog, ROOT / "docs" / "explanation")
    _add(files, config, "changelog.md", changelog)
    return files


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    src = page.file.src_uri
    snippets: Mapping[str, str] = _STATE["snippets"]

    def replace(match: re.Match[str]) -> str:
        name = match["name"]
        if name not in snippets:
            raise PluginError(f"{src}: unknown generated snippet <!-- kvspec:{name} -->; known: {sorted(snippets)}")
        return snippets[name]

    if src == ERRORS_PAGE:
        check_errors_page(markdown)
    if src == VLLM_FINDINGS_PAGE:
        check_vllm_findings_page(markdown, _STATE["vllm_audit"])
    if src == SGLANG_FINDINGS_PAGE:
        check_sglang_findings_page(markdown, _STATE["sglang_audit"])
    markdown = MARKER.sub(replace, markdown)
    if src.startswith("spec/") and src != CATALOGUE:
        markdown = link_rule_sections(markdown, src, _STATE["by_rule"])
    return markdown
