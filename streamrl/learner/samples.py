"""What the model wrote: replay-stream groups decoded into samples a person can read.

A `Sample` is one response of a `ScoredGroup`: the prompt's text; the response split into turns
by its loss mask — model turns (tokens the policy sampled, mask 1) and environment turns (tool
results, user turns and template glue between them, mask 0), each with the weight versions that
sampled its tokens; the tool calls each model turn wrote, read with the run's tool format
(`streamrl.envs.formats`) when the group's environment offered tools, and the tool results each
environment turn carries (a result reading "Error: ..." failed, as `streamrl.envs.tools` answers a
failed call); the reward, raw score, reward terms and per-turn rewards; the finish reason; and,
when known, what the learner did with it (`Consumption`: the step that consumed it, the version
it measured staleness against, and the filter that kept it out of the loss, by the learner's own
rules: `streamrl.learner.batching.drop_reason` and `algorithm.overlong.filter`).

Decoding keeps special tokens (`<|im_end|>` shows where a turn ended) and never cuts a text;
`streamrl.learner.sample_table` renders samples for display, bounded.

Used by `streamrl samples` (`streamrl.runs.samples` works out what the learner consumed from the
run's records), by the learner's wandb table of each logged step
(`streamrl.learner.sample_table.SampleTable`, rank 0) and by the flow's samples artifact. `pick`
chooses the few responses a table shows — the same ones for the wandb table and the artifact of
a step.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from storage.stream.records import ScoredGroup
from streamrl.config.run import RunConfig
from streamrl.envs.formats import TOOL_FORMATS, ToolFormat, resolve_tool_format
from streamrl.learner.batching import STALE, drop_reason, oldest_usable_version

__all__ = [
    "Consumption",
    "Sample",
    "SampleDecoder",
    "ToolCallText",
    "ToolResultText",
    "Turn",
    "batch_samples",
    "consumed",
    "filter_reason",
    "load_tokenizer",
    "pick",
    "task_of",
]

# How the tool formats answer calls: tagged `<tool_result name="...">`, hermes templates
# (Qwen's) `<tool_response>`; streamrl.envs.formats.*Format.observe.
_RESULTS = re.compile(
    r'<tool_result(?: name="(?P<name>[^"]*)")?>\n?(?P<tagged>.*?)\n?</tool_result>'
    r"|<tool_response>\n?(?P<hermes>.*?)\n?</tool_response>",
    re.DOTALL,
)
_FAILED_RESULT = "Error:"  # streamrl.envs.tools: every failed call's result starts so


@dataclass(frozen=True)
class ToolCallText:
    """A tool call as the model wrote it: named and `positional` arguments; `error`: why it
    could not be read (the environment answered it with an error)."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None
    positional: tuple[Any, ...] = ()


@dataclass(frozen=True)
class ToolResultText:
    """A tool result as the environment answered; `ok` False for an error result."""

    name: str
    content: str
    ok: bool


@dataclass(frozen=True)
class Turn:
    """A run of tokens of one kind: `role` "model" (sampled, loss mask 1) or "environment"
    (mask 0). `versions`: the weight versions that sampled a model turn's tokens (several when
    weights changed mid-turn); empty for an environment turn."""

    role: str
    text: str
    tokens: int
    versions: tuple[int, ...] = ()
    tool_calls: tuple[ToolCallText, ...] = ()
    tool_results: tuple[ToolResultText, ...] = ()


@dataclass(frozen=True)
class Consumption:
    """What the learner did with a group: `step` consumed it (0 with `pretrain_step`: value
    pre-training), at policy `version` (what staleness is measured against); `staleness` =
    version − the group's policy_version; `filtered`: why this response was not trained on
    (None: it was)."""

    step: int
    version: int
    staleness: int
    filtered: str | None = None
    pretrain_step: int | None = None


