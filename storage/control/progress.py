"""Generator progress: how often each generator index has started and where its prompts stand.

    <run>/generators/<writer_id>.json    `GeneratorProgress`, rewritten whole at each start and
                                         after each segment its generator commits

A restarted generator reads it to continue its data shard where its commits stopped, and to
seed itself apart from its earlier lives. One process per writer id is assumed (generator
indexes are claimed); the object is replaced atomically (a rename locally, one PUT on S3), so
a reader sees the old record or the new one.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from storage.fs import Location, replace_object

__all__ = ["GeneratorProgress", "read_all_progress", "read_progress", "write_progress"]


@dataclass(frozen=True)
class GeneratorProgress:
    """One generator index's progress (positions are (epoch, offset) of its data shard).

    Invariants: `starts` ≥ 0 counts the processes that have started as `writer_id`;
    `next_prompt` is the first position whose group is not committed to the stream;
    `committed_after` lists, ascending, the positions after it whose groups are committed
    (groups finish out of order). Written only after the commits it describes. `paused_s`:
    seconds flow control held this index back, over all its lives, as of its last commit;
    `cpu_s`: CPU seconds its processes used (the generator, its engine, its reward and
    environment workers), the same way. `dataset`: the fingerprint of the prompts the positions
    refer to (`streamrl.data.PromptSource.fingerprint`; empty in a record written before it was
    kept).
    `task_levels`: the curriculum level of each task, as of its last commit (`streamrl.data.
    curriculum`; empty without one).
    """

    writer_id: str
    starts: int = 0
    next_prompt: tuple[int, int] = (0, 0)
    committed_after: tuple[tuple[int, int], ...] = ()
    paused_s: float = 0.0
    cpu_s: float = 0.0
    updated_at: float = 0.0
    dataset: str = ""
    task_levels: dict[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "next_prompt", tuple(self.next_prompt))
        after = tuple(tuple(p) for p in self.committed_after)
        object.__setattr__(self, "committed_after", after)
        if self.starts < 0 or min(self.next_prompt) < 0:
            raise ValueError(f"progress of {self.writer_id}: starts and positions are ≥ 0")
        levels = self.task_levels
        if not isinstance(levels, dict) or not all(
            isinstance(k, str) and type(v) is int and v >= 0 for k, v in levels.items()
        ):
            raise ValueError(f"progress of {self.writer_id}: task_levels maps tasks to levels ≥ 0")
        if list(after) != sorted(set(after)) or (after and after[0] <= self.next_prompt):
            raise ValueError(
                f"progress of {self.writer_id}: committed_after must ascend, after next_prompt"
            )

    def to_json(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def from_json(cls, data: bytes) -> GeneratorProgress:
        try:
            return cls(**json.loads(data))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"generator progress record is unreadable: {exc}") from None


def _path(run: Location, writer_id: str) -> str:
    return run.join("generators", f"{writer_id}.json")


def read_progress(run: Location, writer_id: str) -> GeneratorProgress | None:
    """The progress of `writer_id`, or None before its first start."""
    try:
        return GeneratorProgress.from_json(run.fs.cat_file(_path(run, writer_id)))
    except FileNotFoundError:
        return None


def write_progress(run: Location, progress: GeneratorProgress) -> None:
    """Replace the progress record of `progress.writer_id` (atomically)."""
    replace_object(run, _path(run, progress.writer_id), progress.to_json())


def read_all_progress(run: Location) -> list[GeneratorProgress]:
    """Every generator index's progress record, by writer id."""
    folder = run.join("generators")
    try:
        names = sorted(run.fs.ls(folder, detail=False))
    except FileNotFoundError:
        return []
    return [
        GeneratorProgress.from_json(run.fs.cat_file(name))
        for name in names
        if name.endswith(".json")
    ]
