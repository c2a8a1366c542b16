"""Runs inside the box (`streamrl.rewards.code.runner`): one program against all of a
problem's tests, each in a process of its own with its own limits. Standard library only.

    python /box/harness.py            # reads /box/spec.json

The spec: {"source": "/box/<file>", "compile": argv | null, "run": argv | null, "tests": [...],
"time_s", "memory_mb", "output_bytes", "compile_s", "budget_s", "stop_on_failure"}; `run` null
runs Python in process. Tests that would start after `budget_s` are timeouts; with
`stop_on_failure` the tests after a failed one are skipped.

Output, on stdout, one JSON object per line: {"started": true} once the harness runs (before
any program code: without it the box itself failed), {"compiled": false, "error": ...} when
compiling failed, then one {"test": i, "status": ..., "detail": ...} per test, in order, written
as each ends. Statuses: passed, wrong, error (raised or exited non-zero), timeout (past
`time_s` of wall clock or of CPU), memory (past `memory_mb`), output (printed more than
`output_bytes`), skipped.

Isolation between tests: each test is a fresh fork of this process made before any program
code ran (nothing a test does to memory reaches the next), in a new session and working
directory; after it ends every process left in the box is killed (`kill(-1)`) and every file
it left under /tmp is removed. A test cannot write into this harness's report: its stdout is
its own file, every other descriptor is closed, and the harness is not dumpable (its
/proc/<pid>/fd and ptrace are closed to the test's uid).
"""

import contextlib
import ctypes
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
# The forked test process reports through its exit code: past its memory, and a call test's
# verdicts (codes a program is unlikely to exit with itself).
EXIT_MEMORY, EXIT_WRONG, EXIT_PASSED = 211, 212, 213
PR_SET_DUMPABLE = 4


def main():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
    with open("/box/spec.json") as f:
        spec = json.load(f)
    report({"started": True})
    if spec["compile"]:
        error = build(spec)
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
    deadline = time.monotonic() + spec["budget_s"]
    failed = False
    for index, test in enumerate(spec["tests"]):
        if failed and spec["stop_on_failure"]:
            status, detail = "skipped", "an earlier test failed"
        elif time.monotonic() + spec["time_s"] > deadline:
            status, detail = "timeout", f"the tests' time budget ({spec['budget_s']:g}s) ran out"
        else:
            status, detail = run_test(spec, test, code)
            clean_up(keep)
        failed = failed or status != "passed"
        report({"test": index, "status": status, "detail": detail})


def report(record):
    os.write(1, (json.dumps(record) + "\n").encode())  # unbuffered: a fork copies no buffer


def build(spec):
    """Compile the program; the compiler's last lines when it fails."""
    try:
        done = subprocess.run(spec["compile"], capture_output=True, timeout=spec["compile_s"])
    except subprocess.TimeoutExpired:
        return f"compiling took more than {spec['compile_s']:g}s"
    if done.returncode != 0:
        return done.stderr.decode(errors="replace")[-2000:] or f"exit code {done.returncode}"
    return None


def run_test(spec, test, code):
    workdir = os.path.join(SCRATCH, f"test-{os.getpid()}-{time.monotonic_ns()}")
    os.mkdir(workdir)
    stdin_path = os.path.join(workdir, ".stdin")
    stdout_path = os.path.join(workdir, ".stdout")
    stderr_path = os.path.join(workdir, ".stderr")
    with open(stdin_path, "w") as f:
        f.write(test.get("stdin", ""))
    pid = os.fork()
    if pid == 0:
        child(spec, test, code, workdir, stdin_path, stdout_path, stderr_path)
    status = wait(pid, spec["time_s"])
    stdout = read(stdout_path, spec["output_bytes"] + 1)
    stderr = read(stderr_path, 4000)
    if status == "timeout":
        return "timeout", f"ran past {spec['time_s']:g}s"
    if status == signal.SIGXFSZ or len(stdout) > spec["output_bytes"]:
        return "output", f"printed more than {spec['output_bytes']} bytes"
    if status in (signal.SIGXCPU, signal.SIGKILL):
        return "timeout", f"used more than {spec['time_s']:g}s of CPU"
    if status == -EXIT_MEMORY or "MemoryError" in stderr[-300:]:
        return "memory", f"needed more than {spec['memory_mb']} MiB"
    if test["kind"] == "call":
        if status == -EXIT_PASSED:
            return "passed", ""
        if status == -EXIT_WRONG:
            return "wrong", stdout.strip()[-300:]
        return "error", last_line(stderr) or f"exit status {status}"
    if status != 0:
        return "error", last_line(stderr) or f"exit status {status}"
    if lines(stdout) == lines(test["stdout"]):
        return "passed", ""
    return "wrong", f"printed {stdout[:200]!r}"


