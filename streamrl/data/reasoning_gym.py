"""reasoning-gym's procedural tasks as a prompt dataset: `data.path: reasoning_gym:<task>[,...]`.

reasoning-gym (`pip install 'streamrl[reasoning-gym]'`) generates endless verifiable problems
per task (`basic_arithmetic`, `leg_counting`, ...), each with its own scorer. A run names its
tasks in `data.path` and sets them up in `data.reasoning_gym` (`ReasoningGymConfig`): each
task's weight in the mixture, its dataset settings (reasoning-gym's config fields for the task,
e.g. `max_animals`), and the sizes of the training and held-out splits.

The rows are ordinary dataset rows (the verl layout `streamrl.data.datasets` reads), so
sharding, shuffling, resume and the prompt fingerprint work as for a file:

    {"prompt": [{"role": "system", ...}, {"role": "user", "content": <question>}],
     "reward_model": {"ground_truth": <GymAnswer as JSON>, "style": "rule"},
     "data_source": <task>, "extra_info": {"index": i, "task": <task>, "level": 0}}

Splits. Training: `size` prompts per epoch, shared among the tasks in proportion to their
weights (largest remainders), task t's drawn with a seed derived from (`seed`, t, "train").
Held-out (`split="eval"`, what `streamrl eval` and the evaluator read when the run names no
other validation set): `eval_size` prompts per task from the seed (`seed`, t, "eval"), minus
every question that also occurs in the task's training prompts, so the two never overlap.
Rows interleave the tasks, so the first N held-out prompts cover every task.

The ground truth does not carry the problem: it names where the problem comes from (task,
seed, size, index, the task's settings), and the reward (`streamrl.rewards.reasoning_gym`)
rebuilds the entry in its worker and scores with the task's own `score_answer`. The answer is
in it only to be shown. The row's `data_source` is the task: the generator records it per
group, so metrics break accuracy down per task.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal

from pydantic import Field, JsonValue

from streamrl.config.base import MAX_SEED, Section
from streamrl.data.rows import DatasetError

__all__ = [
    "REASONING_GYM_PREFIX",
    "CurriculumConfig",
    "GymAnswer",
    "GymTask",
    "ReasoningGymConfig",
    "import_reasoning_gym",
    "level_settings",
    "reasoning_gym_rows",
    "reasoning_gym_tasks",
    "system_prompt",
    "task_dataset",
    "task_row",
]

REASONING_GYM_PREFIX = "reasoning_gym:"
INSTALL = "pip install 'streamrl[reasoning-gym]'"
DEFAULT_SYSTEM_PROMPT = "default"
"""reasoning-gym's own system prompt: think, then give the answer in <answer> tags."""


class GymTask(Section):
    """One reasoning-gym task's place in the mixture and its settings."""

    weight: float = Field(
        1.0, gt=0.0, le=1e6, description="Share of the training prompts, relative to the others."
    )
    config: dict[str, JsonValue] = Field(
        default_factory=dict,
        description="The task's own dataset settings (reasoning-gym's config fields for it, "
        "e.g. {max_animals: 4} for leg_counting); seed and size come from data.reasoning_gym.",
    )


class CurriculumConfig(Section):
    """Raising a task's difficulty as the policy masters it (reasoning-gym's curricula)."""

    threshold: float = Field(
        0.7,
        gt=0.0,
        le=1.0,
        description="Rolling accuracy over `window` responses at which a task's level rises.",
    )
    window: int = Field(
        64,
        ge=8,
        le=100_000,
        description="Responses of a task (this generator's) the rolling accuracy is taken over; "
        "emptied when the level rises.",
    )


