"""Generator throughput: the streaming loop (vLLM + scoring + stream writing) against plain
vLLM `generate` on the same engine, prompts and sampling settings, plus the time of a live
weight update from the weight store.

    .venv/bin/python -m benchmarks.generator_bench [--preset smollm2-cpu ...] [--seconds 60]
    .venv/bin/python -m benchmarks.generator_bench --preset smollm2-cpu --preset code \
        --reward code --reward math --rounds 2 --groups 48

    taskset -c 1 .venv/bin/python -m benchmarks.generator_bench --preset smollm2-cpu \
        --teacher smollm2-135m-instruct --teacher-cores 0 --rounds 2 --groups 48

`--preset` may be given several times (a size preset, then a task preset such as `code`).
`--teacher MODEL` compares the loop without and with a teacher (on-policy distillation: every
finished group's token histories scored by the teacher, served by `streamrl scorer` on
`--teacher-cores`, its own), in turns as `--reward` does, and then measures the teacher's own
scoring throughput: the last run's groups sent to it all at once, their tokens per second.
`--reward` (repeatable) runs the loop once per reward and round, the rewards taking turns (every
other round in reverse order, so a drift of the machine's speed cancels) on
the same engine, prompts and sampling settings, so what differs is only the scoring:
each run samples and scores the same first `--groups` prompts, and the table gives each
reward's tokens/s (their response tokens over the time until the last of them is scored)
and its ratio to the first.

Raw: `LLM.generate` of a batch of prompts (n = G) at a time, back to back for `--seconds`.
Loop: `GeneratorLoop` for the same time with as many prompts in flight as the raw batch,
scoring every response with the configured reward in worker processes and committing segments
to a local run. Both count the response tokens of *finished* groups per wall-clock second.
"""

from __future__ import annotations

import argparse
import itertools
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch

