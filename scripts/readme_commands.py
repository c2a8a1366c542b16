"""Check that every command in README.md and docs/*.md works as typed after `make setup`.

Every line of the ```bash blocks of README.md and of every docs/*.md page (`\\` continuations
joined, trailing `# comments` dropped) is checked in a fresh shell -- an empty environment, no
profile, only `source .venv/bin/activate` -- from the repository root, as a user would type it:

- its program resolves on PATH (`command -v`);
- `streamrl ...`: the arguments parse with streamrl's own parser (`build_parser` of `streamrl.cli`);
- `prefect deployment run FLOW/NAME -p key=value ...`: FLOW/NAME is a deployment of
  deploy/prefect.yaml, every `-p` names a parameter of its flow function (read from the
  entrypoint's source) and every parameter without a default is given;
- `make TARGET`: the Makefile has the target;
- `python SCRIPT`, `python -m MODULE`: the script or module exists.

A command with a placeholder (`<id>`, `<time>`) is checked with the placeholder as a plain word
and never run. With `--run`, the commands of RUN_AS_TYPED also run as typed, each in its own
fresh shell, in document order (README.md, then docs/*.md by name), in one scratch directory
(files they write, such as `run.yaml`, stay out of the checkout); of the other commands of
HELP_ONLY's programs only `--help` runs (they need a server, a run or minutes of training), and
the rest (`make`, `python`) never run.
One line per command, located as FILE:LINE; exit status 1 if any is wrong.

    python scripts/readme_commands.py          # quick check (seconds)
    python scripts/readme_commands.py --run    # and run the quick, server-free ones (a minute)
    python scripts/readme_commands.py --doc docs/pools.md   # only the files named
"""

from __future__ import annotations

import argparse
import ast
import itertools
import json
import re
import shlex
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
ACTIVATE = ROOT / ".venv" / "bin" / "activate"
PLACEHOLDER = re.compile(r"<([A-Za-z][\w.-]*)>")
# Run as typed under --run: quick, no server, no run directory needed.
RUN_AS_TYPED = (("streamrl", "config"), ("streamrl", "models"))
# Under --run, only `--help` of these runs; any other program (make, python) is never run.
HELP_ONLY = ("streamrl", "prefect", "vllm")
Deployments = dict[str, tuple[set[str], set[str]]]  # flow/name -> (parameters, required ones)

PARSE_STREAMRL = """
import contextlib, io, json, sys
from streamrl.cli.main import build_parser
problems = []
for argv in json.load(sys.stdin):
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            build_parser().parse_args(argv)
        problems.append(None)
    except SystemExit as exc:
        problems.append(err.getvalue().strip().splitlines()[-1] if exc.code else None)
print(json.dumps(problems))
"""

MODULE_EXISTS = """
import importlib.util, pathlib, sys
top, *rest = sys.argv[1].split(".")
spec = importlib.util.find_spec(top)  # the package's own files: its body is never imported
places = [pathlib.Path(p, *rest) for p in (spec.submodule_search_locations or [])] if spec else []
found = spec is not None and (not rest or any(
    p.with_suffix(".py").is_file() or (p / "__init__.py").is_file() for p in places))
sys.exit(0 if found else 1)
"""


@dataclass(frozen=True)
class Command:
    """One command line of a ```bash block, continuations joined, comment dropped."""

    line: int  # line of its document it starts on
    text: str  # as typed
    argv: list[str]  # words before any redirection or pipe, leading VAR=value dropped
    placeholder: bool  # holds <...>: checked with the placeholder as a word, never run
    document: str = "README.md"  # where it is written, as reported: README.md, docs/running.md


def _drop_comment(text: str) -> str:
    """`text` without a trailing `# comment` (a `#` after whitespace, outside quotes)."""
    quote = None
    for i, char in enumerate(text):
        if quote:
            quote = None if char == quote else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (i == 0 or text[i - 1].isspace()):
            return text[:i].rstrip()
    return text.rstrip()


def _argv(text: str) -> list[str]:
    lexer = shlex.shlex(PLACEHOLDER.sub(r"\1", text), posix=True, punctuation_chars=True)
    lexer.whitespace_split, lexer.commenters = True, ""
    words = list(lexer)
    words = words[: next((i for i, w in enumerate(words) if set(w) <= set("();<>|&")), None)]
    while words and re.match(r"[A-Za-z_]\w*=", words[0]):
        words.pop(0)
    return words


