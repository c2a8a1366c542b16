"""What a run achieved, for the console: `run_summary` reads it from the run's metrics, and
`format_summary` writes it as the lines `streamrl run` and `make demo` end with."""

from __future__ import annotations

from typing import Any

from storage.fs import Location

__all__ = ["format_summary", "run_summary"]


def run_summary(run: Location, window: int = 5) -> dict[str, Any]:
    """What a finished (or running) run achieved, from its learner metrics: reward and
    accuracy over the first and the last `window` steps, mean learner tokens/s, steps done,
    and the reward and accuracy curves as text charts (`charts`)."""
    from streamrl.learner.reporting import read_metrics
    from streamrl.runs.curves import curve_data, text_charts

    steps = [m for m in read_metrics(run) if "value_pretrain_step" not in m]
    if not steps:
        return {"run_uri": run.uri, "steps": 0}

    def mean(rows: list[dict[str, Any]], key: str) -> float:
        values = [float(r[key]) for r in rows if key in r]
        return sum(values) / len(values) if values else float("nan")

    first, last = steps[:window], steps[-window:]
    return {
        "run_uri": run.uri,
        "steps": int(steps[-1]["step"]),
        "policy_version": int(steps[-1].get("policy_version", 0)),
        "reward_first": mean(first, "rollout/reward_mean"),
        "reward_last": mean(last, "rollout/reward_mean"),
        "acc_first": mean(first, "rollout/acc"),
        "acc_last": mean(last, "rollout/acc"),
        "learner_tokens_per_s": mean(steps, "perf/learner_tokens_per_s"),
        "window": min(window, len(steps)),
        "charts": text_charts(curve_data(steps), titles=("reward (mean)", "accuracy")),
    }


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a few lines for the console."""
    if not summary.get("steps"):
        return f"run {summary['run_uri']}: no learner steps yet"
    n = summary["window"]
    return "\n".join(
        [
            f"run:       {summary['run_uri']}  ({summary['steps']} steps, weights "
            f"v{summary['policy_version']})",
            f"reward:    {summary['reward_first']:+.3f} (first {n} steps) → "
            f"{summary['reward_last']:+.3f} (last {n})",
            f"accuracy:  {summary['acc_first']:.3f} → {summary['acc_last']:.3f}",
            f"learner:   {summary['learner_tokens_per_s']:.0f} tokens/s",
            *(f"  {line}" for line in summary.get("charts", ())),
        ]
    )
