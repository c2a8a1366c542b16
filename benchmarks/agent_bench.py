"""Agent episodes through the endpoint against the same episodes through an environment: the
overhead of bringing your own agent (issue #48's goal: sampling tokens/s ≥ 0.9× the
in-process environment path).

    .venv/bin/python -m benchmarks.agent_bench [--preset smollm2-cpu] [--groups 32] [--rounds 2]

One engine, two episode drivers on it: the calculator environment (`generator.env.fn =
calculator`: `CalculatorEnv` in the environment workers) and the calculator task as an agent on
the OpenAI client (`generator.env.agent = streamrl.envs.calculator_agent:solve`: the same
episodes, driven through the generator's chat-completions endpoint by agents in the workers).
Each run samples and scores the same first `--groups` prompts (G samples each, the run's
sampling, at most `prompts_in_flight` groups at a time); the arms take turns (every other round
in reverse order, so a drift of the machine's speed cancels). Reported per run: sampled tokens
(loss-mask 1) per wall-clock second from the first start to the last group scored, model turns
and tool calls per episode (the same task, so about the same shape of episode), and the agent's
tokens/s over the environment's.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

from streamrl.config.loading import load_config
from streamrl.data import Prompt, PromptSource
from streamrl.envs.runner import EnvRunner
from streamrl.generator.engine import Engine
from streamrl.generator.rollouts import EpisodeDriver
from streamrl.models import resolve_model_path

CALCULATOR = [
    "model.max_model_len=1024",
    "generator.max_tokens=96",
    "generator.env.max_turns=3",
    "generator.prompts_in_flight=4",
]
ARMS = {
    "environment": ["generator.env.fn=calculator"],
    "agent": ["generator.env.agent=streamrl.envs.calculator_agent:solve"],
}


@dataclass
class Measured:
    arm: str
    seconds: float
    sampled_tokens: int
    episodes: int
    turns: int
    tool_calls: int

    @property
    def tokens_per_s(self) -> float:
        return self.sampled_tokens / self.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", action="append", help="presets after grpo (smollm2-cpu)")
    parser.add_argument("--groups", type=int, default=32, help="prompts each run samples")
    parser.add_argument("--rounds", type=int, default=2, help="runs per arm, taking turns")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    presets = ["grpo", *(args.preset or ["smollm2-cpu"])]
    configs = {
        arm: load_config(presets, overrides=[*CALCULATOR, *extra, *args.set])
        for arm, extra in ARMS.items()
    }
    agent_config = configs["agent"]
    cfg = agent_config.generator
    workers = f"generator.env.workers={cfg.prompts_in_flight}"  # a worker per group in flight
    configs = {
        arm: load_config(presets, overrides=[*CALCULATOR, *extra, *args.set, workers])
        for arm, extra in ARMS.items()
    }
    model_path = resolve_model_path(agent_config.model.path)
    engine = Engine(model_path, agent_config.model, cfg, seed=0)
    source = PromptSource(agent_config.data, tokenizer=engine.tokenizer)
    prompts = source.prompts[: args.groups]
    print(
        f"model {agent_config.model.path} ({agent_config.model.dtype}), G={cfg.group_size}, "
        f"max_tokens={cfg.max_tokens}, max_turns=3, {cfg.prompts_in_flight} groups in flight, "
        f"{len(prompts)} groups per run, {args.rounds} rounds"
    )
    template = getattr(engine.tokenizer, "chat_template", None)
    results: list[Measured] = []
    runners = {
        arm: EnvRunner.from_config(c.generator.env, c.generator.reward, template)
        for arm, c in configs.items()
    }
    for runner in runners.values():
        runner.__enter__()
    try:
        drivers = {arm: EpisodeDriver(c, engine, runners[arm]) for arm, c in configs.items()}
        _run(engine, drivers["agent"], prompts[:2], "agent", cfg.prompts_in_flight)  # warm up
        _run(engine, drivers["environment"], prompts[:2], "environment", cfg.prompts_in_flight)
        for round_ in range(args.rounds):
            order = list(ARMS) if round_ % 2 == 0 else list(reversed(ARMS))
            for arm in order:
                measured = _run(engine, drivers[arm], prompts, arm, cfg.prompts_in_flight)
                results.append(measured)
                print(
                    f"  round {round_ + 1} {arm:<12} {measured.tokens_per_s:7.1f} tokens/s "
                    f"({measured.sampled_tokens} tokens in {measured.seconds:.1f}s; "
                    f"{measured.turns / measured.episodes:.2f} turns, "
                    f"{measured.tool_calls / measured.episodes:.2f} tool calls per episode)"
                )
        for driver in drivers.values():
            driver.close()
    finally:
        for runner in runners.values():
            runner.close()
        engine.close()
    _report(results)


def _run(engine: Engine, driver: EpisodeDriver, prompts: list[Prompt], arm: str, in_flight: int):
    started = time.perf_counter()
    waiting = list(prompts)
    done = []
    while len(done) + len(driver.dropped) < len(prompts):
        while waiting and driver.groups_in_flight < in_flight:
            prompt = waiting.pop(0)
            driver.start(prompt, f"{arm}:{prompt.prompt_id}:{started}")
        finished = engine.step() if engine.num_in_flight else []
        if not finished and not engine.num_in_flight:
            time.sleep(0.001)  # the environment, the agents or the reward is answering
        done += driver.advance(finished)
    seconds = time.perf_counter() - started
    driver.dropped.clear()
    episodes = [e for r in done for e in r.episodes]
    return Measured(
        arm,
        seconds,
        sum(sum(r.sampled_lengths()) for r in done),
        len(episodes),
        sum(max(e.turns, 1) for e in episodes),
        sum(e.tool_calls for e in episodes),
    )


def _report(results: list[Measured]) -> None:
    def rate(arm: str) -> float:
        return statistics.mean(m.tokens_per_s for m in results if m.arm == arm)

    env, agent = rate("environment"), rate("agent")
    print()
    print("| path | sampled tokens/s (mean of rounds) | turns / episode | tool calls / episode |")
    print("|---|---|---|---|")
    for arm, value in (("environment", env), ("agent", agent)):
        runs = [m for m in results if m.arm == arm]
        episodes = sum(m.episodes for m in runs)
        turns = sum(m.turns for m in runs) / episodes
        calls = sum(m.tool_calls for m in runs) / episodes
        print(f"| {arm} | {value:.1f} | {turns:.2f} | {calls:.2f} |")
    print(f"\nagent / environment: {agent / env:.3f}× (goal ≥ 0.9×)")


if __name__ == "__main__":
    main()