class ReasoningGymConfig(Section):
    """Settings of the reasoning-gym tasks `data.path` names (`reasoning_gym:<task>,...`)."""

    tasks: dict[str, GymTask] = Field(
        default_factory=dict,
        description="Per-task weight and settings, by task name; a task data.path names "
        "without an entry here has weight 1 and reasoning-gym's default settings.",
    )
    size: int = Field(
        10_000,
        ge=1,
        le=10_000_000,
        description="Training prompts per epoch, all tasks together (shared by weight).",
    )
    eval_size: int = Field(
        200,
        ge=1,
        le=1_000_000,
        description="Held-out prompts drawn per task (fewer when some repeat a training "
        "question: those are left out).",
    )
    seed: int = Field(
        0, ge=0, le=MAX_SEED, description="Seed the tasks' training and held-out seeds derive from."
    )
    system_prompt: str | None = Field(
        DEFAULT_SYSTEM_PROMPT,
        description="System message of every prompt: 'default' is reasoning-gym's own (think, "
        "then answer inside <answer></answer>); null: none. data.system_prompt overrides it.",
    )
    answer: Literal["tag", "last_line", "last_number"] = Field(
        "tag",
        description="Where the reward reads the response's answer: tag, inside its last "
        "<answer></answer> (no tag scores 0); last_line, its last non-empty line; "
        "last_number, its last number (tasks whose answers are numbers).",
    )
    partial_credit: bool = Field(
        False,
        description="Train on the task's partial scores (many reasoning-gym scorers give "
        "len(answer)/len(response) to a response that contains the answer among others, which "
        "a policy learns to exploit by hedging); false: a score below 1 counts as 0.",
    )
    curriculum: CurriculumConfig | None = Field(
        None,
        description="Raise each task's difficulty level (its reasoning-gym curriculum's "
        "global level; level 0: the curriculum's easiest, with `config` for the settings it "
        "does not set) when its rolling accuracy passes a threshold. null: the settings stay "
        "`config`'s. Held-out prompts stay at level 0.",
    )
    split: Literal["train", "eval"] = Field(
        "train",
        description="Which split the dataset is: the training prompts, or the held-out ones "
        "(the evaluator picks it; leave it at train).",
    )


@dataclass(frozen=True)
class GymAnswer:
    """Where a problem comes from, which the reward rebuilds it from: `task`'s dataset with
    `seed`, `size` and the settings `config`, entry `index`; `answer` how to read the response
    (`ReasoningGymConfig.answer`), `partial_credit` whether a score below 1 counts
    (`ReasoningGymConfig.partial_credit`). `expected` is the task's answer, for display only."""

    task: str
    seed: int
    size: int
    index: int
    config: dict[str, Any]
    answer: str = "tag"
    expected: str | None = None
    partial_credit: bool = False

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> GymAnswer:
        """The record `to_json` wrote; ValueError when `text` is not one."""
        try:
            data = json.loads(text)
            answer = cls(**data)
        except (ValueError, TypeError) as error:
            raise ValueError(
                f"not a reasoning-gym ground truth ({error}): {text[:120]!r}"
            ) from None
        numbers = (answer.seed, answer.size, answer.index)
        if (
            not isinstance(answer.task, str)
            or not all(isinstance(n, int) and not isinstance(n, bool) for n in numbers)
            or not isinstance(answer.config, dict)
            or answer.answer not in ("tag", "last_line", "last_number")
            or not (answer.expected is None or isinstance(answer.expected, str))
            or not isinstance(answer.partial_credit, bool)
        ):
            raise ValueError(f"not a reasoning-gym ground truth: {text[:120]!r}")
        return answer


def import_reasoning_gym() -> Any:
    """The `reasoning_gym` package; a DatasetError naming the install command when absent."""
    try:
        import reasoning_gym
    except ImportError:
        raise DatasetError(
            f"data.path names reasoning-gym tasks but reasoning-gym is not installed; {INSTALL}"
        ) from None
    return reasoning_gym


