"""The box: where everything a model wrote is run (the `python` tool today, code rewards next).

Each call starts a fresh bubblewrap (`bwrap`) sandbox, runs one program in it and tears it down:

* **filesystem**: a read-only view of what the interpreter needs — `/usr` (with the `/bin`,
  `/lib`, ... links of a merged-/usr system), the interpreter's prefix and the virtualenv's
  packages — and nothing else of the host: no home directories, no project, no credentials
  files. A private tmpfs of `scratch_mb` at `/tmp` is the only writable place and the working
  directory; the caller's files are mounted read-only under `/box`. Its own `/dev` and `/proc`.
* **processes**: a new PID namespace. The program's parent is the box's init (bwrap, pid 1);
  when the program exits, or the call runs out of time and the init is killed, the kernel kills
  every process left in the namespace — a `setsid()` child or a daemon cannot outlive the call.
  The box also dies with the process that started it, even a SIGKILLed one (`--die-with-parent`),
  and runs in a new session (no terminal to write keystrokes into).
* **identity**: an unprivileged uid with no capabilities and no-new-privileges. A root caller
  drops the program to a uid of its own for this box (so RLIMIT_NPROC counts this box's
  processes and nobody else's); any other caller runs it as uid 65534 in a user namespace in
  which no further user namespace can be made.
* **network**: a network namespace with no interfaces (not even the host's loopback).
* **environment**: built from an allowlist (`BOX_ENVIRONMENT` and what the caller passes);
  nothing of the caller's environment reaches the program.
* **system calls**: a seccomp filter refuses what the box does not need and an attacker would
  (`streamrl.isolation.seccomp`: new namespaces, mounts, the keyring, eBPF, io_uring, ...).
* **limits** (`BoxLimits`): wall clock (the caller kills the box's init), CPU seconds, address
  space per process, processes (threads included), file size, open files, scratch size — set by
  the launcher inside the box before the program starts, so the program cannot raise them.
* **output**: pipes the caller opened before the program started; the first `output_bytes` of
  stdout and the last `output_bytes` of stderr are kept (an error's last line says what it
  was), the rest is read and dropped, so a program that prints without end costs only its time.
* **a private channel** (`channel=True`): descriptor 3 of the program's first process, a pipe
  no other process in the box holds — bwrap's init closes every descriptor but 0-2 before it
  starts the program, so `/proc/1/fd` offers only stdout, which any process of the box can
  reach (the init has the program's uid when the caller is not root). What the first process
  writes there comes back as `BoxResult.channel`. A trusted supervisor in the box (the code
  harness) reports through it: it marks itself not dumpable (so its own `/proc/<pid>/fd` and
  ptrace are closed to the box's uid) and closes the descriptor in every process it starts.

There is no fallback: if the box cannot be made (bwrap missing, user namespaces refused),
`check_box()` raises `BoxUnavailableError` naming the fix, and nothing model-written runs.

Memory: each process of the box may use `memory_mb` of address space, so a box holds at most
`processes × memory_mb` plus its scratch; a cgroup would bound the sum, but is not available to
an unprivileged worker. Making a namespace of its own (where it could mount a tmpfs around
that bound) is refused by the syscall filter.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from streamrl.isolation.process import (
    Streams,
    box_init,
    close_quietly,
    kill_box,
    memfd,
    wait_box,
)
from streamrl.isolation.seccomp import box_filter

__all__ = [
    "BOX_ENVIRONMENT",
    "BoxLimits",
    "BoxResult",
    "BoxUnavailableError",
    "box_mode",
    "check_box",
    "run_in_box",
]

PYTHON = "python"  # argv[0] that runs a Python source file with the box's own interpreter
SCRATCH = "/tmp"
FILES = "/box"  # where the caller's files are mounted, read-only

BOX_ENVIRONMENT: Mapping[str, str] = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": SCRATCH,
    "TMPDIR": SCRATCH,
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}

_INSTALL_FIX = (
    "install bubblewrap (Debian/Ubuntu: `apt-get install bubblewrap`; Fedora: `dnf install "
    "bubblewrap`), then restart the generator"
)
_USERNS_FIX = (
    "let unprivileged processes create user namespaces (`sysctl -w "
    "kernel.unprivileged_userns_clone=1` on Debian kernels, `sysctl -w "
    "kernel.apparmor_restrict_unprivileged_userns=0` on Ubuntu 24.04+, a non-zero "
    "user.max_user_namespaces), or run the generator as root"
)


class BoxUnavailableError(RuntimeError):
    """The box cannot be made on this machine; the message names the fix."""


class BoxLimits(BaseModel):
    """What one program in the box may use."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    wall_s: float = Field(gt=0, le=3600, description="Wall-clock limit, seconds.")
    cpu_s: int | None = Field(
        None, gt=0, le=3600, description="CPU seconds (RLIMIT_CPU); null: wall_s rounded up."
    )
    memory_mb: int = Field(1024, ge=32, le=1024**2, description="Address space per process.")
    processes: int = Field(
        8, ge=1, le=4096, description="Processes and threads of the program (RLIMIT_NPROC)."
    )
    file_mb: int = Field(16, ge=1, le=1024**2, description="Largest file it may write.")
    open_files: int = Field(64, ge=8, le=65536, description="Open file descriptors.")
    scratch_mb: int = Field(64, ge=1, le=1024**2, description="Size of the tmpfs at /tmp.")
    output_bytes: int = Field(
        1024**2, ge=1, le=1024**3, description="Bytes of stdout (first) and stderr (last) kept."
    )

    def rlimits(self) -> dict[str, int]:
        """The launcher's setrlimit calls, by `resource` constant name."""
        return {
            "RLIMIT_AS": self.memory_mb * 1024**2,
            "RLIMIT_CPU": self.cpu_s or max(1, int(self.wall_s + 0.999)),
            "RLIMIT_NPROC": self.processes,
            "RLIMIT_FSIZE": self.file_mb * 1024**2,
            "RLIMIT_NOFILE": self.open_files,
            "RLIMIT_CORE": 0,
        }


