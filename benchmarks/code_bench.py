"""The code reward's costs and the bundled code problems' calibration.

    .venv/bin/python -m benchmarks.code_bench box [--tests 1,10,50] [--repeats 5]
    .venv/bin/python -m benchmarks.code_bench rewards [--seconds 30] [--workers 1]
    .venv/bin/python -m benchmarks.code_bench pass-rate [--preset smollm2-cpu] [--k 4]
    .venv/bin/python -m benchmarks.code_bench against REF [--seconds 30] [--rounds 3]

`box`: what one program costs, side by side — a bare interpreter start (`python -c pass`
outside any box), one box per test (a fresh box runs the program on each test's input), and
the harness (one box, every test in a forked process of its own: what the `code` reward runs).
Median wall seconds per program over `--repeats`, for each number of tests.

`rewards`: rewards per second one reward worker sustains, `RewardScorer` with the `code`
reward on a mix of right and wrong programs for the bundled problems (the program text the
scorer gets; each call runs its tests in the box).

`against`: `rewards` of this tree and of the commit REF (a git worktree of it, run by its own
code_bench), taking turns `--rounds` times (each round in the other order), side by side: what a
change to the reward path costs in throughput (the hardening of issue 58: `against 4625e75`).

`pass-rate`: the base model's pass@1 and pass@k on `builtin:code` and `builtin:code-test` by
level (1, 2, 3): k samples per problem at the preset's temperature and length, each scored by
the `code` reward — the calibration the bundled set is cut to (the easy end between 0.1 and
0.5 at the start).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from streamrl.isolation.box import BoxLimits, run_in_box
from streamrl.rewards.code.cases import StdioTest
from streamrl.rewards.code.config import CodeRewardConfig
from streamrl.rewards.code.runner import LANGUAGES, TestLimits, run_tests

ADD = "a, b = map(int, input().split())\nprint(a + b)\n"


def bench_box(counts: list[int], repeats: int) -> None:
    """Per-program wall seconds: bare interpreter, one box per test, the harness."""
    print("| tests | bare interpreter start | one box per test | harness (one box) | "
          "per test: box / harness |")  # fmt: skip
    print("|---|---|---|---|---|")
    limits = BoxLimits(wall_s=10.0, memory_mb=512)
    for count in counts:
        tests = [StdioTest(f"{i} {i + 1}\n", f"{2 * i + 1}\n") for i in range(count)]
        bare, one_shot, harness = [], [], []
        for _ in range(repeats):
            started = time.perf_counter()
            for test in tests:
                subprocess.run([sys.executable, "-c", ADD], input=test.stdin.encode(), check=True,
                               capture_output=True)  # fmt: skip
            bare.append(time.perf_counter() - started)
            started = time.perf_counter()
            for test in tests:
                program = {"main.py": ADD.encode()}
                result = run_in_box(["python", "/box/main.py"], limits=limits, files=program,
                                    stdin=test.stdin.encode())  # fmt: skip
                assert result.stdout.decode().strip() == test.stdout.strip()
            one_shot.append(time.perf_counter() - started)
            started = time.perf_counter()
            report = run_tests(ADD, tests, LANGUAGES["python"], TestLimits())
            harness.append(time.perf_counter() - started)
            assert report.all_passed, report
        b, o, h = map(statistics.median, (bare, one_shot, harness))
        print(f"| {count} | {b:.3f} s | {o:.3f} s | {h:.3f} s | {o / h:.1f}× |")


def bench_rewards(seconds: float, workers: int) -> None:
    """Rewards per second of `workers` reward workers on the bundled problems."""
    from streamrl.data.builtin import builtin_rows
    from streamrl.rewards.registry import RewardSpec
    from streamrl.rewards.scoring import RewardScorer

    rows = builtin_rows("code")
    truths = [row["reward_model"]["ground_truth"] for row in rows]
    # A right answer for the add_k problems, a wrong one for every other: what a policy writes.
    responses = []
    for row in rows:
        info = row["extra_info"]
        body = f"    return x + {info['k']}" if info["template"] == "add_k" else "    return 0"
        name = row["prompt"][0]["content"].split("`")[1].split("(")[0]
        responses.append(f"```python\ndef {name}(*args):\n{body}\n```")
    spec = RewardSpec("code", CodeRewardConfig(), timeout_s=60.0)
    calls, started = 0, time.perf_counter()
    with RewardScorer(spec, workers=workers, timeout_s=60.0) as scorer:
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            scores = scorer.score(responses[:64], truths[:64])
            calls += len(scores.values)
            assert scores.errors == 0, scorer.stats
        elapsed = time.perf_counter() - started
    print(f"{workers} reward worker(s): {calls} code rewards in {elapsed:.1f}s = "
          f"{calls / elapsed:.1f} rewards/s")  # fmt: skip


def bench_against(ref: str, seconds: float, workers: int, rounds: int) -> None:
    """`rewards` here and at `ref`, taking turns: rewards/s of each round, medians, ratio."""
    here = Path(__file__).resolve().parents[1]
    rates: dict[str, list[float]] = {ref: [], "this tree": []}
    with tempfile.TemporaryDirectory() as scratch:
        there = Path(scratch) / "tree"
        git = ["git", "-C", str(here)]
        subprocess.run([*git, "worktree", "add", "--detach", str(there), ref], check=True,
                       capture_output=True)  # fmt: skip
        try:
            trees = [(ref, there), ("this tree", here)]
            for round_ in range(rounds):
                for name, tree in trees if round_ % 2 == 0 else trees[::-1]:
                    rates[name].append(_rewards_per_second(tree, seconds, workers))
                    print(f"round {round_ + 1}: {name}: {rates[name][-1]:.1f} rewards/s",
                          flush=True)  # fmt: skip
        finally:
            subprocess.run([*git, "worktree", "remove", "--force", str(there)], check=False)
    before, after = statistics.median(rates[ref]), statistics.median(rates["this tree"])
    print(f"\n| code rewards / s ({workers} worker(s), {rounds} rounds of {seconds:g}s) | median |")
    print("|---|---|")
    print(f"| {ref} | {before:.1f} |")
    print(f"| this tree | {after:.1f} |")
    print(f"| this tree / {ref} | {after / before:.3f}× |")


def _rewards_per_second(tree: Path, seconds: float, workers: int) -> float:
    """`code_bench rewards` run by the code of `tree` (its streamrl first on the path)."""
    command = [sys.executable, "-m", "benchmarks.code_bench", "rewards",
               "--seconds", str(seconds), "--workers", str(workers)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(tree)}
    check = [sys.executable, "-c", "import streamrl; print(streamrl.__file__)"]
    loaded = subprocess.run(check, cwd=tree, env=env, capture_output=True, text=True, check=True)
    assert loaded.stdout.strip().startswith(str(tree)), f"{tree} did not load its own streamrl"
    done = subprocess.run(command, cwd=tree, env=env, capture_output=True, text=True, check=True)
    found = re.search(r"= ([0-9.]+) rewards/s", done.stdout)
    assert found, done.stdout + done.stderr
    return float(found.group(1))


def bench_pass_rate(preset: list[str], k: int, max_tokens: int | None) -> None:
    """The base model's pass@1 / pass@k on the bundled code problems, by level."""
    from streamrl.config.loading import load_config
    from streamrl.data import PromptSource
    from streamrl.generator.engine import Engine
    from streamrl.models import resolve_model_path
    from streamrl.rewards.code.reward import CodeReward

    overrides = [f"generator.group_size={k}", "generator.reward.fn=code"]
    if max_tokens:
        overrides.append(f"generator.max_tokens={max_tokens}")
    config = load_config(["dapo", *preset, "code"], overrides=overrides)
    engine = Engine(resolve_model_path(config.model.path), config.model, config.generator, seed=0)
    reward = CodeReward(config.generator.reward.code, call_limit_s=60.0)
    print(f"model {config.model.path}, k={k}, T={config.generator.temperature}, "
          f"max_tokens={config.generator.max_tokens}")  # fmt: skip
    for split in ("builtin:code", "builtin:code-test"):
        data = config.data.model_copy(update={"path": split})
        source = PromptSource(data, tokenizer=engine.tokenizer)
        from streamrl.data.builtin import builtin_rows

        levels = [row["extra_info"]["level"] for row in builtin_rows(split.split(":")[1])]
        started = time.perf_counter()
        groups = engine.generate([p.token_ids for p in source.prompts])
        generated = time.perf_counter() - started
        passed: dict[int, list[list[bool]]] = defaultdict(list)
        lengths = []
        for prompt, group, level in zip(source.prompts, groups, levels, strict=True):
            scores = [reward(c.text, prompt.ground_truth) >= 1.0 for c in group.completions]
            passed[level].append(scores)
            lengths += [len(c.token_ids) for c in group.completions]
        print(f"\n{split}: {len(source.prompts)} problems, generated in {generated:.0f}s, "
              f"mean response {statistics.mean(lengths):.0f} tokens")  # fmt: skip
        print(f"| level | problems | pass@1 | pass@{k} |")
        print("|---|---|---|---|")
        every = [s for level in sorted(passed) for s in passed[level]]
        for level, scores in [*sorted(passed.items()), ("all", every)]:
            at_1 = statistics.mean(statistics.mean(s) for s in scores)
            at_k = statistics.mean(any(s) for s in scores)
            print(f"| {level} | {len(scores)} | {at_1:.3f} | {at_k:.3f} |")
        example = next(c.text for g in groups for c in g.completions)
        print("one response:", json.dumps(example[:400]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    box = commands.add_parser("box")
    box.add_argument("--tests", default="1,10,50")
    box.add_argument("--repeats", type=int, default=5)
    rewards = commands.add_parser("rewards")
    rewards.add_argument("--seconds", type=float, default=30.0)
    rewards.add_argument("--workers", type=int, default=1)
    against = commands.add_parser("against")
    against.add_argument("ref")
    against.add_argument("--seconds", type=float, default=30.0)
    against.add_argument("--workers", type=int, default=1)
    against.add_argument("--rounds", type=int, default=3)
    rate = commands.add_parser("pass-rate")
    rate.add_argument("--preset", action="append", default=None)
    rate.add_argument("--k", type=int, default=4)
    rate.add_argument("--max-tokens", type=int, default=None)
    args = parser.parse_args()
    if args.command == "box":
        bench_box([int(n) for n in args.tests.split(",")], args.repeats)
    elif args.command == "rewards":
        bench_rewards(args.seconds, args.workers)
    elif args.command == "against":
        bench_against(args.ref, args.seconds, args.workers, args.rounds)
    else:
        bench_pass_rate(args.preset or ["smollm2-cpu"], args.k, args.max_tokens)


if __name__ == "__main__":
    main()
