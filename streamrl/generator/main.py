"""One generator process: built from the run's configuration, run until the run stops.

`run_generator` is what `streamrl generator --run RUN_URI --index I` and the Prefect flows
call: it opens an existing run, holds index I (`streamrl.generator.index.hold_generator_index`: no
other live generator may run it), builds one generator from the run's configuration and runs
it until the run's stop marker appears or SIGTERM arrives.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from storage.fs import Location
from storage.stream.writer import StreamWriter
from streamrl.config.run import RunConfig
from streamrl.generator.loop import GeneratorLoop
from streamrl.generator.records import GeneratorStats
from streamrl.scorers.teacher import Teacher
from streamrl.scorers.terms import ModelTermScorer

if TYPE_CHECKING:
    from streamrl.data import PromptSource
    from streamrl.data.curriculum import Curriculum

__all__ = ["build_generator", "run_generator"]

log = logging.getLogger(__name__)
progress_log = logging.getLogger("streamrl.progress")  # a terminal shows it (supervision.output)


@contextlib.contextmanager
def build_generator(
    config: RunConfig,
    run: Location,
    index: int,
    *,
    policy_version: int | None = None,
    take_over: bool = False,
) -> Iterator[GeneratorLoop]:
    """Everything one generator needs, built from the run's configuration and released on exit.

    First holds index `index` for this process (`hold_generator_index`; `take_over` for a
    supervisor restarting it): raises `GeneratorIndexHeldError` while another generator runs
    it, and every commit checks it is still held. Fails fast — before vLLM starts — on a bad
    dataset field, model path or reward (its workers start first and load it). Each call is
    one more start of generator `index` in the run: it continues the data shard after what
    earlier starts committed and draws a seed of its own (`streamrl.generator.progress`).
    Once the engine is up its workers load the weights from the run's store: the newest intact
    version (corrupt ones are skipped and counted), exactly `policy_version` when given (its
    manifest is checked before vLLM starts), or none with `policy_version=0` (the model's own).
    """
    from streamrl.generator.index import hold_generator_index

    if index < 0:
        raise ValueError(f"generator index must be ≥ 0, got {index}")
    with (
        hold_generator_index(run, index, take_over=take_over) as held,
        _build(config, run, index, policy_version, before_commit=held.check) as loop,
    ):
        yield loop
        # The loop has flushed: the index is free before the engine shuts down, so that a
        # resumed generator takes it at once even if this one is killed while shutting down.
        held.release()


@contextlib.contextmanager
def _build(
    config: RunConfig,
    run: Location,
    index: int,
    policy_version: int | None,
    *,
    before_commit: Callable[[], object],
) -> Iterator[GeneratorLoop]:
    from storage.weights.follower import Advance
    from storage.weights.versions import WeightStore
    from streamrl.data import PromptPosition, PromptSource
    from streamrl.envs.runner import EnvRunner
    from streamrl.envs.verifiers_data import environment_rows
    from streamrl.generator.engine import Engine, WeightSource, generator_seed
    from streamrl.generator.progress import PromptLedger, resume_prompts
    from streamrl.models import resolve_model_path

    started = time.monotonic()
    cfg = config.generator
    model_path = resolve_model_path(config.model.path)
    source = PromptSource(
        config.data,
        tokenizer_path=config.model.tokenizer or model_path,
        rows=environment_rows(config.data.path, cfg.env),  # a verifiers environment's own
    )
    cfg.reward.check_ground_truths(
        ((p.prompt_id, p.ground_truth) for p in source.prompts),
        ", ".join(config.data.answer_fields),
    )
    # The reward's workers load it (the user's module is imported there, under their limits)
    # before anything is counted or vLLM starts: a reward (or an environment) that cannot be
    # loaded fails here.
    with contextlib.ExitStack() as stack:
        template = getattr(source.tokenizer, "chat_template", None)
        runner = stack.enter_context(EnvRunner.from_config(cfg.env, cfg.reward, template))
        generator_id = f"gen{index}"
        # The run's `count` generators split the data; one added later (index ≥ count) walks
        # shard index mod count from another epoch, so its prompt order differs from the
        # original's.
        prompts, progress = resume_prompts(
            run,
            generator_id,
            source,
            shard=index % cfg.count,
            num_shards=cfg.count,
            first_start=PromptPosition(epoch=index // cfg.count),
        )
        if policy_version:  # a version that does not exist fails before vLLM starts
            WeightStore(run).read_manifest(policy_version)
        seed = generator_seed(cfg.seed, index, progress.starts)
        engine = stack.enter_context(
            Engine(model_path, config.model, cfg, seed=seed, adapter=config.served_adapter)
        )
        teacher, terms = _scorers(config, run, model_path, stack)
        weights, seconds = Advance(None), 0.0
        if policy_version != 0:
            weight_source = WeightSource.of(run, config.weights)
            weights, seconds = engine.advance_weights(weight_source, exactly=policy_version)
        log.info(
            "generator %s: start %d, seed %d, prompts from %s (%d committed after it), weights "
            "v%d (loaded in %.2fs)",
            generator_id, progress.starts, seed, prompts.position, len(progress.committed_after),
            engine.policy_version, seconds,
        )  # fmt: skip
        progress_log.info("engine up in %.0f s, weights v%d", time.monotonic() - started,
                          engine.policy_version)  # fmt: skip
        writer = StreamWriter(
            run,
            generator_id,
            compression=config.storage.compression,
            level=config.storage.compression_level,
        )
        loop = GeneratorLoop(
            config=config,
            run=run,
            engine=engine,
            prompts=prompts,
            runner=runner,
            writer=writer,
            generator_id=generator_id,
            ledger=PromptLedger(prompts, run=run, progress=progress),
            before_commit=before_commit,
            teacher=teacher,
            terms=terms,
            curriculum=_curriculum(config, source, progress.task_levels),
        )
        stack.callback(loop.episodes.close)
        loop.skip_unusable_weights(weights)
        yield loop


def _curriculum(
    config: RunConfig, source: PromptSource, levels: dict[str, int]
) -> Curriculum | None:
    """The tasks' curriculum (`data.reasoning_gym.curriculum`), at the levels an earlier life
    committed; None without one."""
    from streamrl.data.curriculum import Curriculum

    if not (source.procedural and config.data.reasoning_gym.curriculum is not None):
        return None
    return Curriculum(source, config.data.reasoning_gym, levels)


def _scorers(
    config: RunConfig, run: Location, model_path: str, stack: contextlib.ExitStack
) -> tuple[Teacher | None, list[ModelTermScorer]]:
    """The run's teacher and the reward's model terms, one open client per scorer they name
    (closed by `stack`). An external teacher's tokenizer is checked against the policy's here
    (a served one's by its own process, before it starts)."""
    from streamrl.scorers.client import ScorerClient
    from streamrl.scorers.tokenizers import check_teacher_tokenizer

    clients: dict[str, ScorerClient] = {}

    def client(name: str) -> ScorerClient:
        if name not in clients:
            clients[name] = stack.enter_context(ScorerClient(name, config.scorers[name], run))
        return clients[name]

    teacher = None
    if (name := config.generator.teacher) is not None:
        scorer = config.scorers[name]
        if not scorer.served and scorer.tokenizer is not None:  # served: its process checks
            check_teacher_tokenizer(
                name,
                config.model.tokenizer or model_path,
                scorer.tokenizer,
                trust_remote_code=config.model.trust_remote_code,
            )
        teacher = Teacher(client(name))
    terms = [
        ModelTermScorer(term_name, term, client(term.scorer))
        for term_name, term in config.generator.reward.models.items()
    ]
    return teacher, terms


def run_generator(
    run_uri: str,
    index: int,
    *,
    storage_options: dict[str, Any] | None = None,
    stop: threading.Event | None = None,
    take_over: bool = False,
) -> GeneratorStats:
    """Run generator `index` of an existing run until it is told to stop.

    SIGTERM (when called from the main thread) sets the stop event: the loop flushes its open
    segment and this returns normally, so the process exits 0. `take_over`: see
    `build_generator`.
    """
    from streamrl.config.stored import open_existing_run
    from streamrl.isolation.lifetime import stop_on_sigterm

    config, run = open_existing_run(run_uri, storage_options)
    stop = stop_on_sigterm(stop)
    with build_generator(config, run, index, take_over=take_over) as loop:
        return loop.run(stop)
