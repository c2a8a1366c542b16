"""The replay stream, `<run>/stream/`: scored groups in immutable Zarr segments, ordered by a
gap-free commit log.

- `scored_group` (`ScoredGroup`) and `records` (`CommitRecord`, `Cursor`, `RolloutSums`): what
  is stored and how a position in the stream is named.
- `segments`: a segment's Zarr encoding; `writer` (`StreamWriter`: the layout and the write
  protocol) and `log` (the commit log); `reader` (`StreamReader`).
- `sweep` (orphaned segments), `retention` (segments the learner has consumed).
- `learner_progress`: the learner's position in the stream (`<run>/control/learner.json`),
  which generators pace themselves by.

Imports: `storage.fs`, `storage.control`, `storage.checkpoints` (a checkpoint's cursor decides
what retention keeps).
"""
