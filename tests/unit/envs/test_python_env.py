"""The `python` environment's tool (`streamrl.envs.python_env`), run in this process: code runs
in the box and its output comes back within the step's limits; the attacks of a policy that
writes hostile code, through the tool as the model calls it."""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from streamrl.envs import TOOL_FORMATS, EnvContext, Task
from streamrl.envs.python_env import PythonEnv
from streamrl.rewards import math_reward


@pytest.fixture(scope="module")
def env() -> PythonEnv:
    context = EnvContext(
        math_reward, "math", TOOL_FORMATS["hermes"], observation_max_chars=500, call_timeout_s=6.0
    )
    return PythonEnv(context)


def test_the_tool_answers_within_the_step_limit(env: PythonEnv) -> None:
    assert env.code_limit_s == pytest.approx(2.0)  # a third of the step's 6 s: two calls and room
    task = Task([{"role": "user", "content": "What is 2^10?"}], "1024")
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(2**10)"}}\n</tool_call>'
    step = env.step(task, env.reset(task).state, call)
    assert step.messages == [{"role": "tool", "name": "python", "content": "1024\n"}]
    assert env.run_code("x = 1") == "(no output: print() the values you want to see)"
    assert env.run_code("import sys\nsys.exit(3)") == "(exit code 3)"
    assert "ZeroDivisionError" in env.run_code("1/0")
    assert env.run_code("import sympy\nprint(sympy.factorint(360))") == "{2: 3, 3: 2, 5: 1}\n"
    started = time.monotonic()
    assert (
        env.run_code("while True: pass")
        == "Error: the code ran past its time limit of 2s and was stopped"
    )
    assert time.monotonic() - started < 4


def test_output_is_cut_to_the_observation_limit(env: PythonEnv) -> None:
    answer = env.run_code("print('a' * 100_000)\nraise ValueError('last words')")
    stdout, stderr = answer.split("stderr:\n")
    assert stdout.startswith("a" * 300)
    assert "more characters cut; limit 500" in stdout
    assert len(stdout) <= 501
    assert stderr.endswith("ValueError: last words\n\n(exit code 1)")


def test_ctypes_system_cannot_write_to_the_host(env: PythonEnv, tmp_path: Path) -> None:
    target = tmp_path / "pwned"
    answer = env.run_code(
        f"import ctypes\nctypes.CDLL(None).system(b'id -u; touch {target}')\n"
        "import os\nos.system('id -u')"
    )
    assert not target.exists()
    assert "0\n" not in answer.splitlines(keepends=True)  # never root


def test_a_setsid_child_does_not_outlive_the_call(env: PythonEnv) -> None:
    marker = f"tool-survivor-{uuid.uuid4().hex}"
    env.run_code(  # ctypes: around any audit hook
        "import ctypes\n"
        f"ctypes.CDLL(None).system(b\"setsid {sys.executable} -c 'import time; time.sleep(60)' "
        f'{marker} </dev/null >/dev/null 2>&1 &")\n'
        "print('started')"
    )
    time.sleep(0.2)
    survivors = [
        p for p in psutil.process_iter(["cmdline"]) if marker in " ".join(p.info["cmdline"] or ())
    ]
    for p in survivors:
        p.kill()
    assert survivors == []


def test_replacing_its_output_files_with_fifos_does_not_hang(env: PythonEnv) -> None:
    started = time.monotonic()
    answer = env.run_code("import os\nos.remove('.stdout') if os.path.exists('.stdout') else None\n"
                          "os.mkfifo('.stdout'); os.mkfifo('.stderr'); print('done')")  # fmt: skip
    assert answer == "done\n"
    assert time.monotonic() - started < 2


def test_a_generators_python_environment_fails_on_entry_without_the_box(tmp_path: Path) -> None:
    """The workers a generator starts for `generator.env.fn=python` refuse to load, and the
    generator's start fails naming the fix."""
    code = (
        "from streamrl.envs import EnvConfig, EnvRunner\n"
        "with EnvRunner(EnvConfig(fn='python', workers=1)):\n"
        "    pass\n"
    )
    started = subprocess.run(
        [sys.executable, "-c", code],
        env={"PATH": str(tmp_path)},  # no bwrap on it
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert started.returncode != 0
    assert "EnvLoadError" in started.stderr
    assert "apt-get install bubblewrap" in started.stderr
