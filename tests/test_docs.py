"""The documentation points at what is there: every relative link of README.md and the pages
under docs/ and benchmarks/ resolves (a file, and a heading for `#anchor`), every section of
docs/algorithms.md the code cites by name exists, and every module, file or module attribute
named in backticks — in those pages and in the code's docstrings — exists. A module moved or
renamed without its mentions fails here."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("benchmarks/*.md")])
PACKAGES = ("streamrl", "storage", "flows", "tests", "benchmarks", "scripts")
ALGORITHMS = ROOT / "docs" / "algorithms.md"

# Dotted names that look like modules and are not: the `storage` section's config paths,
# Prefect event and resource names, and record format tags.
NOT_MODULES = re.compile(
    r"storage\.(run_uri|endpoint_url|storage_options|compression|sweep_grace_s|stream_retention)"
    r"|streamrl\.(health|run)(\..*)?$|streamrl\.weights\.(v\d|part)|streamrl\.current-config"
)
DOTTED = re.compile(r"(?<![\w./-])((?:streamrl|storage|flows)(?:\.[A-Za-z_]\w*)+)")
SLASHED = re.compile(
    r"(?<![\w./-])((?:streamrl|storage|flows|tests|benchmarks|scripts|deploy|docs)/[\w./-]+"
    r"\.(?:py|md|yaml|jinja|sh))"
)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
CITED_SECTION = re.compile(r'docs/algorithms\.md,?\s+"([^"]+)"')


def _python_files() -> Iterator[Path]:
    for package in PACKAGES:
        yield from sorted((ROOT / package).rglob("*.py"))


@cache
def _modules() -> dict[str, Path]:
    found = {}
    for path in _python_files():
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


@cache
def _defined(module: str) -> frozenset[str]:
    """Every name a module binds anywhere (functions, classes, assignments, imports)."""
    names = set()
    for node in ast.walk(ast.parse(_modules()[module].read_text())):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            names.add(node.name)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.ImportFrom | ast.Import):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
    return frozenset(names)


def _resolves(dotted: str) -> bool:
    """A module, or an attribute a module defines (`streamrl.learner.loop.Learner.run`)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        if module in _modules():
            return cut == len(parts) or parts[cut] in _defined(module)
    return False


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _headings(page: Path) -> list[str]:
    return [line.lstrip("#").strip() for line in page.read_text().splitlines() if line[:1] == "#"]


def _anchors(page: Path) -> set[str]:
    return set(map(_slug, _headings(page))) if page.suffix == ".md" else set()


def _backticked(text: str) -> Iterator[str]:
    yield from re.findall(r"`([^`\n]+)`", text)


def _docstrings(path: Path) -> Iterator[str]:
    documented = ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, documented) and (text := ast.get_docstring(node, clean=False)):
            yield text


def _broken_names(text: str, where: Path) -> list[str]:
    broken = []
    for quoted in _backticked(text):
        for name in DOTTED.findall(quoted):
            if not NOT_MODULES.match(name) and not _resolves(name.rstrip(".")):
                broken.append(name)
        for path in SLASHED.findall(quoted):
            if not (ROOT / path).exists() and not (where.parent / path).exists():
                broken.append(path)
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_links_resolve(page: Path) -> None:
    broken = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.exists() or (anchor and anchor not in _anchors(linked)):
            broken.append(target)
    assert broken == []


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_names_in_pages_exist(page: Path) -> None:
    assert _broken_names(page.read_text(), page) == []


def test_names_in_docstrings_exist() -> None:
    broken = {
        f"{path.relative_to(ROOT)}: {name}"
        for path in _python_files()
        for text in _docstrings(path)
        for name in _broken_names(text, path)
    }
    assert sorted(broken) == []


def test_cited_sections_of_the_algorithms_exist() -> None:
    headings = [" ".join(h.split()) for h in _headings(ALGORITHMS)]
    cited = {
        " ".join(section.split())
        for path in [*_python_files(), *PAGES]
        for section in CITED_SECTION.findall(path.read_text())
    }
    assert cited, "no section of docs/algorithms.md is cited by name"
    assert sorted(s for s in cited if not any(h.startswith(s) for h in headings)) == []


def test_the_checks_catch_what_is_not_there(tmp_path: Path) -> None:
    assert _resolves("streamrl.learner.loop.Learner")
    assert not _resolves("streamrl.learner.loop.NoSuchThing")
    assert not _resolves("storage.stream_reader")  # the module before it moved
    assert _broken_names("`storage/stream/nowhere.py` and `streamrl.supervisor`", ROOT) == [
        "storage/stream/nowhere.py",
        "streamrl.supervisor",
    ]
    assert _slug("Off-policy correction: the full menu") == "off-policy-correction-the-full-menu"
