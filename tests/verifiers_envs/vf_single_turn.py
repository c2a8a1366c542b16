"""A single-turn verifiers environment, written as verifiers' "Your First Environment" shows:
a local dataset, a reward function and a metric (weight 0), scored by the rubric."""

import verifiers as vf
from datasets import Dataset


def load_environment(reward_weight: float = 1.0):
    dataset = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": "What is 2+2?"}], "answer": "4"},
            {"prompt": [{"role": "user", "content": "What is 3*5?"}], "answer": "15"},
        ]
    )

    async def correct_answer(completion, answer) -> float:
        response = completion[-1]["content"]
        return 1.0 if answer in response else 0.0

    async def response_chars(completion) -> float:
        return float(len(completion[-1]["content"] or ""))

    rubric = vf.Rubric(funcs=[correct_answer, response_chars], weights=[reward_weight, 0.0])
    return vf.SingleTurnEnv(dataset=dataset, eval_dataset=dataset, rubric=rubric)