@dataclass(frozen=True)
class Sample:
    """One response of a group, decoded (module docstring). `position`: the group's place in
    the stream (commit log number, group offset), when read from it. `task`: the dataset part of
    the prompt id (`<dataset>:<row>`). `versions`: every version that sampled a token of this
    response; `policy_version`: the group's (the oldest of its responses'). `learner`: None when
    it is not known what the learner did with it; `learner_note` then says why."""

    prompt_id: str
    task: str
    generator_id: str
    position: tuple[int, int] | None
    response: int
    group_size: int
    prompt: str
    prompt_tokens: int
    ground_truth: str
    turns: tuple[Turn, ...]
    reward: float
    raw_score: float
    reward_terms: dict[str, float]
    turn_rewards: tuple[float, ...]
    finish_reason: str
    truncated: bool
    policy_version: int
    versions: tuple[int, ...]
    tool_calls: int
    tool_errors: int
    tools_offered: bool
    learner: Consumption | None = None
    learner_note: str = ""

    @property
    def response_tokens(self) -> int:
        return sum(t.tokens for t in self.turns)

    def to_json(self) -> dict[str, Any]:
        """Plain JSON values, texts whole."""
        return asdict(self) | {"response_tokens": self.response_tokens}


def load_tokenizer(config: RunConfig, path: str | None = None) -> Any:
    """The run's tokenizer (`model.tokenizer`, else `model.path`; `path` wins). Raises
    `ModelPathError` naming the fix when it is not on this machine."""
    from transformers import AutoTokenizer

    from streamrl.models import resolve_model_path

    model = config.model
    where = resolve_model_path(path or model.tokenizer or model.path)
    return AutoTokenizer.from_pretrained(where, trust_remote_code=model.trust_remote_code)


def task_of(group: ScoredGroup) -> str:
    """The dataset a group's prompt came from: its prompt id less the row (`<dataset>:<row>`)."""
    return group.prompt_id.rpartition(":")[0] or group.prompt_id


class SampleDecoder:
    """Decodes groups into `Sample`s with one tokenizer and tool format."""

    def __init__(self, tokenizer: Any, tool_format: ToolFormat) -> None:
        self.tokenizer, self.tool_format = tokenizer, tool_format

    @classmethod
    def for_run(cls, config: RunConfig, tokenizer_path: str | None = None) -> SampleDecoder:
        """The decoder of the run's tokenizer and tool format (`generator.env.tool_format`)."""
        tokenizer = load_tokenizer(config, tokenizer_path)
        template = getattr(tokenizer, "chat_template", None)
        name = resolve_tool_format(config.generator.env.tool_format, template)
        return cls(tokenizer, TOOL_FORMATS[name])

    def samples(
        self,
        group: ScoredGroup,
        responses: Sequence[int] | None = None,
        position: tuple[int, int] | None = None,
    ) -> list[Sample]:
        """Responses `responses` (default: all) of `group`, in that order."""
        prompt = self._text(group.prompt_tokens)
        chosen = range(group.group_size) if responses is None else responses
        return [self._sample(group, i, prompt, position) for i in chosen]

    def _sample(
        self, group: ScoredGroup, i: int, prompt: str, position: tuple[int, int] | None
    ) -> Sample:
        mask, versions = group.effective_loss_masks[i], group.effective_token_versions[i]
        return Sample(
            prompt_id=group.prompt_id,
            task=task_of(group),
            generator_id=group.generator_id,
            position=position,
            response=i,
            group_size=group.group_size,
            prompt=prompt,
            prompt_tokens=len(group.prompt_tokens),
            ground_truth=group.ground_truth,
            turns=self._turns(group.response_tokens[i], mask, versions, group.tools_offered),
            reward=float(group.rewards[i]),
            raw_score=float(group.raw_scores[i]),
            reward_terms={name: float(v[i]) for name, v in (group.reward_terms or {}).items()},
            turn_rewards=tuple(float(r) for r in group.effective_turn_rewards[i]),
            finish_reason=str(group.finish_reasons[i]),
            truncated=bool(group.truncated[i]),
            policy_version=int(group.policy_version),
            versions=_versions(versions[mask == 1]),
            tool_calls=int(group.episode_stat("tool_calls")[i]),
            tool_errors=int(group.episode_stat("tool_errors")[i]),
            tools_offered=bool(group.tools_offered),
        )

    def _turns(
        self, tokens: np.ndarray, mask: np.ndarray, versions: np.ndarray, tools: bool
    ) -> tuple[Turn, ...]:
        """The response as runs of equal loss mask: model turns and environment turns."""
        cuts = [0, *(np.flatnonzero(np.diff(mask)) + 1).tolist(), len(tokens)]
        turns = []
        for start, end in itertools.pairwise(cuts):
            if start == end:
                continue
            text = self._text(tokens[start:end])
            if not mask[start]:
                turns.append(Turn("environment", text, end - start, tool_results=_results(text)))
                continue
            calls = self.tool_format.parse(text) if tools else []
            written = tuple(
                ToolCallText(c.name, dict(c.arguments), c.error, tuple(c.positional)) for c in calls
            )
            sampled_by = _versions(versions[start:end])
            turns.append(Turn("model", text, end - start, sampled_by, tool_calls=written))
        return tuple(turns)

    def _text(self, tokens: np.ndarray) -> str:
        return self.tokenizer.decode(
            np.asarray(tokens).tolist(), skip_special_tokens=False,
            clean_up_tokenization_spaces=False,
        )  # fmt: skip