def extract(markdown: str, document: str = "README.md") -> list[Command]:
    """Every command of the ```bash blocks of `markdown` (the text of `document`), in order."""
    commands, in_block, pending, start = [], False, "", 0
    for number, line in enumerate(markdown.splitlines(), 1):
        if line.strip().startswith("```"):
            in_block = not in_block and line.strip() == "```bash"
            continue
        if not in_block:
            continue
        pending, start = (pending + " " + line.strip(), start) if pending else (line, number)
        if pending.endswith("\\"):
            pending = pending[:-1].rstrip()
            continue
        text, pending = _drop_comment(pending), ""
        if text:
            placeholder = bool(PLACEHOLDER.search(text))
            commands.append(Command(start, text, _argv(text), placeholder, document))
    return commands


def documents() -> list[Path]:
    """The pages whose commands are checked: README.md, then every docs/*.md by name."""
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def _name(path: Path) -> str:
    """`path` as reported: relative to the repository root when it lies inside it."""
    resolved = path.resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else str(path)


def extract_all(paths: list[Path]) -> list[Command]:
    """Every command of every file of `paths`, in that order."""
    return [c for path in paths for c in extract(path.read_text(), _name(path))]


def fresh_shell(
    command: str, cwd: Path = ROOT, stdin: str | None = None
) -> subprocess.CompletedProcess[str]:
    """`command` in a new login-less bash with an empty environment and the venv activated."""
    script = f"source {shlex.quote(str(ACTIVATE))} && {command}"
    return subprocess.run(
        ["env", "-i", f"HOME={Path.home()}", "PATH=/usr/bin:/bin", "TERM=dumb",
         "bash", "--noprofile", "--norc", "-c", script],
        cwd=cwd, input=stdin, capture_output=True, text=True, timeout=300,
    )  # fmt: skip


def _flow_of(path: str, function: str) -> tuple[str, set[str], set[str]]:
    """A flow function's name, parameters and parameters without a default, from its source."""
    tree = ast.parse((ROOT / path).read_text())
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == function)
    name = function.replace("_", "-")  # Prefect's default flow name
    for call in (d for d in node.decorator_list if isinstance(d, ast.Call)):
        name = next((ast.literal_eval(k.value) for k in call.keywords if k.arg == "name"), name)
    args = node.args
    positional = [a.arg for a in args.posonlyargs + args.args]
    required = set(positional[: len(positional) - len(args.defaults)])
    required |= {a.arg for a, d in zip(args.kwonlyargs, args.kw_defaults, strict=True) if not d}
    return name, {*positional, *(a.arg for a in args.kwonlyargs)}, required


def deployments() -> Deployments:
    """`flow/name` of deploy/prefect.yaml -> (its flow's parameters, those it must be given)."""
    import yaml

    found: Deployments = {}
    for entry in yaml.safe_load((ROOT / "deploy" / "prefect.yaml").read_text())["deployments"]:
        flow, params, required = _flow_of(*entry["entrypoint"].split(":"))
        found[f"{flow}/{entry['name']}"] = (params, required - set(entry.get("parameters") or {}))
    return found


def make_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+)\s*:(?!=)", (ROOT / "Makefile").read_text(), re.MULTILINE))


def _check_prefect(argv: list[str], known: Deployments) -> str | None:
    if argv[1:3] != ["deployment", "run"] or len(argv) < 4:
        return None  # other prefect commands: checked on PATH only
    name, options = argv[3], argv[4:]
    if name not in known:
        return f"no deployment {name!r} in deploy/prefect.yaml; choose one of: {', '.join(known)}"
    params, required = known[name]
    given = set()
    for flag, value in itertools.pairwise(options):
        if flag in ("-p", "--param"):
            given.add(value.split("=", 1)[0])
        elif flag == "--params":
            given |= set(json.loads(value))
    if unknown := given - params:
        takes = ", ".join(sorted(params))
        return f"{name} has no parameter {', '.join(sorted(unknown))}; its flow takes {takes}"
    if missing := required - given:
        return f"{name} needs " + " ".join(f"-p {m}=..." for m in sorted(missing))
    return None


