"""`Sample`s (`streamrl.learner.samples`) for people: a terminal block per sample
(`format_sample`), a closing line on what was read (`format_summary`), and the markdown of the
flow's samples artifact (`samples_markdown`). Every text is cut to a bound (`elide`: its start
and end kept, the characters cut counted), so the output stays readable whatever the model wrote.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from streamrl.learner.sample_table import elide, transcript
from streamrl.learner.samples import Sample
from streamrl.runs.samples import SampleReport

__all__ = ["format_sample", "format_summary", "learner_line", "samples_markdown"]


def _header(sample: Sample) -> str:
    where = "" if sample.position is None else f" · log {sample.position[0]} group "
    where += "" if sample.position is None else str(sample.position[1])
    return (
        f"{sample.prompt_id} · response {sample.response + 1} of {sample.group_size}{where} · "
        f"{sample.generator_id}"
    )


def _scores(sample: Sample) -> str:
    terms = "".join(f", {k}={v:.3f}" for k, v in sorted(sample.reward_terms.items()))
    per_turn = ""
    if sample.turn_rewards:
        per_turn = " · turn rewards " + " ".join(f"{r:+.2f}" for r in sample.turn_rewards)
    turns = sum(t.role == "model" for t in sample.turns)
    tools = ""
    if sample.tools_offered or sample.tool_calls:
        tools = f" · tool calls {sample.tool_calls}, failed {sample.tool_errors}"
    truncated = " (truncated)" if sample.truncated and sample.finish_reason != "max_tokens" else ""
    return (
        f"reward {sample.reward:+.3f} (raw {sample.raw_score:g}{terms}){per_turn} · finish "
        f"{sample.finish_reason}{truncated} · {turns} model turn{'s' * (turns != 1)}, "
        f"{sample.response_tokens} tokens{tools}"
    )


def learner_line(sample: Sample) -> str:
    """Who sampled it and what the learner did with it."""
    sampled = f"sampled by v{','.join(map(str, sample.versions)) or '-'}"
    if sample.versions != (sample.policy_version,):
        sampled += f" (group v{sample.policy_version})"
    learner = sample.learner
    if learner is None:
        return f"{sampled} · learner: {sample.learner_note}"
    step = f"step {learner.step}"
    if learner.pretrain_step is not None:
        step = f"value pre-training {learner.pretrain_step}"
    fate = "trained" if learner.filtered is None else f"NOT TRAINED — {learner.filtered}"
    at = f"at v{learner.version}, staleness {learner.staleness}"
    return f"{sampled} · learner: {step} {at}, {fate}"


def _indented(text: str) -> str:
    return "\n".join(f"  {line}" for line in text.splitlines() or [""])


def format_sample(sample: Sample, max_chars: int) -> str:
    """One sample for a terminal; the prompt, each turn and each tool result cut to `max_chars`."""
    lines = [
        f"━━ {_header(sample)}",
        _scores(sample),
        learner_line(sample),
        f"expected: {elide(sample.ground_truth, 200)}",
        f"prompt ({sample.prompt_tokens} tokens):",
        _indented(elide(sample.prompt, max_chars)),
        "response:",
        _indented(transcript(sample, max_chars)),
    ]
    return "\n".join(lines)


def format_summary(report: SampleReport, limit: int) -> str:
    """What was read to find the samples: a line for stderr."""
    shown = len(report.samples)
    more = " (--limit reached)" if shown >= limit else ""
    released = ""
    if report.released_before_seq:
        released = (
            f"; the segments of log numbers below {report.released_before_seq} were released "
            "(storage.stream_retention=consumed)"
        )
    return (
        f"{shown} sample{'s' * (shown != 1)}{more} from {report.groups_read} group"
        f"{'s' * (report.groups_read != 1)} read of {report.groups_in_stream} in the stream"
        f"{released}"
    )


def _fenced(text: str) -> str:
    """`text` in a code block whose fence no run of backticks inside it can close."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return f"{fence}text\n{text}\n{fence}"


def _inline(text: str) -> str:
    """`text` as inline code on one line (backticks and line breaks replaced)."""
    return "`" + " ".join(text.replace("`", "'").split()) + "`"


def samples_markdown(samples: Sequence[Sample], title: str, max_chars: int) -> str:
    """The flow's samples artifact: each sample's scores, versions and fate, its prompt and its
    transcript, each of those two cut to `max_chars`."""
    lines = [f"### {title}", ""]
    if not samples:
        lines.append("No sample to show.")
    for n, sample in enumerate(samples, 1):
        lines += [
            f"#### {n}. `{sample.prompt_id}` — response {sample.response + 1} of "
            f"{sample.group_size}",
            "",
            f"{_scores(sample)}  ",
            f"{learner_line(sample)}  ",
            f"expected: {_inline(elide(sample.ground_truth, 200))}",
            "",
            f"**prompt** ({sample.prompt_tokens} tokens)",
            "",
            _fenced(elide(sample.prompt, max_chars)),
            "",
            "**response**",
            "",
            _fenced(elide(transcript(sample), max_chars)),
            "",
        ]
    return "\n".join(lines)
