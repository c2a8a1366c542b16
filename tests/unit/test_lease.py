"""The run's lease (one learner per run), on a local folder and on SeaweedFS."""

from __future__ import annotations

import json
import time

import pytest

from storage.fs import Location
from storage.lease import LeaseHeldError, LeaseLostError, RunLease, read_lease


def test_a_second_learner_refuses_naming_the_holder_and_how_to_take_over(run_location: Location):
    with RunLease.acquire(run_location, ttl_s=30, holder="node-a pid 1") as first:
        assert first.check() == 1
        with pytest.raises(LeaseHeldError) as refused:
            RunLease.acquire(run_location, ttl_s=30, holder="node-b pid 2")
        message = str(refused.value)
        assert "node-a pid 1" in message
        assert "--take-over" in message
        assert "expires" in message
        assert first.check() == 1  # the refusal wrote nothing
        assert read_lease(run_location).holder == "node-a pid 1"


def test_a_released_lease_is_taken_at_once_with_the_next_epoch(run_location: Location):
    RunLease.acquire(run_location, ttl_s=30).release()
    assert read_lease(run_location).released
    with RunLease.acquire(run_location, ttl_s=30) as second:
        assert second.epoch == 2
        assert second.check() == 2


def test_taking_over_fences_the_holder_which_then_refuses_every_write(run_location: Location):
    holder = RunLease.acquire(run_location, ttl_s=30, holder="old")
    successor = RunLease.acquire(run_location, ttl_s=30, take_over=True, holder="new")
    assert successor.epoch == holder.epoch + 1
    with pytest.raises(LeaseLostError, match="took the run over"):
        holder.check()
    assert not holder.held
    holder.release()  # a fenced holder does not mark the successor's run released
    assert not read_lease(run_location).released
    assert successor.check() == 2
    successor.release()


def test_an_expired_lease_is_taken_over_and_the_old_holder_stops_at_its_next_check(
    run_location: Location,
):
    holder = RunLease.acquire(run_location, ttl_s=1.5, holder="stopped")
    holder._stop.set()  # as if the process were stopped (SIGSTOP): no more renewals
    time.sleep(1.6)
    assert holder.check() == 1  # lapsed, but nobody took over: an outage is ridden out
    successor = RunLease.acquire(run_location, ttl_s=30, holder="next")
    assert successor.epoch == 2
    with pytest.raises(LeaseLostError, match=r"took the run over \(lease epoch 2\)"):
        holder.check()
    successor.release()


def test_a_live_holder_keeps_its_lease_by_renewing_it(run_location: Location):
    # A ttl of 3 s: on a loaded machine a renewal to SeaweedFS (every ttl/3) was seen to lag
    # past a 1.5 s ttl.
    with RunLease.acquire(run_location, ttl_s=3.0) as holder:
        time.sleep(6.5)  # more than two ttls: renewed every ttl/3
        assert holder.check() == 1
        assert read_lease(run_location).expires_at > time.time()
        with pytest.raises(LeaseHeldError):
            RunLease.acquire(run_location, ttl_s=1.5)


def test_a_malformed_lease_record_is_reported_and_only_taken_over_explicitly(
    run_location: Location,
):
    folder = run_location.join("control", "lease")
    run_location.fs.makedirs(folder, exist_ok=True)
    run_location.fs.pipe_file(f"{folder}/00000004.json", b"{oops")
    run_location.fs.pipe_file(f"{folder}/99999999.json.tmp", b"{}")  # not a record's name
    with pytest.raises(LeaseHeldError, match=r"00000004\.json is malformed.*--take-over"):
        RunLease.acquire(run_location, ttl_s=30)
    with RunLease.acquire(run_location, ttl_s=30, take_over=True) as lease:
        assert lease.epoch == 5
    record = json.loads(run_location.fs.cat_file(run_location.join("control/lease/00000005.json")))
    assert record["epoch"] == 5
    assert record["released"] is True
