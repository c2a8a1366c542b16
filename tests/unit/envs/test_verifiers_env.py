"""verifiers environments (tests/verifiers_envs, written as verifiers' docs show) run unchanged
by the real runner in a real worker environment, against a scripted OpenAI-compatible policy
server: one client per rollout, the rubric's reward and functions checked, and runners that
misbehave (garbage, huge or no answers, NaN rewards, environments that raise) contained.

Needs the verifiers worker environment: the session fixture creates it once under the repo's
`.cache/worker-envs/` (pip reaches PyPI), `make test` expects it there."""

from __future__ import annotations

import json
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from streamrl.envs.base import Task
from streamrl.envs.registry import EnvLoadError, EnvResolutionError
from streamrl.envs.verifiers_config import DEFAULT_VERIFIERS_VERSION, VerifiersConfig
from streamrl.envs.verifiers_env import (
    VerifiersSpec,
    check_verifiers_env,
    load_verifiers,
)
from streamrl.envs.worker_envs import create_worker_env, interpreter

REPO = Path(__file__).parents[3]
ENVS = REPO / "tests" / "verifiers_envs"
TASK = Task([{"role": "user", "content": "What is 2+2?"}], "4", "What is 2+2?")


@pytest.fixture(scope="session")
def worker_env() -> Path:
    location = REPO / ".cache" / "worker-envs" / f"verifiers-{DEFAULT_VERIFIERS_VERSION}"
    if not interpreter(location).is_file():
        create_worker_env(location, DEFAULT_VERIFIERS_VERSION, [])
    python = interpreter(location)
    purelib = os.popen(
        f"{python} -I -c 'import sysconfig; print(sysconfig.get_paths()[\"purelib\"])'"
    )
    (Path(purelib.read().strip()) / "streamrl_test_verifiers_envs.pth").write_text(f"{ENVS}\n")
    return location


