"""The command `streamrl run` prints after a stop resumes the run from any folder: with the
`PYTHONPATH` the run was started under (a user package's folder), made absolute."""

from __future__ import annotations

import argparse
import os

from streamrl.cli.run import _resume_command


def _args(*argv: str) -> argparse.Namespace:
    return argparse.Namespace(argv=list(argv))


def test_the_resume_command_carries_the_pythonpath_made_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([".", "src", "/opt/lib"]))
    command = _resume_command(_args("run", "--preset", "grpo", "storage.run_uri=/r"))
    folders = os.pathsep.join([str(tmp_path), str(tmp_path / "src"), "/opt/lib"])
    assert command == f"PYTHONPATH={folders} streamrl run --resume --preset grpo storage.run_uri=/r"


def test_without_a_pythonpath_the_command_is_the_one_given_plus_resume(monkeypatch):
    monkeypatch.delenv("PYTHONPATH", raising=False)
    command = _resume_command(_args("run", "--resume", "--preset", "grpo"))
    assert command == "streamrl run --resume --preset grpo"
