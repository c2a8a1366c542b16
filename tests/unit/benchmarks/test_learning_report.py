"""The learning study's goals (`benchmarks/learning_report.py`): what #29 reports as met or not
met is computed here, so each verdict is checked on cells whose answer is known."""

from __future__ import annotations

import pytest

from benchmarks.learning_report import Arm, goals, recorded

BASE = {"version": 0, "val/acc_greedy": 0.70, "val/avg@4": 0.22, "k": 4}


def cell(arm: str, seed: int, accuracy: dict[int, tuple[float, float]], wall_s: float) -> dict:
    """A finished cell: (greedy, pass@1) at each evaluated step, one learner record a step."""
    last = max(accuracy)
    return {
        "arm": arm,
        "seed": seed,
        "wall_s": wall_s,
        "steps": [{"step": s, "time": 1000.0 + s} for s in range(1, last + 1)],
        "evaluations": [
            {"version": s, "val/acc_greedy": g, "val/avg@4": p, "k": 4}
            for s, (g, p) in accuracy.items()
        ],
    }


def arm(name: str, per_seed: list[dict[int, tuple[float, float]]], wall_s: float = 900.0) -> Arm:
    bases = dict.fromkeys(range(len(per_seed)), BASE)
    cells = [cell(name, seed, acc, wall_s + seed) for seed, acc in enumerate(per_seed)]
    return Arm(name, cells, bases)


def report(*arms: Arm) -> dict[str, str]:
    bases = dict.fromkeys(range(3), BASE)
    lines = [line for line in goals({a.name: a for a in arms}, bases) if line.startswith("- ")]
    return {line.split(":", 1)[0][2:]: line.split(":", 1)[1] for line in lines}


def test_an_arm_is_above_the_base_only_when_both_metrics_gain_more_than_the_spread() -> None:
    learned = arm("grpo", [{8: (0.9, 0.8)}, {8: (0.92, 0.82)}, {8: (0.91, 0.81)}])
    # greedy gains 0.01 ± 0.2: inside its spread, though pass@1 gains clearly
    noisy = arm("dr_grpo", [{8: (0.5, 0.8)}, {8: (0.9, 0.8)}, {8: (0.73, 0.8)}])
    found = report(learned, noisy)
    assert found["GRPO above the base model by more than the seed spread"].startswith(" met")
    assert found["Dr. GRPO above the base model by more than the seed spread"].startswith(
        " not met"
    )


def test_a_verdict_waits_for_three_seeds() -> None:
    found = report(arm("dapo", [{8: (0.9, 0.8)}, {8: (0.92, 0.82)}]))
    assert found["DAPO above the base model by more than the seed spread"].startswith(" open")


@pytest.mark.parametrize(
    ("dapo_acc", "outcome", "greedy_where"),
    [
        ((0.95, 0.91), " met", "inside"),  # ahead on both, greedy by less than the spread
        ((0.93, 0.95), " not met", "inside"),  # behind on greedy by 0.01, spread 0.02
        ((0.80, 0.95), " not met", "outside"),  # behind on greedy by far more than the spread
    ],
)
def test_dapo_against_grpo_weighs_both_metrics_and_says_where_each_gap_lies(
    dapo_acc: tuple[float, float], outcome: str, greedy_where: str
) -> None:
    greedy, sampled = dapo_acc
    dapo = arm(
        "dapo", [{32: (greedy - 0.02, sampled)}, {32: dapo_acc}, {32: (greedy + 0.02, sampled)}]
    )
    grpo = arm("grpo", [{32: (0.92, 0.88)}, {32: (0.94, 0.90)}, {32: (0.96, 0.92)}])
    line = report(dapo, grpo)["DAPO ≥ GRPO at step 32"]
    assert line.startswith(outcome)
    assert f"greedy {greedy:.3f} ± 0.020 against 0.940 ± 0.020" in line
    assert f"{greedy_where} the spread 0.020); pass@1" in line


