"""Where a recipe writes, checked before any stage runs (`overlapping_folders`).

A recipe writes each stage's folder, `<root>/<stage>` (a run, an evaluation's result, an
exported model), and the models later stages start from, `<models_dir>/<stage>`. An export that
lands in a stage's folder overwrites what that stage wrote — with `models_dir` = the root, a
stage's model is exported over that very stage's run — so `models_dir` must lie apart: neither
the recipe's root, nor a folder above it, nor a stage's folder or a folder inside one. The
default `<root>/models` is apart (no stage may be named `models`).

Folders are compared as the storage sees them: a local path (or `file://` URI) resolved against
the working directory and through symlinks; an `s3://` (or `s3a://`) URI by its bucket and key
segments, so `s3://b/runs/x` and `s3://b/runs/x-2` are apart while `s3://b/runs` and
`s3://b/runs/x/` nest. A local folder and a remote one never overlap.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

__all__ = ["folder_key", "overlapping_folders"]

FolderKey = tuple[str, tuple[str, ...]]


def folder_key(uri: str) -> FolderKey:
    """`uri` as (store, path segments): two URIs name the same folder exactly when their keys
    are equal, and one folder lies inside another when its segments extend the other's."""
    scheme, separator, rest = uri.partition("://")
    if not separator or scheme == "file":
        return "file", Path(rest if separator else uri).resolve().parts
    store = "s3" if scheme in ("s3", "s3a") else scheme
    return store, tuple(segment for segment in rest.split("/") if segment)


def _within(inner: FolderKey, outer: FolderKey) -> bool:
    """Whether `inner` is `outer` or lies inside it."""
    (inner_store, inner_parts), (outer_store, outer_parts) = inner, outer
    return inner_store == outer_store and inner_parts[: len(outer_parts)] == outer_parts


def overlapping_folders(root: str, models_dir: str, stages: Sequence[str]) -> list[str]:
    """The problems of `models_dir` against the recipe's `root` and its `stages`' folders
    (`<root>/<stage>`), each naming both folders and the fix; [] when it lies apart."""
    models, top = folder_key(models_dir), folder_key(root)
    fix = (
        f"give models_dir a folder of its own, neither {root}, nor above it, nor in a stage's "
        f"folder (the default for a local root: {root}/models)"
    )
    if _within(top, models):
        if models == top:
            return [
                f"models_dir {models_dir} is the recipe's root {root}: each stage's model "
                f"would be exported to {root}/<stage>, over that stage's own folder; {fix}"
            ]
        return [
            f"models_dir {models_dir} contains the recipe's root {root}: the models exported "
            f"to {models_dir}/<stage> would share it with the recipe's own folders; {fix}"
        ]
    problems = []
    for stage in stages:
        folder = f"{root}/{stage}"
        if _within(models, folder_key(folder)):
            where = "is" if models == folder_key(folder) else "lies inside"
            problems.append(
                f"models_dir {models_dir} {where} stage {stage}'s folder {folder}: the models "
                f"exported to {models_dir}/<stage> would be written into that stage's own "
                f"output; {fix}"
            )
    return problems
