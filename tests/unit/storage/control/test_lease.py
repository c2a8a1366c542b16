"""The run's lease (one learner per run), on a local folder and on SeaweedFS."""

from __future__ import annotations

import json
import time
import uuid

import pytest
from fsspec.implementations.memory import MemoryFileSystem

from storage.control.lease import (
    LeaseHeldError,
    LeaseLostError,
    LeaseRecord,
    RunLease,
    _epochs,
    read_lease,
)
from storage.fs import Location, StorageError, create_once


def test_a_second_learner_refuses_naming_the_holder_and_how_to_take_over(run_location: Location):
    # A ttl of 9 s (a renewal every 3 s): under CI's load a renewal to SeaweedFS was seen to
    # lag past a 3 s ttl, and the newcomer rightly took the run over.
    with RunLease.acquire(run_location, ttl_s=9, holder="node-a pid 1") as first:
        assert first.check() == 1
        started = time.monotonic()
        with pytest.raises(LeaseHeldError) as refused:
            RunLease.acquire(run_location, ttl_s=30, holder="node-b pid 2")
        assert time.monotonic() - started < 6  # a renewal period (ttl / 3), not the whole ttl
        message = str(refused.value)
        assert "node-a pid 1" in message
        assert "--take-over" in message
        assert "renewed it" in message
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


# -- clocks, stores and outages ------------------------------------------------------------


class _Store(MemoryFileSystem):
    """An object store with the faults of real ones, switched on per test: `ignores_conditions`
    (a gateway that drops If-None-Match), `lost_create_response` (a create whose response was
    lost: the client's retry is refused although the first request landed), `down` (an
    outage: every call fails)."""

    protocol = "faultymem"
    ignores_conditions = False
    lost_create_response = False
    down = False

    def _fail_if_down(self) -> None:
        if self.down:
            raise ConnectionError("the store cannot be reached")

    def pipe_file(self, path, value, mode="overwrite", **kwargs):  # type: ignore[no-untyped-def]
        self._fail_if_down()
        if self.ignores_conditions:
            mode = "overwrite"
        super().pipe_file(path, value, mode=mode, **kwargs)
        if mode == "create" and self.lost_create_response and "/lease/" in path:
            raise FileExistsError(path)  # what the retry of the landed request got back

    def cat_file(self, path, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._fail_if_down()
        return super().cat_file(path, *args, **kwargs)

    def exists(self, path, **kwargs):  # type: ignore[no-untyped-def]
        self._fail_if_down()
        return super().exists(path, **kwargs)


def _store_location(**faults: bool) -> Location:
    fs = _Store(skip_instance_cache=True)
    fs.store = {}  # each test its own objects
    fs.pseudo_dirs = [""]
    for fault, on in faults.items():
        setattr(fs, fault, on)
    name = uuid.uuid4().hex
    return Location(fs, f"/bucket-{name}/run", f"faultymem://bucket-{name}/run")


def test_a_holder_whose_clock_is_behind_keeps_its_lease() -> None:
    """Its records look long expired to a newcomer's clock; the newcomer watches, sees the
    renewals and refuses (before: it took the run from a live learner)."""
    run = _store_location()
    an_hour_behind = lambda: time.time() - 3600  # noqa: E731
    with RunLease.acquire(run, ttl_s=1.5, holder="slow clock", clock=an_hour_behind) as holder:
        assert read_lease(run).expires_at < time.time() - 3000
        with pytest.raises(LeaseHeldError, match=r"slow clock .*renewed it"):
            RunLease.acquire(run, ttl_s=30, holder="newcomer")
        assert holder.check() == 1


def test_a_crashed_holder_whose_clock_was_ahead_is_taken_over_after_its_ttl() -> None:
    run = _store_location()
    an_hour_ahead = lambda: time.time() + 3600  # noqa: E731
    crashed = RunLease.acquire(run, ttl_s=1.5, holder="fast clock", clock=an_hour_ahead)
    crashed._stop.set()  # it stops renewing, as a killed process would
    started = time.monotonic()
    with RunLease.acquire(run, ttl_s=30, holder="newcomer") as successor:
        assert 1.5 <= time.monotonic() - started < 5  # its ttl of 1.5 s, on our clock
        assert successor.epoch == 2


def test_a_create_whose_response_was_lost_is_recognised_as_ours() -> None:
    run = _store_location()
    run.fs.lost_create_response = True
    with RunLease.acquire(run, ttl_s=30, holder="retried") as lease:
        assert lease.check() == 1
        assert read_lease(run).holder == "retried"


def test_create_once_tells_its_own_landed_request_from_another_writers(
    run_location: Location,
) -> None:
    path = run_location.join("control", "claim.json")
    assert create_once(run_location.fs, path, b"mine")
    assert create_once(run_location.fs, path, b"mine")  # a retry of the same request
    assert not create_once(run_location.fs, path, b"theirs")
    assert run_location.fs.cat_file(path) == b"mine"


def test_a_store_that_ignores_conditional_writes_is_refused_naming_it() -> None:
    run = _store_location(ignores_conditions=True)
    with pytest.raises(StorageError, match=r"faultymem://bucket-\w+/run ignores conditional"):
        RunLease.acquire(run, ttl_s=30)
    assert _epochs(run) == []  # nothing written


def test_a_holder_whose_record_was_overwritten_stops_at_its_next_check() -> None:
    """Should a store still let a second create through, the holder reads its record back."""
    run = _store_location()
    holder = RunLease.acquire(run, ttl_s=30, holder="first")
    record = LeaseRecord(1, "second", time.time() + 30, ttl_s=30)
    run.fs.pipe_file(run.join("control", "lease", "00000001.json"), record.to_json())
    with pytest.raises(LeaseLostError, match="names second"):
        holder.check()
    holder.release()
    assert read_lease(run).holder == "second"  # the lost holder did not write over it


def test_release_during_an_outage_says_so_and_lets_the_lease_lapse(
    caplog: pytest.LogCaptureFixture,
) -> None:
    run = _store_location()
    holder = RunLease.acquire(run, ttl_s=30, holder="cut off")
    run.fs.down = True
    holder.release()  # before: ConnectionError from the look for a successor
    assert "could not release the lease" in caplog.text
    assert "the store cannot be reached" in caplog.text