from storage.control.endpoints import read_endpoint
from storage.fs import open_location
from storage.stream.writer import StreamReader, StreamWriter
from storage.weights.publish import WeightWriter
from streamrl.config.loading import load_config
from streamrl.config.run import RunConfig
from streamrl.config.stored import prepare_run
from streamrl.data import PromptSource
from streamrl.envs.runner import EnvRunner
from streamrl.generator.engine import Engine, WeightSource
from streamrl.generator.loop import GeneratorLoop
from streamrl.generator.records import GeneratorStats
from streamrl.models import resolve_model_path
from streamrl.scorers.client import ScorerClient
from streamrl.scorers.teacher import Teacher


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--preset", action="append", help="presets after dapo (default: smollm2-cpu); repeatable"
    )
    parser.add_argument("--seconds", type=float, default=60.0, help="length of each measurement")
    parser.add_argument(
        "--reward", action="append", help="compare the loop scoring with these rewards (repeatable)"
    )
    parser.add_argument("--rounds", type=int, default=2, help="runs per reward, taking turns")
    parser.add_argument(
        "--groups", type=int, default=48, help="groups each run of --reward samples and scores"
    )
    parser.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="config override"
    )
    parser.add_argument("--teacher", metavar="MODEL", help="compare without and with a teacher")
    parser.add_argument(
        "--teacher-cores", default="0", help="the teacher server's cores (taskset list)"
    )
    args = parser.parse_args()

    # No learner consumes here: flow control would pause generation at the staleness budget.
    presets = args.preset or ["smollm2-cpu"]
    config = load_config(["dapo", *presets], overrides=["generator.flow_control=off", *args.set])
    cfg = config.generator
    model_path = resolve_model_path(config.model.path)
    engine = Engine(model_path, config.model, cfg, seed=0)
    source = PromptSource(config.data, tokenizer=engine.tokenizer)
    batch = cfg.prompts_in_flight
    print(
        f"model {config.model.path} ({config.model.dtype}), G={cfg.group_size}, "
        f"max_tokens={cfg.max_tokens}, {batch} prompts in flight, {args.seconds:.0f}s each"
    )

    # Warm-up: the first requests pay one-off costs (allocation, kernels).
    engine.generate([p.token_ids for p in source.prompts[:2]])

    if args.reward:
        _compare_rewards(config, engine, source, args.reward, args.rounds, args.groups)
        return
    if args.teacher:
        _compare_teacher(config, engine, source, args)
        return

    from vllm.inputs import TokensPrompt

    params = engine.sampling_params()
    prompts = itertools.cycle(source.prompts)
    raw_tokens, raw_groups, start = 0, 0, time.perf_counter()
    while time.perf_counter() - start < args.seconds:
        chunk = [TokensPrompt(prompt_token_ids=next(prompts).token_ids) for _ in range(batch)]
        for output in engine.llm.generate(chunk, params, use_tqdm=False):
            raw_tokens += sum(len(c.token_ids) for c in output.outputs)
            raw_groups += 1
    raw_s = time.perf_counter() - start

    with tempfile.TemporaryDirectory() as tmp:
        run = open_location(tmp)
        loop = _run_loop(config, engine, source, run, args.seconds)
        steady_tokens, steady_s, steady_groups = loop.steady_tokens, loop.steady_s, loop.groups - 1
        stats, loop_s = loop.stats, loop.seconds

        # Live weight update: publish the engine's model as version 1 and load it in place,
        # then version 2 as a delta (1% of the elements changed) onto the version held.
        from transformers import AutoModelForCausalLM

        dtype = getattr(torch, config.weights.resolved_dtype(config.model))
        state = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).state_dict()
        store, weights = WeightWriter(run), WeightSource.of(run, config.weights)
        publish_start = time.perf_counter()
        store.publish(1, state)
        publish_s = time.perf_counter() - publish_start
        update_s = engine.advance_weights(weights, exactly=1)[1]
        changed = {name: _changed(tensor, 0.01) for name, tensor in state.items()}
        store.publish(2, changed, base=(1, state))
        delta_update_s = engine.advance_weights(weights, exactly=2)[1]

    raw_rate, loop_rate = raw_tokens / raw_s, stats.tokens / loop_s
    print("\n| measurement | groups | tokens | seconds | tokens/s | groups/s |")
    print("|---|---|---|---|---|---|")
    print(
        f"| plain vLLM generate | {raw_groups} | {raw_tokens} | {raw_s:.1f} | "
        f"{raw_rate:.1f} | {raw_groups / raw_s:.2f} |"
    )
    print(
        f"| generator loop | {stats.groups} | {stats.tokens} | {loop_s:.1f} | "
        f"{loop_rate:.1f} | {stats.groups / loop_s:.2f} |"
    )
    print(
        f"| generator loop, steady state | {steady_groups} | {steady_tokens} | "
        f"{steady_s:.1f} | {steady_tokens / steady_s:.1f} | {steady_groups / steady_s:.2f} |"
    )
    print(
        f"\nloop / raw tokens/s: {loop_rate / raw_rate:.3f} wall clock, "
        f"{steady_tokens / steady_s / raw_rate:.3f} steady state"
    )
    print(
        f"weight update ({sum(t.numel() for t in state.values()) / 1e6:.0f}M parameters): "
        f"publish {publish_s:.2f}s; generator update {update_s:.2f}s, from a 1% delta "
        f"{delta_update_s:.2f}s (workers read + verify + in-place reload + lm_head re-pack + "
        "prefix-cache reset)"
    )
    print(
        f"loop: {stats.segments} segments, "
        f"reward mean {stats.reward_sum / max(stats.responses, 1):.3f}, "
        f"accuracy {stats.correct / max(stats.responses, 1):.3f}"
    )


@dataclass(frozen=True)
class LoopRun:
    stats: GeneratorStats
    seconds: float  # wall clock, start to stop
    groups: int  # finished
    steady_tokens: int  # response tokens of the groups finished after the first
    steady_s: float  # from the first finished group to the last
    first_tokens: int  # response tokens of the first `groups` finished (fixed-work runs)
    first_s: float  # from the start to the last of those finishing

    @property
    def steady_rate(self) -> float:
        return self.steady_tokens / self.steady_s


