"""A run's status (`streamrl.runs.status.RunStatus`, read from storage) as text: the console table
`streamrl status` prints, and the one-line JSON object of `streamrl status --json`.

Nothing here reads storage: both are pure functions of the record, so the table and the JSON
always agree with each other and with what `read_status` found.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from streamrl.runs.status import GeneratorStatus, RunStatus, StreamStatus

__all__ = ["format_status", "to_json"]


def to_json(status: RunStatus) -> str:
    """The status as one line of strict JSON (non-finite numbers become null)."""
    body = asdict(status)
    del body["stream"]["groups_before"]
    body["newest_write_age_s"] = status.newest_write_age_s
    return json.dumps(_finite(body), allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


_METRICS_SHOWN = (  # (key, label, format): the rollout row, then the learner row
    (
        ("rollout/reward_mean", "reward", "{:+.3f}"),
        ("rollout/acc", "acc", "{:.3f}"),
        ("rollout/response_len_mean", "length", "{:.1f}"),
        ("rollout/truncated_frac", "truncated", "{:.2f}"),
        ("sft/loss", "loss", "{:.4f}"),  # a supervised run's
        ("sft/heldout_loss", "held-out loss", "{:.4f}"),
        ("sft/epoch", "epoch", "{:.2f}"),
        ("pref/loss", "pref loss", "{:.4f}"),  # a preference run's
        ("pref/margin", "margin", "{:+.3f}"),
        ("pref/accuracy", "pref acc", "{:.3f}"),
        ("pref/eval_accuracy", "held-out pref acc", "{:.3f}"),
    ),
    (
        ("actor/pg_loss", "pg_loss", "{:.4f}"),
        ("actor/clip_frac", "clipped", "{:.3f}"),  # per the policy loss: tokens or responses
        ("actor/gate_weight_mean", "gate", "{:.3f}"),  # SAPO's
        ("opd/reverse_kl", "reverse KL", "{:.4f}"),  # on-policy distillation's, to the teacher
        ("rollout/teacher_s_per_group", "teacher", "{:.2f}s/group"),
        ("perf/learner_tokens_per_s", "tokens/s", "{:.0f}"),
        ("perf/step_s", "step", "{:.2f}s"),
    ),
)


def mismatch_summary(metrics: dict[str, Any]) -> str | None:
    """The gap between the generator's and the learner's log-probs in a line (k3 KL over all
    groups and over fresh ones, the largest token ratio, what the correction rejected), or
    None when the step logged none."""
    if not _num(kl := metrics.get("mismatch/kl_k3")):
        return None
    parts = [f"KL {kl:.2e}"]
    if _num(fresh := metrics.get("mismatch/kl_k3_fresh")):
        parts.append(f"fresh {fresh:.2e}")
    if _num(top := metrics.get("mismatch/ratio_max")):
        parts.append(f"ratio max {top:.2f}")
    dropped = [
        f"{label} {metrics[key]:.1%}"
        for key, label in (
            ("mismatch/rs_token_frac", "tokens rejected"),
            ("mismatch/veto_frac", "responses vetoed"),
        )
        if _num(metrics.get(key)) and metrics[key] > 0
    ]
    return "  ".join(parts + dropped) + " (last step)"


def episode_summary(metrics: dict[str, Any]) -> str | None:
    """Multi-turn rollouts in a line (turns, tool calls, environment time, straggler wait,
    finish reasons), or None for single-turn ones offered no tools (one turn each, no call)."""
    turns, calls = metrics.get("rollout/turns_mean"), metrics.get("rollout/tool_calls_mean")
    offered = metrics.get("rollout/tools_offered_frac", 0.0)
    if not (_num(turns) and _num(calls)) or (turns <= 1 and calls == 0 and not offered):
        return None
    reasons = ", ".join(
        f"{key[len('rollout/finish_') : -len('_frac')]} {value:.2f}"
        for key, value in sorted(metrics.items())
        if key.startswith("rollout/finish_") and key.endswith("_frac") and _num(value)
    )
    return (
        f"turns {turns:.2f}  tool calls {calls:.2f} (errors "
        f"{metrics.get('rollout/tool_errors_mean', 0.0):.2f})  env "
        f"{metrics.get('rollout/env_s_mean', 0.0):.2f}s  straggler wait "
        f"{metrics.get('rollout/wait_s_mean', 0.0):.2f}s  finished: {reasons}"
    )


def format_status(status: RunStatus) -> str:
    """The status as a compact table for the console."""
    return "\n".join(f"{label:<11}{text}".rstrip() for label, text in _rows(status))


def _rows(s: RunStatus) -> Iterator[tuple[str, str]]:
    now = s.read_at
    yield "run", f"{s.uri}  ({s.algorithm}, model {s.model}, created {s.created_at})"
    yield "state", f"{s.state} — {s.state_reason}"
    for i, warning in enumerate(s.health):  # the learner's, from storage: streamrl.runs.health
        yield "health" if i == 0 else "", warning.removeprefix("health: ")
    version = "none" if s.policy_version is None else f"v{s.policy_version}"
    yield "learner", f"step {s.step}/{s.total_steps}, policy version {version}"
    checkpoint = "none yet"
    if s.checkpoint_step is not None:
        checkpoint = f"step {s.checkpoint_step} (policy v{s.checkpoint_version})"
    yield "checkpoint", checkpoint
    weights = "none published yet"
    if s.weight_version is not None:
        kept = " ".join(str(v) for v in s.weight_versions)
        weights = f"v{s.weight_version} latest (kept: {kept})"
    yield "weights", weights
    if s.algorithm == "sft":  # a supervised run: no stream, generators or evaluator
        yield from _metrics_rows(s)
        return
    st = s.stream
    written = f"{st.groups} groups in {st.commits} commits"
    if st.newest_commit_at is not None:
        written += f", newest {_age(now - st.newest_commit_at)}"
    yield "stream", written
    if st.quarantined:
        skipped = f"{_plural(st.quarantined, 'segment')} ({st.quarantined_groups} groups)"
        yield "", f"quarantined: {skipped}, skipped by readers and left out of the lag"
    if s.consumed_groups is None:
        yield "", "consumed: none yet (no checkpoint or learner step)"
    else:
        yield "", f"consumed: {s.consumed_groups} groups ({s.consumed_source})"
        yield "", f"lag: {s.lag_groups} groups written, not yet consumed"
    if st.commits:
        yield "rewards", f"{_reward_failures(st)} in all"
    if st.judge_verdicts:
        frac = st.judge_unparsed / st.judge_verdicts
        yield (
            "",
            (
                f"judges: {st.judge_unparsed} of {st.judge_verdicts} verdicts unparsed "
                f"(judge/unparsed_frac {frac:.3f}; scored by each term's on_unparsed rule)"
            ),
        )
    yield from _metrics_rows(s)
    for i, (task, responses, correct) in enumerate(st.tasks):
        last = s.last_metrics.get(f"task/{task}/acc") if s.last_metrics else None
        recent = f", last step {last:.3f}" if _num(last) else ""
        yield (
            "tasks" if i == 0 else "",
            f"{task}: acc {correct / max(responses, 1):.3f} over {responses} responses{recent}",
        )
    if not st.generators:
        yield "generators", "none has committed yet"
    for g in st.generators:
        restarts = _lives(g)
        failures = ""
        if g.reward_errors or g.reward_timeouts or g.reward_dropped_groups:
            failures = f"; {_reward_failures(g)}"
        yield (
            "generators" if g is st.generators[0] else "",
            f"{g.writer_id}: {g.groups} groups in {g.commits} commits, sampling v"
            f"{g.policy_version}, last {_age(now - g.last_commit_at)}{restarts}{failures}",
        )
    if s.last_eval is not None:
        values = "  ".join(
            f"{k} {v:.3g}" for k, v in s.last_eval.items() if k.startswith("val/") and _num(v)
        )
        yield "eval", f"v{s.last_eval.get('version', '?')}: {values}  ({s.evaluations} in all)"


def _metrics_rows(s: RunStatus) -> Iterator[tuple[str, str]]:
    m = s.last_metrics
    if m is None:
        yield "metrics", "no learner step logged yet"
        return
    when = f", {_age(s.read_at - m['time'])}" if _num(m.get("time")) else ""
    if "value_pretrain_step" in m:
        yield "metrics", f"value pre-training step {m['value_pretrain_step']}{when}"
    else:
        rollout, perf = (
            "  ".join(f"{name} {fmt.format(m[k])}" for k, name, fmt in shown if _num(m.get(k)))
            for shown in _METRICS_SHOWN
        )
        yield "metrics", f"step {m.get('step')}{when}: {rollout}"
        yield "", perf
        if (episodes := episode_summary(m)) is not None:
            yield "episodes", episodes
    if _num(m.get("stream/staleness_mean")):
        mean, top = m["stream/staleness_mean"], m.get("stream/staleness_max", 0)
        yield "staleness", f"mean {mean:.2f}, max {top:.0f} versions (last step)"
    if (gap := mismatch_summary(m)) is not None:
        yield "mismatch", gap
    dropped = []
    for scope, suffix in (("last step", ""), ("in all", "_total")):
        counts = [f"{int(m[k])} {label}" for k, label in _dropped_keys(suffix) if _num(m.get(k))]
        if counts:
            dropped.append(f"{scope}: {', '.join(counts)}")
    if dropped:
        yield "dropped", "; ".join(dropped) + " groups"


def _dropped_keys(suffix: str) -> list[tuple[str, str]]:
    return [
        (f"stream/dropped_stale{suffix}", "stale"),
        (f"stream/dropped_zero_var{suffix}", "zero-variance"),
    ]


def _num(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f}s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f}m ago"
    return f"{seconds / 3600:.1f}h ago"


def _lives(g: GeneratorStatus) -> str:
    """ ", 1 restart, 2 resumes": the later starts of a generator's index."""
    restarts = len(g.incarnations) - 1 if g.restarts is None else g.restarts
    counts = [_plural(n, word) for n, word in ((restarts, "restart"), (g.resumes, "resume")) if n]
    return "".join(f", {count}" for count in counts)


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def _reward_failures(counts: GeneratorStatus | StreamStatus) -> str:
    """Failed reward calls and the groups they kept out of the stream."""
    return (
        f"{_plural(counts.reward_errors, 'reward error')}, "
        f"{_plural(counts.reward_timeouts, 'reward timeout')}, "
        f"{_plural(counts.reward_dropped_groups, 'group')} dropped for them"
    )
