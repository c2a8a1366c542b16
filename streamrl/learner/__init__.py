"""The learner: consumes the replay stream, trains the policy (and VAPO's critic) with FSDP2,
publishes weights and checkpoints through `storage/`.

`batching` turns stream groups into filtered training batches and token-budget micro-batches.
"""
