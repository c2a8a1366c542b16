"""Running a model's Python code in a sandboxed subprocess: no network, limited time, memory,
file size and output, no credentials, a temporary working directory.

`run_python(code, timeout_s=..., memory_mb=...)` starts a fresh interpreter for each piece of
code (nothing carries over between calls) and returns what it printed. The box:

* network: the interpreter runs in a network namespace of its own with no interfaces
  (`unshare --net --map-root-user`) where the kernel allows one; and in every case an audit
  hook, installed before the code runs and impossible to remove from Python, refuses every
  socket operation and every way to start a process (`subprocess`, `os.system`, `os.fork`,
  `os.exec*`, `os.posix_spawn`);
* time: killed (its whole process group) `timeout_s` after it starts; RLIMIT_CPU as a backstop;
* memory: RLIMIT_AS of `memory_mb` (an allocation beyond it raises MemoryError);
* files: a fresh temporary directory as working directory and HOME, removed afterwards;
  RLIMIT_FSIZE caps every file it writes, its captured output included (`MAX_FILE_MB`);
* environment: nothing of the caller's but a PATH — no credentials, no PYTHONPATH — and the
  interpreter in isolated mode (`-I`: no user site-packages, no current directory on sys.path).

What it does not do: the code runs as the worker's user and may read what that user may read
(with the audit hook's `open` left allowed: the code may write its own files). Hostile code
needs another user or a container; this box is for the honest mistakes and runaway loops of a
model learning to program.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass

__all__ = ["SandboxResult", "network_namespace_available", "run_python"]

MAX_FILE_MB = 16

# Runs in the child before the code: limits, then the audit hook, then the code from stdin.
_PRELUDE = """
import resource, sys, traceback
memory, cpu_s, file_bytes = (int(a) for a in sys.argv[1:4])
hard = resource.getrlimit(resource.RLIMIT_AS)[1]
if hard != resource.RLIM_INFINITY:
    memory = min(memory, hard)
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
code = sys.stdin.read()
_BLOCKED = ("socket.", "subprocess.", "os.system", "os.fork", "os.forkpty", "os.exec",
            "os.posix_spawn", "os.spawn", "pty.spawn")
def _refuse(event, args, _blocked=_BLOCKED):
    if event.startswith(_blocked):
        raise PermissionError(f"{event} is not allowed in the sandbox (no network, no processes)")
sys.addaudithook(_refuse)
sys.argv = ["<code>"]
try:
    exec(compile(code, "<code>", "exec"), {"__name__": "__main__"})
except SystemExit:
    raise
except BaseException:
    kind, value, tb = sys.exc_info()
    traceback.print_exception(kind, value, tb.tb_next)  # from the code's own frames
    sys.exit(1)
"""


@dataclass(frozen=True)
class SandboxResult:
    """What the code printed (stdout's first and stderr's last `max_chars` characters), its
    exit code (negative: the signal that ended it), and whether it was stopped at its time
    limit."""

    stdout: str
    stderr: str
    returncode: int
    timed_out: bool


@functools.cache
def network_namespace_available() -> bool:
    """Whether `unshare --net --map-root-user` works here (user namespaces allowed)."""
    if shutil.which("unshare") is None:
        return False
    try:
        probe = subprocess.run(
            ["unshare", "--net", "--map-root-user", "true"],
            capture_output=True, timeout=10, env={"PATH": os.defpath},
        )  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return False
    return probe.returncode == 0


def run_python(
    code: str, *, timeout_s: float, memory_mb: int, max_chars: int = 10_000
) -> SandboxResult:
    """Run `code` in a fresh sandboxed interpreter (module docstring) and return its output."""
    command = [
        sys.executable, "-I", "-c", _PRELUDE,
        str(memory_mb * 1024**2), str(max(1, int(timeout_s) + 1)), str(MAX_FILE_MB * 1024**2),
    ]  # fmt: skip
    if network_namespace_available():
        command = ["unshare", "--net", "--map-root-user", *command]
    with tempfile.TemporaryDirectory(prefix="streamrl-sandbox-") as workdir:
        environ = {
            "PATH": os.defpath, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
            "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
        }  # fmt: skip
        out_path, err_path = os.path.join(workdir, ".stdout"), os.path.join(workdir, ".stderr")
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=workdir,
                env=environ, start_new_session=True,
            )  # fmt: skip
            timed_out = False
            try:
                process.communicate(code.encode(), timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                _kill_group(process)
        return SandboxResult(
            _read(out_path, max_chars),
            _read(err_path, max_chars, tail=True),  # an error's last line says what it was
            process.returncode,
            timed_out,
        )


def _kill_group(process: subprocess.Popen[bytes]) -> None:
    """SIGKILL the code's whole process group (it may have left children) and reap it."""
    with contextlib.suppress(ProcessLookupError):  # the group is gone already
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def _read(path: str, max_chars: int, *, tail: bool = False) -> str:
    """The first (or, `tail`, the last) `max_chars` characters of a file, saying if cut."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        if tail:
            f.seek(max(0, size - 4 * max_chars))
        data = f.read(4 * max_chars)
    text = data.decode("utf-8", errors="replace")
    if len(text) <= max_chars and len(data) == size:
        return text
    if tail:
        return f"[... output cut to its last {max_chars} characters]\n" + text[-max_chars:]
    return text[:max_chars] + f"\n[... output cut at {max_chars} characters]"
