"""Learner checkpoints, `<run>/checkpoints/step-<n>/`: DCP shards and the learner's state,
trusted only once COMMITTED names every file.

- `dcp`: save, load, verify and retain checkpoints (DCP; collectives across ranks).
- `record`: `CommittedRecord`, the COMMITTED marker: sizes, checksums, the writer's epoch.
- `writer`: a storage writer that hashes as it writes, so a save reads nothing back.
- `ranks`: sharing the hashing of a checkpoint's files between ranks on resume.

Imports: `storage.fs`, `storage.control` (fencing), `storage.weights` (its checksum).
"""