@dataclass(frozen=True)
class BoxResult:
    """What a program in the box did. `returncode`: its exit status, negative for the signal
    that ended it (-9 when it was stopped at its time limit; like a shell, bwrap reports a
    signal N as exit status 128+N, so an exit status above 128 reads as a signal); `stdout`:
    its first and `stderr` its last `output_bytes`; `output_cut`: either was longer;
    `channel`: the first `output_bytes` written to the private channel (module docstring),
    empty without `channel=True`."""

    stdout: bytes
    stderr: bytes
    returncode: int
    timed_out: bool
    output_cut: bool
    wall_s: float
    channel: bytes = b""


# Runs inside the box as the program's first code: the identity, the limits, then the program.
# Arguments: a JSON spec. Only fds 0-2 stay open, and the private channel as fd 3 (a Python
# program holds it itself: it is not passed on to what it starts).
_LAUNCHER = """
import json, os, resource, sys, traceback
spec = json.loads(sys.argv[1])
if spec["channel"] is not None:
    os.dup2(spec["channel"], 3, inheritable=not spec["python"])
    os.closerange(4, 1 << 16)
else:
    os.closerange(3, 1 << 16)
if spec["uid"] is not None:
    os.setgroups([])
    os.setresgid(spec["uid"], spec["uid"], spec["uid"])
    os.setresuid(spec["uid"], spec["uid"], spec["uid"])
for name, value in spec["rlimits"].items():
    resource.setrlimit(getattr(resource, name), (value, value))
argv = spec["argv"]
if not spec["python"]:
    try:
        os.execv(argv[0], argv)
    except OSError as error:
        print(f"box: cannot run {argv[0]}: {error.strerror}", file=sys.stderr)
        os._exit(127)
sys.argv = argv
sys.path.insert(0, os.path.dirname(argv[0]))
with open(argv[0], "rb") as source:
    code = compile(source.read(), argv[0], "exec")
try:
    exec(code, {"__name__": "__main__", "__file__": argv[0], "__builtins__": __builtins__})
except SystemExit:
    raise
except BaseException:
    kind, value, tb = sys.exc_info()
    traceback.print_exception(kind, value, tb.tb_next)
    sys.exit(1)
"""


