"""The documentation holds together: every link in README.md, docs/ and examples/ leads to a file and a
heading that exist; `--help` of every command names every subcommand; the README stays short; the
LICENSE matches pyproject; and neither the docs nor the code's comments speak of how the project was
made (issue numbers, design notes outside the repository, first-person narration)."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from opttree.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "examples" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
README_MAX_LINES = 250
HISTORY = [  # words about the project's own making, not about the software
    r"\b[Ii]ssue \d+", r"DESIGN\.md", "§", r"\bthis round\b", r"\bI ran\b", r"\bother engineers\b",
    r"\bthis session\b",
]


def without_code(text: str) -> str:
    """The text outside fenced code blocks (a `# comment` in a shell block is not a heading)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in re.findall(r"^#{1,6} (.+)$", without_code(page.read_text(encoding="utf-8")), flags=re.M):
        base = slug(heading)
        found.add(base if base not in seen else f"{base}-{seen[base]}")
        seen[base] = seen.get(base, 0) + 1
    return found


def links(page: Path) -> list[str]:
    return re.findall(r"\]\(([^)\s]+)\)", without_code(page.read_text(encoding="utf-8")))


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_leads_to_a_file_and_a_heading(page):
    broken = []
    for link in links(page):
        if re.match(r"[a-z]+:", link):  # https:, mailto:
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        if not target.exists():
            broken.append(f"{link}: no file {target}")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target):
            broken.append(f"{link}: no heading #{anchor} in {target.name}")
    assert not broken, "\n".join(broken)


def test_anchors_follow_githubs_rule():
    assert slug("Tree policies at equal budgets: OPT-Tree against static, Sequoia, EAGLE-2, DySpec, chains") == (
        "tree-policies-at-equal-budgets-opt-tree-against-static-sequoia-eagle-2-dyspec-chains")
    assert slug("CPU: torch.compile'd forwards (`--compile`)") == "cpu-torchcompiled-forwards---compile"


def subcommands(parser: argparse.ArgumentParser) -> argparse._SubParsersAction | None:
    return next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)


def test_help_names_every_subcommand():
    """`opttree --help` names every command in its description; a command with subcommands names each
    in the help line its parent shows, and every subcommand has a help line of its own."""
    parser = build_parser()
    commands = subcommands(parser)
    for name in commands.choices:
        assert re.search(rf"\b{re.escape(name)}\b", parser.description), f"`opttree --help` does not name {name}"
    helps = {action.dest: action.help for action in commands._choices_actions}
    assert set(helps) == set(commands.choices) and all(helps.values()), helps
    for name, command in commands.choices.items():
        nested = subcommands(command)
        if nested is None:
            continue
        shown = f"{helps[name]} {command.description or ''}"
        nested_helps = {action.dest: action.help for action in nested._choices_actions}
        assert set(nested_helps) == set(nested.choices) and all(nested_helps.values()), nested_helps
        for sub in nested.choices:
            assert re.search(rf"(?<![\w-]){re.escape(sub)}(?![\w-])", shown), f"`opttree --help` for {name} misses {sub}"


def test_the_readme_is_short():
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines < README_MAX_LINES, f"README.md has {lines} lines; move reference material to docs/"


def test_the_license_is_the_one_pyproject_names():
    text = (ROOT / "LICENSE").read_text(encoding="utf-8")
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
    assert re.search(r'^license = \{text = "Apache-2.0"\}', (ROOT / "pyproject.toml").read_text(), flags=re.M)


def test_no_word_about_how_the_project_was_made():
    files = PAGES + sorted((ROOT / "src").rglob("*.py")) + sorted((ROOT / "tests").rglob("*.py"))
    found = []
    for path in files:
        if path == Path(__file__).resolve():
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            found += [f"{path.relative_to(ROOT)}:{number}: {line.strip()}" for pattern in HISTORY
                      if re.search(pattern, line)]
    assert not found, "\n".join(found)


def test_the_codes_pointers_into_the_docs_name_pages_and_sections_that_exist():
    """A docstring or comment that sends the reader to `docs/PAGE.md, "Section"` names a page that exists and
    words that a heading of it holds (the pointers span lines: they are read with the lines joined)."""
    headings = {page.name: [h.lower() for h in re.findall(r"^#{1,6} (.+)$", without_code(page.read_text()), flags=re.M)]
                for page in (ROOT / "docs").glob("*.md")}
    broken, seen = [], 0
    for path in sorted((ROOT / "src").rglob("*.py")) + sorted((ROOT / "scripts").glob("*.py")):
        joined = re.sub(r"\s*\n\s*(#\s*)?", " ", path.read_text(encoding="utf-8"))
        for page in re.findall(r"docs/(\w+\.md)", joined):
            if page not in headings:
                broken.append(f"{path.relative_to(ROOT)}: docs/{page} does not exist")
        for page, section in re.findall(r'docs/(\w+\.md),?\s*"([^"]+)"', joined):
            seen += 1
            if page in headings and not any(section.lower() in heading for heading in headings[page]):
                broken.append(f'{path.relative_to(ROOT)}: no heading of docs/{page} holds "{section}"')
    assert seen > 10 and not broken, "\n".join(broken)
