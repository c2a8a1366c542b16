"""Shared fixtures: a real S3 server (SeaweedFS on 127.0.0.1) and run locations on both backends;
each test module leaves the process environment as it found it and torch.distributed
uninitialised."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest
import torch.distributed as dist

from storage.fs import Location, open_location
from storage.seaweedfs import SeaweedFS


@pytest.fixture(scope="module", autouse=True)
def _environment_restored() -> Iterator[None]:
    """Restore `os.environ` after each module. An in-process vLLM CPU engine sets variables
    for its whole process — LD_PRELOAD (its tcmalloc, torch's libgomp), thread binding — which
    every child process a later module starts (stub commands, components) would inherit."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module", autouse=True)
def _no_process_group_left() -> Iterator[None]:
    """Fail a module that leaves torch.distributed initialised. A later module's `Topology`
    would adopt that group, and an unclosed in-process vLLM engine destroys the default group
    whenever the garbage collector gets to it — in the middle of some later test."""
    yield
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()  # so that the modules after this one start clean
        pytest.fail(
            "torch.distributed is still initialised after this module: close every Engine "
            "(`with Engine(...)` or `engine.close()`) and exit every Topology it started",
            pytrace=False,
        )


@pytest.fixture(scope="session")
def seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    """One SeaweedFS server for the whole session, killed at the end."""
    with SeaweedFS(data_dir=tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server


@pytest.fixture(params=["local", "s3"])
def backend(request: pytest.FixtureRequest) -> str:
    """Storage tests run once on a local folder and once on SeaweedFS."""
    return request.param


@pytest.fixture
def run_uri_and_options(backend: str, tmp_path, request: pytest.FixtureRequest) -> tuple[str, dict]:
    """A fresh, empty run root on the selected backend: (uri, storage_options)."""
    if backend == "local":
        return str(tmp_path / "run"), {}
    server: SeaweedFS = request.getfixturevalue("seaweedfs")
    return f"s3://{server.bucket}/runs/{uuid.uuid4().hex[:12]}", server.storage_options


@pytest.fixture
def run_location(run_uri_and_options: tuple[str, dict]) -> Location:
    """`run_uri_and_options` opened as a Location."""
    uri, options = run_uri_and_options
    return open_location(uri, storage_options=options)
