"""The commands of README.md and docs/*.md work as typed after `make setup`, checked in a fresh
shell like a user's (scripts/readme_commands.py), and the checker itself catches a broken
command and says in which file and on which line it is."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "readme_commands.py"


def _checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("readme_commands", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _as_a_user(*args: str) -> subprocess.CompletedProcess[str]:
    """`python scripts/readme_commands.py ARGS` typed into a fresh shell after activating."""
    command = "source .venv/bin/activate && python scripts/readme_commands.py " + " ".join(args)
    return subprocess.run(
        ["env", "-i", f"HOME={Path.home()}", "PATH=/usr/bin:/bin", "TERM=dumb",
         "bash", "--noprofile", "--norc", "-c", command],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def _verdicts(output: str) -> dict[str, str]:
    """Each reported command, as typed -> its report (with the problem's line, when WRONG)."""
    lines = output.splitlines()
    verdicts = {}
    for line, following in zip(lines, [*lines[1:], ""], strict=True):
        if reported := re.match(r"(ok|WRONG) +\S+:\d+ +(.*?)(  \[.*\])?$", line):
            verdicts[reported[2]] = f"{line}\n{following}"
    return verdicts


def test_readme_commands_check_out_in_a_fresh_shell() -> None:
    done = _as_a_user()
    assert done.returncode == 0, done.stdout + done.stderr
    assert " 0 wrong" in done.stdout
    located = set(re.findall(r"^ok +(\S+):\d+ ", done.stdout, re.MULTILINE))
    checker = _checker()
    pages = [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
    with_commands = {c.document for page in pages for c in checker.extract_all([page])}
    assert "docs/configuration.md" in with_commands
    assert located == with_commands  # README and every docs page with commands are read


@pytest.mark.slow  # ~45 s on 2 cores: every `streamrl config`/`models` command, and --help runs
def test_readme_commands_run_in_a_fresh_shell() -> None:
    done = _as_a_user("--run")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "streamrl config presets  [ran as typed]" in done.stdout
    validate = "streamrl config validate --config run.yaml learner.total_steps=500"
    assert f"{validate}  [ran as typed]" in done.stdout  # on the run.yaml written just before
    assert not (ROOT / "run.yaml").exists()  # the docs' run.yaml is written in a scratch folder


def test_extractor_finds_the_commands_users_rely_on() -> None:
    checker = _checker()
    commands = checker.extract_all(checker.documents())
    where: dict[str, set[str]] = {}
    demo_run = "--preset dapo --preset smollm2-cpu storage.run_uri=./runs/mine"
    for command in commands:
        where.setdefault(command.text, set()).add(command.document)
    for expected, document in (
        ("make demo", "README.md"),  # the front door: the quickstart stays in README
        ("make test", "README.md"),
        ("make setup", "README.md"),
        ("source .venv/bin/activate", "README.md"),
        ("streamrl status ./runs/mine", "README.md"),
        (f"streamrl run {demo_run}", "README.md"),
        ("prefect deployment run streamrl/dapo --watch", "docs/running.md"),
        ("streamrl status ./runs/mine --plot curves.png", "docs/running.md"),
        ("streamrl generator --run ./runs/mine --index 3", "docs/pools.md"),
        ("make up S3=1", "docs/storage.md"),
        ("streamrl config presets", "docs/configuration.md"),
        ("streamrl models prepare", "docs/generators.md"),
        ("make demo ENV=calculator", "docs/agents.md"),
        ("make demo LORA=1", "docs/lora.md"),
        ("streamrl export ./runs/mine --version 12 --out ./exported", "docs/evaluation.md"),
    ):
        assert document in where.get(expected, set()), f"{expected!r} not in {document}: {where}"
    resumed = next(c for c in commands if c.argv[:3] == ["streamrl", "run", "--resume"])
    assert resumed.argv[-1] == "learner.total_steps=40"  # its `\` continuation joined
    assert "#" not in resumed.text
    assert resumed.document == "docs/resuming.md"
    scale = next(c for c in commands if c.argv[:2] == ["streamrl", "scale"])
    assert scale.placeholder  # ./runs/dapo-<time>: checked, never run


def test_each_command_is_located_by_its_file_and_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    readme, page = tmp_path / "README.md", tmp_path / "docs" / "pools.md"
    page.parent.mkdir()
    readme.write_text("Intro.\n\n```bash\nmake test\n```\n")
    page.write_text("# Pools\n\n```bash\nstreamrl status ./runs/mine\nmake nowhere\n```\n")

    assert _checker().main(["--doc", str(readme), "--doc", str(page)]) == 1
    verdicts = _verdicts(capsys.readouterr().out)
    assert verdicts["make test"].startswith(f"ok     {readme}:4 ")
    assert verdicts["streamrl status ./runs/mine"].startswith(f"ok     {page}:4 ")
    assert verdicts["make nowhere"].startswith(f"WRONG  {page}:5 ")


def test_extractor_reads_shell_words_as_bash_does() -> None:
    readme = (
        "Inline `streamrl nope` is prose.\n\n"
        "```bash\n"
        "prefect deployment run streamrl/dapo -p 'overrides=[\"a=1 # b\"]'  # it's a comment\n"
        "AWS_PROFILE=x streamrl config show \\\n"
        "    --preset dapo > run.yaml\n"
        "```\n\n"
        "```\n$ streamrl output-block\n```\n"
    )
    first, second = _checker().extract(readme)
    assert first.argv[-2:] == ["-p", 'overrides=["a=1 # b"]']
    assert first.text.endswith("'overrides=[\"a=1 # b\"]'")
    assert (second.line, second.argv) == (5, ["streamrl", "config", "show", "--preset", "dapo"])


def test_broken_commands_are_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    readme = tmp_path / "README.md"
    broken = {
        "streamrl frobnicate ./runs/mine": "invalid choice: 'frobnicate'",
        "streamrl status": "the following arguments are required: RUN_URI",
        "prefect deployment run streamrl/dapo -p made_up=1": "has no parameter made_up",
        "prefect deployment run generator/default": "needs -p run_uri=...",
        "prefect deployment run streamrl/nope": "no deployment 'streamrl/nope'",
        "make nowhere": "the Makefile has no target nowhere",
        "python -m streamrl.nowhere": "no module streamrl.nowhere",
        "no-such-program --flag": "command not found",
    }
    fine = ["streamrl status ./runs/mine", "prefect deployment run streamrl/grpo -p resume=true"]
    readme.write_text("```bash\n" + "\n".join([*fine, *broken]) + "\n```\n")

    assert _checker().main(["--readme", str(readme)]) == 1
    verdicts = _verdicts(capsys.readouterr().out)
    for command in fine:
        assert verdicts[command].startswith("ok "), verdicts[command]
    for command, problem in broken.items():
        assert verdicts[command].startswith("WRONG ")
        assert problem in verdicts[command]


def test_run_reports_a_command_that_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("```bash\nstreamrl config validate --config missing.yaml\n```\n")
    assert _checker().main(["--readme", str(readme), "--run"]) == 1
    failed = _verdicts(capsys.readouterr().out)["streamrl config validate --config missing.yaml"]
    assert failed.startswith("WRONG ")
    assert "missing.yaml does not exist" in failed
