"""Retention of weight versions: deleting retired versions and garbage, never under a reader.

(The layout and what a version is: `storage.weights.publish`.) Whatever no committed manifest
names is garbage: retired versions, dead publishes' folders, and in a kept version the part
records and the files of a publish that died before the one that committed it (readers open
only what the manifest names, and a manifest never changes, so deleting the rest cannot hurt
one).

The chain rule: a version is built from its chain — the nearest full version and the deltas
after it (`WeightStore.chain`) — so every version on the chain of a kept version is kept, and so
is the version LATEST names. Retired versions go newest first, each one's manifest before its
files: a reader that finds a link of its chain gone also finds the version it builds gone, so
a version removed under it reads as vanished (`WeightVersionNotFoundError`), never as corrupt
(`WeightIntegrityError`, which readers skip for good).

The learner retains after each commit (`WeightWriter.retain`, its lease as the fence).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import TYPE_CHECKING

from storage.weights.manifest import WeightManifest
from storage.weights.versions import (
    MANIFEST_NAME,
    WeightIntegrityError,
    WeightStore,
    WeightVersionNotFoundError,
    check_int,
)

if TYPE_CHECKING:
    from storage.control.fencing import Fence

__all__ = ["retain_versions"]


def retain_versions(store: WeightStore, keep: int, fence: Fence | None = None) -> list[int]:
    """Delete all but the newest `keep` committed versions of `store` and what they need, and
    what no kept manifest names; returns the deleted versions, ascending.

    Never deletes the version LATEST names, nor a version on the chain of a kept one (the
    full version and deltas a kept delta is built from). Also deletes manifest-less
    folders older than the newest committed version (dead publishes; newer ones may be in
    progress and stay) and, in kept versions, the objects their manifest does not name.
    Versions go newest first, each one's manifest before its files, so a reader still
    reading one gets `WeightVersionNotFoundError` (vanished), never `WeightIntegrityError`
    (see the module docstring): keep >= 2 leaves generators one publication of slack.
    `fence` (the writer's lease) is checked before each version is deleted and before the
    leftovers are; what it raises stops the deletions.
    """
    check_int(keep, 1, "keep")
    folders = store.folders()
    committed = sorted(v for v, names in folders.items() if MANIFEST_NAME in names)
    kept = {*committed[-keep:], store.read_latest()}
    protected, manifests = _with_their_chains(store, kept, committed)
    newest = max(committed, default=0)
    doomed = sorted(
        (v for v in folders if v not in protected and (v in committed or v < newest)),
        reverse=True,  # a chain's link never goes before the versions built on it
    )
    for version in doomed:
        _check(fence)
        if version in committed:  # manifest first: the version is gone for new readers
            store.fs.rm_file(store.path(version, MANIFEST_NAME))
        store.fs.rm(store.path(version), recursive=True)
    leftovers = [
        store.path(version, name)
        for version, manifest in sorted(manifests.items())  # every one of them is kept
        for name in sorted(folders.get(version, set()) - _named(manifest))
    ]
    if leftovers:
        _check(fence)
        store.fs.rm(leftovers)
    return sorted(doomed)


def _with_their_chains(
    store: WeightStore, kept: set[int | None], committed: Collection[int]
) -> tuple[set[int | None], dict[int, WeightManifest]]:
    """`kept` and every version on the chain of a committed one in it, with the manifests read
    on the way. A broken chain keeps what is left of it: readers detect it."""
    protected = set(kept)
    manifests: dict[int, WeightManifest] = {}
    for version in sorted(v for v in kept if v in committed):
        base: int | None = version
        while base is not None:
            protected.add(base)
            try:
                manifests[base] = manifests.get(base) or store.read_manifest(base)
            except (WeightVersionNotFoundError, WeightIntegrityError):
                break  # a broken chain: readers detect it; keep what is left of it
            base = manifests[base].base
    return protected, manifests


def _named(manifest: WeightManifest) -> set[str]:
    """The objects of a committed version's folder that its readers need."""
    return {MANIFEST_NAME, *(entry.file for entry in manifest.files)}


def _check(fence: Fence | None) -> None:
    if fence is not None:
        fence.check()
