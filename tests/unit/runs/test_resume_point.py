"""What a stopped run's last line says (`streamrl run`, the demo): where a resume starts, against
the steps the learner finished (its progress record) and the last committed checkpoint."""

from __future__ import annotations

from torch import nn

from storage.checkpoints.dcp import CheckpointStore, LearnerState, ModelState
from storage.fs import open_location
from storage.stream.learner_progress import LearnerProgress, write_learner_progress
from streamrl.runs.summary import resume_point


def _finished(run_uri: str, step: int) -> None:
    write_learner_progress(open_location(run_uri), LearnerProgress(step=step, policy_version=step))


def _checkpoint(run_uri: str, step: int) -> None:
    model = nn.Linear(2, 2)
    CheckpointStore(open_location(run_uri)).save(
        {"policy": ModelState(model)}, LearnerState(step=step, policy_version=step)
    )


def test_a_learner_stopped_before_its_first_checkpoint_resumes_from_step_1(tmp_path) -> None:
    run_uri = str(tmp_path / "run")
    _finished(run_uri, 2)
    assert resume_point(open_location(run_uri)) == (
        "no checkpoint: the run resumes from step 1, training steps 1-2 again"
    )


def test_steps_after_the_last_checkpoint_are_named(tmp_path) -> None:
    run_uri = str(tmp_path / "run")
    _checkpoint(run_uri, 2)
    _finished(run_uri, 3)
    assert resume_point(open_location(run_uri)) == (
        "the last is at step 2: the run resumes from step 3, training step 3 again"
    )


def test_a_checkpoint_of_the_last_finished_step_loses_nothing(tmp_path) -> None:
    run_uri = str(tmp_path / "run")
    _checkpoint(run_uri, 3)
    _finished(run_uri, 3)
    assert resume_point(open_location(run_uri)) == (
        "checkpoint at step 3 committed: the run resumes from step 4"
    )
    empty = str(tmp_path / "empty")  # stopped before the learner finished anything
    assert resume_point(open_location(empty)) == "no step was finished: the run resumes from step 1"
