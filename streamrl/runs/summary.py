"""What a run achieved, for the console: `run_summary` reads it from the run's metrics, and
`format_summary` writes it as the lines `streamrl run` and `make demo` end with; after a stop,
`resume_point` says what a resume starts from, read from the run's storage."""

from __future__ import annotations

from typing import Any

from storage.fs import Location
from streamrl.learner.metrics_records import INITIAL, read_metrics

__all__ = ["format_summary", "resume_point", "run_summary"]


def run_summary(run: Location, window: int = 5) -> dict[str, Any]:
    """What a finished (or running) run achieved, from its learner metrics: reward and
    accuracy (a supervised run: its loss, and the held-out loss) over the first and the last
    `window` steps, mean learner tokens/s, steps done, and their curves as text charts
    (`charts`)."""
    from streamrl.runs.curves import curve_data, text_charts

    steps = [m for m in read_metrics(run) if "value_pretrain_step" not in m]
    if not steps:
        return {"run_uri": run.uri, "steps": 0}

    def mean(rows: list[dict[str, Any]], key: str) -> float:
        values = [float(r[key]) for r in rows if key in r]
        return sum(values) / len(values) if values else float("nan")

    first, last = steps[:window], steps[-window:]
    if "pref/loss" in steps[-1]:  # a preference run
        return {
            "run_uri": run.uri,
            "steps": int(steps[-1]["step"]),
            "policy_version": int(steps[-1].get("policy_version", 0)),
            "preference": True,
            "loss_first": mean(first, "pref/loss"),
            "loss_last": mean(last, "pref/loss"),
            "accuracy_first": mean(first, "pref/accuracy"),
            "accuracy_last": mean(last, "pref/accuracy"),
            "heldout": _heldout(steps, "pref/eval_accuracy"),
            "heldout_likelihood": _heldout(steps, "pref/eval_likelihood_accuracy"),
            "learner_tokens_per_s": mean(steps, "perf/learner_tokens_per_s"),
            "window": min(window, len(steps)),
            "charts": text_charts(curve_data(steps), titles=("preference accuracy",)),
        }
    if "sft/loss" in steps[-1]:  # a supervised run
        return {
            "run_uri": run.uri,
            "steps": int(steps[-1]["step"]),
            "policy_version": int(steps[-1].get("policy_version", 0)),
            "supervised": True,
            "loss_first": mean(first, "sft/loss"),
            "loss_last": mean(last, "sft/loss"),
            "heldout": _heldout(steps, "sft/heldout_loss"),
            "learner_tokens_per_s": mean(steps, "perf/learner_tokens_per_s"),
            "window": min(window, len(steps)),
            "charts": text_charts(curve_data(steps), titles=("supervised loss",)),
        }
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


def _heldout(steps: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """(step, value) of a held-out metric, step 0 for the weights the run started from."""
    initial = [(0, float(steps[0][f"{INITIAL}{key}"]))] if f"{INITIAL}{key}" in steps[0] else []
    return initial + [(int(m["step"]), float(m[key])) for m in steps if key in m]


def format_summary(summary: dict[str, Any]) -> str:
    """The summary as a few lines for the console."""
    if not summary.get("steps"):
        return f"run {summary['run_uri']}: no learner steps yet"
    n = summary["window"]
    if summary.get("supervised"):  # a supervised run: its loss
        heldout = summary["heldout"]
        return "\n".join(
            [
                f"run:       {summary['run_uri']}  ({summary['steps']} supervised steps, "
                f"weights v{summary['policy_version']})",
                f"loss:      {summary['loss_first']:.4f} (first {n} steps) → "
                f"{summary['loss_last']:.4f} (last {n})",
                *_heldout_line(heldout),
                f"learner:   {summary['learner_tokens_per_s']:.0f} tokens/s",
                *(f"  {line}" for line in summary.get("charts", ())),
            ]
        )
    if summary.get("preference"):  # a preference run: its loss and pair accuracy
        return "\n".join(
            [
                f"run:       {summary['run_uri']}  ({summary['steps']} preference steps, "
                f"weights v{summary['policy_version']})",
                f"loss:      {summary['loss_first']:.4f} (first {n} steps) → "
                f"{summary['loss_last']:.4f} (last {n})",
                f"pair acc:  {summary['accuracy_first']:.3f} → {summary['accuracy_last']:.3f}",
                *_heldout_line(summary["heldout"]),
                *_heldout_line(summary.get("heldout_likelihood", []), "likelihood"),
                f"learner:   {summary['learner_tokens_per_s']:.0f} tokens/s",
                *(f"  {line}" for line in summary.get("charts", ())),
            ]
        )
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


def _heldout_line(heldout: list[tuple[int, float]], label: str = "held-out") -> list[str]:
    if not heldout:
        return []
    (first_step, first), (last_step, last) = heldout[0], heldout[-1]
    return [f"{label + ':':<10} {first:.4f} (step {first_step}) → {last:.4f} (step {last_step})"]


def resume_point(run: Location) -> str:
    """Where a resume of a stopped run starts, against the steps its learner finished: read
    from its storage (the last committed checkpoint, the learner's progress record), so the
    line is true whatever the processes said before they ended."""
    from storage.checkpoints.dcp import CheckpointStore
    from storage.stream.learner_progress import read_learner_progress

    progress = read_learner_progress(run)
    finished = progress.step if progress is not None else 0
    saved = CheckpointStore(run).latest_committed() or 0
    if saved >= finished:
        if saved == 0:
            return "no step was finished: the run resumes from step 1"
        return f"checkpoint at step {saved} committed: the run resumes from step {saved + 1}"
    lost = f"step {finished}" if finished == saved + 1 else f"steps {saved + 1}-{finished}"
    where = f"the last is at step {saved}" if saved else "no checkpoint"
    return f"{where}: the run resumes from step {saved + 1}, training {lost} again"
