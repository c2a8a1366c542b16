"""Prefect flows that start, supervise and stop streamrl's generators and learner.

Wiring, supervision and artifacts only: no math. Depends on `streamrl` and `storage`.
"""
