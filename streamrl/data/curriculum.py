"""A generator's curriculum over reasoning-gym tasks (`data.reasoning_gym.curriculum`): each
task's difficulty level rises when the policy's rolling accuracy on it passes a threshold.

Consumes: the prompts of the generator's shard (drawn at level 0) and the groups it scores.
Produces: each prompt drawn again at its task's current level (`prompt`: the same task, seed
and index, the settings of reasoning-gym's curriculum for the task at that global level,
`level_row`), recorded with its level (`ScoredGroup.task_level`).

A task's rolling accuracy is over the last `window` responses of its groups sampled at its
current level (`observe`; groups of an earlier level, still in flight when it rose, do not
count). When the window is full and its accuracy is at least `threshold`, the level rises by
one (up to the curriculum's highest), the window empties, and the rise is logged. Levels are
the generator's own, not the run's: each generator measures the same policy on its own groups,
so generators agree up to the noise of their windows. A generator index keeps its levels in
its progress record (`storage.control.progress.GeneratorProgress.task_levels`), so a restart
goes on at the levels its predecessor committed. The held-out split stays at level 0: the
evaluation measures one fixed task, whatever the curriculum reached.
"""

from __future__ import annotations

import functools
import json
import logging
from collections import deque
from collections.abc import Mapping
from typing import Any

import numpy as np

from storage.stream.scored_group import ScoredGroup
from streamrl.data.datasets import Prompt, PromptSource
from streamrl.data.reasoning_gym import (
    CurriculumConfig,
    GymAnswer,
    GymTask,
    ReasoningGymConfig,
    import_reasoning_gym,
    level_settings,
    reasoning_gym_tasks,
    task_dataset,
    task_row,
)

__all__ = ["Curriculum", "level_row", "max_level"]

log = logging.getLogger("streamrl.progress")  # a terminal shows it (supervision.output)


class Curriculum:
    """The task levels of one generator (module docstring); `levels`: where an earlier life of
    the generator left them."""

    def __init__(
        self,
        source: PromptSource,
        config: ReasoningGymConfig,
        levels: Mapping[str, int] | None = None,
    ) -> None:
        assert config.curriculum is not None
        self.source, self.config = source, config
        self.settings: CurriculumConfig = config.curriculum
        tasks = reasoning_gym_tasks(source.path)
        self.top = {task: max_level(task) for task in tasks}
        levels = levels or {}
        self.levels = {
            task: min(max(int(levels.get(task, 0)), 0), self.top[task]) for task in tasks
        }
        self._recent = {task: deque[bool](maxlen=self.settings.window) for task in tasks}

    def prompt(self, prompt: Prompt) -> Prompt:
        """`prompt` at its task's current level (itself at level 0, or when the level's prompt
        is longer than `data.max_prompt_len`)."""
        level = self.levels.get(prompt.task or "", 0)
        if level == 0:
            return prompt
        row = level_row(prompt.ground_truth, level, self.config)
        leveled = self.source.prompt_of(row, f"{prompt.prompt_id}@{level}")
        return prompt if leveled is None else leveled

    def observe(self, group: ScoredGroup) -> None:
        """Count a scored group of the current level of its task; raise the level when due."""
        task = group.task
        if task not in self.levels or group.task_level != self.levels[task]:
            return
        recent = self._recent[task]
        recent.extend(bool(s >= 1.0) for s in np.asarray(group.raw_scores))
        if len(recent) < self.settings.window or self.levels[task] >= self.top[task]:
            return
        accuracy = sum(recent) / len(recent)
        if accuracy >= self.settings.threshold:
            self.levels[task] += 1
            recent.clear()
            log.info(
                "curriculum: task %s rises to level %d (accuracy %.2f over its last %d "
                "responses ≥ %.2f)",
                task,
                self.levels[task],
                accuracy,
                self.settings.window,
                self.settings.threshold,
            )


def max_level(task: str) -> int:
    """The highest global level of `task`'s curriculum."""
    curriculum = import_reasoning_gym().factory.create_curriculum(task)
    return max(len(attribute.levels) - 1 for attribute in curriculum.attributes.values())


def level_row(ground_truth: str, level: int, config: ReasoningGymConfig) -> dict[str, Any]:
    """The training row whose ground truth is `ground_truth`, drawn again at curriculum
    `level`: the same task, seed and index, the task's settings at that level."""
    truth = GymAnswer.from_json(ground_truth)
    task = config.tasks.get(truth.task, GymTask())
    settings = level_settings(truth.task, task.config, level)
    dataset = _level_dataset(truth.task, truth.seed, truth.size, json.dumps(settings))
    row = task_row(truth.task, dataset, truth.index, config)
    row["extra_info"]["level"] = level
    return row


@functools.lru_cache(maxsize=256)
def _level_dataset(task: str, seed: int, size: int, settings: str) -> Any:
    return task_dataset(task, seed, size, json.loads(settings))
