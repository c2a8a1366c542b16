"""Held-out evaluation of published weight versions: greedy accuracy and avg@k.

For a version v, every validation prompt is answered once greedily (temperature 0) and k times
at the evaluation temperature (`eval.temperature`, else `generator.temperature`), with the
run's engine settings (max_tokens, stop strings, top-p/top-k for the samples). Answers are
episodes, as the generators' are (`streamrl.generator.rollouts.EpisodeDriver`, the one way a
rollout goes): with an environment (`generator.env`) the model takes its turns, calls its tools
and is scored by the environment; single-turn, one response scored by the reward function
(`generator.reward`). An answer is correct when its score is ≥ 1, as in the generator's
accuracy. Metrics:

    val/acc_greedy          correct greedy responses / prompts
    val/avg@{k}             correct sampled responses / (k × prompts)
    val/pass@1              the same: the unbiased estimate of one sample's pass rate
    val/pass@{k}            prompts with at least one correct sample among k / prompts
    val/num_prompts         prompts evaluated
    val/response_len_mean   tokens per sampled response, divided by k × prompts
    val/turns_mean, val/tool_calls_mean, val/tool_errors_mean
                            with an environment: per sampled episode, model turns, tool calls
                            and failed tool calls
    val/tool_use_frac       with an environment: sampled episodes with at least one tool call
    val/<task>/acc_greedy, val/<task>/pass@1, val/<task>/num_prompts
                            per task, when the prompts come from two tasks or more (their
                            `data.task_field`: reasoning-gym tasks, verl's data_source)

The validation prompts (`validation_dataset`): `eval.dataset` when set (fields it leaves unset
come from `data`), else the `data` section read from `data.val_path`, else for reasoning-gym
tasks their held-out split (`streamrl.data.reasoning_gym`) and for a verifiers environment's
dataset its eval split (`verifiers:eval`, `streamrl.envs.verifiers_data`), else — the bundled
datasets ship no split — the training prompts themselves. The last is no held-out measure: the
evaluator says so in a warning and in every record (`held_out: false`). The first
`eval.max_prompts` prompts in file order are used, the same ones for every version.

Each evaluation appends one record to the run's evaluation log (`streamrl.evaluation.records`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

import numpy as np

from storage.control.requests import stop_requested
from storage.fs import Location
from storage.weights.versions import WeightStore, WeightVersionNotFoundError
from streamrl.config.base import ConfigError
from streamrl.config.run import RunConfig
from streamrl.data.config import DataConfig
from streamrl.data.datasets import Prompt
from streamrl.evaluation.records import append_eval_record, read_eval_records
from streamrl.generator.config import GeneratorConfig
from streamrl.generator.engine import Engine, WeightSource
from streamrl.generator.rollouts import EpisodeDriver, Rollout

__all__ = [
    "EvaluationLoop",
    "Evaluator",
    "evaluate",
    "evaluation_sampling",
    "run_evaluator",
    "validation_dataset",
]

log = logging.getLogger(__name__)


def evaluation_sampling(
    config: RunConfig, k: int | None = None, temperature: float | None = None
) -> GeneratorConfig:
    """The generator section an evaluation engine samples with: n = k (default eval.k) at the
    evaluation temperature (default eval.temperature, else generator.temperature)."""
    chosen = temperature or config.eval.temperature or config.generator.temperature
    fields = {"group_size": k or config.eval.k, "temperature": chosen}
    return GeneratorConfig.model_validate({**config.generator.model_dump(), **fields})


def validation_dataset(
    config: RunConfig, dataset: DataConfig | None = None
) -> tuple[DataConfig, bool]:
    """The validation prompts' data section and whether they are held out (module docstring)."""
    if dataset is None and config.eval.dataset is not None:
        dataset = config.eval.dataset
    if dataset is None and config.data.val_path is not None:
        dataset = config.data.model_copy(update={"path": config.data.val_path, "val_path": None})
    if dataset is None and config.data.procedural:  # reasoning-gym tasks: their held-out split
        split = config.data.reasoning_gym.model_copy(update={"split": "eval"})
        dataset = config.data.model_copy(update={"reasoning_gym": split})
    if dataset is None and config.data.path == "verifiers:train":  # the environment's eval split
        dataset = config.data.model_copy(update={"path": "verifiers:eval"})
    if dataset is not None:
        held_out = dataset.procedural and dataset.reasoning_gym.split == "eval"
        return dataset, held_out or dataset.path != config.data.path
    log.warning(
        "no validation set (eval.dataset and data.val_path are unset): evaluating on the "
        "training prompts of %s, which measures no held-out accuracy",
        config.data.path,
    )
    return config.data, False


