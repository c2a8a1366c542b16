"""What a component's flow run says when the run it is given is not on its machine's disk."""

from __future__ import annotations

import pytest

from flows.components import open_run_config
from storage.fs import StorageError
from streamrl.supervision.policy import NOT_RESTARTED


def test_a_local_run_missing_on_this_machine_names_shared_storage(tmp_path):
    elsewhere = tmp_path / "made-on-another-machine"
    with pytest.raises(StorageError, match=r"s3:// run URI") as raised:
        open_run_config(str(elsewhere))
    assert NOT_RESTARTED in str(raised.value)  # the parent fails the run instead of retrying
    assert not elsewhere.exists()  # nothing made where the run was expected


def test_a_folder_that_is_no_run_is_reported_as_such(tmp_path):
    with pytest.raises(StorageError, match=r"run\.json not found"):
        open_run_config(str(tmp_path))
