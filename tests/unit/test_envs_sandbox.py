"""Tests for the Python tool's sandbox (`streamrl.envs.sandbox`) and the `python` environment's
tool, run in this process: no network, no processes, its time, memory and output limits, no
credentials, a temporary working directory."""

from __future__ import annotations

import json
import os
import socket
import time

import pytest

from streamrl.envs import TOOL_FORMATS, EnvContext, Task
from streamrl.envs.python_env import PythonEnv
from streamrl.envs.sandbox import run_python
from streamrl.rewards import math_reward

LIMITS = {"timeout_s": 5.0, "memory_mb": 512}


def test_code_runs_and_its_output_comes_back() -> None:
    result = run_python(
        "import math\nprint(math.comb(10, 3))\nprint('x', file=__import__('sys').stderr)", **LIMITS
    )
    assert (result.stdout, result.stderr, result.returncode, result.timed_out) == (
        "120\n",
        "x\n",
        0,
        False,
    )


def test_a_socket_cannot_be_opened_or_connected() -> None:
    with socket.socket() as server:  # a real listener on this machine: reachable without the box
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        code = (
            "import socket\n"
            f"socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "print('connected')"
        )
        result = run_python(code, **LIMITS)
        server.setblocking(False)
        with pytest.raises(BlockingIOError):  # a connection made would wait in the backlog
            server.accept()
    assert "connected" not in result.stdout
    assert result.returncode != 0
    assert "PermissionError" in result.stderr
    assert "not allowed in the sandbox" in result.stderr
    raw = run_python("import _socket\n_socket.socket()\nprint('opened')", **LIMITS)
    assert "opened" not in raw.stdout
    assert "PermissionError" in raw.stderr


def test_processes_cannot_be_started() -> None:
    for code in (
        "import subprocess\nsubprocess.run(['true'])",
        "import os\nos.system('true')",
        "import os\nos.fork()",
    ):
        result = run_python(code, **LIMITS)
        assert result.returncode == 1, code
        assert "not allowed in the sandbox" in result.stderr, code


def test_code_that_loops_forever_is_killed_at_its_limit() -> None:
    started = time.monotonic()
    result = run_python("while True:\n    pass", timeout_s=1.0, memory_mb=512)
    elapsed = time.monotonic() - started
    assert result.timed_out
    assert result.returncode < 0
    assert 1.0 <= elapsed < 5.0


def test_code_that_allocates_too_much_fails() -> None:
    result = run_python("data = bytearray(2 * 1024**3)\nprint('allocated')", **LIMITS)
    assert "allocated" not in result.stdout
    assert result.returncode == 1
    assert "MemoryError" in result.stderr
    assert (
        run_python("data = bytearray(64 * 1024**2)\nprint(len(data))", **LIMITS).stdout
        == f"{64 * 1024**2}\n"
    )


def test_no_credentials_and_a_temporary_working_directory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "planted")
    monkeypatch.setenv("HF_TOKEN", "planted")
    code = (
        "import os, json\n"
        "open('note.txt', 'w').write('x')\n"
        "print(json.dumps([sorted(os.environ), os.getcwd()]))"
    )
    result = run_python(code, **LIMITS)
    names, cwd = json.loads(result.stdout)
    assert "AWS_SECRET_ACCESS_KEY" not in names
    assert "HF_TOKEN" not in names
    assert set(names) <= {
        "PATH",
        "HOME",
        "TMPDIR",
        "LANG",
        "OPENBLAS_NUM_THREADS",
        "OMP_NUM_THREADS",
        "MKL_NUM_THREADS",
    }
    assert os.path.basename(cwd).startswith("streamrl-sandbox-")
    assert cwd != os.getcwd()
    assert not os.path.exists(cwd)  # removed afterwards, with what the code wrote


def test_output_is_cut() -> None:
    result = run_python(
        "print('a' * 100_000)\nraise ValueError('last words')",
        timeout_s=5.0,
        memory_mb=512,
        max_chars=300,
    )
    assert result.stdout.startswith("a" * 300)
    assert "output cut at 300 characters" in result.stdout
    assert len(result.stdout) < 400
    assert result.stderr.endswith("ValueError: last words\n")  # an error's end is kept


def test_python_env_tool_answers_and_stays_inside_the_step_limit() -> None:
    context = EnvContext(
        math_reward, "math", TOOL_FORMATS["hermes"], observation_max_chars=500, call_timeout_s=3.0
    )
    env = PythonEnv(context)
    assert env.code_limit_s == pytest.approx(1.0)  # a third of the step's 3 s: two calls and room
    task = Task([{"role": "user", "content": "What is 2^10?"}], "1024")
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(2**10)"}}\n</tool_call>'
    step = env.step(task, env.reset(task).state, call)
    assert step.messages == [{"role": "tool", "name": "python", "content": "1024\n"}]
    assert env.run_code("x = 1") == "(no output: print() the values you want to see)"
    assert env.run_code("import sys\nsys.exit(3)") == "(exit code 3)"
    assert "ZeroDivisionError" in env.run_code("1/0")
    assert (
        env.run_code("while True: pass")
        == "Error: the code ran past its time limit of 1s and was stopped"
    )