def child(spec, test, code, workdir, stdin_path, stdout_path, stderr_path):
    """The test's process: its own session, directory, limits and standard streams."""
    try:
        os.setsid()
        os.chdir(workdir)
        os.dup2(os.open(stdin_path, os.O_RDONLY), 0)
        os.dup2(os.open(stdout_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 1)
        os.dup2(os.open(stderr_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), 2)
        os.closerange(3, 1 << 16)
        seconds = max(1, math.ceil(spec["time_s"]))
        resource.setrlimit(resource.RLIMIT_CPU, (seconds, seconds + 1))
        size = spec["output_bytes"] + 1
        resource.setrlimit(resource.RLIMIT_FSIZE, (size, size))
        memory = spec["memory_mb"] * 1024**2
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        if spec["run"] is not None:
            os.execv(spec["run"][0], spec["run"])
        os._exit(run_python(test, code))  # sys.stdin/stdout/stderr: fds 0-2, nothing buffered
    except BaseException:
        os._exit(1)


def run_python(test, code):
    """Run the program in this (forked) process; the exit status says how it went."""
    call = test["kind"] == "call"
    namespace = {"__name__": "solution" if call else "__main__", "__builtins__": __builtins__}
    try:
        exec(code, namespace)
        if call:
            verdict = judge(call_function(namespace, test), test)
            sys.stdout.flush()
            return verdict
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


def judge(result, test):
    expected = test["expected"]
    if same(result, expected) or (test["unwrap"] and same(result, expected[0])):
        return EXIT_PASSED
    print(f"returned {result!r:.200}")
    return EXIT_WRONG


def same(got, want):
    """== with tuples as lists and floats to a relative tolerance of 1e-6."""
    if isinstance(got, bool) or isinstance(want, bool):
        return got is want or (type(got) is type(want) and got == want)
    if isinstance(got, int | float) and isinstance(want, int | float):
        if isinstance(got, float) or isinstance(want, float):
            return math.isclose(got, want, rel_tol=1e-6, abs_tol=1e-9)
        return got == want
    if isinstance(got, list | tuple) and isinstance(want, list | tuple):
        return len(got) == len(want) and all(same(g, w) for g, w in zip(got, want, strict=True))
    if isinstance(got, dict) and isinstance(want, dict):
        return got.keys() == want.keys() and all(same(got[k], want[k]) for k in want)
    return got == want


def wait(pid, time_s):
    """The child's exit status (its negated exit code for an exit, the signal that ended it,
    0 for success), or "timeout" after `time_s` seconds of wall clock."""
    deadline = time.monotonic() + time_s
    handle = os.pidfd_open(pid)
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([handle], [], [], left)[0]:
                os.killpg(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return "timeout"
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                if os.WIFSIGNALED(status):
                    return os.WTERMSIG(status)
                code = os.WEXITSTATUS(status)
                return -code if code else 0
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


def lines(text):
    return [line.strip() for line in text.strip().splitlines()]


def last_line(text):
    rows = [line for line in text.strip().splitlines() if line.strip()]
    return rows[-1][:300] if rows else ""


if __name__ == "__main__":
    main()
