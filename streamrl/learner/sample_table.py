"""Samples for display: a response's transcript and the rows of the learner's wandb table.

`transcript` renders a `Sample` (`streamrl.learner.samples`) turn by turn, its tool calls and
results below each turn; `elide` bounds a text, keeping its start and its end (where the answer
is), saying how much was cut. `SampleTable` is the learner's wandb table (rank 0): at each step
the reporter logs to wandb, `logging.log_samples` responses (`pick`) of the batch it trained on,
each prompt and transcript cut to `SAMPLE_MAX_CHARS`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from streamrl.config.run import RunConfig
from streamrl.learner.batching import StreamBatch
from streamrl.learner.reporting import MetricsReporter
from streamrl.learner.samples import Sample, SampleDecoder, ToolCallText, batch_samples

__all__ = ["SAMPLE_MAX_CHARS", "TABLE_COLUMNS", "SampleTable", "elide", "table_rows", "transcript"]

log = logging.getLogger(__name__)

SAMPLE_MAX_CHARS = 2000
"""Most characters of one text (a prompt, a transcript) in a wandb table cell or an artifact."""


def elide(text: str, max_chars: int) -> str:
    """`text` in at most about `max_chars` characters: its start and its end, with how many
    characters were cut between them."""
    if len(text) <= max_chars:
        return text
    head = max_chars // 2
    tail = max_chars - head
    cut = len(text) - head - tail
    return f"{text[:head]}\n… [{cut} characters cut] …\n{text[len(text) - tail :]}"


def transcript(sample: Sample, max_chars: int | None = None) -> str:
    """The response as text: each turn under a header (`[model v3 · 12 tokens]`), its tool
    calls (`→`) and results (`←`) below it; each turn's text cut to `max_chars` (None: whole)."""
    lines = []
    for turn in sample.turns:
        text = turn.text if max_chars is None else elide(turn.text, max_chars)
        sampled_by = " v" + ",".join(map(str, turn.versions)) if turn.versions else ""
        lines.append(f"[{turn.role}{sampled_by} · {turn.tokens} tokens]")
        lines.append(text)
        for call in turn.tool_calls:
            shown = f"unreadable call: {call.error}" if call.error else _call_text(call)
            lines.append(f"  → {shown}")
        for result in turn.tool_results:
            content = result.content if max_chars is None else elide(result.content, max_chars)
            state = "" if result.ok else " FAILED"
            lines.append(f"  ← {result.name or 'tool'}{state}: {content}")
    return "\n".join(lines)


def _call_text(call: ToolCallText) -> str:
    """`name(1, expression="2 + 3")`: each argument's value as JSON."""

    def shown(value: Any) -> str:
        return json.dumps(value, ensure_ascii=False, default=str)

    named = (f"{name}={shown(value)}" for name, value in call.arguments.items())
    return f"{call.name}({', '.join([*map(shown, call.positional), *named])})"


TABLE_COLUMNS = (
    "step", "prompt_id", "response", "reward", "raw_score", "reward_terms", "finish_reason",
    "versions", "staleness", "turns", "tool_calls", "tool_errors", "filtered", "prompt",
    "transcript",
)  # fmt: skip


def table_rows(samples: Sequence[Sample], max_chars: int = SAMPLE_MAX_CHARS) -> list[list[Any]]:
    """One row of `TABLE_COLUMNS` per sample; the prompt and the transcript each cut to
    `max_chars`."""
    rows = []
    for s in samples:
        learner = s.learner
        terms = ", ".join(f"{k}={v:.3f}" for k, v in sorted(s.reward_terms.items()))
        rows.append([
            learner.step if learner else None, s.prompt_id, s.response, s.reward, s.raw_score,
            terms, s.finish_reason, ",".join(map(str, s.versions)),
            learner.staleness if learner else None,
            sum(t.role == "model" for t in s.turns), s.tool_calls, s.tool_errors,
            (learner.filtered or "") if learner else s.learner_note,
            elide(s.prompt, max_chars), elide(transcript(s), max_chars),
        ])  # fmt: skip
    return rows


class SampleTable:
    """Rank 0: a wandb table (`samples`) of `logging.log_samples` responses of the batch each
    logged step trained on (`pick`), through the metrics reporter; the tokenizer is loaded at
    the first table."""

    def __init__(self, config: RunConfig, reporter: MetricsReporter) -> None:
        self.config, self.reporter = config, reporter
        self._decoder: SampleDecoder | None = None
        self._off = False  # a table failed once: the rest of the run goes without

    def log(self, batch: StreamBatch, step: int) -> None:
        """The table of `step`, when the reporter logs one then. It is for people to read: a
        failure to make it (a tokenizer that cannot be loaded here) is logged once and turns
        the tables off; training goes on."""
        count = self.config.logging.log_samples
        if self._off or not count or not self.reporter.logs_tables(step):
            return
        try:
            self._log(batch, step, count)
        except Exception as exc:
            self._off = True
            log.warning("the wandb samples table is off for this run: making it failed at "
                        "step %d: %r", step, exc)  # fmt: skip

    def _log(self, batch: StreamBatch, step: int, count: int) -> None:
        if self._decoder is None:
            self._decoder = SampleDecoder.for_run(self.config)
        versions = [int(s) + g.policy_version for s, g in zip(batch.staleness, batch.groups,
                                                                strict=True)]  # fmt: skip
        samples = batch_samples(self._decoder, batch.groups, versions, step, count, self.config)
        self.reporter.log_table("samples", TABLE_COLUMNS, table_rows(samples), step)
