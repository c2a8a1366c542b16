"""Everything streamrl persists: run manifest, replay stream, weight store, checkpoints.

Built on fsspec (a local directory or s3://), zarr, numpy and safetensors. Knows nothing of
models, losses or Prefect; `streamrl` and `flows` depend on it, never the other way round.
"""
