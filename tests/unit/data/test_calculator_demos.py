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


def _facts(rows):
    return {(r["extra_info"]["op"], r["extra_info"]["a"], r["extra_info"]["b"]) for r in rows}


def test_the_held_out_problems_are_never_trained_on_and_the_demonstrations_are_right() -> None:
    train, test = builtin_rows("calculator"), builtin_rows("calculator-test")
    assert (len(train), len(test)) == (2000, 256)
    assert not _facts(train) & _facts(test)
    assert {r["extra_info"]["op"] for r in test} == {"*", "+", "-"}
    for demo in builtin_rows("calculator-demos")[:200] + builtin_rows("calculator-demos-test"):
        _, call, result, answer = demo["messages"]
        expression = call["tool_calls"][0]["function"]["arguments"]["expression"]
        assert result["content"] == calculate(expression)
        info = demo["extra_info"]
        truth = {"*": info["a"] * info["b"], "+": info["a"] + info["b"],
                 "-": info["a"] - info["b"]}[info["op"]]  # fmt: skip
        assert math_reward(answer["content"], str(truth)) == 1.0


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
    problems = builtin_rows("calculator")
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