def _run_loop(
    config: RunConfig,
    engine: Engine,
    source: PromptSource,
    run,
    seconds: float | None = None,
    groups: int | None = None,
    teacher: Teacher | None = None,
) -> LoopRun:
    """`GeneratorLoop` committing to `run`, for `seconds`, or until `groups` groups are
    written. Its steady state: the groups finished after the first one, over the time between
    them (the loop's wall-clock rate also charges it for the groups still in flight at the
    stop)."""
    with EnvRunner.from_config(config.generator.env, config.generator.reward, None) as runner:
        loop = GeneratorLoop(
            config=config,
            run=run,
            engine=engine,
            prompts=source.iterate(),
            runner=runner,
            writer=StreamWriter(run, "gen0"),
            generator_id="gen0",
            teacher=teacher,
        )
        stop = threading.Event()
        if seconds is not None:
            threading.Timer(seconds, stop.set).start()
        if groups is not None:
            threading.Thread(target=_stop_at, args=(loop, groups, stop), daemon=True).start()
        start_unix, start = time.time(), time.perf_counter()
        stats = loop.run(stop)
        loop_s = time.perf_counter() - start
    reader = StreamReader(run).groups(timeout_s=5)
    written = sorted((next(reader) for _ in range(stats.groups)), key=lambda g: g.finished_at)
    reader.close()
    counted = written[: groups or len(written)]
    return LoopRun(
        stats,
        loop_s,
        len(written),
        sum(g.num_tokens for g in written[1:]),
        written[-1].finished_at - written[0].finished_at,
        sum(g.num_tokens for g in counted),
        counted[-1].finished_at - start_unix,
    )


def _stop_at(loop: GeneratorLoop, groups: int, stop: threading.Event) -> None:
    while loop.stats.groups < groups and not stop.is_set():
        time.sleep(0.05)
    stop.set()


def _compare_rewards(
    config: RunConfig,
    engine: Engine,
    source: PromptSource,
    rewards: list[str],
    rounds: int,
    groups: int,
) -> None:
    """The loop scoring with each of `rewards` in turn, `rounds` times, each run sampling the
    same first `groups` prompts; one table. A first run
    of the first reward, not counted, warms the engine and the reward up."""

    def measure(name: str) -> LoopRun:
        reward = config.generator.reward.model_copy(update={"fn": name})
        generator = config.generator.model_copy(update={"reward": reward})
        with tempfile.TemporaryDirectory() as tmp:
            return _run_loop(
                config.model_copy(update={"generator": generator}),
                engine,
                source,
                open_location(tmp),
                groups=groups,
            )

    measure(rewards[0])
    runs: dict[str, list[LoopRun]] = {name: [] for name in rewards}
    for round_ in range(rounds):  # in turn, every other round backwards: a drift cancels
        for name in rewards if round_ % 2 == 0 else rewards[::-1]:
            run = measure(name)
            runs[name].append(run)
            print(
                f"round {round_ + 1}, reward {name}: {run.first_tokens} tokens of {groups} "
                f"groups in {run.first_s:.1f}s = {run.first_tokens / run.first_s:.1f} tokens/s, "
                f"reward mean {run.stats.reward_sum / max(run.stats.responses, 1):.3f}"
            )

    _table(runs, groups, rewards[0])