def run_in_box(
    argv: Sequence[str],
    *,
    limits: BoxLimits,
    files: Mapping[str, bytes] | None = None,
    stdin: bytes = b"",
    env: Mapping[str, str] | None = None,
    channel: bool = False,
) -> BoxResult:
    """Run `argv` in a fresh box (module docstring) and return what it did.

    `argv[0]` is `"python"` to run a Python source file with the box's interpreter (e.g.
    `["python", "/box/main.py"]`), else an executable's absolute path inside the box. `files`:
    name → content, mounted read-only at `/box/<name>`; `stdin`: the program's standard input;
    `env`: variables added to `BOX_ENVIRONMENT` (never secrets: the program reads them);
    `channel`: give the program's first process the private channel as descriptor 3.

    Raises:
        BoxUnavailableError: the box cannot be made here (the message names the fix).
    """
    check_box()
    return _run(argv, limits, files or {}, stdin, env or {}, channel=channel)


def _run(
    argv: Sequence[str],
    limits: BoxLimits,
    files: Mapping[str, bytes],
    stdin: bytes,
    env: Mapping[str, str],
    *,
    channel: bool = False,
) -> BoxResult:
    if not argv:
        raise ValueError("run_in_box needs a program: argv is empty")
    for name in files:
        if not name or "/" in name or name in (".", ".."):
            raise ValueError(f"box file name {name!r} must be a plain file name (no '/')")
    started = time.monotonic()
    python = argv[0] == PYTHON
    with contextlib.ExitStack() as stack, _box_uid() as uid:
        data_fds = [memfd(name, content) for name, content in files.items()]
        syscall_filter = memfd("seccomp", box_filter())
        for fd in (*data_fds, syscall_filter):
            stack.callback(os.close, fd)
        info_read, info_write = os.pipe()
        stack.callback(close_quietly, info_read)
        channel_read, channel_write = os.pipe() if channel else (None, None)
        stack.callback(close_quietly, channel_read)
        spec = {
            "uid": uid,
            "rlimits": limits.rlimits(),
            "python": python,
            "argv": list(argv[1:] if python else argv),  # python: the source file and its args
            "channel": channel_write,
        }
        command = [
            *_bwrap_command(uid is not None, limits, {**BOX_ENVIRONMENT, **env}),
            *_file_arguments(files, data_fds),
            "--seccomp", str(syscall_filter), "--info-fd", str(info_write),
            "--", _python_path(), "-I", *([] if python else ["-S"]),
            "-c", _LAUNCHER, json.dumps(spec),
        ]  # fmt: skip
        passed = (info_write, syscall_filter, *data_fds)
        try:
            process = subprocess.Popen(
                command,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=passed if channel_write is None else (*passed, channel_write),
                env={"PATH": os.defpath},
                start_new_session=True,
            )
        finally:
            os.close(info_write)
            close_quietly(channel_write)
        with process:
            init = box_init(info_read)
            stack.callback(close_quietly, init)
            io = Streams(process, limits.output_bytes, channel_read)
            timed_out = not io.communicate(stdin, deadline=started + limits.wall_s)
            if timed_out:
                kill_box(process, init)
            returncode = wait_box(process, started + limits.wall_s + 5.0, init)
    return BoxResult(
        bytes(io.stdout),
        bytes(io.stderr),
        -signal.SIGKILL if timed_out else returncode,
        timed_out,
        io.cut,
        time.monotonic() - started,
        bytes(io.channel),
    )


def _bwrap_command(as_root: bool, limits: BoxLimits, env: Mapping[str, str]) -> list[str]:
    if as_root:  # bwrap privileged: the launcher drops to the box's own uid
        identity = ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        identity = [
            "--unshare-user", "--uid", "65534", "--gid", "65534", "--disable-userns",
            "--cap-drop", "ALL",
        ]  # fmt: skip
    environment = [part for k, v in env.items() for part in ("--setenv", k, v)]
    return [
        _bwrap(),
        "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts",
        "--unshare-cgroup-try", "--die-with-parent", "--new-session", *identity,
        "--clearenv", *environment,
        # Scratch first: an interpreter or virtualenv under /tmp is bound on top of it.
        "--perms", "1777", "--size", str(limits.scratch_mb * 1024**2), "--tmpfs", SCRATCH,
        *_system_view(),
        "--proc", "/proc", "--dev", "/dev",
        "--chdir", SCRATCH, "--hostname", "box",
    ]  # fmt: skip


def _file_arguments(files: Mapping[str, bytes], fds: Sequence[int]) -> list[str]:
    arguments = []
    for name, fd in zip(files, fds, strict=True):
        arguments += ["--perms", "0444", "--ro-bind-data", str(fd), f"{FILES}/{name}"]
    return arguments


