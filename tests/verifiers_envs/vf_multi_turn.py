"""A multi-turn verifiers environment, written as verifiers' `MultiTurnEnv` section shows: the
environment answers each model turn ("go on") until three turns were taken or the model says
"done" (a `@vf.stop` condition); the reward counts the turns."""

import verifiers as vf
from datasets import Dataset


class GoOnEnv(vf.MultiTurnEnv):
    async def env_response(self, messages: vf.Messages, state: vf.State) -> vf.Messages:
        return [{"role": "user", "content": "go on"}]

    @vf.stop
    async def said_done(self, state: vf.State) -> bool:
        trajectory = state.get("trajectory") or []
        if not trajectory:
            return False
        completion = trajectory[-1]["completion"]
        return "done" in str(completion[-1]["content"] if completion else "")


async def turns_taken(completion) -> float:
    return sum(1.0 for message in completion if message["role"] == "assistant") / 3


def load_environment(max_turns: int = 3):
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": "Count with me."}], "answer": ""}]
    )
    rubric = vf.Rubric(funcs=[turns_taken])
    return GoOnEnv(dataset=dataset, rubric=rubric, max_turns=max_turns)
