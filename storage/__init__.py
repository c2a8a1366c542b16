"""Everything streamrl persists: run manifest, replay stream, weight store, checkpoints.

Built on fsspec (a local directory or s3://), zarr, numpy and safetensors. Knows nothing of
models, losses or Prefect; `streamrl` and `flows` depend on it, never the other way round.

Packages, bottom up: `fs` (a run's location on fsspec: a local directory or s3://) and `seaweedfs`
(a real S3 server for tests and the local stack); `control` (the run's control records); `weights`
(the weight store); `checkpoints`; `stream` (the replay stream). Each imports only those before it.
"""