def _versions(versions: np.ndarray) -> tuple[int, ...]:
    return tuple(int(v) for v in np.unique(versions))


def _results(text: str) -> tuple[ToolResultText, ...]:
    found = []
    for match in _RESULTS.finditer(text):
        content = match.group("tagged") if match.group("hermes") is None else match.group("hermes")
        ok = not content.lstrip().startswith(_FAILED_RESULT)
        found.append(ToolResultText(match.group("name") or "", content, ok))
    return tuple(found)


def filter_reason(group: ScoredGroup, response: int, version: int, config: RunConfig) -> str | None:
    """Why the learner, at policy `version`, did not train on response `response` of `group`
    (None: it did), by its own rules: the staleness and dynamic-sampling filters drop the
    group (`drop_reason`), the overlong filter masks a truncated response out of the loss."""
    max_staleness, algorithm = config.learner.max_staleness, config.algorithm
    oldest = oldest_usable_version(version, max_staleness)
    reason = drop_reason(group, oldest, algorithm.dynamic_sampling)
    if reason == STALE:
        return (
            f"stale: dropped, staleness {version - group.policy_version} > learner.max_staleness="
            f"{max_staleness} (learner at v{version}, group sampled from v{group.policy_version})"
        )
    if reason is not None:
        return (
            f"no signal: dropped, every response scored {float(group.raw_scores[0]):g} "
            "(algorithm.dynamic_sampling)"
        )
    if algorithm.overlong.filter and bool(group.truncated[response]):
        return "overlong: truncated, masked out of the loss (algorithm.overlong.filter)"
    return None


def consumed(
    sample: Sample, group: ScoredGroup, step: int, version: int, config: RunConfig,
    pretrain_step: int | None = None,
) -> Sample:  # fmt: skip
    """`sample` with what the learner at `step` and `version` did with it."""
    staleness = version - group.policy_version
    reason = filter_reason(group, sample.response, version, config)
    return replace(sample, learner=Consumption(step, version, staleness, reason, pretrain_step))


def pick(groups: Sequence[ScoredGroup], count: int) -> list[tuple[int, int]]:
    """`count` (group, response) pairs to show of `groups`: one response per group in order,
    then a second round, and so on — of each group its best reward first, then its worst, its
    second best, ... (even groups start with the best, odd ones with the worst), so a table
    shows what was rewarded beside what was not."""
    orders = []
    for g, group in enumerate(groups):
        ranked = np.argsort(-np.asarray(group.rewards, np.float64), kind="stable").tolist()
        ranked = ranked[::-1] if g % 2 else ranked
        orders.append([ranked[k // 2] if k % 2 == 0 else ranked[-1 - k // 2]
                       for k in range(len(ranked))])  # fmt: skip
    chosen: list[tuple[int, int]] = []
    for turn in range(max((len(o) for o in orders), default=0)):
        for g, order in enumerate(orders):
            if len(chosen) == count:
                return chosen
            if turn < len(order):
                chosen.append((g, order[turn]))
    return chosen


def batch_samples(
    decoder: SampleDecoder,
    groups: Sequence[ScoredGroup],
    versions: Sequence[int],
    step: int,
    count: int,
    config: RunConfig,
) -> list[Sample]:
    """`count` samples (`pick`) of a step's trained `groups`, read by the learner at
    `versions[i]` each: what the wandb table and the flow's artifact show of step `step`."""
    out = []
    for g, response in pick(groups, count):
        (sample,) = decoder.samples(groups[g], [response])
        out.append(consumed(sample, groups[g], step, int(versions[g]), config))
    return out