@functools.cache
def _system_view() -> tuple[str, ...]:
    """Read-only binds of what the interpreter needs: /usr and the root links into it, the
    interpreter's prefix and the virtualenv, when they are not under /usr."""
    view = ["--ro-bind", "/usr", "/usr"]
    for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        path = f"/{top}"
        if os.path.islink(path):
            view += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            view += ["--ro-bind", path, path]
    view += ["--ro-bind-try", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    prefixes = {os.path.realpath(p) for p in (sys.base_prefix, sys.prefix)}
    made: set[str] = set()
    for prefix in sorted(prefixes):
        if prefix.startswith("/usr/"):
            continue
        parent = os.path.dirname(prefix)
        parents = []
        while parent != "/" and parent not in made:  # traversable by the box's uid
            parents.append(parent)
            made.add(parent)
            parent = os.path.dirname(parent)
        for directory in reversed(parents):
            view += ["--perms", "0755", "--dir", directory]
        view += ["--ro-bind", prefix, prefix]
    return tuple(view)


@functools.cache
def _python_path() -> str:
    """The worker's interpreter (the virtualenv's, so its packages are importable), by the
    real path of its folder: the box binds the real prefixes (`_system_view`), so a virtualenv
    reached through a symlink (`.venv -> /elsewhere/.venv`) is found there. The file itself
    stays a virtualenv's link: Python finds its `pyvenv.cfg` next to the path it was started
    by."""
    folder, name = os.path.split(os.path.abspath(sys.executable))
    return os.path.join(os.path.realpath(folder), name)


@functools.cache
def _bwrap() -> str:
    path = shutil.which("bwrap")
    if path is None:
        raise BoxUnavailableError(f"the box for model-written code needs bwrap: {_INSTALL_FIX}")
    return path


def box_mode() -> str:
    """How the box drops privileges here (module docstring: identity)."""
    return "a uid of its own per box" if os.geteuid() == 0 else "uid 65534 in a user namespace"


_check_lock = threading.Lock()
_check_error: BoxUnavailableError | None = None
_checked = False


def check_box() -> None:
    """Make sure the box can be made here: a probe program runs in it once per process.

    Raises:
        BoxUnavailableError: bwrap is missing or cannot make the box (user namespaces
            refused); the message names the fix. Checked once; the answer is kept.
    """
    global _check_error, _checked
    with _check_lock:
        if not _checked:
            _check_error = _probe()
            _checked = True
    if _check_error is not None:
        raise _check_error


def _probe() -> BoxUnavailableError | None:
    try:
        result = _run(
            [PYTHON, f"{FILES}/probe.py"],
            BoxLimits(wall_s=30.0),
            {"probe.py": b"import os\nprint(os.getuid())\n"},
            b"",
            {},
        )
    except BoxUnavailableError as error:
        return error
    except RuntimeError as error:  # no libseccomp: the syscall filter cannot be built
        return BoxUnavailableError(f"the box for model-written code cannot be made here: {error}")
    except OSError as error:
        return BoxUnavailableError(f"the box could not be started ({error}): {_INSTALL_FIX}")
    uid = result.stdout.strip()
    if result.returncode == 0 and uid.isdigit() and int(uid) != 0:
        return None
    said = (result.stderr or result.stdout).decode(errors="replace").strip()[-600:]
    fix = _USERNS_FIX if os.geteuid() != 0 else "fix what bwrap reports, then restart the generator"
    return BoxUnavailableError(
        f"the box for model-written code cannot be made here: bwrap said {said!r} (exit "
        f"{result.returncode}); {fix}"
    )


# -- the box's uid ---------------------------------------------------------------------------

_UID_BASE = 1 << 30  # far above real users; unique per box: this process's pid and a slot
_uid_lock = threading.Lock()
_uid_slots_free = list(range(256))


@contextlib.contextmanager
def _box_uid():  # type: ignore[no-untyped-def]
    """A uid of its own for a root caller's box (None for other callers), held for the call."""
    if os.geteuid() != 0:
        yield None
        return
    with _uid_lock:
        if not _uid_slots_free:
            raise RuntimeError("more than 256 boxes at once in one process")
        slot = _uid_slots_free.pop()
    try:
        yield _UID_BASE + ((os.getpid() % (1 << 20)) << 8) + slot
    finally:
        with _uid_lock:
            _uid_slots_free.append(slot)
