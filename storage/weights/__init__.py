"""The weight store, `<run>/weights/`: published policy versions, full or as deltas.

- `publish`: the write protocol and commit (stated once there); `files` (a rank's share as
  safetensors files), `shares`, `pieces`.
- `manifest`: `WeightManifest`, every tensor with its pieces and checksums.
- `versions`: the read side — versions, delta chains, building a version; `follower`: what a
  generator polls and loads. Generators import only the read side.
- `retention`: which versions are kept.

Imports: `storage.fs`, `storage.control` (fencing).
"""
