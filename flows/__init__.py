"""Prefect flows that start, supervise and stop streamrl's generators and learner.

Wiring, supervision and artifacts only: no math. The top of the layers: imports `streamrl` and
`storage`, and is the only package that imports Prefect.
"""