def _check_args(argv: list[str], known: Deployments, targets: set[str]) -> str | None:
    program, args = argv[0], argv[1:]
    if program == "prefect":
        return _check_prefect(argv, known)
    if program == "make":
        missing = [a for a in args if not a.startswith("-") and "=" not in a and a not in targets]
        return f"the Makefile has no target {', '.join(missing)}" if missing else None
    if program == "python" and args[:1] == ["-m"]:
        found = fresh_shell(f"python -c {shlex.quote(MODULE_EXISTS)} {shlex.quote(args[1])}")
        return None if found.returncode == 0 else f"no module {args[1]} in .venv"
    if program == "python" and args and not (ROOT / args[0]).is_file():
        return f"no file {args[0]} in the repository"
    return None


def check(commands: list[Command]) -> list[str | None]:
    """What is wrong with each command (None: nothing), checked without running it."""
    problems: list[str | None] = [None] * len(commands)
    ours = [i for i, c in enumerate(commands) if c.argv[:1] == ["streamrl"]]
    if ours:
        parsed = fresh_shell(
            f"python -c {shlex.quote(PARSE_STREAMRL)}",
            stdin=json.dumps([commands[i].argv[1:] for i in ours]),
        )
        if parsed.returncode != 0:
            sys.exit(f"streamrl's parser did not run in .venv (run `make setup`):\n{parsed.stderr}")
        for i, problem in zip(ours, json.loads(parsed.stdout), strict=True):
            problems[i] = problem and f"{problem} (see `{shlex.join(_help_of(commands[i].argv))}`)"
    known, targets = deployments(), make_targets()
    for i, command in enumerate(commands):
        program = command.argv[0] if command.argv else ""
        if fresh_shell(f"command -v {shlex.quote(program)}").returncode != 0:
            problems[i] = (
                f"`{program}`: command not found after `source .venv/bin/activate`; "
                "install it with .venv (pyproject.toml) or say in the page where it comes from"
            )
        problems[i] = problems[i] or _check_args(command.argv, known, targets)
    return problems


def _help_of(argv: list[str]) -> list[str]:
    """The `--help` command of the (sub)command `argv` runs."""
    words = itertools.takewhile(lambda w: re.fullmatch(r"[a-z][a-z0-9-]*", w), argv[1:])
    return [argv[0], *words, "--help"]


def _outcome(command: str, cwd: Path) -> str | None:
    done = fresh_shell(command, cwd=cwd)
    last_line = (done.stderr.strip().splitlines() or [""])[-1]
    return f"`{command}` exited {done.returncode}: {last_line}" if done.returncode else None


def run(commands: list[Command], problems: list[str | None]) -> list[str]:
    """Run what RUN_AS_TYPED and HELP_ONLY allow, recording failures in `problems`; returns a
    note per command saying what ran."""
    notes: list[str] = []
    helped: dict[str, str | None] = {}
    with tempfile.TemporaryDirectory(prefix="readme-commands-") as scratch:
        for i, command in enumerate(commands):
            if problems[i] is not None:
                notes.append("")
            elif not command.placeholder and tuple(command.argv[:2]) in RUN_AS_TYPED:
                problems[i] = _outcome(command.text, Path(scratch))
                notes.append("ran as typed")
            elif command.argv[0] in HELP_ONLY:
                help_command = shlex.join(_help_of(command.argv))
                if help_command not in helped:
                    helped[help_command] = _outcome(help_command, Path(scratch))
                problems[i] = helped[help_command]
                notes.append(f"checked; ran `{help_command}`: needs a server, a run or minutes")
            else:
                notes.append("checked, not run: starts servers or a run")
    return notes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="store_true", help="also run the quick, server-free ones")
    parser.add_argument(
        "--doc", "--readme", dest="docs", type=Path, action="append", metavar="FILE",
        help="a Markdown file to read (repeatable; default: README.md and docs/*.md)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    paths = args.docs or documents()
    if missing := [str(p) for p in paths if not p.is_file()]:
        print(f"no such file: {', '.join(missing)}")
        return 1
    commands = extract_all(paths)
    if not commands:
        print(f"{', '.join(map(_name, paths))}: no commands in ```bash blocks")
        return 1
    problems = check(commands)
    notes = run(commands, problems) if args.run else ["checked"] * len(commands)
    width = max(len(f"{c.document}:{c.line}") for c in commands)
    for command, problem, note in zip(commands, problems, notes, strict=True):
        where = f"{command.document}:{command.line}"
        if problem is None:
            print(f"ok     {where:<{width}} {command.text}  [{note}]")
        else:
            print(f"WRONG  {where:<{width}} {command.text}\n       -> {problem}")
    wrong = sum(p is not None for p in problems)
    print(f"{len(commands)} commands, {wrong} wrong" + ("" if args.run else "; --run runs them"))
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