def reasoning_gym_tasks(path: str) -> list[str]:
    """The task names of `reasoning_gym:<task>[,<task>...]`, checked against reasoning-gym's
    registry (a DatasetError names an unknown one and the closest known)."""
    names = [n.strip() for n in path.removeprefix(REASONING_GYM_PREFIX).split(",")]
    if not all(names) or len(set(names)) != len(names):
        raise DatasetError(
            f"data.path {path!r} must name distinct reasoning-gym tasks separated by commas, "
            "e.g. reasoning_gym:basic_arithmetic,leg_counting"
        )
    known = import_reasoning_gym().factory.DATASETS
    for name in names:
        if name not in known:
            close = difflib.get_close_matches(name, known, n=3)
            hint = f" (did you mean {', '.join(close)}?)" if close else ""
            raise DatasetError(
                f"reasoning-gym has no task {name!r}{hint}; it has {len(known)}, e.g. "
                f"{', '.join(sorted(known)[:8])}, ..."
            )
    return names


def reasoning_gym_rows(path: str, config: ReasoningGymConfig) -> list[dict[str, Any]]:
    """The rows of `path`'s tasks for `config.split` (module docstring)."""
    names = reasoning_gym_tasks(path)
    unknown = sorted(set(config.tasks) - set(names))
    if unknown:
        raise DatasetError(
            f"data.reasoning_gym.tasks sets up {', '.join(unknown)}, which data.path ({path}) "
            "does not name; add it to data.path or remove its entry"
        )
    tasks = {name: config.tasks.get(name, GymTask()) for name in names}
    counts = _shares(config.size, {name: task.weight for name, task in tasks.items()})
    per_task = []
    for name, task in tasks.items():
        if config.curriculum is not None:
            task = task.model_copy(update={"config": level_settings(name, task.config, 0)})
        train = _dataset(name, task, _seed(config.seed, name, "train"), counts[name])
        if config.split == "train":
            per_task.append([task_row(name, train, i, config) for i in range(len(train))])
            continue
        seen = {train[i]["question"] for i in range(len(train))}
        held_out = _dataset(name, task, _seed(config.seed, name, "eval"), config.eval_size)
        kept = [i for i in range(len(held_out)) if held_out[i]["question"] not in seen]
        if not kept:
            raise DatasetError(
                f"task {name!r} has no held-out prompt: each of its {config.eval_size} drawn "
                f"is among its {counts[name]} training prompts (its settings allow few distinct "
                "problems); lower data.reasoning_gym.size or widen the task's settings"
            )
        per_task.append([task_row(name, held_out, i, config) for i in kept])
    return [row for group in _interleaved(per_task) for row in group]


def _dataset(name: str, task: GymTask, seed: int, size: int) -> Any:
    for reserved in ("seed", "size"):
        if reserved in task.config:
            raise DatasetError(
                f"data.reasoning_gym.tasks.{name}.config sets {reserved!r}, which "
                f"data.reasoning_gym.{'seed' if reserved == 'seed' else 'size'} decides; remove it"
            )
    try:
        dataset = task_dataset(name, seed, size, task.config)
    except (TypeError, ValueError, AssertionError) as error:
        raise DatasetError(
            f"reasoning-gym refused the settings of task {name!r} "
            f"(data.reasoning_gym.tasks.{name}.config = {task.config}): {error}"
        ) from None
    _check_rebuilds(name, dataset)
    return dataset


def _check_rebuilds(name: str, dataset: Any) -> None:
    """A DatasetError unless the reward can rebuild `dataset` from its settings as JSON (the
    ground truth): some tasks hold settings JSON does not keep (enums, dates, option objects)."""
    try:
        rebuilt = task_dataset(name, dataset.config.seed, len(dataset), _settings(dataset.config))
        shown, again = dataset[0], rebuilt[0]
        same = (again["question"], str(again["answer"])) == (
            shown["question"],
            str(shown["answer"]),
        )
    except (TypeError, ValueError, AssertionError, AttributeError, KeyError) as error:
        same, why = False, f": {type(error).__name__}: {error}"
    else:
        why = ": its first entry comes out different"
    if not same:
        raise DatasetError(
            f"reasoning-gym task {name!r} cannot be used: the reward rebuilds a task from its "
            f"settings as JSON, and this task's do not survive that{why}; choose another task"
        )


