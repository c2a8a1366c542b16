"""The documentation points at what is there: every relative link of README.md and the pages
under docs/ and benchmarks/ resolves (a file, and a heading for `#anchor`), every section of
docs/algorithms.md the code cites by name exists, and every module, file or module attribute
named in backticks — in those pages and in the code's docstrings — exists. A module moved or
renamed without its mentions fails here. What a page promises a command of its own does is
checked by loading the configuration exactly as that command does."""

from __future__ import annotations

import ast
import re
import shlex
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from streamrl.config.run import RunConfig

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("benchmarks/*.md")])
PACKAGES = ("streamrl", "storage", "flows", "tests", "benchmarks", "scripts")
ALGORITHMS = ROOT / "docs" / "algorithms.md"

# Dotted names that look like modules and are not: the `storage` section's config paths,
# Prefect event and resource names, record format tags and the progress lines' logger.
NOT_MODULES = re.compile(
    r"storage\.(run_uri|endpoint_url|storage_options|compression|sweep_grace_s|stream_retention)"
    r"|streamrl\.(health|run)(\..*)?$|streamrl\.weights\.(v\d|part)|streamrl\.current-config"
    r"|streamrl\.progress$"
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


def _command_config(command: str) -> RunConfig:
    """The configuration `command` (a `streamrl ...` line of a page) runs with, loaded as the
    command line loads it: the CLI's own parser, then `config_from`."""
    from streamrl.cli.config import config_from
    from streamrl.cli.main import build_parser

    return config_from(build_parser().parse_args(shlex.split(command)[1:]))


def test_the_supervised_commands_of_the_pages_train_as_docs_sft_says() -> None:
    """docs/sft.md states the preset `sft`'s learning rate, warm-up and batch: every supervised
    `streamrl run` a page shows must give them (presets apply in order, so a size preset after
    `sft` would replace them with its RL ones)."""
    text = " ".join((ROOT / "docs" / "sft.md").read_text().split())
    stated = re.search(
        r"The preset `sft`: learning rate (?P<lr>\S+) with (?P<warmup>\d+) warm-up updates .*? "
        r"(?P<batch>\d+) conversations a step in one update",
        text,
    )
    assert stated, "docs/sft.md no longer states the preset's learning rate and batch"
    commands = [
        line.strip()
        for page in PAGES
        for line in page.read_text().splitlines()
        if line.strip().startswith("streamrl run ") and "--preset sft" in line
    ]
    assert len(commands) >= 2, "the supervised commands of README.md and docs/sft.md are gone"
    for command in commands:
        learner = _command_config(command).learner
        got = (learner.lr, learner.warmup_steps, learner.batch_groups, learner.mini_batch_groups)
        batch = int(stated["batch"])
        assert got == (float(stated["lr"]), int(stated["warmup"]), batch, batch), command


def test_deploy_readme_quotes_what_prefect_says_of_a_killed_container() -> None:
    """deploy/README.md tells a killed container from an out-of-memory one by Prefect's words
    for exit status 137: they must be the installed Prefect's."""
    from prefect.utilities._infrastructure_exit_codes import get_infrastructure_exit_info

    said = f"status code 137. {get_infrastructure_exit_info(137).explanation}"
    page = " ".join((ROOT / "deploy" / "README.md").read_text().split())
    assert said in page
    assert "docker inspect -f '{{.State.OOMKilled}}" in page


def test_pages_naming_the_learners_metrics_file_name_its_object_store_layout_too() -> None:
    """Object stores cannot append: there the learner writes one object a step,
    `learner-<step>.json` (`streamrl.learner.reporting`), and a page that sends a reader to
    `learner.jsonl` alone sends an S3 run's reader nowhere. (The benchmarks' pages name the
    files of the local runs they measured.)"""
    from streamrl.learner.metrics_records import JSONL

    missing = []
    for page in [p for p in PAGES if p.parent.name != "benchmarks"]:
        text = " ".join(page.read_text().split())
        for mention in re.finditer(re.escape(f"<run>/metrics/{JSONL}"), text):
            after = text[mention.end() : mention.end() + 120]
            if not re.search(r"object store|S3", after):
                missing.append(f"{page.relative_to(ROOT)}: {text[mention.start() :][:80]}")
    assert missing == []
