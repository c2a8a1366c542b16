"""Where a generator stands in its data shard, kept in the run so a restart continues there.

A prompt is *taken* when submitted to the engine, *collected* when its scored group goes to the
stream writer (or is dropped by the reward-failure policy) and *committed* by the writer's next
segment. After each commit the ledger writes `GeneratorProgress`: the first position not
committed, and the committed positions after it. A restart (`resume_prompts`) iterates from
that first position and skips the committed ones, so it redoes exactly what its predecessor
lost — prompts in flight, being scored or in the open segment — and repeats nothing committed.
The one exception: a death between a commit and the progress write that follows repeats that
segment's prompts (at most `segment_groups` of them); nothing is ever skipped.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace

from storage.control.progress import GeneratorProgress, read_progress, write_progress
from storage.fs import Location
from streamrl.data import DatasetError, PromptIterator, PromptPosition, PromptSource

__all__ = ["PromptLedger", "resume_prompts"]


def resume_prompts(
    run: Location,
    writer_id: str,
    source: PromptSource,
    *,
    shard: int,
    num_shards: int,
    first_start: PromptPosition,
) -> tuple[PromptIterator, GeneratorProgress]:
    """Count one more start of `writer_id` in the run and return its prompts, continuing after
    what its earlier lives committed (from `first_start` on its first start), with its
    progress record (`starts` counts this start). A dataset whose prompts differ from those
    its earlier lives walked is refused (`DatasetError`) before anything is written: their
    positions would skip or repeat prompts."""
    previous = read_progress(run, writer_id)
    if previous is None:
        previous = GeneratorProgress(writer_id, next_prompt=(first_start.epoch, first_start.offset))
    elif previous.dataset and previous.dataset != source.fingerprint:
        raise DatasetError(
            f"generator {writer_id} of run {run.uri} walked the prompts of {source.path} as "
            f"{previous.dataset}; they are now {source.fingerprint}, so its saved position "
            "would skip or repeat prompts. Restore the dataset the run was started with (the "
            "same file, or the streamrl version that bundled it), or start a new run "
            "(another storage.run_uri)"
        )
    progress = replace(
        previous,
        starts=previous.starts + 1,
        updated_at=time.time(),
        dataset=source.fingerprint,
    )
    write_progress(run, progress)
    prompts = source.iterate(
        shard,
        num_shards,
        start=PromptPosition(*progress.next_prompt),
        skip=[PromptPosition(*p) for p in progress.committed_after],
    )
    return prompts, progress


class PromptLedger:
    """Tracks taken → collected → committed prompts of one generator (module docstring) and,
    given a run and a progress record, writes the progress after each commit."""

    def __init__(
        self,
        prompts: PromptIterator,
        *,
        run: Location | None = None,
        progress: GeneratorProgress | None = None,
    ) -> None:
        self.prompts = prompts
        self.run, self.progress = run, progress
        self._taken: dict[str, PromptPosition] = {}  # request id → position, not collected
        self._collected: list[PromptPosition] = []  # since the last commit
        self._committed: set[PromptPosition] = set()  # after the first uncommitted position
        self._paused_before = 0.0  # flow control's pauses in earlier lives
        self._cpu_before = 0.0  # CPU seconds of earlier lives
        if progress is not None:
            self._committed = {PromptPosition(*p) for p in progress.committed_after}
            self._paused_before, self._cpu_before = progress.paused_s, progress.cpu_s

    def take(self, request_id: str, position: PromptPosition) -> None:
        """The prompt at `position` (the iterator's `position` before it was drawn) went to the
        engine as `request_id`."""
        self._taken[request_id] = position

    def collected(self, request_id: str) -> None:
        """`request_id`'s group went to the stream writer (or was dropped on purpose)."""
        self._collected.append(self._taken.pop(request_id))

    def committed(
        self,
        paused_s: float = 0.0,
        task_levels: Mapping[str, int] | None = None,
        cpu_s: float = 0.0,
    ) -> GeneratorProgress | None:
        """Everything collected is now in a committed segment: update (and, with a run,
        write) the progress record; `paused_s` is this life's time paused by flow control,
        `task_levels` its curriculum's levels (None: as recorded), `cpu_s` the CPU seconds
        this life's processes have used."""
        self._committed.update(self._collected)
        self._collected = []
        first = min(self._taken.values(), default=self.prompts.position)
        self._committed = {p for p in self._committed if p > first}
        if self.progress is None:
            return None
        self.progress = replace(
            self.progress,
            next_prompt=(first.epoch, first.offset),
            committed_after=tuple((p.epoch, p.offset) for p in sorted(self._committed)),
            paused_s=self._paused_before + paused_s,
            cpu_s=self._cpu_before + cpu_s,
            updated_at=time.time(),
            task_levels=self.progress.task_levels if task_levels is None else dict(task_levels),
        )
        if self.run is not None:
            write_progress(self.run, self.progress)
        return self.progress