class Evaluator:
    """One run's validation prompts, reward scorer and vLLM engine, to evaluate versions with.

    Use as a context manager (the scorer's worker processes start on entry). `engine`, when
    given, must sample with `evaluation_sampling(config, k, temperature)` and stays open on
    exit; by default one is built from model.path and closed on exit. Building fails fast,
    before vLLM starts, on a bad dataset or reward.
    """

    def __init__(
        self,
        run: Location,
        config: RunConfig,
        *,
        dataset: DataConfig | None = None,
        k: int | None = None,
        max_prompts: int | None = None,
        temperature: float | None = None,
        engine: Engine | None = None,
    ) -> None:
        from streamrl.data import PromptSource
        from streamrl.envs.runner import EnvRunner
        from streamrl.envs.verifiers_data import environment_rows
        from streamrl.models import resolve_model_path
        from streamrl.rewards import check_reward_name

        self.run, self.config = run, config
        self.sampling = evaluation_sampling(config, k, temperature)
        self.dataset, self.held_out = validation_dataset(config, dataset)
        model_path = resolve_model_path(config.model.path)
        check_reward_name(config.generator.reward.fn)  # user code runs in the workers only
        source = PromptSource(
            self.dataset,
            tokenizer_path=config.model.tokenizer or model_path,
            rows=environment_rows(self.dataset.path, config.generator.env),
        )
        self.prompts = source.prompts[: max_prompts or config.eval.max_prompts]
        config.generator.reward.check_ground_truths(
            ((p.prompt_id, p.ground_truth) for p in self.prompts),
            ", ".join(self.dataset.answer_fields),
        )
        self._owns_engine = engine is None  # closed on exit; a caller's engine is theirs
        if engine is None:
            engine = Engine(
                model_path,
                config.model,
                self.sampling,
                seed=self.sampling.seed,
                adapter=config.served_adapter,
            )
        elif engine.generator != self.sampling:
            raise ValueError("the engine must sample with evaluation_sampling(config, k, T)")
        self.engine = engine
        self.weights = WeightStore(run)
        self.weight_source = WeightSource.of(run, config.weights)
        self.episodes = config.generator.env.multi_turn
        template = getattr(engine.tokenizer, "chat_template", None)
        self._runner = EnvRunner.from_config(
            config.generator.env, config.generator.reward, template
        )
        self._episode_config = config.model_copy(update={"generator": self.sampling})

    def __enter__(self) -> Evaluator:
        self._runner.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        try:
            self._runner.__exit__(kind, exc, tb)
        finally:
            if self._owns_engine:
                self.engine.close()

    @property
    def k(self) -> int:
        return self.sampling.group_size

    def evaluate(self, version: int, stop: threading.Event | None = None) -> dict[str, Any] | None:
        """Load `version` and measure it (module docstring); None when `stop` was set first.
        Version 0 is the initial weights (model.path), which a fresh engine serves."""
        if version != self.engine.policy_version:
            if version == 0:
                raise ValueError("version 0 (the initial weights) is measured by a fresh engine")
            self.engine.advance_weights(self.weight_source, exactly=version)
        rollouts = self._answers(stop)
        if rollouts is None:
            return None
        n, k = len(self.prompts), self.k
        greedy = [rollouts.get(f"greedy:{i}") for i in range(n)]
        sampled = [rollouts.get(f"sampled:{i}") for i in range(n)]
        correct = np.array([_correct(r, 1)[0] for r in greedy], dtype=bool)
        samples = np.array([_correct(r, k) for r in sampled], dtype=bool).reshape(n, k)
        metrics: dict[str, Any] = {
            "version": version,
            "val/acc_greedy": float(correct.mean()),
            f"val/avg@{k}": float(samples.mean()),
            "val/pass@1": float(samples.mean()),
            f"val/pass@{k}": float(samples.any(axis=1).mean()),
            "val/num_prompts": float(n),
            "val/response_len_mean": _mean_per_sample(
                sampled, k, lambda r: [t.sampled for t in r.transcripts]
            ),
        }
        metrics |= _per_task(self.prompts, correct, samples)
        if self.episodes:  # what the agent did, per sampled episode
            for name, field in (("turns", "turns"), ("tool_calls", "tool_calls"),
                                ("tool_errors", "tool_errors")):  # fmt: skip
                metrics[f"val/{name}_mean"] = _mean_per_sample(
                    sampled, k, lambda r, f=field: [getattr(e, f) for e in r.episodes]
                )
            metrics["val/tool_use_frac"] = _mean_per_sample(
                sampled, k, lambda r: [float(e.tool_calls > 0) for e in r.episodes]
            )
        return metrics

    def _answers(self, stop: threading.Event | None) -> dict[str, Rollout] | None:
        """Every prompt's greedy answer (`greedy:<i>`) and k samples (`sampled:<i>`) as scored
        rollouts by key; a group dropped (its reset failed, its prompt too long) is absent.
        None when `stop` was set first (the engine's requests are aborted)."""
        driver = EpisodeDriver(self._episode_config, self.engine, self._runner)
        try:
            for i, prompt in enumerate(self.prompts):
                driver.start(prompt, f"greedy:{i}", greedy=True)
                driver.start(prompt, f"sampled:{i}", group_size=self.k)
            done: dict[str, Rollout] = {}
            while len(done) + len(driver.dropped) < 2 * len(self.prompts):
                if stop is not None and stop.is_set():
                    self.engine.abort_all()
                    return None
                finished = self.engine.step() if self.engine.num_in_flight else []
                if not finished and not self.engine.num_in_flight:
                    time.sleep(0.005)  # the environment, agent or reward is answering
                done.update((r.key, r) for r in driver.advance(finished))
            return done
        finally:
            driver.close()

    def record(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """`metrics` as an eval.jsonl record: with what was evaluated and how."""
        return {
            "time": time.time(),
            **metrics,
            "k": self.k,
            "temperature": self.sampling.temperature,
            "dataset": self.dataset.path,
            "held_out": self.held_out,
        }


def _per_task(prompts: list[Prompt], greedy: np.ndarray, samples: np.ndarray) -> dict[str, float]:
    """`val/<task>/acc_greedy`, `/pass@1` and `/num_prompts` for each task of the prompts, when
    they come from two tasks or more (`greedy`: [n] bool; `samples`: [n, k] bool)."""
    tasks = sorted({p.task for p in prompts if p.task is not None})
    if len(tasks) < 2:
        return {}
    metrics = {}
    for task in tasks:
        mine = np.array([p.task == task for p in prompts])
        metrics[f"val/{task}/acc_greedy"] = float(greedy[mine].mean())
        metrics[f"val/{task}/pass@1"] = float(samples[mine].mean())
        metrics[f"val/{task}/num_prompts"] = float(mine.sum())
    return metrics


def _correct(rollout: Rollout | None, count: int) -> list[bool]:
    """Whether each of a group's `count` answers scored ≥ 1; a group dropped, or an episode whose
    environment or reward failed (its score is 0), counts as wrong: leaving it out would bias
    accuracy upwards (the runner logs and counts every failure)."""
    if rollout is None:
        return [False] * count
    return [future.result().reward >= 1.0 for future in rollout.scores]


def _mean_per_sample(
    rollouts: list[Rollout | None], k: int, values: Callable[[Rollout], list[float]]
) -> float:
    """The mean of `values` over every sample of every prompt (a dropped group's count as 0)."""
    total = sum(sum(values(r)) for r in rollouts if r is not None)
    return float(total / max(k * len(rollouts), 1))


def evaluate(
    run: Location,
    version: int | None = None,
    *,
    dataset: DataConfig | None = None,
    k: int | None = None,
    max_prompts: int | None = None,
    temperature: float | None = None,
    record: bool = True,
) -> dict[str, Any]:
    """Evaluate one published `version` of `run` (default: the latest; 0: the initial weights,
    model.path) with a fresh engine.

    `k`, `max_prompts`, `temperature` default to the run's `eval` section, `dataset` as in
    `validation_dataset`. With `record`, the result is appended to the run's evaluation log.
    Returns the metrics (module docstring) and `version`.
    """
    from streamrl.config.stored import load_run_config

    config = load_run_config(run)
    store = WeightStore(run)
    if version is None and (version := store.latest_version()) is None:
        raise WeightVersionNotFoundError(f"run {run.uri} has no published weights to evaluate")
    if version != 0:
        store.read_manifest(version)  # an unknown version fails before vLLM starts
    options = {"dataset": dataset, "k": k, "max_prompts": max_prompts, "temperature": temperature}
    with Evaluator(run, config, **options) as evaluator:
        metrics = evaluator.evaluate(version)
        assert metrics is not None  # no stop event: it ran to the end
        if record:
            append_eval_record(run, evaluator.record(metrics))
    return metrics


class EvaluationLoop:
    """The evaluator process: follows a run and evaluates every E-th published version.

    Consumes: the run's published weight versions (listed every `poll_s` seconds).
    Produces: one evaluation-log record per evaluated version: each multiple of
    `every_versions`, and the last version once the run has stopped.
    Waits for: the next such version; it never blocks the learner or the generators, which do
    not know it exists.
    Stops when: the run's stop marker is there and the last published version is evaluated,
    or `stop` is set (SIGTERM), then at once: an evaluation in progress is dropped.
    Resumes: versions already in the evaluation log are never evaluated again. A version that
    retention deleted before its turn is skipped, logged and counted in `missed`.
    """

    def __init__(self, evaluator: Evaluator, *, every_versions: int, poll_s: float) -> None:
        if every_versions < 1:
            raise ValueError(f"every_versions must be ≥ 1, got {every_versions}")
        self.evaluator = evaluator
        self.run_location = evaluator.run
        self.every, self.poll_s = every_versions, poll_s
        self.done = {int(r["version"]) for r in read_eval_records(self.run_location)}
        self.missed: list[int] = []

    def run(self, stop: threading.Event | None = None) -> list[dict[str, Any]]:
        """Evaluate until the run has stopped and its last version is evaluated; the records."""
        stop = stop or threading.Event()
        records: list[dict[str, Any]] = []
        while not stop.is_set():
            stopping, version = self.next_version()
            if version is not None:
                if (record := self.step(version, stop)) is not None:
                    records.append(record)
            elif stopping:
                break
            else:
                stop.wait(self.poll_s)
        log.info("evaluator: %d versions evaluated, %d missed", len(records), len(self.missed))
        return records

    def next_version(self) -> tuple[bool, int | None]:
        """(whether the run has stopped, the oldest version due and not yet evaluated)."""
        stopping = stop_requested(self.run_location)  # before listing: the last is then listed
        versions = self.evaluator.weights.versions()
        last = versions[-1] if versions else 0
        for gone in range(self.every, last + 1, self.every):
            if gone not in versions and gone not in self.done and gone not in self.missed:
                self._miss(gone, "deleted by weight retention before its evaluation")
        due = [
            v
            for v in versions
            if v not in self.done
            and v not in self.missed
            and (v % self.every == 0 or (stopping and v == last))
        ]
        return stopping, (due[0] if due else None)

    def step(self, version: int, stop: threading.Event) -> dict[str, Any] | None:
        """Evaluate `version` and log it; None when stopped or the version vanished."""
        started = time.perf_counter()
        try:
            metrics = self.evaluator.evaluate(version, stop)
        except WeightVersionNotFoundError as exc:  # retention removed it while we read it
            self._miss(version, str(exc))
            return None
        if metrics is None:
            return None
        record = {**self.evaluator.record(metrics), "eval_s": time.perf_counter() - started}
        append_eval_record(self.run_location, record)
        self.done.add(version)
        k = self.evaluator.k
        log.info(
            "eval v%d: acc_greedy %.3f avg@%d %.3f pass@%d %.3f over %d prompts (%.1fs)",
            version, metrics["val/acc_greedy"], k, metrics[f"val/avg@{k}"],
            k, metrics[f"val/pass@{k}"], metrics["val/num_prompts"], record["eval_s"],
        )  # fmt: skip
        return record

    def _miss(self, version: int, why: str) -> None:
        self.missed.append(version)
        log.warning("evaluator: skipping weights v%d: %s", version, why)


def run_evaluator(
    run_uri: str,
    *,
    poll_s: float = 10.0,
    every_versions: int | None = None,
    storage_options: dict[str, Any] | None = None,
    stop: threading.Event | None = None,
) -> list[dict[str, Any]]:
    """`streamrl eval --run RUN_URI --follow`: the evaluator of an existing run, in a process of
    its own, until the run stops (see `EvaluationLoop`). SIGTERM (when called from the main
    thread) sets the stop event, so the process exits 0."""
    from streamrl.config.stored import open_existing_run
    from streamrl.isolation.lifetime import stop_on_sigterm

    config, run = open_existing_run(run_uri, storage_options)
    stop = stop_on_sigterm(stop)
    every = config.eval.every_versions if every_versions is None else every_versions
    if every < 1:
        raise ConfigError(
            [f"eval.every_versions is {every}: the evaluator has nothing to follow; set "
             "eval.every_versions ≥ 1 (or pass --every E)"]
        )  # fmt: skip
    with Evaluator(run, config) as evaluator:
        return EvaluationLoop(evaluator, every_versions=every, poll_s=poll_s).run(stop)
