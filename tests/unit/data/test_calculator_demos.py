"""The calculator agent's bundled data (`streamrl.data.tool_problems`): the held-out split shares
no problem with the training split, every demonstration's call and answer are right, and a
demonstration rendered for supervised training begins with exactly the tokens the calculator
environment's RL episode of the same problem begins with — so the warm start teaches the
model the very episode RL continues."""

from __future__ import annotations

from transformers import AutoTokenizer

from streamrl.config.loading import load_config
from streamrl.data.builtin import builtin_rows
from streamrl.envs import TOOL_FORMATS, EnvContext, Task
from streamrl.envs.calculator import CalculatorEnv, calculate
from streamrl.envs.chat import ChatRenderer
from streamrl.learner.supervised import SupervisedSource
from streamrl.models import resolve_model_path
from streamrl.rewards import math_reward


def test_the_held_out_problems_are_never_trained_on_and_the_demonstrations_are_right() -> None:
    train, test = builtin_rows("calculator"), builtin_rows("calculator-test")
    assert (len(train), len(test)) == (2000, 256)
    expressions = [{r["extra_info"]["expression"] for r in rows} for rows in (train, test)]
    assert not expressions[0] & expressions[1]
    for rows in (train, test):  # both kinds in both splits, every ground truth right
        assert 0.4 < sum(r["extra_info"]["operations"] == 2 for r in rows) / len(rows) < 0.6
        for row in rows[:300]:
            truth = row["reward_model"]["ground_truth"]
            assert calculate(row["extra_info"]["expression"]) == truth
    for demo in builtin_rows("calculator-demos")[:200] + builtin_rows("calculator-demos-test"):
        _, call, result, answer = demo["messages"]
        expression = call["tool_calls"][0]["function"]["arguments"]["expression"]
        assert demo["extra_info"]["operations"] == 1  # two-operation problems are RL's
        assert result["content"] == calculate(expression)
        assert math_reward(answer["content"], calculate(expression)) == 1.0
    # Without the tool: the same problems, the same final answer at once.
    for demo, direct in zip(builtin_rows("calculator-demos-test"),
                            builtin_rows("calculator-answers-test"), strict=True):  # fmt: skip
        assert direct["messages"] == [demo["messages"][0], demo["messages"][-1]]
        assert "tool_calls" not in direct["messages"][-1]


def test_a_demonstration_begins_as_the_environments_episode_of_its_problem() -> None:
    config = load_config(
        ["smollm2-cpu", "sft", "calculator"],
        overrides=["data.path=builtin:calculator-demos", "data.val_path=null",
                   "sft.tools=environment"],
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct"))
    source = SupervisedSource(config, tokenizer=tokenizer)
    fmt = TOOL_FORMATS[source.renderer.format.name]
    env = CalculatorEnv(EnvContext(reward=math_reward, reward_fn="math", tool_format=fmt))
    chat = ChatRenderer(tokenizer)
    problems = [r for r in builtin_rows("calculator") if r["extra_info"]["operations"] == 1]
    for index in (0, 1, 2, 500):
        conversation = source.train.rendered[index]
        row = problems[index]
        reset = env.reset(Task(row["prompt"], row["reward_model"]["ground_truth"]))
        episode_start = chat.prompt_ids(reset.messages, env.template_tools())
        ids = conversation.token_ids.tolist()
        assert ids[: conversation.prompt_length] == episode_start
        # What the model is taught to write first is a call the environment runs.
        first_turn = tokenizer.decode(ids[conversation.prompt_length :]).split("<|im_end|>")[0]
        step = env.step(Task(row["prompt"], ""), None, first_turn)
        assert (step.tool_calls, step.tool_errors, step.done) == (1, 0, False)
        assert step.messages[0]["content"].split("\n")[1] == row["reward_model"]["ground_truth"]
