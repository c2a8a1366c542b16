"""Runs inside the box (`streamrl.rewards.code.runner`): one program on all of a problem's
tests, each in a process of its own with its own limits. Standard library only.

    python /box/harness.py            # reads /box/spec.json, reports on descriptor 3

The spec: {"source": "/box/<file>", "compile": argv | null, "run": argv | null, "tests": [...],
"time_s", "wall_s", "memory_mb", "output_bytes", "compile_s", "deadline", "stop_on_failure"};
`run` null runs Python in process; `deadline` is when the tests' time is up, on the monotonic
clock the box shares with its caller (compiling counts against it: the caller kills the box a
moment after it). A test is {"kind": "stdio", "stdin"} or {"kind": "call", "fn_name", "args"}:
inputs only. No expected output ever enters the box — the program shares this process's memory
and files and could read them — so the harness reports what the program did and the runner,
outside, judges it.

The report goes to descriptor 3, the box's private channel (`streamrl.isolation.box`), one JSON
object per line: {"started": true} once the harness runs (before any program code: without it
the box itself failed), {"compiled": false, "error": ...} when compiling failed, then per test,
in order, as each ends: {"test": i, "status": ..., "detail": ..., "stdout": sha256 of the
printed lines (each stripped, trailing blank lines dropped), "head": the first characters
printed, "result": a call's return value as JSON}. Statuses (`STATUSES`): ran, error (raised or
exited non-zero), timeout (past `time_s` of CPU, past `wall_s` of wall clock — it waited or
slept —, or past the deadline), memory (past `memory_mb`), output (printed more than
`output_bytes`, or a result larger than `MAX_RESULT_CHARS`), skipped (after a test that did not
run to its end, with `stop_on_failure`).

Isolation between tests: each test is a fresh fork of this process made before any program
code ran (nothing a test does to memory reaches the next), in a new session and working
directory; after it ends every process left in the box is killed (`kill(-1)`) and every file
it left under /tmp is removed. A test cannot write into this harness's report: its stdout is
its own file, every other descriptor is closed (the report's too), and the harness is not
dumpable (its /proc/<pid>/fd and ptrace are closed to the test's uid); the box's stdout, which
any process in the box can reach through /proc/1/fd, carries nothing the runner reads.
"""

import contextlib
import ctypes
import hashlib
import json
import math
import os
import resource
import select
import shutil
import signal
import subprocess
import sys
import time
import traceback

SCRATCH = "/tmp"
REPORT = 3  # the box's private channel
STATUSES = ("ran", "error", "timeout", "memory", "output", "skipped")
OUT_OF_TIME = "the tests' time (the reward call's limit) ran out"
EXIT_MEMORY = 211  # the forked test process ran out of memory (a code no program uses)
MAX_RESULT_CHARS = 1 << 16
HEAD_CHARS = 200
PR_SET_DUMPABLE = 4


def main():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    with open("/box/spec.json") as f:
        spec = json.load(f)
    deadline = spec["deadline"]
    report({"started": True})
    if spec["compile"]:
        error = build(spec, deadline)
        if error is not None:
            report({"compiled": False, "error": error})
            return
    keep = set(os.listdir(SCRATCH))  # the compiled program stays for every test
    code = None
    if spec["run"] is None:
        with open(spec["source"], "rb") as f:
            source = f.read()
        try:
            code = compile(source, "solution.py", "exec")
        except (SyntaxError, ValueError) as error:
            report({"compiled": False, "error": f"{type(error).__name__}: {error}"})
            return
    failed = False
    for index, test in enumerate(spec["tests"]):
        if failed and spec["stop_on_failure"]:
            outcome = {"status": "skipped", "detail": "an earlier test failed"}
        elif time.monotonic() + spec["time_s"] > deadline:
            outcome = {"status": "timeout", "detail": OUT_OF_TIME}
        else:
            outcome = run_test(spec, test, code, deadline)
            clean_up(keep)
        failed = failed or outcome["status"] != "ran"
        report({"test": index, "detail": "", **outcome})


def report(record):
    os.write(REPORT, (json.dumps(record) + "\n").encode())  # unbuffered: a fork copies none


def build(spec, deadline):
    """Compile the program, within `compile_s` and the deadline; the compiler's last lines
    when it fails."""
    limit = min(spec["compile_s"], deadline - time.monotonic())
    try:
        done = subprocess.run(spec["compile"], capture_output=True, timeout=max(0.0, limit))
    except subprocess.TimeoutExpired:
        if limit < spec["compile_s"]:
            return f"compiling did not end before {OUT_OF_TIME}"
        return f"compiling took more than {spec['compile_s']:g}s"
    if done.returncode != 0:
        return done.stderr.decode(errors="replace")[-2000:] or f"exit code {done.returncode}"
    return None


