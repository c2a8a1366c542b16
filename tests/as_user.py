"""Running a piece of the test suite's Python as a non-root user, as every non-root deployment
runs (process pools as a user, the Kubernetes templates' uid 1000): the box then makes a user
namespace of its own instead of dropping a root caller's privileges.

CI runs as root, so a test drops to `USER_UID` with `setpriv`. The interpreter, the virtualenv
and the checkout may lie under a folder that uid cannot enter (a root home folder): the code
then runs in a private mount namespace in which each such folder is a tmpfs that holds only
the read-only paths the interpreter needs, bound back in. Nothing of the host changes.
"""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

__all__ = ["USER_UID", "run_python_as_user", "users"]

USER_UID = 4242  # no user of the machine: a uid with no files and no groups
ROOT = Path(__file__).resolve().parents[1]


def users() -> list[str]:
    """Who a test should run as: root and a user when the suite runs as root, else itself."""
    return ["root", "user"] if os.geteuid() == 0 else ["user"]


def run_python_as_user(
    code: str, *, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """Run `code` with this interpreter as `USER_UID` (as this process when it is not root)."""
    python = [sys.executable, "-c", code]
    environment = {
        "PATH": os.defpath,
        "HOME": "/tmp",
        "PYTHONPATH": str(ROOT),
        "PYTHONDONTWRITEBYTECODE": "1",
        **(env or {}),
    }
    if os.geteuid() != 0:
        return subprocess.run(
            python, env=environment, capture_output=True, text=True, timeout=timeout
        )
    if shutil.which("setpriv") is None or shutil.which("unshare") is None:
        pytest.fail("running as a user needs setpriv and unshare (util-linux)")
    drop = ["setpriv", f"--reuid={USER_UID}", f"--regid={USER_UID}", "--clear-groups", "--"]
    script = [*_expose(_needed_paths()), f"cd /tmp && exec {shlex.join([*drop, *python])}"]
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-ec", "\n".join(script)],
        env=environment,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _needed_paths() -> list[str]:
    paths = {sys.base_prefix, sys.prefix, os.path.dirname(sys.executable), str(ROOT)}
    return sorted({os.path.realpath(path) for path in paths} | paths)


def _expose(paths: list[str]) -> list[str]:
    """Shell lines that make `paths` reachable by any uid: each closed folder above one becomes
    a tmpfs holding only those paths, bound back read-only from where they were."""
    closed = sorted({folder for path in paths for folder in _closed_folders(path)}, key=len)
    closed = [f for f in closed if not any(f.startswith(c + "/") for c in closed if c != f)]
    inside = [p for p in paths if any(p.startswith(folder + "/") for folder in closed)]
    fds = {path: 3 + index for index, path in enumerate(inside[:7])}
    # Each path held open before its folder is covered: /proc/self/fd/<n> still reaches it.
    lines = [f"exec {fd}< {shlex.quote(path)}" for path, fd in fds.items()]
    lines += [f"mount -t tmpfs -o mode=755 tmpfs {shlex.quote(folder)}" for folder in closed]
    for path, fd in fds.items():
        lines.append(f"mkdir -p {shlex.quote(path)}")
        lines.append(f"mount --no-canonicalize --rbind /proc/self/fd/{fd} {shlex.quote(path)}")
    lines += [f"exec {fd}<&-" for fd in fds.values()]
    return lines


def _closed_folders(path: str) -> list[str]:
    """The folders above `path` that other users cannot enter."""
    closed = []
    folder = os.path.dirname(path)
    while folder not in ("/", ""):
        if not os.stat(folder).st_mode & stat.S_IXOTH:
            closed.append(folder)
        folder = os.path.dirname(folder)
    return closed
