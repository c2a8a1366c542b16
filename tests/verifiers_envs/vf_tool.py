"""A tool verifiers environment, written as verifiers' `ToolEnv` section shows: a python
function is the tool (its name, type hints and docstring describe it), the model may call it
until it answers without a call."""

import verifiers as vf
from datasets import Dataset


async def add(a: int, b: int) -> str:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return str(a + b)


async def correct_answer(completion, answer) -> float:
    return 1.0 if answer in str(completion[-1]["content"]) else 0.0


def load_environment():
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": "What is 2+3? Use the add tool."}], "answer": "5"}]
    )
    rubric = vf.Rubric(funcs=[correct_answer])
    return vf.ToolEnv(dataset=dataset, tools=[add], rubric=rubric, max_turns=4)