def level_settings(task: str, settings: Mapping[str, Any], level: int) -> dict[str, Any]:
    """Task `task`'s settings at curriculum `level` (reasoning-gym's curriculum for it at that
    global level; `settings` for what it leaves), as JSON; a DatasetError for a task with no
    curriculum."""
    factory = import_reasoning_gym().factory
    if not factory.has_curriculum(task):
        raise DatasetError(
            f"reasoning-gym task {task!r} has no curriculum; set data.reasoning_gym.curriculum"
            "=null or leave the task out"
        )
    curriculum = factory.create_curriculum(task)
    curriculum.set_global_level(level)
    base = {key: _tuples(value) for key, value in settings.items()}
    return _settings(curriculum.generate_configuration({**base, "seed": 0, "size": 1}))


def task_row(name: str, dataset: Any, index: int, config: ReasoningGymConfig) -> dict[str, Any]:
    """Entry `index` of task `name`'s `dataset` as a row (module docstring)."""
    entry = dataset[index]
    truth = GymAnswer(
        task=name,
        seed=dataset.config.seed,
        size=dataset.config.size,
        index=index,
        config=_settings(dataset.config),
        answer=config.answer,
        partial_credit=config.partial_credit,
        expected=None if entry.get("answer") is None else str(entry["answer"]),
    )
    messages = [{"role": "user", "content": entry["question"]}]
    if config.system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt(config.system_prompt)})
    return {
        "prompt": messages,
        "reward_model": {"ground_truth": truth.to_json(), "style": "rule"},
        "data_source": name,
        "extra_info": {"index": index, "task": name, "level": 0},
    }


def system_prompt(setting: str) -> str:
    """`setting` itself, or reasoning-gym's system prompt when it is 'default'."""
    if setting != DEFAULT_SYSTEM_PROMPT:
        return setting
    from reasoning_gym.utils import SYSTEM_PROMPTS

    return SYSTEM_PROMPTS["default"]


def _settings(dataset_config: Any) -> dict[str, Any]:
    """A task's dataset settings as JSON (tuples become lists), without seed and size."""
    settings = {k: v for k, v in vars(dataset_config).items() if k not in ("seed", "size")}
    return json.loads(json.dumps(settings, default=list))


def task_dataset(name: str, seed: int, size: int, settings: Mapping[str, Any]) -> Any:
    """reasoning-gym's dataset of task `name` with these settings (JSON: lists for tuples)."""
    config = {key: _tuples(value) for key, value in settings.items()}
    return import_reasoning_gym().create_dataset(name, seed=seed, size=size, **config)


def _tuples(value: Any) -> Any:
    """JSON lists as the tuples reasoning-gym's settings hold (ranges, operator sets)."""
    return tuple(_tuples(v) for v in value) if isinstance(value, list) else value


def _seed(seed: int, task: str, split: str) -> int:
    digest = hashlib.sha256(f"streamrl-reasoning-gym:{seed}:{task}:{split}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & MAX_SEED


def _shares(total: int, weights: Mapping[str, float]) -> dict[str, int]:
    """`total` split among the tasks: one each, the rest in proportion to `weights` by largest
    remainders."""
    if total < len(weights):
        raise DatasetError(
            f"data.reasoning_gym.size ({total}) is smaller than the number of tasks "
            f"({len(weights)}); every task needs a prompt"
        )
    rest, scale = total - len(weights), sum(weights.values())
    exact = {name: rest * w / scale for name, w in weights.items()}
    counts = {name: math.floor(x) for name, x in exact.items()}
    by_remainder = sorted(weights, key=lambda n: counts[n] - exact[n])
    for name in by_remainder[: rest - sum(counts.values())]:
        counts[name] += 1
    return {name: count + 1 for name, count in counts.items()}


def _interleaved(per_task: list[list[dict[str, Any]]]) -> list[list[dict[str, Any]]]:
    """Rows of the tasks in turn (one of each, then the next of each, ...)."""
    longest = max((len(rows) for rows in per_task), default=0)
    return [[rows[i] for rows in per_task if i < len(rows)] for i in range(longest)]
