"""verifiers environments against the same tasks through streamrl's own paths: the overhead of
running a verifiers environment unchanged (issue #60's goal: sampled tokens/s ≥ 0.9× the
native path, single-turn and multi-turn).

    .venv/bin/python -m benchmarks.verifiers_bench [--preset smollm2-cpu] [--groups 16] \
        [--rounds 2] [--pair single-turn --pair multi-turn] [--worker-env DIR]

One engine, four episode drivers on it, the same prompts (the first `--groups` of the preset's
dataset, `builtin:arithmetic`) and sampling (G, max_tokens, at most `prompts_in_flight` groups
at a time) for each:

- single-turn, native: the default single-turn path, scored by the `math` reward in the reward
  workers; verifiers: `tests/verifiers_envs/vf_single_turn.py` (a `SingleTurnEnv` whose rubric
  checks the answer), its rollouts through the generator's endpoint.
- multi-turn, native: the `guess` environment (`generator.env.fn=guess`: higher / lower hints,
  at most 4 guesses) in the environment workers; verifiers: its twin
  `tests/verifiers_envs/vf_guess.py` (a `MultiTurnEnv` giving the same hints in the same words,
  stopping on a right answer), its rollouts through the endpoint.

A verifiers arm has a worker per group in flight (`generator.env.workers`), as the native
multi-turn arm has. The arms take turns (every other round in reverse order, so a drift of the
machine's speed cancels). Reported per arm: sampled tokens (loss mask 1) per wall-clock second
from the first start to the last group scored (`benchmarks.agent_bench`'s measure), model turns
per episode (the same task, so about the same shape of episode) and how the episodes finished;
per pair, verifiers' tokens/s over the native path's.

Needs the verifiers worker environment with the tests' environments on its path, by default
`.cache/worker-envs/verifiers-<version>` in the repository, which the verifiers unit tests'
session fixture makes (`pytest tests/unit/envs/test_verifiers_env.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from pathlib import Path

from benchmarks.agent_bench import Measured, _run
from streamrl.config.loading import load_config
from streamrl.data import PromptSource
from streamrl.envs.registry import EnvResolutionError
from streamrl.envs.runner import EnvRunner
from streamrl.envs.verifiers_config import DEFAULT_VERIFIERS_VERSION
from streamrl.envs.verifiers_env import check_verifiers_env
from streamrl.generator.engine import Engine
from streamrl.generator.rollouts import EpisodeDriver
from streamrl.models import resolve_model_path

REPO = Path(__file__).parents[1]
COMMON = ["model.max_model_len=1024", "generator.prompts_in_flight=4"]
PAIRS = {  # the task → the native path's overrides, the verifiers environment's id
    "single-turn": ([], "vf_single_turn"),
    "multi-turn": (["generator.env.fn=guess"], "vf_guess"),
}
PATHS = ("native", "verifiers")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--preset", action="append", help="presets after grpo (smollm2-cpu)")
    parser.add_argument("--groups", type=int, default=16, help="prompts each run samples")
    parser.add_argument("--rounds", type=int, default=2, help="runs per arm, taking turns")
    parser.add_argument("--pair", action="append", choices=list(PAIRS), help="default: both")
    parser.add_argument(
        "--worker-env",
        default=str(REPO / ".cache" / "worker-envs" / f"verifiers-{DEFAULT_VERIFIERS_VERSION}"),
        help="the verifiers worker environment (with tests/verifiers_envs on its path)",
    )
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    presets = ["grpo", *(args.preset or ["smollm2-cpu"])]
    base = load_config(presets, overrides=[*COMMON, *args.set])
    cfg = base.generator
    workers = f"generator.env.workers={cfg.prompts_in_flight}"  # a worker per group in flight
    arms = [f"{pair} {path}" for pair in args.pair or list(PAIRS) for path in PATHS]
    configs = {}
    for arm in arms:
        pair, path = arm.split()
        native, env_id = PAIRS[pair]
        extra = native if path == "native" else [
            f"generator.env.verifiers.env_id={env_id}",
            f"generator.env.verifiers.worker_env={args.worker_env}",
        ]  # fmt: skip
        configs[arm] = load_config(presets, overrides=[*COMMON, *extra, workers, *args.set])
    for config in configs.values():
        if config.generator.env.verifiers is not None:
            _check(config.generator.env.verifiers)
    model_path = resolve_model_path(base.model.path)
    engine = Engine(model_path, base.model, cfg, seed=0)
    source = PromptSource(base.data, tokenizer=engine.tokenizer)
    prompts = source.prompts[: args.groups]
    print(
        f"model {base.model.path} ({base.model.dtype}), G={cfg.group_size}, "
        f"max_tokens={cfg.max_tokens}, {cfg.prompts_in_flight} groups in flight, "
        f"{len(prompts)} groups per run, {args.rounds} rounds"
    )
    template = getattr(engine.tokenizer, "chat_template", None)
    results: list[Measured] = []
    with contextlib.ExitStack() as stack:
        stack.callback(engine.close)
        runners = {
            arm: EnvRunner.from_config(c.generator.env, c.generator.reward, template)
            for arm, c in configs.items()
        }
        for runner in runners.values():
            stack.enter_context(runner)
        drivers = {arm: EpisodeDriver(c, engine, runners[arm]) for arm, c in configs.items()}
        for driver in drivers.values():
            stack.callback(driver.close)
        for arm in arms:  # warm up: the workers' first calls, the endpoint's first requests
            _run(engine, drivers[arm], prompts[:2], arm, cfg.prompts_in_flight)
        for round_ in range(args.rounds):
            for arm in arms if round_ % 2 == 0 else list(reversed(arms)):
                measured = _run(engine, drivers[arm], prompts, arm, cfg.prompts_in_flight)
                results.append(measured)
                print(
                    f"  round {round_ + 1} {arm:<22} {measured.tokens_per_s:7.1f} tokens/s "
                    f"({measured.sampled_tokens} tokens in {measured.seconds:.1f}s; "
                    f"{measured.turns / measured.episodes:.2f} turns per episode)"
                )
        finished = {arm: dict(runner.stats.finished) for arm, runner in runners.items()}
    _report(results, finished)


def _check(config) -> None:
    """Refuse a worker environment that cannot run the tests' environments, before vLLM
    starts, saying how to make one that can."""
    try:
        check_verifiers_env(config)
    except EnvResolutionError as error:
        raise SystemExit(
            f"{error}\n(the tests' environments are put on its path by the verifiers unit "
            "tests' session fixture: `.venv/bin/python -m pytest "
            "tests/unit/envs/test_verifiers_env.py -x -q` makes it at the default --worker-env)"
        ) from None


def _report(results: list[Measured], finished: dict[str, dict[str, int]]) -> None:
    print()
    print("| arm | sampled tokens/s (mean of rounds) | rounds | turns / episode | finished |")
    print("|---|---|---|---|---|")
    rates = {}
    for arm in finished:
        runs = [m for m in results if m.arm == arm]
        rates[arm] = statistics.mean(m.tokens_per_s for m in runs)
        shown = " / ".join(f"{m.tokens_per_s:.1f}" for m in runs)
        turns = sum(m.turns for m in runs) / sum(m.episodes for m in runs)
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(finished[arm].items()))
        print(f"| {arm} | {rates[arm]:.1f} | {shown} | {turns:.2f} | {reasons} |")
    print()
    for pair in PAIRS:
        if f"{pair} native" in rates:
            ratio = rates[f"{pair} verifiers"] / rates[f"{pair} native"]
            print(f"{pair}: verifiers / native {ratio:.3f}× (goal ≥ 0.9×)")


if __name__ == "__main__":
    main()
