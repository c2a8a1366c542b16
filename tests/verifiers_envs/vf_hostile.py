"""verifiers environments that misbehave, for streamrl's tests: a reward that is NaN, a
rollout that raises, one that prints into its stdout, and one whose load fails."""

import sys

import verifiers as vf
from datasets import Dataset

DATASET = [{"prompt": [{"role": "user", "content": "Say something."}], "answer": ""}]


class RaisingEnv(vf.SingleTurnEnv):
    async def setup_state(self, state: vf.State) -> vf.State:
        raise RuntimeError("the environment broke")


class PrintingEnv(vf.SingleTurnEnv):
    async def setup_state(self, state: vf.State) -> vf.State:
        print("not a protocol line", flush=True)
        sys.stdout.write("{}\n")
        return state


async def not_a_number(completion) -> float:
    return float("nan")


async def one(completion) -> float:
    return 1.0


def load_environment(mode: str = "nan"):
    dataset = Dataset.from_list(DATASET)
    if mode == "nan":
        return vf.SingleTurnEnv(dataset=dataset, rubric=vf.Rubric(funcs=[not_a_number]))
    if mode == "raise":
        return RaisingEnv(dataset=dataset, rubric=vf.Rubric(funcs=[one]))
    if mode == "print":
        return PrintingEnv(dataset=dataset, rubric=vf.Rubric(funcs=[one]))
    if mode == "out_of_range":
        return vf.SingleTurnEnv(dataset=dataset, rubric=vf.Rubric(funcs=[one], weights=[5.0]))
    raise ValueError(f"no mode {mode!r}")