def test_sync_matches_async_only_when_every_step_and_metric_is_within_the_spread() -> None:
    same = [{8: (0.90, 0.50), 32: (0.95, 0.90)}, {8: (0.92, 0.52), 32: (0.97, 0.92)}] * 2
    asynchronous = arm("dapo", same[:3], wall_s=900.0)
    synchronous = arm("dapo_sync", same[1:], wall_s=1100.0)
    found = report(asynchronous, synchronous)
    key = next(k for k in found if k.startswith("Synchronous and asynchronous DAPO reach the same"))
    assert found[key].startswith(" met")
    assert (
        "seed by seed: 1.22, 1.22, 1.22 (mean 1.22 ± 0.00)"
        in found["Asynchronous DAPO gets there sooner"]
    )
    assert found["Asynchronous DAPO gets there sooner"].startswith(" met")

    # pass@1 at step 8 falls behind by 0.2 while greedy matches everywhere
    slower = [{8: (c[8][0], c[8][1] - 0.2), 32: c[32]} for c in same[1:]]
    found = report(asynchronous, arm("dapo_sync", slower, wall_s=800.0))
    assert found[key].startswith(" not met")
    assert "pass@1, step 8" in found[key]
    assert found["Asynchronous DAPO gets there sooner"].startswith(" not met")


def test_a_metric_only_some_cells_recorded_says_over_how_many() -> None:
    grpo = arm("grpo", [{8: (0.9, 0.8)}, {8: (0.92, 0.82)}, {8: (0.91, 0.81)}])
    assert recorded(grpo, grpo.run_means("actor/entropy", last=8)) == "—"
    for step in grpo.cells[2]["steps"]:
        step["actor/entropy"] = 2.0 - step["step"] / 10  # 1.9, 1.8, ... 1.2 at step 8
    assert grpo.run_means("actor/entropy", last=2) == [pytest.approx(1.25)]
    assert recorded(grpo, grpo.run_means("actor/entropy", last=2)) == "1.25 (1 of 3)"


def test_opd_reaches_dapo_only_when_an_early_step_matches_dapos_last_on_both_metrics() -> None:
    dapo = arm("dapo", [{8: (0.85, 0.5), 32: (0.95, 0.9)}] * 3)
    fast = arm("opd", [{8: (0.96, 0.91), 32: (0.97, 0.95)}] * 3)
    for cell_ in fast.cells:  # the reverse KL falls in every run
        for record in cell_["steps"]:
            record["opd/reverse_kl"] = 1.0 / record["step"]
    found = report(dapo, fast)
    line = found["OPD reaches DAPO's step-32 held-out accuracy within a third of its steps"]
    assert line.startswith(" met")
    assert "greedy: DAPO step 32 0.950, OPD step 8 0.960" in line
    assert found["OPD's reverse KL to the teacher falls"].startswith(" met")

    slow = arm("opd", [{8: (0.96, 0.80), 32: (0.97, 0.95)}] * 3)  # pass@1 gets there at 32 only
    line = report(dapo, slow)[
        "OPD reaches DAPO's step-32 held-out accuracy within a third of its steps"
    ]
    assert line.startswith(" not met")
    assert "not recorded" in report(dapo, slow)["OPD's reverse KL to the teacher falls"]


def test_the_policy_loss_arms_are_judged_on_two_seeds_and_against_grpo() -> None:
    grpo = arm("grpo", [{32: (0.92, 0.88)}, {32: (0.94, 0.90)}, {32: (0.96, 0.92)}])
    gspo = arm("gspo", [{32: (0.95, 0.90)}, {32: (0.97, 0.92)}])
    found = report(grpo, gspo)
    assert found["GSPO above the base model by more than the seed spread"].startswith(" met")
    assert found["GSPO ≥ GRPO at step 32"].startswith(" met")  # two seeds are enough here
    one = report(grpo, arm("cispo", [{32: (0.95, 0.90)}]))
    assert one["CISPO above the base model by more than the seed spread"].startswith(" open")
    assert one["CISPO ≥ GRPO at step 32"].startswith(" open")
    two = report(arm("dapo", [{32: (0.95, 0.90)}, {32: (0.97, 0.92)}]))
    assert two["DAPO above the base model by more than the seed spread"].startswith(" open")