def run_test(spec, test, code, deadline):
    """Run one test in a fresh fork, stopped at its wall clock or the deadline; what it did,
    as a report record's fields."""
    workdir = os.path.join(SCRATCH, f"test-{os.getpid()}-{time.monotonic_ns()}")
    os.mkdir(workdir)
    paths = {name: os.path.join(workdir, f".{name}") for name in ("stdin", "stdout", "stderr")}
    paths["result"] = os.path.join(workdir, ".result")
    with open(paths["stdin"], "w") as f:
        f.write(test.get("stdin", ""))
    pid = os.fork()
    if pid == 0:
        child(spec, test, code, workdir, paths)
    wall_s = min(spec["wall_s"], deadline - time.monotonic())
    status, cpu_s = wait(pid, wall_s)
    stdout = read(paths["stdout"], spec["output_bytes"] + 1)
    stderr = read(paths["stderr"], 4000)
    cpu = {"status": "timeout", "detail": f"used more than {spec['time_s']:g}s of CPU"}
    if status == "timeout" and cpu_s > spec["time_s"]:
        return cpu  # stopped at its wall clock, but it had used its CPU time first
    if status == "timeout" and wall_s < spec["wall_s"]:
        return {"status": "timeout", "detail": OUT_OF_TIME}
    if status == "timeout":
        return {"status": "timeout", "detail": f"ran past {spec['wall_s']:g}s of wall clock"}
    if status == signal.SIGXFSZ or len(stdout) > spec["output_bytes"]:
        return {"status": "output", "detail": f"printed more than {spec['output_bytes']} bytes"}
    if status in (signal.SIGXCPU, signal.SIGKILL) or cpu_s > spec["time_s"]:
        return cpu
    if status == -EXIT_MEMORY or "MemoryError" in stderr[-300:]:
        return {"status": "memory", "detail": f"needed more than {spec['memory_mb']} MiB"}
    if status != 0:
        return {"status": "error", "detail": last_line(stderr) or f"exit status {status}"}
    ran = {"status": "ran", "stdout": digest(stdout), "head": stdout[:HEAD_CHARS]}
    if test["kind"] == "call":
        result = read(paths["result"], MAX_RESULT_CHARS + 1)
        if len(result) > MAX_RESULT_CHARS:
            return {"status": "output", "detail": f"returned more than {MAX_RESULT_CHARS} chars"}
        ran["result"] = result
    return ran


def digest(text):
    """The printed lines as the runner compares them: each stripped, trailing blank lines
    dropped (the same rule as `streamrl.rewards.code.verdicts.output_digest`)."""
    lines = [line.strip() for line in text.strip().splitlines()]
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def child(spec, test, code, workdir, paths):
    """The test's process: its own session, directory, limits and standard streams."""
    try:
        os.setsid()
        os.chdir(workdir)
        os.dup2(os.open(paths["stdin"], os.O_RDONLY), 0)
        os.dup2(os.open(paths["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 1)
        os.dup2(os.open(paths["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
        os.closerange(3, 1 << 16)
        seconds = max(1, math.ceil(spec["time_s"]))
        resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 1))
        size = spec["output_bytes"] + 1
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        memory = spec["memory_mb"] * 1024**2
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        if spec["run"] is not None:
            os.execv(spec["run"][0], spec["run"])
        os._exit(run_python(test, code, paths["result"]))  # sys.std*: fds 0-2, none buffered
    except BaseException:
        os._exit(1)


def run_python(test, code, result_path):
    """Run the program in this (forked) process; the exit status says how it went, a call's
    return value goes to `result_path` as JSON."""
    call = test["kind"] == "call"
    namespace = {"__name__": "solution" if call else "__main__", "__builtins__": __builtins__}
    try:
        exec(code, namespace)
        if call:
            result = json.dumps(call_function(namespace, test), default=repr)
            with open(result_path, "w") as f:
                f.write(result)
    except SystemExit as stop:
        if call:
            return 1
        sys.stdout.flush()
        return stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
    except MemoryError:
        return EXIT_MEMORY
    except BaseException:
        kind, value, tb = sys.exc_info()
        traceback.print_exception(kind, value, tb.tb_next)
        sys.stderr.flush()
        return 1
    sys.stdout.flush()
    return 0


def call_function(namespace, test):
    name = test["fn_name"]
    if callable(namespace.get(name)):
        function = namespace[name]
    elif isinstance(namespace.get("Solution"), type):  # LeetCode style: a method of Solution
        function = getattr(namespace["Solution"](), name)
    else:
        raise NameError(f"the program defines no function {name}")
    return function(*json.loads(json.dumps(test["args"])))  # a fresh copy for each call


def wait(pid, wall_s):
    """The child's exit status (its negated exit code for an exit, the signal that ended it,
    0 for success), or "timeout" after `wall_s` seconds of wall clock; and the CPU seconds it
    used (with the children it waited for)."""
    cpu = lambda usage: usage.ru_utime + usage.ru_stime  # noqa: E731
    deadline = time.monotonic() + wall_s
    handle = os.pidfd_open(pid)
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([handle], [], [], left)[0]:
                os.killpg(pid, signal.SIGKILL)
                return "timeout", cpu(os.wait4(pid, 0)[2])
            done, status, usage = os.wait4(pid, os.WNOHANG)
            if done:
                if os.WIFSIGNALED(status):
                    return os.WTERMSIG(status), cpu(usage)
                code = os.WEXITSTATUS(status)
                return (-code if code else 0), cpu(usage)
    finally:
        os.close(handle)


def clean_up(keep):
    """Kill every process the test left (all but this harness and the box's init), and remove
    every file it left in the scratch directory."""
    with contextlib.suppress(ProcessLookupError):  # none left
        os.kill(-1, signal.SIGKILL)
    for name in os.listdir(SCRATCH):
        if name not in keep:
            path = os.path.join(SCRATCH, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                with contextlib.suppress(OSError):
                    os.unlink(path)


def read(path, limit):
    try:
        with open(path, "rb") as f:
            return f.read(limit).decode(errors="replace")
    except OSError:
        return ""


def last_line(text):
    rows = [line for line in text.strip().splitlines() if line.strip()]
    return rows[-1][:300] if rows else ""


if __name__ == "__main__":
    main()
