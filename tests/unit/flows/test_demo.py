"""What the demo's terminal says after a Ctrl-C: where a resume starts, against the steps the
learner finished (its progress record) and the last committed checkpoint."""

from __future__ import annotations

from torch import nn

from flows.demo import _resume_point
from storage.checkpoints.dcp import CheckpointStore, LearnerState, ModelState
from storage.fs import open_location
from storage.stream.learner_progress import LearnerProgress, write_learner_progress


def _finished(run_uri: str, step: int) -> None:
    write_learner_progress(open_location(run_uri), LearnerProgress(step=step, policy_version=step))


def _checkpoint(run_uri: str, step: int) -> None:
    model = nn.Linear(2, 2)
    CheckpointStore(open_location(run_uri)).save(
        {"policy": ModelState(model)}, LearnerState(step=step, policy_version=step)
    )


def test_a_learner_stopped_before_its_first_checkpoint_resumes_from_step_0(tmp_path) -> None:
    run_uri = str(tmp_path / "run")
    _finished(run_uri, 2)
    assert _resume_point(run_uri) == (
        "the learner stopped before it could checkpoint: a resume starts from step 0 "
        "(no checkpoint yet) and trains steps 1-2 again"
    )


def test_steps_after_the_last_checkpoint_are_named(tmp_path) -> None:
    run_uri = str(tmp_path / "run")
    _checkpoint(run_uri, 2)
    _finished(run_uri, 3)
    assert _resume_point(run_uri).endswith("a resume starts from step 2 and trains step 3 again")


def test_a_checkpoint_of_the_last_finished_step_loses_nothing(tmp_path) -> None:
    run_uri = str(tmp_path / "run")
    _checkpoint(run_uri, 3)
    _finished(run_uri, 3)
    assert _resume_point(run_uri) == "the checkpoint of step 3 holds every step it finished"
    empty = str(tmp_path / "empty")  # stopped before the learner finished anything
    assert _resume_point(empty) == "the learner had finished no step: a resume starts from step 0"