class Policy(ThreadingHTTPServer):
    """A scripted policy behind the endpoint's routes: `reply(token, turn)` → message."""

    def __init__(self, reply) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.reply, self.starts, self.requests = reply, [], []
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}/v1"


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass

    def do_POST(self) -> None:
        token = self.headers["Authorization"].removeprefix("Bearer ")
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"] or 0)) or b"{}")
        if self.path.endswith("/streamrl/start"):
            self.server.starts.append(token)
            answer = {}
        else:
            turn = sum(1 for t, _ in self.server.requests if t == token)
            self.server.requests.append((token, body))
            message = self.server.reply(token, turn)
            finish = "tool_calls" if message.get("tool_calls") else "stop"
            answer = {
                "id": "c",
                "object": "chat.completion",
                "created": 0,
                "model": "policy",
                "choices": [{"index": 0, "message": message, "finish_reason": finish}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
            }
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def _says(text):
    return lambda token, turn: {"role": "assistant", "content": text}


def _runner(worker_env, env_id, reward_range=(0.0, 1.0), runner=None, **env_args):
    spec = VerifiersSpec(str(interpreter(worker_env)), env_id, env_args, reward_range, 120.0)
    if runner is not None:
        spec = VerifiersSpec(spec.python, env_id, env_args, reward_range, 10.0, str(runner))
    return load_verifiers(spec)


def test_a_single_turn_environment_scores_each_rollout_with_its_own_client(worker_env):
    policy = Policy(_says("4"))
    runner = _runner(worker_env, "vf_single_turn")
    try:
        runs = runner.run(policy.base_url, ["t1", "t2", "t3"], TASK, 60.0)
    finally:
        runner.close()
    assert sorted(policy.starts) == ["t1", "t2", "t3"]
    assert sorted(t for t, _ in policy.requests) == ["t1", "t2", "t3"]
    assert policy.requests[0][1]["messages"] == TASK.messages
    for run in runs:
        assert run.failure is None, run.error
        assert run.result.reward == 1.0
        assert run.result.terms == {
            "vf_correct_answer": 1.0,
            "vf_response_chars": 1.0,
            "vf_num_turns": 1.0,
        }


def test_an_empty_answer_is_the_policys_scored_as_it_stands_not_a_failure(worker_env):
    """verifiers ends a rollout whose answer is empty (EmptyModelResponseError); a policy may
    well sample one, so it is scored (0 here), never blamed on the environment (env_error)."""
    policy = Policy(_says(""))
    runner = _runner(worker_env, "vf_single_turn")
    try:
        runs = runner.run(policy.base_url, ["a", "b"], TASK, 60.0)
    finally:
        runner.close()
    for run in runs:
        assert run.failure is None, run.error
        assert run.result.reward == 0.0
        assert run.result.terms["vf_correct_answer"] == 0.0


def test_a_multi_turn_environment_runs_its_own_turns(worker_env):
    policy = Policy(_says("and"))
    runner = _runner(worker_env, "vf_multi_turn")
    try:
        runs = runner.run(policy.base_url, ["a", "b"], TASK, 60.0)
    finally:
        runner.close()
    assert [t for t, _ in policy.requests].count("a") == 3
    last = [body for t, body in policy.requests if t == "a"][-1]
    assert [m["content"] for m in last["messages"]][-2:] == ["and", "go on"]
    assert all(run.result.reward == pytest.approx(1.0) for run in runs)


def test_a_tool_environment_calls_its_tools(worker_env):
    def reply(token, turn):
        if turn == 0:
            call = {
                "id": "c1",
                "type": "function",
                "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
            }
            return {"role": "assistant", "content": None, "tool_calls": [call]}
        return {"role": "assistant", "content": "5"}

    policy = Policy(reply)
    runner = _runner(worker_env, "vf_tool")
    try:
        task = Task([{"role": "user", "content": "What is 2+3? Use add."}], "5", "")
        (run,) = runner.run(policy.base_url, ["x"], task, 60.0)
    finally:
        runner.close()
    assert run.failure is None, run.error
    assert run.result.reward == 1.0
    assert run.result.terms["vf_add_calls"] == 1.0
    assert policy.requests[0][1]["tools"][0]["function"]["name"] == "add"
    tool_result = policy.requests[1][1]["messages"][-1]
    assert (tool_result["role"], tool_result["content"], tool_result["tool_call_id"]) == (
        "tool",
        "5",
        "c1",
    )


@pytest.mark.parametrize(
    ("mode", "why"),
    [
        ("nan", "not a finite number"),
        ("raise", "the environment broke"),
        ("out_of_range", "reward_range"),
    ],
)
def test_a_broken_reward_or_environment_fails_its_episodes(worker_env, mode, why):
    policy = Policy(_says("hi"))
    runner = _runner(worker_env, "vf_hostile", mode=mode)
    try:
        runs = runner.run(policy.base_url, ["a", "b"], TASK, 60.0)
        again = runner.run(policy.base_url, ["c"], TASK, 60.0)  # the runner goes on
    finally:
        runner.close()
    for run in [*runs, *again]:
        assert run.failure == "env_error"
        assert why in run.error


def test_a_wide_reward_range_maps_onto_zero_one_and_prints_stay_out_of_the_protocol(worker_env):
    policy = Policy(_says("hi"))
    wide = _runner(worker_env, "vf_hostile", reward_range=(-5.0, 5.0), mode="out_of_range")
    printing = _runner(worker_env, "vf_hostile", mode="print")
    try:
        (run,) = wide.run(policy.base_url, ["a"], TASK, 60.0)
        (printed,) = printing.run(policy.base_url, ["b"], TASK, 60.0)
    finally:
        wide.close()
        printing.close()
    assert run.result.reward == 1.0
    assert printed.failure is None
    assert printed.result.reward == 1.0


def _fake_runner(tmp_path, body: str) -> Path:
    script = tmp_path / "runner.py"
    script.write_text("import sys, time\nfor line in sys.stdin:\n" + body)
    return script


@pytest.mark.parametrize(
    "body",
    [
        "    print('garbage', flush=True)\n",
        "    sys.stdout.write('{\"x\": \"' + 'a' * 9_000_000 + '\"}\\n')\n    sys.stdout.flush()\n",
        "    print('[1, 2]', flush=True)\n",
        "    sys.exit(3)\n",
    ],
)
def test_a_runner_that_answers_no_answer_fails_to_load_and_is_killed(tmp_path, body):
    spec = VerifiersSpec(
        sys.executable, "x", {}, (0.0, 1.0), 10.0, str(_fake_runner(tmp_path, body))
    )
    with pytest.raises(EnvLoadError, match="verifiers environment 'x'"):
        load_verifiers(spec)


def test_a_runner_that_hangs_times_out_and_leaves_no_process(tmp_path):
    body = (
        "    if 'load' in line: print('{\"ok\": true, \"reward_names\": []}', flush=True)\n"
        "    else: time.sleep(600)\n"
    )
    spec = VerifiersSpec(
        sys.executable, "x", {}, (0.0, 1.0), 10.0, str(_fake_runner(tmp_path, body))
    )
    runner = load_verifiers(spec)
    process = runner._process
    policy = Policy(_says("hi"))
    with pytest.raises(TimeoutError):
        runner.run(policy.base_url, ["a"], TASK, 0.5)
    assert process.poll() is not None, "the hung runner was killed"
    assert runner._process is None


def test_a_missing_worker_env_is_refused_naming_the_command(tmp_path):
    config = VerifiersConfig(env_id="vf-single-turn", worker_env=str(tmp_path / "none"))
    with pytest.raises(EnvResolutionError, match="streamrl worker-env verifiers --version"):
        check_verifiers_env(config)


def test_an_environment_missing_from_the_worker_env_is_refused(worker_env):
    config = VerifiersConfig(env_id="vf-not-installed", worker_env=str(worker_env))
    with pytest.raises(EnvResolutionError, match="is not installed in the worker environment"):
        check_verifiers_env(config)
    check_verifiers_env(VerifiersConfig(env_id="vf-single-turn", worker_env=str(worker_env)))


def test_a_failed_episode_scores_0_in_every_rubric_term_so_groups_share_their_terms(
    worker_env,
):
    """Segments hold groups with the same reward terms: a group whose every episode failed
    must carry the rubric's terms (0) like any other, or the writer could not store it beside
    one that succeeded."""
    from streamrl.envs.config import EnvConfig
    from streamrl.envs.runner import EnvRunner
    from streamrl.rewards.config import RewardConfig

    policy = Policy(_says("hi"))
    env = EnvConfig.model_validate({
        "verifiers": {"env_id": "vf_hostile", "env_args": {"mode": "raise"},
                      "worker_env": str(worker_env)}, "workers": 1,
    })  # fmt: skip
    with EnvRunner.from_config(env, RewardConfig(), None) as runner:
        episodes = [f.result() for f in runner.run_agents(TASK, policy.base_url, ["x", "y"])]
        scored = [runner.score(e).result() for e in episodes]
    assert [s.failure for s in scored] == ["error", "error"]
    for s in scored:  # the rubric's function and verifiers' own metrics (num_turns)
        assert s.terms is not None
        assert "vf_one" in s.terms
        assert set(s.terms.values()) == {0.0}