def _compare_teacher(
    config: RunConfig, engine: Engine, source: PromptSource, args: argparse.Namespace
) -> None:
    """The loop without and with a served teacher, in turns (module docstring); one table, then
    the teacher's scoring throughput."""
    with tempfile.TemporaryDirectory() as tmp:
        taught = load_config(
            ["dapo", *(args.preset or ["smollm2-cpu"])],
            overrides=[
                "generator.flow_control=off", *args.set, f"storage.run_uri={tmp}/teacher-run",
                "algorithm.opd.lambda_rl=1.0", "generator.teacher=teacher",
                f"scorers.teacher.model={args.teacher}", "scorers.teacher.dtype=float32",
            ],
        )  # fmt: skip
        taught, run = prepare_run(taught)
        server = subprocess.Popen(
            ["taskset", "-c", args.teacher_cores, sys.executable, "-m", "streamrl", "scorer",
             "--run", str(run.uri), "--name", "teacher"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            _wait_for_endpoint(run, server)
            with ScorerClient("teacher", taught.scorers["teacher"], run) as client:
                teacher = Teacher(client)
                variants = {"without teacher": None, "with teacher": teacher}

                def measure(name: str) -> LoopRun:
                    with tempfile.TemporaryDirectory() as out:
                        return _run_loop(
                            taught if variants[name] else config, engine, source,
                            open_location(out), groups=args.groups, teacher=variants[name],
                        )  # fmt: skip

                measure("with teacher")  # warms the engine and the teacher up
                runs: dict[str, list[LoopRun]] = {name: [] for name in variants}
                for round_ in range(args.rounds):
                    names = list(variants) if round_ % 2 == 0 else list(variants)[::-1]
                    for name in names:
                        runs[name].append(measure(name))
                        last = runs[name][-1]
                        print(f"round {round_ + 1}, {name}: {last.first_tokens / last.first_s:.1f} "
                              "tokens/s")  # fmt: skip
                _table(runs, args.groups, "without teacher")
                _teacher_throughput(teacher, source, args.groups, taught.generator.group_size)
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(timeout=60)


def _wait_for_endpoint(run, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + 900
    while read_endpoint(run, "scorer-teacher") is None:
        if server.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the teacher's server did not come up (run `streamrl scorer` alone)")
        time.sleep(0.5)


def _table(runs: dict[str, list[LoopRun]], groups: int, baseline: str) -> None:
    def rate(done: list[LoopRun]) -> float:
        return sum(r.first_tokens for r in done) / sum(r.first_s for r in done)

    first = rate(runs[baseline])
    print(f"\n| run | groups | tokens | seconds | tokens/s | per round | ratio to {baseline} |")
    print("|---|---|---|---|---|---|---|")
    for name, done in runs.items():
        per_round = ", ".join(f"{r.first_tokens / r.first_s:.1f}" for r in done)
        print(
            f"| {name} | {groups * len(done)} | {sum(r.first_tokens for r in done)} | "
            f"{sum(r.first_s for r in done):.1f} | {rate(done):.1f} | {per_round} | "
            f"{rate(done) / first:.3f} |"
        )


def _teacher_throughput(teacher: Teacher, source: PromptSource, groups: int, size: int) -> None:
    """Groups of `size` copies of prompt + a 64-token continuation (the prompt's own tokens
    again, so every id is in the vocabulary), all sent at once: the tokens the teacher scores
    per second (prefill), and each group's latency."""
    prompts = source.prompts[:groups]
    responses = [[np.resize(np.asarray(p.token_ids, np.int32), 64)] * size for p in prompts]
    masks = [[np.ones(64, np.uint8)] * size for _ in prompts]
    started = time.perf_counter()
    futures = [
        teacher.score(p.token_ids, r, m) for p, r, m in zip(prompts, responses, masks, strict=True)
    ]
    latencies = [f.result().seconds for f in futures]
    elapsed = time.perf_counter() - started
    tokens = sum((len(p.token_ids) + 64) * size for p in prompts)
    print(
        f"\nteacher scoring throughput: {groups} groups × {size} sequences, {tokens} tokens in "
        f"{elapsed:.1f}s = {tokens / elapsed:.0f} tokens/s ({groups / elapsed:.2f} groups/s); "
        f"per-group latency median {np.median(latencies):.2f}s"
    )


def _changed(tensor: torch.Tensor, fraction: float) -> torch.Tensor:
    """A copy of `tensor` with every (1/fraction)-th element nudged: the same elements of tied
    tensors, so they stay equal."""
    out = tensor.clone()
    out.view(-1)[:: round(1 / fraction)] += 1e-3
    return out


if __name__ == "__main__":
    main()
